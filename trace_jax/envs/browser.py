"""Browser tools ``search`` / ``open`` / ``find`` over an offline corpus, with gpt-oss ``browser`` semantics.

The agent loop calls one entry point, ``Browser.execute(name, arguments) -> str``; ``arguments`` may be a dict or the
raw JSON string the model wrote. Every failure (malformed JSON, wrong argument types, unknown link id, cursor out of
range, location past the end of a page, ``find`` on a results page, unknown tool) comes back as an observation text
starting with ``"Error: "``; ``execute`` never raises. ``Browser.step`` returns the same text plus structured state
(``Observation``) for programmatic agents such as the oracle.

Semantics follow gpt-oss's ``SimpleBrowserTool`` (``gpt_oss/tools/simple_browser/simple_browser_tool.py``):

* Every successful call pushes a page onto a stack; the page's index in the stack is its *cursor*, shown as ``[n]``
  in front of the observation. ``cursor=-1`` (the default) means the latest page.
* ``search(query, topn)`` pushes a results page: one numbered link per hit, ``【{id}†{title}†{domain}】`` followed by a
  snippet (the start of the document).
* ``open(id, cursor, loc, num_lines)``: an integer ``id >= 0`` follows link ``id`` on page ``cursor``; a string
  ``id`` opens that url (a digit string is read as a link id, because small models often quote numbers);
  ``id=-1`` re-shows page ``cursor`` from line ``loc`` (scrolling). Text is wrapped to ``wrap_width`` columns and
  shown as ``L{n}: ...`` lines, at most ``view_lines`` of them (``num_lines`` can only narrow the view), under a
  header ``**viewing lines [a - b] of last**``. Following a ``find`` match link opens the document a few lines above
  the match, as gpt-oss does.
* ``find(pattern, cursor)``: case-insensitive substring match against each wrapped line of a *document* page
  (``find`` on a search or find results page is an error, as in gpt-oss); each match shows the matching line and
  the next ``find_context_lines - 1`` lines, headed ``# 【{k}†match at L{n}】``; the results form a new page whose
  links point back into the document.

Differences from gpt-oss, all deliberate: the view budget is counted in lines, not o200k tokens (no tokenizer
dependency; the task generator needs to know exactly where the first view ends); ``topn`` is honoured up to
``max_search_results``; unknown argument names are errors instead of Python ``TypeError`` s; errors are prefixed
``Error: ``.

This module knows about corpora and the search index, not about tasks, rewards or chat formats.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping
from urllib.parse import quote

from trace_jax.envs.corpus import Corpus, Document
from trace_jax.envs.search_index import SearchIndex

TOOL_NAMES = ("search", "open", "find")
ERROR_PREFIX = "Error: "
MAX_QUERY_CHARS = 2000
MAX_PATTERN_CHARS = 500

BROWSER_INSTRUCTIONS = (
    "Tool for browsing an offline collection of documents.\n"
    "The `cursor` appears in brackets before each browsing display: `[{cursor}]`.\n"
    "Links look like `【{id}†{title}†{domain}】`; open one with open(id=...), optionally with cursor=... to use an "
    "earlier page. Scroll with open(cursor=..., loc=...). Search inside an opened document with find(pattern=...)."
)

PageKind = Literal["search", "document", "find"]


class ToolError(Exception):
    """A tool call the browser refuses; its message becomes the error observation."""


@dataclass(frozen=True, slots=True)
class Link:
    """A numbered link on a page: where ``open(id=...)`` goes. ``line`` is set for find-result links."""

    id: int
    url: str
    title: str
    docid: str | None
    line: int | None = None


@dataclass(frozen=True, slots=True)
class Page:
    """One entry of the page stack. ``lines`` are the wrapped display lines (numbered ``L0``.. in observations)."""

    kind: PageKind
    url: str
    title: str
    lines: tuple[str, ...]
    links: Mapping[int, Link] = field(default_factory=dict)
    docid: str | None = None  # the document shown (document pages) or searched (find pages)
    query: str | None = None  # the search query or find pattern
    results: tuple[tuple[str, float], ...] = ()  # (docid, score) for search pages, best first

    @property
    def num_lines(self) -> int:
        return len(self.lines)

    def link_for(self, docid: str) -> int | None:
        """The first link id on this page that leads to ``docid`` (``None`` if none does)."""
        for link_id, link in self.links.items():
            if link.docid == docid:
                return link_id
        return None


@dataclass(frozen=True, slots=True)
class Observation:
    """Result of one tool call: ``text`` is what the model sees; the rest is for programmatic agents."""

    text: str
    ok: bool
    page: Page | None = None  # the page pushed by this call (None on error)
    cursor: int | None = None  # its index in the page stack
    first_line: int | None = None  # first and last line shown (inclusive)
    last_line: int | None = None


def domain_of(url: str) -> str:
    """``https://en.wiki.local/a/b`` -> ``en.wiki.local``; a url without a scheme gives its first path part."""
    rest = url.split("://", 1)[1] if "://" in url else url
    return rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rsplit("@", 1)[-1]


_LINK_UNSAFE = re.compile(r"[【】†\n\r]")


def _link_text(text: str) -> str:
    # The link markup uses 【, † and 】 as delimiters, so they must not appear inside a title or domain.
    return _LINK_UNSAFE.sub(" ", text).strip()


def _wrap_paragraph(paragraph: str, width: int) -> list[str]:
    # Greedy word wrap (what textwrap.wrap does for plain prose, ~5x faster); a word longer than the width is cut.
    lines: list[str] = []
    current = ""
    for word in paragraph.split():
        while len(word) > width:
            if current:
                lines.append(current)
                current = ""
            lines.append(word[:width])
            word = word[width:]
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current = f"{current} {word}"
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def wrap_text(text: str, width: int) -> tuple[str, ...]:
    """Split on newlines and wrap each paragraph to ``width`` columns (runs of spaces collapse to one); empty
    lines are kept and a page has at least one line."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        wrapped = _wrap_paragraph(paragraph, width)
        lines.extend(wrapped if wrapped else [""])
    return tuple(lines) or ("",)


def snippet_of(text: str, max_chars: int) -> str:
    """The first ``max_chars`` characters of ``text`` with whitespace collapsed, cut at a word boundary."""
    # Only the head of the text can reach the snippet; splitting all of a long document would dominate search.
    flat = " ".join(text[: 2 * max_chars + 64].split())
    if len(flat) <= max_chars:
        return flat
    cut = flat[:max_chars]
    space = cut.rfind(" ")
    return (cut[:space] if space > max_chars // 2 else cut).rstrip() + " ..."


# Argument checking -------------------------------------------------------------------------------------------------

_INT_STRING = re.compile(r"\s*[+-]?\d{1,30}\s*")


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ToolError(f"`{name}` must be an integer, got a boolean ({value}).")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT_STRING.fullmatch(value):
        return int(value)
    raise ToolError(f"`{name}` must be an integer, got {type(value).__name__} ({_short(value)}).")


def _as_text(value: Any, name: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise ToolError(f"`{name}` must be a string, got {type(value).__name__} ({_short(value)}).")
    if not value.strip():
        raise ToolError(f"`{name}` must be a non-empty string.")
    if len(value) > max_chars:
        raise ToolError(f"`{name}` is too long ({len(value)} characters; at most {max_chars}).")
    return value


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_arguments(arguments: Any) -> dict[str, Any]:
    """Tool arguments as a dict: accepts a dict, a JSON object string, or ``None``/``""`` (no arguments)."""
    if arguments is None:
        return {}
    if isinstance(arguments, (bytes, bytearray)):
        try:
            arguments = arguments.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError("arguments must be UTF-8 JSON text.") from None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as error:
            # json's own messages vary ("Expecting ',' delimiter"...); the position alone keeps the wording fixed.
            detail = f"error at line {error.lineno} column {error.colno}" if isinstance(
                error, json.JSONDecodeError) else "nested too deeply"
            raise ToolError(f"arguments are not valid JSON ({detail}); send a JSON object such as "
                            '{"query": "..."}.') from None
    if not isinstance(arguments, Mapping):
        raise ToolError(f"arguments must be a JSON object, got {type(arguments).__name__} ({_short(arguments)}).")
    for key in arguments:
        if not isinstance(key, str):
            raise ToolError(f"argument names must be strings, got {_short(key)}.")
    return dict(arguments)


# The browser ------------------------------------------------------------------------------------------------------


class Browser:
    """gpt-oss-style browser over ``corpus`` searched with ``index``. One instance per concurrent episode.

    Args:
      corpus: the documents that ``open`` can show.
      index: a ``SearchIndex`` over the same corpus (built if omitted).
      wrap_width: columns per display line.
      view_lines: most lines shown by one ``open``/``search``/``find`` observation (the view budget).
      max_search_results: upper bound for ``topn``.
      default_topn: ``topn`` when the model does not give one.
      snippet_chars: length of the snippet under each search result.
      find_context_lines: lines shown per ``find`` match (the match and the lines after it).
      max_find_results: most matches listed by one ``find``.
      result_filter: optional ``(query, [(docid, score)]) -> [(docid, score)]`` applied to search results before
        display (e.g. to inject retrieval noise); it must be deterministic for reproducible episodes.
      document_cache_size: wrapped documents and rendered result entries kept across episodes (cleared when full).
    """

    def __init__(self, corpus: Corpus, index: SearchIndex | None = None, *, wrap_width: int = 80,
                 view_lines: int = 30, max_search_results: int = 10, default_topn: int = 10,
                 snippet_chars: int = 160, find_context_lines: int = 4, max_find_results: int = 50,
                 result_filter: Callable[[str, list[tuple[str, float]]], list[tuple[str, float]]] | None = None,
                 document_cache_size: int = 20_000):
        if wrap_width < 10 or view_lines < 1 or max_search_results < 1 or find_context_lines < 1:
            raise ValueError("wrap_width >= 10, view_lines >= 1, max_search_results >= 1 and "
                             "find_context_lines >= 1 are required.")
        if index is not None and index.corpus is not corpus:
            raise ValueError("index was built over a different Corpus object; pass the corpus it was built from.")
        self.corpus = corpus
        self.index = index if index is not None else SearchIndex.build(corpus)
        self.wrap_width = wrap_width
        self.view_lines = view_lines
        self.max_search_results = max_search_results
        self.default_topn = max(1, min(default_topn, max_search_results))
        self.snippet_chars = snippet_chars
        self.find_context_lines = find_context_lines
        self.max_find_results = max_find_results
        self.result_filter = result_filter
        # Wrapped document pages are pure functions of (document, width): cache them across episodes.
        self._document_pages: dict[str, Page] = {}
        self._search_entries: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._document_cache_size = document_cache_size
        self.pages: list[Page] = []

    def fork(self) -> "Browser":
        """A new browser for another concurrent episode: same corpus, index, settings and render caches, its own
        empty page stack. Cheaper than constructing one, and the caches are shared."""
        other = object.__new__(Browser)
        other.__dict__.update(self.__dict__)
        other.pages = []
        return other

    # Episode state ------------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new episode: empty page stack (cheap; caches of wrapped documents are kept)."""
        self.pages = []

    @property
    def cursor(self) -> int:
        """Cursor of the latest page, -1 before the first successful call."""
        return len(self.pages) - 1

    @property
    def current_page(self) -> Page | None:
        return self.pages[-1] if self.pages else None

    def get_page(self, cursor: int = -1) -> Page:
        if not self.pages:
            raise ToolError("No pages are open yet; call search first.")
        if cursor == -1:
            return self.pages[-1]
        if not 0 <= cursor < len(self.pages):
            raise ToolError(f"Cursor `{cursor}` is out of range. "
                            f"Available cursor indices: [0 - {len(self.pages) - 1}].")
        return self.pages[cursor]

    # Entry points -------------------------------------------------------------------------------------------------

    def execute(self, name: Any, arguments: Any = None) -> str:
        """Run tool ``name`` (``search``/``open``/``find``, optionally prefixed ``browser.``) and return the text
        observation. Never raises: every problem is returned as ``"Error: ..."`` text."""
        return self.step(name, arguments).text

    def step(self, name: Any, arguments: Any = None) -> Observation:
        """Like ``execute`` but returns the structured ``Observation``."""
        try:
            tool = self._tool_name(name)
            kwargs = parse_arguments(arguments)
            if tool == "search":
                return self.search(**self._check_keys(tool, kwargs, {"query", "topn"}, {"top_n", "source"}))
            if tool == "open":
                return self.open(**self._check_keys(tool, kwargs, {"id", "cursor", "loc", "num_lines"},
                                                    {"view_source", "source"}))
            return self.find(**self._check_keys(tool, kwargs, {"pattern", "cursor"}, set()))
        except ToolError as error:
            return Observation(text=ERROR_PREFIX + str(error), ok=False)
        except Exception as error:  # a bug must not kill the rollout; the text makes it visible
            return Observation(text=f"{ERROR_PREFIX}internal browser error ({type(error).__name__}: "
                                    f"{_short(str(error), 200)}).", ok=False)

    @staticmethod
    def _tool_name(name: Any) -> str:
        if not isinstance(name, str):
            raise ToolError(f"tool name must be a string, got {type(name).__name__}. Tools: {list(TOOL_NAMES)}.")
        bare = name.strip()
        if bare.startswith("browser."):
            bare = bare[len("browser."):]
        if bare not in TOOL_NAMES:
            raise ToolError(f"unknown tool {_short(name)}. Available tools: {list(TOOL_NAMES)}.")
        return bare

    @staticmethod
    def _check_keys(tool: str, kwargs: dict[str, Any], allowed: set[str], ignored: set[str]) -> dict[str, Any]:
        unknown = sorted(set(kwargs) - allowed - ignored)
        if unknown:
            raise ToolError(f"unknown argument(s) {unknown} for `{tool}`; it takes {sorted(allowed)}.")
        if "top_n" in kwargs and "topn" not in kwargs:  # gpt-oss accepts both spellings
            kwargs["topn"] = kwargs["top_n"]
        return {key: value for key, value in kwargs.items() if key in allowed}

    # Tools (also callable directly; they raise ToolError, which step() turns into an observation) ---------------

    def search(self, query: Any = None, topn: Any = None) -> Observation:
        if query is None:
            raise ToolError("`search` needs a `query` string, e.g. {\"query\": \"river cities\"}.")
        query = _as_text(query, "query", MAX_QUERY_CHARS)
        topn = self.default_topn if topn is None else _as_int(topn, "topn")
        if topn < 1:
            raise ToolError(f"`topn` must be at least 1, got {topn}.")
        results = self.index.search(query, min(topn, self.max_search_results))
        if self.result_filter is not None:
            results = list(self.result_filter(query, list(results)))[: self.max_search_results]
        lines: list[str] = []
        links: dict[int, Link] = {}
        for link_id, (docid, _score) in enumerate(results):
            document = self.corpus.by_docid(docid)
            links[link_id] = Link(id=link_id, url=document.url, title=document.title, docid=docid)
            link_label, snippet_lines = self._search_entry(document)
            lines.append(f"【{link_id}†{link_label}】")
            lines.extend(snippet_lines)
        if not results:
            lines = [f"No results found for `{query}`."]
        page = Page(kind="search", url="", title=f"Search results for `{query}`", lines=tuple(lines),
                    links=links, query=query, results=tuple(results))
        return self._push_and_show(page, loc=0, num_lines=-1)

    def open(self, id: Any = -1, cursor: Any = -1, loc: Any = -1, num_lines: Any = -1) -> Observation:
        cursor = _as_int(cursor, "cursor")
        loc = _as_int(loc, "loc")
        num_lines = _as_int(num_lines, "num_lines")
        if isinstance(id, str) and not _INT_STRING.fullmatch(id):
            url = id.strip()
            if not url:
                raise ToolError("`id` must be a link id (integer) or a url, got an empty string.")
            document = self.corpus.by_url(url)
            if document is None:
                shown = url if len(url) <= 120 else url[:117] + "..."
                raise ToolError(f"Error fetching URL `{shown}`: no such page in the corpus. "
                                "Open a link id from a search results page instead.")
            page = self._document_page(document)
            start = 0
        else:
            link_id = _as_int(id, "id")
            current = self.get_page(cursor)
            if link_id >= 0:
                link = current.links.get(link_id)
                if link is None:
                    count = len(current.links)
                    available = "none on this page" if not count else ("0" if count == 1 else f"0-{count - 1}")
                    raise ToolError(f"Invalid link id `{link_id}` (valid ids: {available}).")
                page = self._document_page(self.corpus.by_docid(link.docid))
                # gpt-oss: land a few lines above a find match so its context is visible.
                start = 0 if link.line is None else (link.line - 4 if link.line > 4 else link.line)
            elif link_id == -1:
                page, start = current, 0
            else:
                raise ToolError(f"`id` must be a link id >= 0, or -1 to scroll the page at `cursor`; got {link_id}.")
        if loc < 0:
            loc = start
        return self._push_and_show(page, loc=loc, num_lines=num_lines)

    def find(self, pattern: Any = None, cursor: Any = -1) -> Observation:
        if pattern is None:
            raise ToolError("`find` needs a `pattern` string, e.g. {\"pattern\": \"born in\"}.")
        pattern = _as_text(pattern, "pattern", MAX_PATTERN_CHARS)
        cursor = _as_int(cursor, "cursor")
        page = self.get_page(cursor)
        if page.kind != "document":
            raise ToolError("Cannot run `find` on search results page or find results page; "
                            "open a document first.")
        needle = pattern.lower()
        lines: list[str] = []
        links: dict[int, Link] = {}
        line_index = 0
        while line_index < page.num_lines and len(links) < self.max_find_results:
            if needle not in page.lines[line_index].lower():
                line_index += 1
                continue
            match_id = len(links)
            links[match_id] = Link(id=match_id, url=page.url, title=page.title, docid=page.docid, line=line_index)
            if lines:
                lines.append("")
            lines.append(f"# 【{match_id}†match at L{line_index}】")
            lines.extend(page.lines[line_index: line_index + self.find_context_lines])
            line_index += self.find_context_lines
        if not links:
            lines = [f"No `find` results for pattern: `{pattern}`"]
        result_page = Page(kind="find", url=f"{page.url}/find?pattern={quote(pattern)}",
                           title=f"Find results for text: `{pattern}` in `{page.title}`", lines=tuple(lines),
                           links=links, docid=page.docid, query=pattern)
        return self._push_and_show(result_page, loc=0, num_lines=-1)

    # Rendering ----------------------------------------------------------------------------------------------------

    def _search_entry(self, document: Document) -> tuple[str, tuple[str, ...]]:
        """``title†domain`` and the wrapped snippet lines of a result (cached: results repeat across episodes)."""
        entry = self._search_entries.get(document.docid)
        if entry is None:
            if len(self._search_entries) >= self._document_cache_size:
                self._search_entries.clear()
            title = _link_text(document.title) or document.docid
            snippet = snippet_of(document.text, self.snippet_chars)
            entry = (f"{title}†{_link_text(domain_of(document.url))}",
                     wrap_text(snippet, self.wrap_width) if snippet else ())
            self._search_entries[document.docid] = entry
        return entry

    def _document_page(self, document: Document) -> Page:
        page = self._document_pages.get(document.docid)
        if page is None:
            if len(self._document_pages) >= self._document_cache_size:
                self._document_pages.clear()
            page = Page(kind="document", url=document.url, title=document.title,
                        lines=wrap_text(document.text, self.wrap_width), docid=document.docid)
            self._document_pages[document.docid] = page
        return page

    def _push_and_show(self, page: Page, *, loc: int, num_lines: int) -> Observation:
        total = page.num_lines
        if loc >= total:
            # gpt-oss pushes then pops on this error; the stack ends up unchanged either way.
            raise ToolError(f"Invalid location parameter: `{loc}`. Cannot exceed page maximum of {total - 1}.")
        shown = self.view_lines if num_lines <= 0 else min(num_lines, self.view_lines)
        end = min(loc + shown, total)
        self.pages.append(page)
        cursor = len(self.pages) - 1
        header = f"[{cursor}] {page.title}"
        if page.url:
            header += f" ({page.url})"
        body = "\n".join(f"L{n}: {page.lines[n]}" for n in range(loc, end))
        text = f"{header}\n**viewing lines [{loc} - {end - 1}] of {total - 1}**\n\n{body}"
        return Observation(text=text, ok=True, page=page, cursor=cursor, first_line=loc, last_line=end - 1)


# Tool schemas -----------------------------------------------------------------------------------------------------


def tool_schemas() -> list[dict[str, Any]]:
    """The three tools in the OpenAI function-tool format (``{"type": "function", "function": {name,
    description, parameters}}``), as chat templates (``apply_chat_template(tools=...)``) expect."""
    integer = {"type": "integer"}
    functions = [
        {
            "name": "search",
            "description": "Searches the document collection for `query` and displays the top `topn` results as "
                           "numbered links `【{id}†{title}†{domain}】` with snippets.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Search query."},
                    "topn": {**integer, "description": "Number of results to show.", "default": 10},
                },
                "required": ["query"],
            },
        },
        {
            "name": "open",
            "description": "Opens link `id` from the page at `cursor` (default: the latest page), or the url `id` "
                           "if it is a string, showing numbered lines from `loc`. Without `id`, scrolls the page at "
                           "`cursor` to line `loc`.",
            "parameters": {
                "type": "object",
                "properties": {
                    "id": {"type": ["integer", "string"], "description": "Link id on the page, or a url.",
                           "default": -1},
                    "cursor": {**integer, "description": "Page to act on (the number in brackets).", "default": -1},
                    "loc": {**integer, "description": "First line to show.", "default": -1},
                    "num_lines": {**integer, "description": "Number of lines to show (-1: a full view).",
                                  "default": -1},
                },
                "required": [],
            },
        },
        {
            "name": "find",
            "description": "Finds case-insensitive matches of `pattern` in the document at `cursor` (default: the "
                           "latest page) and shows each match with a few lines of context.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "description": "Text to look for."},
                    "cursor": {**integer, "description": "Page to search in.", "default": -1},
                },
                "required": ["pattern"],
            },
        },
    ]
    return [{"type": "function", "function": function} for function in functions]


def observation_templates() -> tuple[str, ...]:
    """Every fixed string the tools emit (observation chrome, common error messages, schemas, instructions), with
    example values in the slots: pass to a closed-vocabulary builder (e.g. ``world.vocabulary(extra_texts=...)``) so
    a word-level tokenizer covers tool output. Values shown to the model that come from outside (document text,
    titles, urls, the model's own queries and patterns, repr of malformed arguments) are not included."""
    texts = [
        "[0] Search results for `q`", "**viewing lines [0 - 9] of 39**", "L0: ", "【0†title†domain】 ...",
        "No results found for `q`.", "# 【0†match at L12】", "Find results for text: `p` in `t` (u/find?pattern=p)",
        "No `find` results for pattern: `p`",
        ERROR_PREFIX + "No pages are open yet; call search first.",
        ERROR_PREFIX + "Cursor `5` is out of range. Available cursor indices: [0 - 4].",
        ERROR_PREFIX + "Invalid link id `7` (valid ids: 0-9).", ERROR_PREFIX + "Invalid link id `7` (valid ids: none "
                                                                               "on this page).",
        ERROR_PREFIX + "Invalid location parameter: `40`. Cannot exceed page maximum of 39.",
        ERROR_PREFIX + "Cannot run `find` on search results page or find results page; open a document first.",
        ERROR_PREFIX + "Error fetching URL `u`: no such page in the corpus. Open a link id from a search results "
                       "page instead.",
        ERROR_PREFIX + "`id` must be a link id >= 0, or -1 to scroll the page at `cursor`; got -2.",
        ERROR_PREFIX + "`id` must be a link id (integer) or a url, got an empty string.",
        ERROR_PREFIX + "`search` needs a `query` string, e.g. {\"query\": \"river cities\"}.",
        ERROR_PREFIX + "`find` needs a `pattern` string, e.g. {\"pattern\": \"born in\"}.",
        ERROR_PREFIX + "`query` must be a non-empty string.", ERROR_PREFIX + "`topn` must be at least 1, got 0.",
        ERROR_PREFIX + "`topn` must be an integer, got str ('x').", ERROR_PREFIX + "`topn` must be an integer, got a "
                                                                            "boolean (True).",
        ERROR_PREFIX + "`query` is too long (2001 characters; at most 2000).",
        ERROR_PREFIX + "unknown argument(s) ['x'] for `search`; it takes ['query', 'topn'].",
        ERROR_PREFIX + "unknown argument(s) ['x'] for `open`; it takes ['cursor', 'id', 'loc', 'num_lines'].",
        ERROR_PREFIX + "unknown argument(s) ['x'] for `find`; it takes ['cursor', 'pattern'].",
        ERROR_PREFIX + "unknown tool 'x'. Available tools: ['search', 'open', 'find'].",
        ERROR_PREFIX + "tool name must be a string, got int. Tools: ['search', 'open', 'find'].",
        ERROR_PREFIX + "arguments are not valid JSON (error at line 1 column 1); send a JSON object such "
                       "as {\"query\": \"...\"}.",
        ERROR_PREFIX + "arguments must be a JSON object, got list ([1]).",
        BROWSER_INSTRUCTIONS,
    ]
    texts += [json.dumps(schema) for schema in tool_schemas()]
    return tuple(texts)
