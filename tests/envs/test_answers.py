"""Answer extraction, normalisation, exact match, token F1 and the reward function."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_jax.envs.answers import answer_reward, exact_match, extract_answer, normalize_answer, token_f1


@pytest.mark.parametrize("text,expected", [
    ("I think <answer>Paris</answer>", "Paris"),
    ("<answer>first</answer> then <answer> second </answer>", "second"),
    ("<ANSWER>Upper</Answer>", "Upper"),
    ("<answer>multi\nline</answer>", "multi\nline"),
    ("cut off <answer> Rome and", "Rome and"),
    ("<answer>done</answer> later <answer>cut <|im_end|>", "cut"),
    ("no tag here", None),
    ("<answer>   </answer>", None),
    ("", None),
])
def test_extract_answer_takes_last_tag_and_handles_unclosed_or_missing(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("raw,normalized", [
    ("  The  Eiffel   Tower. ", "eiffel tower"),
    ("An apple a day", "apple day"),
    ("Hello, World!", "hello world"),
    ("1,234,567", "1234567"),
    ("twenty-one", "21"),
    ("Three hundred and five", "305"),
    ("a hundred", "100"),
    ("forty two thousand", "42000"),
    ("one two", "1 2"),
    ("3.50", "3.5"),
    ("3.0", "3"),
    ("007", "7"),
    ("U.S.A.", "usa"),
    ("New-York", "new york"),
    ("Ｆｕｌｌｗｉｄｔｈ", "fullwidth"),
    ("São Paulo", "são paulo"),
    ("“quoted” — dash", "quoted dash"),
])
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


@pytest.mark.parametrize("prediction,gold", [
    ("the Eiffel tower", "Eiffel Tower"),
    ("21", "twenty-one"),
    ("1,000", "one thousand"),
    ("USA", ["United States", "U.S.A."]),
])
def test_exact_match_after_normalisation_and_aliases(prediction, gold):
    assert exact_match(prediction, gold)


def test_exact_match_rejects_different_answers_and_none():
    assert not exact_match("Eiffel", "Eiffel Tower")
    assert not exact_match(None, "x")


def test_token_f1_partial_overlap_best_alias():
    assert token_f1("Eiffel", "Eiffel Tower") == pytest.approx(2 / 3)
    assert token_f1("Eiffel Tower", ["Louvre", "the Eiffel Tower"]) == 1.0
    assert token_f1("Louvre", "Eiffel Tower") == 0.0 and token_f1(None, "x") == 0.0
    assert token_f1("the", "a") == 0.0 and token_f1("A.", "a") == 1.0  # article-only answers compare as words


def test_gold_answers_must_be_given():
    with pytest.raises(ValueError, match="gold_answers"):
        exact_match("x", [])


def test_reward_is_exact_match_by_default():
    right = answer_reward("Reasoning... <answer>Twenty-one</answer>", ["21"])
    wrong = answer_reward("<answer>22</answer>", ["21"])
    assert (right.reward, right.exact, right.has_answer, right.well_formed, right.answer) == (
        1.0, True, True, True, "Twenty-one")
    assert (wrong.reward, wrong.exact, wrong.f1) == (0.0, False, 0.0)


def test_reward_without_answer_tag_is_zero():
    result = answer_reward("The answer is 21.", "21")
    assert result.reward == 0.0 and not result.has_answer and result.answer is None


def test_format_weight_rewards_a_closed_answer_tag():
    assert answer_reward("<answer>22</answer>", "21", format_weight=0.1).reward == pytest.approx(0.1)
    assert answer_reward("<answer>21</answer>", "21", format_weight=0.1).reward == pytest.approx(1.0)
    unclosed = answer_reward("<answer>21", "21", format_weight=0.1)
    assert unclosed.exact and not unclosed.well_formed and unclosed.reward == pytest.approx(0.9)


def test_f1_weight_gives_partial_credit():
    assert answer_reward("<answer>Eiffel</answer>", "Eiffel Tower", f1_weight=0.3).reward == pytest.approx(0.2)


def test_reward_weights_are_validated():
    with pytest.raises(ValueError, match="format_weight"):
        answer_reward("<answer>x</answer>", "x", format_weight=0.8, f1_weight=0.5)


answer_words = st.sampled_from("one two twenty hundred thousand and a the ninety-nine 1,000 3.50 , . U.S. - Kalo".split())


@given(st.text(max_size=40) | st.lists(answer_words, max_size=8).map(" ".join))
def test_normalize_answer_is_idempotent(text):
    normalized = normalize_answer(text)
    assert normalize_answer(normalized) == normalized


@given(st.text(max_size=60), st.lists(st.text(max_size=10), min_size=1, max_size=3))
def test_reward_stays_in_unit_interval_for_any_text(response, gold):
    result = answer_reward(response, gold, format_weight=0.1, f1_weight=0.1)
    assert 0.0 <= result.reward <= 1.0 and result.has_answer == (result.answer is not None)
