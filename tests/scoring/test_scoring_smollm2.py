"""Real-model sanity check: SmolLM2-135M-Instruct as the reference on a hand-built trajectory.

Three tool calls; only the second tool response contains the answer. The answer score (and so the value) must
jump at the state after that response, and the turn that fetched it must get the largest credit. The numbers are
recorded so that a change in the scorer, the chat format or the converter shows up here.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models
from trace_jax.credit import td_deltas, trace_turn_credit, trace_values
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import load_tokenizer
from trace_jax.scoring import score_answer_prefixes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("optimized_xla")]  # conversion (shared fixture) + a 135M-parameter pass on CPU: ~20-50 s


def _call(i, name, arguments):
    return [{"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}]


MESSAGES = [
    {"role": "system", "content": "You are a research assistant. Use the tools, then answer as <answer>...</answer>."},
    {"role": "user", "content": "What is the name of the lighthouse keeper's cat on Farrow Island?"},
    {"role": "assistant", "content": "Let me search for Farrow Island.",
     "tool_calls": _call(1, "search", {"query": "Farrow Island"})},
    {"role": "tool", "tool_call_id": "c1",
     "content": "Farrow Island is a small island in the North Sea with a ferry port and a lighthouse built in 1872."},
    {"role": "assistant", "content": "Let me search for the lighthouse keeper.",
     "tool_calls": _call(2, "search", {"query": "Farrow Island lighthouse keeper cat"})},
    {"role": "tool", "tool_call_id": "c2",
     "content": "The lighthouse keeper of Farrow Island, Anna Berg, lives with her cat, whose name is Pepperwhisk."},
    {"role": "assistant", "content": "Let me check the ferry timetable too.",
     "tool_calls": _call(3, "search", {"query": "Farrow Island ferry"})},
    {"role": "tool", "tool_call_id": "c3",
     "content": "Ferries to Farrow Island leave twice a day from the mainland harbour."},
    {"role": "assistant", "content": "<answer>Pepperwhisk</answer>"},
]

# Recorded with SmolLM2-135M-Instruct (GGUF -> HF, float32, CPU), template "<answer>", gold "Pepperwhisk".
RECORDED_SCORES = [-7.641226, -9.614021, -2.222954, -2.750617]
RECORDED_VALUES = [0.0, -0.227010, 1.203721, 0.999025]
RECORDED_CREDIT = [0.322364, 0.703875, -0.204696]  # defaults, A_out = 0


def test_value_jumps_where_the_answer_is_fetched_and_that_turn_gets_most_credit(smollm2_hf_dir):
    tokenizer = load_tokenizer(smollm2_hf_dir)
    config, params = models.load_pretrained(smollm2_hf_dir)
    conversation = ChatFormat(tokenizer).messages_to_ids(MESSAGES)
    assert len(conversation.boundaries) == 4  # S_0 .. S_3
    template = tokenizer.encode("<answer>", add_special_tokens=False)
    gold = tokenizer.encode("Pepperwhisk", add_special_tokens=False)
    answer_mask = np.array([[0] * len(template) + [1] * len(gold)])
    result = score_answer_prefixes(config, params, conversation.ids[None], conversation.boundaries[None],
                                   np.array([4]), np.array([template + gold]), answer_mask)
    scores = np.asarray(result.answer_scores)
    num_turns = jnp.array([3])
    values = np.asarray(trace_values(jnp.asarray(scores), num_turns))[0]
    deltas = np.asarray(td_deltas(jnp.asarray(scores), num_turns))[0]
    credit = np.asarray(trace_turn_credit(jnp.asarray(scores), num_turns, jnp.zeros(1)))[0]

    assert np.argmax(deltas) == 1 and deltas[1] > 1.0  # the jump: state S_2 follows the answer-bearing response
    assert values[2] - values[1] > 1.0
    assert np.argmax(credit) == 1  # the turn whose tool call fetched the answer
    np.testing.assert_allclose(scores[0], RECORDED_SCORES, atol=2e-3)
    np.testing.assert_allclose(values, RECORDED_VALUES, atol=2e-3)
    np.testing.assert_allclose(credit, RECORDED_CREDIT, atol=2e-3)
    assert np.all(np.isfinite(np.asarray(result.token_logprobs)))
