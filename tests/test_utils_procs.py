"""Pool workers exit when their parent is killed (lmforge.utils.procs.exit_with_parent)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# A parent that starts a spawn pool with the initializer, reports its workers, then waits.
_PARENT = """
import concurrent.futures as cf, multiprocessing as mp, os, sys, time
from lmforge.utils.procs import exit_with_parent

def pid(_):
    time.sleep(0.2)
    return os.getpid()

if __name__ == "__main__":
    guarded, kind = sys.argv[1] == "guarded", sys.argv[2]
    init = exit_with_parent if guarded else None
    args = (os.getpid(),) if guarded else ()
    if kind == "pool":  # what the pipeline's local executor and the tokenizer use
        pool = mp.get_context("spawn").Pool(2, initializer=init, initargs=args)
        pids = pool.map(pid, range(8))
    else:  # what dedup uses: the platform's default start method (fork on Linux)
        ex = cf.ProcessPoolExecutor(2, initializer=init, initargs=args)
        pids = list(ex.map(pid, range(8)))
    print(sorted(set(pids)), flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its reaping is left


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids + [g for k in kids for g in _children(k) if _alive(k)]


def _wait_gone(pids: list[int], limit_s: float = 30.0) -> list[int]:
    # Liveness bound only: the assertion is on which processes remain, not on how fast.
    end = time.monotonic() + limit_s
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _kill_parent(tmp_path: Path, mode: str, kind: str) -> tuple[list[int], list[int]]:
    script = tmp_path / "parent.py"  # a file: spawn workers re-import the parent's __main__
    script.write_text(_PARENT)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, kind], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()
        assert line, "the parent died before starting its pool"
        workers = json.loads(line)
        tree = sorted(set(workers) | set(_children(proc.pid)))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return tree, _wait_gone(tree, 30.0 if mode == "guarded" else 3.0)
    finally:
        for p in _children(proc.pid) if _alive(proc.pid) else []:
            os.kill(p, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("kind", ["pool", "executor"])
def test_pool_workers_exit_when_the_parent_is_killed(tmp_path: Path, kind: str) -> None:
    tree, left = _kill_parent(tmp_path, "guarded", kind)
    assert len(tree) >= 2 and left == []


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_unguarded_workers_would_hang(tmp_path: Path) -> None:
    # The control: without the initializer the same workers outlive a kill -9 of the parent.
    _, left = _kill_parent(tmp_path, "plain", "executor")
    try:
        assert left, "expected unguarded workers to survive their parent"
    finally:
        for p in left:
            os.kill(p, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.requires("xxhash")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_data_run_leaves_no_workers(tmp_path: Path) -> None:
    # The case: kill -9 of `lmforge data run` with a 2-worker dedup stage.
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(4000)]
    inp = tmp_path / "in"
    inp.mkdir()
    for f in range(6):
        rows = [
            json.dumps({"id": f"{f}-{i}", "text": " ".join(rng.choices(words, k=300))})
            for i in range(1500)
        ]
        (inp / f"p{f}.jsonl").write_text("\n".join(rows) + "\n")
    pipe = tmp_path / "p.toml"
    pipe.write_text(
        f'workers = 2\n[input]\npaths = ["{inp}"]\nformat = "jsonl"\n'
        f'[output]\ndir = "{tmp_path / "out"}"\n[[steps]]\ntype = "minhash_dedup"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge", "data", "run", str(pipe), "--no-progress"], env=env
    )
    try:
        end = time.monotonic() + 120
        tree: list[int] = []
        while time.monotonic() < end and len(tree) < 2 and proc.poll() is None:
            time.sleep(0.2)
            tree = [p for p in _children(proc.pid) if _alive(p)]
        assert len(tree) >= 2, "the dedup pool never started"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _wait_gone(tree) == []
    finally:
        if proc.poll() is None:
            proc.kill()
