"""Context management for long episodes: the search-state record that replaces old tool observations.

With `RolloutConfig.context_budget` on, an episode whose next context would pass the budget *compacts*: its next
context is the original prompt, then one user turn holding a compact record of the episode's search so far, then
(when it fits) the most recent tool response (`compacted_context`). This module builds that record, host side and
pure: from the parsed tool calls and the observation texts, never from model state.

What the record tracks (`SearchState`, built by `search_state`):

  * queries: every `search` call with a query, in order, with the titles of its top `TOP_RESULTS` results;
  * pages: every document the episode opened (an `open` observation whose header carries a url and is not a find
    page), title and url, first visit only;
  * clues: lines of opened pages and of find results that mention a *key term*, each with its source page. The
    key terms start as the question's entity words (`entity_words`: capitalised words of two or more letters and
    numbers of two or more digits, less a short list of sentence starters); every accepted clue adds its own
    entity words, so a chain of facts is followed from the question outwards. Lines are read in the order the
    episode saw them; a line already recorded is not repeated.

`render_record` writes the state as a short text within a token budget of its own: while the text is over budget
the longest section (ties: queries, then pages, then clues) loses its oldest entry. Everything is deterministic:
the same history gives the same record, so the same context.

This module knows the browser's observation layout (`trace_jax.envs.browser`) and the chat format; it knows nothing
about models, sampling, credit or training.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

from trace_jax.envs.browser import ERROR_PREFIX

TOP_RESULTS = 3
RECORD_HEADER = "Search state so far (older tool results were removed to fit the context):"
# Capitalised words that start sentences or name nothing; they are not entities.
_NOT_ENTITIES = frozenset(
    "A An And As At But By For From He Her His How If In Is It Its Of On Or She So That The Their There These They "
    "This Those To Was We What When Where Which Who Whom Whose Why With You L".split())
_ENTITY = re.compile(r"\b(?:[A-Z][\w'-]*\w|\d[\d,.]*\d)\b")
_LINK = re.compile(r"【(\d+)†([^†】]*)†[^】]*】")
_HEADER = re.compile(r"^\[\d+\] (.*?)(?: \((\S+)\))?$")
_LINE = re.compile(r"^L\d+: (.*)$")
_FIND_TITLE = re.compile(r"^Find results for text: `.*` in `(.*)`$")


@dataclasses.dataclass(frozen=True)
class Query:
    """A `search` call: its query and the titles of its top results (empty when it found nothing)."""

    query: str
    results: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Page:
    """A document the episode opened."""

    title: str
    url: str


@dataclasses.dataclass(frozen=True)
class Clue:
    """A line of an opened page (or of a find result) that mentions a key term, with its source page's title."""

    text: str
    source: str


@dataclasses.dataclass(frozen=True)
class SearchState:
    """What the episode has done so far: queries issued, pages opened, candidate clues (each in order)."""

    queries: tuple[Query, ...] = ()
    pages: tuple[Page, ...] = ()
    clues: tuple[Clue, ...] = ()


def entity_words(text: str) -> set[str]:
    """The lowercased entity words of `text`: capitalised words and numbers, less common sentence starters."""
    return {word.lower() for word in _ENTITY.findall(text) if word not in _NOT_ENTITIES}


def _mentions(line: str, terms: set[str]) -> bool:
    words = {word.lower() for word in re.findall(r"[\w'-]+", line)}
    return bool(words & terms)


def _arguments(arguments: Any) -> Mapping[str, Any]:
    if isinstance(arguments, Mapping):
        return arguments
    if isinstance(arguments, str):
        import json

        try:
            value = json.loads(arguments)
        except ValueError:
            return {}
        return value if isinstance(value, Mapping) else {}
    return {}


def search_state(question: str, tool_calls: Sequence[Any], observations: Sequence[str]) -> SearchState:
    """The `SearchState` of an episode from its history (`EpisodeRecord.tool_calls` and `.observations`).

    `tool_calls[k]` is `(name, arguments)` for a parsed call or the parse error's message (a string); error
    observations (`Error: ...`) add nothing.
    """
    if len(tool_calls) != len(observations):
        raise ValueError(f"search_state: {len(tool_calls)} tool calls but {len(observations)} observations; pass "
                         "one observation per tool call (EpisodeRecord.tool_calls and .observations)")
    terms = entity_words(question)
    queries: list[Query] = []
    pages: list[Page] = []
    clues: list[Clue] = []
    seen_pages: set[str] = set()
    seen_lines: set[str] = set()
    for call, observation in zip(tool_calls, observations):
        if isinstance(call, str) or observation.startswith(ERROR_PREFIX):
            continue
        name, arguments = call
        name = str(name).removeprefix("browser.")
        lines = observation.split("\n")
        header = _HEADER.match(lines[0]) if lines else None
        title, url = (header.group(1), header.group(2) or "") if header else ("", "")
        if name == "search":
            query = str(_arguments(arguments).get("query", "")).strip()
            results = tuple(link_title for _, link_title in _LINK.findall(observation))[:TOP_RESULTS]
            if query:
                queries.append(Query(query, results))
            continue
        find = _FIND_TITLE.match(title)
        if find:
            source = find.group(1)
        elif url and not title.startswith("Search results for `"):
            source = title
            if url not in seen_pages:
                seen_pages.add(url)
                pages.append(Page(title, url))
        else:
            continue  # scrolling a results page: nothing new about documents
        for line in lines[1:]:
            body = _LINE.match(line)
            text = body.group(1).strip() if body else ""
            if not text or text.startswith("# 【") or text in seen_lines or not _mentions(text, terms):
                continue
            seen_lines.add(text)
            clues.append(Clue(text, source))
            terms |= entity_words(text)
    return SearchState(tuple(queries), tuple(pages), tuple(clues))


def _record_text(queries: Sequence[Query], pages: Sequence[Page], clues: Sequence[Clue]) -> str:
    parts = [RECORD_HEADER]
    if queries:
        parts.append("Queries issued:")
        parts += [f'- "{q.query}" -> ' + ("; ".join(q.results) if q.results else "no results") for q in queries]
    if pages:
        parts.append("Pages opened:")
        parts += [f"- {p.title} ({p.url})" for p in pages]
    if clues:
        parts.append("Candidate clues:")
        parts += [f'- "{c.text}" [{c.source}]' for c in clues]
    return "\n".join(parts)


def render_record(state: SearchState, max_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The record's text, at most `max_tokens` by `count_tokens` when possible: while it is longer, the longest
    section (ties: queries, then pages, then clues) drops its oldest entry. The header alone is the floor."""
    sections = [list(state.queries), list(state.pages), list(state.clues)]
    text = _record_text(*sections)
    while count_tokens(text) > max_tokens and any(sections):
        longest = max(range(3), key=lambda i: (len(sections[i]), -i))
        sections[longest].pop(0)
        text = _record_text(*sections)
    return text


def compacted_context(chat, system: str | None, question: str, tools, record: str,
                      observation: str | None) -> list[int]:
    """Token ids of a compacted context: system (+ tools) and question as in the original prompt, one user turn with
    the record, the latest tool response when given, then the generation prompt (the next state's boundary is its
    end). The original prompt without its generation prompt is a prefix of it."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": question}, {"role": "user", "content": record}]
    if observation is not None:
        messages.append({"role": "tool", "content": observation})
    return list(chat.render(messages, tools=tools, add_generation_prompt=True).ids)
