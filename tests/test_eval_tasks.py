"""Benchmark file loaders and prompt formats (files generated in tmp, plus the real ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.eval import (
    arc_prompt,
    gsm8k_prompt,
    hellaswag_prompt,
    load_arc,
    load_gsm8k,
    load_hellaswag,
    load_math,
    load_mmlu,
    math_prompt,
    mmlu_prompt,
)
from lmforge.eval.tasks import choose_shots, task_files
from lmforge.utils import LmforgeError


def _jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def _arc_row(i: int, labels: str = "ABCD", key: str = "B") -> dict:
    choices = [{"text": f"choice {c}{i}", "label": c} for c in labels]
    return {
        "id": str(i),
        "question": {"stem": f"Question {i}?", "choices": choices},
        "answerKey": key,
    }


def test_load_arc_and_prompt(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "arc.jsonl", [_arc_row(0), _arc_row(1, "1234", "3")])
    examples = load_arc(path)
    assert examples[0].answer == 1 and examples[0].labels == ["A", "B", "C", "D"]
    assert examples[1].answer == 2 and examples[1].labels == ["A", "B", "C", "D"]  # 1-4 → A-D
    ctx, conts = arc_prompt(examples[0], [examples[1]])
    assert ctx == "Question: Question 1?\nAnswer: choice 31\n\nQuestion: Question 0?\nAnswer:"
    assert conts == [" choice A0", " choice B0", " choice C0", " choice D0"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"question": {"stem": "q"}, "answerKey": "A"}), "missing field 'choices'"),
        (json.dumps(_arc_row(0, key="E")), "answerKey 'E' is not one of the labels"),
        (json.dumps([1, 2]), "expected a JSON object"),
    ],
)
def test_malformed_arc_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "arc.jsonl"
    path.write_text(json.dumps(_arc_row(0)) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(LmforgeError, match=message) as info:
        load_arc(path)
    assert f"{path}:2" in str(info.value) and "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match="task file not found"):
        load_gsm8k(tmp_path / "nope.jsonl")
    with pytest.raises(LmforgeError, match="MMLU folder not found"):
        load_mmlu(tmp_path, "test")
    with pytest.raises(LmforgeError, match="unknown task"):
        task_files(tmp_path, "squad")


def _mmlu(root: Path) -> None:
    for split in ("dev", "test"):
        (root / split).mkdir(parents=True)
        for subject in ("high_school_physics", "virology"):
            rows = "".join(
                f'"Q{i}, {subject}?",a{i},b,"c, d",e,{"ABCD"[i % 4]}\n' for i in range(5)
            )
            (root / split / f"{subject}_{split}.csv").write_text(rows, encoding="utf-8")


def test_load_mmlu_and_prompt(tmp_path: Path) -> None:
    _mmlu(tmp_path)
    test = load_mmlu(tmp_path, "test")
    assert sorted(test) == ["high_school_physics", "virology"]
    ex = test["virology"][1]
    assert (
        ex.question == "Q1, virology?" and ex.choices == ["a1", "b", "c, d", "e"] and ex.answer == 1
    )
    shots = load_mmlu(tmp_path, "dev", ["virology"])["virology"][:2]
    ctx, conts = mmlu_prompt(ex, shots)
    assert ctx.startswith(
        "The following are multiple choice questions (with answers) about virology.\n\n"
    )
    assert "Q0, virology?\nA. a0\nB. b\nC. c, d\nD. e\nAnswer: A\n\n" in ctx
    assert ctx.endswith("Q1, virology?\nA. a1\nB. b\nC. c, d\nD. e\nAnswer:")
    assert conts == [" A", " B", " C", " D"]
    with pytest.raises(LmforgeError, match="subject"):
        load_mmlu(tmp_path, "test", ["astronomy"])


def test_malformed_mmlu(tmp_path: Path) -> None:
    (tmp_path / "test").mkdir()
    bad = tmp_path / "test" / "x_test.csv"
    bad.write_text("q,a,b,c,d,A\nq,a,b,c,d,Z\n", encoding="utf-8")
    with pytest.raises(LmforgeError, match=r"x_test.csv:2: answer must be A-D"):
        load_mmlu(tmp_path, "test")
    bad.write_text("q,a,b,A\n", encoding="utf-8")
    with pytest.raises(LmforgeError, match="expected 6 columns"):
        load_mmlu(tmp_path, "test")


def test_gsm8k_and_math(tmp_path: Path) -> None:
    g = _jsonl(
        tmp_path / "g.jsonl",
        [{"question": "Tom has 2+3?", "answer": "2+3=<<2+3=5>>5 apples\n#### 5"}],
    )
    ex = load_gsm8k(g)[0]
    assert ex.answer == "5"
    prompt = gsm8k_prompt(ex, [ex])
    assert (
        prompt
        == "Question: Tom has 2+3?\nAnswer: 2+3=5 apples\n#### 5\n\nQuestion: Tom has 2+3?\nAnswer:"
    )
    _jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(LmforgeError, match="does not end with '#### N'"):
        load_gsm8k(tmp_path / "bad.jsonl")
    m = _jsonl(
        tmp_path / "m.jsonl",
        [
            {"problem": "1/2?", "solution": r"It is $\boxed{\frac{1}{2}}$."},
            {"problem": "2?", "solution": "two", "answer": "2"},
        ],
    )
    a, b = load_math(m)
    assert a.answer == r"\frac{1}{2}" and b.answer == "2"
    assert math_prompt(b, [a]).endswith("Problem:\n2?\n\nSolution:\n")
    _jsonl(tmp_path / "m2.jsonl", [{"problem": "p", "solution": "no box"}])
    with pytest.raises(LmforgeError, match="no 'answer' field"):
        load_math(tmp_path / "m2.jsonl")


def test_hellaswag(tmp_path: Path) -> None:
    h = _jsonl(
        tmp_path / "h.jsonl", [{"ctx": "A man", "endings": ["runs.", "sits."], "label": "1"}]
    )
    ex = load_hellaswag(h)[0]
    assert ex.answer == 1
    assert hellaswag_prompt(ex, []) == ("A man", [" runs.", " sits."])
    _jsonl(tmp_path / "h2.jsonl", [{"ctx": "A", "endings": ["x"], "label": 3}])
    with pytest.raises(LmforgeError, match="out of range"):
        load_hellaswag(tmp_path / "h2.jsonl")


def test_math_fewshot_demonstrations_are_consistent() -> None:
    from lmforge.eval import extract_boxed, math_answers_equal
    from lmforge.eval.tasks import MATH_FEWSHOT

    assert len(MATH_FEWSHOT) == 4
    for ex in MATH_FEWSHOT:
        assert math_answers_equal(extract_boxed(ex.solution), ex.answer)


def test_choose_shots_is_seeded_and_avoids_eval_questions(tmp_path: Path) -> None:
    pool = load_arc(_jsonl(tmp_path / "a.jsonl", [_arc_row(i) for i in range(10)]))
    a = choose_shots(pool, 3, seed=1)
    assert a == choose_shots(pool, 3, seed=1) and len(a) == 3
    avoid = {ex.question for ex in pool[:9]}
    assert choose_shots(pool, 3, seed=1, avoid=avoid) == [pool[9]]
    assert choose_shots(pool, 0, seed=1) == []


def test_real_files_parse(shared_data: Path) -> None:
    root = shared_data / "eval"
    mmlu = load_mmlu(root / "mmlu", "test")
    assert len(mmlu) == 57 and sum(map(len, mmlu.values())) == 14042
    assert all(len(v) >= 5 for v in load_mmlu(root / "mmlu", "dev").values())
    files = task_files(root, "arc")
    assert len(load_arc(files["eval"])) == 1150 and len(load_arc(files["shots"])) == 294
    assert len(load_gsm8k(task_files(root, "gsm8k")["shots"])) == 7473
    assert len(load_math(task_files(root, "math")["eval"])) == 5000
    assert len(load_math(task_files(root, "math500")["eval"])) == 500
