"""The answer continuation: joint tokenisation scores the tokens the model would produce, in every think format,
after any answer template."""

import random

import pytest

from trace_jax.models.chat import EMPTY_THINK_BLOCK, ChatFormat, thinking_mode_of
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.scoring.continuation import ANSWER_TAG_TEMPLATE, build_answer_continuation, check_answer_template

# Qwen2/3's pre-tokenizer split: one non-letter may lead a run of letters, so ">Paris" is one pre-token.
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@pytest.fixture(scope="module")
def bpe():
    """A tiny byte-level BPE tokenizer with Qwen's split, trained so that `>P` is merged (as `>Paris`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["<answer>Paris</answer>"] * 50 + [
        "<answer>Rome</answer>", "The answer is Paris.", "<think>\n\n</think>\n\n"] * 5
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def test_byte_level_bpe_merges_across_the_tag(bpe):
    tokens = bpe.convert_ids_to_tokens(bpe.encode("<answer>Paris", add_special_tokens=False))
    assert any(t.startswith(">P") for t in tokens)


def test_joint_continuation_is_exactly_what_the_model_would_produce(bpe):
    chat = ChatFormat(bpe, thinking="none")
    closed = build_answer_continuation(bpe, chat, "Paris", score_close_tag=True)
    assert list(closed.ids) == chat.assistant_content_ids("<answer>Paris</answer>")
    opened = build_answer_continuation(bpe, chat, "Paris")
    assert list(opened.ids) == chat.assistant_content_ids("<answer>Paris")
    scored = bpe.convert_ids_to_tokens(opened.answer_ids)
    assert scored[0].startswith(">P") and bpe.decode(opened.answer_ids).endswith("Paris")
    assert opened.mask == tuple([0] * opened.num_template + [1] * len(opened.answer_ids))


def test_separate_encoding_scores_a_sequence_the_model_never_produces(bpe):
    chat = ChatFormat(bpe, thinking="none")
    separate = bpe.encode("<answer>", add_special_tokens=False) + bpe.encode("Paris", add_special_tokens=False)
    joint = build_answer_continuation(bpe, chat, "Paris")
    assert separate != list(joint.ids)
    assert bpe.decode(separate) == bpe.decode(list(joint.ids))  # same text, different tokens
    assert separate != chat.assistant_content_ids("<answer>Paris")


def test_hybrid_thinking_format_answers_after_an_empty_think_block(bpe):
    chat = ChatFormat(bpe, thinking="hybrid")
    continuation = build_answer_continuation(bpe, chat, "Paris", score_close_tag=True)
    assert continuation.text == EMPTY_THINK_BLOCK + "<answer>Paris</answer>"
    assert list(continuation.ids) == chat.assistant_content_ids(EMPTY_THINK_BLOCK + "<answer>Paris</answer>")
    assert bpe.decode(continuation.template_ids) == EMPTY_THINK_BLOCK + "<answer"


def test_always_thinking_format_closes_the_block_the_header_opened(bpe):
    chat = ChatFormat(bpe, thinking="always")
    assert bpe.decode(chat.generation_prompt_ids()) == "<|im_start|>assistant\n<think>\n"
    continuation = build_answer_continuation(bpe, chat, "Paris")
    assert continuation.text == "\n</think>\n\n<answer>Paris"
    off = ChatFormat(bpe, enable_thinking=False)
    assert off.thinking == "off" and build_answer_continuation(bpe, off, "Paris").text == "<answer>Paris"


def test_reasoning_content_is_rendered_where_the_format_has_a_place_for_it(bpe):
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "<answer>Paris</answer>", "reasoning_content": "It is Paris."}]
    def assistant_text(thinking):
        chat = ChatFormat(bpe, thinking=thinking)
        rendered = chat.render(messages, add_generation_prompt=False)
        turn = rendered.turns[-1]
        return bpe.decode(rendered.ids[turn.content_start:turn.content_end])
    assert assistant_text("hybrid") == "<think>\nIt is Paris.\n</think>\n\n<answer>Paris</answer>"
    assert assistant_text("always") == "It is Paris.\n</think>\n\n<answer>Paris</answer>"
    assert assistant_text("none") == "<answer>Paris</answer>"


def test_thinking_mode_is_read_from_the_chat_template(bpe):
    class WithTemplate:
        def __init__(self, template):
            self.chat_template = template
    assert thinking_mode_of(WithTemplate(None)) == "none"
    assert thinking_mode_of(WithTemplate("{{ '<|im_start|>assistant\\n' }}")) == "none"
    hybrid = "{%- if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    assert thinking_mode_of(WithTemplate(hybrid)) == "hybrid"
    assert thinking_mode_of(WithTemplate("{{- '<|im_start|>assistant\\n<think>\\n' }}")) == "always"
    with pytest.raises(ValueError, match="thinking="):
        ChatFormat(bpe, thinking="maybe")


def test_word_tokenizer_scores_only_the_gold_tokens(tmp_path):
    tokenizer = load_tokenizer(build_word_tokenizer(["Paris", "New", "York"], tmp_path))
    continuation = build_answer_continuation(tokenizer, ChatFormat(tokenizer), "New York")
    assert tokenizer.decode(continuation.template_ids) == "<answer>"
    assert tokenizer.decode(continuation.answer_ids) == "New York"


def test_blank_gold_is_rejected(bpe):
    with pytest.raises(ValueError, match="blank"):
        build_answer_continuation(bpe, None, "  ")


def test_the_default_template_is_the_answer_tag(bpe):
    chat = ChatFormat(bpe, thinking="hybrid")
    assert ANSWER_TAG_TEMPLATE == "<answer>{answer}"
    assert build_answer_continuation(bpe, chat, "Paris") == build_answer_continuation(bpe, chat, "Paris",
                                                                                      template=ANSWER_TAG_TEMPLATE)


def test_a_templates_opening_is_conditioned_on_and_only_the_gold_is_scored(bpe):
    chat = ChatFormat(bpe, thinking="none")
    continuation = build_answer_continuation(bpe, chat, "Paris", template="The answer is {answer}")
    assert continuation.text == "The answer is Paris"
    assert list(continuation.ids) == chat.assistant_content_ids("The answer is Paris")  # jointly, as generated
    assert bpe.decode(continuation.template_ids) + bpe.decode(continuation.answer_ids) == "The answer is Paris"
    assert bpe.decode(continuation.answer_ids).strip() == "Paris"
    assert continuation.scored_span == (len("The answer is "), len("The answer is Paris"))


def test_the_close_tag_is_scored_after_any_template(bpe):
    chat = ChatFormat(bpe, thinking="none")
    continuation = build_answer_continuation(bpe, chat, "Paris", template="The answer is {answer}",
                                             score_close_tag=True)
    assert continuation.text == "The answer is Paris</answer>"
    assert bpe.decode(continuation.answer_ids).endswith("Paris</answer>")


def test_a_bare_placeholder_conditions_on_the_formats_answer_prefix_alone(bpe):
    continuation = build_answer_continuation(bpe, ChatFormat(bpe, thinking="hybrid"), "Paris", template="{answer}")
    assert continuation.text == EMPTY_THINK_BLOCK + "Paris"
    assert bpe.decode(continuation.template_ids) == EMPTY_THINK_BLOCK


@pytest.mark.parametrize("template, message", [
    ("<answer>", "0 times"), ("{answer} or {answer}", "2 times"), ("The answer is {answer}.", "text after"),
    ("{answr}: {answer}", "braces"), ("{{answer}}", "braces"), (None, "must be a string")])
def test_malformed_templates_are_rejected_naming_the_fix(bpe, template, message):
    with pytest.raises(ValueError, match=message):
        check_answer_template(template)
    with pytest.raises(ValueError, match=message):
        build_answer_continuation(bpe, None, "Paris", template=template)


def test_scored_tokens_are_those_a_decoding_reference_puts_over_the_gold(tmp_path):
    """The offset mask against a naive reference on random templates and answers: token k covers the characters
    between the decoded lengths of the first k and k + 1 tokens, and is scored when that span meets the gold's."""
    words = ["Paris", "New", "York", "answer", "is", "The", "river", "Kalo"]
    tokenizer = load_tokenizer(build_word_tokenizer(words, tmp_path))
    rng = random.Random(0)
    pieces = words + ["<answer>", ":", ".", " ", "\n", "-", "zq", "42"]
    for _ in range(60):
        opening = "".join(rng.choice(pieces) + rng.choice(["", " "]) for _ in range(rng.randrange(0, 5)))
        gold = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 4))).strip() or "Paris"
        continuation = build_answer_continuation(tokenizer, None, gold, template=opening + "{answer}")
        ids = list(continuation.ids)
        start = len(opening)
        ends = [len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
        expected = [int(ends[k + 1] > start) for k in range(len(ids))]
        assert tokenizer.decode(ids) == opening + gold
        assert list(continuation.mask) == expected, (opening, gold)
