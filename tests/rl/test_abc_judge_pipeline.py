"""ABC inside the RL step: the step scorer chosen by `UpdateConfig.abc` (the LLM judge, served the scripted rubric
judge on 127.0.0.1, as `trace-jax serve --scripted-judge` serves it) scores the rollout, its answer turn folds into
the last tool step, and ABC-SFT trains only on the trajectory whose answer is correct.

One prompt, two scripted episodes of the same oracle search (search, open the page with the answer, answer): row 0
answers correctly, row 1 answers another task's answer after reading the right one.
"""

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.abc.judge import scripted_rubric_reply
from trace_jax.credit.config import CreditConfig
from trace_jax.envs.oracle import make_browser, trajectory_vocabulary
from trace_jax.envs.tasks import TaskConfig, generate_tasks
from trace_jax.envs.world import WorldConfig, build_world
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rl.abc_scoring import ABCScorerConfig
from trace_jax.rl.pipeline import RLPipeline, UpdateConfig, check_compatible
from trace_jax.rl.warmstart import WarmStartConfig, oracle_assistant_turns, oracle_trajectories
from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy, run_episodes
from trace_jax.serve import ScriptedBackend, ServeConfig, ServerThread, create_app
from trace_jax.train.config import LossConfig, OptimizerConfig
from trace_jax.train.optimizer import make_optimizer
from trace_jax.train.state import init_train_state

ROLLOUT = RolloutConfig(group_size=2, max_turns=3, max_context=768, turn_token_budget=48, with_tools=False,
                        max_observation_chars=2000, sampling=SamplingConfig(greedy=True), sync_every=8)


@pytest.fixture(scope="module")
def judge():
    backend = ScriptedBackend(scripted_rubric_reply, name="rubric-judge")
    with ServerThread(create_app(backend, ServeConfig())) as server:
        yield server.url + "/v1", backend


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    world = build_world(WorldConfig(seed=0, deep_fact_prob=0.0, noise_docs=5, distractors_per_doc=0,
                                    filler_per_doc=0))
    tasks = generate_tasks(world, 4, seed=0, config=TaskConfig(min_hops=1, max_hops=1,
                                                               type_weights=(("bridge", 1.0),)))
    tokenizer = load_tokenizer(build_word_tokenizer(trajectory_vocabulary(), tmp_path_factory.mktemp("tok")))
    chat = ChatFormat(tokenizer)
    browser = make_browser(world, view_lines=6, snippet_chars=60)
    results = oracle_trajectories(tasks, browser, WarmStartConfig(num_trajectories=len(tasks)))
    right = results[0]
    wrong = next(r for r in results[1:] if r.task.answer != right.task.answer)
    turns = oracle_assistant_turns(chat, right)
    scripts = [turns, turns[:-1] + [oracle_assistant_turns(chat, wrong)[-1]]]
    config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    params = models.init_params(config, jax.random.PRNGKey(0))
    rollout = run_episodes(config, params, chat, [right.task], browser, ROLLOUT, jax.random.PRNGKey(0),
                           logits_hook=ScriptedPolicy(scripts, config.vocab_size))
    return config, params, chat, browser, rollout


def _pipeline(env, update, credit=CreditConfig(estimator="abc_sft_online"), loss=LossConfig(mode="sft")):
    config, params, chat, browser, _ = env
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    check_compatible(credit, loss, update, ROLLOUT.group_size)
    pipeline = RLPipeline(config, chat, browser, ROLLOUT, credit, loss, update, optimizer)
    return pipeline, init_train_state(config, optimizer, params, jax.random.PRNGKey(0))


def test_the_scripted_rollout_has_one_right_and_one_wrong_answer_after_the_same_search(env):
    rollout = env[-1]
    assert [e.status for e in rollout.episodes] == ["answered", "answered"]
    assert np.asarray(rollout.batch.reward).tolist() == [1.0, 0.0]
    assert np.asarray(rollout.batch.num_turns).tolist() == [2, 2]


def test_the_judge_scores_the_rl_step_and_abc_sft_trains_only_the_correct_trajectory(env, judge):
    url, backend = judge
    update = UpdateConfig(abc=ABCScorerConfig(scorer="judge", judge_url=url, judge_model="rubric-judge",
                                              timeout_s=20, backoff_s=0.0))
    pipeline, state = _pipeline(env, update)
    calls = backend.calls
    prepared = pipeline.prepare(env[-1], None, num_prompts=1)
    assert backend.calls - calls == 6  # three generated turns per episode, one judge call each
    # folded (spec section 3): step 0 = search (neutral), step 1 = open (clue found) + the answer turn
    # row 0: 1 + 0.8 + 1 -> clip 2;  row 1: 1 + 0.8 - 0.8 (the answer was read and rejected) - 1 = 0
    np.testing.assert_allclose(prepared.step_rewards[:, :2], [[1.0, 2.0], [1.0, 0.0]], atol=1e-6)
    assert prepared.metrics["abc/flagged_steps"] == 0.0 and prepared.metrics["credit/kept_rows"] == 0.5
    mask = np.asarray(prepared.loss_batch.loss_mask)
    assert mask[0].sum() > 0 and mask[1].sum() == 0  # the wrong answer's trajectory is dropped, not down-weighted
    assert float(np.abs(np.asarray(prepared.loss_batch.advantages)[1]).max()) == 0.0
    before = np.asarray(jax.tree_util.tree_leaves(state.params)[0]).copy()
    state, metrics = pipeline.update(state, prepared)
    assert metrics["updates"] == 1.0 and np.isfinite(metrics["loss"])
    assert not np.array_equal(np.asarray(jax.tree_util.tree_leaves(state.params)[0]), before)


def test_the_judge_and_the_rules_give_the_pipeline_the_same_step_rewards(env, judge):
    url, _ = judge
    credit = CreditConfig(estimator="abc_grpo")
    by_judge, _ = _pipeline(env, UpdateConfig(abc=ABCScorerConfig(scorer="judge", judge_url=url,
                                                                  judge_model="rubric-judge")), credit, LossConfig())
    by_rules, _ = _pipeline(env, UpdateConfig(), credit, LossConfig())
    judged = by_judge.prepare(env[-1], None, num_prompts=1)
    ruled = by_rules.prepare(env[-1], None, num_prompts=1)
    np.testing.assert_array_equal(judged.step_rewards, ruled.step_rewards)
    np.testing.assert_array_equal(np.asarray(judged.loss_batch.advantages), np.asarray(ruled.loss_batch.advantages))


def test_a_judge_without_an_endpoint_fails_before_any_compute(monkeypatch):
    monkeypatch.delenv("TRACE_JAX_JUDGE_URL", raising=False)
    with pytest.raises(ValueError, match="ABCScorerConfig.judge_url"):
        check_compatible(CreditConfig(estimator="abc_grpo"), LossConfig(),
                         UpdateConfig(abc=ABCScorerConfig(scorer="judge")), 2)


@pytest.mark.parametrize("given", ["none", "evidence_placeholders"])
def test_a_task_without_a_clue_chain_is_judged_against_recovered_clues_once_per_question(given):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "abc"))
    from judge_cases import DOCS, GOLD, QUESTION, scripted_judge_and_agent, trajectories

    from trace_jax.envs.corpus import Corpus
    from trace_jax.rollout.batch import EpisodeRecord
    from trace_jax.rl.abc_scoring import ABCStepScoring

    _, steps, expected = next(t for t in trajectories() if t[0] == "rejected")
    from trace_jax.envs.tasks import Clue

    # an external task without a chain: no clues, or (data/external.py) one valueless clue per evidence document
    clues = () if given == "none" else (Clue("d1", "Alpha river", "evidence_doc", ""),)
    episode = EpisodeRecord(task_id="q", question=QUESTION, gold=tuple(GOLD), status="answered", clues=clues,
                            turn_texts=[s.assistant for s in steps],
                            tool_calls=[s.tool_call for s in steps if s.observation is not None],
                            observations=[s.observation for s in steps if s.observation is not None])
    backend = ScriptedBackend(scripted_judge_and_agent, name="rubric-judge")
    with ServerThread(create_app(backend, ServeConfig())) as server:
        scoring = ABCStepScoring(ABCScorerConfig(scorer="judge", judge_url=server.url + "/v1",
                                                 judge_model="rubric-judge", backoff_s=0.0),
                                 Corpus.from_records(DOCS))
        try:
            counts, metrics = scoring.score([episode, episode])
        finally:
            scoring.close()
    assert [[(c.n_found, c.n_excluded, c.n_rejected, c.ans) for c in row] for row in counts] == [expected] * 2
    assert metrics == {"abc/flagged_steps": 0.0, "abc/recovered_clues": 1.0, "abc/no_clues": 0.0}
    # one recovery for the two episodes of the question (the scripted agent's 4 tool turns + its clue list), then
    # one judge call per step of each episode
    assert backend.calls == 5 + 2 * len(steps)


def test_an_episode_too_long_for_the_judge_is_scored_neutral_and_flagged_not_fatal(env):
    from trace_jax.abc.judge import JudgeContextExceeded
    from trace_jax.rl.abc_scoring import ABCStepScoring

    class TooLong:
        def score(self, *, question, gold, clues, steps):
            raise JudgeContextExceeded(2, len(steps), "maximum context length is 8 tokens")

    scoring = ABCStepScoring(ABCScorerConfig(scorer="judge", judge_url="http://127.0.0.1:9/v1", judge_model="m",
                                             recover_clues=False))
    scoring.scorer = TooLong()
    counts, metrics = scoring.score(env[-1].episodes)
    assert metrics["abc/flagged_steps"] == 1.0
    assert [[(c.n_found, c.n_excluded, c.n_rejected, c.ans) for c in row] for row in counts] == [
        [(0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1)], [(0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, -1)]]
    assert "context" in counts[0][0].note
