"""Evaluation: perplexity and bits per byte, multiple choice by log-likelihood, generative math,
pass@k, pairwise (Bradley–Terry/Elo) ratings, and an lm-evaluation-harness adapter.

This is the public API of ``lmforge.eval``; everything else is internal. Benchmarks are read from
local files laid out like ``examples/eval`` (see :mod:`lmforge.eval.tasks`); nothing is
downloaded. CLI: ``lmforge eval --checkpoint DIR --tasks ppl,mmlu,arc,gsm8k,math500 --data-dir D``.
The harness adapter lives in :mod:`lmforge.eval.harness` (imported only on demand: it needs
``lm-eval``).
"""

# ruff: noqa: F401 (the imports for type checkers below are the names __all__ exports)

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.eval.answers import (
        extract_boxed,
        gsm8k_reference,
        math_answers_equal,
        normalize_math_answer,
        parse_gsm8k_response,
        parse_math_response,
        parse_mmlu_response,
    )
    from lmforge.eval.metrics import PairwiseRatings, fit_bradley_terry, mean_stderr, pass_at_k
    from lmforge.eval.runner import (
        DEFAULT_SHOTS,
        TASKS,
        EvalOptions,
        evaluate_generative_math,
        evaluate_mmlu_generative,
        evaluate_multiple_choice,
        format_table,
        run_eval,
    )
    from lmforge.eval.scoring import (
        PerplexityResult,
        conditional_perplexity,
        perplexity,
        rolling_windows,
        score_continuations,
        score_sequences,
    )
    from lmforge.eval.tasks import (
        MathExample,
        MultipleChoiceExample,
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

# name → defining module; resolved on first access so ``lmforge eval --help`` (which imports
# this package's ``_cli``) does not pull in torch.
_EXPORTS = {
    name: module
    for module, names in {
        "answers": "extract_boxed gsm8k_reference math_answers_equal normalize_math_answer "
        "parse_gsm8k_response parse_math_response parse_mmlu_response",
        "metrics": "PairwiseRatings fit_bradley_terry mean_stderr pass_at_k",
        "runner": "DEFAULT_SHOTS TASKS EvalOptions evaluate_generative_math "
        "evaluate_mmlu_generative evaluate_multiple_choice format_table run_eval",
        "scoring": "PerplexityResult conditional_perplexity perplexity rolling_windows "
        "score_continuations score_sequences",
        "tasks": "MathExample MultipleChoiceExample arc_prompt gsm8k_prompt hellaswag_prompt "
        "load_arc load_gsm8k load_hellaswag load_math load_mmlu math_prompt mmlu_prompt",
    }.items()
    for name in names.split()
}


__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
