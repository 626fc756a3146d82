"""Model configuration: one frozen, hashable dataclass for every supported decoder.

`ModelConfig` describes a Qwen3 dense, Qwen3-MoE or Llama-family (SmolLM2, Llama 3) decoder. It validates itself
on construction and is used as a *static* argument of jitted functions, so it must stay hashable (tuples, not
lists). `ModelConfig.from_hf` reads a Hugging Face `config.json`; `ModelConfig.to_hf_dict` writes one back.
`ModelConfig.with_rope_parameters` applies a Hugging Face `rope_parameters` / `rope_scaling` dict (e.g. the YaRN
block of Qwen3's model cards) to a config read elsewhere.

This module knows nothing about parameters, checkpoints or meshes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")
_ARCHITECTURE_TO_MODEL_TYPE = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}
_MODEL_TYPE_TO_ARCHITECTURE = {v: k for k, v in _ARCHITECTURE_TO_MODEL_TYPE.items()}
_DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ROPE_TYPES = ("default", "llama3", "yarn")  # see trace_jax.models.decoder.rope_tables
ATTENTION_IMPLS = ("auto", "xla", "dense", "cudnn", "pallas_tpu")  # see trace_jax.models.attention
MOE_DISPATCHES = ("auto", "sort", "all_to_all")  # see trace_jax.models.expert_parallel


class ConfigError(ValueError):
    """A model configuration field is missing, unsupported or inconsistent (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer.

    Attributes mirror Hugging Face names where one exists. Shapes used throughout `trace_jax.models`:
    `D = hidden_size`, `H = num_attention_heads`, `K = num_key_value_heads`, `Dh = head_dim`,
    `F = intermediate_size` (dense MLP), `Fe = moe_intermediate_size`, `E = num_experts`, `V = vocab_size`.

    `dtype` is the compute dtype (activations, matmul inputs); `param_dtype` is the default storage dtype of
    `init_params`. Attention softmax, RMSNorm statistics, router softmax and log-softmax always run in float32.
    `remat` is the rematerialisation policy of one decoder layer: "none", "full" (save nothing), "dots" (save
    matmul outputs) or "dots_no_batch" (save matmuls without batch dims, MaxText's default).
    `attention_impl`: "auto" (the platform kernel on GPU/TPU where it covers the mask, else "xla"), "xla" (tiled
    kernel with a flash-style backward), "dense" (the reference), "cudnn", "pallas_tpu"; see
    `trace_jax.models.attention` and docs/models.md. `attention_q_block` / `attention_k_block`: tile sizes of the
    tiled kernels (q: 0 = `attention_query_chunk` if set, else automatic by head width). `attention_query_chunk`:
    when > 0, the query tile of the tiled kernels and the query block of the dense path (score memory
    O(chunk * keys)); 0 = automatic.
    `moe_dispatch`: "sort" (global sort of assignments by expert, partitioned by GSPMD), "all_to_all" (tokens
    travel to their experts' shards over the `expert` mesh axis) or "auto" (all_to_all when the mesh set with
    `jax.set_mesh` has an `expert` axis > 1 dividing `num_experts`); `moe_capacity_factor`: rows the all_to_all
    dispatch reserves per destination shard, as a multiple of a balanced share (0 = dropless). See
    `trace_jax.models.expert_parallel`.
    `scan_unroll`: unroll the scans over layers and log-prob chunks (same values). Only for ahead-of-time cost
    analysis, which counts a loop body once (`trace-jax plan`'s step-time variants); never for running.

    Rotary embeddings (`rope_*`, Hugging Face's `rope_parameters` keys in brackets): `rope_type` "default",
    "llama3" (Llama 3.1 frequency bands: `rope_scaling_factor` [factor], `rope_low_freq_factor`,
    `rope_high_freq_factor`, `rope_original_max_position` [original_max_position_embeddings]) or "yarn" (YaRN,
    arXiv:2309.00071, as transformers' `_compute_yarn_parameters`: `rope_scaling_factor` [factor],
    `rope_original_max_position`, `rope_beta_fast`, `rope_beta_slow`, `rope_truncate` [truncate] shape the
    interpolation ramp; cos/sin are multiplied by `rope_attention_factor` [attention_factor], 0 = derived from the
    factor and `rope_mscale` / `rope_mscale_all_dim` [mscale, mscale_all_dim], 0 = unset).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0  # 0 = derived (yarn)
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    # Mixture of experts (num_experts == 0 means dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss the trainer adds (Hugging Face default)
    moe_dispatch: str = "auto"
    moe_capacity_factor: float = 0.0  # 0 = dropless; only the all_to_all dispatch can drop
    # Token ids carried through to config.json (not used by the math).
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Numerics and compilation.
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention_query_chunk: int = 0
    attention_impl: str = "auto"
    attention_q_block: int = 0
    attention_k_block: int = 128
    scan_unroll: bool = False

    def __post_init__(self):
        def need(cond, field, msg):
            if not cond:
                raise ConfigError(f"ModelConfig.{field}: {msg}")

        need(self.model_type in SUPPORTED_MODEL_TYPES, "model_type",
             f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, name, f"must be a positive int, got {value!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"num_attention_heads={self.num_attention_heads} must be a multiple of "
             f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)")
        need(self.head_dim % 2 == 0, "head_dim", f"must be even for rotary embeddings, got {self.head_dim}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        need(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        need(self.rope_type in ROPE_TYPES, "rope_type",
             f"unsupported rope type {self.rope_type!r}; supported: {', '.join(map(repr, ROPE_TYPES))}")
        if self.rope_type == "llama3":
            need(self.rope_scaling_factor > 0, "rope_scaling_factor", "must be > 0 for llama3 rope")
            need(self.rope_high_freq_factor > self.rope_low_freq_factor, "rope_high_freq_factor",
                 "must exceed rope_low_freq_factor for llama3 rope")
        if self.rope_type == "yarn":
            need(self.rope_scaling_factor >= 1, "rope_scaling_factor",
                 f"must be >= 1 for yarn rope (target context / original context), got {self.rope_scaling_factor}")
            need(isinstance(self.rope_original_max_position, int) and self.rope_original_max_position > 0,
                 "rope_original_max_position", "must be a positive int for yarn rope (the pretraining context, e.g. "
                 f"32768 for Qwen3), got {self.rope_original_max_position!r}")
            need(self.rope_beta_fast > 0 and self.rope_beta_slow > 0, "rope_beta_fast",
                 f"rope_beta_fast and rope_beta_slow must be > 0, got {self.rope_beta_fast}, {self.rope_beta_slow}")
            need(self.rope_beta_fast >= self.rope_beta_slow, "rope_beta_fast",
                 f"must be >= rope_beta_slow (rotations bounding the ramp), got {self.rope_beta_fast} < "
                 f"{self.rope_beta_slow}")
            for name in ("rope_attention_factor", "rope_mscale", "rope_mscale_all_dim"):
                need(getattr(self, name) >= 0, name, f"must be >= 0 (0 = unset), got {getattr(self, name)}")
            need(isinstance(self.rope_truncate, bool), "rope_truncate", f"must be a bool, got {self.rope_truncate!r}")
        need(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        need(self.param_dtype in _DTYPES, "param_dtype", f"must be one of {_DTYPES}, got {self.param_dtype!r}")
        need(self.remat in REMAT_POLICIES, "remat", f"must be one of {REMAT_POLICIES}, got {self.remat!r}")
        need(self.attention_query_chunk >= 0, "attention_query_chunk", "must be >= 0 (0 = automatic)")
        need(self.attention_impl in ATTENTION_IMPLS, "attention_impl",
             f"must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        need(self.attention_q_block >= 0, "attention_q_block", "must be >= 0 (0 = automatic)")
        need(isinstance(self.scan_unroll, bool), "scan_unroll", f"must be a bool, got {self.scan_unroll!r}")
        need(self.attention_k_block > 0, "attention_k_block", f"must be > 0, got {self.attention_k_block}")
        need(self.router_aux_loss_coef >= 0, "router_aux_loss_coef", f"must be >= 0, got {self.router_aux_loss_coef}")
        need(self.moe_dispatch in MOE_DISPATCHES, "moe_dispatch",
             f"must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}")
        need(self.moe_capacity_factor >= 0, "moe_capacity_factor",
             f"must be >= 0 (0 = dropless), got {self.moe_capacity_factor}")
        need(not (self.moe_dispatch == "sort" and self.moe_capacity_factor > 0), "moe_capacity_factor",
             f"is {self.moe_capacity_factor} but moe_dispatch='sort' is always dropless; set it to 0 or use "
             "moe_dispatch='all_to_all' / 'auto'")
        need(isinstance(self.mlp_only_layers, tuple), "mlp_only_layers",
             "must be a tuple (the config is hashed as a static jit argument)")
        if self.model_type == "qwen3_moe":
            need(self.num_experts > 0, "num_experts", "qwen3_moe needs num_experts > 0")
            need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 f"must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0 for qwen3_moe")
            # Layers are stacked and scanned, so every layer must have the same kind of MLP.
            need(self.decoder_sparse_step == 1, "decoder_sparse_step",
                 f"only 1 (every layer sparse) is supported, got {self.decoder_sparse_step}")
            need(self.mlp_only_layers == (), "mlp_only_layers",
                 f"mixed dense/sparse layers are not supported, got {self.mlp_only_layers}")
        else:
            need(self.num_experts == 0, "num_experts", f"model_type {self.model_type!r} is dense; set num_experts=0")

    # ------------------------------------------------------------------ derived
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_query_groups(self) -> int:
        """Query heads per key/value head (GQA ratio)."""
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Total parameter count (embedding counted once when tied)."""
        d, h, k, dh = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * h * dh * 2 + d * k * dh * 2 + (2 * dh if self.qk_norm else 0)
        if self.attention_bias:
            attn += (h + 2 * k) * dh + d
        if self.is_moe:
            mlp = d * self.num_experts + 3 * self.num_experts * d * self.moe_intermediate_size
        else:
            mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + d

    # ------------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], **overrides) -> "ModelConfig":
        """Build a config from a Hugging Face `config.json` (a path to the file or its directory, or a dict).

        `overrides` set our own fields (e.g. `dtype="bfloat16"`, `remat="full"`). Raises `ConfigError` naming the
        field for unsupported architectures, activations, rope types or sliding-window attention.
        """
        if isinstance(path_or_dict, Mapping):
            hf = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                hf = json.load(f)

        architectures = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if architectures:
            arch = architectures[0]
            if arch not in _ARCHITECTURE_TO_MODEL_TYPE:
                raise ConfigError(f"config.json field 'architectures': unsupported architecture {arch!r}; "
                                  f"supported: {sorted(_ARCHITECTURE_TO_MODEL_TYPE)}")
            model_type = _ARCHITECTURE_TO_MODEL_TYPE[arch]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config.json field 'model_type': unsupported model_type {model_type!r}; "
                              f"supported: {SUPPORTED_MODEL_TYPES}")

        def field(name, default=None, required=False):
            if name not in hf or hf[name] is None:
                if required:
                    raise ConfigError(f"config.json field {name!r} is missing (needed for {model_type})")
                return default
            return hf[name]

        act = field("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json field 'hidden_act': only 'silu' is supported, got {act!r}")
        if field("use_sliding_window", False):
            raise ConfigError("config.json field 'use_sliding_window': sliding-window attention is not supported")
        if field("mlp_bias", False):
            raise ConfigError("config.json field 'mlp_bias': MLP biases are not supported")

        hidden = int(field("hidden_size", required=True))
        heads = int(field("num_attention_heads", required=True))
        rope = dict(field("rope_parameters", None) or field("rope_scaling", None) or {})
        rope_theta = float(rope.get("rope_theta", field("rope_theta", 10000.0)))
        max_position = int(field("max_position_embeddings", 32768))
        rope_kwargs = _rope_fields(rope, max_position, "config.json field 'rope_parameters'")
        eos = field("eos_token_id")
        kwargs = dict(
            model_type=model_type,
            vocab_size=int(field("vocab_size", required=True)),
            hidden_size=hidden,
            intermediate_size=int(field("intermediate_size", required=True)),
            num_hidden_layers=int(field("num_hidden_layers", required=True)),
            num_attention_heads=heads,
            num_key_value_heads=int(field("num_key_value_heads", heads)),
            head_dim=int(field("head_dim", hidden // heads)),
            rms_norm_eps=float(field("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            **rope_kwargs,
            max_position_embeddings=max_position,
            tie_word_embeddings=bool(field("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            attention_bias=bool(field("attention_bias", False)),
            bos_token_id=field("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=field("pad_token_id"),
        )
        if model_type == "qwen3_moe":
            kwargs.update(
                num_experts=int(field("num_experts", None) or field("num_local_experts", required=True)),
                num_experts_per_tok=int(field("num_experts_per_tok", required=True)),
                moe_intermediate_size=int(field("moe_intermediate_size", required=True)),
                norm_topk_prob=bool(field("norm_topk_prob", False)),
                decoder_sparse_step=int(field("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(field("mlp_only_layers", ()) or ()),
                router_aux_loss_coef=float(field("router_aux_loss_coef", 0.001)),
            )
        kwargs.update(overrides)
        return cls(**kwargs)

    def with_rope_parameters(self, rope_parameters: Mapping[str, Any], *, what: str = "rope_parameters"
                             ) -> "ModelConfig":
        """This config with its rotary embedding replaced by a Hugging Face `rope_parameters` (or older
        `rope_scaling`) dict, e.g. Qwen3's model-card YaRN block `{"rope_type": "yarn", "factor": 1.5,
        "original_max_position_embeddings": 32768}`; `rope_theta` is kept unless the dict sets it.

        For "yarn" and "llama3", `max_position_embeddings` becomes `original_max_position_embeddings * factor`, the
        extended context the factor was chosen for (what transformers checks the factor against). `what` names the
        dict's source in errors (`ConfigError`).
        """
        rope = dict(rope_parameters)
        changes = _rope_fields(rope, self.max_position_embeddings, what)
        if "rope_theta" in rope:
            changes["rope_theta"] = float(rope["rope_theta"])
        if changes["rope_type"] in ("yarn", "llama3"):
            changes["max_position_embeddings"] = int(round(changes["rope_original_max_position"]
                                                           * changes["rope_scaling_factor"]))
        return self.replace(**changes)

    def rope_parameters(self) -> dict[str, Any]:
        """The Hugging Face (transformers 5) `rope_parameters` dict of this config."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": self.rope_type}
        if self.rope_type == "llama3":
            rope.update(factor=self.rope_scaling_factor, low_freq_factor=self.rope_low_freq_factor,
                        high_freq_factor=self.rope_high_freq_factor,
                        original_max_position_embeddings=self.rope_original_max_position)
        elif self.rope_type == "yarn":
            rope.update(factor=self.rope_scaling_factor,
                        original_max_position_embeddings=self.rope_original_max_position,
                        beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow, truncate=self.rope_truncate)
            for key, value in (("attention_factor", self.rope_attention_factor), ("mscale", self.rope_mscale),
                               ("mscale_all_dim", self.rope_mscale_all_dim)):
                if value:  # 0 = unset: transformers derives it
                    rope[key] = value
        return rope

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` contents for this config (transformers 5 layout)."""
        rope = self.rope_parameters()
        out: dict[str, Any] = {
            "architectures": [_MODEL_TYPE_TO_ARCHITECTURE[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.rope_type != "default":  # rope_theta lives in rope_parameters, as transformers 5 writes it
            out.pop("rope_theta")
        if self.model_type == "llama":
            out["mlp_bias"] = False
        else:
            out["use_sliding_window"] = False
            out["sliding_window"] = None
        if self.model_type == "qwen3_moe":
            out.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                       num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                       output_router_logits=False, router_aux_loss_coef=self.router_aux_loss_coef)
        return out


_YARN_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                        "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate",
                        "partial_rotary_factor"})


def _rope_fields(rope: dict[str, Any], max_position_embeddings: int, what: str) -> dict[str, Any]:
    """`ModelConfig` rope fields (all but `rope_theta`) from a Hugging Face rope dict; `what` names it in errors.

    Missing values follow transformers (`standardize_rope_params`, `_compute_yarn_parameters`): YaRN's
    `original_max_position_embeddings` defaults to `max_position_embeddings`, a null `factor` to their ratio, a
    null or 0 `beta_fast` / `beta_slow` to 32 / 1, `truncate` to true.
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{what}.rope_type: unsupported {rope_type!r}; supported: "
                          f"{', '.join(map(repr, ROPE_TYPES))}")
    if float(rope.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConfigError(f"{what}.partial_rotary_factor: only 1.0 (rotary over the whole head) is supported, got "
                          f"{rope['partial_rotary_factor']!r}")
    out: dict[str, Any] = {"rope_type": rope_type}
    if rope_type == "llama3":
        if rope.get("factor") is None:
            raise ConfigError(f"{what}.factor is missing (needed for llama3 rope)")
        out.update(rope_scaling_factor=float(rope["factor"]),
                   rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                   rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)))
    elif rope_type == "yarn":
        unknown = sorted(set(rope) - _YARN_KEYS)
        if unknown:
            raise ConfigError(f"{what}: unknown yarn keys {unknown}; known: {sorted(_YARN_KEYS - {'type'})}")
        if "factor" not in rope:
            raise ConfigError(f"{what}.factor is missing (needed for yarn rope: the target context divided by "
                              "original_max_position_embeddings, e.g. 1.5 for 48K on Qwen3's 32K)")
        original = rope.get("original_max_position_embeddings") or max_position_embeddings
        factor = rope["factor"] if rope["factor"] is not None else max_position_embeddings / original
        for key in ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            value = factor if key == "factor" else rope.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{what}.{key} must be a number, got {value!r}")
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ConfigError(f"{what}.truncate must be true or false, got {truncate!r}")
        out.update(rope_scaling_factor=float(factor), rope_original_max_position=int(original),
                   rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                   rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                   rope_attention_factor=float(rope.get("attention_factor") or 0.0),
                   rope_mscale=float(rope.get("mscale") or 0.0),
                   rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                   rope_truncate=truncate)
    return out
