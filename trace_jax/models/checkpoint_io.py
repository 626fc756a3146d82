"""Hugging Face safetensors import/export for the decoder params pytree.

`load_pretrained(path)` reads `config.json` plus `model.safetensors` or a sharded `model.safetensors.index.json`
with the `safetensors` package (no torch). Every parameter is built with `jax.make_array_from_callback`: each
device shard reads only its own rows/columns of each Hugging Face tensor from the file (bf16 through a memory
map), transposes them into our layout and casts them, so a host never holds two full copies of the model.
`save_pretrained` writes the Hugging Face layout back (per-expert MoE tensors, `[out, in]` linear weights) so
transformers, vLLM or SGLang can load it.

This module knows the Hugging Face tensor names; the decoder does not.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from trace_jax.models.config import ModelConfig
from trace_jax.models.decoder import param_logical_axes, param_shapes

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


class CheckpointError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape, or the directory layout is wrong (message names it)."""


# ---------------------------------------------------------------------------------------------------- name map
# Each entry: our param path, HF name template, and how one HF tensor maps to one (layer[, expert]) slice of ours.
def _to_ours(kind: str, config: ModelConfig) -> Callable[[np.ndarray], np.ndarray]:
    H, K, Dh, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
    return {
        "copy": lambda w: w,
        "T": lambda w: w.T,                                      # HF Linear [out, in] -> ours [in, out]
        "q": lambda w: w.T.reshape(D, H, Dh),
        "kv": lambda w: w.T.reshape(D, K, Dh),
        "o": lambda w: w.T.reshape(H, Dh, D),
        "qb": lambda w: w.reshape(H, Dh),
        "kvb": lambda w: w.reshape(K, Dh),
    }[kind]


def _to_hf(kind: str) -> Callable[[np.ndarray], np.ndarray]:
    return {
        "copy": lambda w: w,
        "T": lambda w: w.T,
        "q": lambda w: w.reshape(w.shape[0], -1).T,
        "kv": lambda w: w.reshape(w.shape[0], -1).T,
        "o": lambda w: w.reshape(-1, w.shape[-1]).T,
        "qb": lambda w: w.reshape(-1),
        "kvb": lambda w: w.reshape(-1),
    }[kind]


def hf_name_map(config: ModelConfig) -> list[tuple[tuple[str, ...], str, str]]:
    """(our param path, HF tensor name template with {layer}/{expert}, transform kind) for every parameter."""
    entries = [(("embed",), "model.embed_tokens.weight", "copy"), (("final_norm",), "model.norm.weight", "copy")]
    if not config.tie_word_embeddings:
        entries.append((("lm_head",), "lm_head.weight", "T"))
    pre = "model.layers.{layer}."
    entries += [
        (("layers", "input_norm"), pre + "input_layernorm.weight", "copy"),
        (("layers", "post_attn_norm"), pre + "post_attention_layernorm.weight", "copy"),
        (("layers", "attn", "q_proj"), pre + "self_attn.q_proj.weight", "q"),
        (("layers", "attn", "k_proj"), pre + "self_attn.k_proj.weight", "kv"),
        (("layers", "attn", "v_proj"), pre + "self_attn.v_proj.weight", "kv"),
        (("layers", "attn", "o_proj"), pre + "self_attn.o_proj.weight", "o"),
    ]
    if config.qk_norm:
        entries += [(("layers", "attn", "q_norm"), pre + "self_attn.q_norm.weight", "copy"),
                    (("layers", "attn", "k_norm"), pre + "self_attn.k_norm.weight", "copy")]
    if config.attention_bias:
        entries += [(("layers", "attn", "q_bias"), pre + "self_attn.q_proj.bias", "qb"),
                    (("layers", "attn", "k_bias"), pre + "self_attn.k_proj.bias", "kvb"),
                    (("layers", "attn", "v_bias"), pre + "self_attn.v_proj.bias", "kvb"),
                    (("layers", "attn", "o_bias"), pre + "self_attn.o_proj.bias", "copy")]
    if config.is_moe:
        ex = pre + "mlp.experts.{expert}."
        entries += [(("layers", "moe", "router"), pre + "mlp.gate.weight", "T"),
                    (("layers", "moe", "gate_proj"), ex + "gate_proj.weight", "T"),
                    (("layers", "moe", "up_proj"), ex + "up_proj.weight", "T"),
                    (("layers", "moe", "down_proj"), ex + "down_proj.weight", "T")]
    else:
        entries += [(("layers", "mlp", "gate_proj"), pre + "mlp.gate_proj.weight", "T"),
                    (("layers", "mlp", "up_proj"), pre + "mlp.up_proj.weight", "T"),
                    (("layers", "mlp", "down_proj"), pre + "mlp.down_proj.weight", "T")]
    return entries


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


# ---------------------------------------------------------------------------------------------------- reading
class _SafetensorsReader:
    """Lazy, name-addressed access to one or more safetensors files (memory-mapped; bf16 read via the header)."""

    def __init__(self, directory: str):
        index_path = os.path.join(directory, "model.safetensors.index.json")
        single_path = os.path.join(directory, "model.safetensors")
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            self.file_of = {name: os.path.join(directory, fname) for name, fname in weight_map.items()}
        elif os.path.exists(single_path):
            with safe_open(single_path, framework="numpy") as f:
                self.file_of = {name: single_path for name in f.keys()}
        else:
            raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json found")
        self._headers: dict[str, tuple[int, dict]] = {}

    def _header(self, path: str):
        if path not in self._headers:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._headers[path] = (8 + n, json.loads(f.read(n)))
        return self._headers[path]

    def meta(self, name: str):
        """(shape tuple, safetensors dtype string) of a tensor, or None when absent."""
        path = self.file_of.get(name)
        if path is None:
            return None
        _, header = self._header(path)
        if name not in header:
            raise CheckpointError(f"tensor {name!r} is listed in the index but missing from {path}")
        return tuple(header[name]["shape"]), header[name]["dtype"]

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The tensor, or only `index` (a tuple of slices) of it: only those bytes are read from the file."""
        path = self.file_of[name]
        offset, header = self._header(path)
        info = header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {info['dtype']} (supported: "
                                  f"{sorted(_ST_DTYPES)})")
        if info["dtype"] != "BF16":
            with safe_open(path, framework="numpy") as f:
                return f.get_tensor(name) if index is None else f.get_slice(name)[index]
        start, end = info["data_offsets"]
        mm = np.memmap(path, dtype=np.uint8, mode="r", offset=offset + start, shape=(end - start,))
        view = mm.view(_ST_DTYPES["BF16"]).reshape(info["shape"])
        return np.array(view if index is None else view[index])


def _check_tensors(config: ModelConfig, reader: _SafetensorsReader, directory: str):
    """Raise CheckpointError naming the first missing tensor or wrong shape, before any array is built."""
    H, K, Dh, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
    shapes = param_shapes(config)
    for path, template, kind in hf_name_map(config):
        ours = _get(shapes, path)
        per = ours[1:] if path[0] == "layers" else ours
        if "{expert}" in template:
            per = per[1:]
        expected = {"copy": per, "T": per[::-1], "q": (H * Dh, D), "kv": (K * Dh, D), "o": (D, H * Dh),
                    "qb": (H * Dh,), "kvb": (K * Dh,)}[kind]
        layers = range(config.num_hidden_layers) if "{layer}" in template else [None]
        experts = range(config.num_experts) if "{expert}" in template else [None]
        for layer in layers:
            for expert in experts:
                name = template.format(layer=layer, expert=expert)
                meta = reader.meta(name)
                if meta is None:
                    raise CheckpointError(f"{directory}: missing tensor {name!r} (expected shape "
                                          f"{tuple(expected)} for {config.model_type})")
                if tuple(meta[0]) != tuple(expected):
                    raise CheckpointError(f"{directory}: tensor {name!r} has shape {tuple(meta[0])}, expected "
                                          f"{tuple(expected)} from config.json")


def _span(sl: slice, n: int) -> tuple[int, int]:
    start, stop, step = sl.indices(n)
    assert step == 1, "device shards are contiguous"
    return start, stop


def _read_slice(config: ModelConfig, reader: _SafetensorsReader, name: str, kind: str, rest: tuple) -> np.ndarray:
    """rest (slices in our layout) of one HF tensor, reading only the HF rows/columns that slice needs."""
    Dh = config.head_dim
    if kind == "copy":
        return reader.read(name, rest)
    if kind == "T":
        return reader.read(name, rest[::-1]).T
    if kind in ("q", "kv"):  # ours [D, N, Dh] <- HF [N * Dh, D]
        n = config.num_attention_heads if kind == "q" else config.num_key_value_heads
        n0, n1 = _span(rest[1], n)
        w = reader.read(name, (slice(n0 * Dh, n1 * Dh), rest[0]))
        return w.T.reshape(w.shape[1], n1 - n0, Dh)[:, :, rest[2]]
    if kind == "o":  # ours [H, Dh, D] <- HF [D, H * Dh]
        h0, h1 = _span(rest[0], config.num_attention_heads)
        w = reader.read(name, (rest[2], slice(h0 * Dh, h1 * Dh)))
        return w.T.reshape(h1 - h0, Dh, w.shape[0])[:, rest[1], :]
    return _to_ours(kind, config)(reader.read(name))[rest]  # small bias vectors


def _callback_for(config, reader, path, template, kind, dtype):
    stacked = path[0] == "layers"
    per_expert = "{expert}" in template

    def read_one_slice(rest, layer=None, expert=None):
        return _read_slice(config, reader, template.format(layer=layer, expert=expert), kind, rest)

    def callback(index):
        index = tuple(index)
        if not stacked:
            return np.asarray(read_one_slice(index), dtype=dtype)
        layer_idx = range(config.num_hidden_layers)[index[0]]
        if per_expert:
            expert_idx = range(config.num_experts)[index[1]]
            rest = index[2:]
            block = [[read_one_slice(rest, l, e) for e in expert_idx] for l in layer_idx]
        else:
            rest = index[1:]
            block = [read_one_slice(rest, l) for l in layer_idx]
        return np.asarray(np.array(block), dtype=dtype)

    return callback


def load_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, mesh=None, rules=None,
                    config_overrides: dict | None = None) -> tuple[ModelConfig, dict]:
    """Load a Hugging Face checkpoint directory into `(config, params)`.

    Args:
      path: directory with config.json and model.safetensors (or model.safetensors.index.json + shards).
      dtype: storage dtype of the loaded params (also recorded as config.param_dtype).
      mesh: optional `jax.sharding.Mesh`; params are placed with `NamedSharding`s derived from the logical axes
        and `rules` (default `sharding.DEFAULT_RULES`). Without a mesh everything goes to the first device.
      config_overrides: extra `ModelConfig` fields (e.g. dtype="bfloat16", remat="full").

    Raises `ConfigError` (unsupported architecture/field) or `CheckpointError` (missing tensor, wrong shape).
    """
    from trace_jax.models.sharding import logical_to_sharding  # local: sharding imports nothing from here

    directory = os.fspath(path)
    dtype = jnp.dtype(dtype)
    overrides = {"param_dtype": dtype.name, **(config_overrides or {})}
    config = ModelConfig.from_hf(directory, **overrides)
    reader = _SafetensorsReader(directory)
    _check_tensors(config, reader, directory)
    shapes = param_shapes(config)
    if mesh is not None:
        shardings = logical_to_sharding(param_logical_axes(config), mesh, rules, shapes=shapes)
    params: dict = {}
    for ppath, template, kind in hf_name_map(config):
        shape = _get(shapes, ppath)
        sharding = _get(shardings, ppath) if mesh is not None else SingleDeviceSharding(jax.devices()[0])
        array = jax.make_array_from_callback(shape, sharding, _callback_for(config, reader, ppath, template, kind,
                                                                            dtype))
        _set(params, ppath, array)
    return config, params


# ---------------------------------------------------------------------------------------------------- writing
def _hf_tensors(config: ModelConfig, params: dict, dtype) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy array) pairs, one parameter gathered to host at a time."""
    for path, template, kind in hf_name_map(config):
        to_hf = _to_hf(kind)
        host = np.asarray(jax.device_get(_get(params, path)))
        if dtype is not None:
            host = host.astype(dtype)
        if path[0] != "layers":
            yield template, np.ascontiguousarray(to_hf(host))
            continue
        for layer in range(config.num_hidden_layers):
            if "{expert}" in template:
                for expert in range(config.num_experts):
                    yield (template.format(layer=layer, expert=expert),
                           np.ascontiguousarray(to_hf(host[layer, expert])))
            else:
                yield template.format(layer=layer), np.ascontiguousarray(to_hf(host[layer]))


def save_pretrained(path: str | os.PathLike, config: ModelConfig, params: dict, *, dtype=None,
                    max_shard_bytes: int = 4 * 1024**3) -> None:
    """Write `config.json` and `model.safetensors` (or numbered shards + `model.safetensors.index.json` when the
    model exceeds `max_shard_bytes`) in the Hugging Face layout. `dtype` casts on the way out (default: as stored).
    Only process 0 should call this in a multi-host run.
    """
    directory = os.fspath(path)
    os.makedirs(directory, exist_ok=True)
    for stale in os.listdir(directory):  # an old index would shadow a new single-file checkpoint
        if stale.startswith("model") and ".safetensors" in stale:
            os.remove(os.path.join(directory, stale))
    out_dtype = None if dtype is None else jnp.dtype(dtype)
    stored = out_dtype or jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype)
    hf_config = config.to_hf_dict()
    hf_config["dtype"] = stored.name
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    # Shards are written as soon as they fill, so the host holds at most one shard plus one parameter.
    metadata = {"format": "pt"}
    partial_files: list[tuple[str, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    shard_bytes = total_bytes = 0

    def flush():
        nonlocal shard, shard_bytes
        fname = f"model-{len(partial_files) + 1:05d}.safetensors.partial"
        save_file(shard, os.path.join(directory, fname), metadata=metadata)
        partial_files.append((fname, list(shard)))
        shard, shard_bytes = {}, 0

    for name, array in _hf_tensors(config, params, out_dtype):
        if shard and shard_bytes + array.nbytes > max_shard_bytes:
            flush()
        shard[name] = array
        shard_bytes += array.nbytes
        total_bytes += array.nbytes
    flush()
    if len(partial_files) == 1:
        os.replace(os.path.join(directory, partial_files[0][0]), os.path.join(directory, "model.safetensors"))
        return
    weight_map = {}
    for i, (partial, names) in enumerate(partial_files):
        fname = f"model-{i + 1:05d}-of-{len(partial_files):05d}.safetensors"
        os.replace(os.path.join(directory, partial), os.path.join(directory, fname))
        weight_map.update({name: fname for name in names})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(total_bytes)}, "weight_map": weight_map}, f, indent=2)
