"""The search-state record of context management: what it tracks from an episode's history, how it is cut to its
token budget, and the compacted context it is rendered into."""

import pytest

from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig
from trace_jax.rollout.context import (RECORD_HEADER, Clue, Page, Query, SearchState, compacted_context,
                                       entity_words, render_record, search_state)

DOCS = [
    {"docid": "d1", "url": "https://wiki.example/alpha", "title": "Alpha river",
     "text": "The Alpha river flows through Paris.\nIt is long and slow."},
    {"docid": "d2", "url": "https://wiki.example/beta", "title": "Beta city",
     "text": "Beta city lies on the Alpha river.\nThe mayor of Beta is Lina Voss.\nThe harbour is small."},
    {"docid": "d3", "url": "https://wiki.example/voss", "title": "Lina Voss",
     "text": "Lina Voss was born in Gamma in 1971.\nShe likes boats."},
]
QUESTION = "Where was the mayor of the city on the Alpha river born?"


def run(calls):
    """The (tool_calls, observations) an episode of these calls leaves in its `EpisodeRecord`."""
    browser = Browser(Corpus.from_records(DOCS))
    return list(calls), [browser.execute(name, arguments) for name, arguments in calls]


def test_entity_words_are_capitalised_words_and_numbers_without_sentence_starters():
    assert entity_words("The mayor of Beta city was born in 1971 in Gamma.") == {"beta", "1971", "gamma"}


def test_queries_are_recorded_with_the_titles_of_their_top_results():
    state = search_state(QUESTION, *run([("search", {"query": "Alpha river"}), ("search", '{"query": "zzz"}')]))
    assert state.queries == (Query("Alpha river", ("Alpha river", "Beta city")), Query("zzz", ()))
    assert state.pages == () and state.clues == ()


def test_pages_opened_are_recorded_once_with_title_and_url():
    state = search_state(QUESTION, *run([("search", {"query": "Alpha river"}), ("open", {"id": 1}),
                                         ("open", {"id": "https://wiki.example/beta"})]))
    assert state.pages == (Page("Beta city", "https://wiki.example/beta"),)


def test_clues_follow_entities_from_the_question_through_earlier_clues():
    state = search_state(QUESTION, *run([("search", {"query": "Alpha river"}), ("open", {"id": 1}),
                                         ("open", {"id": "https://wiki.example/voss"})]))
    # "Alpha" (question) -> the Beta city line; its "Beta" -> the mayor line; "Lina Voss" -> the birth line
    assert state.clues == (Clue("Beta city lies on the Alpha river.", "Beta city"),
                           Clue("The mayor of Beta is Lina Voss.", "Beta city"),
                           Clue("Lina Voss was born in Gamma in 1971.", "Lina Voss"))


def test_find_results_give_clues_from_their_page_but_open_no_page():
    state = search_state(QUESTION, *run([("open", {"id": "https://wiki.example/beta"}),
                                         ("find", {"pattern": "Voss"})]))
    assert state.pages == (Page("Beta city", "https://wiki.example/beta"),)
    assert [c.text for c in state.clues] == ["Beta city lies on the Alpha river.", "The mayor of Beta is Lina Voss."]


def test_errors_and_unparsed_calls_add_nothing():
    calls, observations = run([("open", {"id": 3})])
    assert observations[0].startswith("Error: ")
    state = search_state(QUESTION, calls + ["the text inside <tool_call> is not valid JSON"],
                         observations + ["Error: not JSON"])
    assert state == SearchState()


def test_history_lengths_must_agree():
    with pytest.raises(ValueError, match="one observation per tool call"):
        search_state(QUESTION, [("search", {"query": "x"})], [])


def test_record_over_budget_drops_the_oldest_entry_of_the_longest_section():
    state = SearchState(queries=(Query("q1", ("A",)), Query("q2", ("B",)), Query("q3", ())),
                        pages=(Page("P", "u"),), clues=(Clue("c1", "P"), Clue("c2", "P")))
    words = lambda text: len(text.split())  # noqa: E731
    full = render_record(state, 1000, words)
    assert full.splitlines() == [RECORD_HEADER, "Queries issued:", '- "q1" -> A', '- "q2" -> B', '- "q3" -> no results',
                                 "Pages opened:", "- P (u)", "Candidate clues:", '- "c1" [P]', '- "c2" [P]']
    cut = render_record(state, words(full) - 1, words)
    assert '"q1"' not in cut and '"q2"' in cut and '"c1"' in cut
    assert render_record(state, 1, words) == RECORD_HEADER  # the header is the floor


def test_compacted_context_extends_the_prompt_and_ends_with_the_generation_prompt(tmp_path):
    words = sorted({w.strip(".,") for d in DOCS for w in d["text"].split()} | set(QUESTION.strip("?").split()))
    chat = ChatFormat(load_tokenizer(build_word_tokenizer(words, tmp_path)))
    prompt = chat.prompt_ids("Use tools.", QUESTION)
    header = chat.generation_prompt_ids()
    with_latest = compacted_context(chat, "Use tools.", QUESTION, None, "record", "Alpha river")
    without = compacted_context(chat, "Use tools.", QUESTION, None, "record", None)
    original = prompt[:-len(header)]
    assert with_latest[:len(original)] == original and without[:len(original)] == original
    assert without == original + chat.user_ids("record") + header
    assert with_latest[:len(without) - len(header)] == without[:-len(header)]
    assert with_latest[-len(header):] == header and len(with_latest) > len(without)


@pytest.mark.parametrize("budget", [-1, 100, 4097])
def test_context_budget_must_leave_room_for_record_and_turn_within_max_context(budget):
    with pytest.raises(ValueError, match="context_budget"):
        RolloutConfig(max_context=4096, turn_token_budget=64, context_record_tokens=64, context_budget=budget)


def test_context_management_is_off_by_default():
    assert RolloutConfig().context_budget == 0
