"""Token shards on disk, random training windows mixed across sources, sequential eval windows.

A shard is ``NAME.bin`` (raw little-endian uint16/uint32 token ids, documents concatenated) with a
sidecar ``NAME.bin.json`` written by ``lmforge tokenizer encode``::

    {"format": "lmforge-tokens-v1", "dtype": "uint16", "count": N, "vocab_size": V,
     "tokenizer_sha256": "...", "documents": D, "bytes": total UTF-8 bytes}

Shards are memory-mapped (``np.memmap``), never read whole. Training draws random windows
(:class:`MixtureSampler`); evaluation walks fixed, non-overlapping windows (:func:`eval_batches`).
Exercised by ``pytest tests/test_train_data.py``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.utils.errors import LmforgeError
from lmforge.utils.runtime import resolve_device

SHARD_FORMAT = "lmforge-tokens-v1"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclasses.dataclass
class TokenShard:
    """One memory-mapped shard and its sidecar facts."""

    path: Path
    tokens: np.ndarray
    "(N,) token ids, memory-mapped"
    vocab_size: int
    "vocabulary size of the tokenizer that wrote it"
    num_bytes: int
    "UTF-8 bytes of the encoded text (0 when unknown)"
    tokenizer_sha256: str = ""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def open_shard(path: str | Path) -> TokenShard:
    """Memory-map ``path`` (a ``.bin`` shard) after checking its sidecar ``path.json``; a missing
    or inconsistent sidecar (format, dtype, count vs file size) raises one line."""
    p = Path(path)
    side = p.with_name(p.name + ".json")
    if not p.is_file():
        raise LmforgeError(f"token shard not found: {p}")
    if not side.is_file():
        raise LmforgeError(
            f"token shard {p} has no sidecar {side.name} (write it with lmforge tokenizer encode)"
        )
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LmforgeError(f"sidecar {side} is not valid JSON") from None
    if meta.get("format") != SHARD_FORMAT:
        raise LmforgeError(
            f"sidecar {side}: format {meta.get('format')!r}, expected {SHARD_FORMAT!r}"
        )
    dtype = _DTYPES.get(meta.get("dtype", ""))
    if dtype is None:
        raise LmforgeError(
            f"sidecar {side}: dtype {meta.get('dtype')!r}, expected uint16 or uint32"
        )
    count = int(meta.get("count", -1))
    size = p.stat().st_size
    if count < 0 or size != count * dtype.itemsize:
        raise LmforgeError(
            f"token shard {p}: {size} bytes on disk but the sidecar says {count} {dtype.name} tokens"
        )
    tokens = np.memmap(p, dtype=dtype, mode="r") if count else np.zeros(0, dtype=dtype)
    return TokenShard(
        path=p,
        tokens=tokens,
        vocab_size=int(meta.get("vocab_size", 0)),
        num_bytes=int(meta.get("bytes", 0) or 0),
        tokenizer_sha256=str(meta.get("tokenizer_sha256", "")),
    )


def expand_shards(pattern: str) -> list[Path]:
    """A ``.bin`` file, a folder (all ``*.bin`` below it) or a glob → sorted shard paths."""
    p = Path(pattern)
    if p.is_dir():
        paths = sorted(p.rglob("*.bin"))
    elif p.is_file():
        paths = [p]
    else:
        paths = sorted(Path(x) for x in glob.glob(pattern, recursive=True) if x.endswith(".bin"))
    if not paths:
        raise LmforgeError(f"no token shards (.bin) found at '{pattern}'")
    return paths


def open_source(pattern: str, model_vocab_size: int | None = None) -> list[TokenShard]:
    """Open every shard of one source; check each fits the model's vocabulary."""
    shards = [open_shard(x) for x in expand_shards(pattern)]
    if model_vocab_size is not None:
        for s in shards:
            if s.vocab_size > model_vocab_size:
                raise LmforgeError(
                    f"token shard {s.path} has vocab_size {s.vocab_size} but the model's "
                    f"model.vocab_size is {model_vocab_size}"
                )
    return shards


def _to_device(x: np.ndarray, device: str) -> torch.Tensor:
    t = torch.from_numpy(x.astype(np.int64, copy=False))
    if device.startswith("cuda"):
        # Pinned host memory lets the copy overlap with compute.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def get_batch(
    dataset: np.ndarray | Sequence[int],
    batch_size: int,
    context_length: int,
    device: str,
    rng: np.random.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows: x (B, T) and y (B, T) = x shifted left by one,
    starts uniform over ``[0, len − T − 1]``; ``rng`` makes the draw reproducible (else the
    global NumPy RNG). An invalid or unavailable ``device`` raises :class:`LmforgeError`."""
    dev = resolve_device(device)
    data = np.asarray(dataset) if not isinstance(dataset, np.ndarray) else dataset
    n = int(data.shape[0])
    if n < context_length + 1:
        raise LmforgeError(
            f"dataset has {n} tokens, fewer than context_length + 1 = {context_length + 1}"
        )
    high = n - context_length  # exclusive upper bound of a start
    starts = (
        rng.integers(0, high, size=batch_size)
        if rng is not None
        else np.random.randint(0, high, size=batch_size)
    )
    idx = starts[:, None] + np.arange(context_length + 1)[None, :]  # (B, T+1)
    windows = data[idx]  # (B, T+1)
    x = _to_device(np.ascontiguousarray(windows[:, :-1]), dev)  # (B, T)
    y = _to_device(np.ascontiguousarray(windows[:, 1:]), dev)  # (B, T)
    return x, y


class MixtureSampler:
    """Random training windows: each sequence picks a source with probability ``weights[i]``
    (normalised; default: token counts), a shard of it proportional to its length, then a
    uniform window in that shard. All draws come from one PCG64 generator: :meth:`state_dict` is
    the whole data position, so a resumed run sees exactly the uninterrupted run's batches."""

    def __init__(
        self,
        sources: Sequence[Sequence[TokenShard]],
        context_length: int,
        weights: Sequence[float] = (),
        seed: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        if not sources:
            raise LmforgeError("no training sources (data.train is empty)")
        if weights and len(weights) != len(sources):
            raise LmforgeError(
                f"data.weights has {len(weights)} entries but data.train has {len(sources)} sources"
            )
        self.context_length = context_length
        self._shards: list[list[TokenShard]] = []
        self._shard_p: list[np.ndarray] = []
        sizes = []
        for src in sources:
            usable = [s for s in src if len(s) >= context_length + 1]
            if not usable:
                names = ", ".join(str(s.path) for s in src)
                raise LmforgeError(
                    f"source {names}: no shard holds context_length + 1 = {context_length + 1} tokens"
                )
            lens = np.array([len(s) - context_length for s in usable], dtype=np.float64)
            self._shards.append(usable)
            self._shard_p.append(lens / lens.sum())
            sizes.append(float(sum(len(s) for s in usable)))
        w = np.array(weights if weights else sizes, dtype=np.float64)
        if (w < 0).any() or not math.isfinite(w.sum()) or w.sum() <= 0:
            raise LmforgeError(
                f"data.weights must be non-negative with a positive sum, got {list(weights)}"
            )
        self.weights = w / w.sum()
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.vocab_size = vocab_size

    def sample(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """x (B, T) and y (B, T) as int64 NumPy arrays."""
        T = self.context_length
        src = self.rng.choice(len(self._shards), size=batch_size, p=self.weights)  # (B,)
        out = np.empty((batch_size, T + 1), dtype=np.int64)  # (B, T+1)
        for b, s in enumerate(src):
            shards = self._shards[s]
            k = self.rng.choice(len(shards), p=self._shard_p[s]) if len(shards) > 1 else 0
            start = int(self.rng.integers(0, len(shards[k]) - T))
            out[b] = shards[k].tokens[start : start + T + 1]
        # ids past the vocabulary fail here, not as a device-side assert inside a fused loss
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            bad = int(out.max())
            raise LmforgeError(
                f"token id {bad} in a training batch is outside the model's vocabulary "
                f"({self.vocab_size}): a shard is corrupt or was written by another tokenizer"
            )
        return out[:, :-1], out[:, 1:]

    def next_batch(self, batch_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample` moved to ``device`` as int64 tensors (B, T)."""
        x, y = self.sample(batch_size)
        return _to_device(np.ascontiguousarray(x), device), _to_device(
            np.ascontiguousarray(y), device
        )

    def state_dict(self) -> dict[str, Any]:
        """The generator state (JSON-serialisable ints and strings)."""
        return self.rng.bit_generator.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


def eval_batches(
    shards: Sequence[TokenShard], batch_size: int, context_length: int, max_batches: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Fixed sequential windows for validation, the same batches every call: windows of
    ``T + 1`` tokens stepping by ``T`` through each shard in order, at most ``max_batches``
    batches of up to ``batch_size`` windows. Yields x (b, T), y (b, T) int64 arrays."""
    T = context_length
    buf_x: list[np.ndarray] = []
    buf_y: list[np.ndarray] = []
    emitted = 0
    for s in shards:
        for start in range(0, len(s) - T, T):
            w = np.asarray(s.tokens[start : start + T + 1], dtype=np.int64)
            buf_x.append(w[:-1])
            buf_y.append(w[1:])
            if len(buf_x) == batch_size:
                yield np.stack(buf_x), np.stack(buf_y)
                buf_x, buf_y = [], []
                emitted += 1
                if emitted >= max_batches:
                    return
    if buf_x and emitted < max_batches:
        yield np.stack(buf_x), np.stack(buf_y)


def bytes_per_token(shards: Sequence[TokenShard]) -> float | None:
    """UTF-8 bytes per token over ``shards`` from their sidecars (None when unknown)."""
    tokens = sum(len(s) for s in shards)
    nbytes = sum(s.num_bytes for s in shards)
    if tokens == 0 or nbytes == 0 or any(s.num_bytes == 0 for s in shards):
        return None
    return nbytes / tokens


def bits_per_byte(mean_loss_nats: float, bytes_per_tok: float) -> float:
    """Bits per byte = (loss in nats per token) / (ln 2 · bytes per token)."""
    return mean_loss_nats / (math.log(2) * bytes_per_tok)


def write_shard(path: str | Path, tokens: np.ndarray, vocab_size: int, num_bytes: int = 0) -> Path:
    """Write ``tokens`` as a shard + sidecar (for tests and benchmarks; the tokenizer writes real ones)."""
    from lmforge.utils.io import atomic_write_bytes, atomic_write_text

    p = Path(path)
    dtype = "uint16" if vocab_size <= 65536 else "uint32"
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise LmforgeError(
            f"write_shard {p}: token ids must lie in [0, {vocab_size}), got "
            f"[{int(tokens.min())}, {int(tokens.max())}]"
        )
    arr = tokens.astype(_DTYPES[dtype])
    atomic_write_bytes(p, arr.tobytes())
    meta = {
        "format": SHARD_FORMAT,
        "dtype": dtype,
        "count": int(arr.shape[0]),
        "vocab_size": int(vocab_size),
        "tokenizer_sha256": "",
        "documents": 1,
        "bytes": int(num_bytes),
    }
    atomic_write_text(p.with_name(p.name + ".json"), json.dumps(meta))
    return p
