"""Answer checking: extract the final answer from ``<answer>...</answer>``, normalise it, score it.

``answer_reward`` is the one reward function of the search environment (see its docstring for the formula); the
trainer's verifier calls it on the policy's final response. Everything here is pure string processing: no tools,
corpora or model code.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import NamedTuple, Sequence

_ANSWER_OPEN = re.compile(r"<\s*answer\s*>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)


def _find_answer(text: str) -> tuple[str | None, bool]:
    """(content of the last answer tag, whether that tag was closed)."""
    if not isinstance(text, str):
        return None, False
    opens = list(_ANSWER_OPEN.finditer(text))
    if not opens:
        return None, False
    last_open = opens[-1]
    close = _ANSWER_CLOSE.search(text, last_open.end())
    if close is not None:
        content, closed = text[last_open.end(): close.start()], True
    else:
        # Truncated generation (hit the token limit): take the rest, but stop at a stray tag.
        content, closed = text[last_open.end():], False
        content = re.split(r"<\s*/?\s*[\w|]", content, maxsplit=1)[0]  # e.g. </think>, <|im_end|>
    content = content.strip()
    return (content or None), closed and bool(content)


def extract_answer(text: str) -> str | None:
    """The stripped content of the *last* ``<answer>`` tag (tags are case-insensitive).

    An unclosed last tag (generation cut off) yields the text after it, up to any following tag. No tag, or an
    empty answer, gives ``None``.
    """
    return _find_answer(text)[0]


# Normalisation ----------------------------------------------------------------------------------------------------

_UNITS = {word: value for value, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {word: 10 * (index + 2) for index, word in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000, "trillion": 1_000_000_000_000}
_ARTICLES = frozenset({"a", "an", "the"})
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d)[,_](?=\d{3}(?!\d))")
_DECIMAL = re.compile(r"^(\d+)\.(\d+)$")
_PUNCTUATION_EXCEPT_DOT = re.compile("[" + re.escape(string.punctuation.replace(".", "")) + "]")
_DOT_NOT_DECIMAL = re.compile(r"(?<!\d)\.|\.(?!\d)")
_A_SCALE = re.compile(r"\ba\s+(hundred|thousand|million|billion|trillion)\b")
_ACRONYM = re.compile(r"\b(?:[^\W\d_]\.){2,}")


def _words_to_numbers(tokens: list[str]) -> list[str]:
    """Replace runs of English number words with their value: ``twenty one thousand`` -> ``21000``."""
    out: list[str] = []
    index = 0
    while index < len(tokens):
        if tokens[index] not in _UNITS and tokens[index] not in _TENS:
            out.append(tokens[index])
            index += 1
            continue
        total, current, last_kind, end = 0, 0, None, index
        position = index
        while position < len(tokens):
            word = tokens[position]
            if word in _UNITS or word in _TENS:
                value = _UNITS.get(word, _TENS.get(word))
                kind = "tens" if word in _TENS else ("teen" if value >= 10 else "unit")
                # "one two" or "twenty thirty" are two numbers, not one; "twenty one" is one.
                if last_kind in ("unit", "teen") or (last_kind == "tens" and kind != "unit"):
                    break
                current += value
                last_kind = kind
            elif word == "hundred" and last_kind in ("unit", "teen", "tens") and current % 100 != 0:
                current *= 100
                last_kind = "hundred"
            elif word in _SCALES and last_kind is not None and last_kind != "scale":
                total += current * _SCALES[word]
                current = 0
                last_kind = "scale"
            elif word == "and" and last_kind in ("hundred", "scale") and position + 1 < len(tokens) and (
                    tokens[position + 1] in _UNITS or tokens[position + 1] in _TENS):
                pass
            else:
                break
            position += 1
            end = position
        out.append(str(total + current))
        index = end
    return out


def _canonical_number(token: str) -> str:
    match = _DECIMAL.match(token)
    if match:
        whole, fraction = match.groups()
        fraction = fraction.rstrip("0")
        token = f"{int(whole)}.{fraction}" if fraction else str(int(whole))
    elif token.isdigit():
        token = str(int(token))
    return token


def normalize_answer(text: str) -> str:
    """Canonical form for comparison.

    Unicode NFKC and lower case; thousands separators dropped (``1,000`` -> ``1000``); punctuation becomes space
    (a dot between digits is kept, ``3.50`` -> ``3.5``); hyphenated and spelled-out numbers become digits
    (``twenty-one`` -> ``21``, ``three hundred`` -> ``300``); leading zeros dropped; articles (a, an, the) removed;
    whitespace collapsed. Dotted acronyms are joined (``U.S.A.`` -> ``usa``).
    """
    if not isinstance(text, str):
        return ""
    text = unicodedata.normalize("NFKC", text).lower()
    text = _THOUSANDS_SEPARATOR.sub("", text)
    text = _ACRONYM.sub(lambda match: match.group(0).replace(".", ""), text)  # u.s.a. -> usa
    text = _PUNCTUATION_EXCEPT_DOT.sub(" ", text)
    text = _DOT_NOT_DECIMAL.sub(" ", text)
    # Remaining non-word symbols (e.g. unicode dashes, quotes) are separators too.
    text = "".join(" " if unicodedata.category(ch)[0] in "PS" and ch != "." else ch for ch in text)
    text = _A_SCALE.sub(r"one \1", text)  # "a hundred" -> "one hundred" before articles are dropped
    tokens = _words_to_numbers(text.split())
    tokens = [_canonical_number(token) for token in tokens if token not in _ARTICLES]
    return " ".join(tokens)


def _as_aliases(gold_answers: str | Sequence[str]) -> list[str]:
    if isinstance(gold_answers, str):
        return [gold_answers]
    aliases = [alias for alias in gold_answers if isinstance(alias, str)]
    if not aliases:
        raise ValueError("gold_answers must be a string or a non-empty sequence of strings (aliases).")
    return aliases


def _comparison_form(text: str) -> str:
    """``normalize_answer``, or, where that is empty (an answer that is only an article or punctuation, such as the
    option letter ``A``), the lower-cased words without punctuation: so ``A`` matches ``a`` but not ``the``."""
    normalized = normalize_answer(text)
    if normalized or not isinstance(text, str):
        return normalized
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join("".join(" " if unicodedata.category(ch)[0] in "PS" else ch for ch in text).split())


def _gold_forms(gold_answers: str | Sequence[str]) -> list[str]:
    # An alias with nothing comparable in it (empty, or only spaces) accepts nothing, rather than every answer that
    # normalises to the empty string.
    return [form for form in map(_comparison_form, _as_aliases(gold_answers)) if form]


def exact_match(prediction: str | None, gold_answers: str | Sequence[str]) -> bool:
    """True if the normalised prediction equals the normalised form of any gold alias (an empty alias matches
    nothing)."""
    if prediction is None:
        return False
    predicted = _comparison_form(prediction)
    return bool(predicted) and predicted in _gold_forms(gold_answers)


def token_f1(prediction: str | None, gold_answers: str | Sequence[str]) -> float:
    """SQuAD-style token F1 between normalised texts, maximised over gold aliases (empty aliases are skipped)."""
    if prediction is None:
        return 0.0
    predicted = _comparison_form(prediction).split()
    best = 0.0
    for form in _gold_forms(gold_answers):
        gold = form.split()
        if not predicted:
            continue
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


class RewardResult(NamedTuple):
    """Outcome of ``answer_reward``: ``reward`` is what training uses; the rest is for metrics."""

    reward: float
    exact: bool  # normalised exact match against some alias
    f1: float  # best token F1 against the aliases
    has_answer: bool  # an answer was found (possibly in an unclosed tag)
    answer: str | None  # the extracted answer text
    well_formed: bool  # a closed, non-empty <answer>...</answer>


def answer_reward(response_text: str, gold_answers: str | Sequence[str], *, format_weight: float = 0.0,
                  f1_weight: float = 0.0) -> RewardResult:
    """The search environment's reward for a final response.

    ``answer = extract_answer(response_text)``, then::

        reward = (1 - format_weight - f1_weight) * exact  +  f1_weight * f1  +  format_weight * well_formed

    With the defaults this is exactly ``1.0`` for a normalised exact match with any gold alias and ``0.0``
    otherwise. ``format_weight`` (e.g. 0.1) gives a small score for a closed, non-empty ``<answer>`` tag, and
    ``f1_weight`` partial credit by token F1; ``reward`` stays in ``[0, 1]``.
    """
    if not (0.0 <= format_weight <= 1.0 and 0.0 <= f1_weight <= 1.0 and format_weight + f1_weight <= 1.0):
        raise ValueError(f"format_weight ({format_weight}) and f1_weight ({f1_weight}) must be in [0, 1] with a "
                         "sum of at most 1.")
    aliases = _as_aliases(gold_answers)
    answer, well_formed = _find_answer(response_text)
    exact = exact_match(answer, aliases)
    f1 = token_f1(answer, aliases)
    reward = (1.0 - format_weight - f1_weight) * float(exact) + f1_weight * f1 + format_weight * float(well_formed)
    return RewardResult(reward=reward, exact=exact, f1=f1, has_answer=answer is not None, answer=answer,
                        well_formed=well_formed)
