"""``export_model`` / ``import_model``: lmforge models to and from Hugging Face folders.

An export folder holds ``config.json`` (LlamaForCausalLM, or Qwen3ForCausalLM when the model
uses QK-norm; DeepseekV3ForCausalLM for MLA, BambaForCausalLM for a Mamba-2/attention hybrid,
Qwen3NextForCausalLM for a Gated DeltaNet/attention one), ``model.safetensors`` (fp32) and, with
a tokenizer, ``tokenizer.json`` + ``tokenizer_config.json``;
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` then gives the same logits. An import
reads a Llama-, Qwen3-, DeepSeek-V3-, Bamba- or Qwen3-Next-family folder into a
:class:`~lmforge.model.TransformerLM` (fp32) and its tokenizer, ready for continued pretraining,
fine-tuning or RL. Exercised by ``pytest tests/test_hf_convert.py tests/test_hf_hybrid.py`` and
``lmforge hf``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lmforge.hf.convert import (
    _read_hf_config,
    hf_config_to_model_config,
    hf_to_lmforge_state,
    lmforge_to_hf_state,
    load_hf_state,
    model_state_for_export,
    write_hf_config,
)
from lmforge.hf.tokenizer import HFTokenizer, load_hf_tokenizer, save_tokenizer_for_hf
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_bytes

__all__ = ["export_model", "import_model", "load_pretrained", "save_as_checkpoint"]

HF_TOKENIZER_DIR = "hf_tokenizer"
"checkpoint sub-folder for a tokenizer kept in HF format (not convertible to lmforge's)"


def export_model(model: torch.nn.Module, out_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write ``model`` (and ``tokenizer``) as a Hugging Face folder (Llama/Qwen3, DeepSeek-V3,
    Bamba or Qwen3-Next, by the model's options); returns it.

    Weights are fp32; q/k projections are permuted from lmforge's interleaved RoPE layout to HF's
    half-split one (see :mod:`lmforge.hf.convert`). A model with ``logit_soft_cap`` has no HF
    equivalent and raises one line. Each file is written atomically.
    """
    from safetensors.torch import save as st_save

    cfg, state = model_state_for_export(model)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LmforgeError(f"export target {out} exists and is not a folder")
    hf_state = lmforge_to_hf_state(state, cfg)  # checks soft-cap etc. before writing anything
    eos = None if tokenizer is None else tokenizer.eot_id
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise LmforgeError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{cfg.vocab_size}"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_hf_config(out, cfg, eos)
    atomic_write_bytes(out / "model.safetensors", st_save(hf_state, metadata={"format": "pt"}))
    if tokenizer is not None:
        save_tokenizer_for_hf(tokenizer, out)
    return out


def _has_tokenizer_files(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (
        (d / "vocab.json").is_file() and (d / "merges.txt").is_file()
    )


def import_model(
    model_dir: str | os.PathLike,
    *,
    context_length: int | None = None,
    device: str = "cpu",
    attention: str = "sdpa",
) -> tuple[Any, Any]:
    """Load an HF Llama/Qwen3/DeepSeek-V3/Bamba/Qwen3-Next folder as ``(TransformerLM, tokenizer)``.

    The tokenizer is an lmforge ``Tokenizer`` when the folder's is GPT-2-style byte-level BPE,
    otherwise an :class:`~lmforge.hf.HFTokenizer` wrapper, and ``None`` when the folder has no
    tokenizer files. ``context_length`` overrides ``max_position_embeddings`` (lmforge keeps fp32
    RoPE tables of that length in every layer). Unsupported architectures or options and missing
    files raise one line naming them.
    """
    import dataclasses

    from lmforge.model import RotaryEmbedding, TransformerLM

    d = Path(model_dir)
    if not d.is_dir():
        raise LmforgeError(f"Hugging Face model folder not found: {d}")
    hf_cfg = _read_hf_config(d)
    cfg = hf_config_to_model_config(hf_cfg, str(d / "config.json"), context_length)
    cfg = dataclasses.replace(cfg, attention=attention)  # type: ignore[arg-type]
    hf_state = load_hf_state(d)
    if cfg.mtp_depth:  # MTP modules named in config.json but not saved: import without them
        from lmforge.hf.deepseek import mtp_depth_present

        cfg = dataclasses.replace(cfg, mtp_depth=mtp_depth_present(hf_state, cfg))
    interleave = bool(hf_cfg.get("rope_interleave", True))  # DeepSeek-V3's RoPE layout flag
    state = hf_to_lmforge_state(
        hf_state,
        cfg,
        source=str(d),
        rope_interleave=interleave,
        model_type=hf_cfg.get("model_type"),
    )
    tokenizer = load_hf_tokenizer(d) if _has_tokenizer_files(d) else None
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise LmforgeError(
            f"{d}: tokenizer has {tokenizer.vocab_size} ids but vocab_size is {cfg.vocab_size}"
        )
    # Built on the meta device and filled by assignment: no time spent on a random init.
    model = TransformerLM(cfg, device="meta")
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise LmforgeError(f"{d}: weights do not match config.json ({detail})") from None
    model.tie_weights()
    for module in model.modules():
        # RoPE tables are non-persistent buffers: build them on the real device.
        if isinstance(module, RotaryEmbedding):
            module.cos = torch.empty_like(module.cos, device="cpu")
            module.sin = torch.empty_like(module.sin, device="cpu")
            module.reset_parameters()
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        # A buffer this function does not know about: fall back to a normal (initialised) build.
        model = TransformerLM(cfg)
        model.load_state_dict(state)
    model.to(device).eval()
    return model, tokenizer


def save_as_checkpoint(model: Any, tokenizer: Any, out_dir: str | os.PathLike, source: str) -> Path:
    """Write ``model`` (+ tokenizer) as an lmforge checkpoint folder (``lmforge hf import``).

    The folder is what the trainer writes (model.safetensors, config.toml with ``[model]``,
    meta.json) so ``lmforge train``/``generate``/``eval`` accept it. An lmforge tokenizer goes to
    ``tokenizer/``; a wrapped HF tokenizer to ``hf_tokenizer/`` (read by :func:`load_pretrained`).
    """
    from lmforge.checkpoint import save_checkpoint
    from lmforge.config import RunConfig

    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = None
        if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
            tok_dir = Path(tmp) / "tokenizer"
            tokenizer.save(tok_dir)
        save_checkpoint(
            out,
            model,
            None,
            0,
            config=RunConfig(model=model.config),
            tokenizer_dir=tok_dir,
            meta={"source": "huggingface", "hf_model": str(source)},
        )
    if isinstance(tokenizer, HFTokenizer):
        staging = out / f".{HF_TOKENIZER_DIR}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        tokenizer.save(staging)
        os.replace(staging, out / HF_TOKENIZER_DIR)
    return out


def load_pretrained(path: str | os.PathLike, device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from an lmforge checkpoint or run folder, or an HF model folder.

    An lmforge folder loads with :func:`lmforge.checkpoint.load_for_inference`; its tokenizer comes
    from ``tokenizer/`` or, for imported models, ``hf_tokenizer/``. A folder with ``config.json``
    and no ``config.toml`` is imported from Hugging Face format on the fly.
    """
    from lmforge.checkpoint import load_for_inference

    p = Path(path)
    if not p.exists():
        raise LmforgeError(f"checkpoint not found: {p}")
    if (p / "config.json").is_file() and not (p / "config.toml").is_file():
        return import_model(p, device=device)
    model, tokenizer = load_for_inference(p, device)
    if tokenizer is None:
        for cand in (p / HF_TOKENIZER_DIR, *_checkpoint_dirs(p)):
            if (cand / "tokenizer.json").is_file():
                tokenizer = HFTokenizer(cand)
                break
    return model, tokenizer


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    from lmforge.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_dir) if (run_dir / "checkpoints").is_dir() else None
    return [] if latest is None else [latest / HF_TOKENIZER_DIR]
