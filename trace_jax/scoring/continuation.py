"""The answer continuation TRACE scores after every state: one builder for `trace-jax credit` and the trainer.

After a state boundary (the start of an assistant generation) the reference is teacher-forced on the text a model
of this chat format would write to answer at once: the format's `answer_prefix_text` (an empty think block for
thinking formats), the open tag, the gold answer and, by flag, the close tag. That text is tokenised *jointly*, as
the policy's own output is (`ChatFormat.assistant_content_ids`), and the scored tokens are picked by character
offsets: every token that overlaps the gold answer's characters (and the close tag's, when it is scored).

Why jointly: byte-level BPE tokenisers (Qwen2/3) merge across the tag, e.g. `<answer>Paris` becomes
`<`, `answer`, `>P`, `aris`, while `encode("<answer>") + encode("Paris")` gives `<`, `answer`, `>`, `P`, `aris`, a
sequence the model never produces. A token straddling the tag and the answer (`>P`) is scored: it is the
model's only way to emit the answer's first character.

Example (Qwen3 tokenizer, thinking="hybrid", gold "Paris", close tag not scored)::

    text    "<think>\\n\\n</think>\\n\\n<answer>Paris"
    tokens  <think> | \\n\\n | </think> | \\n\\n | < | answer | >P | aris
    mask      0        0        0         0     0     0       1     1       -> score = mean log-prob of >P, aris

This module knows the tokenizer and the chat format; it knows nothing about models or credit.
"""

from __future__ import annotations

import dataclasses

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


@dataclasses.dataclass(frozen=True)
class AnswerContinuation:
    """The token ids appended after each state boundary and which of them are scored.

    Attributes:
      ids: template + answer token ids, in order (the scorer's `answer_tokens` row).
      mask: 1 on the scored tokens (the scorer's `answer_mask` row), a contiguous run ending at the last token.
      text: the continuation as text.
      scored_span: `(start, end)` characters of `text` that are scored (the gold answer, plus the close tag when
        it is scored).
    """

    ids: tuple[int, ...]
    mask: tuple[int, ...]
    text: str
    scored_span: tuple[int, int]

    @property
    def num_template(self) -> int:
        """Tokens before the first scored one (conditioned on, not scored)."""
        return self.mask.index(1)

    @property
    def template_ids(self) -> list[int]:
        return list(self.ids[: self.num_template])

    @property
    def answer_ids(self) -> list[int]:
        """The scored tokens."""
        return list(self.ids[self.num_template:])


def build_answer_continuation(tokenizer, chat_format, gold: str, *, open_tag: str = ANSWER_OPEN,
                              close_tag: str = ANSWER_CLOSE, score_close_tag: bool = False) -> AnswerContinuation:
    """Tokenise `prefix + open_tag + gold (+ close_tag)` jointly and mark the gold answer's tokens by offsets.

    Args:
      tokenizer: the reference's Hugging Face fast tokenizer (offsets are needed).
      chat_format: a `ChatFormat` (its `answer_prefix_text` opens the continuation), or None for no prefix.
      gold: the gold answer text (not stripped; must not be blank).
      open_tag: conditioned-on text right before the answer ('' for none).
      close_tag: the answer's closing tag.
      score_close_tag: append `close_tag` and score it with the answer (the answer's end is then part of the
        score); default False: the continuation ends with the answer.

    Returns:
      `AnswerContinuation`.

    Raises:
      ValueError: a blank gold answer, a tokenizer without offsets, or a tokenisation in which no token covers
        the answer.
    """
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"gold answer {gold!r} is blank; give the answer text to score")
    prefix = (chat_format.answer_prefix_text if chat_format is not None else "") + open_tag
    text = prefix + gold + (close_tag if score_close_tag else "")
    start, end = len(prefix), len(text)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as error:
        raise ValueError("the tokenizer gives no character offsets; load a fast tokenizer (tokenizer.json)") from error
    ids = [int(i) for i in encoded["input_ids"]]
    offsets = encoded["offset_mapping"]
    mask = [int(b > a and b > start and a < end) for a, b in offsets]
    if 1 not in mask:
        raise ValueError(f"no token of {text!r} covers the answer {gold!r} (characters {start}..{end})")
    first = mask.index(1)
    mask[first:] = [1] * (len(mask) - first)  # zero-width tokens inside the answer (rare) stay scored
    return AnswerContinuation(ids=tuple(ids), mask=tuple(mask), text=text, scored_span=(start, end))

