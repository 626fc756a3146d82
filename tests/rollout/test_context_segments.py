"""Context management end to end: a scripted episode that compacts its context several times. The ids the engine's
programs were fed before every turn, the segment rows' `tokens[:boundary]`, the scorer's states and the trainer's
tokens agree token for token; with the option off the batch is the one of before."""

import types

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.credit.config import CreditConfig
from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig, ScriptedPolicy, run_episodes
from trace_jax.rollout import paged as paged_lib
from trace_jax.rollout.paged import PagedConfig
from trace_jax.rollout.batch import episode_view
from trace_jax.rollout.context import RECORD_HEADER

DOCS = [
    {"docid": "d1", "url": "https://wiki.example/alpha", "title": "Alpha river",
     "text": "The Alpha river flows through Paris.\nIt is long and slow."},
    {"docid": "d2", "url": "https://wiki.example/beta", "title": "Beta city",
     "text": "Beta city lies on the Alpha river.\nThe mayor of Beta is Lina Voss."},
    {"docid": "d3", "url": "https://wiki.example/voss", "title": "Lina Voss",
     "text": "Lina Voss was born in Gamma in 1971."},
]
RECORD_WORDS = (RECORD_HEADER + " Queries issued Pages opened Candidate clues no results").replace(":", " ")
WORDS = sorted({w.strip(".,()") for d in DOCS for w in (d["title"] + " " + d["text"]).split()} |
               set(RECORD_WORDS.replace("(", " ").replace(")", " ").split()) |
               {"search", "open", "find", "query", "id", "answer", "Where", "was", "the", "of", "city", "born"})
TASKS = [types.SimpleNamespace(task_id="q0", question="Where was the mayor of Beta city born?", answer="Gamma"),
         types.SimpleNamespace(task_id="q1", question="Where does the Alpha river flow?", answer="Paris")]
# max_context holds the whole episode uncompacted, so the runs with the option off or never reached use the same
# pool as the compacting ones and reuse their compiled programs
BASE = dict(group_size=1, max_turns=8, max_context=1024, turn_token_budget=48, system_prompt="Use tools.",
            with_tools=False, sync_every=1, context_record_tokens=96)
BUDGET = 230  # small enough to compact every two or three turns


def call_ids(chat, name, arguments):
    return chat.assistant_content_ids(None, [{"name": name, "arguments": arguments}])


def scripts(chat):
    answer = chat.assistant_content_ids("<answer>Gamma</answer>") + [chat.im_end_id]
    search = lambda query: call_ids(chat, "search", {"query": query})  # noqa: E731
    opened = lambda url: call_ids(chat, "open", {"id": url})  # noqa: E731
    long_row = [search("Beta city"), opened("https://wiki.example/beta"), search("Lina Voss"),
                opened("https://wiki.example/voss"), search("Alpha river"), opened("https://wiki.example/alpha"),
                search("Gamma"), answer]
    return [long_row, [search("Alpha river"), answer]]


class EngineInputs:
    """Wraps the engine's prefill and decode programs and keeps, per slot, the ids its pages were fed: `seen[slot]` is
    the context at the first decode step of every turn, `ended[slot]` each context a prefill from position 0
    replaced (a compaction starting over in the slot), `stream[slot]` what the slot holds now."""

    def __init__(self, monkeypatch):
        self.stream, self.seen, self.ended = {}, {}, {}
        prefill_program, decode_program = paged_lib.prefill_program, paged_lib.decode_program

        def recording_prefill(*build):
            program = prefill_program(*build)

            def run(params, state, cached, tokens, num_new, items, out_source, out_table, out_slots):
                for slot, u in zip(np.asarray(out_slots), np.asarray(out_source)):
                    slot = int(slot)
                    if slot >= state.logits.shape[0]:  # padding: past the last slot
                        continue
                    start, fed = int(cached[u]), [int(t) for t in tokens[u, :num_new[u]]]
                    if start == 0 and self.stream.get(slot):
                        self.ended.setdefault(slot, []).append(self.stream[slot])
                    self.stream[slot] = self.stream.get(slot, [])[:start] + fed
                return program(params, state, cached, tokens, num_new, items, out_source, out_table, out_slots)

            return run

        def recording_decode(*build):
            program = decode_program(*build)

            def run(sampling, params, state, slots, table, lengths, active, *rest):
                out = program(sampling, params, state, slots, table, lengths, active, *rest)
                turn_step, tokens, was_active = np.asarray(rest[3]), np.asarray(out[1]), np.asarray(out[4])
                for i in np.nonzero(np.asarray(active))[0]:
                    slot = int(slots[i])
                    context = self.stream[slot][:int(lengths[i])]
                    if turn_step[i] == 0:
                        self.seen.setdefault(slot, []).append(list(context))
                    self.stream[slot] = context + tokens[was_active[:, i], i].tolist()
                return out

            return run

        monkeypatch.setattr(paged_lib, "prefill_program", recording_prefill)
        monkeypatch.setattr(paged_lib, "decode_program", recording_decode)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    chat = ChatFormat(load_tokenizer(build_word_tokenizer(WORDS, tmp_path_factory.mktemp("tok"))))
    config = models.get_preset("tiny-qwen3", vocab_size=len(chat.tokenizer))
    params = models.init_params(config, jax.random.PRNGKey(0))
    return chat, config, params, Browser(Corpus.from_records(DOCS))


@pytest.fixture(scope="module")
def compacted(setup):
    """The scripted rollout under `BUDGET`, with what the engine's programs were fed (a slot per row, admitted in
    row order: episode r runs in slot r throughout)."""
    chat, config, params, browser = setup
    with pytest.MonkeyPatch.context() as monkeypatch:
        inputs = EngineInputs(monkeypatch)
        result = run_episodes(config, params, chat, TASKS, browser, RolloutConfig(**BASE, context_budget=BUDGET),
                              jax.random.PRNGKey(0), logits_hook=ScriptedPolicy(scripts(chat), config.vocab_size))
    return result, inputs


def contexts_by_turn(batch):
    """{(episode, turn): tokens[n, :boundaries[n, turn - first_turn[n]]]} over every row's states."""
    tokens, boundaries = np.asarray(batch.tokens), np.asarray(batch.boundaries)
    out = {}
    for n, (episode, first, turns) in enumerate(zip(np.asarray(batch.episode), np.asarray(batch.first_turn),
                                                    np.asarray(batch.num_turns))):
        for j in range(int(turns) + 1):
            out[int(episode), int(first) + j] = tokens[n, :boundaries[n, j]].tolist()
    return out


def test_long_episode_compacts_into_contiguous_segment_rows(compacted):
    result, _ = compacted
    batch = result.batch
    view = episode_view(batch)
    assert view.num_episodes == 2
    np.testing.assert_array_equal(view.num_turns, [7, 1])
    assert (np.asarray(batch.episode) == 0).sum() >= 3  # compacted at least twice
    np.testing.assert_array_equal(np.asarray(batch.group_id), np.asarray(batch.episode))
    assert result.episodes[0].answer == "Gamma" and result.episodes[0].status == "answered"
    assert (np.asarray(batch.reward)[np.asarray(batch.episode) == 0] == 1.0).all()
    assert (np.asarray(batch.lengths) <= BUDGET + BASE["turn_token_budget"]).all()


def test_policy_saw_exactly_each_rows_prefix_at_every_state(compacted):
    result, inputs = compacted
    expected = contexts_by_turn(result.batch)
    for episode, seen in inputs.seen.items():
        assert len(seen) == len(result.episodes[episode].turn_texts)
        for turn, context in enumerate(seen):
            assert context == expected[episode, turn], (episode, turn)


def test_each_segment_row_holds_what_its_cache_row_held(compacted):
    result, inputs = compacted
    batch = result.batch
    tokens, lengths, episode = np.asarray(batch.tokens), np.asarray(batch.lengths), np.asarray(batch.episode)
    for e in range(2):
        held = inputs.ended.get(e, []) + [inputs.stream[e]]
        rows = [tokens[n, :lengths[n]].tolist() for n in np.nonzero(episode == e)[0]]
        assert rows == held


def test_compacted_context_starts_with_the_prompt_and_shows_the_record(compacted, setup):
    chat = setup[0]
    result, _ = compacted
    batch = result.batch
    prompt = chat.prompt_ids(BASE["system_prompt"], TASKS[0].question)[:-len(chat.generation_prompt_ids())]
    second = int(np.nonzero(np.asarray(batch.first_turn) > 0)[0][0])
    head = np.asarray(batch.tokens)[second, :int(batch.boundaries[second, 0])].tolist()
    assert head[:len(prompt)] == prompt
    text = chat.tokenizer.decode(head[len(prompt):], skip_special_tokens=False)
    assert RECORD_HEADER in text and '"Beta city" -> Beta city' in text


def test_segment_turn_indices_are_the_episodes_turns(compacted):
    batch = compacted[0].batch
    turn_index, mask = np.asarray(batch.turn_index), np.asarray(batch.loss_mask)
    for n in range(batch.shape[0]):
        turns = np.unique(turn_index[n][mask[n] > 0])
        first, count = int(batch.first_turn[n]), int(batch.num_turns[n])
        np.testing.assert_array_equal(turns, np.arange(first, first + count + 1))


def test_off_by_default_and_a_budget_never_reached_give_the_same_arrays(setup):
    chat, config, params, browser = setup
    hook = ScriptedPolicy(scripts(chat), config.vocab_size)
    width = BASE["max_context"]
    off = run_episodes(config, params, chat, TASKS, browser, RolloutConfig(**BASE), jax.random.PRNGKey(0),
                       logits_hook=hook).batch
    unreached = run_episodes(config, params, chat, TASKS, browser, RolloutConfig(**BASE, context_budget=width),
                             jax.random.PRNGKey(0), logits_hook=hook).batch
    assert int(off.lengths.max()) < width and int(off.num_turns[0]) == 7  # the whole episode fits uncompacted
    np.testing.assert_array_equal(off.episode, [0, 1])
    np.testing.assert_array_equal(off.first_turn, [0, 0])
    assert not off.segmented
    for name in ("tokens", "loss_mask", "turn_index", "boundaries", "num_turns", "group_id", "reward", "status",
                 "lengths", "episode", "first_turn"):
        np.testing.assert_array_equal(getattr(unreached, name), getattr(off, name), err_msg=name)


@pytest.fixture(scope="module")
def prepared(setup, compacted):
    """The RL step's `prepare` (TRACE: scored states) on the compacted rollout, with the scorer's inputs."""
    import optax

    from trace_jax.rl import pipeline as pipeline_lib
    from trace_jax.train.config import LossConfig

    chat, config, params, browser = setup
    result, _ = compacted
    pipeline = pipeline_lib.RLPipeline(config, chat, browser, RolloutConfig(**BASE, context_budget=BUDGET),
                                       CreditConfig(estimator="trace"), LossConfig(), pipeline_lib.UpdateConfig(),
                                       optax.sgd(1e-3))
    calls = []
    score = pipeline_lib.score_answer_prefixes

    def recording_score(config, params, tokens, boundaries, num_states, *args, **kwargs):
        calls.append((np.asarray(tokens), np.asarray(boundaries), np.asarray(num_states)))
        return score(config, params, tokens, boundaries, num_states, *args, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(pipeline_lib, "score_answer_prefixes", recording_score)
        out = pipeline.prepare(result, params, num_prompts=len(TASKS))
    return out, calls


def test_scorer_states_are_the_contexts_the_policy_saw(compacted, prepared):
    result, inputs = compacted
    _, calls = prepared
    tokens, boundaries, num_states = (np.concatenate(parts) for parts in zip(*calls))
    batch = result.batch
    assert len(tokens) == batch.shape[0]
    scored = 0
    for n, (episode, first) in enumerate(zip(np.asarray(batch.episode), np.asarray(batch.first_turn))):
        for j in range(int(num_states[n])):
            assert tokens[n, :boundaries[n, j]].tolist() == inputs.seen[int(episode)][int(first) + j], (n, j)
            scored += 1
    assert scored == sum(len(e.turn_texts) for e in result.episodes)  # every state of every episode, once


def test_trainer_tokens_are_the_contexts_the_policy_saw(compacted, prepared):
    result, inputs = compacted
    loss_batch = prepared[0].loss_batch
    batch = result.batch
    rows = batch.shape[0]
    tokens = np.asarray(loss_batch.tokens)
    for n, (episode, first) in enumerate(zip(np.asarray(batch.episode), np.asarray(batch.first_turn))):
        for j in range(int(batch.num_turns[n]) + 1):
            assert tokens[n, :int(batch.boundaries[n, j])].tolist() == inputs.seen[int(episode)][int(first) + j]
    np.testing.assert_array_equal(np.asarray(loss_batch.loss_mask)[:rows],
                                  np.asarray(batch.loss_mask)[:, :tokens.shape[1]])
    # empty rows pad the segments to a multiple of the episodes: nothing trained, no real token
    assert loss_batch.shape[0] % len(result.episodes) == 0
    assert not np.asarray(loss_batch.loss_mask)[rows:].any() and not np.asarray(loss_batch.token_mask)[rows:].any()


def test_step_metrics_count_each_episode_once(compacted, prepared):
    result, _ = compacted
    metrics = prepared[0].metrics
    assert [e.answer for e in result.episodes] == ["Gamma", "Gamma"]  # right for q0, wrong for q1
    assert metrics["reward"] == 0.5 and metrics["accuracy"] == 0.5
    assert metrics["tool_calls"] == (7 + 1) / 2


def test_episode_scores_are_each_state_scored_once_at_its_number(compacted, prepared):
    result, _ = compacted
    out, calls = prepared
    batch = result.batch
    scores = out.answer_scores
    assert scores.shape == (2, BASE["max_turns"] + 1)
    num_turns = episode_view(batch).num_turns
    assert np.isfinite(scores).all() and (scores[0, :num_turns[0] + 1] != 0).all()
    # the TRACE turn credit reads every state of the long episode: a turn per tool call
    assert np.count_nonzero(np.asarray(out.credit.per_turn)[0, :num_turns[0]]) == num_turns[0]


def test_evaluation_counts_each_episode_once(setup):
    from trace_jax.rl.evaluate import EvalConfig, evaluate

    chat, config, params, browser = setup
    result = evaluate(config, params, chat, TASKS, browser, RolloutConfig(**BASE, context_budget=BUDGET),
                      EvalConfig(num_tasks=2), logits_hook=ScriptedPolicy(scripts(chat), config.vocab_size))
    assert result.correct == (True, False)
    assert result.mean_reward == 0.5  # episode 0 (reward 1) has three or more rows, episode 1 (reward 0) one


def test_compaction_in_one_slot_gives_the_same_rows(setup, compacted):
    """Rows wait for the one slot and compact in it: the batch of the run with a slot per row, array for array."""
    chat, config, params, browser = setup
    result = run_episodes(config, params, chat, TASKS, browser,
                          RolloutConfig(**BASE, context_budget=BUDGET, paged=PagedConfig(slots=1)),
                          jax.random.PRNGKey(0), logits_hook=ScriptedPolicy(scripts(chat), config.vocab_size))
    assert result.rows_at_once == 1
    unbounded = compacted[0].batch
    for name in ("tokens", "loss_mask", "turn_index", "boundaries", "num_turns", "reward", "episode", "first_turn"):
        np.testing.assert_array_equal(getattr(result.batch, name), getattr(unbounded, name), err_msg=name)
