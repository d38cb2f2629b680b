"""The explicit runtime object: device, dtype, distributed rank, seed.

Nothing in lmforge decides the device or reads the environment at import time. The CLI creates one
:class:`Runtime` (``Runtime.from_env``) and passes it down; library code takes what it needs as
arguments.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Mapping

from lmforge.utils.errors import LmforgeError


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where and how this process runs."""

    device: str = "cpu"
    "torch device string: cpu, cuda, cuda:1, mps"
    rank: int = 0
    "global rank of this process (0 when not distributed)"
    local_rank: int = 0
    "rank within this host, picks the GPU"
    world_size: int = 1
    "number of processes in the job"
    seed: int = 0
    "base random seed"

    @property
    def is_main(self) -> bool:
        """True on the process that logs and writes shared outputs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when launched with more than one process (torchrun)."""
        return self.world_size > 1

    @classmethod
    def from_env(
        cls, device: str = "auto", seed: int = 0, env: Mapping[str, str] | None = None
    ) -> Runtime:
        """Build the runtime from torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE) and ``device``.

        ``device="auto"`` picks ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``.
        """
        env = os.environ if env is None else env
        try:
            rank = int(env.get("RANK", "0"))
            local_rank = int(env.get("LOCAL_RANK", "0"))
            world_size = int(env.get("WORLD_SIZE", "1"))
        except ValueError:
            raise LmforgeError("RANK, LOCAL_RANK and WORLD_SIZE must be integers") from None
        import torch

        if device == "auto":
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        elif device == "cuda":
            device = f"cuda:{local_rank}"
        resolved = resolve_device(device)
        return cls(
            device=resolved, rank=rank, local_rank=local_rank, world_size=world_size, seed=seed
        )

    def seed_everything(self, offset: int = 0) -> None:
        """Seed Python, NumPy and torch with ``seed + offset``."""
        import numpy as np
        import torch

        s = self.seed + offset
        random.seed(s)
        np.random.seed(s % (2**32))
        torch.manual_seed(s)


def resolve_device(device: str) -> str:
    """Check that ``device`` names a usable torch device; raise one clear line otherwise."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise LmforgeError(
            f"invalid device '{device}' (expected cpu, cuda, cuda:N or mps)"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LmforgeError(f"device '{device}' asked for but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LmforgeError(
                f"device '{device}' does not exist ({torch.cuda.device_count()} CUDA devices)"
            )
    elif dev.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise LmforgeError(f"device '{device}' asked for but MPS is not available here")
    elif dev.type != "cpu":
        raise LmforgeError(f"unsupported device '{device}' (expected cpu, cuda, cuda:N or mps)")
    return str(dev)
