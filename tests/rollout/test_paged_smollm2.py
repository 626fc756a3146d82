"""Real model: SmolLM2-135M-Instruct on the rollout engine. Greedy, every generated token is the argmax of the full
forward over the row's tokens before it (the naive reference's choice, checked teacher-forced: one forward a row,
not one a token, which on SmolLM2 costs minutes; greedy, a prompt's two samples are the same row, whose forward is
computed once) and no turn runs past a stop string (its `</tool_call>` is several tokens, and "." is added: turns
end mid decode block by the host's stop-string check and roll back).
Sampled, the tokens' log-probs are the trainer's: tests/rollout/test_rollout_smollm2.py.
The episode rules against the token-by-token naive reference: tests/rollout/test_paged_engine.py (tiny model)."""

import copy

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.envs.oracle import make_browser
from trace_jax.envs.tasks import generate_tasks
from trace_jax.envs.world import WorldConfig, build_world
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import load_tokenizer
from trace_jax.rollout import RolloutConfig, SamplingConfig, run_episodes
from trace_jax.rollout.paged import PagedConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("optimized_xla")]  # runs the real model: optimised


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_dir):
    config, params = models.load_pretrained(smollm2_hf_dir)
    chat = ChatFormat(load_tokenizer(smollm2_hf_dir))
    world = build_world(WorldConfig.from_corpus_size(40, seed=3))
    return config, params, chat, generate_tasks(world, 2, seed=0), make_browser(world)


def _rollout(sampling):
    # Rows are ~180 tokens. Decoding, one step a ~0.1 s read of every weight on a CPU, is most of the test's time:
    # blocks of 4 steps waste fewer of them past a turn's end than 8 would (40 steps, not 48), and a turn that stops
    # at "." on its 19th token still ends mid block.
    return RolloutConfig(group_size=2, max_turns=1, max_context=256, turn_token_budget=20, sampling=sampling,
                         with_tools=False, max_observation_chars=120, sync_every=4, paged=PagedConfig(page_size=16))


def test_smollm2_greedy_tokens_are_the_full_forwards_argmax_and_turns_end_at_their_stop_string(smollm2):
    config, params, chat, tasks, browser = smollm2
    stringy = copy.copy(chat)
    stringy.assistant_stop_strings = tuple(chat.assistant_stop_strings) + (".",)
    result = run_episodes(config, params, stringy, tasks, browser, _rollout(SamplingConfig(greedy=True)),
                          jax.random.PRNGKey(0))
    batch = result.batch
    assert result.stats.decode_dispatches > 0
    tokens, mask = np.asarray(batch.tokens), np.asarray(batch.loss_mask) == 1
    turn_index = np.asarray(batch.turn_index)
    checked, stopped = 0, 0
    forwards = {}  # a row's tokens -> its full forward's logits, [L, V], position t -> t + 1
    for row in range(tokens.shape[0]):
        key = tokens[row].tobytes()
        if key not in forwards:
            forwards[key] = np.asarray(models.forward(config, params, tokens[row:row + 1]))[0]
        logits = forwards[key]
        generated = np.nonzero(mask[row])[0]
        top2 = np.sort(logits[generated - 1], axis=-1)[:, -2:]
        choice = np.argmax(logits[generated - 1], axis=-1)
        # the argmax, but for a near-tie (float32 summation order differs between the paged and full attention)
        assert ((choice == tokens[row, generated]) | (top2[:, 1] - top2[:, 0] < 1e-4)).all(), row
        checked += len(generated)
        for turn in np.unique(turn_index[row][mask[row]]):
            ids = tokens[row][mask[row] & (turn_index[row] == turn)].tolist()
            text = stringy.tokenizer.decode(ids, skip_special_tokens=False)
            before = stringy.tokenizer.decode(ids[:-1], skip_special_tokens=False)
            assert not any(stop in before for stop in stringy.assistant_stop_strings), (row, turn, text)
            stopped += any(stop in text for stop in stringy.assistant_stop_strings)
    assert checked > 50 and stopped > 0

