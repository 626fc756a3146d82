"""A corpus of documents ``{docid, url, title, text}`` for the offline browser tools.

Reads JSONL or parquet files (or a list of records in memory), validates every record, and gives lookup by docid and
by url. It knows nothing about search, tools or tasks; the index and the browser take a ``Corpus`` as input.

Malformed input raises ``CorpusError`` naming the file, the line (JSONL, 1-based) or row (parquet, 0-based), the
field, what was expected and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from trace_jax.jsonl import read_jsonl

DOCUMENT_FIELDS = ("docid", "url", "title", "text")


class CorpusError(ValueError):
    """A corpus file or record is malformed (the message names where and how to fix it)."""


@dataclass(frozen=True, slots=True)
class Document:
    """One page of the offline web: ``docid`` and ``url`` are unique within a corpus."""

    docid: str
    url: str
    title: str
    text: str

    def to_record(self) -> dict[str, str]:
        return {"docid": self.docid, "url": self.url, "title": self.title, "text": self.text}


def _document_from_record(record: Any, where: str) -> Document:
    if not isinstance(record, Mapping):
        raise CorpusError(
            f"{where}: expected a JSON object with fields {list(DOCUMENT_FIELDS)}, got {type(record).__name__}."
        )
    values = {}
    for field in DOCUMENT_FIELDS:
        if field not in record or record[field] is None:
            raise CorpusError(
                f"{where}: missing field '{field}'. Every document needs string fields {list(DOCUMENT_FIELDS)}."
            )
        value = record[field]
        # Integer docids are common in external datasets; they are identifiers, so keep their decimal spelling.
        if field == "docid" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise CorpusError(
                f"{where}: field '{field}' must be a string, got {type(value).__name__} ({value!r:.60})."
            )
        if field in ("docid", "url") and not value.strip():
            raise CorpusError(f"{where}: field '{field}' is empty; docids and urls must be non-empty and unique.")
        values[field] = value
    return Document(**values)


class Corpus(Sequence[Document]):
    """An ordered, immutable collection of documents with lookup by docid and by url.

    Build with ``Corpus.from_records(records)``, ``Corpus.from_jsonl(path)``, ``Corpus.from_parquet(path)`` or
    ``Corpus.load(path)`` (by suffix). ``path`` is the source file (``None`` for an in-memory corpus); the search
    index is saved next to it.
    """

    def __init__(self, documents: Iterable[Document], *, path: str | os.PathLike | None = None,
                 _where: Sequence[str] | None = None):
        self._documents: tuple[Document, ...] = tuple(documents)
        self.path: Path | None = Path(path) if path is not None else None
        self._by_docid: dict[str, int] = {}
        self._by_url: dict[str, int] = {}
        where = _where or [f"document {i}" for i in range(len(self._documents))]
        for index, document in enumerate(self._documents):
            if not isinstance(document, Document):
                raise CorpusError(f"{where[index]}: expected a Document, got {type(document).__name__}.")
            if document.docid in self._by_docid:
                first = where[self._by_docid[document.docid]]
                raise CorpusError(f"{where[index]}: duplicate docid {document.docid!r} (first seen at {first}).")
            if document.url in self._by_url:
                first = where[self._by_url[document.url]]
                raise CorpusError(f"{where[index]}: duplicate url {document.url!r} (first seen at {first}).")
            self._by_docid[document.docid] = index
            self._by_url[document.url] = index
        self._content_hash: str | None = None

    # Construction -------------------------------------------------------------------------------------------------

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any] | Document], *, source: str = "record") -> "Corpus":
        documents, where = [], []
        for index, record in enumerate(records):
            label = f"{source} {index}"
            documents.append(record if isinstance(record, Document) else _document_from_record(record, label))
            where.append(label)
        return cls(documents, _where=where)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike) -> "Corpus":
        documents, where = [], []
        for label, record in read_jsonl(path, error=CorpusError):
            documents.append(_document_from_record(record, label))
            where.append(label)
        return cls(documents, path=Path(path), _where=where)

    @classmethod
    def from_parquet(cls, path: str | os.PathLike) -> "Corpus":
        import pyarrow.parquet as pq

        path = Path(path)
        if not path.is_file():
            raise CorpusError(f"{path}: corpus file not found.")
        try:
            table = pq.read_table(path)
        except Exception as error:  # pyarrow raises several types for a bad file
            raise CorpusError(f"{path}: not a readable parquet file ({error}).") from None
        missing = [field for field in DOCUMENT_FIELDS if field not in table.column_names]
        if missing:
            raise CorpusError(
                f"{path}: missing column(s) {missing}; found {table.column_names}. "
                f"A corpus needs columns {list(DOCUMENT_FIELDS)}."
            )
        columns = {field: table.column(field).to_pylist() for field in DOCUMENT_FIELDS}
        documents, where = [], []
        for row in range(table.num_rows):
            label = f"{path} row {row}"
            documents.append(_document_from_record({f: columns[f][row] for f in DOCUMENT_FIELDS}, label))
            where.append(label)
        return cls(documents, path=path, _where=where)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Corpus":
        """Read a JSON-lines (``.jsonl``, ``.json``, ``.ndjson``: one object per line) or ``.parquet`` corpus file."""
        suffix = Path(path).suffix.lower()
        if suffix in (".jsonl", ".json", ".ndjson"):
            return cls.from_jsonl(path)
        if suffix in (".parquet", ".pq"):
            return cls.from_parquet(path)
        raise CorpusError(f"{path}: unknown corpus format {suffix!r}; use .jsonl or .parquet.")

    def write_jsonl(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        with path.open("w", encoding="utf-8") as out:
            for document in self._documents:
                out.write(json.dumps(document.to_record(), ensure_ascii=False) + "\n")
        return path

    def write_parquet(self, path: str | os.PathLike) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = Path(path)
        table = pa.table({f: [getattr(d, f) for d in self._documents] for f in DOCUMENT_FIELDS})
        pq.write_table(table, path)
        return path

    # Lookup -------------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._documents)

    def __getitem__(self, index):  # int or slice, as for a tuple
        return self._documents[index]

    def __iter__(self) -> Iterator[Document]:
        return iter(self._documents)

    def __repr__(self) -> str:
        return f"Corpus({len(self)} documents, path={str(self.path) if self.path else None!r})"

    @property
    def docids(self) -> list[str]:
        return [d.docid for d in self._documents]

    def index_of(self, docid: str) -> int:
        """Position of ``docid`` in the corpus; ``KeyError`` if absent."""
        try:
            return self._by_docid[docid]
        except (KeyError, TypeError):
            raise KeyError(f"unknown docid {docid!r}") from None

    def get(self, docid: str) -> Document | None:
        index = self._by_docid.get(docid) if isinstance(docid, str) else None
        return None if index is None else self._documents[index]

    def by_docid(self, docid: str) -> Document:
        return self._documents[self.index_of(docid)]

    def by_url(self, url: str) -> Document | None:
        index = self._by_url.get(url) if isinstance(url, str) else None
        return None if index is None else self._documents[index]

    def __contains__(self, docid: object) -> bool:
        return isinstance(docid, str) and docid in self._by_docid

    @property
    def content_hash(self) -> str:
        """SHA-256 over every document's fields in order: the index is reused only for an identical corpus."""
        if self._content_hash is None:
            digest = hashlib.sha256()
            for document in self._documents:
                for field in DOCUMENT_FIELDS:
                    value = getattr(document, field).encode("utf-8")
                    digest.update(len(value).to_bytes(8, "little"))
                    digest.update(value)
            self._content_hash = digest.hexdigest()
        return self._content_hash
