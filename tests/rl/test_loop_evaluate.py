"""Held-out evaluation: accuracy, pass@k, episode statistics and the before/after comparison equal a hand count."""

import itertools
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
from trace_jax.rl.evaluate import (
    EvalConfig,
    EvalResult,
    binomial_se,
    compare,
    evaluate,
    format_comparison,
    pass_at_k,
)

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
