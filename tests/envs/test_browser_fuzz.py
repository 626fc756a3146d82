"""Fuzz Browser.execute: arbitrary names and arguments never raise and always give a string observation."""

import json

from hypothesis import given
from hypothesis import strategies as st

from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus

CORPUS = Corpus.from_records([
    {"docid": "a", "url": "https://f.local/a", "title": "Alpha 【x】", "text": "alpha beta gamma\n" * 30},
    {"docid": "b", "url": "https://f.local/b", "title": "Beta", "text": "beta delta ünïcödé 🚀"},
])
BROWSER = Browser(CORPUS, view_lines=5)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
argument_names = st.sampled_from(["query", "topn", "top_n", "id", "cursor", "loc", "num_lines", "pattern", "source",
                                  "view_source"]) | st.text(max_size=10)
argument_dicts = st.dictionaries(argument_names, json_values, max_size=5)
tool_names = st.sampled_from(["search", "open", "find", "browser.open", "browser.find"]) | st.text(max_size=12) \
    | st.none() | st.integers()


def check(text):
    assert isinstance(text, str) and text
    assert "internal browser error" not in text, text


def _prime():
    BROWSER.reset()
    BROWSER.execute("search", {"query": "beta"})
    BROWSER.execute("open", {"id": 0})


@given(name=tool_names, arguments=argument_dicts)
def test_execute_with_arbitrary_dict_arguments_returns_text(name, arguments):
    _prime()
    check(BROWSER.execute(name, arguments))


@given(name=tool_names, arguments=argument_dicts)
def test_errors_leave_the_stack_and_successes_push_one_page(name, arguments):
    _prime()
    before = list(BROWSER.pages)
    observation = BROWSER.step(name, arguments)
    if observation.ok:
        assert BROWSER.pages[:-1] == before and BROWSER.pages[-1] is observation.page
        assert observation.text.startswith(f"[{len(before)}] ")
    else:
        assert BROWSER.pages == before and observation.text.startswith("Error: ")


@given(name=st.sampled_from(["search", "open", "find"]), raw=st.text(max_size=60))
def test_execute_with_arbitrary_argument_strings_returns_text(name, raw):
    _prime()
    text = BROWSER.execute(name, raw)
    check(text)


@given(name=st.sampled_from(["search", "open", "find"]), arguments=argument_dicts,
       cut=st.integers(min_value=0, max_value=80))
def test_execute_with_truncated_json_returns_text(name, arguments, cut):
    _prime()
    raw = json.dumps(arguments)[:cut]
    check(BROWSER.execute(name, raw))


@given(arguments=st.one_of(st.lists(st.integers()), st.integers(), st.floats(), st.tuples(st.text())))
def test_execute_with_non_object_arguments_is_an_error(arguments):
    _prime()
    text = BROWSER.execute("open", arguments)
    check(text)
    assert text.startswith("Error: ")


@given(raw=st.binary(max_size=40))
def test_execute_with_arbitrary_bytes_returns_text(raw):
    _prime()
    check(BROWSER.execute("search", raw))


@given(cursor=st.integers(min_value=-(10**30), max_value=10**30), loc=st.integers(min_value=-(10**30), max_value=10**30),
       num_lines=st.integers(min_value=-(10**30), max_value=10**30), link=st.integers(min_value=-5, max_value=10**30))
def test_open_with_huge_numbers_returns_text(cursor, loc, num_lines, link):
    _prime()
    check(BROWSER.execute("open", {"id": link, "cursor": cursor, "loc": loc, "num_lines": num_lines}))


@given(pattern=st.text(min_size=1, max_size=40), query=st.text(min_size=1, max_size=40))
def test_unicode_queries_and_patterns_return_text(pattern, query):
    _prime()
    check(BROWSER.execute("find", {"pattern": pattern}))
    check(BROWSER.execute("search", {"query": query}))
