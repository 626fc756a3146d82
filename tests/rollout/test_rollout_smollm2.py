"""Real model end to end: SmolLM2-135M-Instruct runs procedural-task episodes through the agent loop.

It mostly fails the tasks; the point is that real, messy generations (prose, code, unclosed tags, stop strings
made of several tokens) go through the loop and come out as a well-formed `TrajectoryBatch`.
"""

import jax
import numpy as np
import pytest

from trace_jax import credit, models
from trace_jax.envs.oracle import make_browser
from trace_jax.envs.tasks import generate_tasks
from trace_jax.envs.world import WorldConfig, build_world
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import load_tokenizer
from trace_jax.rollout import STATUSES, RolloutConfig, SamplingConfig, ScriptedPolicy, run_episodes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("optimized_xla")]  # runs the real model: optimised


def test_smollm2_runs_procedural_episodes_end_to_end(smollm2_hf_dir):
    config, params = models.load_pretrained(smollm2_hf_dir)
    chat = ChatFormat(load_tokenizer(smollm2_hf_dir))
    assert chat.assistant_stop_strings == ("</tool_call>",)  # SmolLM2 spells the tag with several tokens
    world = build_world(WorldConfig.from_corpus_size(40, seed=3))
    tasks = generate_tasks(world, 1, seed=0)
    # The scripted call is 33 tokens, within a turn's 34. With the hook the engine decodes one step a dispatch, each
    # a ~0.1 s read of every weight on a CPU. Observations cut to 80 characters: the search result's and the error's
    # prefill then share one width (64), so one prefill program fewer compiles. Rows are ~185 tokens.
    rollout = RolloutConfig(group_size=2, max_turns=1, max_context=256, turn_token_budget=34,
                            sampling=SamplingConfig(temperature=0.7, top_p=0.95), with_tools=False,
                            max_observation_chars=80)
    # Row 0 plays a real tool call (SmolLM2 spells </tool_call> with several tokens) and the gold answer; row 1 is
    # the model's own messy generation.
    call = chat.assistant_content_ids("Let me search.", [{"name": "search", "arguments": {"query": "population"}}])
    answer = chat.assistant_content_ids(f"<answer>{tasks[0].answer}</answer>") + [chat.im_end_id]
    hook = ScriptedPolicy([[call, answer]], config.vocab_size)
    result = run_episodes(config, params, chat, tasks, make_browser(world), rollout, jax.random.PRNGKey(0),
                          logits_hook=hook)
    batch = result.batch
    n = 2
    assert batch.tokens.shape == (n, 256) and batch.boundaries.shape == (n, 2)
    scripted = result.episodes[0]
    assert scripted.status == "answered" and float(batch.reward[0]) == 1.0
    assert scripted.tool_calls[0] == ("search", {"query": "population"})
    assert not scripted.observations[0].startswith("Error")
    assert scripted.turn_texts[0].endswith("</tool_call>")  # stopped by the stop string, overshoot rolled back
    start = int(batch.boundaries[0, 0])
    np.testing.assert_array_equal(batch.tokens[0, start:start + len(call)], call)
    lengths = np.asarray(batch.lengths)
    mask = np.asarray(batch.loss_mask)
    turn_index = np.asarray(batch.turn_index)
    boundaries = np.asarray(batch.boundaries)
    for row, episode in enumerate(result.episodes):
        assert episode.status in STATUSES[1:]
        assert mask[row, boundaries[row, 0]] == 1  # the first generated token sits at S_0
        assert mask[row, :boundaries[row, 0]].sum() == 0
        assert mask[row, lengths[row]:].sum() == 0
        # every turn's text is exactly the decoded ids of its masked tokens
        generated = np.asarray(batch.tokens[row])[mask[row] == 1]
        turns = turn_index[row][mask[row] == 1]
        for k, text in enumerate(episode.turn_texts):
            assert chat.tokenizer.decode(generated[turns == k].tolist(), skip_special_tokens=False) == text
        print(f"row {row}: {episode.status}, {len(episode.turn_texts)} turns, "
              f"first turn {episode.turn_texts[0][:80]!r}")
    credit.validate_token_layout(batch.turn_index, batch.loss_mask, batch.num_turns)
    # The free row's sampler log-probs equal the trainer's recomputation on the produced tokens.
    trainer = np.asarray(models.to_token_aligned(models.token_logprobs(config, params, batch.tokens[1:2])))[0]
    generated = mask[1] == 1
    assert generated.sum() > 20
    gap = float(np.abs(trainer[generated] - np.asarray(batch.sampler_logprobs)[1][generated]).max())
    print(f"SmolLM2 max |sampler - token_logprobs| = {gap:.2e}")
    assert gap < 1e-4
    assert np.isfinite(np.asarray(batch.sampler_logprobs)).all()
    assert (np.asarray(batch.sampler_logprobs)[mask == 1] <= 0).all()
