"""Loading and saving the models post-training works on.

``load_model(spec)``: an lmforge checkpoint or run folder (:func:`lmforge.hf.load_pretrained`),
a GGUF file (:func:`lmforge.hf.gguf.import_gguf`: an lmforge ``TransformerLM`` dequantised to
float32 with the file's tokenizer and chat template), or a transformers folder (``config.json``
without ``config.toml``: kept as a transformers model and tokenizer). A chat template not held
by a transformers tokenizer travels as ``tokenizer.chat_template``. ``save_model`` writes an
lmforge checkpoint folder (loadable here and by ``lmforge serve``) or a transformers
``save_pretrained`` folder, atomically.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.core import is_lmforge_model
from lmforge.utils.errors import LmforgeError

GGUF_CONTEXT = 4096
"context length a GGUF import gets (RoPE tables are kept per layer; as ``lmforge serve``)"


def load_model(spec: str | os.PathLike, device: str = "cpu") -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` from an lmforge checkpoint, a ``.gguf`` file or a transformers folder."""
    from lmforge.posttrain.chat import attach_template

    p = Path(spec)
    if not p.exists():
        raise LmforgeError(f"model not found: {p}")
    if p.suffix == ".gguf":
        from lmforge.hf.gguf import import_gguf

        model, tok, template = import_gguf(p, context_length=GGUF_CONTEXT, device=device)
        return model, attach_template(tok, template)
    if (p / "config.json").is_file() and not (p / "config.toml").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(str(p))
        except (OSError, ValueError) as e:
            raise LmforgeError(
                f"cannot load transformers model {p}: {str(e).splitlines()[0]}"
            ) from None
        return model.to(device).eval(), tok
    from lmforge.hf import load_pretrained
    from lmforge.serve.loading import find_chat_template

    model, tok = load_pretrained(p, device)
    return model, attach_template(tok, find_chat_template(p))


def save_model(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """Write ``model`` (and its tokenizer and chat template when present) to ``out_dir`` atomically."""
    from lmforge.checkpoint.io import write_folder_atomically

    def fill(tmp: Path) -> None:
        if not is_lmforge_model(model):
            model.save_pretrained(str(tmp))
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(str(tmp))
            return
        from lmforge.checkpoint.io import save_model_state
        from lmforge.hf.api import HF_TOKENIZER_DIR
        from lmforge.hf.tokenizer import HFTokenizer
        from lmforge.posttrain.chat import template_of
        from lmforge.utils.config import config_to_toml

        save_model_state(tmp / "model.safetensors", model.state_dict())
        (tmp / "config.toml").write_text("[model]\n" + config_to_toml(model.config), "utf-8")
        if isinstance(tokenizer, HFTokenizer):
            # lmforge's Tokenizer.load cannot read tokenizer.json: load_pretrained looks here
            tokenizer.save(tmp / HF_TOKENIZER_DIR)
        elif tokenizer is not None and hasattr(tokenizer, "save"):
            tokenizer.save(tmp / "tokenizer")
        template = template_of(tokenizer)
        if template:
            (tmp / "chat_template.jinja").write_text(template, "utf-8")

    return write_folder_atomically(Path(out_dir), fill)


def eos_ids(tokenizer: Any) -> list[int]:
    """End-of-sequence ids of a tokenizer (either family), possibly empty."""
    for attr in ("eos_id", "eos_token_id", "eot_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return [v]
    return []


def clone_frozen(model: nn.Module) -> nn.Module:
    """A frozen copy (the reference / teacher policy)."""
    import copy

    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
