"""Checkpoints: safetensors tensors + JSON metadata in a folder written atomically.

Layout of one checkpoint folder (``out_dir/checkpoints/step_0001000/``)::

    model.safetensors      full fp32 model state, single-device parameter names; a tied weight
                           once, its aliases in the metadata ("tied": {"lm_head.weight": ...})
    optimizer.safetensors  optimizer state tensors flattened as "state.{param_index}.{name}";
                           param_groups and non-tensor state in the file's metadata (JSON)
    trainer_state.json     iteration, schedule, every data-parallel replica's sampler state
                           ("samplers": {dp_rank: PCG64 state}), the main process's RNG states
                           (torch/cuda/numpy/python as integer lists), loss-spike statistics
    config.toml            the resolved run config
    tokenizer/             copy of the run's tokenizer folder (when data.tokenizer is set)
    meta.json              {"format": "lmforge-checkpoint-v1", "iteration", "val_loss", ...};
                           written last, so its presence marks a complete checkpoint

Atomicity (:func:`write_folder_atomically`): a crash at any moment leaves the previous
checkpoints untouched; keep-last-K pruning runs only after the rename. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from lmforge.utils.config import config_to_toml, from_dict, read_toml
from lmforge.utils.errors import LmforgeError

if TYPE_CHECKING:
    from lmforge.model import TransformerLM

CHECKPOINT_FORMAT = "lmforge-checkpoint-v1"
_STEP_PREFIX = "step_"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


_TIED_PAIRS = (("lm_head.weight", "token_embeddings.weight"),)


def split_tied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop repeated tensors (tied weights) from a state dict: (unique tensors, alias → kept name).
    A repeat is the same storage or, for the LM head / embedding pair, an equal copy (the
    model's ``state_dict`` hands out the tied head as a copy)."""
    seen: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.dtype,
        )
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t
    for alias, source in _TIED_PAIRS:
        a, b = unique.get(alias), unique.get(source)
        if a is not None and b is not None and a.shape == b.shape and torch.equal(a, b):
            aliases[alias] = source
            del unique[alias]
    return unique, aliases


def save_model_state(path: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Write a model state dict to ``path`` (safetensors; tied weights once, aliases in metadata)."""
    unique, aliases = split_tied(state)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in unique.items()}
    save_file(
        tensors, str(path), metadata={"format": CHECKPOINT_FORMAT, "tied": json.dumps(aliases)}
    )


def _read_safetensors(
    path: str | Path, what: str
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    # (metadata, tensors) of a safetensors file; an unreadable one is one line naming ``what``.
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise LmforgeError(f"cannot read {what} {path}: {e}") from None


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict written by :func:`save_model_state` (tied aliases restored)."""
    meta, state = _read_safetensors(path, "model weights")
    for alias, source in json.loads(meta.get("tied", "{}")).items():
        state[alias] = state[source]
    return state


def save_optimizer_state(path: str | Path, optimizer: torch.optim.Optimizer | dict) -> None:
    """Write ``optimizer.state_dict()`` (or such a dict) flattened into one safetensors file."""
    state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for pid, st in state["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{k}"] = v.detach().to("cpu").contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    meta = {"param_groups": json.dumps(state["param_groups"]), "scalars": json.dumps(scalars)}
    save_file(tensors, str(path), metadata=meta)


def load_optimizer_state(path: str | Path, optimizer: torch.optim.Optimizer) -> None:
    """Load a file written by :func:`save_optimizer_state` into ``optimizer``."""
    meta, flat = _read_safetensors(path, "optimizer state")
    state: dict[int, dict[str, Any]] = {}
    for key, t in flat.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = t
    for key, v in json.loads(meta.get("scalars", "{}")).items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    groups = json.loads(meta["param_groups"])
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise LmforgeError(f"optimizer state {path} does not fit this model: {e}") from None


def write_folder_atomically(final: Path, fill: Callable[[Path], None]) -> Path:
    """Build a folder with ``fill(tmp)``, fsync it, then rename it to ``final`` in one step (an
    existing ``final`` is swapped out, then removed); a failure leaves ``final`` as it was."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        fill(tmp)
        for p in tmp.rglob("*"):
            if p.is_file():
                _fsync_path(p)
        _fsync_path(tmp)
        old = None
        if final.exists():
            # Same step saved twice (e.g. the final save right after a periodic one): swap.
            old = final.parent / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_path(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_checkpoint(
    path: str | Path,
    model: nn.Module | dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict | None,
    iteration: int,
    *,
    trainer_state: dict[str, Any] | None = None,
    config: Any = None,
    tokenizer_dir: str | Path | None = None,
    meta: dict[str, Any] | None = None,
    extra_dir: str | Path | None = None,
) -> Path:
    """Write a checkpoint folder at ``path`` atomically; return its path. ``model`` is a module
    or an already-gathered full state dict, ``optimizer`` an optimizer or its (gathered)
    ``state_dict()``. The files of ``extra_dir`` (per-rank optimizer shards staged by other
    ranks) are moved in before the rename. Exercised by ``pytest tests/test_checkpoint.py``."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    final = Path(path)

    def fill(tmp: Path) -> None:
        save_model_state(tmp / "model.safetensors", state)
        if optimizer is not None:
            save_optimizer_state(tmp / "optimizer.safetensors", optimizer)
        state_json = json.dumps({"iteration": int(iteration), **(trainer_state or {})})
        (tmp / "trainer_state.json").write_text(state_json, encoding="utf-8")
        if config is not None:
            (tmp / "config.toml").write_text(config_to_toml(config), encoding="utf-8")
        if extra_dir is not None:
            for f in sorted(Path(extra_dir).iterdir()):
                os.replace(f, tmp / f.name)
        if tokenizer_dir:
            src = Path(tokenizer_dir)
            if not src.is_dir():
                raise LmforgeError(f"data.tokenizer folder not found: {src}")
            shutil.copytree(src, tmp / "tokenizer")
        info = {"format": CHECKPOINT_FORMAT, "iteration": int(iteration), "created": time.time()}
        (tmp / "meta.json").write_text(json.dumps({**info, **(meta or {})}), encoding="utf-8")

    out = write_folder_atomically(final, fill)
    if extra_dir is not None:
        shutil.rmtree(extra_dir, ignore_errors=True)
    return out


def load_checkpoint(
    path: str | Path,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    load_model: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> int:
    """Restore model (and optimizer) from the checkpoint folder ``path``; return its iteration.
    ``load_model`` replaces ``model.load_state_dict`` (a strategy's ``load_full_state_dict``)."""
    p = Path(path)
    if not (p / "meta.json").is_file():
        raise LmforgeError(f"{p} is not a complete checkpoint (meta.json missing)")
    state = load_model_state(p / "model.safetensors")
    try:
        if load_model is not None:
            load_model(state)
        elif model is not None:
            model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0:2]
        raise LmforgeError(f"weights in {p} do not match the model: {' '.join(first)}") from None
    if optimizer is not None:
        if not (p / "optimizer.safetensors").is_file():
            raise LmforgeError(f"{p} has no optimizer.safetensors to resume from")
        load_optimizer_state(p / "optimizer.safetensors", optimizer)
    return int(read_trainer_state(p)["iteration"])


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint folder."""
    f = Path(path) / "trainer_state.json"
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LmforgeError(f"checkpoint file missing: {f}") from None
    except json.JSONDecodeError:
        raise LmforgeError(f"checkpoint file is corrupt (not JSON): {f}") from None


def checkpoint_path(run_dir: str | Path, iteration: int) -> Path:
    """``run_dir/checkpoints/step_{iteration:07d}``."""
    return Path(run_dir) / "checkpoints" / f"{_STEP_PREFIX}{iteration:07d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run folder, oldest first (temp folders are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        name = p.name
        if name.startswith(_STEP_PREFIX) and name[len(_STEP_PREFIX) :].isdigit():
            if (p / "meta.json").is_file():
                found.append((int(name[len(_STEP_PREFIX) :]), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run folder, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (and stale temp folders)."""
    removed = []
    ckpts = list_checkpoints(run_dir)
    if keep_last > 0:
        for p in ckpts[:-keep_last]:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    root = Path(run_dir) / "checkpoints"
    pid = os.getpid()
    for pattern in (".tmp-*", ".old-*", ".staging-*"):
        for p in root.glob(pattern) if root.is_dir() else ():
            if not p.name.endswith(f"-{pid}"):
                # Left by a process that died mid-save; the rename never happened.
                shutil.rmtree(p, ignore_errors=True)
    return removed


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder itself, or the latest checkpoint of a run folder."""
    p = Path(path)
    if (p / "model.safetensors").is_file() or (p / "meta.json").is_file():
        return p
    if (p / "checkpoints").is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise LmforgeError(f"run folder {p} has no complete checkpoint under checkpoints/")
        return latest
    raise LmforgeError(f"{p} is neither a checkpoint folder (model.safetensors) nor a run folder")


def load_for_inference(path: str | Path, device: str = "cpu") -> tuple[TransformerLM, Any]:
    """Load a model (eval mode, built from the checkpoint's ``config.toml``) and its tokenizer (or
    None) from a checkpoint or run folder; missing or corrupt files and a config/weights
    mismatch are one-line :class:`LmforgeError`. Exercised by ``lmforge generate``."""
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.utils.runtime import resolve_device

    ckpt = resolve_checkpoint(path)
    cfg_file = ckpt / "config.toml"
    if not cfg_file.is_file():
        raise LmforgeError(f"checkpoint {ckpt} has no config.toml")
    data = read_toml(cfg_file, "checkpoint config")
    if "model" not in data:
        raise LmforgeError(f"{cfg_file} has no [model] table")
    cfg = from_dict(ModelConfig, data["model"], prefix="model")
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise LmforgeError(f"checkpoint {ckpt} has no model.safetensors")
    state = load_model_state(weights)
    dev = resolve_device(device)
    model = TransformerLM(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = " ".join(str(e).strip().splitlines()[:2])
        raise LmforgeError(
            f"weights {weights} do not match [model] of {cfg_file}: {first}"
        ) from None
    model.to(dev).eval()
    tokenizer = None
    tok_dir = ckpt / "tokenizer"
    if tok_dir.is_dir():
        from lmforge.tokenizer import Tokenizer

        try:
            tokenizer = Tokenizer.load(tok_dir)
        except (OSError, ValueError, KeyError) as e:
            raise LmforgeError(f"cannot load tokenizer {tok_dir}: {e}") from None
    return model, tokenizer
