"""Answer extraction and normalisation (GSM8K, MATH, MMLU by generation)."""

from __future__ import annotations

import pytest

from lmforge.eval import (
    MultipleChoiceExample,
    extract_boxed,
    gsm8k_reference,
    load_gsm8k,
    load_math,
    math_answers_equal,
    normalize_math_answer,
    parse_gsm8k_response,
    parse_math_response,
    parse_mmlu_response,
)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("Janet sells 9 eggs and makes $18.\n#### 18", "18"),
        ("The total is $1,234.50.", "1234.5"),
        ("So she has -3 apples left", "-3"),
        ("answer: 18.00", "18"),
        ("first 12 then 7 then 40", "40"),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_parse_gsm8k_response_takes_the_last_number(output: str, expected: str | None) -> None:
    assert parse_gsm8k_response(output) == expected


def test_gsm8k_reference() -> None:
    assert gsm8k_reference("2+2=<<2+2=4>>4\n#### 1,000") == "1000"
    with pytest.raises(ValueError):
        gsm8k_reference("no marker")


def test_parse_mmlu_response() -> None:
    ex = MultipleChoiceExample("Which colour?", ["red", "blue", "green", "yellow"], 1)
    assert parse_mmlu_response(ex, "The answer is (B).") == "B"
    assert parse_mmlu_response(ex, "Answer: C") == "C"
    assert parse_mmlu_response(ex, "answer: c") == "C"
    assert parse_mmlu_response(ex, "B. blue") == "B"
    assert parse_mmlu_response(ex, "(D)") == "D"
    assert parse_mmlu_response(ex, "A") == "A"
    assert parse_mmlu_response(ex, "I think it is green.") == "C"  # choice text, unique
    assert parse_mmlu_response(ex, "blue or red") is None  # two choice texts: ambiguous
    assert parse_mmlu_response(ex, "a") is None  # the article, not a letter
    assert parse_mmlu_response(ex, "The answer is (F)") is None  # not offered
    assert parse_mmlu_response(ex, "nothing useful") is None


def test_extract_boxed_handles_nesting_and_last_box() -> None:
    text = r"first \boxed{1} then \boxed{\frac{a}{b^{2}}} end"
    assert extract_boxed(text) == r"\frac{a}{b^{2}}"
    assert extract_boxed(r"so $\boxed 5$.") == "5"
    assert extract_boxed(r"\fbox{x+1}") == "x+1"
    assert extract_boxed(r"\boxed{unbalanced") is None
    assert extract_boxed("no box") is None
    assert parse_math_response(r"Thus the answer is $\frac{1}{2}$.") == r"\frac{1}{2}"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("0.5", r"\frac12"),
        ("1/2", r"\dfrac{1}{2}"),
        (r"\frac{1}{2}", r"\tfrac{1}{2}"),
        (".5", "1/2"),
        ("2.50", "5/2"),
        (r"-\frac{3}{4}", "-0.75"),
        (r"10^\circ", "10"),
        (r"10^{\circ}", "10"),
        (r"\$10", "10"),
        (r"10 \text{ cm}", "10"),
        ("5 inches", "5"),
        (r"50\%", "50"),
        ("1,000", "1000"),
        ("x = 5", "5"),
        (r"\text{(A)}", "(A)"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt3}2"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        ("(1, 2)", "(1,2.0)"),
        (r"\!12\,345", "12345"),
    ],
)
def test_equivalent_math_answers_compare_equal(a: str, b: str) -> None:
    assert math_answers_equal(a, b)
    assert math_answers_equal(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [("1/2", "1/3"), ("(1,2)", "[1,2]"), (r"\sqrt{8}", "2"), ("x+1", "x-1"), ("1,2", "12")],
)
def test_different_math_answers_differ(a: str, b: str) -> None:
    assert not math_answers_equal(a, b)


def test_normalize_is_idempotent() -> None:
    for s in [r"\dfrac{1}{2}", r"\left[ 1, 2 \right)", r"5\text{ inches}", "0.25", r"x=\sqrt2"]:
        once = normalize_math_answer(s)
        assert normalize_math_answer(once) == once
    assert math_answers_equal(None, "1") is False


def test_real_gsm8k_answers_parse(shared_data) -> None:
    examples = load_gsm8k(shared_data / "eval" / "gsm8k" / "test.jsonl")
    assert len(examples) == 1319
    # the reference solution's own last number is its gold answer, for every problem
    assert all(parse_gsm8k_response(ex.solution) == ex.answer for ex in examples)


def test_real_math500_boxed_matches_answer_field(shared_data) -> None:
    examples = load_math(shared_data / "eval" / "math" / "math_oai" / "test.jsonl")
    assert len(examples) == 500
    agree = sum(math_answers_equal(extract_boxed(ex.solution), ex.answer) for ex in examples)
    assert agree == 500
