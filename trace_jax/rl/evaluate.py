"""Held-out evaluation of a policy: greedy exact-match accuracy, pass@k with sampling, and episode statistics.

`evaluate` runs `trace_jax.rollout.run_episodes` over the tasks in chunks and counts:

  * accuracy: share of tasks whose greedy episode ends with an answer that exactly matches the gold answer or an
    alias (`envs.answers.exact_match`, normalised), with its binomial standard error `sqrt(p (1 - p) / n)`;
  * mean reward: the environment's `answer_reward` as the rollouts compute it (differs from accuracy only with a
    format weight);
  * pass@k (optional): `n >= k` sampled episodes per task, `c` of them correct; the unbiased estimator
    `1 - C(n - c, k) / C(n, k)` (Chen et al. 2021), averaged over tasks;
  * tool calls and generated turns per episode, tool errors, and how episodes ended (`rollout.STATUSES`).

Every figure is a function of the per-task outcomes (`TaskOutcome`: id, correct, reward, tool calls, turns, tool
errors, status, correct samples of pass@k), which the result keeps (`EvalResult.outcomes`) for paired analyses
across runs; `result_from_outcomes` computes the figures from them, whatever order the tasks were run in.

With several JAX processes each evaluates its contiguous part of the tasks (`distributed.process_part`): with a mesh
over every process's devices, in programs over the whole mesh that every process dispatches together (a process
whose part is shorter takes part with empty chunks); without one, on its own devices. Then the outcomes of every
process are gathered (`distributed.gather_rows`), so every process returns the result one process evaluating every
task would: greedy episodes do not depend on the rows batched with them, and a
sampled episode's keys on its task's position in the whole list (`run_episodes(row_offset=...)`), not on the chunk
or the process that runs it.

`compare` turns two evaluations of the same tasks into "before -> after, difference +- SE": the SE is the paired
one (standard error of the per-task differences) when both cover the same task ids, else the unpaired
`sqrt(se_before^2 + se_after^2)`.

This module knows the rollout API, answer checking and how processes share work (`train.distributed`); it knows
nothing about training, optimizers or credit.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from trace_jax.envs.answers import exact_match
from trace_jax.rollout.agent import RolloutConfig, run_episodes
from trace_jax.rollout.batch import STATUSES, EpisodeRecord, episode_view
from trace_jax.rollout.sampler import SamplingConfig
from trace_jax.train import distributed


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """When and how the held-out tasks are evaluated.

    Attributes:
      num_tasks: held-out tasks evaluated (the first `num_tasks` of the held-out split).
      every_steps: evaluate every this many RL steps (0 = only before and after training).
      batch_size: tasks per `run_episodes` call (bounds the KV cache: batch_size x samples rows).
      pass_k: k of pass@k (0 = no sampled evaluation).
      pass_samples: samples n per task for pass@k (n >= k; more samples lower the estimator's variance).
      temperature: sampling temperature of the pass@k episodes.
      seed: PRNG seed of the sampled episodes (the same at every evaluation, so runs compare like with like).
      max_turns: tool-calling turns an evaluation episode may make; None = the rollouts' `RolloutConfig.max_turns`
        (the paper trains with up to 60 and evaluates with up to 80).
      sets: the evaluation sets, name -> source (`trace_jax.data.sources`): 'heldout' (the run's own held-out
        split), 'procedural', 'tfds:<builder>[/<config>]' (its `DataConfig.eval_split`) or
        'external:<queries.jsonl>[:<corpus.jsonl>]' (all its queries), e.g.
        `EvalConfig.sets = {'heldout': 'heldout', 'procedural': 'procedural'}`. Each is evaluated on its first
        `num_tasks` tasks and reported on its own, with their average; the first set is the run's headline
        (`eval/...` metrics, the before/after comparison). Stored as a tuple of (name, source) pairs.
    """

    num_tasks: int = 128
    every_steps: int = 0
    batch_size: int = 128
    pass_k: int = 0
    pass_samples: int = 4
    temperature: float = 1.0
    seed: int = 1234
    max_turns: int | None = None
    sets: tuple[tuple[str, str], ...] = (("heldout", "heldout"),)

    def __post_init__(self):
        from trace_jax.data.sources import check_name, parse_source

        sets = self.sets
        if isinstance(sets, Mapping):
            sets = tuple(sets.items())
        if not isinstance(sets, (tuple, list)) or not all(isinstance(p, (tuple, list)) and len(p) == 2
                                                          for p in sets):
            raise ValueError(f"EvalConfig.sets must map set names to sources, e.g. {{'heldout': 'heldout', "
                             f"'bcp': 'external:queries.jsonl:corpus.jsonl'}}; got {self.sets!r}")
        for name, source in sets:
            check_name(name, "EvalConfig.sets")
            parse_source(source, f"EvalConfig.sets[{name!r}]", inline=True)
        if len({name for name, _ in sets}) != len(sets):
            raise ValueError(f"EvalConfig.sets names a set twice: {[name for name, _ in sets]}")
        if not sets:
            raise ValueError("EvalConfig.sets is empty; name at least one set, e.g. {'heldout': 'heldout'}")
        object.__setattr__(self, "sets", tuple((str(n), str(s)) for n, s in sets))
        for name in ("num_tasks", "batch_size", "pass_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("every_steps", "pass_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"EvalConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.pass_k > self.pass_samples:
            raise ValueError(f"EvalConfig.pass_k={self.pass_k} needs pass_samples >= pass_k, got "
                             f"{self.pass_samples}; raise EvalConfig.pass_samples")
        if not self.temperature > 0:
            raise ValueError(f"EvalConfig.temperature must be > 0, got {self.temperature!r}")
        if self.max_turns is not None and (isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int)
                                           or self.max_turns < 0):
            raise ValueError(f"EvalConfig.max_turns must be None (the rollouts' max_turns) or an int >= 0, got "
                             f"{self.max_turns!r}")


@dataclasses.dataclass(frozen=True)
class TaskOutcome:
    """How one task's evaluation went (a record's `outcomes`, one per task in task order).

    Attributes:
      task_id: the task's `task_id` (its position in the evaluated list when it has none).
      correct: whether its greedy episode's answer matches the gold answer or an alias (`episode_correct`).
      reward: the greedy episode's `answer_reward`.
      tool_calls, turns, tool_errors: of the greedy episode (turns = generated assistant turns, the answer's too).
      status: how the greedy episode ended, a name of `rollout.STATUSES` ('answered', 'max_turns' = the turn cap,
        'malformed_answer', 'context_overflow', ...).
      samples_correct: with pass@k, how many of the `EvalConfig.pass_samples` sampled episodes were correct (None
        without sampling).
    """

    task_id: str
    correct: bool
    reward: float
    tool_calls: int
    turns: int
    tool_errors: int
    status: str
    samples_correct: int | None = None


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Figures of one evaluation (see the module docstring).

    Attributes:
      num_tasks: tasks evaluated (n of the standard error).
      accuracy, accuracy_se: greedy exact-match share and its binomial standard error.
      mean_reward: mean `answer_reward` of the greedy episodes.
      pass_k: {k: pass@k} for k = 1..EvalConfig.pass_k (empty without sampling).
      tool_calls_per_episode, turns_per_episode, tool_errors_per_episode: means over the greedy episodes
        (turns = generated assistant turns, the final answer included).
      statuses: {status name: episodes} of the greedy episodes, every name of `rollout.STATUSES` present.
      correct: per task, in order, whether its greedy episode was correct.
      task_ids: the tasks, in order.
      seconds: wall time of the evaluation.
      outcomes: per task, in order, its `TaskOutcome` (empty in records written before they were kept).
    """

    num_tasks: int
    accuracy: float
    accuracy_se: float
    mean_reward: float
    pass_k: dict[int, float]
    tool_calls_per_episode: float
    turns_per_episode: float
    tool_errors_per_episode: float
    statuses: dict[str, int]
    correct: tuple[bool, ...]
    task_ids: tuple[str, ...]
    seconds: float = 0.0
    outcomes: tuple[TaskOutcome, ...] = ()

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat scalar metrics for `metrics.jsonl` / TensorBoard."""
        out = {f"{prefix}accuracy": self.accuracy, f"{prefix}accuracy_se": self.accuracy_se,
               f"{prefix}mean_reward": self.mean_reward, f"{prefix}tool_calls": self.tool_calls_per_episode,
               f"{prefix}turns": self.turns_per_episode, f"{prefix}tool_errors": self.tool_errors_per_episode,
               f"{prefix}num_tasks": float(self.num_tasks), f"{prefix}seconds": self.seconds}
        out.update({f"{prefix}pass@{k}": v for k, v in self.pass_k.items()})
        out.update({f"{prefix}status/{name}": count / max(1, self.num_tasks) for name, count in self.statuses.items()})
        return out

    def to_json(self) -> dict:
        """The result as JSON values (pass@k keys as strings; `outcomes` as one dict per task)."""
        out = dataclasses.asdict(self)
        out["pass_k"] = {str(k): v for k, v in self.pass_k.items()}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "EvalResult":
        """The inverse of `to_json`; a record written before per-task outcomes were kept reads with none."""
        data = dict(data)
        data["pass_k"] = {int(k): v for k, v in data["pass_k"].items()}
        data["correct"], data["task_ids"] = tuple(data["correct"]), tuple(data["task_ids"])
        data["outcomes"] = tuple(TaskOutcome(**o) for o in data.get("outcomes") or ())
        return cls(**data)


def binomial_se(p: float, n: int) -> float:
    """Standard error of a share p estimated from n independent trials: sqrt(p (1 - p) / n) (0 for n = 0)."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else 0.0


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021).

    The product form avoids huge binomials: C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i).
    """
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n samples, got k={k}, n={num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct={num_correct} must be in [0, {num_samples}]")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


def episode_correct(episode: EpisodeRecord) -> bool:
    """Exact match of the episode's final answer against the gold answer and aliases (False without an answer:
    a `malformed_answer` whose text happens to match counts, as the reward does; see `answers.answer_reward`)."""
    return episode.answer is not None and exact_match(episode.answer, episode.gold)


def _run(model_config, params, chat, tasks, browser, rollout, rng, batch_size, first_task, **kwargs):
    """Episodes of `tasks` (the list's tasks from position `first_task` on) in chunks of `batch_size` tasks, and
    each episode's reward. Row keys count from the first task of the whole list, so a task's samples do not depend
    on the chunk or the process that runs it."""
    episodes: list[EpisodeRecord] = []
    rewards: list[np.ndarray] = []
    chunks = -(-len(tasks) // batch_size)
    if distributed.spans_processes(kwargs.get("mesh")):  # collective programs: as many calls on every process
        chunks = distributed.agree_max(chunks)
    for start in range(0, chunks * batch_size, batch_size):
        chunk = tasks[start:start + batch_size]  # empty on a process whose part ran out: it still takes part
        result = run_episodes(model_config, params, chat, chunk, browser, rollout, rng,
                              row_offset=(first_task + start) * rollout.group_size, **kwargs)
        episodes += result.episodes
        rewards.append(np.asarray(result.batch.reward)[episode_view(result.batch).last_row])  # one per episode
    return episodes, (np.concatenate(rewards) if rewards else np.zeros(0, np.float32))


# A process's outcomes travel to the others as float32 rows (exact: rewards are float32, counts small integers)
_COLUMNS = ("index", "correct", "reward", "tool_calls", "turns", "tool_errors", "status", "samples_correct")


def _outcome_rows(indices, episodes, rewards, samples_correct) -> np.ndarray:
    rows = [(i, episode_correct(e), r, len(e.tool_calls), len(e.turn_texts), e.num_tool_errors,
             STATUSES.index(e.status), -1 if c is None else c)
            for i, e, r, c in zip(indices, episodes, rewards, samples_correct)]
    return np.asarray(rows, np.float32).reshape(len(rows), len(_COLUMNS))


def _outcomes_from_rows(rows: np.ndarray, task_ids: Sequence[str]) -> tuple[TaskOutcome, ...]:
    """The outcomes of `rows` (any order, each task once) in task order."""
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    if rows[:, 0].astype(int).tolist() != list(range(len(task_ids))):
        raise ValueError(f"the gathered outcomes cover tasks {rows[:, 0].astype(int).tolist()}, not each of the "
                         f"{len(task_ids)} tasks once: every process must evaluate the same task list")
    return tuple(TaskOutcome(task_id=task_ids[int(i)], correct=bool(c), reward=float(r), tool_calls=int(calls),
                             turns=int(turns), tool_errors=int(errors), status=STATUSES[int(status)],
                             samples_correct=None if hits < 0 else int(hits))
                 for i, c, r, calls, turns, errors, status, hits in rows)


def result_from_outcomes(outcomes: Sequence[TaskOutcome], *, pass_k: int = 0, pass_samples: int = 0,
                         seconds: float = 0.0) -> EvalResult:
    """The figures of an evaluation (module docstring) from its per-task outcomes, in the given task order;
    pass@1..pass@`pass_k` from each task's `samples_correct` of `pass_samples` (pass_k = 0: none)."""
    outcomes = tuple(outcomes)
    n = len(outcomes)
    if not n:
        raise ValueError("an evaluation needs at least one task outcome")
    accuracy = sum(o.correct for o in outcomes) / n
    statuses = {name: 0 for name in STATUSES}
    for o in outcomes:
        statuses[o.status] += 1
    pass_at = {}
    if pass_k:
        if any(o.samples_correct is None for o in outcomes):
            raise ValueError(f"pass@{pass_k} needs every outcome's samples_correct (the sampled episodes' count)")
        pass_at = {k: float(np.mean([pass_at_k(pass_samples, o.samples_correct, k) for o in outcomes]))
                   for k in range(1, pass_k + 1)}
    return EvalResult(
        num_tasks=n, accuracy=accuracy, accuracy_se=binomial_se(accuracy, n),
        mean_reward=float(np.mean([o.reward for o in outcomes])), pass_k=pass_at,
        tool_calls_per_episode=float(np.mean([o.tool_calls for o in outcomes])),
        turns_per_episode=float(np.mean([o.turns for o in outcomes])),
        tool_errors_per_episode=float(np.mean([o.tool_errors for o in outcomes])), statuses=statuses,
        correct=tuple(o.correct for o in outcomes), task_ids=tuple(o.task_id for o in outcomes), seconds=seconds,
        outcomes=outcomes)


def evaluate(model_config, params, chat, tasks: Sequence[Any], browser, rollout: RolloutConfig,
             config: EvalConfig = EvalConfig(), *, mesh=None, rules=None, logits_hook=None,
             across_processes: bool = True) -> EvalResult:
    """Evaluate the policy on `tasks` (all of them; slice to `config.num_tasks` before calling).

    Greedy episodes give accuracy and the episode statistics; with `config.pass_k > 0`, `config.pass_samples`
    sampled episodes per task (temperature `config.temperature`) give pass@1..pass@k.

    Args:
      model_config, params, chat: the policy and its chat format.
      tasks: held-out tasks (`question`, `answer`, optional `aliases`, `task_id`).
      browser: the rollouts' `Browser` (or `task -> Browser` factory).
      rollout: the training rollouts' limits (max_turns, max_context, ...); its group size and sampling are
        replaced here (1 greedy sample; n sampled ones for pass@k), and its max_turns by `config.max_turns` when
        that is set.
      config: the `EvalConfig`.
      mesh, rules: passed to `run_episodes` (with several processes: the run's mesh over all of them).
      logits_hook: passed to `run_episodes` (tests only).
      across_processes: with several JAX processes, each runs its part of the tasks and the outcomes are gathered
        (a collective: every process calls this with the same tasks and gets the same result). False: this
        process runs every task and talks to no other.
    """
    start = time.perf_counter()
    tasks = list(tasks)
    if not tasks:
        raise ValueError("evaluate needs at least one task")
    task_ids = [str(getattr(task, "task_id", i)) for i, task in enumerate(tasks)]
    part = distributed.process_part(len(tasks)) if across_processes else slice(0, len(tasks))
    mine = tasks[part]
    # the keys the first chunk had when each chunk folded in its own start: a seed's draws stay what they were
    key = jax.random.PRNGKey(config.seed)
    if config.max_turns is not None:
        rollout = dataclasses.replace(rollout, max_turns=config.max_turns)
    greedy = dataclasses.replace(rollout, group_size=1, sampling=SamplingConfig(greedy=True))
    episodes, rewards = _run(model_config, params, chat, mine, browser, greedy, jax.random.fold_in(key, 0),
                             config.batch_size, part.start, mesh=mesh, rules=rules, logits_hook=logits_hook)
    samples_correct: list[int | None] = [None] * len(mine)
    if config.pass_k:
        samples = config.pass_samples
        sampled = dataclasses.replace(rollout, group_size=samples,
                                      sampling=SamplingConfig(temperature=config.temperature))
        sampled_episodes, _ = _run(model_config, params, chat, mine, browser, sampled,
                                   jax.random.fold_in(jax.random.fold_in(key, 1), 0),
                                   max(1, config.batch_size // samples), part.start, mesh=mesh, rules=rules,
                                   logits_hook=logits_hook)
        hits = np.asarray([episode_correct(e) for e in sampled_episodes], bool).reshape(len(mine), samples)
        samples_correct = [int(c) for c in hits.sum(axis=1)]
    rows = _outcome_rows(range(part.start, part.stop), episodes, rewards, samples_correct)
    if across_processes:
        rows = distributed.gather_rows(rows)
    return result_from_outcomes(_outcomes_from_rows(rows, task_ids), pass_k=config.pass_k,
                                pass_samples=config.pass_samples, seconds=time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Accuracy before and after, the difference and its standard error (paired when the tasks match)."""

    before: float
    after: float
    difference: float
    se: float
    paired: bool
    num_tasks: int

    def __str__(self) -> str:
        kind = "paired" if self.paired else "unpaired"
        return (f"held-out accuracy {100 * self.before:.1f}% -> {100 * self.after:.1f}% on {self.num_tasks} tasks: "
                f"difference {100 * self.difference:+.1f} +- {100 * self.se:.1f} points ({kind} binomial SE)")


def compare(before: EvalResult, after: EvalResult) -> Comparison:
    """The accuracy difference `after - before` with its standard error.

    Same task ids in the same order: paired SE = std(d_i) / sqrt(n) of the per-task differences d_i in {-1, 0, 1}
    (population std, matching `binomial_se`'s convention). Otherwise: sqrt(se_before^2 + se_after^2).
    """
    difference = after.accuracy - before.accuracy
    if before.task_ids == after.task_ids:
        d = np.asarray(after.correct, float) - np.asarray(before.correct, float)
        se = float(d.std() / math.sqrt(len(d)))
        return Comparison(before.accuracy, after.accuracy, difference, se, True, len(d))
    se = math.sqrt(before.accuracy_se ** 2 + after.accuracy_se ** 2)
    return Comparison(before.accuracy, after.accuracy, difference, se, False, min(before.num_tasks, after.num_tasks))


def format_comparison(before: EvalResult, after: EvalResult, *, before_label: str = "after warm start",
                      after_label: str = "after RL") -> str:
    """One line for logs and the end of a run: 'accuracy <before_label> X% -> <after_label> Y%, diff +- SE'."""
    c = compare(before, after)
    kind = "paired" if c.paired else "unpaired"
    return (f"held-out greedy accuracy ({c.num_tasks} tasks): {before_label} {100 * c.before:.1f}% -> "
            f"{after_label} {100 * c.after:.1f}%, difference {100 * c.difference:+.1f} +- {100 * c.se:.1f} points "
            f"({kind} binomial SE)")
