"""Carry a recipe's run folder between machines in pieces: ``lmforge recipe pack`` writes what the
stages still to run need as a gzipped tar cut into parts of at most ``part_mb`` MB (a device
call brings back files of at most 16 MiB), with a manifest of their SHA-256; ``lmforge recipe
unpack`` checks and extracts them into a run folder on the other machine.

What a pack holds, for the stage ``next_stage`` that runs next:

* every stage's completion/attempt markers and its small files (metrics, summaries, curves,
  the eval reports and the eval cache ``evals/``), so finished stages are skipped there;
* the tokenizer, and the token shards when pretraining is still to run;
* each model a later stage reads (pretrain's latest checkpoint for SFT, the SFT model for RL,
  every model whose eval row is not cached yet): its files without the optimizer state, the
  weights cast to ``weights_dtype`` (bfloat16 by default: half the bytes; the trainers compute
  in bf16 on the GPU, and a model loads its weights into its own dtype);
* nothing of ``data/`` but its markers (the mixture is only read by the tokenizer stage).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from lmforge.recipe.config import STAGES, RecipeConfig, stage_index
from lmforge.recipe.markers import ATTEMPT, DONE
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_bytes, atomic_write_text

MANIFEST = "recipe-pack.json"
_SMALL = 1 << 20  # files up to 1 MiB travel whatever they are (metrics, summaries, curves)
_DTYPES = ("bfloat16", "float16", "float32", "keep")


def needed_models(cfg: RecipeConfig, out: Path, next_stage: str) -> list[Path]:
    """Checkpoint folders the stages from ``next_stage`` on read and that exist now."""
    from lmforge.checkpoint import latest_checkpoint
    from lmforge.recipe.stages import eval_cache_path, eval_targets

    first = stage_index(next_stage, "--next")
    wanted: list[Path] = []
    if first <= STAGES.index("sft") and cfg.sft.enabled:
        latest = latest_checkpoint(out / "train")
        if latest is not None:
            wanted.append(latest)
    if first <= STAGES.index("rl") and cfg.rl.enabled and cfg.sft.enabled:
        wanted.append(out / "sft" / "model")
    if first <= STAGES.index("eval"):
        for name, path in eval_targets(cfg, out):
            if path.endswith(".gguf") or not Path(path).exists():
                continue
            try:
                cached = eval_cache_path(cfg, out, name, path).is_file()
            except LmforgeError:
                cached = False
            if not cached:
                p = Path(path)
                wanted.append(p if (p / "model.safetensors").is_file() else
                              latest_checkpoint(p) or p)  # fmt: skip
    seen: list[Path] = []
    for p in wanted:
        if p.is_dir() and p not in seen:
            seen.append(p)
    return seen


def _members(cfg: RecipeConfig, out: Path, next_stage: str) -> tuple[list[Path], list[Path]]:
    """(plain files, checkpoint folders) of the pack, relative to ``out``."""
    first = stage_index(next_stage, "--next")
    models = [m.relative_to(out) for m in needed_models(cfg, out, next_stage)]
    files: list[Path] = []
    for f in sorted(q for q in out.rglob("*") if q.is_file()):
        rel = f.relative_to(out)
        top = rel.parts[0]
        if top == "previous":
            continue  # outputs of earlier settings stay on this machine
        if f.name in (DONE, ATTEMPT) and len(rel.parts) == 2:  # a stage's own markers
            files.append(rel)
        elif top == "data" or f.name == ".recipe-lock":
            continue
        elif any(rel.is_relative_to(m) for m in models):
            continue  # packed below, without optimizer state
        elif (
            top == "tokens" and first <= STAGES.index("pretrain") and f.suffix in (".bin", ".json")
        ):
            files.append(rel)
        elif top == "tokenizer":
            files.append(rel)
        elif top == "evals" and "anchors" in rel.parts:
            continue  # an imported GGUF anchor (large; its row is what travels)
        elif f.stat().st_size <= _SMALL and "checkpoints" not in rel.parts:
            files.append(rel)
    return files, models


def _model_weights(path: Path, dtype: str) -> bytes:
    """``model.safetensors`` at ``path`` with its floating tensors cast to ``dtype``."""
    import torch

    from lmforge.checkpoint import load_model_state, save_model_state

    state = load_model_state(path)
    target = getattr(torch, dtype)
    state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    with tempfile.TemporaryDirectory() as tmp:
        save_model_state(Path(tmp) / "model.safetensors", state)
        return (Path(tmp) / "model.safetensors").read_bytes()


def pack(
    cfg: RecipeConfig,
    dest: str | Path,
    next_stage: str,
    *,
    part_mb: float = 15.0,
    weights_dtype: str = "bfloat16",
) -> dict[str, Any]:
    """Write the pack of ``cfg.recipe.out`` for the stages from ``next_stage`` into folder
    ``dest`` (parts ``recipe-pack.tar.gz.NN`` and ``recipe-pack.json``); returns the manifest."""
    out = Path(cfg.recipe.out)
    if not out.is_dir():
        raise LmforgeError(f"recipe folder {out} not found: nothing to pack")
    if weights_dtype not in _DTYPES:
        raise LmforgeError(f"--weights-dtype: expected one of {', '.join(_DTYPES)}")
    if part_mb <= 0:
        raise LmforgeError(f"--part-mb must be > 0, got {part_mb}")
    files, models = _members(cfg, out, next_stage)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for rel in files:
            tar.add(out / rel, arcname=rel.as_posix(), recursive=False)
        for m in models:
            for f in sorted(q for q in (out / m).rglob("*") if q.is_file()):
                rel = f.relative_to(out)
                if f.name == "optimizer.safetensors":
                    continue
                if f.name == "model.safetensors" and weights_dtype != "keep":
                    data = _model_weights(f, weights_dtype)
                    info = tarfile.TarInfo(rel.as_posix())
                    info.size, info.mtime = len(data), int(f.stat().st_mtime)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.add(f, arcname=rel.as_posix(), recursive=False)
    blob = buf.getvalue()
    size = max(1, int(part_mb * 1e6))
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("recipe-pack.tar.gz.*"):
        old.unlink()
    parts = []
    for i in range(0, len(blob), size):
        name = f"recipe-pack.tar.gz.{i // size:02d}"
        chunk = blob[i : i + size]
        atomic_write_bytes(dest / name, chunk)
        parts.append({"name": name, "bytes": len(chunk),
                      "sha256": hashlib.sha256(chunk).hexdigest()})  # fmt: skip
    manifest = {"next_stage": next_stage, "recipe_out": str(out), "weights_dtype": weights_dtype,
                "bytes": len(blob), "files": len(files),
                "models": [m.as_posix() for m in models], "parts": parts}  # fmt: skip
    atomic_write_text(dest / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def unpack(src: str | Path, into: str | Path) -> dict[str, Any]:
    """Check the parts in folder ``src`` against their manifest and extract them into the run
    folder ``into`` (created; files already there are replaced); returns the manifest."""
    src, into = Path(src), Path(into)
    try:
        manifest = json.loads((src / MANIFEST).read_text(encoding="utf-8"))
        parts = manifest["parts"]
    except (OSError, ValueError, KeyError, TypeError):
        raise LmforgeError(f"{src / MANIFEST} is missing or not a recipe pack manifest") from None
    chunks = []
    for p in parts:
        f = src / p["name"]
        if not f.is_file():
            raise LmforgeError(f"recipe pack part {f} is missing")
        data = f.read_bytes()
        if hashlib.sha256(data).hexdigest() != p["sha256"]:
            raise LmforgeError(f"recipe pack part {f} is corrupt (SHA-256 differs)")
        chunks.append(data)
    into.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(b"".join(chunks)), mode="r:gz") as tar:
            tar.extractall(into, filter="data")  # no absolute paths, links or '..' escapes
    except (tarfile.TarError, OSError, EOFError) as e:
        raise LmforgeError(f"cannot extract the recipe pack in {src}: {e}") from None
    return manifest
