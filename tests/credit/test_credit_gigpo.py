"""GiGPO (`gigpo`): equal to a float64 loop written from the paper's definitions, including the degenerate anchors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_jax import credit
from trace_jax.credit import reference as ref

GROUPS, G, T = 3, 4, 5


def random_groups(seed, *, key_mode="history"):
    """GROUPS prompts x G trajectories; each tool call sees one of two observations, so histories collide often.

    key_mode: "history" (states keyed by observation history, S_0 shared), "unique" (no state shared by two
    steps), "shared" (every step of a prompt group starts from the same state).
    """
    rng = np.random.default_rng(seed)
    n = GROUPS * G
    num_turns = rng.integers(0, T + 1, size=n)
    group_id = np.repeat(np.arange(GROUPS), G)
    rewards = rng.integers(0, 2, size=n).astype(np.float32)
    rewards[::5] = rng.uniform(0, 1)  # some non-binary rewards
    keys = []
    for i in range(n):
        if key_mode == "history":
            observations = [f"page {rng.integers(0, 2)}" for _ in range(num_turns[i])]
            keys.append([(group_id[i], k) for k in credit.history_state_keys(observations)])
        elif key_mode == "unique":
            keys.append([(i, k) for k in range(num_turns[i] + 1)])
        else:
            keys.append([group_id[i]] * (num_turns[i] + 1))
    return rewards, group_id, num_turns, keys


def layout(num_turns, length=3 * (T + 2) + 2):
    """Token layout: 2 prompt tokens, then per turn 2 assistant tokens and 1 observation token."""
    n = len(num_turns)
    turn_index = np.full((n, length), -1, np.int32)
    loss_mask = np.zeros((n, length), np.int32)
    for i in range(n):
        pos = 2
        for k in range(num_turns[i] + 1):
            turn_index[i, pos:pos + 2] = k
            loss_mask[i, pos:pos + 2] = 1
            pos += 3
    return turn_index, loss_mask


def inputs_for(rewards, group_id, num_turns, keys):
    turn_index, loss_mask = layout(num_turns)
    return credit.CreditInputs(
        rewards=jnp.asarray(rewards), group_id=jnp.asarray(group_id, jnp.int32), loss_mask=jnp.asarray(loss_mask),
        turn_index=jnp.asarray(turn_index), num_turns=jnp.asarray(num_turns, jnp.int32),
        anchor_keys=jnp.asarray(credit.anchor_key_ids(keys, T + 1)))


@given(st.integers(0, 10_000), st.sampled_from(["history", "unique", "shared"]),
       st.sampled_from([0.95, 0.5, 1.0]), st.sampled_from([1.0, 0.3]), st.sampled_from(["population", "none"]))
def test_gigpo_matches_the_loop_reference(seed, key_mode, gamma, omega, step_std):
    rewards, group_id, num_turns, keys = random_groups(seed, key_mode=key_mode)
    result = credit.compute_advantages("gigpo", inputs_for(rewards, group_id, num_turns, keys), check=True,
                                       gamma=gamma, omega=omega, step_std=step_std)
    want = ref.gigpo_ref(rewards, group_id, keys, num_turns, gamma=gamma, omega=omega, step_std=step_std)
    for i, row in enumerate(want):
        np.testing.assert_allclose(result.per_turn[i, :len(row)], row, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(result.per_turn[i, len(row):], 0.0)


def test_no_shared_state_leaves_only_the_episode_term():
    rewards, group_id, num_turns, keys = random_groups(3, key_mode="unique")
    inputs = inputs_for(rewards, group_id, num_turns, keys)
    gigpo = credit.compute_advantages("gigpo", inputs)
    grpo = credit.compute_advantages("grpo", inputs)
    np.testing.assert_allclose(gigpo.token_advantages, grpo.token_advantages, atol=1e-6)


def test_all_steps_sharing_one_state_compare_every_return_of_the_group():
    rewards = np.array([1.0, 0.0], np.float32)
    num_turns = np.array([1, 0])
    keys = [[7, 7], [7]]  # one anchor group {G_0 of row 0 = 0.95, G_1 of row 0 = 1, G_0 of row 1 = 0}
    result = credit.compute_advantages("gigpo", inputs_for(rewards, np.array([0, 0]), num_turns, keys))
    returns = np.array([0.95, 1.0, 0.0])
    z = (returns - returns.mean()) / returns.std()
    np.testing.assert_allclose(result.per_turn[0, :2], 1.0 + z[:2], atol=1e-5)  # A_E = +1 for the solved row
    np.testing.assert_allclose(result.per_turn[1, :1], -1.0 + z[2:], atol=1e-5)


def test_shared_initial_state_ranks_trajectories_by_discounted_return():
    """Two solved trajectories from S_0: the shorter one reaches the reward sooner, so its first step is better."""
    rewards = np.array([1.0, 1.0], np.float32)
    num_turns = np.array([1, 3])
    keys = [credit.history_state_keys(["a"]), credit.history_state_keys(["b", "c", "d"])]
    result = credit.compute_advantages("gigpo", inputs_for(rewards, np.array([0, 0]), num_turns, keys))
    assert float(result.outcome_advantages[0]) == 0.0  # equal rewards: no episode-level signal
    assert result.per_turn[0, 0] == pytest.approx(1.0) and result.per_turn[1, 0] == pytest.approx(-1.0)
    np.testing.assert_array_equal(result.per_turn[1, 1:4], 0.0)  # states nobody else visited


def test_omega_zero_is_grpo_and_tokens_follow_turns():
    rewards, group_id, num_turns, keys = random_groups(5)
    inputs = inputs_for(rewards, group_id, num_turns, keys)
    np.testing.assert_allclose(credit.compute_advantages("gigpo", inputs, omega=0.0).token_advantages,
                               credit.compute_advantages("grpo", inputs).token_advantages, atol=1e-6)
    result = credit.compute_advantages("gigpo", inputs)
    turn_index, loss_mask = np.asarray(inputs.turn_index), np.asarray(inputs.loss_mask)
    want = np.where(loss_mask != 0, np.take_along_axis(np.asarray(result.per_turn), np.maximum(turn_index, 0), 1), 0)
    np.testing.assert_allclose(result.token_advantages, want, atol=1e-6)


def test_gigpo_jits_and_ignores_padding_keys():
    rewards, group_id, num_turns, keys = random_groups(8)
    inputs = inputs_for(rewards, group_id, num_turns, keys)
    eager = credit.compute_advantages("gigpo", inputs).token_advantages
    padded = np.asarray(inputs.anchor_keys).copy()
    padded[np.arange(T + 1)[None, :] > num_turns[:, None]] = 0  # padding that collides with real keys
    jitted = jax.jit(lambda x: credit.compute_advantages("gigpo", x).token_advantages)(
        inputs._replace(anchor_keys=jnp.asarray(padded)))
    np.testing.assert_allclose(jitted, eager, atol=1e-6)


def test_history_keys_share_the_initial_state_and_part_on_the_first_different_observation():
    a = credit.history_state_keys(["x", "y"])
    b = credit.history_state_keys(["x", "z"])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert credit.history_state_keys(["ab", "c"])[2] != credit.history_state_keys(["a", "bc"])[2]


def test_missing_or_float_anchor_keys_are_named():
    rewards, group_id, num_turns, keys = random_groups(1)
    inputs = inputs_for(rewards, group_id, num_turns, keys)
    with pytest.raises(ValueError, match="needs CreditInputs.anchor_keys"):
        credit.compute_advantages("gigpo", inputs._replace(anchor_keys=None), check=True)
    with pytest.raises(ValueError, match="anchor_key_ids"):
        credit.compute_advantages("gigpo", inputs._replace(anchor_keys=inputs.anchor_keys * 1.0), check=True)


def random_observations(seed):
    """GROUPS prompts x G trajectories whose tool calls see one of three pages, so equal current observations are
    reached through different histories."""
    rng = np.random.default_rng(seed)
    n = GROUPS * G
    num_turns = rng.integers(0, T + 1, size=n)
    rewards = rng.integers(0, 2, size=n).astype(np.float32)
    observations = [[f"page {rng.integers(0, 3)}" for _ in range(num_turns[i])] for i in range(n)]
    return rewards, np.repeat(np.arange(GROUPS), G), num_turns, observations


@settings(max_examples=10)
@given(st.integers(0, 10_000), st.sampled_from(["population", "none"]))
def test_observation_anchors_equal_a_plain_loop_over_current_observations(seed, step_std):
    rewards, group_id, num_turns, observations = random_observations(seed)
    keys = [credit.state_keys(obs, "observation") for obs in observations]
    result = credit.compute_advantages("gigpo", inputs_for(rewards, group_id, num_turns, keys), check=True,
                                       step_std=step_std)
    want = ref.gigpo_current_observation_ref(rewards, group_id, observations, num_turns, step_std=step_std)
    for i, row in enumerate(want):
        np.testing.assert_allclose(result.per_turn[i, :len(row)], row, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(result.per_turn[i, len(row):], 0.0)


def test_observation_anchors_group_steps_that_reach_one_page_by_different_paths():
    """Row 0 reads page A then C, row 1 page B then C: by observation their third steps share the anchor C (and
    compare returns), by history they do not (each is alone: step advantage 0)."""
    rewards = np.array([1.0, 0.0], np.float32)
    observations = [["A", "C"], ["B", "C"]]
    num_turns = np.array([2, 2])
    per_turn = {}
    for anchor in ("observation", "history"):
        keys = [credit.state_keys(obs, anchor) for obs in observations]
        per_turn[anchor] = np.asarray(credit.compute_advantages(
            "gigpo", inputs_for(rewards, np.array([0, 0]), num_turns, keys)).per_turn)
    outcome = np.array([1.0, -1.0])
    np.testing.assert_allclose(per_turn["history"][:, 2], outcome, atol=1e-6)
    np.testing.assert_allclose(per_turn["observation"][:, 2], outcome + np.array([1.0, -1.0]), atol=1e-6)
    np.testing.assert_allclose(per_turn["observation"][:, 1], per_turn["history"][:, 1], atol=1e-6)


def test_observation_is_the_default_anchor_and_the_initial_state_is_shared():
    assert credit.CreditConfig().gigpo_anchor == "observation"
    a, b = credit.state_keys(["x", "y"]), credit.state_keys(["z", "y"])
    assert a[0] == b[0] and a[1] != b[1] and a[2] == b[2]
    with pytest.raises(ValueError, match="CreditConfig.gigpo_anchor"):
        credit.state_keys(["x"], "page")


@pytest.mark.slow
def test_rollout_exposes_the_anchor_state_of_every_turn_and_the_clue_chain(tmp_path):
    """A scripted group of two: both search the same query first (shared S_0 and S_1), then only one opens a page."""
    import types

    from trace_jax import models
    from trace_jax.envs.browser import Browser
    from trace_jax.envs.corpus import Corpus
    from trace_jax.envs.tasks import Clue
    from trace_jax.models.chat import ChatFormat
    from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
    from trace_jax.rollout import RolloutConfig, ScriptedPolicy, run_episodes
    from trace_jax.rollout.batch import anchor_keys

    docs = [{"docid": "d1", "url": "https://wiki.example/alpha", "title": "Alpha river",
             "text": "The Alpha river flows through Paris."}]
    words = ["Alpha", "river", "flows", "through", "Paris", "The", "search", "open", "query", "id", "answer"]
    tokenizer = load_tokenizer(build_word_tokenizer(words, tmp_path))
    chat = ChatFormat(tokenizer)
    config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer))
    params = models.init_params(config, jax.random.PRNGKey(0))
    clue = Clue("d1", "Alpha river", "on_river", "Paris")
    task = types.SimpleNamespace(task_id="q0", question="Where does the Alpha river flow?", answer="Paris",
                                 aliases=(), clues=(clue,))
    search = chat.assistant_content_ids(None, [{"name": "search", "arguments": {"query": "Alpha river"}}])
    open_first = chat.assistant_content_ids(None, [{"name": "open", "arguments": {"id": 0}}])
    answer = chat.assistant_content_ids("<answer>Paris</answer>") + [chat.im_end_id]
    rollout = RolloutConfig(group_size=2, max_turns=2, max_context=512, turn_token_budget=32, system_prompt="Go.",
                            with_tools=False, sync_every=1)
    hook = ScriptedPolicy([[search, answer], [search, open_first, answer]], config.vocab_size)
    result = run_episodes(config, params, chat, [task], Browser(Corpus.from_records(docs)), rollout,
                          jax.random.PRNGKey(0), logits_hook=hook)
    keys = anchor_keys(result.episodes, rollout.max_turns + 1)
    np.testing.assert_array_equal(np.asarray(result.batch.num_turns), [1, 2])
    assert keys[0, 0] == keys[1, 0] and keys[0, 1] == keys[1, 1] and keys[1, 2] not in keys[0, :2]
    assert all(episode.clues == (clue,) for episode in result.episodes)
    inputs = result.batch.credit_inputs(anchor_keys=jnp.asarray(keys))
    gigpo = credit.compute_advantages("gigpo", inputs, check=True)
    # both answered right: no episode signal; from the shared S_1 the row that answered at once has the larger return
    np.testing.assert_allclose(gigpo.outcome_advantages, [0.0, 0.0])
    assert float(gigpo.per_turn[0, 1]) > 0 > float(gigpo.per_turn[1, 1])
