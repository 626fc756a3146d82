"""Import external QA sets that come with their own corpus (BrowseComp-Plus style) as ``Task`` objects + ``Corpus``.

Inputs (both JSONL, one object per line; blank lines are skipped):

* queries: ``query_id`` (string or int), ``query`` (string), ``answer`` (string), and the supporting documents as
  ``evidence_docs`` and/or ``gold_docs`` (lists of docids, or of objects with a ``docid``, as in BrowseComp-Plus's
  decrypted release). Optional: ``answers``/``aliases`` (list of other accepted answers) and ``clues`` (a recovered
  clue chain: list of objects with ``docid`` and optional ``entity``, ``relation``, ``value``).
* corpus: ``docid`` (string or int) and ``text``; ``url`` and ``title`` are optional (defaults:
  ``doc://{docid}`` and the first line of the text, cut to 80 characters).

Clues: the given chain if any; else one clue per evidence document (``relation="evidence_doc"``) followed by the
gold documents (``relation="gold_doc"``, the pages that contain the answer), in file order, without repeats.

Bad lines are skipped, never fatal: a line that is not UTF-8 or not JSON, nests too deeply, is not an object, has a
field of the wrong type, repeats an id, or names a document the corpus lacks is left out, and the rest of the file
is imported. Each skipped line is a ``SkippedLine`` (file, 1-based line, what is wrong and the fix): appended to the
``skipped`` list a caller passes, else announced in one ``ExternalDataWarning`` per file; ``load_external`` returns
them in ``ExternalDataset.skipped``. A problem with a whole file raises ``ExternalDataError``: the file is missing,
no line is usable, or it is an encrypted release. Nothing is downloaded here: the user supplies decrypted files.

This module knows about tasks and corpora; not about tools, models or training.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

from trace_jax.envs.corpus import Corpus, Document
from trace_jax.envs.tasks import Clue, Task
from trace_jax.jsonl import SkippedLine, read_jsonl_skipping

QUERY_FIELDS = ("query_id", "query", "answer")
DOC_LIST_FIELDS = ("evidence_docs", "gold_docs")


class ExternalDataError(ValueError):
    """An external query or corpus file is malformed (the message names file, line and field, and the fix)."""


class ExternalDataWarning(UserWarning):
    """Lines of an external file were skipped (the message lists them with what is wrong and the fix)."""


class ExternalDataset(NamedTuple):
    """Tasks, the corpus they are asked over, and the lines of either file that were skipped."""

    tasks: list[Task]
    corpus: Corpus
    skipped: tuple[SkippedLine, ...] = ()


def _records(path: Path, skipped: list[SkippedLine]) -> Iterator[tuple[int, str, Mapping[str, Any]]]:
    """`(line, where, record)` of each readable object line; every other line is appended to `skipped`."""
    for line, record in read_jsonl_skipping(path, skipped, error=ExternalDataError):
        if not isinstance(record, Mapping):
            skipped.append(SkippedLine(str(path), line, f"expected a JSON object, got {type(record).__name__}."))
            continue
        yield line, f"{path}:{line}", record


def _skip(skipped: list[SkippedLine], path: Path, line: int, where: str, error: ExternalDataError) -> None:
    skipped.append(SkippedLine(str(path), line, str(error).removeprefix(f"{where}: ")))


def _warn(skipped: list[SkippedLine], stacklevel: int) -> None:
    """One `ExternalDataWarning` listing the skipped lines (the first 20)."""
    shown = "\n".join(f"  {s}" for s in skipped[:20])
    more = f"\n  ... and {len(skipped) - 20} more" if len(skipped) > 20 else ""
    warnings.warn(f"{len(skipped)} line(s) skipped; the rest was imported:\n{shown}{more}", ExternalDataWarning,
                  stacklevel=stacklevel + 1)


def _announce(skipped: list[SkippedLine], mine: list[SkippedLine] | None) -> None:
    """Hand the skipped lines to the caller's list, or warn about them when it passed none."""
    if mine is not None:
        mine.extend(skipped)
    elif skipped:
        _warn(skipped, stacklevel=3)


def _nothing_usable(path: Path, what: str, skipped: list[SkippedLine]) -> ExternalDataError:
    if not skipped:
        return ExternalDataError(f"{path}: no {what} found; expected one JSON object per line.")
    first = "\n".join(f"  {s}" for s in skipped[:5])
    return ExternalDataError(f"{path}: no usable {what}: all {len(skipped)} line(s) were skipped, for example:\n"
                             f"{first}")


def _identifier(record: Mapping[str, Any], field: str, where: str) -> str:
    value = record.get(field)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or (isinstance(value, str) and not value.strip()):
        raise ExternalDataError(f"{where}: field '{field}' must be a non-empty string or integer, got {value!r:.60}.")
    return str(value)


def _string(record: Mapping[str, Any], field: str, where: str, *, hint: str = "") -> str:
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        missing = "missing" if field not in record else f"must be a non-empty string, got {value!r:.60}"
        raise ExternalDataError(f"{where}: field '{field}' {missing}.{hint}")
    return value


def load_external_corpus(path: str | os.PathLike, *, skipped: list[SkippedLine] | None = None) -> Corpus:
    """Read a corpus JSONL (``docid``, ``text``, optional ``url``/``title``) into a ``Corpus``.

    Bad lines are skipped and appended to ``skipped`` (or announced in an ``ExternalDataWarning``)."""
    path = Path(path)
    bad: list[SkippedLine] = []
    documents, seen = [], {}
    for line, where, record in _records(path, bad):
        try:
            documents.append(_document(record, where, seen))
        except ExternalDataError as error:
            _skip(bad, path, line, where, error)
    _announce(bad, skipped)
    if not documents:
        raise _nothing_usable(path, "documents", bad)
    try:
        return Corpus(documents, path=path)
    except ValueError as error:  # e.g. duplicate urls
        raise ExternalDataError(f"{path}: {error}") from None


def _document(record: Mapping[str, Any], where: str, seen: dict[str, str]) -> Document:
    docid = _identifier(record, "docid", where)
    if docid in seen:
        raise ExternalDataError(f"{where}: duplicate docid {docid!r} (first at {seen[docid]}); docids must be "
                                "unique.")
    text = record.get("text")
    if not isinstance(text, str):
        raise ExternalDataError(f"{where}: field 'text' must be a string, got {text!r:.60}.")
    title = record.get("title")
    if title is None or (isinstance(title, str) and not title.strip()):
        title = (text.strip().split("\n", 1)[0][:80] if text.strip() else docid)
    elif not isinstance(title, str):
        raise ExternalDataError(f"{where}: field 'title' must be a string if given, got {title!r:.60}.")
    url = record.get("url")
    if url is None or (isinstance(url, str) and not url.strip()):
        url = f"doc://{docid}"
    elif not isinstance(url, str):
        raise ExternalDataError(f"{where}: field 'url' must be a string if given, got {url!r:.60}.")
    seen[docid] = where
    return Document(docid=docid, url=url, title=title, text=text)


def _docids(record: Mapping[str, Any], field: str, where: str) -> list[str]:
    value = record.get(field)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ExternalDataError(f"{where}: field '{field}' must be a list of docids or of objects with a 'docid', "
                                f"got {type(value).__name__}.")
    out = []
    for index, item in enumerate(value):
        if isinstance(item, Mapping):
            out.append(_identifier(item, "docid", f"{where}: {field}[{index}]"))
        elif isinstance(item, (str, int)) and not isinstance(item, bool):
            out.append(str(item))
        else:
            raise ExternalDataError(f"{where}: {field}[{index}] must be a docid or an object with a 'docid', got "
                                    f"{item!r:.60}.")
    return out


def load_external_tasks(path: str | os.PathLike, *, corpus: Corpus | None = None,
                        source: str = "browsecomp_plus", skipped: list[SkippedLine] | None = None) -> list[Task]:
    """Read a BrowseComp-Plus-style queries JSONL into ``Task`` objects (``qtype="external"``).

    With ``corpus``, every referenced docid must exist in it (a query naming a missing one is skipped), and clue
    entities are the documents' titles. Bad lines are skipped and appended to ``skipped`` (or announced in an
    ``ExternalDataWarning``).
    """
    path = Path(path)
    bad: list[SkippedLine] = []
    tasks, seen = [], {}
    for line, where, record in _records(path, bad):
        if "query" not in record and any(k in record for k in ("encrypted_query", "canary")):
            raise ExternalDataError(f"{where}: this looks like an encrypted release; decrypt it first (the "
                                    "dataset's own decryption script) so each line has plain 'query' and 'answer'.")
        try:
            tasks.append(_task(record, where, seen, corpus, source))
        except ExternalDataError as error:
            _skip(bad, path, line, where, error)
    _announce(bad, skipped)
    if not tasks:
        if not bad:
            raise ExternalDataError(f"{path}: no queries found; expected one JSON object per line with fields "
                                    f"{list(QUERY_FIELDS)}.")
        raise _nothing_usable(path, "queries", bad)
    return tasks


def _task(record: Mapping[str, Any], where: str, seen: dict[str, str], corpus: Corpus | None, source: str) -> Task:
    query_id = _identifier(record, "query_id", where)
    if query_id in seen:
        raise ExternalDataError(f"{where}: duplicate query_id {query_id!r} (first at {seen[query_id]}); query ids "
                                "must be unique.")
    question = _string(record, "query", where)
    answer = _string(record, "answer", where)
    aliases = []
    for field in ("answers", "aliases"):
        extra = record.get(field, [])
        if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
            raise ExternalDataError(f"{where}: field '{field}' must be a list of strings if given.")
        aliases += [a for a in extra if a != answer and a not in aliases]
    if "clues" in record:
        clues = _clue_chain(record["clues"], where)
    else:
        evidence = _docids(record, "evidence_docs", where)
        gold = _docids(record, "gold_docs", where)
        gold_set = set(gold)
        clues = [Clue(docid=d, entity="", relation="evidence_doc", value="") for d in dict.fromkeys(evidence)
                 if d not in gold_set]
        clues += [Clue(docid=d, entity="", relation="gold_doc", value="") for d in dict.fromkeys(gold)]
    if corpus is not None:
        resolved = []
        for clue in clues:
            document = corpus.get(clue.docid)
            if document is None:
                raise ExternalDataError(f"{where}: docid {clue.docid!r} (in {clue.relation or 'clues'}) is not in "
                                        f"the corpus {corpus.path or ''}; check that both files come from the same "
                                        "release.")
            resolved.append(Clue(docid=clue.docid, entity=clue.entity or document.title, relation=clue.relation,
                                 value=clue.value, kind=clue.kind))
        clues = resolved
    seen[query_id] = where
    return Task(task_id=f"{source}-{query_id}", question=question, answer=answer, aliases=tuple(aliases),
                qtype="external", hops=0, clues=tuple(clues), program={}, source=source, world={})


def _clue_chain(value: Any, where: str) -> list[Clue]:
    if not isinstance(value, list):
        raise ExternalDataError(f"{where}: field 'clues' must be a list of objects with a 'docid'.")
    clues = []
    for index, item in enumerate(value):
        label = f"{where}: clues[{index}]"
        if not isinstance(item, Mapping):
            raise ExternalDataError(f"{label} must be an object with a 'docid', got {item!r:.60}.")
        kind = str(item.get("kind", "support"))
        if kind not in ("support", "exclude"):
            raise ExternalDataError(f"{label}: 'kind' must be 'support' or 'exclude', got {kind!r}.")
        clues.append(Clue(docid=_identifier(item, "docid", label), entity=str(item.get("entity", "")),
                          relation=str(item.get("relation", "clue")), value=str(item.get("value", "")), kind=kind))
    return clues


def corpus_from_queries(path: str | os.PathLike, *, skipped: list[SkippedLine] | None = None) -> Corpus:
    """A corpus from the documents embedded in a queries JSONL (objects with ``docid`` and ``text`` in
    ``evidence_docs``, ``gold_docs`` or ``negative_docs``, as BrowseComp-Plus ships them), first occurrence kept.

    A line with a malformed embedded document contributes none of its documents and is skipped (appended to
    ``skipped``, or announced in an ``ExternalDataWarning``)."""
    path = Path(path)
    bad: list[SkippedLine] = []
    documents: dict[str, Document] = {}
    for line, where, record in _records(path, bad):
        try:
            documents.update((d.docid, d) for d in _embedded(record, where) if d.docid not in documents)
        except ExternalDataError as error:
            _skip(bad, path, line, where, error)
    _announce(bad, skipped)
    if not documents:
        raise ExternalDataError(f"{path}: no embedded documents (objects with 'docid' and 'text' in "
                                f"{list(DOC_LIST_FIELDS) + ['negative_docs']}); pass a corpus JSONL instead.")
    try:
        return Corpus(documents.values())
    except ValueError as error:  # e.g. two documents with one url
        raise ExternalDataError(f"{path}: {error}") from None


def _embedded(record: Mapping[str, Any], where: str) -> list[Document]:
    """The documents embedded in one query record, first occurrence of each docid kept."""
    found: dict[str, Document] = {}
    for field in DOC_LIST_FIELDS + ("negative_docs",):
        items = record.get(field)
        if not isinstance(items, list):
            continue
        for index, item in enumerate(items):
            if not isinstance(item, Mapping) or "text" not in item:
                continue
            label = f"{where}: {field}[{index}]"
            docid = _identifier(item, "docid", label)
            text = item["text"]
            if not isinstance(text, str):
                raise ExternalDataError(f"{label}: field 'text' must be a string, got {text!r:.60}.")
            if docid in found:
                continue
            title = item.get("title") if isinstance(item.get("title"), str) and item.get("title").strip() else (
                text.strip().split("\n", 1)[0][:80] or docid)
            url = item.get("url") if isinstance(item.get("url"), str) and item.get("url").strip() else (
                f"doc://{docid}")
            found[docid] = Document(docid=docid, url=url, title=title, text=text)
    return list(found.values())


def load_external(queries_path: str | os.PathLike, corpus_path: str | os.PathLike | None = None, *,
                  source: str = "browsecomp_plus") -> ExternalDataset:
    """Read a queries JSONL and its corpus JSONL; every referenced docid is checked against the corpus.

    Without ``corpus_path`` the corpus is made of the documents embedded in the queries file
    (``corpus_from_queries``). Skipped lines of both files are in ``ExternalDataset.skipped`` (a line of the
    queries file reported once, with its first problem) and announced in one ``ExternalDataWarning``.
    """
    skipped: list[SkippedLine] = []
    corpus = (load_external_corpus(corpus_path, skipped=skipped) if corpus_path is not None
              else corpus_from_queries(queries_path, skipped=skipped))
    tasks = load_external_tasks(queries_path, corpus=corpus, source=source, skipped=skipped)
    unique = list({(s.path, s.line): s for s in reversed(skipped)}.values())[::-1]
    unique.sort(key=lambda s: (s.path != str(corpus_path), s.line))
    if unique:
        _warn(unique, stacklevel=2)
    return ExternalDataset(tasks=tasks, corpus=corpus, skipped=tuple(unique))
