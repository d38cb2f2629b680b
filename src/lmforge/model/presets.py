"""Named model shapes: ``configs/NAME.toml`` files holding one ``[model]`` table."""

from __future__ import annotations

import os
from pathlib import Path

from lmforge.model.config import ModelConfig
from lmforge.utils.config import from_dict, read_toml
from lmforge.utils.errors import LmforgeError


def presets_dir() -> Path:
    """The repository's ``configs/`` folder (where the named presets live)."""
    return Path(__file__).resolve().parents[3] / "configs"


def load_preset(name_or_path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` in the ``[model]`` table of a preset name or a TOML path.

    ``"tiny"`` reads ``configs/tiny.toml`` at the repository root; anything ending in ``.toml``
    or naming an existing file is read as a path. A preset is also a valid run config.
    Exercised by ``pytest tests/test_model.py -k preset``.
    """
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".toml") or path.is_file()):
        path = presets_dir() / f"{text}.toml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in presets_dir().glob("*.toml")))
            raise LmforgeError(f"unknown model preset '{text}' (known: {known})")
    data = read_toml(path, "model preset")
    if "model" not in data:
        raise LmforgeError(f"model preset {path} has no [model] table")
    return from_dict(ModelConfig, data["model"], prefix="model")
