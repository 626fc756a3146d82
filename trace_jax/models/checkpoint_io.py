"""Hugging Face safetensors import/export for the decoder params pytree.

`load_pretrained(path)` reads `config.json` plus `model.safetensors` or a sharded `model.safetensors.index.json`
with the `safetensors` package (no torch). Every parameter is built with `jax.make_array_from_callback`: each
device shard reads only its own rows/columns of each Hugging Face tensor from the file (bf16 through a memory
map), transposes them into our layout and casts them, so a host never holds two full copies of the model.
`save_pretrained` writes the Hugging Face layout back (per-expert MoE tensors, `[out, in]` linear weights) so
transformers, vLLM or SGLang can load it, atomically: a crash never destroys the previous export.

Files are distrusted before any tensor is read: an index may only name shards inside its directory, and every
safetensors header is checked (its length against the file, each tensor's `data_offsets` inside the data, in order,
not overlapping and exactly dtype x shape bytes), with errors naming the file and the tensor.

This module knows the Hugging Face tensor names; the decoder does not.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import struct
import sys
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
# Bytes per element of every safetensors dtype (the format's own list), to check each tensor's byte range.
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def _shard_path(directory: str, index_path: str, fname) -> str:
    """The path of a shard the index names, which must be a relative path inside `directory`."""
    if not isinstance(fname, str) or not fname or "\0" in fname:
        raise CheckpointError(f"{index_path}: weight_map names the file {fname!r}; expected a file name such as "
                              "'model-00001-of-00002.safetensors'")
    parts = fname.replace("\\", "/").split("/")
    if os.path.isabs(fname) or fname.startswith(("/", "\\")) or ".." in parts:
        raise CheckpointError(f"{index_path}: weight_map names the file {fname!r}, which is outside the checkpoint "
                              "directory (absolute or with '..'); shards must be files inside it")
    return os.path.join(directory, fname)


def _read_header(path: str) -> tuple[int, dict]:
    """(offset of the data, tensor entries) of a safetensors file, after checking the header length against the
    file, and every tensor's dtype, shape and `data_offsets` (inside the data, in order, not overlapping, exactly
    dtype x shape bytes). Raises CheckpointError naming the file and the tensor."""
    try:
        size = os.path.getsize(path)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read the safetensors file ({error.strerror or error})") from None
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (8-byte header length "
                                  "first); the file is truncated")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes) or the "
                                  f"{_MAX_HEADER_BYTES}-byte limit; the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as error:
            raise CheckpointError(f"{path}: the header is not UTF-8 JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is {type(header).__name__}, expected a JSON object")
    data_bytes = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise CheckpointError(f"{where}: expected an entry with dtype, shape and data_offsets, got {info!r}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _ST_ITEMSIZE:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r} (safetensors dtypes: {sorted(_ST_ITEMSIZE)})")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} is not a pair of integers [start, end]")
        start, end = offsets
        if not 0 <= start <= end <= data_bytes:
            raise CheckpointError(f"{where}: data_offsets [{start}, {end}] is not an ordered range inside the "
                                  f"file's {data_bytes} data bytes; the file is truncated or damaged")
        expected = math.prod(shape) * _ST_ITEMSIZE[dtype]
        if end - start != expected:
            raise CheckpointError(f"{where}: data_offsets [{start}, {end}] hold {end - start} bytes, but {dtype} x "
                                  f"{tuple(shape)} needs {expected}")
        spans.append((start, end, name))
    spans.sort()
    for (_, previous_end, previous), (start, _, name) in zip(spans, spans[1:]):
        if start < previous_end:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets start at {start}, inside tensor "
                                  f"{previous!r} (which ends at {previous_end}); tensors must not overlap")
    return 8 + n, {name: info for name, info in header.items() if name != "__metadata__"}


class _SafetensorsReader:
    """Lazy, name-addressed access to one or more safetensors files (memory-mapped; bf16 read via the header).

    Every header is checked when first read (`_read_header`), and the index's file names must stay inside the
    directory, before any tensor byte is read."""

    def __init__(self, directory: str):
        index_path = os.path.join(directory, "model.safetensors.index.json")
        single_path = os.path.join(directory, "model.safetensors")
        self._headers: dict[str, tuple[int, dict]] = {}
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index_path}: not an index with a 'weight_map' ({error!r})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: 'weight_map' is {type(weight_map).__name__}, expected an "
                                      "object of tensor name -> file name")
            self.file_of = {name: _shard_path(directory, index_path, fname) for name, fname in weight_map.items()}
        elif os.path.exists(single_path):
            self.file_of = {name: single_path for name in self._header(single_path)[1]}
        else:
            raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json found")

    def _header(self, path: str):
        if path not in self._headers:
            self._headers[path] = _read_header(path)
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

    Atomic: everything is written into a hidden sibling directory (`.NAME.tmp-PID-XXXX`) that replaces `path` only
    once complete, so a crash at any point leaves the previous export as it was. The previous directory's other
    files (a tokenizer, a README) are carried over; its model files are not, so no stale shard or index remains.
    The replacement is one `renameat2(RENAME_EXCHANGE)` on Linux; elsewhere two renames, and a crash between them
    leaves the previous export at `.NAME.old-PID-XXXX`.
    """
    directory = os.path.realpath(os.fspath(path))  # through a symlink: the directory it names is replaced
    parent, name = os.path.split(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} exists and is not a directory; save_pretrained writes a directory")
    os.makedirs(parent, exist_ok=True)
    _remove_dead_staging(parent, name)
    staging = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(staging)  # not mkdtemp: the export gets the umask's permissions, not 0700
    try:
        _write_model_files(staging, config, params, dtype, max_shard_bytes)
        if not os.path.isdir(directory):
            os.rename(staging, directory)
            return
        for entry in os.listdir(directory):
            if not _is_model_file(entry):
                _link_or_copy(os.path.join(directory, entry), os.path.join(staging, entry))
        _replace_directory(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _is_model_file(entry: str) -> bool:
    """A file `save_pretrained` writes (replaced, never carried over from a previous export)."""
    return entry == "config.json" or (entry.startswith("model") and ".safetensors" in entry)


def _remove_dead_staging(parent: str, name: str) -> None:
    """Delete staging directories of earlier `save_pretrained` calls on `name` whose process is gone (killed
    mid-write)."""
    prefix = f".{name}.tmp-"
    for entry in os.listdir(parent):
        pid = entry[len(prefix):].split("-")[0] if entry.startswith(prefix) else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _link_or_copy(source: str, target: str) -> None:
    """Carry a file or directory over into the new export: hard links where the file system allows, else copies."""
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    if os.path.isdir(source) and not os.path.islink(source):
        shutil.copytree(source, target, symlinks=True, copy_function=link)
    elif os.path.islink(source):
        os.symlink(os.readlink(source), target)
    else:
        link(source, target)


def _replace_directory(new: str, old: str) -> None:
    """Put directory `new` at path `old`, atomically where the OS can exchange two paths, and delete the old one."""
    if _exchange(new, old):
        shutil.rmtree(new)  # `new` now names the previous directory
        return
    aside = os.path.join(os.path.dirname(old), f".{os.path.basename(old)}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(old, aside)
    os.rename(new, old)
    shutil.rmtree(aside)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where the OS or file system can't."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, or another libc
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _write_model_files(directory: str, config: ModelConfig, params: dict, dtype, max_shard_bytes: int) -> None:
    """`config.json` and the safetensors file(s) into an empty `directory`; the host holds at most one shard plus
    one parameter."""
    out_dtype = None if dtype is None else jnp.dtype(dtype)
    stored = out_dtype or jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype)
    hf_config = config.to_hf_dict()
    hf_config["dtype"] = stored.name
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    metadata = {"format": "pt"}
    shard_names: list[list[str]] = []
    shard: dict[str, np.ndarray] = {}
    shard_bytes = total_bytes = 0

    def flush():
        nonlocal shard, shard_bytes
        save_file(shard, os.path.join(directory, f"model-{len(shard_names) + 1:05d}.safetensors.partial"),
                  metadata=metadata)
        shard_names.append(list(shard))
        shard, shard_bytes = {}, 0

    for name, array in _hf_tensors(config, params, out_dtype):
        if shard and shard_bytes + array.nbytes > max_shard_bytes:
            flush()
        shard[name] = array
        shard_bytes += array.nbytes
        total_bytes += array.nbytes
    flush()
    if len(shard_names) == 1:
        os.replace(os.path.join(directory, "model-00001.safetensors.partial"),
                   os.path.join(directory, "model.safetensors"))
        return
    weight_map = {}
    for i, names in enumerate(shard_names):
        fname = f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors"
        os.replace(os.path.join(directory, f"model-{i + 1:05d}.safetensors.partial"), os.path.join(directory, fname))
        weight_map.update({name: fname for name in names})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(total_bytes)}, "weight_map": weight_map}, f, indent=2)
