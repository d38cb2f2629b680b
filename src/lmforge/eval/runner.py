"""The evaluation suite: run tasks on a model, collect a JSON-ready report, print a table.

Tasks (``--tasks`` names):

- ``ppl``: perplexity and bits per byte of held-out text files (each file one document);
- ``mmlu``, ``arc``, ``hellaswag``: multiple choice by log-likelihood; ``acc`` picks the choice
  with the highest summed log-probability, ``acc_norm`` the highest log-probability per byte of
  the choice text (HellaSwag-style length normalisation);
- ``mmlu_gen``: MMLU answered by generation (for instruction-tuned models), the letter read by
  :func:`~lmforge.eval.parse_mmlu_response`; an unparsable answer counts as wrong;
- ``gsm8k``, ``math500``, ``math``: generation, answer extraction (last number / last ``\\boxed{}``)
  and normalised comparison; ``pass@1`` (and ``pass@k`` for k ≤ ``samples``) with the unbiased
  estimator.

Every accuracy comes with its standard error. Exercised by ``pytest tests/test_eval_runner.py``
and ``lmforge eval --checkpoint DIR --tasks ppl,mmlu,arc,gsm8k,math500 --data-dir DATA``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmforge.eval import tasks as T
from lmforge.eval.answers import (
    math_answers_equal,
    parse_gsm8k_response,
    parse_math_response,
    parse_mmlu_response,
)
from lmforge.eval.metrics import mean_stderr, pass_at_k
from lmforge.eval.scoring import TextTokenizer, encode_pair, perplexity, score_continuations
from lmforge.utils.errors import LmforgeError

TASKS = ("ppl", "mmlu", "mmlu_gen", "arc", "hellaswag", "gsm8k", "math500", "math")
DEFAULT_SHOTS = {
    "mmlu": 5,
    "mmlu_gen": 5,
    "arc": 0,
    "hellaswag": 0,
    "gsm8k": 5,
    "math500": 4,
    "math": 4,
}
# Text after which a generated answer is over: the model starts the next few-shot example.
_STOP_STRINGS = {
    "gsm8k": ("\n\nQuestion:", "\nQuestion:", "\n\n\n"),
    "math": ("\n\nProblem:", "\nProblem:", "\n\n\n"),
}


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """Settings shared by all tasks of one evaluation run."""

    data_dir: str = "examples/eval"
    "folder laid out like examples/eval (see lmforge.eval.tasks)"
    limit: int | None = None
    "evaluate at most this many examples per task (ppl: context-length windows of tokens)"
    shots: int | None = None
    "few-shot examples per prompt (None = each task's default)"
    batch_size: int = 8
    "sequences per forward pass of log-likelihood scoring (generation batches on the engine)"
    max_new_tokens: int = 256
    "generation budget for gsm8k/math"
    samples: int = 1
    "generations per problem (pass@k for k ≤ samples)"
    temperature: float = 0.0
    "sampling temperature for generation (0 = greedy; use > 0 with samples > 1)"
    top_p: float = 1.0
    "nucleus sampling threshold for generation"
    ppl_files: tuple[str, ...] = ()
    "text files for the ppl task (default: DATA/../text/wikitext2/test.txt)"
    ppl_max_tokens: int | None = None
    "score at most this many tokens per ppl document"
    seed: int = 1234
    "seed for few-shot selection, subsampling and sampling"
    progress: bool = True
    "show tqdm progress bars on stderr"


# ---------------------------------------------------------------- multiple choice


def evaluate_multiple_choice(
    model: Any,
    tokenizer: TextTokenizer,
    prompts: Sequence[tuple[str, list[str], int]],
    *,
    batch_size: int = 8,
    progress: bool = False,
    desc: str = "choices",
) -> dict[str, Any]:
    """Accuracy of ``(context, continuations, answer index)`` items scored by log-likelihood.

    ``acc`` picks argmax of the summed log-probability; ``acc_norm`` of log-probability divided by
    the continuation's UTF-8 byte length. Both with standard errors; ``n`` items.
    """
    requests = [encode_pair(tokenizer, ctx, c) for ctx, conts, _ in prompts for c in conts]
    scores = iter(
        score_continuations(model, requests, batch_size=batch_size, progress=progress, desc=desc)
    )
    correct, correct_norm = [], []
    for _, conts, answer in prompts:
        lls = [next(scores)[0] for _ in conts]
        norm = [ll / max(1, len(c.encode("utf-8"))) for ll, c in zip(lls, conts)]
        correct.append(float(max(range(len(lls)), key=lls.__getitem__) == answer))
        correct_norm.append(float(max(range(len(norm)), key=norm.__getitem__) == answer))
    acc, acc_se = mean_stderr(correct)
    acc_n, acc_n_se = mean_stderr(correct_norm)
    return {
        "acc": acc,
        "acc_stderr": acc_se,
        "acc_norm": acc_n,
        "acc_norm_stderr": acc_n_se,
        "n": len(prompts),
        "_correct": correct,
    }


# ---------------------------------------------------------------- generation


def make_engine(model: Any, tokenizer: TextTokenizer, seed: int = 0) -> Any:
    """The serving engine generative tasks decode on (:class:`lmforge.serve.Engine`, its defaults:
    the compiled step on CUDA), with ``tokenizer`` for text and stop strings."""
    from lmforge.serve import Engine
    from lmforge.serve.loading import engine_tokenizer

    text = engine_tokenizer(tokenizer, int(model.config.vocab_size))
    return Engine(model, tokenizer=text, eos_token_id=tokenizer.eot_id, seed=seed)


def generate_texts(
    model: Any,
    tokenizer: TextTokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    samples: int = 1,
    stops: Sequence[str] = (),
    seed: int = 0,
    engine: Any = None,
    progress: bool = False,
) -> list[list[str]]:
    """``samples`` continuations of each prompt, all decoded at once on one serving engine.

    Each prompt starts with the end-of-text id (documents start that way in training) and keeps
    its rightmost ``context_length - new tokens`` tokens (new tokens: ``max_new_tokens``, at most
    half the context). A sample ends at the end-of-text id or at a stop string; its text holds
    neither. Sample ``j`` of prompt ``i`` is seeded with ``seed + i * samples + j``, so results
    do not depend on what else is in the batch. ``engine`` (default: :func:`make_engine`)
    lets several tasks share one.
    """
    from lmforge.serve import SamplingParams

    ctx_len = int(getattr(getattr(model, "config", None), "context_length", 1 << 30))
    new_tokens = max(1, min(max_new_tokens, ctx_len // 2))
    keep = ctx_len - new_tokens
    prefix = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    encoded = [[*prefix, *tokenizer.encode(p)][-keep:] for p in prompts]
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=new_tokens,
            n=samples,
            seed=None if temperature == 0 else seed + i * samples,
            stop=tuple(s for s in stops if s),
        )
        for i in range(len(prompts))
    ]
    engine = engine if engine is not None else make_engine(model, tokenizer, seed)
    outs = engine.generate(encoded, params, progress=progress)
    return [[sample.text for sample in out.outputs] for out in outs]


def evaluate_generative_math(
    model: Any,
    tokenizer: TextTokenizer,
    examples: Sequence[T.MathExample],
    shots: Sequence[T.MathExample],
    *,
    kind: str,
    max_new_tokens: int = 256,
    samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    progress: bool = False,
    seed: int = 0,
    engine: Any = None,
) -> dict[str, Any]:
    """pass@1 (and pass@k for k = 2, 4, 8, … ≤ samples and k = samples) on GSM8K (``kind="gsm8k"``) or MATH.

    Each problem is answered ``samples`` times (:func:`generate_texts`: every problem and sample
    decoded together on the serving engine); with c correct of n, pass@k is the unbiased
    estimate 1 - C(n-c, k)/C(n, k), averaged over problems with its standard error.
    """
    gsm8k = kind == "gsm8k"
    prompt_fn = T.gsm8k_prompt if gsm8k else T.math_prompt
    outputs = generate_texts(
        model,
        tokenizer,
        [prompt_fn(ex, list(shots)) for ex in examples],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        samples=samples,
        stops=_STOP_STRINGS["gsm8k" if gsm8k else "math"],
        seed=seed,
        engine=engine,
        progress=progress,
    )
    n_correct = []
    records = []
    for ex, outs in zip(examples, outputs, strict=True):
        if gsm8k:
            preds = [parse_gsm8k_response(o) for o in outs]
            ok = [p is not None and p == ex.answer for p in preds]
        else:
            preds = [parse_math_response(o) for o in outs]
            ok = [math_answers_equal(p, ex.answer) for p in preds]
        n_correct.append(sum(ok))
        records.append({"answer": ex.answer, "predictions": preds, "correct": ok})
    result: dict[str, Any] = {"n": len(examples), "samples": samples}
    ks = sorted({1, samples, *(k for k in (2, 4, 8, 16, 32, 64, 128) if k <= samples)})
    for k in ks:
        mean_se = mean_stderr([pass_at_k(samples, c, k) for c in n_correct])
        result[f"pass@{k}"], result[f"pass@{k}_stderr"] = mean_se
    result["_records"] = records
    return result


def evaluate_mmlu_generative(
    model: Any,
    tokenizer: TextTokenizer,
    items: Sequence[tuple[T.MultipleChoiceExample, str]],
    *,
    max_new_tokens: int = 16,
    progress: bool = False,
    engine: Any = None,
) -> dict[str, Any]:
    """Accuracy of letters generated after each ``(example, prompt)`` (greedy, one line)."""
    texts = generate_texts(
        model,
        tokenizer,
        [prompt for _, prompt in items],
        max_new_tokens=max_new_tokens,
        stops=("\n",),
        engine=engine,
        progress=progress,
    )
    outputs = [t[0] for t in texts]
    preds = [parse_mmlu_response(ex, out) for (ex, _), out in zip(items, outputs)]
    correct = [float(p == ex.labels[ex.answer]) for (ex, _), p in zip(items, preds)]
    acc, se = mean_stderr(correct)
    unparsed = sum(p is None for p in preds) / max(1, len(preds))
    return {
        "acc": acc,
        "acc_stderr": se,
        "unparsed": unparsed,
        "n": len(items),
        "_records": [
            {"answer": ex.labels[ex.answer], "output": out, "prediction": p}
            for (ex, _), out, p in zip(items, outputs, preds)
        ],
    }


# ---------------------------------------------------------------- the suite


def _subsample(items: list, limit: int | None, seed: int, shuffle: bool) -> list:
    if limit is None or limit >= len(items):
        return items
    if shuffle:
        items = list(items)
        random.Random(seed).shuffle(items)
    return items[:limit]


def _ppl_texts(task: str, options: EvalOptions) -> list[tuple[str, str]]:
    """(file, text) of each ppl document (``task`` as the other task readers take it)."""
    files = [Path(f) for f in options.ppl_files] or [
        Path(options.data_dir).parent / "text" / "wikitext2" / "test.txt"
    ]
    out = []
    for f in files:
        if not f.is_file():
            raise LmforgeError(f"ppl text file not found: {f} (give --ppl-text FILE)")
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise LmforgeError(f"ppl text file is not UTF-8: {f}") from None
        if not text.strip():
            raise LmforgeError(f"ppl text file is empty: {f} (nothing to score)")
        out.append((str(f), text))
    return out


def _mmlu_items(task: str, options: EvalOptions) -> list[tuple[T.MultipleChoiceExample, str]]:
    """(example, prompt) pairs: the first k dev questions of the subject as shots (the standard)."""
    files = T.task_files(options.data_dir, "mmlu")
    k = DEFAULT_SHOTS[task] if options.shots is None else options.shots
    evals = T.load_mmlu(files["eval"], "test")
    devs = T.load_mmlu(files["shots"], "dev") if k > 0 else {}
    flat = [ex for subject in sorted(evals) for ex in evals[subject]]
    flat = _subsample(flat, options.limit, options.seed, shuffle=True)
    items = []
    for ex in flat:
        pool = devs.get(ex.subject, [])
        if k > 0 and len(pool) < k:
            raise LmforgeError(
                f"MMLU dev file for '{ex.subject}' has {len(pool)} questions, need {k} shots"
            )
        items.append((ex, T.mmlu_prompt(ex, pool[:k])[0]))
    return items


def _mc_prompts(task: str, options: EvalOptions) -> list[tuple[str, list[str], int]]:
    files = T.task_files(options.data_dir, task)
    k = DEFAULT_SHOTS[task] if options.shots is None else options.shots
    if task == "mmlu":
        return [
            (prompt, [f" {label}" for label in ex.labels], ex.answer)
            for ex, prompt in _mmlu_items(task, options)
        ]
    loader, prompt_fn = {
        "arc": (T.load_arc, T.arc_prompt),
        "hellaswag": (T.load_hellaswag, T.hellaswag_prompt),
    }[task]
    examples = _subsample(loader(files["eval"]), options.limit, options.seed, shuffle=False)
    pool = loader(files["shots"]) if k > 0 else []
    avoid = {ex.question for ex in examples}
    shots = T.choose_shots(pool, k, options.seed, avoid)
    return [(*prompt_fn(ex, shots), ex.answer) for ex in examples]


def _math_examples(
    task: str, options: EvalOptions
) -> tuple[list[T.MathExample], list[T.MathExample]]:
    files = T.task_files(options.data_dir, task)
    k = DEFAULT_SHOTS[task] if options.shots is None else options.shots
    loader = T.load_gsm8k if task == "gsm8k" else T.load_math
    examples = _subsample(loader(files["eval"]), options.limit, options.seed, shuffle=False)
    shots: list[T.MathExample] = []
    if task != "gsm8k":
        shots = list(T.MATH_FEWSHOT[:k])  # fixed demonstrations; more come from the file
    if k > len(shots):
        if not files["shots"].is_file():
            raise LmforgeError(f"few-shot file not found: {files['shots']} (or lower --shots)")
        pool = loader(files["shots"])
        if task != "gsm8k":
            # MATH demonstrations must show a final \boxed{} answer to imitate.
            pool = [p for p in pool if "\\boxed" in p.solution and len(p.solution) < 1500]
        avoid = {ex.problem for ex in examples}
        shots += T.choose_shots(pool, k - len(shots), options.seed, avoid)
    return examples, shots


_SCORED = ("ppl", "mmlu", "arc", "hellaswag")  # log-likelihood tasks; the rest generate


def run_eval(
    model: Any,
    tokenizer: TextTokenizer,
    tasks: Sequence[str],
    options: EvalOptions = EvalOptions(),
) -> dict[str, Any]:
    """Run ``tasks`` on ``model`` and return the report ``{"results": {task: metrics}, ...}``.

    Task inputs are read before any model work, so a missing or malformed file stops the run at
    once. Per-example records (``_correct``, ``_records``) are kept under ``"details"``.
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise LmforgeError(f"unknown task(s) {', '.join(unknown)} (expected {', '.join(TASKS)})")
    if int(tokenizer.vocab_size) > int(model.config.vocab_size):  # ids with no embedding
        raise LmforgeError(
            f"checkpoint: tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model.config.vocab_size} (checkpoint/tokenizer mismatch)"
        )
    # What each task runs on: texts (ppl), prompts (multiple choice), examples and shots.
    read = {"ppl": _ppl_texts, "mmlu_gen": _mmlu_items, **dict.fromkeys(_SCORED[1:], _mc_prompts)}
    inputs = {task: read.get(task, _math_examples)(task, options) for task in tasks}
    o = options
    results: dict[str, Any] = {}
    details: dict[str, Any] = {}
    timings: dict[str, float] = {}
    # One engine for a run of generative tasks; dropped before a scoring task, whose batches
    # need the memory the engine's KV cache takes (on CUDA, most of what is free).
    engine = None
    bar = tqdm(list(tasks), desc="eval", disable=not o.progress)
    for task in bar:
        bar.set_postfix_str(task)
        t0 = time.perf_counter()
        if task in _SCORED and engine is not None:
            device, engine = engine.device, None
            _empty_cache(device)
        elif task not in _SCORED:
            engine = engine or make_engine(model, tokenizer, o.seed)
        if task == "ppl":
            docs = inputs[task]
            ppl = perplexity(
                model,
                tokenizer,
                [text for _, text in docs],
                batch_size=o.batch_size,
                max_tokens=o.ppl_max_tokens,
                max_windows=o.limit,
                progress=o.progress,
            )
            res = {**ppl.as_dict(), "files": [name for name, _ in docs]}
        elif task in _SCORED:
            res = evaluate_multiple_choice(
                model,
                tokenizer,
                inputs[task],
                batch_size=o.batch_size,
                progress=o.progress,
                desc=task,
            )
        elif task == "mmlu_gen":
            res = evaluate_mmlu_generative(
                model,
                tokenizer,
                inputs[task],
                max_new_tokens=min(o.max_new_tokens, 16),
                progress=o.progress,
                engine=engine,
            )
        else:
            res = evaluate_generative_math(
                model,
                tokenizer,
                *inputs[task],
                kind="gsm8k" if task == "gsm8k" else "math",
                max_new_tokens=o.max_new_tokens,
                samples=o.samples,
                temperature=o.temperature,
                top_p=o.top_p,
                progress=o.progress,
                seed=o.seed,
                engine=engine,
            )
        for key in ("_correct", "_records"):
            if key in res:
                details[task] = res.pop(key)
        if task != "ppl":
            res["shots"] = DEFAULT_SHOTS[task] if o.shots is None else o.shots
        results[task] = res
        timings[task] = time.perf_counter() - t0
    if engine is not None:
        device, engine = engine.device, None
        _empty_cache(device)
    return {
        "results": results,
        "seconds": timings,
        "options": dataclasses.asdict(options),
        "details": details,
    }


def _empty_cache(device: Any) -> None:
    """Hand a dropped engine's KV cache back to the device (CUDA keeps freed blocks cached)."""
    if device.type == "cuda":
        import gc

        import torch

        gc.collect()  # the engine's compiled step and graphs may hold it in reference cycles
        torch.cuda.empty_cache()


_MAIN_METRICS = {
    "ppl": ("bits_per_byte", "perplexity"),
    "mmlu": ("acc", "acc_norm"),
    "mmlu_gen": ("acc", "unparsed"),
    "arc": ("acc", "acc_norm"),
    "hellaswag": ("acc", "acc_norm"),
}


def format_table(report: dict[str, Any]) -> str:
    """Markdown table ``| task | metric | value | ± stderr | n |`` of a :func:`run_eval` report."""
    rows = ["| task | metric | value | ± stderr | n |", "|---|---|---:|---:|---:|"]
    for task, res in report["results"].items():
        names = _MAIN_METRICS.get(task) or tuple(
            k for k in res if k.startswith("pass@") and not k.endswith("_stderr")
        )
        n = res.get("n", res.get("tokens", ""))
        for name in names:
            value = res[name]
            se = res.get(f"{name}_stderr")
            se_s = "" if se is None or (isinstance(se, float) and math.isnan(se)) else f"{se:.4f}"
            rows.append(f"| {task} | {name} | {value:.4f} | {se_s} | {n} |")
    return "\n".join(rows)
