"""The body of ``lmforge generate``: load a checkpoint, encode, sample, decode, print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from lmforge.generate.engine import generate
from lmforge.model import TransformerLM
from lmforge.utils.errors import LmforgeError


def _load_checkpoint(path: Path, device: str) -> tuple[TransformerLM, Any]:
    """Minimal loader for a checkpoint folder (``model.safetensors`` + ``config.toml``).

    Used only when ``lmforge.train.load_for_inference`` is not available in this checkout; it
    reads the same layout (a run folder is not resolved to its latest checkpoint here).
    """
    from safetensors import SafetensorsError
    from safetensors.torch import load_file

    from lmforge.config import RunConfig
    from lmforge.utils.config import load_config

    weights, config = path / "model.safetensors", path / "config.toml"
    for f in (weights, config):
        if not f.is_file():
            raise LmforgeError(f"checkpoint file not found: {f}")
    cfg = load_config(RunConfig, config).model
    model = TransformerLM(cfg, device=device)
    try:
        state = load_file(str(weights), device=str(device))
    except (SafetensorsError, OSError) as e:
        raise LmforgeError(f"cannot read {weights}: {e}") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise LmforgeError(f"{weights} does not match {config}: {first}") from None
    model.eval()
    tokenizer = None
    if (path / "tokenizer").is_dir():
        from lmforge.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(path / "tokenizer")
    return model, tokenizer


def load_model(path: str | Path, device: str) -> tuple[TransformerLM, Any]:
    """(model, tokenizer or None) via ``lmforge.train.load_for_inference`` when present."""
    path = Path(path)
    if not path.exists():
        raise LmforgeError(f"checkpoint folder not found: {path}")
    try:
        from lmforge.train import load_for_inference
    except ImportError:
        return _load_checkpoint(path, device)
    try:
        return load_for_inference(path, device)
    except LmforgeError as e:
        from lmforge.utils.corpus import run_folder_hint

        raise LmforgeError(f"{e}{run_folder_hint(path)}") from None


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise LmforgeError(f"--prompt-ids '{text}' must be space-separated integers") from None
    if not ids:
        raise LmforgeError("--prompt-ids needs at least one token id")
    return ids


def main(args: argparse.Namespace) -> int:
    """Run ``lmforge generate`` with parsed ``args``; returns the exit status."""
    from lmforge.utils.runtime import Runtime

    if not args.prompt and not args.prompt_ids:
        raise LmforgeError("give at least one --prompt TEXT or --prompt-ids IDS")
    if args.num_samples < 1:
        raise LmforgeError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 0:
        raise LmforgeError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise LmforgeError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1:
        raise LmforgeError(f"--top-k must be >= 1, got {args.top_k}")
    runtime = Runtime.from_env(device=args.device, seed=args.seed)
    model, tokenizer = load_model(args.checkpoint, runtime.device)
    vocab = model.config.vocab_size

    prompts: list[list[int]] = []
    labels: list[str] = []
    for text in args.prompt:
        if tokenizer is None:
            raise LmforgeError(
                f"checkpoint {args.checkpoint} has no tokenizer/ folder; use --prompt-ids"
            )
        ids = tokenizer.encode(text)
        if not ids:
            raise LmforgeError("--prompt encodes to no tokens; give a non-empty prompt")
        prompts.append(ids)
        labels.append(text)
    for text in args.prompt_ids:
        ids = _parse_ids(text)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise LmforgeError(f"--prompt-ids: id {bad[0]} outside the vocabulary [0, {vocab})")
        prompts.append(ids)
        labels.append(text)

    stops = set(args.stop_id)
    eot = getattr(tokenizer, "eot_id", None)
    if eot is not None:
        stops.add(int(eot))
    batch = [p for p in prompts for _ in range(args.num_samples)]
    torch.manual_seed(args.seed)
    outs = generate(
        model,
        batch,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_tokens=stops,
        seed=args.seed,
        vocab_limit=getattr(tokenizer, "vocab_size", None),
    )
    for i, new in enumerate(outs):
        prompt_i, sample_i = divmod(i, args.num_samples)
        if args.num_samples > 1 or len(prompts) > 1:
            print(f"--- prompt {prompt_i + 1}, sample {sample_i + 1} ---")
        if tokenizer is not None and prompt_i < len(args.prompt):
            print(labels[prompt_i] + tokenizer.decode(new))
        else:
            print(" ".join(str(t) for t in batch[i] + new))
    sys.stdout.flush()
    return 0
