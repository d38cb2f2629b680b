"""lm-evaluation-harness adapter: ``lm_eval --model lmforge --model_args checkpoint=DIR``.

:class:`LmforgeLM` implements the harness's ``LM`` interface (``loglikelihood``,
``loglikelihood_rolling``, ``generate_until``) on top of :mod:`lmforge.eval.scoring` and
the serving engine (:func:`lmforge.eval.runner.generate_texts`), and is registered under the name ``lmforge`` when this module
is imported. lm-eval 0.4 finds models only in its own registry (it does not scan entry points),
so this module must be imported before the harness runs; ``python -m lmforge.eval.harness`` does
exactly that and then hands the command line to lm-eval::

    python -m lmforge.eval.harness --model lmforge --model_args checkpoint=runs/demo \\
        --device cuda --tasks hellaswag,arc_easy --batch_size 16

(``--device`` goes to the harness, not into ``--model_args``: the harness passes it on itself.)

From Python: ``import lmforge.eval.harness`` then ``lm_eval.simple_evaluate(model="lmforge", ...)``,
or pass ``LmforgeLM(model=m, tokenizer=tok)`` as the model object. Needs ``pip install lm-eval``.
Exercised by ``pytest tests/test_eval_harness.py``.
"""

from __future__ import annotations

import math
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from lmforge.eval.scoring import (
    _document_items,
    encode_pair,
    score_continuations,
    score_sequences,
)

__all__ = ["LmforgeLM", "main"]


@register_model("lmforge")
class LmforgeLM(LM):
    """An lmforge model as an lm-evaluation-harness ``LM``.

    Construct from ``checkpoint`` (an lmforge checkpoint/run folder or an HF Llama/Qwen3 folder,
    loaded by :func:`lmforge.serve.loading.load_for_serving`) or from an in-memory ``model`` and
    ``tokenizer``.
    Simplification: one process (no data-parallel ranks); ``batch_size="auto"`` means 8.
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        device: str | None = "cpu",
        batch_size: int | str | None = 8,
        max_gen_toks: int = 256,
        model: Any = None,
        tokenizer: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise ValueError("LmforgeLM needs checkpoint=DIR (or model= and tokenizer=)")
            from lmforge.serve.loading import load_for_serving

            model, tokenizer, _, _ = load_for_serving(
                checkpoint=checkpoint, device=device or "cpu", dtype="float32"
            )
        if tokenizer is None:
            raise ValueError("LmforgeLM needs a tokenizer (the checkpoint has none)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        try:
            self.batch_size = int(batch_size)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            self.batch_size = 8
        self.max_gen_toks = int(max_gen_toks)
        self._device = next(model.parameters()).device
        self.checkpoint = checkpoint

    def get_model_info(self) -> dict[str, Any]:
        """What the harness records about the model in its results ``config``."""
        return {
            "model_num_parameters": int(self.model.num_parameters()),
            "model_checkpoint": str(self.checkpoint or "<in memory>"),
            "model_context_length": self.max_length,
        }

    @property
    def max_length(self) -> int:
        """The model's context length."""
        return int(self.model.config.context_length)

    @property
    def eot_token_id(self) -> int | None:
        """The tokenizer's end-of-text id."""
        return self.tokenizer.eot_id

    def tok_encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return self.tokenizer.encode(text)

    def tok_decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode(ids)

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per ``(context, continuation)``."""
        pairs = [encode_pair(self.tokenizer, *req.args) for req in requests]
        # An empty continuation scores 0 (the harness never sends one, but guard anyway).
        scored = iter(
            score_continuations(self.model, [p for p in pairs if p[1]], batch_size=self.batch_size)
        )
        return [next(scored) if cont else (0.0, True) for _, cont in pairs]

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """Log-likelihood of each whole string, every token scored once (after the EOT prefix)."""
        per_doc: list[list[tuple[list[int], int]]] = []
        prefix = [] if self.eot_token_id is None else [self.eot_token_id]
        for req in requests:
            (text,) = req.args[:1]
            s = [*prefix, *self.tok_encode(text)]
            per_doc.append(_document_items(s, self.max_length, None) if len(s) > 1 else [])
        flat = [item for items in per_doc for item in items]
        scored = iter(score_sequences(self.model, flat, batch_size=self.batch_size))
        return [math.fsum(x for _ in items for x in next(scored)[0]) for items in per_doc]

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Greedy (or sampled, with ``do_sample`` and ``temperature``) text cut at ``until``.

        Every request decodes at once on the serving engine
        (:func:`lmforge.eval.runner.generate_texts`, one call per generation setting); the
        end-of-text id always stops.
        """
        from lmforge.eval.runner import generate_texts, make_engine

        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            _, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
            temperature = float(kwargs["temperature"]) if sample else 0.0
            groups.setdefault((max_new, temperature, until), []).append(i)
        outs = [""] * len(requests)
        engine = make_engine(self.model, self.tokenizer)
        for (max_new, temperature, until), idx in groups.items():
            texts = generate_texts(
                self.model,
                self.tokenizer,
                [requests[i].args[0] for i in idx],
                max_new_tokens=max_new,
                temperature=temperature,
                stops=until,
                engine=engine,
            )
            for i, samples in zip(idx, texts, strict=True):
                outs[i] = samples[0]
        return outs


def main() -> None:
    """``python -m lmforge.eval.harness ARGS``: lm-eval's command line with ``lmforge`` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
