"""A gold-guided oracle agent that solves procedural tasks with the browser tools and records chat trajectories.

The oracle knows each task's clue chain (which page holds which fact). It reaches every clue page through the tool
API only (``Browser.step(name, arguments)``: ``search`` for the page's entity, ``open`` the matching result, read
the view, ``find`` a relation keyword, scroll as a last resort) and counts a clue as confirmed only when its value
is visible in a tool observation of that page. It answers with the gold answer when every clue was confirmed and
with "unknown" otherwise, so its solve rate measures whether the tasks are answerable through the tools.

Optional realistic detours (``OracleConfig.detour_prob``): open a wrong search result and go back to the results
page by cursor, or try a ``find`` pattern that is not on the page.

Failed demonstrations on purpose (``OracleConfig.failure``; ABC-SFT trains on correct and incorrect teacher
trajectories, credit-spec section 3): ``"wrong_page"`` follows the chain to its last clue, then opens a wrong result
of that clue's search and answers that page's title; ``"give_up"`` follows the chain up to a clue drawn at random
(the episode's seed) and answers "unknown". Either answer is wrong by construction (a wrong page whose title is the
gold answer, or a search with no other result, gives up instead).

Trajectories use the OpenAI chat messages format: ``system``, ``user`` (the question), ``assistant`` messages with
``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``), ``tool`` messages
with ``tool_call_id``, and a final ``assistant`` message containing ``<answer>...</answer>``.

This module knows about tasks, worlds and the browser; not about models, tokenizers or training.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from trace_jax.envs.answers import answer_reward
from trace_jax.envs.browser import BROWSER_INSTRUCTIONS, Browser, Observation, tool_schemas
from trace_jax.envs.corpus import Corpus
from trace_jax.envs.corpus_browser import corpus_browser, retrieval_noise_filter  # noqa: F401 (re-exported)
from trace_jax.envs.search_index import SearchIndex
from trace_jax.envs.tasks import IDENTIFY_NP, Clue, Task
from trace_jax.envs.world import FACT_TEMPLATES, LIST_TEMPLATES, World, join_names, vocabulary, words

# The harness's answer format (the system prompt asks for it; `answers.extract_answer` reads the last one).
ANSWER_TAGS = "<answer>{answer}</answer>"
SYSTEM_PROMPT = (
    "You are a research agent. Answer the question by searching and reading documents with the browser tools. "
    "Think step by step, then give the final answer as " + ANSWER_TAGS.format(answer="your answer") + ".\n\n"
    + BROWSER_INSTRUCTIONS
)
# What the oracle says before each tool call (words come from this text, the tasks and the world).
SAY_SEARCH = "I will search for {query}."
SAY_OPEN = "Result {id} is {title}. I will open it."
SAY_WRONG_OPEN = "Result {id} might help. I will open it."
SAY_BACK = "This page is not the one I need. I will go back to the results and open result {id}, {title}."
SAY_FIND = "I will look for {pattern} on this page."
SAY_SCROLL = "I will read further down the page."
SAY_ANSWER = "The answer is {answer}.\n" + ANSWER_TAGS
SAY_GIVE_UP = "I could not find the answer.\n" + ANSWER_TAGS.format(answer="unknown")
UNKNOWN_ANSWER = "unknown"
# Joins the facts confirmed since the oracle's last message (its notes) and what it says next, in one message.
NOTE_SEPARATOR = " "
FAILURES = ("", "wrong_page", "give_up")  # OracleConfig.failure: "" = solve as well as the tools allow

# Relation -> find patterns tried in order (they match the fact templates of world.py).
FIND_KEYWORDS = {
    "born_in": ("born", "native", "birthplace"),
    "works_for": ("works", "employ"),
    "studied_at": ("studied", "graduated", "student"),
    "headquartered_in": ("headquarter", "offices", "based"),
    "located_in": ("located", "campus", "stands", "based"),
    "on_river": ("River",),
    "population": ("population", "people"),
    "founded_year": ("founded", "established", "dates", "settlers"),
    "university_founded_year": ("founded", "established", "opened", "students"),
    "company_founded_year": ("founded", "established", "trading", "started"),
    "length_km": ("kilometres",),
    "birth_year": ("born", "world", "year of birth"),
    "profession": ("works as", "profession", "trade", "living"),
    "industry": ("company", "industry", "business", "trade"),
    "list:born_in": ("born in", "natives"),
    "list:headquartered_in": ("companies",),
    "list:located_in": ("universities", "home to"),
    "list:on_river": ("cities",),
}
# Search words for a page identified by an attribute value rather than a name (reverse lookups).
IDENTIFY_QUERY = {
    "length_km": "river {v} kilometres long",
    "population": "city population {v}",
    "founded_year": "city founded {v}",
    "university_founded_year": "university founded {v}",
    "company_founded_year": "company founded {v}",
}
# Fixed strings of the browser's observations (see browser.py), for the trajectory vocabulary.
BROWSER_TEXTS = (
    "【0†title†domain】", "[0] title (https://wiki.local/x)", "**viewing lines [0 - 9] of 9**", "L0: ...",
    "# 【0†match at L0】", "Find results for text: `x` in `y`", "Search results for `x`",
    "No `find` results for pattern: `x`", "No results found for `x`.", "Error: ",
)
ORACLE_TEXTS = (SYSTEM_PROMPT, SAY_SEARCH, SAY_OPEN, SAY_WRONG_OPEN, SAY_BACK, SAY_FIND, SAY_SCROLL,
                SAY_ANSWER, SAY_GIVE_UP, " ".join(" ".join(v) for v in FIND_KEYWORDS.values()),
                " ".join(IDENTIFY_QUERY.values()),
                '{"query": "x", "topn": 1, "id": 1, "cursor": 1, "loc": 1, "num_lines": 1, "pattern": "x"}',
                "search open find system user assistant tool", json.dumps(tool_schemas()))


# Python type names that the browser's argument errors quote ("got NoneType (None)").
TYPE_NAMES = "NoneType None bool int float str list dict bytes True False"


def _code_string_texts(module: Any) -> list[str]:
    """Every string literal in ``module``'s code except docstrings (its messages, including f-string parts)."""
    tree = ast.parse(inspect.getsource(module))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def trajectory_vocabulary() -> list[str]:
    """Every word token (``world.words``) of documents, questions, answers, tool observations and oracle messages.

    This is the closed vocabulary for a word-level tokenizer over procedural tasks and trajectories. Tool output is
    covered including the browser's error messages (read from its code), apart from text a policy itself wrote and
    the browser echoes back (e.g. a misspelt query), which is in the policy's vocabulary by construction.
    """
    from trace_jax.envs import browser as browser_module

    return vocabulary(extra_texts=BROWSER_TEXTS + ORACLE_TEXTS + (TYPE_NAMES,)
                      + tuple(browser_module.observation_templates())
                      + tuple(_code_string_texts(browser_module)))


# ------------------------------------------------------------------------------------------------------------------
# Environment construction
# ------------------------------------------------------------------------------------------------------------------


def make_browser(world_or_corpus: World | Corpus, *, snippet_chars: int = 160, view_lines: int = 30,
                 wrap_width: int = 80, retrieval_noise: float = 0.0, noise_seed: int = 0,
                 index: SearchIndex | None = None, cache_dir: str | os.PathLike | None = None) -> Browser:
    """A browser over a world's corpus (or any corpus) with the environment's difficulty knobs: ``corpus_browser``.

    The index is built in memory unless ``cache_dir`` is given (a procedural world's index takes milliseconds);
    with ``cache_dir`` it is loaded from / saved to that cache like an external corpus's.
    """
    corpus = world_or_corpus if isinstance(world_or_corpus, Corpus) else Corpus.from_records(
        world_or_corpus.documents, source="world document")
    return corpus_browser(corpus, cache_dir=False if cache_dir is None else cache_dir, index=index,
                          snippet_chars=snippet_chars, view_lines=view_lines, wrap_width=wrap_width,
                          retrieval_noise=retrieval_noise, noise_seed=noise_seed)


# ------------------------------------------------------------------------------------------------------------------
# The oracle
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OracleConfig:
    """Oracle behaviour.

    Attributes:
      detour_prob: probability of a detour at each search (open a wrong result first) and each find (try a pattern
        that is not on the page first).
      seed: seed of the detour choices.
      topn: results requested per search.
      max_steps: tool calls after which the oracle gives up.
      failure: "" (default) to solve; "wrong_page" or "give_up" to fail on purpose (module docstring). The choices
        within a failure (which wrong result, where to give up) are drawn from the episode's seed.
    """

    detour_prob: float = 0.0
    seed: int = 0
    topn: int = 10
    max_steps: int = 80
    failure: str = ""

    def __post_init__(self):
        if not 0.0 <= self.detour_prob <= 1.0:
            raise ValueError(f"OracleConfig.detour_prob must be in [0, 1], got {self.detour_prob!r}.")
        if self.failure not in FAILURES:
            raise ValueError(f"OracleConfig.failure must be one of {FAILURES}, got {self.failure!r}.")
        if self.topn < 1 or self.max_steps < 1:
            raise ValueError("OracleConfig.topn and max_steps must be >= 1.")


@dataclass
class OracleResult:
    """One oracle episode.

    Attributes:
      task: the task solved.
      messages: the chat trajectory (OpenAI format).
      answer: the answer given ("unknown" when a clue could not be confirmed).
      solved: the answer is correct (``answers.answer_reward`` exact match against the gold answer and aliases).
      confirmed: per clue, whether its value was seen on its page.
      clue_progress: after each tool call, the fraction of clues confirmed so far (an oracle progress measure).
    """

    task: Task
    messages: list[dict[str, Any]]
    answer: str
    solved: bool
    confirmed: list[bool]
    clue_progress: list[float] = field(default_factory=list)

    @property
    def num_tool_calls(self) -> int:
        return len(self.clue_progress)

    def to_record(self, *, record_id: str | None = None, group: str | None = None) -> dict[str, Any]:
        """JSON-able record: the trajectory plus gold data (SFT / test format).

        `reward` is the environment's answer reward (`answers.answer_reward`) of the final message, the field
        `trace-jax credit` reads by default; `clues` is the gold clue chain (ABC's rule-based scorer reads it).
        `record_id` and `group` (the prompt group of `solve_group` runs) are written as `id` and `group` when given.
        """
        final_text = next((m.get("content") or "" for m in reversed(self.messages) if m["role"] == "assistant"), "")
        ids = {"id": record_id} if record_id is not None else {}
        if group is not None:
            ids["group"] = group
        return {**ids, "task_id": self.task.task_id, "question": self.task.question, "messages": self.messages,
                "tools": tool_schemas(), "answer": self.task.answer, "aliases": list(self.task.aliases),
                "predicted_answer": self.answer, "solved": self.solved,
                "reward": answer_reward(final_text, self.task.gold_answers).reward, "qtype": self.task.qtype,
                "hops": self.task.hops, "clues": [c.to_dict() for c in self.task.clues],
                "clue_progress": self.clue_progress}


_LINE_PREFIX = re.compile(r"^L\d+: ", re.MULTILINE)


def visible_text(observation_text: str) -> str:
    """Observation text with line-number prefixes removed and whitespace collapsed (wrapped lines re-joined)."""
    return " ".join(_LINE_PREFIX.sub("", observation_text).split())


def initial_messages(task: Task, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """The prompt of an episode: system message and the question, as the oracle's trajectories start."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": task.question}]


class _Episode:
    def __init__(self, browser: Browser, task: Task, rng: random.Random, config: OracleConfig):
        self.browser, self.task, self.rng, self.config = browser, task, rng, config
        self.messages: list[dict[str, Any]] = initial_messages(task)
        self.seen_by_docid: dict[str, str] = {}  # docid -> visible text seen on that page
        self.known = task.question  # text the agent has seen (names it may search for)
        self.confirmed = [False] * len(task.clues)
        self.progress: list[float] = []
        self.steps = 0
        self.notes: list[str] = []  # facts confirmed since the last assistant message, said in the next one

    # -- tool calls with chat records ------------------------------------------------------------------------------

    def call(self, say: str, name: str, arguments: dict[str, Any]) -> Observation:
        self.steps += 1
        call_id = f"call_{self.steps}"
        arguments_json = json.dumps(arguments, ensure_ascii=False)
        observation = self.browser.step(name, arguments_json)
        say = NOTE_SEPARATOR.join(self.notes + [say])
        self.notes = []
        self.messages.append({"role": "assistant", "content": say, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_json}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": observation.text})
        page = observation.page
        if observation.ok and page is not None and page.docid is not None and (page.kind == "document" or page.links):
            # Only the page's shown lines count: the header (title, url) and an echoed find pattern are not facts.
            shown = " ".join(page.lines[observation.first_line: observation.last_line + 1])
            self.seen_by_docid[page.docid] = self.seen_by_docid.get(page.docid, "") + " " + " ".join(shown.split())
        self.known += " " + observation.text
        self._update_confirmed()
        self.progress.append(sum(self.confirmed) / max(1, len(self.confirmed)))
        return observation

    def _update_confirmed(self) -> None:
        newly: list[Clue] = []
        for index, clue in enumerate(self.task.clues):
            if not self.confirmed[index] and clue.value in self.seen_by_docid.get(clue.docid, ""):
                self.confirmed[index] = True
                newly.append(clue)
        # One sentence per fact; members of one list page in one sentence.
        lists: dict[tuple[str, str], list[str]] = {}
        for clue in newly:
            if clue.relation.startswith("list:"):
                lists.setdefault((clue.entity, clue.relation), []).append(clue.value)
        said_lists = set()
        for clue in newly:
            key = (clue.entity, clue.relation)
            if key in lists:
                if key in said_lists:
                    continue
                said_lists.add(key)
                clue = Clue(clue.docid, clue.entity, clue.relation, join_names(lists[key]))
            note = fact_sentence(clue)
            if note:
                self.notes.append(note)

    def out_of_steps(self) -> bool:
        return self.steps >= self.config.max_steps

    # -- reaching a page -------------------------------------------------------------------------------------------

    def queries_for(self, clue: Clue, index: int) -> list[str]:
        queries = []
        if clue.entity and clue.entity in self.known:
            queries.append(clue.entity)
        elif clue.relation in IDENTIFY_NP and index == 0:
            queries.append(IDENTIFY_QUERY[clue.relation].format(v=clue.value))
        if clue.entity:
            # Fallbacks matter under retrieval noise, which is deterministic per query string.
            queries += [clue.entity, f"{clue.entity} {clue.value}"]
            queries += [f"{clue.entity} {keyword}" for keyword in FIND_KEYWORDS.get(clue.relation, ())]
        return list(dict.fromkeys(queries))

    def reach(self, clue: Clue, index: int) -> bool:
        """Make the page ``clue.docid`` the current page; True on success."""
        current = self.browser.current_page
        if current is not None and current.kind == "document" and current.docid == clue.docid:
            return True
        for query in self.queries_for(clue, index):
            if self.out_of_steps():
                return False
            results = self.call(SAY_SEARCH.format(query=query), "search", {"query": query, "topn": self.config.topn})
            if not results.ok or results.page is None:
                continue
            search_cursor = results.cursor
            target = next((link for link in results.page.links.values() if link.docid == clue.docid), None)
            if target is None:
                continue
            others = [link for link in results.page.links.values() if link.docid != clue.docid]
            if others and self.rng.random() < self.config.detour_prob:
                wrong = others[self.rng.randrange(len(others))]
                self.call(SAY_WRONG_OPEN.format(id=wrong.id), "open", {"id": wrong.id})
                opened = self.call(SAY_BACK.format(id=target.id, title=target.title), "open",
                                   {"id": target.id, "cursor": search_cursor})
            else:
                opened = self.call(SAY_OPEN.format(id=target.id, title=target.title), "open", {"id": target.id})
            return opened.ok and opened.page is not None and opened.page.docid == clue.docid
        return False

    # -- reading a fact --------------------------------------------------------------------------------------------

    def read(self, clue: Clue, index: int) -> None:
        document_page = self.browser.current_page
        document_cursor = self.browser.cursor
        keywords = list(FIND_KEYWORDS.get(clue.relation, ()))
        if keywords and self.rng.random() < self.config.detour_prob:
            absent = [k for values in FIND_KEYWORDS.values() for k in values
                      if not any(k.lower() in line.lower() for line in document_page.lines)]
            if absent:
                keywords.insert(0, absent[self.rng.randrange(len(absent))])
        for pattern in keywords + [clue.value]:
            if self.confirmed[index] or self.out_of_steps():
                return
            self.call(SAY_FIND.format(pattern=pattern), "find", {"pattern": pattern, "cursor": document_cursor})
        # Last resort: scroll through the page view by view.
        loc = 0
        while not self.confirmed[index] and not self.out_of_steps() and loc < document_page.num_lines:
            shown = self.call(SAY_SCROLL, "open", {"cursor": document_cursor, "loc": loc})
            if not shown.ok or shown.last_line is None:
                return
            loc = shown.last_line + 1

    def run(self, until: int | None = None) -> tuple[str, bool]:
        """Confirm the clues in order (the first `until` of them; all by default); `(answer, complete)`."""
        for index, clue in enumerate(self.task.clues[:until]):
            if self.confirmed[index]:
                continue
            if self.out_of_steps() or not self.reach(clue, index):
                return UNKNOWN_ANSWER, False
            if not self.confirmed[index]:
                self.read(clue, index)
            if not self.confirmed[index]:
                return UNKNOWN_ANSWER, False
        return self.task.answer, True

    def fail(self, failure: str) -> str:
        """The final message of a failure on purpose (module docstring); its answer is never the gold one."""
        clues = self.task.clues
        stop = len(clues) - 1 if failure == "wrong_page" else self.rng.randrange(len(clues))
        _, complete = self.run(until=stop)
        if failure == "wrong_page" and complete and not self.out_of_steps():
            title = self.open_wrong(clues[stop], stop)
            message = SAY_ANSWER.format(answer=title) if title else ""
            if title and not answer_reward(message, self.task.gold_answers).exact:
                return message
        return SAY_GIVE_UP

    def open_wrong(self, clue: Clue, index: int) -> str | None:
        """Search for `clue`'s page and open a result that is not it; that result's title, or None."""
        for query in self.queries_for(clue, index):
            if self.out_of_steps():
                return None
            results = self.call(SAY_SEARCH.format(query=query), "search", {"query": query, "topn": self.config.topn})
            if not results.ok or results.page is None:
                continue
            others = [link for link in results.page.links.values() if link.docid != clue.docid and link.title]
            if others:
                wrong = others[self.rng.randrange(len(others))]
                opened = self.call(SAY_WRONG_OPEN.format(id=wrong.id), "open", {"id": wrong.id})
                return wrong.title if opened.ok else None
        return None


def fact_sentence(clue: Clue) -> str:
    """The fact a clue states, as a sentence in the world's first template ("Kalo lies on the Venmir River.");
    empty for clues without a known relation (external tasks)."""
    if clue.relation.startswith("list:"):
        templates = LIST_TEMPLATES.get(clue.relation[len("list:"):])
    else:
        templates = FACT_TEMPLATES.get(clue.relation)
    if not templates or not clue.entity or not clue.value:
        return ""
    return templates[0].format(s=clue.entity, o=clue.value)


def final_message(notes: Sequence[str], answer: str | None) -> str:
    """The oracle's final assistant message: its notes (the facts confirmed by the last tool call), then
    `SAY_ANSWER` with `answer`, or `SAY_GIVE_UP` when `answer` is None."""
    return NOTE_SEPARATOR.join([*notes, SAY_GIVE_UP if answer is None else SAY_ANSWER.format(answer=answer)])


def answer_template(*, after_notes: bool = True) -> str:
    """The text the oracle's final message puts right before the answer, with `{answer}` in the answer's place: the
    opening a policy warm-started on its demonstrations writes before the answer (`trace_jax.scoring.continuation`
    scores the gold answer after it).

    `after_notes` (default): the opening as it follows the notes, `NOTE_SEPARATOR` first (" The answer is {answer}").
    Every procedural episode has notes there: the last tool call confirms the last clue, whose fact sentence the
    final message says first ("Kalo lies on the Venmir River. The answer is Venmir River."). Without notes (clues
    without a fact sentence, e.g. external tasks' evidence documents) the message starts with "The answer is".
    """
    opening = SAY_ANSWER.partition("{answer}")[0]
    return (NOTE_SEPARATOR if after_notes else "") + opening + "{answer}"


def chat_answer_template() -> str:
    """The harness's own answer opening, `ANSWER_TAGS` up to the answer ("<answer>{answer}"): what the system prompt
    asks any model for, and what a chat model that was not taught another format writes (after its think block)."""
    return ANSWER_TAGS.partition("{answer}")[0] + "{answer}"


def solve(browser: Browser, task: Task, config: OracleConfig = OracleConfig()) -> OracleResult:
    """Solve ``task`` with ``browser`` (reset first) and return the trajectory and outcome (deterministic)."""
    browser.reset()
    digest = hashlib.sha256(f"{config.seed}:{task.task_id}".encode("utf-8")).digest()
    episode = _Episode(browser, task, random.Random(int.from_bytes(digest[:8], "big")), config)
    if config.failure and task.clues:
        final = NOTE_SEPARATOR.join([*episode.notes, episode.fail(config.failure)])
    else:
        answer, complete = episode.run()
        final = final_message(episode.notes, answer if complete else None)
    episode.messages.append({"role": "assistant", "content": final})
    result = answer_reward(final, task.gold_answers)
    return OracleResult(task=task, messages=episode.messages, answer=result.answer or UNKNOWN_ANSWER,
                        solved=result.exact, confirmed=list(episode.confirmed), clue_progress=episode.progress)


def group_browsers(world_or_corpus: World | Corpus, group_size: int, *, retrieval_noise: float = 0.0, seed: int = 0,
                   **browser_options) -> list[Browser]:
    """`group_size` browsers over one shared index, browser `g` with retrieval-noise seed `seed + 1000 * g`."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size!r}")
    corpus = world_or_corpus if isinstance(world_or_corpus, Corpus) else Corpus.from_records(
        world_or_corpus.documents, source="world document")
    index = SearchIndex.build(corpus)
    return [make_browser(corpus, retrieval_noise=retrieval_noise, noise_seed=seed + 1000 * g, index=index,
                         **browser_options) for g in range(group_size)]


def solve_group(browsers: Sequence[Browser], task: Task, config: OracleConfig = OracleConfig()) -> list[OracleResult]:
    """Several oracle runs of one task, a prompt group for group-relative credit: run `g` uses `browsers[g]`
    (its own retrieval-noise seed, see `group_browsers`) and detour seed `config.seed + 1000 * g` (run 0 is
    `solve(browsers[0], task, config)`), so runs take different paths; with a tight `max_steps` some run out of
    steps and answer "unknown", so rewards differ within the group."""
    return [solve(browser, task, dataclasses.replace(config, seed=config.seed + 1000 * g))
            for g, browser in enumerate(browsers)]


def solve_all(browser: Browser, tasks: Iterable[Task], config: OracleConfig = OracleConfig()) -> list[OracleResult]:
    return [solve(browser, task, config) for task in tasks]


def solve_rate(results: Sequence[OracleResult]) -> float:
    return sum(r.solved for r in results) / max(1, len(results))


def message_words(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Word tokens of every content and tool-call argument string in a trajectory (for vocabulary checks)."""
    out: list[str] = []
    for message in messages:
        out += words(message.get("content") or "")
        for call in message.get("tool_calls", ()):
            out += words(call["function"]["name"]) + words(call["function"]["arguments"])
    return out
