"""Benchmark files and prompts: MMLU, ARC, HellaSwag-style, GSM8K and MATH read from local files.

The file layout is the one of ``examples/eval`` (``DATA`` below is ``--data-dir``; a few items per
task ship there, the full sets go in a folder of the same layout)::

    DATA/mmlu/{dev,val,test}/<subject>_<split>.csv    question,A,B,C,D,answer (no header)
    DATA/arc_challenge/ARC-Challenge-{Dev,Test}.jsonl {"question": {"stem", "choices": [{text,
                                                      label}]}, "answerKey"}
    DATA/gsm8k/{train,test}.jsonl                     {"question", "answer": "... #### N"}
    DATA/math/math_oai/test.jsonl                     MATH-500: {"problem", "solution", "answer"}
    DATA/math/math/test.jsonl                         MATH: {"problem", "solution"} (\\boxed{})
    DATA/hellaswag/{train,val}.jsonl                  {"ctx", "endings": [...], "label"}

Few-shot demonstrations come from the dev/train split beside each test file (MMLU: the first k
dev questions of the subject; ARC: Dev; GSM8K: train); MATH and MATH-500 use the four fixed
demonstrations of :data:`MATH_FEWSHOT` (more shots are drawn from the other MATH file, never
repeating a problem under evaluation).

A missing file or a malformed line stops with one :class:`~lmforge.utils.LmforgeError` line naming
the file, line and field. Prompts follow the usual harness formats so numbers are comparable with
published few-shot results. Exercised by ``pytest tests/test_eval_tasks.py``.
"""

from __future__ import annotations

import csv
import dataclasses
import random
import re
from collections.abc import Iterator
from pathlib import Path

from lmforge.eval.answers import extract_boxed, gsm8k_reference
from lmforge.utils.errors import LmforgeError

LETTERS = "ABCDEFGHIJ"


@dataclasses.dataclass(frozen=True)
class MultipleChoiceExample:
    """One multiple-choice question."""

    question: str
    "question text (for HellaSwag-style tasks: the context to continue)"
    choices: list[str]
    "answer texts, in order"
    answer: int
    "index of the correct choice"
    labels: list[str] = dataclasses.field(default_factory=list)
    "letters shown for the choices (default A, B, C, ...)"
    subject: str = ""
    "MMLU subject or other grouping"

    def __post_init__(self) -> None:
        if not self.labels:
            object.__setattr__(self, "labels", list(LETTERS[: len(self.choices)]))


@dataclasses.dataclass(frozen=True)
class MathExample:
    """One math word problem with its gold final answer."""

    problem: str
    "problem statement"
    answer: str
    "gold final answer (GSM8K: a canonical number; MATH: LaTeX as in the boxed solution)"
    solution: str = ""
    "worked solution (used for few-shot demonstrations)"


def _records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` per JSONL line; ``where`` ("FILE:LINE") starts every error message."""
    from lmforge.utils.io import iter_jsonl

    for lineno, obj in iter_jsonl(Path(path), "task file"):
        yield f"{path}:{lineno}", obj


def _field(obj: dict, key: str, typ: type, where: str) -> object:
    if key not in obj:
        raise LmforgeError(f"{where}: missing field '{key}'")
    value = obj[key]
    if not isinstance(value, typ):
        raise LmforgeError(f"{where}: field '{key}' should be {typ.__name__}")
    return value


# ---------------------------------------------------------------- MMLU


def _mmlu_csv(path: Path, subject: str) -> list[MultipleChoiceExample]:
    out = []
    with path.open(encoding="utf-8", newline="") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            if len(row) != 6:
                raise LmforgeError(
                    f"{path}:{lineno}: expected 6 columns (question,A,B,C,D,answer), got {len(row)}"
                )
            answer = row[5].strip().upper()
            if answer not in "ABCD" or len(answer) != 1:
                raise LmforgeError(f"{path}:{lineno}: answer must be A-D, got {row[5]!r}")
            out.append(
                MultipleChoiceExample(
                    question=row[0].strip(),
                    choices=[c.strip() for c in row[1:5]],
                    answer="ABCD".index(answer),
                    subject=subject,
                )
            )
    return out


def load_mmlu(
    root: str | Path, split: str = "test", subjects: list[str] | None = None
) -> dict[str, list[MultipleChoiceExample]]:
    """MMLU questions of one split per subject, from ``root/<split>/<subject>_<split>.csv``."""
    folder = Path(root) / split
    if not folder.is_dir():
        raise LmforgeError(
            f"MMLU folder not found: {folder} (expected <subject>_{split}.csv files)"
        )
    files = sorted(folder.glob(f"*_{split}.csv"))
    if not files:
        raise LmforgeError(f"no MMLU files *_{split}.csv in {folder}")
    out: dict[str, list[MultipleChoiceExample]] = {}
    for path in files:
        subject = path.name[: -len(f"_{split}.csv")]
        if subjects is None or subject in subjects:
            out[subject] = _mmlu_csv(path, subject)
    if subjects is not None and (missing := sorted(set(subjects) - set(out))):
        raise LmforgeError(f"MMLU subject(s) not found in {folder}: {', '.join(missing)}")
    return out


def _mmlu_block(ex: MultipleChoiceExample) -> str:
    lines = [ex.question]
    lines += [f"{label}. {choice}" for label, choice in zip(ex.labels, ex.choices)]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_prompt(
    example: MultipleChoiceExample, shots: list[MultipleChoiceExample]
) -> tuple[str, list[str]]:
    """(context, continuations) in the original MMLU format; the continuations are " A".." D"."""
    head = (
        "The following are multiple choice questions (with answers) about "
        f"{example.subject.replace('_', ' ')}.\n\n"
    )
    demos = "".join(f"{_mmlu_block(s)} {s.labels[s.answer]}\n\n" for s in shots)
    return head + demos + _mmlu_block(example), [f" {label}" for label in example.labels]


# ---------------------------------------------------------------- ARC


def load_arc(path: str | Path) -> list[MultipleChoiceExample]:
    """ARC questions from a JSONL file of ``{question: {stem, choices: [{text, label}]}, answerKey}``."""
    out = []
    for where, obj in _records(path):
        q = _field(obj, "question", dict, where)
        stem = _field(q, "stem", str, where + " question")
        choices = _field(q, "choices", list, where + " question")
        try:
            texts = [str(c["text"]) for c in choices]
            labels = [str(c["label"]) for c in choices]
        except (KeyError, TypeError):
            raise LmforgeError(f"{where}: each choice needs 'text' and 'label'") from None
        key = str(_field(obj, "answerKey", str, where))
        if key not in labels:
            raise LmforgeError(f"{where}: answerKey {key!r} is not one of the labels {labels}")
        # Some ARC items label choices 1-4: show letters so prompts stay uniform.
        letters = list(LETTERS[: len(labels)]) if labels[0].isdigit() else labels
        out.append(
            MultipleChoiceExample(
                question=stem, choices=texts, answer=labels.index(key), labels=letters
            )
        )
    return out


def arc_prompt(
    example: MultipleChoiceExample, shots: list[MultipleChoiceExample]
) -> tuple[str, list[str]]:
    """(context, continuations) as in lm-evaluation-harness: the choice texts are scored."""
    demos = "".join(f"Question: {s.question}\nAnswer: {s.choices[s.answer]}\n\n" for s in shots)
    return demos + f"Question: {example.question}\nAnswer:", [f" {c}" for c in example.choices]


# ---------------------------------------------------------------- HellaSwag-style


def load_hellaswag(path: str | Path) -> list[MultipleChoiceExample]:
    """Sentence-completion items from JSONL ``{ctx, endings: [...], label}`` (HellaSwag format)."""
    out = []
    for where, obj in _records(path):
        ctx = _field(obj, "ctx", str, where)
        endings = _field(obj, "endings", list, where)
        label = obj.get("label")
        try:
            label = int(label)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise LmforgeError(f"{where}: field 'label' should be an integer index") from None
        if not 0 <= label < len(endings):
            raise LmforgeError(f"{where}: label {label} out of range for {len(endings)} endings")
        out.append(
            MultipleChoiceExample(question=ctx, choices=[str(e) for e in endings], answer=label)
        )
    return out


def hellaswag_prompt(
    example: MultipleChoiceExample, shots: list[MultipleChoiceExample]
) -> tuple[str, list[str]]:
    """(context, continuations): the context followed by each ending (zero-shot by convention)."""
    demos = "".join(f"{s.question} {s.choices[s.answer]}\n\n" for s in shots)
    return demos + example.question, [f" {c}" for c in example.choices]


# ---------------------------------------------------------------- GSM8K and MATH


def load_gsm8k(path: str | Path) -> list[MathExample]:
    """GSM8K problems from JSONL ``{question, answer}``; the gold answer is the ``#### N`` number."""
    out = []
    for where, obj in _records(path):
        question = _field(obj, "question", str, where)
        answer = _field(obj, "answer", str, where)
        try:
            gold = gsm8k_reference(answer)  # type: ignore[arg-type]
        except ValueError:
            raise LmforgeError(f"{where}: field 'answer' does not end with '#### N'") from None
        out.append(MathExample(problem=question, answer=gold, solution=answer))  # type: ignore[arg-type]
    return out


def load_math(path: str | Path) -> list[MathExample]:
    """MATH problems from JSONL ``{problem, solution[, answer]}`` (answer = last \\boxed{} if absent)."""
    out = []
    for where, obj in _records(path):
        problem = _field(obj, "problem", str, where)
        solution = obj.get("solution", "")
        answer = obj.get("answer")
        if answer is None:
            answer = extract_boxed(str(solution))
        if answer is None:
            raise LmforgeError(f"{where}: no 'answer' field and no \\boxed{{}} in 'solution'")
        out.append(MathExample(problem=problem, answer=str(answer), solution=str(solution)))  # type: ignore[arg-type]
    return out


# Four hand-written demonstrations for MATH prompts (the shared data has no MATH training split,
# and MATH-500 is a subset of the MATH test set, so neither can supply shots for the other).
MATH_FEWSHOT = (
    MathExample(
        problem="What is the value of $3^2 + 4^2$?",
        answer="25",
        solution="We have $3^2 + 4^2 = 9 + 16 = 25$. The answer is $\\boxed{25}$.",
    ),
    MathExample(
        problem="Simplify $\\frac{6}{8}$.",
        answer="\\frac{3}{4}",
        solution="Dividing numerator and denominator by 2 gives $\\boxed{\\frac{3}{4}}$.",
    ),
    MathExample(
        problem="Solve for $x$: $2x + 3 = 11$.",
        answer="4",
        solution="Subtracting 3 from both sides gives $2x = 8$, so $x = \\boxed{4}$.",
    ),
    MathExample(
        problem="A rectangle has length 7 and width 3. What is its perimeter?",
        answer="20",
        solution="The perimeter is $2(7 + 3) = 20$, so the answer is $\\boxed{20}$.",
    ),
)


def _gsm8k_solution(solution: str) -> str:
    # Drop the calculator annotations "<<16-3-4=9>>" that the dataset carries.
    return re.sub(r"<<[^>]*>>", "", solution).strip()


def gsm8k_prompt(example: MathExample, shots: list[MathExample]) -> str:
    """Few-shot "Question: …\\nAnswer: … #### N" prompt; the model continues after "Answer:"."""
    demos = "".join(
        f"Question: {s.problem}\nAnswer: {_gsm8k_solution(s.solution)}\n\n" for s in shots
    )
    return demos + f"Question: {example.problem}\nAnswer:"


def math_prompt(example: MathExample, shots: list[MathExample]) -> str:
    """Few-shot "Problem: …\\nSolution: … \\boxed{}" prompt (Minerva style)."""
    demos = "".join(f"Problem:\n{s.problem}\n\nSolution:\n{s.solution}\n\n" for s in shots)
    return demos + f"Problem:\n{example.problem}\n\nSolution:\n"


def choose_shots(pool: list, k: int, seed: int = 1234, avoid: set[str] | None = None) -> list:
    """The first ``k`` items of a seeded shuffle of ``pool``, skipping questions in ``avoid``.

    ``avoid`` holds question/problem texts under evaluation, so a demonstration never gives away
    an answer (MATH-500 is a subset of the MATH test set that MATH-500's shots come from).
    """
    if k <= 0:
        return []
    avoid = avoid or set()
    items = [p for p in pool if getattr(p, "question", getattr(p, "problem", None)) not in avoid]
    random.Random(seed).shuffle(items)
    return items[:k]


def task_files(data_dir: str | Path, task: str) -> dict[str, Path]:
    """The evaluation and few-shot files of ``task`` under ``data_dir`` (layout in this module)."""
    layout = {  # task: (evaluation file, few-shot file) under data_dir
        "mmlu": ("mmlu", "mmlu"),
        "arc": ("arc_challenge/ARC-Challenge-Test.jsonl", "arc_challenge/ARC-Challenge-Dev.jsonl"),
        "hellaswag": ("hellaswag/val.jsonl", "hellaswag/train.jsonl"),
        "gsm8k": ("gsm8k/test.jsonl", "gsm8k/train.jsonl"),
        "math500": ("math/math_oai/test.jsonl", "math/math/test.jsonl"),
        "math": ("math/math/test.jsonl", "math/math_oai/test.jsonl"),
    }
    if task not in layout:
        raise LmforgeError(f"unknown task '{task}' (expected one of {', '.join(layout)})")
    return {"eval": Path(data_dir, layout[task][0]), "shots": Path(data_dir, layout[task][1])}
