"""Test tiers: default (CPU, fast, no network), ``gpu`` (skipped without CUDA), ``slow``, ``dist``.

The default suite (``./run test``) deselects ``slow``, ``gpu`` and ``dist_slow`` through pyproject's
addopts; run ``./run test -m gpu`` on a GPU machine, ``./run test -m slow`` for the long tier.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never use the network: any connection outside loopback fails loudly."""
    real_connect = socket.socket.connect

    def guarded(self: socket.socket, address: object) -> object:
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (
            host.startswith("127.") or host in ("localhost", "::1") or self.family == socket.AF_UNIX
        ):
            raise RuntimeError(f"test tried to reach the network: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; the test is skipped when it is absent."""
    root = Path(os.environ.get("LMFORGE_SHARED_DATA", SHARED_DATA))
    if not root.is_dir():
        pytest.skip(f"shared data not found at {root}")
    return root
