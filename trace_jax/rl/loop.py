"""The training run: `train(run_config, run_dir)` and `evaluate_run(run_dir, step)`, what `trace-jax train | eval` do.

A run, in order (each stage logged, and timed in `summary.json`):

  1. build: the tasks of `DataConfig.source` (`data.sources`: the procedural world's splits, a tfds builder, or an
     external BrowseComp-Plus-style set, whose files are all read and checked here, before any compute), the
     browser over their world or corpus (`EnvConfig`; an external corpus's BM25 index from the disk cache, built
     once), the evaluation sets (`EvalConfig.sets`), the tokenizer (the word tokenizer over the world's
     vocabulary, or the checkpoint's own) and the policy (fresh init from `TrainConfig.model` and `seed`, a Hugging
     Face directory, or `'gguf:smollm2'` converted into the run directory);
  2. evaluation before anything (`before`), the SFT warm start on oracle trajectories (a clearly labelled stage of
     ours; `WarmStartConfig.steps = 0` skips it, as the paper does), evaluation after it (`initial`);
  3. the frozen reference, held on the mesh in `TrainConfig.reference_dtype` and never aliased to the policy: the
     initial policy (after the warm start, saved under `reference/`); or, with `TrainConfig.reference_checkpoint`,
     a step of another run (`'<run dir>@<step>'`) or a Hugging Face directory, loaded and checked against the model
     before any compute and frozen from step 0; or, in the mid-run swap variant (`TrainConfig.reference_swap_step =
     N`), this run's own policy of step N from step N on (the initial one before). A reference step whose files are
     damaged is read from another copy of the same step (`reference/` or the run's checkpoints), never an older one;
  4. `TrainConfig.steps` RL steps of `pipeline.RLPipeline`, with an evaluation every `EvalConfig.every_steps`;
  5. the final evaluation, the comparison with the initial one (difference and paired binomial SE), HTML credit
     receipts of a few held-out episodes, plots and `summary.json`.

Training prompts come from `prompt_stream`: a grain pipeline (`data.sources.epoch_batches`: seeded per-epoch
shuffles by `DataConfig.shuffle_seed`, each process its block of every step's prompts); each step's task ids are
appended to `prompts.jsonl` (process 0's share). The warm start draws its SFT batches through the same pipeline.
Each step whose rollouts the reference scored (an estimator that reads answer scores, or `UpdateConfig.kl_metric`)
appends one line per episode to `turn_scores.jsonl` (`turn_score_records`: scores and values of every state).

Resume: the train state (params, optimizer, PRNG key) and the host state (grain's iterator state of the prompt
order, the prompts drawn so far, the evaluations so far) are checkpointed together every
`CheckpointConfig.every_steps` steps, and on SIGTERM/SIGINT. A run directory that already holds a checkpoint
resumes from it: rollouts draw their key from `(seed, step)` and prompts from the restored iterator, so the resumed
steps equal an uninterrupted run's. A run killed during the warm start restarts from scratch (the warm start is
deterministic). `TrainState.step` counts RL steps (reset after each step's updates; the optimizer's own count
drives its schedule).

Evaluations run on every set of `EvalConfig.sets` (each with its own browser); the first set is the headline
(`eval/...` metrics, the before/after comparison, `summary.json`'s `evaluations`), and `summary.json`'s
`eval_sets` is the table of every evaluation x set plus their average; `summary.json`'s `outcomes` holds every
task's outcome of each (`eval_outcomes`). With several processes each evaluates its part of the tasks and every
process gets the whole result.

Every phase runs on one mesh (`MeshConfig`; a 1x1x1x1 mesh on one device): `Placement` says which layout each
array has there, `rl_step` is one step on it (docs/training.md, "One mesh for the whole step").

The loop's shape (PureJaxRL's and levanter's): `make_rl_step(run_config, environment)` is the step,
`step(state: RLState, batch: RLBatch) -> (state, metrics)` (`RLState`: the train state and the frozen reference;
`RLBatch`: the step's number, prompts and rollout key); `train` feeds it batches and after each step runs its
hooks (`Hook`: evaluation, the metrics record, the reference swap, the checkpoint, plots), in that order, each
when due; after the last step (also when there is none, `TrainConfig.steps = 0`) it forces a checkpoint and runs
the end-of-run hooks (`Hook.at_end`): the final evaluation, its record, the credit receipts and the plots. The warm
start before the steps is a stage of `train`, not a hook.

This module knows configs, the run directory and the pipeline; the arithmetic lives in the modules it calls.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax import models
from trace_jax.credit import episode_states, td_deltas, trace_values, turn_layout
from trace_jax.data.sources import (BatchStream, TaskSplits, epoch_batches, external_splits, parse_source,
                                     procedural_splits, tfds_splits)
from trace_jax.envs.corpus_browser import corpus_browser
from trace_jax.envs.oracle import make_browser, trajectory_vocabulary
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rl.abc_scoring import ABCStepScoring
from trace_jax.rl.credit_diagnostics import OPTIONAL_METRICS
from trace_jax.rl.evaluate import EvalResult, compare, episode_correct, evaluate, format_comparison
from trace_jax.rl.gin_setup import RunConfig, reference_checkpoint_parts
from trace_jax.rl.metrics import PhaseTimer, RunWriter, progress_bar
from trace_jax.rl.pipeline import Prepared, RLPipeline, check_compatible
from trace_jax.rl.warmstart import (DroppedDemonstrations, abc_sft_weighted, dropped_summary,
                                   oracle_trajectories, sft_arrays)
from trace_jax.rollout.batch import episode_view
from trace_jax.rollout.engine import paged_pool_line, pool_pages
from trace_jax.scoring.receipts import excerpt, safe_filename, write_receipt
from trace_jax.train import distributed
from trace_jax.train.checkpoint import Checkpointer, PreemptionGuard, abstract_train_state, restore_params_from_copies
from trace_jax.train.config import CheckpointConfig, LossConfig, MeshConfig
from trace_jax.train.flops import PEAK_FLOPS, measure_peak_flops
from trace_jax.train.loss import LossBatch, real_token_mask, trained_positions
from trace_jax.train.optimizer import make_optimizer
from trace_jax.train.state import init_train_state
from trace_jax.train.step import batch_sharding, make_train_step

REFERENCE_DIR = "reference"
# the warm start's own checkpoints while it runs (`WarmStartConfig.checkpoint_every`), gone once step 0 is saved
WARM_START_DIR = "warm_start"
RECEIPTS_DIR = "receipts"
_ROLLOUT_SALT = 7919  # rollout keys are fold_in(PRNGKey(seed), salt + step), apart from init keys


@dataclasses.dataclass
class EvalSet:
    """One evaluation set: its tasks and the browser over their corpus."""

    tasks: list
    browser: Any


@dataclasses.dataclass
class Environment:
    """What a run builds before training: tasks, browser, tokenizer, chat format and the initial policy.

    `train_tasks` / `eval_tasks` and `browser` are those of `DataConfig.source` (the held-out split is also the
    'heldout' evaluation set); `eval_sets` holds every set of `EvalConfig.sets`, in order, each with its browser
    (the run's own where the set shares its source).
    """

    train_tasks: list
    eval_tasks: list
    browser: Any
    chat: ChatFormat
    model_config: Any
    params: Any
    eval_sets: dict[str, EvalSet] = dataclasses.field(default_factory=dict)


def _files_dir(run_dir: Path) -> Path:
    """Where this process writes the files it builds (tokenizer, converted policy): the run directory on the
    primary process, a scratch directory on the others (only process 0 writes into the run directory)."""
    if distributed.is_primary():
        return run_dir
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"trace_jax_process{jax.process_index()}_"))


def _policy_dir(run_config: RunConfig, run_dir: Path) -> Path | None:
    source = run_config.train.checkpoint
    if not source:
        return None
    if source == "gguf:smollm2":
        target = run_dir / "policy_hf"
        if not (target / "config.json").exists():
            from trace_jax.models.gguf import convert_gguf, find_smollm2_gguf

            convert_gguf(find_smollm2_gguf(), target)
        return target
    path = Path(source)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"TrainConfig.checkpoint = {source!r}: no config.json there; point it at a Hugging "
                                "Face checkpoint directory or use 'gguf:smollm2'")
    return path


def _source_splits(run_config: RunConfig, source: str, where: str, *, inline: bool = False) -> TaskSplits:
    """Read one task source (`data.sources`) with the run's `DataConfig` (counts, splits, seeds, paths)."""
    data = run_config.data
    spec = parse_source(source, where, inline=inline)
    if spec.kind == "procedural":
        return procedural_splits(data.world, data.tasks, num_train=data.num_train_tasks,
                                 num_eval=data.num_eval_tasks, seed=data.seed)
    if spec.kind == "tfds":
        return tfds_splits(spec, train_split=data.train_split, eval_split=data.eval_split,
                           num_train=data.num_train_tasks, num_eval=data.num_eval_tasks, data_dir=data.data_dir,
                           corpus=data.corpus, where=where)
    if spec.queries:  # an inline external evaluation set: all of its queries
        return external_splits(spec.queries, spec.corpus, eval_fraction=0.0, seed=data.seed,
                               num_train=run_config.eval.num_tasks, num_eval=0, skip_bad_lines=data.skip_bad_lines,
                               fields=(f"{where} (queries)", f"{where} (corpus)"))
    if not data.queries:
        raise ValueError(f"{where} = 'external' evaluates DataConfig's external set, but DataConfig.queries is not "
                         "set; name the files inline: 'external:<queries.jsonl>[:<corpus.jsonl>]'")
    return external_splits(data.queries, data.corpus, eval_fraction=data.eval_fraction, seed=data.seed,
                           num_train=data.num_train_tasks, num_eval=data.num_eval_tasks,
                           skip_bad_lines=data.skip_bad_lines)


def _browser_over(run_config: RunConfig, splits: TaskSplits):
    """The browser over a source's world or corpus, with `EnvConfig`'s knobs. An external corpus's BM25 index comes
    from the disk cache (`DataConfig.index_dir`): built once, then loaded by every later run, evaluation and
    process; a procedural world's is built in memory (milliseconds)."""
    env = run_config.env
    knobs = dict(view_lines=env.view_lines, snippet_chars=env.snippet_chars, wrap_width=env.wrap_width,
                 retrieval_noise=env.retrieval_noise)
    if splits.world is not None:
        return make_browser(splits.world, **knobs)
    return corpus_browser(splits.corpus, cache_dir=run_config.data.index_dir or None, **knobs)


def build_tasks(run_config: RunConfig, *, only_set: str | None = None) -> tuple[TaskSplits, Any, dict[str, EvalSet]]:
    """The run's task splits and browser (`DataConfig.source`) and its evaluation sets (`EvalConfig.sets`, or just
    `only_set`). Every file is read and checked here, before any compute: a missing path or a malformed external
    set raises with the file, line, field and fix."""
    data = run_config.data
    splits = _source_splits(run_config, data.source, "DataConfig.source")
    if not splits.train:
        raise ValueError(f"DataConfig.source = {data.source!r} gave no training tasks; check the split or lower "
                         "DataConfig.eval_fraction")
    browser = _browser_over(run_config, splits)
    wanted = dict(run_config.eval.sets)
    if only_set is not None:
        if only_set not in wanted:
            raise ValueError(f"--set {only_set!r}: the run has evaluation sets {list(wanted)} (EvalConfig.sets)")
        wanted = {only_set: wanted[only_set]}
    eval_sets = {}
    for name, source in wanted.items():
        where = f"EvalConfig.sets[{name!r}]"
        if source in ("heldout", data.source):
            tasks, set_browser = splits.heldout, browser
        else:
            other = _source_splits(run_config, source, where, inline=True)
            tasks, set_browser = other.heldout or other.train, _browser_over(run_config, other)
        if not tasks:
            raise ValueError(f"{where} = {source!r} has no tasks (an external training set's held-out share is "
                             "DataConfig.eval_fraction; it is 0)")
        eval_sets[name] = EvalSet(tasks, set_browser)
    return splits, browser, eval_sets


def build_environment(run_config: RunConfig, run_dir: str | Path, *, load_params: bool = True,
                      only_set: str | None = None) -> Environment:
    """Tasks, browser, evaluation sets, tokenizer, chat format and policy of a run (deterministic in the config)."""
    run_dir = _files_dir(Path(run_dir))
    train_config = run_config.train
    splits, browser, eval_sets = build_tasks(run_config, only_set=only_set)
    policy_dir = _policy_dir(run_config, run_dir)
    if train_config.tokenizer == "word":
        tokenizer = load_tokenizer(build_word_tokenizer(trajectory_vocabulary(), run_dir / "tokenizer"))
    else:
        tokenizer = load_tokenizer(policy_dir)
    chat = ChatFormat(tokenizer)
    params = None
    if policy_dir is None:
        model_config = train_config.model.replace(vocab_size=len(tokenizer))
        if load_params:
            params = models.init_params(model_config, jax.random.PRNGKey(train_config.seed), dtype="float32")
    elif load_params:
        model_config, params = models.load_pretrained(policy_dir)
    else:
        model_config = models.ModelConfig.from_hf(str(policy_dir), param_dtype="float32")
    model_config = train_config.policy_model(model_config)
    return Environment(splits.train, splits.heldout, browser, chat, model_config, params, eval_sets)


def demonstrable_tasks(tasks: list) -> list:
    """The tasks an oracle can demonstrate: those with a clue chain (procedural tasks; external ones with evidence
    or gold documents, or a recovered `clues` chain). The oracle follows the chain through the browser, opening
    each clue's document, so a task without one would teach answering without searching; raises when none has a
    chain, naming the fix."""
    kept = [task for task in tasks if task.clues]
    if not kept:
        example = tasks[0].task_id if tasks else "none"
        raise ValueError(f"WarmStartConfig.steps > 0 needs oracle demonstrations, but none of the {len(tasks)} "
                         f"training tasks has evidence documents or a clue chain (e.g. {example}); add "
                         "'evidence_docs' / 'gold_docs' / 'clues' to the queries, or set WarmStartConfig.steps = 0 "
                         "(the default; a pretrained policy needs no warm start)")
    return kept


class WarmStartOutcome(NamedTuple):
    """What `warm_start` returns: the warm-started `params` and the SFT `losses` of every step (None and the steps
    so far when a stop signal ended it early: `stopped_at` is then the step it saved), and `carry`, the caller's
    dict saved with its checkpoints (`fresh_carry`'s, or the resumed checkpoint's). `run_seconds_before`: the run's
    wall seconds (its `clock`) up to the checkpoint this warm start resumed from, over every earlier attempt; 0 when
    it did not resume."""

    params: Any
    losses: list
    stopped_at: int | None = None
    carry: dict | None = None
    seconds: float = 0.0
    run_seconds_before: float = 0.0


def warm_start(run_config: RunConfig, environment: Environment, params, log: Callable[[str], None] = print, *,
               progress: bool = False, mesh=None, rules=None, store: Checkpointer | None = None,
               guard: PreemptionGuard | None = None, fresh_carry: Callable[[], dict] | None = None,
               clock: Callable[[], float] | None = None) -> WarmStartOutcome:
    """SFT on oracle trajectories rendered exactly as the rollouts render them, on `mesh` (the run's; None = the
    params' own device) under the train-layout `rules` (the run's `MeshConfig.train_rules()`). With the progress
    flag the steps show on a bar of their own (instead of a log line every fifth of them).

    With a `store` (`WarmStartConfig.checkpoint_every`) the warm start saves its state, data position, losses and
    `carry` every `checkpoint_every` steps and at its last, and resumes from the newest step there: bit for bit the
    warm start that was not stopped. A `guard`'s stop signal (any process's) saves the step just taken and returns
    with `stopped_at` set. `fresh_carry()` runs only when nothing is resumed (the caller's evaluation before the
    warm start); its dict is saved with each checkpoint and returned as `carry`. `seconds`: the warm start's own
    time over every attempt (the first attempt's `fresh_carry` not counted). `clock()`: the run's wall seconds in
    this attempt (its metrics writer's); each checkpoint saves it on top of the earlier attempts', so a resumed run's
    wall time can continue from there (`run_seconds_before`)."""
    began = time.perf_counter()
    ws = run_config.warmstart
    results = oracle_trajectories(demonstrable_tasks(environment.train_tasks), environment.browser, ws)
    with warnings.catch_warnings():  # the drops go into the log line below, not into a warning with source lines
        warnings.simplefilter("ignore", DroppedDemonstrations)
        arrays = sft_arrays(environment.chat, ws.render_rollout(run_config.rollout), environment.browser, results,
                            length_multiple=ws.length_multiple, max_length=ws.max_length,
                            answer_weight=ws.answer_weight)
    if ws.weighting == "abc":  # ABC-SFT: the RL step's ABC scorer weighs each demonstration step
        scoring = ABCStepScoring(run_config.update.abc, getattr(environment.browser, "corpus", None))
        try:
            arrays, abc_metrics = abc_sft_weighted(arrays, scoring, answer_step=run_config.credit.abc_answer_step)
        finally:
            scoring.close()
        log("warm start: ABC-SFT weights, " + ", ".join(f"{k} {v:.3f}" for k, v in abc_metrics.items()))
    optimizer = make_optimizer(ws.optimizer)
    step_fn = make_train_step(environment.model_config, LossConfig(mode="sft", entropy_metric=False), optimizer,
                              mesh=mesh, rules=rules)
    restored = None
    if store is not None:
        restored = store.restore_latest(abstract_train_state(environment.model_config, optimizer, mesh=mesh,
                                                             rules=rules))
    if restored is None:
        state = init_train_state(environment.model_config, optimizer, params, jax.random.PRNGKey(run_config.train.seed),
                                 mesh=mesh, rules=rules)
        start, losses, data_state, seconds, run_before = 0, [], None, 0.0, 0.0
        t0 = time.perf_counter()
        carry = fresh_carry() if fresh_carry is not None else None
        began += time.perf_counter() - t0
    else:
        _check_resumed_warm_start(store.directory, restored.host.get("config"), ws)
        state, start = restored.state, int(restored.step)
        losses, data_state = list(restored.host["losses"]), restored.host["data_iterator"]
        seconds, carry = float(restored.host.get("seconds", 0.0)), restored.host.get("carry")
        run_before = float(restored.host.get("run_seconds") or 0.0)  # absent in checkpoints from before it was saved
        log(f"warm start: resumed at step {start}/{ws.steps} from {store.directory}")
    dropped = (f" ({len(arrays.dropped)} more dropped: {dropped_summary(arrays.dropped, first=False)})"
               if arrays.dropped else "")
    log(f"warm start: {len(arrays)} oracle trajectories of {arrays.tokens.shape[1]} tokens{dropped}, {ws.steps} SFT "
        f"steps of {ws.batch_size}")
    # the same grain order as the RL prompts: seeded per-epoch shuffles of the rows, cut into batches
    batches = BatchStream(epoch_batches(range(len(arrays)), ws.batch_size, seed=run_config.train.seed), data_state)
    bar = progress_bar(ws.steps, "warm start", enabled=progress)
    bar.update(start)

    def elapsed() -> float:  # the warm start's seconds over every attempt
        return seconds + time.perf_counter() - began

    def save(force: bool) -> None:
        host = {"losses": losses, "data_iterator": batches.state(), "config": dataclasses.asdict(ws),
                "seconds": elapsed(), "carry": carry, "run_seconds": run_before + (clock() if clock else 0.0)}
        store.save(state, host, force=force)

    for step in range(start, ws.steps):
        index = next(batches)
        rows = arrays.batch(np.asarray(index), length_multiple=ws.length_multiple)
        # host arrays: the train step places them on its mesh (every process holds the same batch)
        batch = LossBatch(tokens=np.asarray(rows["tokens"]), positions=np.asarray(rows["positions"]),
                          loss_mask=np.asarray(rows["loss_mask"]), advantages=np.asarray(rows["weights"]),
                          behaviour_logprobs=np.zeros(rows["tokens"].shape, np.float32),
                          token_mask=np.asarray(real_token_mask(arrays.lengths[np.asarray(index)],
                                                                rows["tokens"].shape[1])),
                          trained_index=np.asarray(trained_positions(rows["loss_mask"], ws.length_multiple)))
        state, metrics = step_fn(state, batch, None)
        losses.append(float(metrics["loss"]))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if not progress and (step == 0 or (step + 1) % max(1, ws.steps // 5) == 0):
            log(f"warm start step {step + 1}/{ws.steps}: loss {losses[-1]:.3f}")
        if store is not None:
            if guard is not None:
                _stop_requested_anywhere(guard)
                if guard.requested and step + 1 < ws.steps:
                    save(force=True)
                    store.wait_until_finished()
                    bar.close()
                    return WarmStartOutcome(None, losses, stopped_at=step + 1, carry=carry, seconds=elapsed(),
                                            run_seconds_before=run_before)
            save(force=step + 1 == ws.steps)
    bar.close()
    if store is not None:
        store.wait_until_finished()
    return WarmStartOutcome(state.params, losses, carry=carry, seconds=elapsed(), run_seconds_before=run_before)


def _check_resumed_warm_start(directory: str, saved: dict | None, ws) -> None:
    """A warm start resumes only under the settings it was saved with (how often it saves may change)."""
    saved, now = saved or {}, json.loads(json.dumps(dataclasses.asdict(ws)))
    changed = sorted(k for k in set(now) | set(saved) if k != "checkpoint_every" and saved.get(k) != now.get(k))
    if changed:
        listed = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise ValueError(f"the warm start saved in {directory} ran with other WarmStartConfig settings ({listed}); "
                         "bind them back to resume it, or move that directory away to warm-start again")


# ------------------------------------------------------------------------------------------------ evaluation
def _eval_to_json(result: EvalResult) -> dict:
    return result.to_json()


def _eval_from_json(data: dict) -> EvalResult:
    return EvalResult.from_json(data)


def _evaluate(run_config: RunConfig, environment: Environment, params, label: str, log,
              placement: "Placement") -> dict[str, EvalResult]:
    """Every evaluation set of the environment (`EvalConfig.sets`, in order), each on its first
    `EvalConfig.num_tasks` tasks with its own browser, with `params` in the rollout layout on the mesh of
    `placement`; {set name: result}. With several processes each runs its part of the tasks and every process gets
    the whole result (`evaluate`; a collective)."""
    results = {}
    for name, eval_set in environment.eval_sets.items():
        tasks = eval_set.tasks[:run_config.eval.num_tasks]
        result = evaluate(environment.model_config, params, environment.chat, tasks, eval_set.browser,
                          run_config.rollout, run_config.eval, mesh=placement.mesh,
                          rules=placement.rollout_rules)
        log(f"eval ({label}, {name}): greedy accuracy {100 * result.accuracy:.1f}% +- {100 * result.accuracy_se:.1f} "
            f"on {result.num_tasks} tasks, reward {result.mean_reward:.3f}, tool calls "
            f"{result.tool_calls_per_episode:.2f}/episode ({result.seconds:.0f}s)")
        results[name] = result
    return results


def _headline(results: dict[str, EvalResult]) -> EvalResult:
    """The run's headline evaluation: its first set's (`EvalConfig.sets`)."""
    return next(iter(results.values()))


def set_average(results: dict[str, EvalResult]) -> dict[str, float]:
    """The average column over evaluation sets: mean accuracy (each set weighs the same, as in the paper's tables)
    and its standard error `sqrt(sum se_i^2) / k` (independent sets)."""
    k = len(results)
    return {"accuracy": sum(r.accuracy for r in results.values()) / k,
            "accuracy_se": math.sqrt(sum(r.accuracy_se ** 2 for r in results.values())) / k,
            "tool_calls_per_episode": sum(r.tool_calls_per_episode for r in results.values()) / k}


def _eval_metrics(results: dict[str, EvalResult]) -> dict[str, float]:
    """`eval/...` of the headline set; with several sets also `eval/<set>/...` of each and `eval/average/...`."""
    metrics = _headline(results).metrics()
    if len(results) > 1:
        for name, result in results.items():
            metrics.update(result.metrics(f"eval/{name}/"))
        metrics.update({f"eval/average/{k}": v for k, v in set_average(results).items()})
    return metrics


def _sets_to_json(results: dict[str, EvalResult]) -> dict[str, dict]:
    return {name: _eval_to_json(result) for name, result in results.items()}


def _sets_from_json(data: dict[str, dict]) -> dict[str, EvalResult]:
    return {name: _eval_from_json(result) for name, result in data.items()}


_TABLE_FIELDS = ("num_tasks", "accuracy", "accuracy_se", "pass_k", "mean_reward", "tool_calls_per_episode",
                 "turns_per_episode", "tool_errors_per_episode", "statuses")


def eval_outcomes(evals: dict[str, dict[str, dict]]) -> dict[str, dict[str, list[dict]]]:
    """Per evaluation (before, initial, step<N>, final) and set, the per-task outcomes in task order (`TaskOutcome`
    as dicts: task_id, correct, reward, tool_calls, turns, tool_errors, status, samples_correct): `summary.json`'s
    `outcomes`, for paired analyses across runs. An evaluation recorded without them (a run resumed from a
    checkpoint written before they were kept) has an empty list."""
    return {label: {name: list(result.get("outcomes") or ()) for name, result in sets.items()}
            for label, sets in evals.items()}


def eval_table(evals: dict[str, dict[str, dict]]) -> dict:
    """The seed's table layout of the run's evaluations: one row per evaluation (before, initial, step<N>, final),
    one column per set plus their average; each cell holds accuracy +- SE, pass@k, tool calls and statuses."""
    rows = {}
    names: list[str] = []
    for label, sets in evals.items():
        results = _sets_from_json(sets)
        names = names or list(results)
        rows[label] = {name: {k: _eval_to_json(r)[k] for k in _TABLE_FIELDS} for name, r in results.items()}
        rows[label]["average"] = set_average(results)
    return {"columns": names + ["average"], "rows": rows}


def _peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind.lower()
    if jax.devices()[0].platform == "cpu":
        return measure_peak_flops(size=512, repeats=3)
    for name, peak in PEAK_FLOPS.items():
        if name.replace("tpu-", "") in kind.replace(" ", ""):
            return peak * len(jax.devices())
    return None


# ------------------------------------------------------------------------------------------------ receipts
def write_credit_receipts(pipeline: RLPipeline, params, reference_params, tasks, rng, out_dir: Path, *,
                          write: bool = True) -> list[Path]:
    """HTML credit receipts of G sampled episodes on each of `tasks` (credit of the run's estimator, the reference's
    answer scores, values and TD shown whatever the estimator). `write=False` computes them without writing (a
    process taking part in the collective programs of another's receipts)."""
    if not tasks:
        return []
    rollout = pipeline.collect(params, tasks, rng)
    prepared = pipeline.prepare(rollout, reference_params, num_prompts=len(tasks))
    view = episode_view(rollout.batch)  # one receipt per episode, whatever its segment rows
    scores = prepared.answer_scores
    if scores is None:
        scores, _ = pipeline.score(reference_params, rollout, prepared.width)
        if rollout.batch.segmented:
            scores = np.asarray(episode_states(scores, view.episode, view.first_turn,
                                               np.asarray(rollout.batch.num_states), view.num_episodes))
    num_turns = view.num_turns
    cfg = pipeline.credit
    values = np.asarray(trace_values(jnp.asarray(scores), jnp.asarray(num_turns), eps=cfg.eps,
                                     min_score=cfg.min_score))
    deltas = np.asarray(td_deltas(jnp.asarray(scores), jnp.asarray(num_turns), eps=cfg.eps, min_score=cfg.min_score))
    per_turn = None if prepared.credit.per_turn is None else np.asarray(prepared.credit.per_turn)
    outcome = (None if prepared.credit.outcome_advantages is None
               else np.asarray(prepared.credit.outcome_advantages))
    advantages = np.asarray(prepared.credit.token_advantages)
    if rollout.batch.segmented:  # the credit is the episodes' (`pipeline.prepare`): one pseudo-token per turn
        turn_index = np.asarray(turn_layout(jnp.asarray(num_turns), advantages.shape[1])[0])
    else:
        turn_index = np.asarray(rollout.batch.turn_index)[:, :advantages.shape[1]]
    written = []
    for row, episode in enumerate(rollout.episodes):
        t = int(num_turns[row])
        turn_adv = []
        for k in range(t):
            where = turn_index[row] == k
            turn_adv.append(float(advantages[row][where][0]) if where.any() else None)
        result = {"id": f"{episode.task_id}-sample{row % pipeline.rollout.group_size}", "answer": episode.gold[0],
                  "reward": float(view.reward[row]), "estimator": cfg.estimator,
                  "flags": [episode.status], "outcome_advantage": None if outcome is None else float(outcome[row]),
                  "answer_scores": [float(x) for x in scores[row, :t + 1]],
                  "values": [float(x) for x in values[row, :t + 1]], "td": [float(x) for x in deltas[row, :t]],
                  "turn_credit": None if per_turn is None else [float(x) for x in per_turn[row, :t]],
                  "turn_advantage": turn_adv}
        turns = [{"calls": [excerpt(str(episode.tool_calls[k]), 200)],
                  "observation": excerpt(episode.observations[k], 300)} for k in range(t)]
        path = out_dir / safe_filename(result["id"], ".html")
        if write:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_receipt(path, result, turns, question=episode.question)
            written.append(path)
    return written


# ------------------------------------------------------------------------------------------------ the run
def prompt_stream(run_config: RunConfig, train_tasks: list, state: dict | None = None) -> BatchStream:
    """This process's prompts of each RL step, in the run's order: `data.sources.epoch_batches` (grain; seeded
    per-epoch shuffles by `DataConfig.shuffle_seed`, `TrainConfig.prompts_per_step` a step, each process its
    contiguous block of the step's prompts). `state` (the host state's `data_iterator`) resumes it."""
    dataset = epoch_batches(train_tasks, run_config.train.prompts_per_step, seed=run_config.data.shuffle_seed,
                            shard_index=jax.process_index(), shard_count=jax.process_count())
    return BatchStream(dataset, state)


PROMPTS_FILE = "prompts.jsonl"


def _record_prompts(run_dir: Path, step: int, tasks: list) -> None:
    """Append the task ids of a step's prompts (process 0's share; all of them with one process) to
    `prompts.jsonl`, so a run's training order can be read back and compared."""
    with open(run_dir / PROMPTS_FILE, "a", encoding="utf-8") as out:
        out.write(json.dumps({"step": step, "task_ids": [task.task_id for task in tasks]}) + "\n")


TURN_SCORES_FILE = "turn_scores.jsonl"


def turn_score_records(step: int, prepared, *, eps: float, min_score: float | None) -> list[dict]:
    """One record per episode of a scored step (`prepared.answer_scores` not None; else none): `step`, `episode`
    (its row in the step), `group` (its prompt group), `task_id`, `reward`, `correct`, `status`, `num_turns` T, the
    reference's scores `scores` l_0..l_T and the values `values` V_0..V_T (`trace_values`, the run's `eps` and
    `min_score`): what the credit-quality analysis reads after the run (docs/credit.md, "Credit quality")."""
    if prepared.answer_scores is None:
        return []
    view = episode_view(prepared.rollout.batch)
    num_turns = np.asarray(view.num_turns)
    scores = np.asarray(prepared.answer_scores, np.float64)
    values = np.asarray(trace_values(jnp.asarray(scores), jnp.asarray(num_turns), eps=eps, min_score=min_score))
    return [{"step": step, "episode": row, "group": int(view.group_id[row]), "task_id": episode.task_id,
             "reward": float(view.reward[row]), "correct": bool(episode_correct(episode)), "status": episode.status,
             "num_turns": int(num_turns[row]), "scores": [round(float(x), 5) for x in scores[row, :num_turns[row] + 1]],
             "values": [round(float(x), 5) for x in values[row, :num_turns[row] + 1]]}
            for row, episode in enumerate(prepared.rollout.episodes)]


def _trim_prompts(run_dir: Path, last_step: int, name: str = PROMPTS_FILE) -> None:
    """Drop the records of steps after `last_step` (run after a kill, before the checkpoint's step was redone)."""
    path = run_dir / name
    if path.exists():
        lines = [line for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip() and json.loads(line)["step"] <= last_step]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


# ------------------------------------------------------------------------------------------------ placement
class Placement:
    """Where a run's arrays live: one mesh over every device of every process (`MeshConfig`; a 1x1x1x1 mesh on one
    device). Every phase runs on it: the rollout and the reference scoring are SPMD programs over the whole mesh
    that each process feeds with its own rows (the agent loop and its tools run per process, for its rows), so no
    dimension of the params or the cache is gathered onto a process because the mesh spans processes.

      * the train state: the train layout (`MeshConfig.train_rules()`: `models.DEFAULT_RULES`, FSDP x tensor x
        expert, with the run's `MeshConfig.rules` overrides) on the mesh;
      * rollouts and evaluation read `rollout_params(params)`: the policy cast on device to
        `TrainConfig.rollout_dtype` (float32: untouched) and resharded to the rollout layout
        (`MeshConfig.rollout_rules()`: weights whole over the batch axes, heads / mlp / vocab over `tensor`,
        experts over `expert`), on the mesh;
      * the frozen reference: restored once from its checkpoint straight into the train layout, cast to
        `TrainConfig.reference_dtype` on device (fresh buffers, never the policy's, which the update donates), in
        the train layout.

    Nothing here goes through host memory but the initial params, which every process builds from the seed.
    """

    def __init__(self, run_config: RunConfig, model_config):
        self.mesh = run_config.mesh.make_mesh()
        self.model_config = model_config
        self.rules = run_config.mesh.train_rules()
        self.rollout_rules = run_config.mesh.rollout_rules()
        self.train_shardings = models.param_shardings(model_config, self.mesh, self.rules)
        self.rollout_shardings = models.param_shardings(model_config, self.mesh, self.rollout_rules)
        self.reference_dtype = jnp.dtype(run_config.train.reference_dtype)
        self.rollout_dtype = jnp.dtype(run_config.train.rollout_dtype)

    def describe(self) -> dict:
        return distributed.describe_mesh(self.mesh)

    def line(self) -> str:
        info = self.describe()
        axes = " ".join(f"{a}={s}" for a, s in info["axes"].items())
        return (f"mesh {axes} ({info['devices']} {info['platform']} devices, {info['processes']} "
                f"process{'es' if info['processes'] > 1 else ''})")

    def policy(self, params):
        """Params every process holds in full (fresh init, loaded checkpoint) -> the train layout on the mesh."""
        return distributed.put_replicated_value(params, self.train_shardings)

    def rollout_params(self, params):
        """Train-layout params -> the rollout copy: cast to `rollout_dtype` (a fresh copy, in the train layout),
        then the rollout layout on the mesh (on device: `models.in_layout`; a collective with several processes)."""
        if any(x.dtype != self.rollout_dtype for x in jax.tree_util.tree_leaves(params)):
            params = models.cast_program(self.rollout_dtype, self.train_shardings)(params)
        return models.in_layout(params, self.rollout_shardings)

    def reference(self, copies: Sequence[Checkpointer], step: int, what: str):
        """The frozen reference of checkpoint `step`, from the first of `copies` holding it that restores
        (`restore_params_from_copies`; `what` names it in errors), as the scorer reads it (a collective with
        several processes)."""
        return self.frozen(restore_params_from_copies(copies, step, shardings=self.train_shardings, what=what))

    def frozen(self, params):
        """Train-layout params -> a frozen reference as the scorer reads it: cast to its dtype on device, in fresh
        buffers (a jitted copy: never an alias of arrays the update donates), in the train layout."""
        return models.cast_program(self.reference_dtype, self.train_shardings)(params)


# ------------------------------------------------------------------------------------------------ across processes
def _combine_process_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """One step's rollout metrics of every process as one: means (every process holds the same number of rows and
    prompts, so a mean of per-process means is the global mean) except `generated_tokens`, a sum. A credit
    diagnostic a process left out (undefined on its rows, `credit_diagnostics.OPTIONAL_METRICS`) is the mean over
    the processes that have it, and left out when none has. A collective."""
    if jax.process_count() == 1:
        return dict(metrics)
    names = sorted(set(metrics) | set(OPTIONAL_METRICS))  # the same names on every process
    local = np.asarray([metrics.get(n, np.nan) for n in names], np.float64)
    values = distributed.gather_to_hosts(local).astype(np.float64)
    out = {}
    for column, name in enumerate(names):
        if name not in OPTIONAL_METRICS:
            out[name] = float(values[:, column].mean())
        elif np.isfinite(values[:, column]).any():
            out[name] = float(np.nanmean(values[:, column]))
    if "generated_tokens" in out:
        out["generated_tokens"] = float(values[:, names.index("generated_tokens")].sum())
    return out


def _global_loss_batch(loss_batch: LossBatch, mesh, rules) -> LossBatch:
    """This process's `[n, L]` rows -> the global `[n' x processes, W]` batch on `mesh`: every process's batch is
    the run's fixed update shape (`pipeline.update_shapes`) unless one fell back to a wider one; n', W and the
    `trained_index` width are the largest of any process (the others padded with untrained zeros,
    `LossBatch.padded`). A collective."""
    shape = np.asarray([*loss_batch.shape, loss_batch.head_width], np.int32)
    most_rows, width, head_width = (int(x) for x in distributed.gather_to_hosts(shape).reshape(-1, 3).max(axis=0))
    padded = loss_batch.padded(most_rows, width, None if loss_batch.trained_index is None else head_width)
    padded = jax.tree_util.tree_map(np.asarray, padded)
    rows = most_rows * jax.process_count()
    return distributed.global_batch(padded, batch_sharding(mesh, rules, (rows, width)))


def _stop_requested_anywhere(guard: PreemptionGuard) -> None:
    """Make a stop signal of any process every process's (they must all take the forced checkpoint together)."""
    if distributed.gather_to_hosts(np.asarray(guard.requested, np.int32)).any() and not guard.requested:
        guard.requested, guard.signal_name = True, "a signal to another process"


def rl_step(pipeline: RLPipeline, placement: Placement, state, reference_params, process_tasks: list, key, *,
            seed: int, timer: PhaseTimer | None = None):
    """One RL step of the run on its mesh: `process_tasks`, this process's share of the step's prompts
    (`prompt_stream`; whole prompt groups, so group statistics stay on the process; with one process, all of
    them) rolled out with the policy in the rollout layout and this process's key,
    scored by the frozen reference (`Placement.reference`), the rows of every process as one global `LossBatch`,
    and the update over the whole mesh. Returns `(state, prepared, update_metrics)`; `state` is donated. Every
    process calls it (collectives).
    """
    timer = timer or PhaseTimer()
    tasks = list(process_tasks)
    with timer.phase("rollout"):
        # the step's key: each row draws what it draws in a one-process run (`RLPipeline.collect`)
        rollout = pipeline.collect(placement.rollout_params(state.params), tasks, key)
    prepared = pipeline.prepare(rollout, reference_params, num_prompts=len(tasks))
    timer.seconds.update(prepared.timing)
    prepared.loss_batch = _global_loss_batch(prepared.loss_batch, placement.mesh, placement.rules)
    prepared.metrics = _combine_process_metrics(prepared.metrics)
    with timer.phase("update"):
        state, update_metrics = pipeline.update(state, prepared, reference_params, seed=seed)
        jax.block_until_ready(state.params)
    return state, prepared, update_metrics


# ------------------------------------------------------------------------------------------------ the step and hooks
@dataclasses.dataclass(frozen=True)
class RLState:
    """What one RL step carries to the next: the train state (params, optimizer, key; the update donates it) and the
    frozen reference the step scores with (replaced only by the mid-run swap, `TrainConfig.reference_swap_step`)."""

    train: Any
    reference: Any


@dataclasses.dataclass(frozen=True)
class RLBatch:
    """One step's input: its number (`step`, from 1), this process's share of its prompts (`prompt_stream`) and its
    rollout key (`rollout_key`)."""

    step: int
    tasks: tuple
    key: Any


def rollout_key(seed: int, step: int):
    """The rollout key of RL step `step` (from 1): `fold_in(PRNGKey(seed), salt + step - 1)`, so a resumed run draws
    the keys of an uninterrupted one."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), _ROLLOUT_SALT + step - 1)


class RLStep:
    """`step(state: RLState, batch: RLBatch) -> (state, metrics)`: one RL step of a run on its mesh (`rl_step`: the
    rollout in the rollout layout, reference scoring, credit and the update over the whole mesh), the train state's
    step counter set to `batch.step`, and the step's metrics (rollout, credit, update, phase seconds, throughput).
    `state.train` is donated. Built by `make_rl_step`; `pipeline`, `placement` and `optimizer` are the pieces the
    rest of the run shares (evaluation, receipts, checkpoints)."""

    def __init__(self, pipeline: RLPipeline, placement: Placement, optimizer, seed: int, peak_flops: float | None,
                 run_config: RunConfig | None = None):
        self.pipeline, self.placement, self.optimizer = pipeline, placement, optimizer
        self.seed, self.peak_flops, self.run_config = seed, peak_flops, run_config
        self.prepared: Prepared | None = None  # the last step's batch, for the run's turn-scores record

    def programs(self, tasks: Sequence[Any]):
        """The registry of the device programs this step dispatches (`rl.programs.programs`), with its update the
        pipeline's own train step and the scorer's answers as long as the longest continuation of `tasks`' gold
        answers (the step's prompts are drawn from them)."""
        from trace_jax.rl.programs import programs

        pipeline = self.pipeline
        answer_tokens = max((len(pipeline.continuation(str(task.answer)).ids) for task in tasks), default=1)
        return programs(self.run_config, pipeline.model_config, self.placement.mesh, optimizer=self.optimizer,
                        train_step=pipeline.train_step, num_stop_ids=len(pipeline.chat.assistant_stop_ids) or 1,
                        answer_tokens=answer_tokens)

    def __call__(self, state: RLState, batch: RLBatch) -> tuple[RLState, dict[str, float]]:
        timer = PhaseTimer()
        train_state, prepared, update_metrics = rl_step(
            self.pipeline, self.placement, state.train, state.reference, list(batch.tasks), batch.key,
            seed=self.seed * 1_000_003 + batch.step - 1, timer=timer)
        self.prepared = prepared
        train_state = train_state.replace(step=distributed.put_replicated_value(
            np.int32(batch.step), NamedSharding(self.placement.mesh, P())))
        metrics = {**prepared.metrics, **update_metrics, **timer.metrics()}
        metrics.update(self.pipeline.throughput(prepared, timer.seconds["update"], timer.seconds["rollout"],
                                                peak_flops=self.peak_flops))
        return RLState(train_state, state.reference), metrics


def make_rl_step(run_config: RunConfig, environment: "Environment", *, placement: Placement | None = None,
                 optimizer=None, peak_flops: float | None = None) -> RLStep:
    """The RL step of `run_config` on `environment` (`build_environment`): its mesh and layouts (`Placement`, built
    here unless given), its optimizer (`OptimizerConfig`) and one `RLPipeline` whose update is one program over the
    whole mesh. Fails before any compute when the step's rows cannot be one global batch or the KV budget holds no
    row. `train` drives it with hooks (`Hook`); a Python user can drive it alone:

        rl = make_rl_step(run_config, environment)
        state = RLState(init_train_state(...), reference_params)
        state, metrics = rl(state, RLBatch(1, tasks, rollout_key(seed, 1)))
    """
    placement = placement or Placement(run_config, environment.model_config)
    optimizer = optimizer or make_optimizer(run_config.optimizer)
    rows = run_config.train.prompts_per_step * run_config.rollout.group_size
    try:  # fail before any compute when the step's rows cannot be one global batch
        distributed.check_rows_split_by_process(batch_sharding(placement.mesh, placement.rules, (rows, 1)), (rows, 1))
    except ValueError as error:
        raise ValueError(f"TrainConfig.prompts_per_step x RolloutConfig.group_size = {rows} rows per step: "
                         f"{error}") from None
    # fail before any compute when the KV budget holds no row
    pool_pages(environment.model_config, run_config.rollout, run_config.rollout.paged, rows,
               mesh=placement.mesh, rules=placement.rollout_rules)
    pipeline = RLPipeline(environment.model_config, environment.chat, environment.browser, run_config.rollout,
                          run_config.credit, run_config.loss, run_config.update, optimizer,
                          mesh=placement.mesh, rules=placement.rules, rollout_rules=placement.rollout_rules,
                          train_step=make_train_step(environment.model_config, run_config.loss, optimizer,
                                                     mesh=placement.mesh, rules=placement.rules),
                          warm_started=run_config.warm_started)
    return RLStep(pipeline, placement, optimizer, run_config.train.seed, peak_flops, run_config)


@dataclasses.dataclass(frozen=True)
class Hook:
    """What a run does after a step besides the step itself (levanter's hooks): `fn(step, state, metrics)` runs after
    each step where `due(step)`, in the order of the run's hook list; it may add to `metrics` (which the `record`
    hook then logs) and may return a new `RLState` (the reference swap does), else None.

    Attributes:
      name: what it is, for messages (`evaluation`, `record`, `reference swap`, `checkpoint`, `plots`,
        `final evaluation`, `receipts`).
      fn: `(step, state, metrics) -> RLState | None`.
      every: run it after every `every`-th step; 0 never.
      at_end: also run it once after the run's last step (`run_hooks(..., end=True)`), with the metrics of the end
        (the final evaluation's); a hook with `every = 0` and `at_end` runs only then.
    """

    name: str
    fn: Callable[[int, RLState, dict], "RLState | None"]
    every: int = 1
    at_end: bool = False

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


def run_hooks(hooks: Sequence[Hook], step: int, state: RLState, metrics: dict, *, end: bool = False) -> RLState:
    """Run the hooks due after `step` (with `end`: the end-of-run hooks, `Hook.at_end`), in order; returns the state
    the last of them left."""
    for hook in hooks:
        if hook.at_end if end else hook.due(step):
            new = hook.fn(step, state, metrics)
            if new is not None and not isinstance(new, RLState):
                raise TypeError(f"hook {hook.name!r} returned a {type(new).__name__}; a hook returns a new RLState "
                                "or None")
            state = new if new is not None else state
    return state


def _init_from_store(init_from: str) -> Checkpointer:
    """The reference store of the run `TrainConfig.init_from` names, checked to hold its step 0 (the initial policy)."""
    missing = not (Path(init_from) / REFERENCE_DIR).is_dir()  # checked first: a Checkpointer creates its directory
    store = None if missing else _reference_checkpointer(Path(init_from))
    if missing or 0 not in store.all_steps():
        if store is not None:
            store.close()
        raise FileNotFoundError(f"TrainConfig.init_from = {init_from!r}: no initial policy there (no complete step 0 "
                                f"under {Path(init_from) / REFERENCE_DIR}); point it at the run directory of a "
                                "`trace-jax train` run that finished its warm start")
    return store


def _initial_policy_of(init_from: str, placement: "Placement"):
    """The initial policy of the run `init_from` (its step 0 reference checkpoint), in the train layout on the mesh,
    checked leaf by leaf against this run's model."""
    with _init_from_store(init_from) as store:
        params = store.restore_params(0, shardings=placement.train_shardings)
    _check_model(params, placement.model_config, f"TrainConfig.init_from = {init_from!r}", dtype=np.dtype("float32"))
    return params


def _check_model(params, model_config, what: str, *, dtype=None) -> None:
    """Raise ValueError naming `what` when `params` are not `model_config`'s (shapes, and `dtype` when given)."""
    def spec(shape, array_dtype):
        return (tuple(shape), array_dtype) if dtype is not None else tuple(shape)

    want = {jax.tree_util.keystr(p): spec(shape, dtype) for p, shape in jax.tree_util.tree_leaves_with_path(
        models.param_shapes(model_config), is_leaf=lambda x: isinstance(x, tuple))}
    got = {jax.tree_util.keystr(p): spec(x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    if want != got:
        differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise ValueError(f"{what}: its params are not this run's model ({len(differ)} params differ, e.g. "
                         f"{differ[0]}: {got.get(differ[0])} there, {want.get(differ[0])} here); use the same model "
                         "preset and tokenizer as that checkpoint")


def _reference_copies(run_dir: Path, checkpoint_directory: str) -> list[Checkpointer]:
    """Checkpointers of the directories of run `run_dir` that hold policy params by step: `reference/` (its initial
    policy, step 0, and a swap step) and its checkpoints (`CheckpointConfig.directory`, the name this run uses);
    only those that exist (a Checkpointer creates its directory)."""
    directories = [run_dir / REFERENCE_DIR, run_dir / checkpoint_directory]
    return [Checkpointer(CheckpointConfig(directory=str(d), every_steps=1, keep_last=None, async_save=False))
            for d in directories if d.is_dir()]


def check_reference_checkpoint(run_config: RunConfig) -> None:
    """Fail before any compute when `TrainConfig.reference_checkpoint` names nothing loadable: a run directory
    without that complete step, or a directory that is not a Hugging Face checkpoint."""
    value = run_config.train.reference_checkpoint
    if not value:
        return
    path, step = reference_checkpoint_parts(value)
    what = f"TrainConfig.reference_checkpoint = {value!r}"
    if step is None:
        if not (Path(path) / "config.json").exists():
            hint = (f"; it looks like a run directory: name a step, '{path}@<step>'"
                    if (Path(path) / REFERENCE_DIR).is_dir() else "")
            raise FileNotFoundError(f"{what}: no config.json in {path}{hint}; give '<run dir>@<step>' (a step of a "
                                    "`trace-jax train` run) or a Hugging Face checkpoint directory")
        return
    copies = _reference_copies(Path(path), run_config.checkpoint.directory)
    try:
        held = {d.directory: d.all_steps() for d in copies}
    finally:
        for copy in copies:
            copy.close()
    if not any(step in steps for steps in held.values()):
        listed = "; ".join(f"{d}: steps {steps}" for d, steps in held.items()) or f"no {REFERENCE_DIR}/ or " \
            f"{run_config.checkpoint.directory}/ directory in {path}"
        raise FileNotFoundError(f"{what}: no complete step {step} there ({listed}); name a saved step of a "
                                "`trace-jax train` run directory")


def load_reference_checkpoint(run_config: RunConfig, placement: "Placement"):
    """The frozen reference `TrainConfig.reference_checkpoint` names (see `TrainConfig`), checked against this run's
    model and placed as `Placement.frozen` places it: fresh buffers on the mesh, never the policy's."""
    value = run_config.train.reference_checkpoint
    path, step = reference_checkpoint_parts(value)
    what = f"TrainConfig.reference_checkpoint = {value!r}"
    if step is None:
        _, params = models.load_pretrained(path)
        _check_model(params, placement.model_config, what)
        return placement.frozen(placement.policy(params))
    copies = _reference_copies(Path(path), run_config.checkpoint.directory)
    try:
        params = restore_params_from_copies(copies, step, shardings=placement.train_shardings, what=what)
    finally:
        for copy in copies:
            copy.close()
    _check_model(params, placement.model_config, what)
    return placement.frozen(params)


def _reference_checkpointer(run_dir: Path) -> Checkpointer:
    return Checkpointer(CheckpointConfig(directory=str(run_dir / REFERENCE_DIR), every_steps=1, keep_last=None,
                                         async_save=False))


def train(run_config: RunConfig, run_dir: str | Path, *, progress: bool = True,
          log: Callable[[str], None] = print) -> dict:
    """Run (or resume) a training run into `run_dir`; returns the summary (also written to `summary.json`).

    The gin config in effect must be the one `run_config` was parsed from (`gin_setup.parse`); it is written to
    the run directory. Raises ValueError before any compute when the configs cannot work together.

    Every phase runs on one mesh (`run_config.mesh`, see `Placement`): on one process over its devices, on several
    (after `distributed.initialize`, see `trace_jax.train.distributed`) over every process's devices. Every process
    calls this with the same config and run directory; each rolls out and scores its share of the step's prompts
    on its own block of the mesh, the update is one program over the whole mesh, and only process 0 writes the
    run's files and logs (every process writes its shards of the checkpoints). The warm start runs on every
    process (deterministic, so they agree); each evaluation splits its tasks over the processes (`evaluate`)."""
    from trace_jax.rl.gin_setup import write_config

    started = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    train_config = run_config.train
    update_config = run_config.update
    rows = train_config.prompts_per_step * run_config.rollout.group_size
    check_compatible(run_config.credit, run_config.loss, update_config, rows)
    if train_config.init_from:  # fail before any compute when there is nothing to start from
        _init_from_store(train_config.init_from).close()
    check_reference_checkpoint(run_config)
    primary = distributed.is_primary()
    distributed.process_share(train_config.prompts_per_step, what="prompts per step (TrainConfig."
                              "prompts_per_step; each process rolls out an equal share)")
    log = log if primary else (lambda _line: None)
    if primary:
        write_config(run_dir)
    stages: dict[str, float] = {}

    t0 = time.perf_counter()
    environment = build_environment(run_config, run_dir)
    stages["build"] = time.perf_counter() - t0
    rl = make_rl_step(run_config, environment)
    placement, pipeline, optimizer, mesh = rl.placement, rl.pipeline, rl.optimizer, rl.placement.mesh
    checkpoint_config = dataclasses.replace(run_config.checkpoint,
                                            directory=str(run_dir / run_config.checkpoint.directory))
    log(f"run {run_dir}: {train_config.steps} RL steps of {train_config.prompts_per_step} prompts x "
        f"{run_config.rollout.group_size} samples, credit {run_config.credit.estimator}, "
        f"{len(environment.train_tasks)} train / {len(environment.eval_tasks)} held-out tasks, {placement.line()}")
    log(paged_pool_line(environment.model_config, run_config.rollout, rows // jax.process_count(), mesh=mesh,
                        rules=placement.rollout_rules))

    external_reference = None
    if train_config.reference_checkpoint:  # loaded (and checked against the model) before the warm start
        external_reference = load_reference_checkpoint(run_config, placement)
        log(f"reference: {train_config.reference_checkpoint}, frozen from step 0")

    with PreemptionGuard() as guard, Checkpointer(checkpoint_config, guard=guard) as checkpointer, \
            _reference_checkpointer(run_dir) as reference_store:
        restored = checkpointer.restore_latest(abstract_train_state(environment.model_config, optimizer, mesh=mesh,
                                                                         rules=placement.rules))
        latest = None if restored is None else restored.step
        if latest is None:
            writer = RunWriter(run_dir, total_steps=train_config.steps, progress=progress, write_files=primary)
            evals: dict[str, dict] = {}
            warm_started = run_config.warm_started
            if train_config.init_from:
                params = _initial_policy_of(train_config.init_from, placement)
                log(f"initial policy from {train_config.init_from} (its policy after its warm start; no warm start "
                    "here)")
            else:
                params = placement.policy(environment.params)
            if run_config.warmstart.steps > 0 and not train_config.init_from:
                def evaluate_before():
                    t0 = time.perf_counter()
                    before = _sets_to_json(_evaluate(run_config, environment, placement.rollout_params(params),
                                                     "before warm start", log, placement))
                    return {"evals_before": before, "eval_before_seconds": time.perf_counter() - t0}

                warm_start_store = None
                if run_config.warmstart.checkpoint_every:
                    warm_start_store = Checkpointer(CheckpointConfig(
                        directory=str(run_dir / WARM_START_DIR), every_steps=run_config.warmstart.checkpoint_every,
                        keep_last=1, async_save=True), guard=guard)
                try:
                    outcome = warm_start(run_config, environment, params, log, progress=progress and primary,
                                         mesh=mesh, rules=placement.rules, store=warm_start_store, guard=guard,
                                         fresh_carry=evaluate_before, clock=lambda: writer.wall_time)
                finally:
                    if warm_start_store is not None:
                        warm_start_store.close()
                if outcome.stopped_at is not None:
                    log(f"stopped by {guard.signal_name} at warm start step {outcome.stopped_at}/"
                        f"{run_config.warmstart.steps} (saved in {warm_start_store.directory}); rerun the same "
                        "command to resume")
                    writer.close()
                    return {"stopped_at": 0, "warm_start_stopped_at": outcome.stopped_at}
                writer.continue_wall_time(outcome.run_seconds_before)  # the attempts before this one, if resumed
                evals["before"] = outcome.carry["evals_before"]
                stages["eval_before"] = outcome.carry["eval_before_seconds"]
                params, losses = outcome.params, outcome.losses
                stages["warm_start"] = outcome.seconds
                writer.log(0, {"warmstart/final_loss": losses[-1] if losses else float("nan")})
            t0 = time.perf_counter()
            initial = _evaluate(run_config, environment, placement.rollout_params(params),
                                "after warm start" if warm_started else "initial policy", log, placement)
            stages["eval_initial"] = time.perf_counter() - t0
            evals["initial"] = _sets_to_json(initial)
            writer.log(0, _eval_metrics(initial))
            state = init_train_state(environment.model_config, optimizer, params,
                                     jax.random.PRNGKey(train_config.seed), mesh=mesh, rules=placement.rules)
            host = {"data_position": 0, "data_iterator": None, "evals": evals, "stages": stages}
            reference_store.save(state, {"step": 0}, force=True)
            checkpointer.save(state, host, force=True)
            checkpointer.wait_until_finished()
            if primary and (run_dir / WARM_START_DIR).exists():  # step 0 holds the warm-started policy now
                shutil.rmtree(run_dir / WARM_START_DIR)
        else:
            state, host = restored.state, restored.host
            writer = RunWriter(run_dir, total_steps=train_config.steps, resume_step=latest, progress=progress,
                               write_files=primary)
            log(f"resuming from the checkpoint of step {latest}")
            if primary:
                _trim_prompts(run_dir, latest)
                _trim_prompts(run_dir, latest, TURN_SCORES_FILE)
            stages.update(host.get("stages", {}))
        step = int(state.step)
        swap = train_config.reference_swap_step
        reference_at = swap if 0 <= swap <= step else 0
        own_copies = (reference_store, checkpointer)  # a damaged reference/ step is read from the checkpoints' copy
        if external_reference is not None:
            reference_params = external_reference
        else:
            reference_params = placement.reference(own_copies, reference_at, f"the reference of {run_dir}")
        rl.peak_flops = _peak_flops()

        end: dict[str, Any] = {}  # what the end-of-run hooks leave for the summary

        def evaluation(step, state, metrics):
            if step < train_config.steps:  # the final evaluation follows the loop
                result = _evaluate(run_config, environment, placement.rollout_params(state.train.params),
                                   f"step {step}", log, placement)
                metrics.update(_eval_metrics(result))
                host["evals"][f"step{step}"] = _sets_to_json(result)

        def final_evaluation(step, state, metrics):
            t0 = time.perf_counter()
            end["final_params"] = placement.rollout_params(state.train.params)
            final = _evaluate(run_config, environment, end["final_params"], "after RL", log, placement)
            stages["eval_final"] = time.perf_counter() - t0
            metrics.update(_eval_metrics(final))
            end["evals"] = {**host["evals"], "final": _sets_to_json(final)}
            initial, final = _headline(_sets_from_json(host["evals"]["initial"])), _headline(final)
            label = "after warm start" if run_config.warmstart.steps > 0 or train_config.init_from else "initial"
            end["line"] = format_comparison(initial, final, before_label=label, after_label="after RL")
            log(end["line"])
            end["comparison"] = compare(initial, final)

        def reference_swap(step, state, metrics):
            if step == swap:  # the mid-run swap variant: this run's own policy of this step from now on
                reference_store.save(state.train, {"step": step}, force=True)
                return RLState(state.train, placement.reference(own_copies, step, f"the reference of {run_dir}"))

        def checkpoint(step, state, metrics):
            _stop_requested_anywhere(guard)
            checkpointer.maybe_save(state.train, host)

        def record(step, state, metrics):
            writer.log(step, metrics)
            if primary and rl.prepared is not None:  # this process's rows; the end-of-run record has no step
                records = turn_score_records(step, rl.prepared, eps=run_config.credit.eps,
                                             min_score=run_config.credit.min_score)
                if records:
                    with open(run_dir / TURN_SCORES_FILE, "a", encoding="utf-8") as out:
                        out.writelines(json.dumps(r) + "\n" for r in records)
                rl.prepared = None

        def receipts(step, state, metrics):
            # every process rolls the receipts' episodes out (the programs span the mesh); process 0 writes them
            together = distributed.spans_processes(mesh)
            receipt_tasks = environment.eval_tasks[:train_config.receipts] if primary or together else []
            end["receipts"] = write_credit_receipts(pipeline, end["final_params"], state.reference, receipt_tasks,
                                                    jax.random.PRNGKey(train_config.seed + 1), run_dir / RECEIPTS_DIR,
                                                    write=primary)

        def plots(step, state, metrics):
            writer.write_plots()

        hooks = [Hook("evaluation", evaluation, run_config.eval.every_steps),
                 Hook("final evaluation", final_evaluation, 0, at_end=True),
                 Hook("record", record, at_end=True),
                 Hook("reference swap", reference_swap, 1 if swap > 0 else 0),
                 Hook("checkpoint", checkpoint),
                 Hook("receipts", receipts, 0, at_end=True),
                 Hook("plots", plots, train_config.plot_every, at_end=True)]
        rl_state = RLState(state, reference_params)
        rl_start = time.perf_counter()
        writer.start_progress()
        prompts = prompt_stream(run_config, environment.train_tasks, host.get("data_iterator"))
        while step < train_config.steps:
            step_tasks = next(prompts)
            step += 1
            if primary:
                _record_prompts(run_dir, step, step_tasks)
            rl_state, metrics = rl(rl_state, RLBatch(step, tuple(step_tasks), rollout_key(train_config.seed, step)))
            # grain's iterator state is the position; data_position counts every process's prompts
            host["data_iterator"] = prompts.state()
            host["data_position"] = int(host["data_position"]) + train_config.prompts_per_step
            rl_state = run_hooks(hooks, step, rl_state, metrics)
            if checkpointer.stop_requested:
                log(f"stopped by {guard.signal_name} after step {step}; rerun the same command to resume")
                writer.close()
                return {"stopped_at": step}
        stages["rl_steps"] = time.perf_counter() - rl_start
        checkpointer.save(rl_state.train, host, force=True)
        checkpointer.wait_until_finished()
        writer.end_progress()
        rl_state = run_hooks(hooks, step, rl_state, {}, end=True)
        evals = end["evals"]
        history = [r for r in writer.history if "reward" in r]
        summary = {
            "run_dir": str(run_dir), "steps": step, "estimator": run_config.credit.estimator,
            "mesh": placement.describe(),
            "model": dataclasses.asdict(environment.model_config) if hasattr(environment.model_config,
                                                                             "__dataclass_fields__") else None,
            # the headline set's evaluations; every set's, with their average, in eval_sets
            "evaluations": {name: {k: v for k, v in next(iter(sets.values())).items()
                                   if k not in ("correct", "task_ids", "outcomes")} for name, sets in evals.items()},
            "eval_sets": eval_table(evals),
            "outcomes": eval_outcomes(evals),  # per evaluation and set, one record per task
            "comparison": {**dataclasses.asdict(end["comparison"]), "line": end["line"]},
            "reference": {"checkpoint": train_config.reference_checkpoint or None,
                          "swap_step": swap if swap >= 0 else None,
                          "frozen_from_step_0": swap < 0},
            "mean_reward_first_step": history[0]["reward"] if history else None,
            "mean_reward_last_step": history[-1]["reward"] if history else None,
            "seconds": {**stages, "total_this_process": time.perf_counter() - started},
            "receipts": [str(p.relative_to(run_dir)) for p in end["receipts"]],
        }
        writer.write_summary(summary)
        writer.close()
    return summary


def evaluate_run(run_dir: str | Path, step: int | None = None, *, set_name: str | None = None,
                 mesh: MeshConfig | None = None, log: Callable[[str], None] = print) -> dict[str, EvalResult]:
    """Evaluate the checkpoint of `step` (default: the latest) of a run on its evaluation sets (`EvalConfig.sets`;
    only `set_name` when given), with the run's own config (`config.gin`). Writes `eval_step<S>.json` (the headline
    set's figures at the top level, every set under `sets`, their `average`), or `eval_step<S>_<set>.json` for one
    set; returns {set name: result}.

    The policy runs on the run's mesh (its recorded `MeshConfig`, or `mesh` instead, e.g. to evaluate on fewer
    chips than it trained on), placed as `train` places it (`Placement`): each process reads its shards of the
    checkpoint straight into the train layout, resharded on device into the rollout layout.
    """
    from trace_jax.rl.gin_setup import parse

    run_dir = Path(run_dir)
    config_path = run_dir / "config.gin"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} does not exist: --run-dir must be a directory written by "
                                "`trace-jax train`")
    run_config = parse([str(config_path)])
    if mesh is not None:
        run_config = dataclasses.replace(run_config, mesh=mesh.keeping_rules_of(run_config.mesh))
    environment = build_environment(run_config, run_dir, load_params=False, only_set=set_name)
    placement = Placement(run_config, environment.model_config)
    directory = run_dir / run_config.checkpoint.directory
    store = Checkpointer(CheckpointConfig(directory=str(directory), async_save=False))
    try:
        steps = store.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint of step {step} in {directory}; have {steps}")
        params = store.restore_params(step, shardings=placement.train_shardings)
    finally:
        store.close()
    log(f"eval of {run_dir} step {step} on {placement.line()}")
    results = _evaluate(run_config, environment, placement.rollout_params(params), f"step {step}", log, placement)
    path = run_dir / (f"eval_step{step}.json" if set_name is None else f"eval_step{step}_{set_name}.json")
    data = {**_eval_to_json(_headline(results)), "sets": _sets_to_json(results), "average": set_average(results)}
    if distributed.is_primary():  # every process holds the same results
        path.write_text(json.dumps(_finite(data), indent=2) + "\n", encoding="utf-8")
    return results


def _finite(value):
    """`value` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
