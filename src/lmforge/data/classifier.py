"""fastText document classifiers: training from labelled JSONL, scoring, threshold/Pareto filtering.

Quality (positives: a high-quality reference set you name; negatives: raw crawl), toxicity and
NSFW all use the same machinery. To plug in Dolma's Jigsaw models, download
``jigsaw_fasttext_bigrams_hatespeech_final.bin`` / ``jigsaw_fasttext_bigrams_nsfw_final.bin``
yourself and name one in a ``classifier`` step: ``model = "…nsfw_final.bin"``,
``label = "non-nsfw"`` (their labels are ``hate``/``non-hate`` and ``nsfw``/``non-nsfw``),
``threshold = 0.5``.

Exercised by ``lmforge data train-classifier`` and ``tests/test_data_pipeline.py``.
"""

from __future__ import annotations

import functools
import json
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmforge.data.core import Document, Filter
from lmforge.data.readers import read_documents


def _clean(text: str) -> str:
    # fastText reads one example per line.
    return " ".join(text.split())


def write_fasttext_training_file(
    path: str | os.PathLike,
    labelled: Sequence[tuple[str, str]],
) -> int:
    """Write ``(label, text)`` pairs as fastText ``__label__X text`` lines; returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for label, text in labelled:
            t = _clean(text)
            if t:
                f.write(f"__label__{label} {t}\n")
                n += 1
    return n


def labelled_from_jsonl(
    paths: Sequence[str | os.PathLike], label_key: str = "label", text_key: str = "text"
) -> list[tuple[str, str]]:
    """(label, text) pairs from JSONL records that carry both keys; others are skipped."""
    out = []
    for p in paths:
        for doc in read_documents(p, "jsonl", text_key=text_key):
            label = doc.metadata.get(label_key)
            if label is not None:
                out.append((str(label), doc.text))
    return out


def train_classifier(
    labelled: Sequence[tuple[str, str]],
    output_model: str | os.PathLike,
    *,
    epoch: int = 5,
    lr: float = 0.5,
    word_ngrams: int = 2,
    dim: int = 64,
    bucket: int = 200_000,
    valid_fraction: float = 0.1,
    seed: int = 0,
) -> dict[str, Any]:
    """Train a fastText supervised classifier on ``(label, text)`` pairs and save it.

    ``bucket`` hashed n-gram rows (fastText's default of 2M costs 0.5 GB at dim 64). A
    ``valid_fraction`` of the examples (shuffled with ``seed``) is held out; returns
    ``{"train": n, "valid": n, "precision@1": p}`` (p on the held-out part, NaN if none).
    """
    import fasttext

    if len({lab for lab, _ in labelled}) < 2:
        raise ValueError("a classifier needs examples of at least two labels")
    rows = list(labelled)
    random.Random(seed).shuffle(rows)
    n_valid = int(len(rows) * valid_fraction)
    valid, train = rows[:n_valid], rows[n_valid:]
    with tempfile.TemporaryDirectory() as tmp:
        tr = Path(tmp) / "train.txt"
        n_train = write_fasttext_training_file(tr, train)
        model = fasttext.train_supervised(
            str(tr),
            epoch=epoch,
            lr=lr,
            wordNgrams=word_ngrams,
            dim=dim,
            verbose=0,
            seed=seed,
            thread=1,
        )
        precision = float("nan")
        if valid:
            va = Path(tmp) / "valid.txt"
            n_va = write_fasttext_training_file(va, valid)
            if n_va:
                _, precision, _ = model.test(str(va))
    Path(output_model).parent.mkdir(parents=True, exist_ok=True)
    model.save_model(str(output_model))
    return {"train": n_train, "valid": len(valid), "precision@1": precision}


@functools.cache
def load_classifier(model_path: str) -> Any:
    """The fastText model at ``model_path`` (cached per process)."""
    import fasttext

    fasttext.FastText.eprint = lambda *a, **k: None
    if not Path(model_path).is_file():
        raise FileNotFoundError(f"classifier model not found: {model_path}")
    return fasttext.load_model(model_path)


def classify(text: str, model_path: str) -> tuple[str, float]:
    """(most likely label, its probability) for ``text`` under the fastText model."""
    labels, probs = load_classifier(str(model_path)).predict(_clean(text), k=1)
    return labels[0].removeprefix("__label__"), float(min(1.0, probs[0]))


def label_probability(text: str, model_path: str, label: str) -> float:
    """Probability the model gives ``label`` for ``text`` (0 when absent from its top labels)."""
    labels, probs = load_classifier(str(model_path)).predict(_clean(text), k=-1)
    for lab, p in zip(labels, probs):
        if lab.removeprefix("__label__") == label:
            return float(min(1.0, p))
    return 0.0


def pareto_keep(score: float, key: str, alpha: float = 9.0, seed: int = 0) -> bool:
    """GPT-3's sampling rule: keep when a Pareto(alpha) draw exceeds 1 − score.

    The draw is seeded by ``key`` (the document id) so reruns keep the same documents.
    """
    import numpy as np
    import xxhash

    rng = np.random.default_rng(xxhash.xxh64_intdigest(key.encode(), seed=seed))
    return bool(rng.pareto(alpha) > 1.0 - score)


def labelled_from_sources(
    positives: Sequence[str | os.PathLike],
    negatives: Sequence[str | os.PathLike],
    positive_label: str = "hq",
    negative_label: str = "cc",
    text_key: str = "text",
) -> list[tuple[str, str]]:
    """(label, text) pairs from two sets of files of any readable format (balanced by truncation)."""
    pos = [d.text for p in positives for d in read_documents(p, text_key=text_key) if d.text]
    neg = [d.text for p in negatives for d in read_documents(p, text_key=text_key) if d.text]
    n = min(len(pos), len(neg))
    return [(positive_label, t) for t in pos[:n]] + [(negative_label, t) for t in neg[:n]]


def dump_labelled(path: str | os.PathLike, labelled: Sequence[tuple[str, str]]) -> None:
    """Write ``(label, text)`` pairs as JSONL records ``{"label", "text"}``."""
    with open(path, "w", encoding="utf-8") as f:
        for label, text in labelled:
            f.write(json.dumps({"label": label, "text": text}, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- pipeline step


@dataclass(frozen=True)
class ClassifierOptions:
    """``classifier``: score with a fastText model; keep by threshold or Pareto sampling."""

    model: str
    "path of a fastText .bin/.ftz model"
    label: str
    "the label whose probability is the keep score (e.g. hq, non-nsfw)"
    threshold: float = 0.5
    "keep when the score is at least this (mode threshold)"
    mode: Literal["threshold", "pareto"] = "threshold"
    "threshold, or GPT-3 Pareto sampling (keep when pareto(alpha) > 1 - score)"
    pareto_alpha: float = 9.0
    "shape of the Pareto draw"
    seed: int = 0
    "seed of the per-document Pareto draw"


class ClassifierFilter(Filter):
    """Keep by a fastText label probability: threshold or GPT-3 Pareto sampling."""

    name = "classifier"

    def __init__(self, opts: ClassifierOptions, **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        score = label_probability(doc.text, self.opts.model, self.opts.label)
        doc.metadata[f"score_{self.opts.label}"] = round(score, 4)
        if self.opts.mode == "pareto":
            keep = pareto_keep(score, doc.id, self.opts.pareto_alpha, self.opts.seed)
            return True if keep else (False, "classifier_pareto")
        return True if score >= self.opts.threshold else (False, "classifier_below_threshold")
