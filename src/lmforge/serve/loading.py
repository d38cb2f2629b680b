"""Loading a model to serve: an lmforge checkpoint, an HF folder or a GGUF file, with its
tokenizer, chat template and a display name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lmforge.utils.errors import LmforgeError

__all__ = ["find_chat_template", "load_for_serving"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IMPORT_CONTEXT = 4096  # imports default to this much context (RoPE tables are kept per layer)


def find_chat_template(folder: Path) -> str | None:
    """A chat template stored with a model: ``chat_template.jinja`` or ``tokenizer_config.json``
    (in the folder, its ``hf_tokenizer/`` or ``tokenizer/``)."""
    for d in (folder, folder / "hf_tokenizer", folder / "tokenizer"):
        jinja = d / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        cfg = d / "tokenizer_config.json"
        if cfg.is_file():
            try:
                tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
            except (json.JSONDecodeError, UnicodeDecodeError):
                tpl = None
            if isinstance(tpl, str):
                return tpl
    return None


def load_for_serving(
    *,
    checkpoint: str | None = None,
    hf: str | None = None,
    gguf: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    context_length: int | None = None,
) -> tuple[Any, Any, str | None, str]:
    """``(model, tokenizer, chat template or None, name)`` from exactly one source."""
    if sum(x is not None for x in (checkpoint, hf, gguf)) != 1:
        raise LmforgeError("give exactly one of --checkpoint, --hf, --gguf")
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise LmforgeError("--device cuda, but no CUDA GPU is available")
    if context_length is not None and context_length < 2:
        raise LmforgeError(f"--context-length must be at least 2, got {context_length}")
    template = None
    if gguf is not None:
        from lmforge.hf.gguf import import_gguf

        model, tokenizer, template = import_gguf(
            gguf, context_length=context_length or _IMPORT_CONTEXT
        )
        name = Path(gguf).stem
    elif hf is not None:
        from lmforge.hf import import_model

        model, tokenizer = import_model(hf, context_length=context_length or _IMPORT_CONTEXT)
        template = find_chat_template(Path(hf))
        name = Path(hf).name
    else:
        from lmforge.hf import load_pretrained

        assert checkpoint is not None
        model, tokenizer = load_pretrained(checkpoint, "cpu")
        template = find_chat_template(Path(checkpoint))
        name = Path(checkpoint).resolve().name
        if context_length is not None and context_length != model.config.context_length:
            raise LmforgeError(
                "--context-length applies to imports; a checkpoint serves its own "
                f"({model.config.context_length})"
            )
    want = (
        _DTYPES.get(dtype)
        if dtype != "auto"
        else (torch.bfloat16 if dev.startswith("cuda") else torch.float32)
    )
    model = model.to(device=dev, dtype=want).eval()
    return model, tokenizer, template, name
