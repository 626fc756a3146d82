"""Agent loop: a scripted episode gives exactly the expected tokens, masks, turn indices and boundaries; the batch
feeds the credit API and the scorer as it is."""

import types

import jax
import numpy as np
import pytest

from trace_jax import credit, models
from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus
from trace_jax.models.chat import ChatFormat, parse_tool_call
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig, STATUS_CODES, ScriptedPolicy, run_episodes
from trace_jax.rollout.agent import error_observation

DOCS = [
    {"docid": "d1", "url": "https://wiki.example/alpha", "title": "Alpha river",
     "text": "The Alpha river flows through Paris. It is long and slow."},
    {"docid": "d2", "url": "https://wiki.example/beta", "title": "Beta city",
     "text": "Beta city lies on the Alpha river. Its mayor is Lina Voss."},
    {"docid": "d3", "url": "https://wiki.example/gamma", "title": "Gamma",
     "text": "Gamma is a company in Beta city."},
]
WORDS = sorted({w.strip(".,") for d in DOCS for w in (d["title"] + " " + d["text"]).split()} |
               {"search", "open", "find", "query", "answer", "The", "is", "Error", "result", "results", "id", "river"})
TASKS = [types.SimpleNamespace(task_id="q0", question="Which city does the Alpha river flow through?",
                               answer="Paris", aliases=()),
         types.SimpleNamespace(task_id="q1", question="Who is the mayor of Beta city?", answer="Lina Voss")]
# Two samples of each task (4 rows): one scripted rollout serves the exact-layout test, the credit/scorer test and
# the sharded comparison (`scripted`), so its programs compile once for the module.
ROLLOUT = RolloutConfig(group_size=2, max_turns=2, max_context=512, turn_token_budget=48, system_prompt="Use tools.",
                        with_tools=False, sync_every=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = load_tokenizer(build_word_tokenizer(WORDS, tmp_path_factory.mktemp("tok")))
    chat = ChatFormat(tokenizer)
    config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer))
    params = models.init_params(config, jax.random.PRNGKey(0))
    corpus = Corpus.from_records(DOCS)
    return chat, config, params, Browser(corpus)


def call_ids(chat, name, arguments):
    return chat.assistant_content_ids(None, [{"name": name, "arguments": arguments}])


def scripts(chat):
    answer = chat.assistant_content_ids("The answer is Paris.\n<answer>Paris</answer>") + [chat.im_end_id]
    malformed = chat.assistant_content_ids('<tool_call>\n{"name": search}\n</tool_call>')
    return [
        # row 0: search, a malformed call (error observation), then the answer
        [call_ids(chat, "search", {"query": "Alpha river"}), malformed, answer],
        # row 1: open before any search (tool error), search, then a third call: max_turns, not executed
        [call_ids(chat, "open", {"id": 0}), call_ids(chat, "search", {"query": "mayor"}),
         call_ids(chat, "search", {"query": "Beta"})],
    ]


def row_scripts(chat):
    """The script of every row: both samples of a task follow that task's script."""
    return [script for script in scripts(chat) for _ in range(ROLLOUT.group_size)]


@pytest.fixture(scope="module")
def scripted(setup):
    """The scripted episodes of both tasks on one device (the forced tokens do not depend on the key)."""
    chat, config, params, browser = setup
    return run_episodes(config, params, chat, TASKS, browser, ROLLOUT, jax.random.PRNGKey(0),
                        logits_hook=ScriptedPolicy(row_scripts(chat), config.vocab_size))


def expected_row(chat, browser, task, turns, executed):
    """Replay the script by hand: the token list, masks, turn indices and boundaries the loop must produce."""
    browser = browser.fork()
    ids = chat.prompt_ids(ROLLOUT.system_prompt, task.question)
    mask, turn_index, boundaries = [0] * len(ids), [-1] * len(ids), [len(ids)]
    for k, turn in enumerate(turns):
        ids, mask, turn_index = ids + turn, mask + [1] * len(turn), turn_index + [k] * len(turn)
        if k >= executed:
            break
        call = parse_tool_call(chat.tokenizer.decode(turn, skip_special_tokens=False))
        observation = (browser.execute(call.name, call.arguments) if hasattr(call, "name")
                       else error_observation(call.message))
        response = chat.tool_response_ids(observation, previous_ids=turn)
        ids, mask, turn_index = ids + response, mask + [0] * len(response), turn_index + [-1] * len(response)
        boundaries.append(len(ids))
    return ids, mask, turn_index, boundaries


def test_scripted_episode_gives_exact_tokens_masks_turns_and_boundaries(setup, scripted):
    chat, config, params, browser = setup
    script = scripts(chat)
    assert script[0][0][-1] in chat.assistant_stop_ids  # the word tokenizer has </tool_call> as one token
    batch = scripted.batch
    assert batch.tokens.shape == (4, 512) and batch.boundaries.shape == (4, 3)
    for row in range(4):
        task = row // ROLLOUT.group_size
        ids, mask, turn_index, boundaries = expected_row(chat, browser, TASKS[task], script[task], executed=2)
        length = len(ids)
        assert int(batch.lengths[row]) == length
        np.testing.assert_array_equal(batch.tokens[row, :length], ids)
        np.testing.assert_array_equal(batch.loss_mask[row, :length], mask)
        np.testing.assert_array_equal(batch.turn_index[row, :length], turn_index)
        np.testing.assert_array_equal(batch.boundaries[row], boundaries)
        assert not np.asarray(batch.loss_mask[row, length:]).any()
        assert (np.asarray(batch.turn_index[row, length:]) == -1).all()
        np.testing.assert_array_equal(batch.positions[row], np.arange(512))
    np.testing.assert_array_equal(batch.num_turns, [2, 2, 2, 2])
    np.testing.assert_array_equal(batch.status, [STATUS_CODES["answered"]] * 2 + [STATUS_CODES["max_turns"]] * 2)
    np.testing.assert_allclose(batch.reward, [1.0, 1.0, 0.0, 0.0])
    for first, second in (scripted.episodes[0::2], scripted.episodes[1::2]):  # each sample of the two tasks
        assert first.answer == "Paris" and first.num_tool_errors == 1
        assert first.observations[1].startswith("Error: the text inside <tool_call></tool_call> is not valid JSON")
        assert second.observations[0].startswith("Error: ") and second.num_tool_errors == 1
        assert len(second.observations) == 2 and second.status == "max_turns"
    # forced tokens have log-prob ~0 under the hooked logits; prompt and observations have 0
    lp = np.asarray(batch.sampler_logprobs)
    assert np.abs(lp).max() < 1e-3
    credit.validate_token_layout(batch.turn_index, batch.loss_mask, batch.num_turns)


def test_observation_that_does_not_fit_ends_the_episode_as_context_overflow(setup):
    chat, config, params, browser = setup
    prompt_length = len(chat.prompt_ids(ROLLOUT.system_prompt, TASKS[0].question))
    call = call_ids(chat, "search", {"query": "Alpha river"})
    small = RolloutConfig(group_size=2, max_turns=2, max_context=prompt_length + len(call) + 8,
                          turn_token_budget=48, system_prompt=ROLLOUT.system_prompt, with_tools=False, sync_every=1)
    result = run_episodes(config, params, chat, TASKS[:1], browser, small, jax.random.PRNGKey(0),
                          logits_hook=ScriptedPolicy([[call], [call[:3] + [chat.im_start_id] * 20]],
                                                     config.vocab_size))
    batch = result.batch
    np.testing.assert_array_equal(batch.status, [STATUS_CODES["context_overflow"]] * 2)
    np.testing.assert_array_equal(batch.num_turns, [0, 0])
    np.testing.assert_array_equal(batch.boundaries, [[prompt_length] * 3] * 2)
    assert int(batch.lengths[0]) == prompt_length + len(call)  # the observation was not appended
    assert int(batch.lengths[1]) == small.max_context  # generation ran into the end of the cache
    np.testing.assert_array_equal(batch.group_id, [0, 0])


def test_batch_feeds_credit_and_scorer_without_reshaping(setup, scripted):
    chat, config, params, browser = setup
    batch = scripted.batch
    n, length = batch.tokens.shape
    turns = batch.boundaries.shape[1] - 1
    np.testing.assert_array_equal(batch.group_id, [0, 0, 1, 1])

    advantages = credit.token_advantages(batch.turn_index, batch.loss_mask,
                                         jax.numpy.ones((n, turns), jax.numpy.float32),
                                         jax.numpy.arange(n, dtype=jax.numpy.float32), batch.num_turns)
    assert advantages.shape == (n, length)
    assert (np.asarray(advantages)[np.asarray(batch.loss_mask) == 0] == 0).all()
    grpo = credit.compute_advantages("grpo", batch.credit_inputs(), check=True)
    assert grpo.token_advantages.shape == (n, length)

    from trace_jax.scoring import score_answer_prefixes

    answer = chat.assistant_content_ids("<answer>Paris</answer>")
    answer_tokens = np.tile(np.asarray(answer, np.int32), (n, 1))
    answer_mask = np.zeros_like(answer_tokens)
    answer_mask[:, 1:-1] = 1  # score the gold words, condition on the tags
    scores = score_answer_prefixes(config, params, batch.tokens, batch.boundaries, batch.num_states,
                                   answer_tokens, answer_mask, lengths=batch.lengths)
    assert scores.answer_scores.shape == (n, turns + 1)
    assert np.isfinite(np.asarray(scores.answer_scores)).all()
    trace = credit.compute_advantages("trace", batch.credit_inputs(answer_scores=scores.answer_scores), check=True)
    assert trace.token_advantages.shape == (n, length)


def test_sharded_rollout_equals_single_device(setup, scripted):
    """Rows over `data`, kv heads / mlp / vocab over `tensor`: the same episodes, token for token."""
    chat, config, params, browser = setup
    mesh = models.make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    hook = ScriptedPolicy(row_scripts(chat), config.vocab_size)
    single = scripted
    sharded = run_episodes(config, models.shard_params(params, config, mesh), chat, TASKS, browser, ROLLOUT,
                           jax.random.PRNGKey(0), mesh=mesh, logits_hook=hook)
    for name in ("tokens", "loss_mask", "turn_index", "boundaries", "num_turns", "status", "reward"):
        np.testing.assert_array_equal(getattr(sharded.batch, name), getattr(single.batch, name), err_msg=name)
    np.testing.assert_allclose(sharded.batch.sampler_logprobs, single.batch.sampler_logprobs, atol=1e-4)
