"""Frozen, self-validating config dataclasses of the training core: loss, optimizer, mesh and checkpoints.

One dataclass per concern; each checks its own fields in `__post_init__` and raises `TrainConfigError` naming the
field and the fix. They are plain dataclasses (hashable, usable as static jit arguments); gin registration is the
loop's business (`gin.external_configurable`), so this module does not import gin.

This module knows nothing about arrays or the training loop; it reads the logical-axis names of the sharding rules
from `trace_jax.models.sharding` (imported when a `MeshConfig` is built).
"""

from __future__ import annotations

import dataclasses
import math

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant")
RATIO_LEVELS = ("token", "sequence")
TIS_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_MODES = ("rl", "sft")
SCHEDULES = ("constant", "cosine", "linear")
MESH_AXES = ("data", "fsdp", "tensor", "expert")


class TrainConfigError(ValueError):
    """A training config field has an illegal value; the message names the field and the fix."""


def _need(cond: bool, owner: str, field: str, message: str) -> None:
    if not cond:
        raise TrainConfigError(f"{owner}.{field}: {message}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the policy update optimises (see `trace_jax.train.loss` for the formulas).

    Attributes:
      eps_low, eps_high: asymmetric clip range of the importance ratio, `[1 - eps_low, 1 + eps_high]`
        (DAPO's clip-higher defaults 0.2 / 0.28; GSPO uses ~3e-4 / 4e-4 with sequence ratios).
      dual_clip: None, or `c > 1`: for negative advantages the per-token loss is capped at `-c * A` (dual-clip PPO).
      ratio_level: "token" (GRPO, TRACE, ABC-GRPO) or "sequence" (GSPO's length-normalised sequence ratio,
        clipped per sequence).
      aggregation: how per-token losses become one scalar, as (sum, count): "token-mean", "seq-mean-token-mean",
        "seq-mean-token-sum" or "constant" (Dr.GRPO: sum over tokens / (rows * constant_normaliser)).
      constant_normaliser: tokens per row in the "constant" mode's denominator; None = the padded length L.
      kl_estimator: "k1", "k2" or "k3" (Schulman's estimators of KL(pi || pi_ref)); used when kl_coef > 0.
      kl_coef: weight of the KL penalty (0 by default, as in the paper; then no reference log-probs are needed).
      kl_clamp: per-token KL estimates are clipped to `[-kl_clamp, kl_clamp]`; None = no clamp.
      entropy_coef: weight of the entropy bonus (subtracted from the loss).
      entropy_metric: compute the policy entropy for the metrics even when entropy_coef == 0 (costs one more
        exp over each logits chunk).
      micro_batches: the batch is split into this many micro-batches accumulated under `lax.scan`; rows must divide.
      mode: "rl" (clipped surrogate on advantages) or "sft" (weighted negative log-likelihood; the batch's
        `advantages` hold the per-token weights).
      router_aux: add the MoE load-balancing loss times the model's `router_aux_loss_coef` (no-op for dense models).
      logprob_chunk: sequence chunk of the chunked log-softmax; None (default) sizes it so that one chunk's
        float32 logits on one device stay within `logits_chunk_bytes` (at least 64 tokens, at most the length).
      logits_chunk_bytes: the per-device budget of one logits chunk when `logprob_chunk` is None.
      tis: rollout correction by truncated importance sampling between the sampler's and the trainer's log-probs
        of the same tokens (verl's and Tunix's TIS): None (off), "token" (`w_t = min(pi_old(y_t) / pi_sampler(y_t),
        tis_cap)`) or "sequence" (`w_i = min(prod_t pi_old(y_it) / pi_sampler(y_it), tis_cap)`, one weight per
        row). The policy-gradient term of each token is multiplied by its weight. With it the pipeline recomputes
        `pi_old` with the trainer before the step's first update (one more forward pass), so the clipped ratio is
        `pi / pi_old(trainer)` and the weight carries the sampler/trainer mismatch (rl mode only).
      tis_cap: the truncation `C >= 1` of the TIS weights.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    ratio_level: str = "token"
    aggregation: str = "token-mean"
    constant_normaliser: int | None = None
    kl_estimator: str = "k3"
    kl_coef: float = 0.0
    kl_clamp: float | None = 10.0
    entropy_coef: float = 0.0
    entropy_metric: bool = True
    micro_batches: int = 1
    mode: str = "rl"
    router_aux: bool = True
    logprob_chunk: int | None = None
    logits_chunk_bytes: int = 256 * 1024**2
    tis: str | None = None
    tis_cap: float = 2.0

    def __post_init__(self):
        o = "LossConfig"
        _need(0 <= self.eps_low < 1, o, "eps_low", f"must be in [0, 1), got {self.eps_low!r}")
        _need(self.eps_high >= 0, o, "eps_high", f"must be >= 0, got {self.eps_high!r}")
        _need(self.dual_clip is None or self.dual_clip > 1, o, "dual_clip",
              f"must be None or > 1 (it caps the loss at -c * A for A < 0), got {self.dual_clip!r}")
        _need(self.ratio_level in RATIO_LEVELS, o, "ratio_level", f"must be one of {RATIO_LEVELS}, got "
              f"{self.ratio_level!r}")
        _need(self.aggregation in AGGREGATIONS, o, "aggregation", f"must be one of {AGGREGATIONS}, got "
              f"{self.aggregation!r}")
        _need(self.constant_normaliser is None or self.constant_normaliser > 0, o, "constant_normaliser",
              f"must be None or a positive token count, got {self.constant_normaliser!r}")
        _need(self.kl_estimator in KL_ESTIMATORS, o, "kl_estimator", f"must be one of {KL_ESTIMATORS}, got "
              f"{self.kl_estimator!r}")
        _need(self.kl_coef >= 0, o, "kl_coef", f"must be >= 0, got {self.kl_coef!r}")
        _need(self.kl_clamp is None or self.kl_clamp > 0, o, "kl_clamp", f"must be None or > 0, got "
              f"{self.kl_clamp!r}")
        _need(self.entropy_coef >= 0, o, "entropy_coef", f"must be >= 0, got {self.entropy_coef!r}")
        _need(isinstance(self.micro_batches, int) and self.micro_batches >= 1, o, "micro_batches",
              f"must be a positive int, got {self.micro_batches!r}")
        _need(self.mode in LOSS_MODES, o, "mode", f"must be one of {LOSS_MODES}, got {self.mode!r}")
        _need(self.logprob_chunk is None or self.logprob_chunk >= 1, o, "logprob_chunk",
              f"must be None (automatic) or >= 1, got {self.logprob_chunk!r}")
        _need(self.logits_chunk_bytes > 0, o, "logits_chunk_bytes", f"must be > 0, got {self.logits_chunk_bytes!r}")
        _need(self.tis is None or self.tis in TIS_LEVELS, o, "tis", f"must be None (off) or one of {TIS_LEVELS}, "
              f"got {self.tis!r}")
        _need(isinstance(self.tis_cap, (int, float)) and not isinstance(self.tis_cap, bool)
              and math.isfinite(self.tis_cap) and self.tis_cap >= 1, o, "tis_cap",
              f"must be a finite number >= 1 (the truncation of the importance weights), got {self.tis_cap!r}")
        _need(self.tis is None or self.mode == "rl", o, "tis", "applies to the rl mode only (sft has no sampler "
              "policy to correct); set LossConfig.tis = None")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads `LossBatch.reference_logprobs` (only the KL term does)."""
        return self.mode == "rl" and self.kl_coef > 0

    @property
    def needs_sampler_logprobs(self) -> bool:
        """Whether the loss reads `LossBatch.sampler_logprobs` (the TIS weights do)."""
        return self.mode == "rl" and self.tis is not None

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0 or self.entropy_metric

    def chunk_for(self, rows_per_device: int, length: int, vocab_size: int) -> int:
        """The log-softmax chunk for `rows_per_device x length` tokens over a `vocab_size` vocabulary."""
        if self.logprob_chunk is not None:
            return self.logprob_chunk
        fits = self.logits_chunk_bytes // max(1, rows_per_device * vocab_size * 4)
        chunk = 1 << max(0, int(fits).bit_length() - 1)  # a power of two, so typical lengths split evenly
        return max(1, min(length, max(64, chunk)))


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with a warmup-then-decay learning-rate schedule and global-norm gradient clipping.

    Attributes:
      learning_rate: peak learning rate (reached after `warmup_steps`).
      schedule: "constant", "cosine" (to `end_lr_ratio * learning_rate` at `total_steps`) or "linear" (same end).
      warmup_steps: linear warmup from 0 to the peak.
      total_steps: length of the decay (cosine/linear); ignored by "constant".
      end_lr_ratio: final learning rate as a fraction of the peak.
      weight_decay: decoupled weight decay, applied to matrices only (not norms or biases).
      clip_norm: global gradient-norm clip; None = no clipping.
      b1, b2, eps: Adam moments.
    """

    learning_rate: float = 1e-6
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    clip_norm: float | None = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        o = "OptimizerConfig"
        _need(self.learning_rate > 0 and math.isfinite(self.learning_rate), o, "learning_rate",
              f"must be a positive finite number, got {self.learning_rate!r}")
        _need(self.schedule in SCHEDULES, o, "schedule", f"must be one of {SCHEDULES}, got {self.schedule!r}")
        _need(self.warmup_steps >= 0, o, "warmup_steps", f"must be >= 0, got {self.warmup_steps!r}")
        _need(self.total_steps > self.warmup_steps or self.schedule == "constant", o, "total_steps",
              f"must exceed warmup_steps={self.warmup_steps} for a decaying schedule, got {self.total_steps!r}")
        _need(0 <= self.end_lr_ratio <= 1, o, "end_lr_ratio", f"must be in [0, 1], got {self.end_lr_ratio!r}")
        _need(self.weight_decay >= 0, o, "weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        _need(self.clip_norm is None or self.clip_norm > 0, o, "clip_norm", f"must be None or > 0, got "
              f"{self.clip_norm!r}")
        _need(0 <= self.b1 < 1, o, "b1", f"must be in [0, 1), got {self.b1!r}")
        _need(0 <= self.b2 < 1, o, "b2", f"must be in [0, 1), got {self.b2!r}")
        _need(self.eps > 0, o, "eps", f"must be > 0, got {self.eps!r}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The one mesh every phase of a run uses (rollouts, reference scoring, updates), on one process or many.

    Attributes:
      data, fsdp, tensor, expert: sizes of the mesh axes; at most one may be -1 (= the remaining devices). A
        one-device run is a 1x1x1x1 mesh.
      devices: use the first `devices` devices of this process (0 = every device of every process); one process
        only, e.g. to compare a mesh with one device in the same process.
      rules: overrides of the logical-axis sharding rules (`models.DEFAULT_RULES`, the train layout), each
        `(logical axis, mesh axes)`: a logical name of `models.LOGICAL_AXES` and a mesh axis, a tuple of mesh axes
        or None (replicated), e.g. `(('embed', ('data', 'fsdp', 'expert')), ('vocab', None))`. Empty (default) =
        the default rules. Every phase of a run uses them: `train_rules()` for the train state, the update and the
        frozen reference, `rollout_rules()` (derived: `embed` replicated) for rollouts and evaluation.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    devices: int = 0
    rules: tuple = ()

    def __post_init__(self):
        sizes = [getattr(self, a) for a in MESH_AXES]
        for axis, size in zip(MESH_AXES, sizes):
            _need(isinstance(size, int) and (size >= 1 or size == -1), "MeshConfig", axis,
                  f"must be a positive int or -1 (the rest of the devices), got {size!r}")
        _need(sizes.count(-1) <= 1, "MeshConfig", "fsdp",
              f"at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
        _need(isinstance(self.devices, int) and self.devices >= 0, "MeshConfig", "devices",
              f"must be an int >= 0 (0 = all devices), got {self.devices!r}")
        # the one rule checker (it imports jax, so not at the top)
        from trace_jax.models.sharding import check_rule_overrides

        _need(isinstance(self.rules, (tuple, list)), "MeshConfig", "rules",
              f"must be a tuple of (logical axis, mesh axes) pairs, e.g. (('embed', 'fsdp'),), got {self.rules!r}")
        try:
            rules = check_rule_overrides(self.rules)
        except ValueError as error:
            raise TrainConfigError(f"MeshConfig.rules: {error}") from None
        object.__setattr__(self, "rules", rules)  # nested tuples (gin may give lists): the config stays hashable

    def keeping_rules_of(self, run_mesh: "MeshConfig") -> "MeshConfig":
        """This mesh, with `run_mesh`'s rules when it names none itself: a `--mesh` flag given for a run (`eval`,
        `plan`) changes the axis sizes and keeps the run's `MeshConfig.rules`."""
        return self if self.rules else dataclasses.replace(self, rules=run_mesh.rules)

    def train_rules(self) -> tuple:
        """The run's logical-axis rules of the train layout: `models.DEFAULT_RULES` merged with `rules`."""
        from trace_jax.models.sharding import merge_rules

        return merge_rules(self.rules)

    def rollout_rules(self) -> tuple:
        """The run's rules of the rollout layout, derived from `train_rules()` (`models.rollout_rules`)."""
        from trace_jax.models.sharding import rollout_rules

        return rollout_rules(self.train_rules())

    @classmethod
    def from_flag(cls, text: str, flag: str = "--mesh") -> "MeshConfig":
        """A command line's `AXIS=SIZE[,AXIS=SIZE]` (e.g. `fsdp=4,tensor=2`; axes not named are 1, one size may be
        -1; `devices=N` takes the first N devices of this process) -> a `MeshConfig`. Raises `TrainConfigError`
        naming `flag` and the expected form."""
        fields = {}
        for part in text.split(","):
            name, _, value = (s.strip() for s in part.partition("="))
            if name not in MESH_AXES + ("devices",) or name in fields or not value.lstrip("-").isdigit():
                raise TrainConfigError(f"{flag} {text!r}: expected AXIS=SIZE[,AXIS=SIZE] with axes "
                                       f"{', '.join(MESH_AXES)} (each at most once, one size may be -1) and optionally "
                                       f"devices=N, e.g. {flag} fsdp=4,tensor=2")
            fields[name] = int(value)
        try:
            return cls(**{**{axis: 1 for axis in MESH_AXES}, **fields})
        except TrainConfigError as error:
            raise TrainConfigError(f"{flag} {text!r}: {error}") from None

    def axis_sizes(self, num_devices: int) -> dict[str, int]:
        """The concrete `{axis: size}` for `num_devices` devices (resolving -1); raises if they do not multiply up."""
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        known = math.prod(s for s in sizes.values() if s != -1)
        if -1 in sizes.values():
            axis = next(a for a, s in sizes.items() if s == -1)
            if num_devices % known:
                raise TrainConfigError(f"MeshConfig.{axis}: -1 cannot fill {num_devices} devices when the other "
                                       f"axes multiply to {known}; make {num_devices} divisible by {known}")
            sizes[axis] = num_devices // known
        if math.prod(sizes.values()) != num_devices:
            raise TrainConfigError(f"MeshConfig: axes {sizes} multiply to {math.prod(sizes.values())} but there "
                                   f"are {num_devices} devices; set one axis to -1 or fix the sizes")
        return sizes

    def make_mesh(self, devices=None):
        """A `jax.sharding.Mesh` over `devices` (default: every device, or the first `self.devices` of this
        process) with the four named axes."""
        import jax

        from trace_jax.models import make_mesh

        if devices is None and self.devices:
            local = jax.local_devices()
            _need(jax.process_count() == 1 and self.devices <= len(local), "MeshConfig", "devices",
                  f"asks for the first {self.devices} devices; this process has {len(local)} of "
                  f"{jax.process_count()} process(es) (set 0 to use every device; a multi-process run uses all)")
            devices = local[:self.devices]
        devices = jax.devices() if devices is None else list(devices)
        return make_mesh(self.axis_sizes(len(devices)), devices)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the train state is checkpointed (orbax `CheckpointManager`).

    Attributes:
      directory: root directory; each step is a subdirectory written atomically.
      every_steps: save when `step % every_steps == 0` (a forced save, e.g. on SIGTERM, ignores it).
      keep_last: keep only the newest K steps; None keeps all.
      async_save: write in a background thread while training continues.
    """

    directory: str = ""
    every_steps: int = 100
    keep_last: int | None = 3
    async_save: bool = True

    def __post_init__(self):
        _need(isinstance(self.directory, str) and self.directory != "", "CheckpointConfig", "directory",
              "must be a non-empty path")
        _need(self.every_steps >= 1, "CheckpointConfig", "every_steps", f"must be >= 1, got {self.every_steps!r}")
        _need(self.keep_last is None or self.keep_last >= 1, "CheckpointConfig", "keep_last",
              f"must be None or >= 1, got {self.keep_last!r}")
