"""Held-out evaluation: accuracy, pass@k, episode statistics and the before/after comparison equal a hand count."""

import dataclasses
import itertools
import json
import math
import types

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig, ScriptedPolicy
from trace_jax.rollout.batch import episode_view
from trace_jax.rl import evaluate as evaluate_lib
from trace_jax.rl.evaluate import (
    EvalConfig,
    EvalResult,
    TaskOutcome,
    binomial_se,
    compare,
    evaluate,
    format_comparison,
    pass_at_k,
    result_from_outcomes,
)
from trace_jax.train import distributed

DOCS = [{"docid": "d1", "url": "https://wiki.example/alpha", "title": "Alpha river",
         "text": "The Alpha river flows through Paris."}]
WORDS = ["Alpha", "river", "flows", "through", "Paris", "Rome", "Lina", "Voss", "search", "query", "answer", "The", "is"]
TASKS = [types.SimpleNamespace(task_id=f"q{i}", question=q, answer=a, aliases=al) for i, (q, a, al) in enumerate([
    ("Where does the Alpha river flow?", "Paris", ()),
    ("Who is the mayor?", "Lina Voss", ()),
    ("Which city?", "Rome", ("Roma",)),
    ("Which river?", "Alpha", ()),
])]
ROLLOUT = RolloutConfig(max_turns=2, max_context=512, turn_token_budget=32, system_prompt="Use tools.",
                        with_tools=False, sync_every=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = load_tokenizer(build_word_tokenizer(WORDS, tmp_path_factory.mktemp("tok")))
    chat = ChatFormat(tokenizer)
    config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer))
    params = models.init_params(config, jax.random.PRNGKey(0))
    return chat, config, params, Browser(Corpus.from_records(DOCS))


def answer(chat, text):
    return chat.assistant_content_ids(f"The answer is {text}.\n<answer>{text}</answer>") + [chat.im_end_id]


def search(chat):
    return chat.assistant_content_ids(None, [{"name": "search", "arguments": {"query": "Alpha river"}}])


def greedy_scripts(chat):
    """Per task: correct after one search (2 turns, 1 call), wrong answer, an alias (correct), no answer at all
    (three searches: max_turns after 2 calls, 3 turns)."""
    return [[search(chat), answer(chat, "Paris")], [answer(chat, "Rome")], [answer(chat, "Roma")],
            [search(chat), search(chat), search(chat)]]


class ByLayout:
    """A logits hook that scripts the greedy run (1 row per task) and the sampled run (n rows per task) apart."""

    def __init__(self, vocab_size, greedy, sampled):
        self.greedy = ScriptedPolicy(greedy, vocab_size)
        self.sampled = ScriptedPolicy(sampled, vocab_size)
        self.rows = len(greedy)

    def __call__(self, turn_of_row, step, generated):
        hook = self.greedy if len(generated) == self.rows else self.sampled
        return hook(turn_of_row, step, generated)


def test_accuracy_reward_statuses_and_turns_equal_a_hand_count(setup):
    chat, config, params, browser = setup
    result = evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig(num_tasks=4),
                      logits_hook=ScriptedPolicy(greedy_scripts(chat), config.vocab_size))
    assert result.correct == (True, False, True, False)
    assert result.accuracy == 0.5 and result.accuracy_se == pytest.approx(math.sqrt(0.25 / 4))
    assert result.mean_reward == 0.5
    assert result.statuses == {"running": 0, "answered": 3, "malformed_answer": 0, "max_turns": 1,
                               "context_overflow": 0}
    assert result.tool_calls_per_episode == (1 + 0 + 0 + 2) / 4
    assert result.turns_per_episode == (2 + 1 + 1 + 3) / 4
    assert result.task_ids == ("q0", "q1", "q2", "q3") and result.pass_k == {}


@pytest.mark.slow  # two more compiled batch shapes of the sampler
def test_batches_of_tasks_give_the_same_figures_as_one_batch(setup):
    chat, config, params, browser = setup
    scripts = greedy_scripts(chat)

    class ByChunk:  # chunks of 3 then 1 task: scripts follow the chunk's tasks
        def __call__(self, turn_of_row, step, generated):
            chunk = scripts[:3] if len(generated) == 3 else scripts[3:]
            return ScriptedPolicy(chunk, config.vocab_size)(turn_of_row, step, generated)

    result = evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig(batch_size=3), logits_hook=ByChunk())
    assert result.correct == (True, False, True, False)


def test_pass_at_k_counts_correct_samples_per_task(setup):
    chat, config, params, browser = setup
    right, wrong = answer(chat, "Paris"), answer(chat, "Rome")
    # 3 samples per task: task 0 right in 2 of 3, task 1 in 0, task 2 ("Rome") in 3, task 3 ("Alpha") in 1.
    per_task = [[[right], [wrong], [right]], [[wrong]] * 3, [[wrong]] * 3, [[answer(chat, "Alpha")], [wrong], [wrong]]]
    sampled = [row for task in per_task for row in task]
    hook = ByLayout(config.vocab_size, greedy_scripts(chat), sampled)
    result = evaluate(config, params, chat, TASKS, browser, ROLLOUT,
                      EvalConfig(pass_k=2, pass_samples=3, batch_size=12), logits_hook=hook)
    hits = [2, 0, 3, 1]
    for k in (1, 2):
        expected = np.mean([1 - math.comb(3 - c, k) / math.comb(3, k) for c in hits])
        assert result.pass_k[k] == pytest.approx(expected)
    assert result.pass_k[1] == pytest.approx(6 / 12)


@pytest.mark.parametrize("seed", range(5))
def test_pass_at_k_matches_the_brute_force_share_of_k_subsets(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    c = int(rng.integers(0, n + 1))
    k = int(rng.integers(1, n + 1))
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_pass_at_k_rejects_k_above_the_samples():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def fake(correct, ids=None):
    n = len(correct)
    p = sum(correct) / n
    return EvalResult(num_tasks=n, accuracy=p, accuracy_se=binomial_se(p, n), mean_reward=p, pass_k={},
                      tool_calls_per_episode=0.0, turns_per_episode=1.0, tool_errors_per_episode=0.0, statuses={},
                      correct=tuple(correct), task_ids=tuple(ids or (f"t{i}" for i in range(n))))


def test_comparison_on_the_same_tasks_uses_the_paired_standard_error():
    before = fake([True, False, False, False])
    after = fake([True, True, True, False])
    result = compare(before, after)
    d = np.array([0, 1, 1, 0], float)
    assert result.paired and result.difference == pytest.approx(0.5)
    assert result.se == pytest.approx(d.std() / 2)
    line = format_comparison(before, after)
    assert "25.0% -> " in line and "75.0%" in line and "+50.0 +- 25.0 points" in line and "paired" in line


def test_comparison_on_different_tasks_uses_the_unpaired_standard_error():
    before = fake([True, False], ids=["a", "b"])
    after = fake([True, True, False, False], ids=["c", "d", "e", "f"])
    result = compare(before, after)
    assert not result.paired
    assert result.se == pytest.approx(math.sqrt(binomial_se(0.5, 2) ** 2 + binomial_se(0.5, 4) ** 2))


def test_eval_config_names_the_bad_field():
    with pytest.raises(ValueError, match="EvalConfig.pass_samples"):
        EvalConfig(pass_k=4, pass_samples=2)
    with pytest.raises(ValueError, match="EvalConfig.num_tasks"):
        EvalConfig(num_tasks=0)


# ------------------------------------------------------------------------------------------------ per-task outcomes
def test_each_task_keeps_its_outcome_in_task_order(setup):
    chat, config, params, browser = setup
    result = evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig(num_tasks=4),
                      logits_hook=ScriptedPolicy(greedy_scripts(chat), config.vocab_size))
    assert result.outcomes == (
        TaskOutcome("q0", True, 1.0, tool_calls=1, turns=2, tool_errors=0, status="answered"),
        TaskOutcome("q1", False, 0.0, tool_calls=0, turns=1, tool_errors=0, status="answered"),
        TaskOutcome("q2", True, 1.0, tool_calls=0, turns=1, tool_errors=0, status="answered"),
        TaskOutcome("q3", False, 0.0, tool_calls=2, turns=3, tool_errors=0, status="max_turns"))
    assert result_from_outcomes(result.outcomes, seconds=result.seconds) == result


def test_a_result_round_trips_through_json_with_its_outcomes(setup):
    chat, config, params, browser = setup
    result = evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig(num_tasks=4),
                      logits_hook=ScriptedPolicy(greedy_scripts(chat), config.vocab_size))
    data = json.loads(json.dumps(result.to_json()))
    assert data["outcomes"][3] == {"task_id": "q3", "correct": False, "reward": 0.0, "tool_calls": 2, "turns": 3,
                                   "tool_errors": 0, "status": "max_turns", "samples_correct": None}
    assert EvalResult.from_json(data) == result


def test_a_record_written_before_outcomes_were_kept_reads_with_none():
    older = fake([True, False]).to_json()
    del older["outcomes"]
    read = EvalResult.from_json(older)
    assert read.outcomes == () and read.correct == (True, False) and read.accuracy == 0.5


def test_pass_at_k_comes_from_each_tasks_count_of_correct_samples():
    outcomes = [TaskOutcome(f"t{i}", False, 0.0, 0, 1, 0, "answered", samples_correct=c) for i, c in enumerate([2, 0])]
    result = result_from_outcomes(outcomes, pass_k=2, pass_samples=3)
    assert result.pass_k == {1: pytest.approx((2 / 3 + 0) / 2), 2: pytest.approx((1 + 0) / 2)}
    with pytest.raises(ValueError, match="samples_correct"):
        result_from_outcomes([TaskOutcome("t", False, 0.0, 0, 1, 0, "answered")], pass_k=1, pass_samples=3)


# ------------------------------------------------------------------------------------------------ across processes
def _scripted_by_task(monkeypatch, vocab_size, scripts: dict, calls: list):
    """Make every `run_episodes` call of `evaluate` script its rows by their task (whatever chunk or process runs
    them) and record the task ids of each call."""
    run_episodes = evaluate_lib.run_episodes

    def scripted(model_config, params, chat, tasks, browser, rollout, rng, **kwargs):
        calls.append([t.task_id for t in tasks])
        kwargs["logits_hook"] = ScriptedPolicy([scripts[t.task_id] for t in tasks for _ in range(rollout.group_size)],
                                               vocab_size)
        return run_episodes(model_config, params, chat, tasks, browser, rollout, rng, **kwargs)

    monkeypatch.setattr(evaluate_lib, "run_episodes", scripted)


class _Collected(Exception):
    pass


def test_two_processes_each_run_their_part_and_get_the_one_process_result(setup, monkeypatch):
    """Two processes simulated in one: process 1 runs tasks q2, q3 and hands its outcome rows over; process 0 runs
    q0, q1 and receives both parts, process 1's first: the result is one process's."""
    chat, config, params, browser = setup
    scripts = dict(zip(("q0", "q1", "q2", "q3"), greedy_scripts(chat)))
    calls: list = []
    _scripted_by_task(monkeypatch, config.vocab_size, scripts, calls)
    one = evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig(), across_processes=False)
    assert calls == [["q0", "q1", "q2", "q3"]]

    handed_over = {}

    def gather_rows(rows):
        handed_over[current] = rows
        if current == 1:
            raise _Collected  # process 1's part is collected; process 0 assembles the whole
        return np.concatenate([handed_over[1], handed_over[0]])

    monkeypatch.setattr(evaluate_lib.distributed, "gather_rows", gather_rows)
    results = {}
    for current in (1, 0):
        calls.clear()
        monkeypatch.setattr(evaluate_lib.distributed, "process_part",
                            lambda count, i=current: evaluate_lib.distributed.process_share(count, process_index=i,
                                                                                            process_count=2))
        try:
            results[current] = evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig())
        except _Collected:
            pass
        assert calls == [[["q0", "q1"]], [["q2", "q3"]]][current]  # each process ran only its part
    assert dataclasses.replace(results[0], seconds=0.0) == dataclasses.replace(one, seconds=0.0)


def test_the_processes_parts_cover_every_task_once_even_when_uneven():
    parts = [distributed.process_part(5, process_index=i, process_count=3) for i in range(3)]
    assert parts == [slice(0, 1), slice(1, 3), slice(3, 5)]
    assert distributed.process_part(1, process_index=0, process_count=2) == slice(0, 0)  # nothing to do


@pytest.mark.slow  # two more sampled batch shapes
def test_a_tasks_sampled_episodes_do_not_depend_on_the_chunk_that_runs_it(setup, monkeypatch):
    """pass@k's samples of a task draw the same tokens in any chunk (or process): row keys count from the first
    task of the whole list."""
    chat, config, params, browser = setup
    run_episodes = evaluate_lib.run_episodes
    tokens: dict[int, list] = {}

    def recording(model_config, params, chat, tasks, browser, rollout, rng, **kwargs):
        result = run_episodes(model_config, params, chat, tasks, browser, rollout, rng, **kwargs)
        if rollout.group_size > 1:
            rows = np.asarray(result.batch.tokens)
            view = episode_view(result.batch)
            tokens[len(tasks)] = tokens.get(len(tasks), []) + [
                rows[view.last_row[e]][:np.asarray(result.batch.loss_mask)[view.last_row[e]].nonzero()[0].max() + 1]
                .tolist() for e in range(len(result.episodes))]
        return result

    monkeypatch.setattr(evaluate_lib, "run_episodes", recording)
    sampled = dict(pass_k=1, pass_samples=2, temperature=1.0)
    evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig(batch_size=8, **sampled))  # one chunk of 4
    evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig(batch_size=2, **sampled))  # 4 chunks of 1
    assert len(tokens[4]) == len(tokens[1]) == 8
    assert tokens[4] == tokens[1]
    assert len({tuple(t) for t in tokens[4]}) > 1  # sampled, not all alike
