"""Specification of the external QA importer (BrowseComp-Plus-style queries + corpus JSONL written by the test)."""

import json

import pytest

from trace_jax.data.external import (
    ExternalDataError,
    ExternalDataWarning,
    load_external,
    load_external_corpus,
    load_external_tasks,
)
from trace_jax.envs.oracle import make_browser

CORPUS = [
    {"docid": "d1", "url": "https://example.org/kalo", "title": "Kalo", "text": "Kalo is a city on the Venmir River."},
    {"docid": 2, "text": "Venmir River\nThe Venmir River is 812 kilometres long."},
    {"docid": "d3", "title": "Unrelated", "text": "Nothing to see here."},
]
QUERIES = [
    {"query_id": 7, "query": "How long is the river through Kalo?", "answer": "812 kilometres",
     "evidence_docs": [{"docid": "d1", "text": "..."}, {"docid": "2", "text": "..."}],
     "gold_docs": [{"docid": "2", "text": "..."}]},
    {"query_id": "q8", "query": "Which city lies on the Venmir River?", "answer": "Kalo", "answers": ["Kalo city"],
     "gold_docs": ["d1"]},
    {"query_id": "q9", "query": "Chain?", "answer": "812",
     "clues": [{"docid": "d1", "value": "Venmir River"}, {"docid": "2", "value": "812"}]},
]


def write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path):
    return (write_jsonl(tmp_path / "queries.jsonl", QUERIES, extra_lines=[""]),
            write_jsonl(tmp_path / "corpus.jsonl", CORPUS))


def test_reads_queries_and_corpus_into_tasks(files):
    dataset = load_external(*files, source="bcp")
    assert [t.task_id for t in dataset.tasks] == ["bcp-7", "bcp-q8", "bcp-q9"]
    first = dataset.tasks[0]
    assert (first.question, first.answer, first.qtype, first.source) == (QUERIES[0]["query"], "812 kilometres",
                                                                         "external", "bcp")
    assert len(dataset.corpus) == 3


def test_clues_are_evidence_docs_then_gold_docs_with_titles(files):
    first = load_external(*files).tasks[0]
    assert [(c.docid, c.relation, c.entity) for c in first.clues] == [("d1", "evidence_doc", "Kalo"),
                                                                      ("2", "gold_doc", "Venmir River")]


def test_given_clue_chain_and_aliases_are_kept(files):
    tasks = load_external(*files).tasks
    assert tasks[1].aliases == ("Kalo city",)
    assert [(c.docid, c.value) for c in tasks[2].clues] == [("d1", "Venmir River"), ("2", "812")]


def test_corpus_defaults_for_missing_url_and_title(files):
    corpus = load_external_corpus(files[1])
    document = corpus.by_docid("2")
    assert document.url == "doc://2" and document.title == "Venmir River"


def test_imported_corpus_works_with_the_browser(files):
    dataset = load_external(*files)
    browser = make_browser(dataset.corpus)
    assert "Venmir River" in browser.execute("search", {"query": "Venmir kilometres"})


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"query": "q", "answer": "a"}), "field 'query_id'"),
    (json.dumps({"query_id": "x", "answer": "a"}), "field 'query' missing"),
    (json.dumps({"query_id": "x", "query": "q", "answer": 3}), "field 'answer' must be a non-empty string"),
    (json.dumps({"query_id": "x", "query": "q", "answer": "a", "gold_docs": "d1"}), "field 'gold_docs' must be a list"),
    (json.dumps({"query_id": "x", "query": "q", "answer": "a", "gold_docs": [{"id": 1}]}), "gold_docs[0]"),
    (json.dumps({"query_id": "x", "query": "q", "answer": "a", "gold_docs": ["missing"]}),
     "docid 'missing' (in gold_doc) is not in the corpus"),
    (json.dumps({"query_id": 7, "query": "q", "answer": "a"}), "duplicate query_id '7'"),
    (json.dumps({"query_id": "x", "query": "q", "answer": "a", "answers": "b"}), "'answers' must be a list"),
])
def test_malformed_query_lines_are_skipped_with_file_line_and_field(tmp_path, line, message):
    queries = write_jsonl(tmp_path / "queries.jsonl", QUERIES[:2] + [QUERIES[2]], extra_lines=[line])
    corpus = write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    with pytest.warns(ExternalDataWarning, match="1 line\\(s\\) skipped"):
        dataset = load_external(queries, corpus)
    assert [t.task_id for t in dataset.tasks] == ["browsecomp_plus-7", "browsecomp_plus-q8", "browsecomp_plus-q9"]
    (skipped,) = dataset.skipped
    assert (skipped.path, skipped.line) == (str(queries), 4) and message in skipped.error
    assert str(skipped).startswith(f"{queries}:4: skipped: ")


def test_an_encrypted_release_is_refused_as_a_whole(tmp_path):
    line = json.dumps({"query_id": "x", "encrypted_query": "zzz", "canary": "c"})
    queries = write_jsonl(tmp_path / "queries.jsonl", QUERIES, extra_lines=[line])
    with pytest.raises(ExternalDataError, match="queries.jsonl:4: .*decrypt it first"):
        load_external(queries, write_jsonl(tmp_path / "corpus.jsonl", CORPUS))


@pytest.mark.parametrize("record, message", [
    ({"text": "no id"}, "field 'docid'"),
    ({"docid": "d1", "text": "again"}, "duplicate docid 'd1'"),
    ({"docid": "d9"}, "field 'text' must be a string"),
    ({"docid": "d9", "text": "t", "title": 5}, "field 'title' must be a string"),
])
def test_malformed_corpus_lines_are_skipped_with_file_line_and_field(tmp_path, record, message):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", CORPUS + [record])
    skipped = []
    loaded = load_external_corpus(corpus, skipped=skipped)
    assert sorted(d.docid for d in loaded) == ["2", "d1", "d3"]
    assert [(s.line, message in s.error) for s in skipped] == [(4, True)]


def test_a_query_naming_a_skipped_document_is_skipped_too(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", CORPUS[:1] + [{"docid": 2, "text": 5}] + CORPUS[2:])
    queries = write_jsonl(tmp_path / "queries.jsonl", QUERIES)
    with pytest.warns(ExternalDataWarning):
        dataset = load_external(queries, corpus)
    assert [t.task_id for t in dataset.tasks] == ["browsecomp_plus-q8"]
    assert [(s.path.endswith("corpus.jsonl"), s.line) for s in dataset.skipped] == [(True, 2), (False, 1),
                                                                                    (False, 3)]


def test_a_file_with_no_usable_line_is_an_error_that_shows_why(tmp_path):
    queries = write_jsonl(tmp_path / "queries.jsonl", [{"query": "q"}, [1]])
    with pytest.raises(ExternalDataError, match="no usable queries: all 2 line\\(s\\) were skipped"):
        load_external_tasks(queries, skipped=[])


def test_missing_and_empty_files_are_reported(tmp_path):
    with pytest.raises(ExternalDataError, match="file not found"):
        load_external_corpus(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ExternalDataError, match="no queries found"):
        load_external_tasks(tmp_path / "empty.jsonl")


def test_tasks_without_a_corpus_keep_docids_unchecked(tmp_path):
    queries = write_jsonl(tmp_path / "q.jsonl", [{"query_id": 1, "query": "q", "answer": "a", "gold_docs": ["zz"]}])
    assert load_external_tasks(queries)[0].clues[0].docid == "zz"


def test_corpus_can_come_from_documents_embedded_in_the_queries(tmp_path):
    queries = write_jsonl(tmp_path / "q.jsonl", [
        {"query_id": 1, "query": "q", "answer": "a",
         "evidence_docs": [{"docid": "e1", "text": "First page\nbody", "url": "https://x.org/1"}],
         "gold_docs": [{"docid": "g1", "text": "Gold page"}], "negative_docs": [{"docid": "n1", "text": "noise"}]},
        {"query_id": 2, "query": "q2", "answer": "b", "gold_docs": [{"docid": "g1", "text": "Gold page"}]},
    ])
    dataset = load_external(queries)
    assert sorted(d.docid for d in dataset.corpus) == ["e1", "g1", "n1"]
    assert dataset.corpus.by_docid("e1").title == "First page"
    assert [c.entity for c in dataset.tasks[0].clues] == ["First page", "Gold page"]


def test_queries_without_embedded_documents_need_a_corpus_file(tmp_path):
    queries = write_jsonl(tmp_path / "q.jsonl", [{"query_id": 1, "query": "q", "answer": "a", "gold_docs": ["d"]}])
    with pytest.raises(ExternalDataError, match="pass a corpus JSONL"):
        load_external(queries)
