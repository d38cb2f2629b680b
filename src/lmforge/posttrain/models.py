"""Loading and saving the models post-training works on.

``load_model(spec)``: an lmforge checkpoint or run folder (``lmforge.train.load_for_inference``),
a GGUF file (transformers' GGUF loader, dequantised to float32, with its tokenizer and chat
template), or a transformers folder (``config.json``). ``save_model`` writes an lmforge
checkpoint folder (``config.toml`` + ``model.safetensors``, loadable by ``load_for_inference``)
or a transformers ``save_pretrained`` folder, into a temporary folder renamed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.core import is_lmforge_model
from lmforge.utils.errors import LmforgeError


def load_model(spec: str | os.PathLike, device: str = "cpu") -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` from an lmforge checkpoint, a ``.gguf`` file or a transformers folder."""
    p = Path(spec)
    if not p.exists():
        raise LmforgeError(f"model not found: {p}")
    if p.suffix == ".gguf":
        return _load_gguf(p, device)
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
    from lmforge.train import load_for_inference

    return load_for_inference(p, device)


def _load_gguf(p: Path, device: str) -> tuple[nn.Module, Any]:
    """A GGUF file as a float32 transformers model and tokenizer.

    ``from_pretrained(gguf_file=...)`` needs ``accelerate`` (not a dependency here), so the
    model is built from the GGUF's config and filled by transformers' own GGUF tensor reader
    (dequantised), which is what ``from_pretrained`` does underneath.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        parsed = load_gguf_checkpoint(str(p), return_tensors=True, model_to_load=model)
        missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
        model.tie_weights()
        tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"GGUF tensors do not match: missing {missing}, unexpected {unexpected}"
            )
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise LmforgeError(f"cannot load GGUF {p}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval(), tok


def save_model(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """Write ``model`` (and its tokenizer when it can be saved) to ``out_dir`` atomically."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if is_lmforge_model(model):
            from lmforge.train.checkpoint import save_model_state
            from lmforge.utils.config import config_to_toml
            from lmforge.utils.io import atomic_write_text

            save_model_state(tmp / "model.safetensors", model.state_dict())
            atomic_write_text(tmp / "config.toml", "[model]\n" + config_to_toml(model.config))
            if tokenizer is not None and hasattr(tokenizer, "save"):
                tokenizer.save(tmp / "tokenizer")
        else:
            model.save_pretrained(str(tmp))
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def eos_ids(tokenizer: Any) -> list[int]:
    """End-of-sequence ids of a tokenizer (either family), possibly empty."""
    for attr in ("eos_id", "eos_token_id"):
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
