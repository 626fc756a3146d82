"""Browser tool semantics (gpt-oss style) on a small hand-written corpus: paging, cursors, find, every error path."""

import json

import pytest

from trace_jax.envs.browser import Browser, Link, Observation, observation_templates, tool_schemas, wrap_text
from trace_jax.envs.corpus import Corpus
from trace_jax.envs.search_index import SearchIndex

LONG_TEXT = "\n".join(f"Paragraph {n}: the lighthouse keeper wrote entry number {n} in the log." for n in range(40))

DOCUMENTS = [
    {"docid": "ada", "url": "https://wiki.local/ada", "title": "Ada Lovelace",
     "text": "Ada Lovelace was a mathematician.\nShe was born in London.\nShe worked with Charles Babbage."},
    {"docid": "babbage", "url": "https://wiki.local/babbage", "title": "Charles Babbage",
     "text": "Charles Babbage designed the Analytical Engine.\nHe lived in London for most of his life."},
    {"docid": "london", "url": "https://wiki.local/london", "title": "London",
     "text": "London is a city on the river Thames.\nIt is the capital of England."},
    {"docid": "log", "url": "https://archive.local/log", "title": "Lighthouse Log", "text": LONG_TEXT},
    {"docid": "empty", "url": "https://archive.local/empty", "title": "Empty Page", "text": ""},
]


@pytest.fixture(scope="module")
def corpus():
    return Corpus.from_records(DOCUMENTS)


@pytest.fixture(scope="module")
def index(corpus):
    return SearchIndex.build(corpus)


@pytest.fixture
def browser(corpus, index):
    return Browser(corpus, index, view_lines=10, wrap_width=80)


def is_error(text):
    return text.startswith("Error: ")


# search ----------------------------------------------------------------------------------------------------------


def test_search_shows_numbered_links_with_title_domain_and_snippet(browser):
    text = browser.execute("search", {"query": "Analytical Engine"})
    assert text.startswith("[0] Search results for `Analytical Engine`\n**viewing lines [0 - ")
    assert "L0: 【0†Charles Babbage†wiki.local】" in text
    assert "L1: Charles Babbage designed the Analytical Engine." in text


def test_search_links_are_structured_for_programmatic_agents(browser):
    obs = browser.step("search", {"query": "London"})
    assert obs.ok and obs.cursor == 0 and obs.page.kind == "search"
    top = browser.corpus.by_docid(obs.page.results[0][0])
    assert obs.page.links[0] == Link(id=0, url=top.url, title=top.title, docid=top.docid)
    assert [link.docid for link in obs.page.links.values()] == [docid for docid, _ in obs.page.results]


def test_search_topn_limits_results(browser):
    obs = browser.step("search", {"query": "London", "topn": 2})
    assert len(obs.page.links) == 2


def test_search_topn_is_capped_by_max_search_results(corpus, index):
    browser = Browser(corpus, index, max_search_results=2)
    assert len(browser.step("search", {"query": "London", "topn": 10**30}).page.links) == 2


def test_search_accepts_gpt_oss_top_n_spelling_and_ignores_source(browser):
    obs = browser.step("search", {"query": "London", "top_n": 1, "source": "web"})
    assert obs.ok and len(obs.page.links) == 1


def test_search_without_matches_pushes_an_empty_results_page(browser):
    text = browser.execute("search", {"query": "zeppelin"})
    assert "No results found for `zeppelin`." in text and text.startswith("[0] ")
    assert browser.current_page.links == {}


def test_search_result_filter_can_reorder_results(corpus, index):
    browser = Browser(corpus, index, result_filter=lambda query, results: list(reversed(results)))
    plain = Browser(corpus, index).step("search", {"query": "London"}).page.results
    assert browser.step("search", {"query": "London"}).page.results == tuple(reversed(plain))


# open ------------------------------------------------------------------------------------------------------------


def test_open_follows_link_on_latest_page(browser):
    browser.execute("search", {"query": "Analytical Engine"})
    text = browser.execute("open", {"id": 0})
    assert text.startswith("[1] Charles Babbage (https://wiki.local/babbage)\n**viewing lines [0 - 1] of 1**\n\n")
    assert text.endswith("L0: Charles Babbage designed the Analytical Engine.\nL1: He lived in London for most of "
                         "his life.")


def test_open_follows_link_on_an_earlier_cursor(browser):
    search = browser.step("search", {"query": "London"})
    browser.execute("open", {"id": 0})
    obs = browser.step("open", {"id": 1, "cursor": 0})
    assert obs.ok and obs.cursor == 2 and obs.page.docid == search.page.links[1].docid


def test_open_by_url(browser):
    obs = browser.step("open", {"id": "https://wiki.local/london"})
    assert obs.ok and obs.page.docid == "london" and obs.cursor == 0


def test_open_digit_string_is_a_link_id(browser):
    browser.execute("search", {"query": "Analytical Engine"})
    assert browser.step("open", {"id": "0"}).page.docid == "babbage"


def test_open_shows_at_most_view_lines_and_pages_with_loc(browser):
    browser.execute("open", {"id": "https://archive.local/log"})
    first = browser.step("open", {})  # id=-1 re-shows the latest page
    assert (first.first_line, first.last_line) == (0, 9)
    assert "**viewing lines [0 - 9] of 39**" in first.text and "L10:" not in first.text
    second = browser.step("open", {"cursor": 0, "loc": 10})
    assert (second.first_line, second.last_line) == (10, 19)
    assert second.text.splitlines()[3] == "L10: Paragraph 10: the lighthouse keeper wrote entry number 10 in the log."


def test_open_last_view_is_truncated_at_page_end(browser):
    browser.execute("open", {"id": "https://archive.local/log"})
    obs = browser.step("open", {"loc": 35})
    assert "**viewing lines [35 - 39] of 39**" in obs.text


def test_num_lines_narrows_but_never_widens_the_view(browser):
    browser.execute("open", {"id": "https://archive.local/log"})
    assert browser.step("open", {"num_lines": 3}).last_line == 2
    assert browser.step("open", {"num_lines": 1000}).last_line == 9


def test_every_call_pushes_a_page_and_cursor_prefix_counts_up(browser):
    texts = [browser.execute("search", {"query": "London"}), browser.execute("open", {"id": 0}),
             browser.execute("find", {"pattern": "london"})]
    assert [t[:3] for t in texts] == ["[0]", "[1]", "[2]"]
    assert browser.cursor == 2 and len(browser.pages) == 3


def test_text_is_wrapped_to_wrap_width(corpus, index):
    browser = Browser(corpus, index, wrap_width=30, view_lines=100)
    obs = browser.step("open", {"id": "https://archive.local/log"})
    assert all(len(line) <= 30 for line in obs.page.lines)
    assert obs.page.lines == wrap_text(LONG_TEXT, 30)


def test_empty_document_has_one_empty_line(browser):
    obs = browser.step("open", {"id": "https://archive.local/empty"})
    assert obs.ok and obs.page.lines == ("",) and "**viewing lines [0 - 0] of 0**" in obs.text


def test_reset_empties_the_page_stack(browser):
    browser.execute("search", {"query": "London"})
    browser.reset()
    assert browser.pages == [] and browser.cursor == -1
    assert browser.execute("open", {"id": 0}) == "Error: No pages are open yet; call search first."


# find ------------------------------------------------------------------------------------------------------------


def test_find_is_case_insensitive_and_shows_context_lines(browser):
    browser.execute("open", {"id": "https://wiki.local/ada"})
    obs = browser.step("find", {"pattern": "LONDON"})
    assert obs.ok and obs.page.kind == "find"
    assert obs.text.startswith("[1] Find results for text: `LONDON` in `Ada Lovelace` (https://wiki.local/ada/find?pattern=LONDON)")
    assert obs.page.lines == ("# 【0†match at L1】", "She was born in London.", "She worked with Charles Babbage.")
    assert obs.page.links[0].line == 1 and obs.page.links[0].docid == "ada"


def test_find_lists_every_match_with_context_then_skips_past_it(browser):
    browser.execute("open", {"id": "https://archive.local/log"})
    obs = browser.step("find", {"pattern": "entry number 1"})  # matches L1, L10-L19
    starts = [link.line for link in obs.page.links.values()]
    assert starts == [1, 10, 14, 18]  # 4 context lines per match: L10 hides L11-L13
    assert obs.page.lines[:5] == ("# 【0†match at L1】",) + wrap_text(LONG_TEXT, 80)[1:5]


def test_find_on_an_earlier_cursor(browser):
    browser.execute("open", {"id": "https://wiki.local/ada"})
    browser.execute("open", {"id": "https://wiki.local/london"})
    assert browser.step("find", {"pattern": "babbage", "cursor": 0}).page.links[0].line == 2


def test_find_without_match_pushes_an_empty_find_page(browser):
    browser.execute("open", {"id": "https://wiki.local/ada"})
    text = browser.execute("find", {"pattern": "zeppelin"})
    assert text.endswith("L0: No `find` results for pattern: `zeppelin`") and browser.cursor == 1


def test_opening_a_find_link_lands_four_lines_above_the_match(browser):
    browser.execute("open", {"id": "https://archive.local/log"})
    browser.execute("find", {"pattern": "entry number 25 "})
    obs = browser.step("open", {"id": 0})
    assert obs.page.docid == "log" and obs.first_line == 21


def test_opening_a_find_link_near_the_top_lands_on_the_match(browser):
    browser.execute("open", {"id": "https://archive.local/log"})
    browser.execute("find", {"pattern": "entry number 3 "})
    assert browser.step("open", {"id": 0}).first_line == 3


# errors: always text, never exceptions, stack unchanged ---------------------------------------------------------


ERROR_CASES = [
    ("open", {"id": 0}, "Error: No pages are open yet; call search first."),
    ("find", {"pattern": "x"}, "Error: No pages are open yet; call search first."),
    ("search", {}, "Error: `search` needs a `query` string"),
    ("search", {"query": ""}, "Error: `query` must be a non-empty string."),
    ("search", {"query": 3}, "Error: `query` must be a string, got int"),
    ("search", {"query": "x", "topn": 0}, "Error: `topn` must be at least 1"),
    ("search", {"query": "x", "topn": "many"}, "Error: `topn` must be an integer, got str"),
    ("search", {"query": "x", "topn": True}, "Error: `topn` must be an integer, got a boolean"),
    ("search", {"query": "x", "limit": 3}, "Error: unknown argument(s) ['limit'] for `search`"),
    ("find", {}, "Error: `find` needs a `pattern` string"),
    ("open", {"id": "https://nowhere.local/x"}, "Error: Error fetching URL `https://nowhere.local/x`"),
    ("open", {"id": 1.5}, "Error: `id` must be an integer, got float"),
    ("open", {"id": None}, "Error: `id` must be an integer, got NoneType"),
    ("browse", {}, "Error: unknown tool 'browse'. Available tools: ['search', 'open', 'find']."),
    ("search", "{not json", "Error: arguments are not valid JSON"),
    ("search", "[1, 2]", "Error: arguments must be a JSON object, got list"),
    ("search", "null", "Error: arguments must be a JSON object, got NoneType"),
    (None, {}, "Error: tool name must be a string"),
]


@pytest.mark.parametrize("name,arguments,expected", ERROR_CASES)
def test_error_observations_on_fresh_browser(browser, name, arguments, expected):
    obs = browser.step(name, arguments)
    assert not obs.ok and obs.text.startswith(expected) and obs.page is None
    assert browser.pages == []


def test_unknown_link_id_is_an_error_naming_the_valid_ids(browser):
    browser.execute("search", {"query": "London"})
    assert browser.execute("open", {"id": 7}) == "Error: Invalid link id `7` (valid ids: 0-2)."


def test_link_id_on_a_page_without_links(browser):
    browser.execute("open", {"id": "https://wiki.local/ada"})
    assert browser.execute("open", {"id": 0}) == "Error: Invalid link id `0` (valid ids: none on this page)."


def test_invalid_cursor_is_an_error_listing_the_range(browser):
    browser.execute("search", {"query": "London"})
    assert browser.execute("open", {"id": 0, "cursor": 5}) == ("Error: Cursor `5` is out of range. "
                                                                "Available cursor indices: [0 - 0].")
    assert browser.execute("find", {"pattern": "x", "cursor": -2}).startswith("Error: Cursor `-2` is out of range")


def test_location_out_of_range_is_an_error_and_leaves_the_stack(browser):
    browser.execute("open", {"id": "https://wiki.local/ada"})
    text = browser.execute("open", {"loc": 3})
    assert text == "Error: Invalid location parameter: `3`. Cannot exceed page maximum of 2."
    assert browser.cursor == 0


def test_find_on_search_or_find_results_page_is_an_error(browser):
    browser.execute("search", {"query": "London"})
    assert browser.execute("find", {"pattern": "London"}).startswith(
        "Error: Cannot run `find` on search results page or find results page")
    browser.execute("open", {"id": 0})
    browser.execute("find", {"pattern": "London"})
    assert browser.execute("find", {"pattern": "London"}).startswith("Error: Cannot run `find`")


def test_negative_link_id_other_than_minus_one_is_an_error(browser):
    browser.execute("search", {"query": "London"})
    assert browser.execute("open", {"id": -3}).startswith("Error: `id` must be a link id >= 0, or -1")


def test_execute_accepts_json_strings_and_browser_prefix(browser):
    assert browser.execute("browser.search", json.dumps({"query": "London"})).startswith("[0] Search results")
    assert browser.execute("open", "").startswith("[1] ")  # no arguments: re-show the latest page


def test_numbers_as_integral_floats_or_digit_strings_are_accepted(browser):
    browser.execute("search", {"query": "London"})
    assert browser.step("open", {"id": 0.0, "cursor": "0", "loc": 0, "num_lines": 2.0}).ok


def test_index_built_for_another_corpus_is_rejected(corpus, index):
    with pytest.raises(ValueError, match="different Corpus"):
        Browser(Corpus.from_records(DOCUMENTS), index)


# schemas ---------------------------------------------------------------------------------------------------------


def test_tool_schemas_are_openai_function_tools_for_each_tool():
    schemas = tool_schemas()
    assert [s["function"]["name"] for s in schemas] == ["search", "open", "find"]
    for schema in schemas:
        assert schema["type"] == "function"
        function = schema["function"]
        assert set(function) == {"name", "description", "parameters"} and function["description"]
        assert function["parameters"]["type"] == "object"
        assert set(function["parameters"]["required"]) <= set(function["parameters"]["properties"])
    assert json.loads(json.dumps(schemas)) == schemas


def test_schema_parameters_match_what_execute_accepts(browser):
    for schema in tool_schemas():
        function = schema["function"]
        allowed = set(function["parameters"]["properties"])
        assert not browser.step(function["name"], {name: None for name in allowed} | {"zz": 1}).ok
        assert "unknown argument(s) ['zz']" in browser.execute(function["name"], {"zz": 1})


def test_observation_is_a_plain_dataclass():
    assert Observation(text="x", ok=True).page is None


def test_wrap_text_matches_textwrap_on_prose_and_cuts_overlong_words():
    import textwrap

    prose = "The river Kalo flows north past the city of Venmir, where the old mill stands. " * 5
    assert list(wrap_text(prose, 40)) == textwrap.wrap(prose, 40, break_on_hyphens=False)
    assert wrap_text("a\n\nb", 10) == ("a", "", "b")
    assert wrap_text("x" * 25, 10) == ("x" * 10, "x" * 10, "x" * 5)


def test_fork_shares_caches_but_not_the_page_stack(browser):
    browser.execute("search", {"query": "London"})
    other = browser.fork()
    assert other.pages == [] and browser.cursor == 0
    assert other.execute("open", {"id": "https://wiki.local/ada"}).startswith("[0] Ada Lovelace")
    assert other._document_pages is browser._document_pages and browser.cursor == 0


def test_page_link_for_finds_the_link_to_a_document(browser):
    page = browser.step("search", {"query": "London"}).page
    assert page.links[page.link_for("ada")].docid == "ada" and page.link_for("log") is None


def test_observation_templates_cover_the_fixed_words_of_real_observations(browser):
    import re

    template_words = {w for text in observation_templates() for w in re.findall(r"[A-Za-z]+", text)}
    corpus_words = {w for d in DOCUMENTS for field in ("title", "text", "url") for w in re.findall(r"[A-Za-z]+", d[field])}
    session = [("search", {"query": "London"}), ("open", {"id": 0}), ("find", {"pattern": "London"}),
               ("find", {"pattern": "zeppelin", "cursor": 1}), ("search", {"query": "zeppelin"}),
               ("open", {"id": 9}), ("open", {"cursor": 99}), ("open", {"loc": 99}), ("find", {"pattern": "x"}),
               ("open", {"id": "https://nowhere.local"}), ("search", "{"), ("nope", {}), ("search", {"x": 1})]
    for name, arguments in session:
        observed = set(re.findall(r"[A-Za-z]+", browser.execute(name, arguments)))
        assert observed <= template_words | corpus_words | {"zeppelin", "nowhere", "local", "nope", "x"}, name
