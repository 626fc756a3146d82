"""Specification of the tiny word-level tokenizer builder and the local tokenizer loader."""

import json
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_jax.models.tokenizer import (
    CHAT_SPECIAL_TOKENS,
    TOOL_TAG_TOKENS,
    build_word_tokenizer,
    load_tokenizer,
)

WORDS = ["the", "capital", "of", "France", "is", "Paris", "search", "query", "answer", "café"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = build_word_tokenizer(WORDS, tmp_path_factory.mktemp("word_tok"), extra_special_tokens=("<|task|>",))
    return load_tokenizer(directory)


def test_builder_writes_a_hugging_face_tokenizer_directory(tmp_path):
    directory = build_word_tokenizer(["a"], tmp_path / "tok")
    assert (directory / "tokenizer.json").is_file()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"


def test_autotokenizer_loads_the_built_directory(tmp_path):
    from transformers import AutoTokenizer

    directory = build_word_tokenizer(["a"], tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")


def test_given_words_are_single_tokens_with_and_without_leading_space(tokenizer):
    ids = tokenizer.encode("the capital of France is Paris", add_special_tokens=False)
    assert len(ids) == 6
    assert len(tokenizer.encode("café", add_special_tokens=False)) == 1


def test_chat_and_tool_tags_are_single_tokens(tokenizer):
    for token in (*CHAT_SPECIAL_TOKENS, *TOOL_TAG_TOKENS, "<|task|>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token


def test_control_tokens_are_special_and_tool_tags_are_not_like_qwen3(tokenizer):
    ids = tokenizer.encode("<|im_start|>x<tool_call>y</tool_call><think>z</think><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "x<tool_call>y</tool_call><think>z</think>"


def test_digits_and_punctuation_are_in_the_vocabulary(tokenizer):
    vocab = tokenizer.get_vocab()
    for symbol in string.digits + string.punctuation:
        assert symbol in vocab


def test_unknown_words_fall_back_to_bytes_without_an_unknown_token(tokenizer):
    ids = tokenizer.encode("zyzzyva 日本", add_special_tokens=False)
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == "zyzzyva 日本"


def test_whitespace_survives_the_round_trip(tokenizer):
    text = '  {"name": "search",\n\t"arguments": {"query": "a  b"}}\n\n'
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@given(st.text(max_size=60))
def test_any_unicode_text_round_trips_exactly(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_rejects_words_with_whitespace(tmp_path):
    with pytest.raises(ValueError, match="without whitespace"):
        build_word_tokenizer(["two words"], tmp_path)


def test_load_tokenizer_names_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


def test_load_tokenizer_names_a_directory_without_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_ids_are_contiguous_so_len_is_the_embedding_size(tokenizer):
    ids = sorted(tokenizer.get_vocab().values())
    assert ids == list(range(len(tokenizer)))


def test_chat_special_tokens_have_fixed_small_ids(tokenizer):
    assert tokenizer.convert_tokens_to_ids(list(CHAT_SPECIAL_TOKENS)) == [0, 1, 2]
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
