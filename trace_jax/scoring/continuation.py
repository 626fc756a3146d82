"""The answer continuation TRACE scores after every state: one builder for `trace-jax credit` and the trainer.

After a state boundary (the start of an assistant generation) the reference is teacher-forced on an answer
template with the gold answer in its place: the format's `answer_prefix_text` (an empty think block for thinking
formats), the template's text up to `{answer}` (conditioned on, not scored), the gold answer and, by flag, the close
tag. Which template is a choice: `ANSWER_TAG_TEMPLATE` (`<answer>{answer}`, the answer tag alone) or the text the
policy itself writes before its answer (its builder lives with the harness that taught the policy to write it,
`trace_jax.rl.warmstart.policy_answer_template`; this module is told the template, never where it came from).
The text is tokenised *jointly*, as the policy's own output is (`ChatFormat.assistant_content_ids`), and the
scored tokens are picked by character offsets: every token that overlaps the gold answer's characters (and the
close tag's, when it is scored).

Why jointly: byte-level BPE tokenisers (Qwen2/3) merge across the tag, e.g. `<answer>Paris` becomes
`<`, `answer`, `>P`, `aris`, while `encode("<answer>") + encode("Paris")` gives `<`, `answer`, `>`, `P`, `aris`, a
sequence the model never produces. A token straddling the template and the answer (`>P`) is scored: it is the
model's only way to emit the answer's first character.

Example (Qwen3 tokenizer, thinking="hybrid", gold "Paris", template "<answer>{answer}", close tag not scored)::

    text    "<think>\\n\\n</think>\\n\\n<answer>Paris"
    tokens  <think> | \\n\\n | </think> | \\n\\n | < | answer | >P | aris
    mask      0        0        0         0     0     0       1     1       -> score = mean log-prob of >P, aris

This module knows the tokenizer and the chat format; it knows nothing about models, credit, environments or how
a policy was trained.
"""

from __future__ import annotations

import dataclasses

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
ANSWER_PLACEHOLDER = "{answer}"
# The answer tag alone: what the scorer conditioned on before templates were a choice.
ANSWER_TAG_TEMPLATE = ANSWER_OPEN + ANSWER_PLACEHOLDER


def check_answer_template(template, *, where: str = "answer template") -> str:
    """`template` if it is a usable answer template, else ValueError naming `where`, the problem and the fix.

    A template is a string holding `{answer}` exactly once, at its end: the text before it is conditioned on, the
    gold answer takes its place and is scored. No other braces (a misspelt `{answr}` would otherwise be scored as
    literal text) and no text after `{answer}` (it would be neither conditioned on nor scored; to score the close
    tag use `score_close_tag`).
    """
    example = f"e.g. {ANSWER_TAG_TEMPLATE!r} or 'The answer is {ANSWER_PLACEHOLDER}'"
    if not isinstance(template, str):
        raise ValueError(f"{where} must be a string holding {ANSWER_PLACEHOLDER} once ({example}), got {template!r}")
    count = template.count(ANSWER_PLACEHOLDER)
    if count != 1:
        raise ValueError(f"{where} {template!r} holds {ANSWER_PLACEHOLDER} {count} times; it marks the gold "
                         f"answer's place exactly once ({example})")
    opening, _, after = template.partition(ANSWER_PLACEHOLDER)
    if "{" in opening or "}" in opening:
        raise ValueError(f"{where} {template!r} has braces besides {ANSWER_PLACEHOLDER}; the only placeholder is "
                         f"{ANSWER_PLACEHOLDER} ({example})")
    if after:
        raise ValueError(f"{where} {template!r} has text after {ANSWER_PLACEHOLDER} ({after!r}); the template ends "
                         "with the answer (text after it is never scored; score the close tag with score_close_tag)")
    return template


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


def build_answer_continuation(tokenizer, chat_format, gold: str, *, template: str = ANSWER_TAG_TEMPLATE,
                              close_tag: str = ANSWER_CLOSE, score_close_tag: bool = False) -> AnswerContinuation:
    """Tokenise `answer_prefix_text + template(gold) (+ close_tag)` jointly; mark the gold answer's tokens by offsets.

    Args:
      tokenizer: the reference's Hugging Face fast tokenizer (offsets are needed).
      chat_format: a `ChatFormat` (its `answer_prefix_text` opens the continuation), or None for no prefix.
      gold: the gold answer text (not stripped; must not be blank).
      template: the answer's opening with `{answer}` at its end (`check_answer_template`): its text before
        `{answer}` is conditioned on, not scored. `ANSWER_TAG_TEMPLATE` ("<answer>{answer}") is the answer tag
        alone; `"{answer}"` conditions on nothing but the format's prefix.
      close_tag: the answer's closing tag.
      score_close_tag: append `close_tag` and score it with the answer (the answer's end is then part of the
        score); default False: the continuation ends with the answer.

    Returns:
      `AnswerContinuation`.

    Raises:
      ValueError: a malformed template, a blank gold answer, a tokenizer without offsets, or a tokenisation in
        which no token covers the answer.
    """
    opening = check_answer_template(template).partition(ANSWER_PLACEHOLDER)[0]
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"gold answer {gold!r} is blank; give the answer text to score")
    prefix = (chat_format.answer_prefix_text if chat_format is not None else "") + opening
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
