"""Corpus loading (JSONL, parquet, in memory), validation errors that name file/line/field, and lookup."""

import json

import pytest

from trace_jax.envs.corpus import Corpus, CorpusError, Document

RECORDS = [
    {"docid": "a", "url": "https://x.local/a", "title": "Alpha", "text": "First document."},
    {"docid": "b", "url": "https://x.local/b", "title": "Beta", "text": "Second document.\nTwo lines."},
]


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_from_records_keeps_order_and_fields():
    corpus = Corpus.from_records(RECORDS)
    assert len(corpus) == 2 and corpus.docids == ["a", "b"]
    assert corpus[1] == Document(docid="b", url="https://x.local/b", title="Beta", text="Second document.\nTwo lines.")


def test_lookup_by_docid_and_url():
    corpus = Corpus.from_records(RECORDS)
    assert corpus.by_docid("b").title == "Beta" and corpus.by_url("https://x.local/a").docid == "a"
    assert corpus.get("zz") is None and corpus.by_url("https://x.local/zz") is None
    assert "a" in corpus and "zz" not in corpus and corpus.index_of("b") == 1
    with pytest.raises(KeyError, match="unknown docid 'zz'"):
        corpus.by_docid("zz")


def test_jsonl_round_trip_and_blank_lines_skipped(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [RECORDS[0], "", RECORDS[1]])
    corpus = Corpus.load(path)
    assert list(corpus) == list(Corpus.from_records(RECORDS)) and corpus.path == path


def test_parquet_round_trip(tmp_path):
    path = Corpus.from_records(RECORDS).write_parquet(tmp_path / "c.parquet")
    corpus = Corpus.load(path)
    assert list(corpus) == list(Corpus.from_records(RECORDS)) and corpus.path == path


def test_write_jsonl_reads_back(tmp_path):
    path = Corpus.from_records(RECORDS).write_jsonl(tmp_path / "c.jsonl")
    assert list(Corpus.from_jsonl(path)) == list(Corpus.from_records(RECORDS))


def test_integer_docids_become_strings():
    corpus = Corpus.from_records([{**RECORDS[0], "docid": 17}])
    assert corpus.docids == ["17"]


def test_content_hash_depends_on_content_only():
    same = Corpus.from_records(RECORDS).content_hash == Corpus.from_records(list(RECORDS)).content_hash
    changed = Corpus.from_records([RECORDS[0], {**RECORDS[1], "text": "Other."}]).content_hash
    assert same and changed != Corpus.from_records(RECORDS).content_hash


@pytest.mark.parametrize("bad,message", [
    ({"url": "u", "title": "t", "text": "x"}, "line 2: missing field 'docid'"),
    ({"docid": "c", "url": "u", "title": "t"}, "line 2: missing field 'text'"),
    ({"docid": "c", "url": "u", "title": 5, "text": "x"}, "line 2: field 'title' must be a string, got int"),
    ({"docid": "c", "url": " ", "title": "t", "text": "x"}, "line 2: field 'url' is empty"),
    ([1, 2], "line 2: expected a JSON object"),
])
def test_malformed_jsonl_record_names_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], bad])
    with pytest.raises(CorpusError) as error:
        Corpus.from_jsonl(path)
    assert str(error.value).startswith(str(path)) and message.replace("line ", "") in str(error.value)


def test_invalid_json_names_line_and_column(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], '{"docid": "x",'])
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: invalid JSON"):
        Corpus.from_jsonl(path)


def test_duplicate_docid_names_both_places(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [RECORDS[0], {**RECORDS[1], "docid": "a"}])
    with pytest.raises(CorpusError, match=r"dup.jsonl:2: duplicate docid 'a' \(first seen at .*dup.jsonl:1\)"):
        Corpus.from_jsonl(path)


def test_duplicate_url_is_an_error():
    with pytest.raises(CorpusError, match="record 1: duplicate url 'https://x.local/a'"):
        Corpus.from_records([RECORDS[0], {**RECORDS[1], "url": "https://x.local/a"}])


def test_parquet_missing_column_and_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"docid": ["a"], "url": ["u"], "text": ["x"]}), path)
    with pytest.raises(CorpusError, match=r"missing column\(s\) \['title'\]"):
        Corpus.from_parquet(path)
    pq.write_table(pa.table({"docid": ["a", "b"], "url": ["u", "v"], "title": ["t", None], "text": ["x", "y"]}), path)
    with pytest.raises(CorpusError, match=r"bad.parquet row 1: missing field 'title'"):
        Corpus.from_parquet(path)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        Corpus.from_jsonl(tmp_path / "none.jsonl")
    with pytest.raises(CorpusError, match="unknown corpus format '.csv'"):
        Corpus.load(tmp_path / "c.csv")
