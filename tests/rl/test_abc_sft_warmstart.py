"""ABC-SFT as the warm start (credit-spec section 3; docs/abc.md, "ABC-SFT, the warm start"): a share of the oracle
demonstrations fails on purpose, each demonstration step is scored by the RL step's ABC scorer, and that step's
assistant tokens are weighted by `2 sigmoid(2 (r_t - 1))` in the SFT loss.

The weighted loss is checked against a float64 numpy reference computed here from the scorer's counts alone: the
answer turn folded into the last tool step by hand, the rubric, the weight formula, the weight of each step put on
the tokens of its turns, and the loss `sum(-w log p) / sum(mask)` on random log-probs.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import SMALL, WARM_START_TURNS
from trace_jax.abc.rules import RuleBasedStepScorer, steps_from_episode
from trace_jax.envs.answers import answer_reward
from trace_jax.envs.oracle import make_browser, trajectory_vocabulary
from trace_jax.envs.tasks import TaskConfig, generate_tasks
from trace_jax.envs.world import WorldConfig, build_world
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rl import cli as train_cli
from trace_jax.rl.abc_scoring import ABCScorerConfig, ABCStepScoring
from trace_jax.rl.warmstart import (WarmStartConfig, abc_sft_weighted, failing_demonstrations, oracle_trajectories,
                                    sft_arrays)
from trace_jax.rollout import RolloutConfig, SamplingConfig
from trace_jax.train.config import LossConfig
from trace_jax.train.loss import LossBatch, objective_from_logprobs

ROLLOUT = RolloutConfig(group_size=1, max_turns=8, max_context=2048, turn_token_budget=64,
                        max_observation_chars=300, sampling=SamplingConfig(greedy=True), sync_every=4)
RUBRIC = {"n_found": 0.8, "n_excluded": 0.4, "n_rejected": -0.8, "ans": 1.0, "tool_error": -1.0}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    world = build_world(WorldConfig(seed=0, deep_fact_prob=0.0, noise_docs=5))
    tasks = generate_tasks(world, 12, seed=0, config=TaskConfig(min_hops=1, max_hops=2))
    tokenizer = load_tokenizer(build_word_tokenizer(trajectory_vocabulary(), tmp_path_factory.mktemp("tok")))
    return tasks, ChatFormat(tokenizer), make_browser(world, view_lines=6, snippet_chars=60)


@pytest.mark.parametrize("share, count", [(0.0, 0), (0.25, 3), (0.35, 4), (0.5, 6)])
def test_the_share_of_failed_demonstrations_is_honoured(env, share, count):
    tasks, _, browser = env
    config = WarmStartConfig(num_trajectories=12, failed_share=share, oracle_seed=1)
    failing = failing_demonstrations(config)
    results = oracle_trajectories(tasks, browser, config)
    assert len(failing) == count and len(results) == 12  # the oracle solves every other one here
    assert [i for i, r in enumerate(results) if not r.solved] == sorted(failing)


def test_the_failed_demonstrations_are_drawn_from_the_oracle_seed():
    picks = [failing_demonstrations(WarmStartConfig(num_trajectories=40, failed_share=0.35, oracle_seed=s))
             for s in (0, 0, 1)]
    assert picks[0] == picks[1] != picks[2]
    assert set(picks[0].values()) == {"wrong_page", "give_up"}


def _reference_token_weights(arrays, answer_weight):
    """float64 token weights: the scorer's counts, folded, scored, weighted and put on the tokens by hand."""
    out = np.zeros(arrays.loss_mask.shape, np.float64)
    scorer = RuleBasedStepScorer()
    for n, episode in enumerate(arrays.episodes):
        counts = scorer.score(question=episode.question, gold=episode.gold, clues=episode.clues,
                              steps=steps_from_episode(episode))
        raw = [1.0 + sum(weight * float(getattr(c, name)) for name, weight in RUBRIC.items()) for c in counts]
        tool_calls = len(episode.observations)
        if tool_calls >= 1:  # the answer turn joins the last tool step: its counts add before the clip
            raw = raw[:tool_calls - 1] + [raw[tool_calls - 1] + raw[tool_calls] - 1.0]
        rewards = np.clip(np.array(raw, np.float64), 0.0, 2.0)
        step_weights = 2.0 / (1.0 + np.exp(-2.0 * (rewards - 1.0)))
        turns = arrays.turn_index[n]
        last_turn = turns.max()
        for t in np.nonzero(arrays.loss_mask[n] > 0)[0]:
            step = min(turns[t], len(step_weights) - 1)
            out[n, t] = step_weights[step] * (answer_weight if turns[t] == last_turn else 1.0)
    return out


def test_abc_sft_weighs_the_loss_of_demonstrations_with_failures_as_the_float64_reference(env):
    tasks, chat, browser = env
    config = WarmStartConfig(num_trajectories=12, failed_share=0.5, oracle_seed=2)
    arrays = sft_arrays(chat, ROLLOUT, browser, oracle_trajectories(tasks, browser, config), answer_weight=2.0)
    weighted, metrics = abc_sft_weighted(arrays, ABCStepScoring(ABCScorerConfig()))
    reference = _reference_token_weights(arrays, 2.0)
    np.testing.assert_allclose(weighted.weights, reference, rtol=1e-6, atol=1e-7)
    correct = [answer_reward(e.turn_texts[-1], e.gold).exact for e in arrays.episodes]
    assert 0 < sum(correct) < len(correct)  # demonstrations with failures (a few long ones did not fit the rollout)
    assert metrics["abc_sft/correct_share"] == pytest.approx(np.mean(correct))
    assert metrics["abc_sft/failed_share"] == pytest.approx(1 - np.mean(correct))
    # failed demonstrations are down-weighted on their last step, correct ones up-weighted
    assert reference[reference > 0].min() < 0.5 and reference.max() > 1.5 * 2.0

    rng = np.random.default_rng(0)
    logp = -rng.exponential(2.0, arrays.tokens.shape).astype(np.float32)
    batch = LossBatch(tokens=jnp.asarray(arrays.tokens), positions=jnp.asarray(arrays.positions),
                      loss_mask=jnp.asarray(arrays.loss_mask), advantages=jnp.asarray(weighted.weights),
                      behaviour_logprobs=jnp.zeros(arrays.tokens.shape, jnp.float32))
    objective_sum, sums = objective_from_logprobs(LossConfig(mode="sft"), jnp.asarray(logp), None, batch)
    loss_sum, count = (float(x) for x in sums["loss"])
    expected = np.sum(-reference * logp.astype(np.float64) * arrays.loss_mask) / np.sum(arrays.loss_mask)
    assert loss_sum / count == pytest.approx(expected, rel=1e-5)


def test_abc_weighting_uses_the_scorer_options(env):
    tasks, chat, browser = env
    config = WarmStartConfig(num_trajectories=12, failed_share=0.5, oracle_seed=2)
    arrays = sft_arrays(chat, ROLLOUT, browser, oracle_trajectories(tasks, browser, config))
    strict, _ = abc_sft_weighted(arrays, ABCStepScoring(ABCScorerConfig()))
    lenient, _ = abc_sft_weighted(arrays, ABCStepScoring(ABCScorerConfig(error_step="neutral", no_answer=0)))
    # oracle demonstrations always answer: only failed tool calls (a detour's absent `find` is no error) could differ
    errors = sum(o.startswith("Error: ") for e in arrays.episodes for o in e.observations)
    assert (errors == 0) == np.array_equal(strict.weights, lenient.weights)


def test_a_bad_weighting_or_failed_share_names_the_field():
    with pytest.raises(ValueError, match="WarmStartConfig.weighting"):
        WarmStartConfig(weighting="abc_sft")
    with pytest.raises(ValueError, match="WarmStartConfig.failed_share"):
        WarmStartConfig(failed_share=1.0)


@pytest.mark.slow  # a warm start of 3 SFT steps, then an ABC-GRPO step of the small config (~20 s)
def test_the_abc_pipeline_config_runs_an_rl_step_after_its_abc_sft_warm_start(tmp_path, capsys):
    gin_file = tmp_path / "small.gin"
    gin_file.write_text(SMALL + WARM_START_TURNS + "include 'configs/credit/abc_pipeline.gin'\nTrainConfig.steps = 1\n"
                        "WarmStartConfig.steps = 3\nWarmStartConfig.num_trajectories = 6\n"
                        "WarmStartConfig.batch_size = 3\nWarmStartConfig.failed_share = 0.5\n")
    run_dir = tmp_path / "run"
    assert train_cli.run_train([str(gin_file)], [], str(run_dir), progress=False) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "ABC-SFT weights" in line]
    failed = float(line.split("abc_sft/failed_share ")[1].split(",")[0])
    assert 0 < failed < 1  # failed demonstrations among those that fit the small rollout budget
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["estimator"] == "abc_grpo" and "warm_start" in summary["seconds"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in steps if "reward" in line] == [1]
    operative = (run_dir / "config.gin").read_text()
    assert "WarmStartConfig.weighting = 'abc'" in operative
