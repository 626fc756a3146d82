"""The answer continuation: joint tokenisation scores the tokens the model would produce, in every think format."""

import pytest

from trace_jax.models.chat import EMPTY_THINK_BLOCK, ChatFormat, thinking_mode_of
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.scoring.continuation import build_answer_continuation

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
