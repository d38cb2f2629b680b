"""Quantized checkpoints: an lmforge checkpoint folder whose quantized linears hold codes and scales.

Layout (written atomically: staged beside the target, fsynced, renamed in one step)::

    model.safetensors     the model's state dict. A quantized linear ``NAME`` has, instead of
                          ``NAME.weight``:
                            int8  NAME.qweight int8 (N, K), NAME.scales fp16 (N, K/G)
                            int4  NAME.qweight uint8 (N, K/2) (two codes per byte, per-group
                                  half split), NAME.scales fp16 (N, K/G),
                                  NAME.offsets fp16 (N, K/G) unless symmetric
                            fp8   NAME.qweight float8_e4m3fn (N, K), NAME.scales fp32 (N,) or (1,)
                          and, when AWQ/SmoothQuant kept a scale, NAME.input_scale fp32 (K,).
                          Everything else (embeddings, norms, an unquantized LM head) as in any
                          lmforge checkpoint. :mod:`lmforge.quant.formats` gives the math.
    quantization.json     {"version": 1, "method", "spec": {...}, "modules": {NAME: {"format",
                          "group_size", "symmetric", "per_channel", "activations"}}, "source"}
    config.toml           the [model] table (the unquantized architecture)
    meta.json             lmforge checkpoint metadata (written last)
    tokenizer/ | hf_tokenizer/, chat_template.jinja   as ``lmforge hf import`` writes them

:func:`load_quantized` rebuilds the model on the meta device, swaps in empty modules of the
recorded formats and assigns the stored tensors (no float copy of the weights is ever made).
Exercised by ``pytest tests/test_quant_checkpoint.py`` and ``lmforge quantize``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.quant.apply import QuantSpec, replace_linears
from lmforge.quant.formats import Fp8Linear, Int4Linear, Int8Linear, QuantLinear
from lmforge.utils.errors import LmforgeError

__all__ = ["QUANT_FILE", "is_quantized_checkpoint", "load_quantized", "save_quantized"]

QUANT_FILE = "quantization.json"
_VERSION = 1


def _describe(m: QuantLinear) -> dict[str, Any]:
    if isinstance(m, Int4Linear):
        return {"format": "int4", "group_size": m.group_size, "symmetric": m.symmetric}
    if isinstance(m, Int8Linear):
        return {"format": "int8", "group_size": m.group_size}
    assert isinstance(m, Fp8Linear)
    return {"format": "fp8", "per_channel": m.per_channel, "activations": m.activations}


def _build(desc: dict[str, Any], d_in: int, d_out: int) -> QuantLinear:
    fmt = desc.get("format")
    if fmt == "int4":
        return Int4Linear(d_in, d_out, int(desc["group_size"]), bool(desc["symmetric"]))
    if fmt == "int8":
        return Int8Linear(d_in, d_out, int(desc["group_size"]))
    if fmt == "fp8":
        return Fp8Linear(d_in, d_out, bool(desc["per_channel"]), str(desc["activations"]))
    raise LmforgeError(f"unknown quantized format {fmt!r} in {QUANT_FILE}")


def save_quantized(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    method: str,
    spec: QuantSpec,
    source: str,
    chat_template: str | None = None,
) -> Path:
    """Write the quantized ``model`` (+ tokenizer, chat template) as one folder, atomically."""
    from lmforge.checkpoint import save_checkpoint
    from lmforge.config import RunConfig
    from lmforge.hf.api import HF_TOKENIZER_DIR
    from lmforge.hf.tokenizer import HFTokenizer
    from lmforge.quant.formats import QuantEmbedding

    if any(isinstance(m, QuantEmbedding) for m in model.modules()):
        raise LmforgeError(
            "a model with a quantized embedding (a GGUF import) is not saved as a checkpoint: "
            "serve the GGUF file directly, or quantize its dequantized import (--gguf)"
        )
    modules = {n: _describe(m) for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    info = {
        "version": _VERSION,
        "method": method,
        "spec": dataclasses.asdict(spec),
        "modules": modules,
        "source": source,
    }
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        extra = Path(tmp) / "extra"
        extra.mkdir()
        (extra / QUANT_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if chat_template:
            (extra / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        tok_dir = None
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.save(extra / HF_TOKENIZER_DIR)
        elif tokenizer is not None:
            tok_dir = Path(tmp) / "tokenizer"
            tokenizer.save(tok_dir)
        save_checkpoint(
            out,
            model,
            None,
            0,
            config=RunConfig(model=model.config),
            tokenizer_dir=tok_dir,
            meta={"source": "quantize", "method": method, "from": source},
            extra_dir=extra,
        )
    return out


def is_quantized_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder written by :func:`save_quantized`."""
    return (Path(path) / QUANT_FILE).is_file()


def load_quantized(path: str | os.PathLike, device: str = "cpu") -> tuple[nn.Module, Any]:
    """``(model, tokenizer or None)`` from a quantized checkpoint folder (eval mode)."""
    from lmforge.checkpoint import load_model_state
    from lmforge.hf.api import HF_TOKENIZER_DIR
    from lmforge.hf.tokenizer import HFTokenizer
    from lmforge.model import ModelConfig, RotaryEmbedding, TransformerLM
    from lmforge.utils.config import from_dict

    d = Path(path)
    qfile, cfile, wfile = d / QUANT_FILE, d / "config.toml", d / "model.safetensors"
    for f in (qfile, cfile, wfile):
        if not f.is_file():
            raise LmforgeError(f"{d} is not a quantized checkpoint: {f.name} is missing")
    try:
        info = json.loads(qfile.read_text(encoding="utf-8"))
        modules = info["modules"]
        cfg = from_dict(
            ModelConfig, tomllib.loads(cfile.read_text(encoding="utf-8"))["model"], prefix="model"
        )
    except (
        json.JSONDecodeError,
        KeyError,
        TypeError,
        tomllib.TOMLDecodeError,
        UnicodeDecodeError,
    ) as e:
        raise LmforgeError(f"{d}: unreadable {QUANT_FILE} or config.toml ({e})") from None
    state = load_model_state(wfile)
    model = TransformerLM(cfg, device="meta")
    new = {}
    for name, desc in modules.items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise LmforgeError(f"{qfile}: the model has no module {name!r}") from None
        d_out, d_in = old.weight.shape
        q = _build(desc, d_in, d_out)
        if f"{name}.input_scale" in state:
            q.input_scale = torch.empty(d_in)
        new[name] = q.to("meta")
    replace_linears(model, new)
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise LmforgeError(
            f"{wfile} does not match {QUANT_FILE} / config.toml ({detail})"
        ) from None
    if cfg.tie_embeddings and "lm_head" not in modules:
        model.tie_weights()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):  # non-persistent tables: build them for real
            module.cos = torch.empty_like(module.cos, device="cpu")
            module.sin = torch.empty_like(module.sin, device="cpu")
            module.reset_parameters()
    model.to(device).eval()
    tokenizer = None
    if (d / "tokenizer").is_dir():
        from lmforge.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(d / "tokenizer")
    elif (d / HF_TOKENIZER_DIR / "tokenizer.json").is_file():
        tokenizer = HFTokenizer(d / HF_TOKENIZER_DIR)
    return model, tokenizer


def load_source(
    *, checkpoint: str | None, gguf: str | None, hf: str | None, context_length: int | None
) -> tuple[nn.Module, Any, str | None, str]:
    """``(fp model, tokenizer, chat template, source name)`` from exactly one source."""
    if sum(x is not None for x in (checkpoint, gguf, hf)) != 1:
        raise LmforgeError("give exactly one of --checkpoint, --gguf, --hf")
    if gguf is not None:
        from lmforge.hf.gguf import import_gguf

        model, tok, template = import_gguf(gguf, context_length=context_length)
        return model, tok, template, gguf
    if hf is not None:
        from lmforge.hf import import_model

        model, tok = import_model(hf, context_length=context_length)
        return model, tok, _template(Path(hf)), hf
    from lmforge.hf import load_pretrained

    assert checkpoint is not None
    model, tok = load_pretrained(checkpoint, "cpu")
    return model, tok, _template(Path(checkpoint)), checkpoint


def _template(folder: Path) -> str | None:
    """A chat template stored with a model (chat_template.jinja or tokenizer_config.json)."""
    for d in (folder, folder / "hf_tokenizer", folder / "tokenizer"):
        if (d / "chat_template.jinja").is_file():
            return (d / "chat_template.jinja").read_text(encoding="utf-8")
        cfg = d / "tokenizer_config.json"
        if cfg.is_file():
            try:
                tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                tpl = None
            if isinstance(tpl, str):
                return tpl
    return None
