"""Run a recipe's stages in order, skipping finished ones and resuming a killed one.

For each stage: its key (:func:`lmforge.recipe.markers.stage_key`) is computed from its settings,
inputs and the previous stage's key. A marker with the same key means done: "skipped". Otherwise
the stage's folders are cleared (unless a killed attempt under the same key can resume in place),
an attempt marker is written, the stage runs, and its completion marker is written last, so a
``kill -9`` anywhere leaves either a finished stage or one that a rerun continues or restarts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lmforge.recipe.config import STAGES, RecipeConfig, stage_index
from lmforge.recipe.markers import (
    ATTEMPT,
    DONE,
    inputs_digest,
    read_marker,
    stage_key,
    write_marker,
)
from lmforge.recipe.stages import STAGE_LIST, Context, Stage, model_path, where
from lmforge.utils.config import ConfigError
from lmforge.utils.errors import LmforgeError

DEVICE_STAGES = ("pretrain", "sft", "rl", "eval")
"stages that run on recipe.device (the others run on the CPU of the machine that runs them)"


def _log(msg: str) -> None:
    print(f"[recipe] {msg}", file=sys.stderr, flush=True)


def subprocess_launcher(threads: int) -> Callable[[Sequence[str]], int]:
    """Run each command as ``python -m lmforge ARGS`` with ``threads`` OpenMP/MKL threads: a
    fresh process per command (memory returned between stages, torch's thread pool sized
    before it starts)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}

    def launch(args: Sequence[str]) -> int:
        return subprocess.call([sys.executable, "-m", "lmforge", *args], env=env)

    return launch


def inprocess_launcher(threads: int) -> Callable[[Sequence[str]], int]:
    """Run each command through :func:`lmforge.cli.main` in this process (no interpreter start
    per command: what the tests use)."""
    import torch

    torch.set_num_threads(threads)

    def launch(args: Sequence[str]) -> int:
        from lmforge.cli import main

        try:
            return main(list(args))
        except SystemExit as e:  # argparse's usage errors
            return int(e.code or 0) if isinstance(e.code, int) else 2

    return launch


def stage_keys(cfg: RecipeConfig) -> dict[str, str]:
    """Every enabled stage's key, in order (a disabled stage passes the previous key on)."""
    keys: dict[str, str] = {}
    previous = ""
    for st in STAGE_LIST:
        if not st.enabled(cfg):
            continue
        previous = stage_key(st.name, st.settings(cfg), inputs_digest(st.inputs(cfg)), previous)
        keys[st.name] = previous
    return keys


def is_done(out: Path, stage: Stage, key: str) -> bool:
    """Whether ``stage`` finished under ``key`` (its completion marker says so)."""
    marker = read_marker(out / stage.dirs[0] / DONE)
    return marker is not None and marker.get("key") == key


def _prepare(out: Path, stage: Stage, key: str) -> None:
    """Make room for a fresh attempt, unless a killed attempt under the same key can continue in
    place; then record this attempt. A killed attempt's partial outputs are deleted; outputs of
    other settings (a finished stage whose settings changed, or one run again by --from) are
    kept, numbered, under ``out/previous/`` (nothing a user ran is lost)."""
    attempt = read_marker(out / stage.dirs[0] / ATTEMPT)
    same_key = attempt is not None and attempt.get("key") == key
    if same_key and stage.resumable:
        _log(f"{stage.name}: an earlier attempt was interrupted; continuing it")
    else:
        for d in stage.dirs:
            if not (out / d).exists():
                continue
            if same_key or stage.name == "report":  # a partial attempt; the card is rewritten
                shutil.rmtree(out / d)
                if stage.name != "report":
                    _log(f"{stage.name}: cleared its interrupted outputs; starting it afresh")
                continue
            dest = previous_path(out, d)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(out / d, dest)
            _log(f"{stage.name}: its earlier outputs ({d}/, other settings) are kept in {dest}")
    write_marker(out / stage.dirs[0] / ATTEMPT, {"key": key, "started": time.time()})


def previous_path(out: Path, folder: str) -> Path:
    """``out/previous/FOLDER.N``, N one more than the highest kept so far."""
    taken = [int(p.name.rsplit(".", 1)[1]) for p in (out / "previous").glob(f"{folder}.*")
             if p.name.rsplit(".", 1)[1].isdigit()]  # fmt: skip
    return out / "previous" / f"{folder}.{max(taken, default=0) + 1}"


@contextlib.contextmanager
def recipe_lock(out: Path) -> Iterator[None]:
    """Hold ``out/.recipe-lock`` for the run: a second run on the same folder (whose stages
    would clear each other's outputs) is one line. The operating system drops the lock when the
    process dies, so a ``kill -9`` leaves nothing to clean up."""
    import fcntl

    f = open(out / ".recipe-lock", "a+")
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            pid = f.read().strip() or "?"
            raise LmforgeError(
                f"another recipe run (pid {pid}) is using {out}; wait for it or use another "
                "recipe.out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        f.close()


def make_context(cfg: RecipeConfig, threads: int) -> Context:
    """The stages' context for ``cfg`` with its configured launcher."""
    launch = (subprocess_launcher if cfg.recipe.launcher == "subprocess"
              else inprocess_launcher)(threads)  # fmt: skip
    return Context(cfg, Path(cfg.recipe.out), threads, launch)


def run_recipe(
    cfg: RecipeConfig,
    *,
    from_stage: str | None = None,
    until_stage: str | None = None,
    threads: int = 1,
    launch: Callable[[Sequence[str]], int] | None = None,
) -> dict[str, Any]:
    """Run the recipe's stages from ``from_stage`` (forced to re-run, with every later one)
    through ``until_stage``; returns ``{stage: "skipped" | "ran"}``."""
    out = Path(cfg.recipe.out)
    first = stage_index(from_stage, "--from") if from_stage else 0
    last = stage_index(until_stage, "--until") if until_stage else len(STAGES) - 1
    if first > last:
        raise ConfigError(f"--from {from_stage} comes after --until {until_stage}")
    ctx = make_context(cfg, threads) if launch is None else Context(cfg, out, threads, launch)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LmforgeError(f"cannot create the recipe folder {out}: {e.strerror}") from None
    if not os.access(out, os.W_OK):
        raise LmforgeError(f"recipe folder {out} is not writable")
    with recipe_lock(out):
        return _run_stages(cfg, out, ctx, first, last, from_stage)


def _run_stages(
    cfg: RecipeConfig, out: Path, ctx: Context, first: int, last: int, from_stage: str | None
) -> dict[str, Any]:
    keys = stage_keys(cfg)
    status: dict[str, Any] = {}
    for i, st in enumerate(STAGE_LIST):
        if i > last:
            break
        if not st.enabled(cfg):
            _log(f"{st.name}: disabled in the recipe")
            continue
        key = keys[st.name]
        forced = i >= first and from_stage is not None
        if st.name != "report" and not forced and is_done(out, st, key):
            _log(f"{st.name}: already done (marker {out / st.dirs[0] / DONE}); skipping")
            status[st.name] = "skipped"
            continue
        if i < first:
            raise LmforgeError(
                f"--from {from_stage}: the earlier stage '{st.name}' has not finished "
                "under these settings; run without --from first"
            )
        # the later stages consume this one's outputs: they are no longer done, whatever happens
        for later in STAGE_LIST[i + 1 :]:
            (out / later.dirs[0] / DONE).unlink(missing_ok=True)
        if forced:
            write_marker(out / st.dirs[0] / ATTEMPT, {"key": "forced"})  # never resumed
        _prepare(out, st, key)
        _log(f"{st.name}: running")
        t0 = time.time()
        metrics = st.run(ctx)
        seconds = time.time() - t0
        device = cfg.recipe.device if st.name in DEVICE_STAGES else "cpu"
        write_marker(
            out / st.dirs[0] / DONE,
            {"key": key, "stage": st.name, "settings": st.settings(cfg), "seconds": seconds,
             "metrics": metrics, "finished": time.time(), "where": where(device)},
        )  # fmt: skip
        _log(f"{st.name}: done in {seconds:.1f} s")
        status[st.name] = "ran"
    if last == len(STAGES) - 1:
        result = model_path(cfg, out, "rl")
        card_path = out / "report.md"
        if card_path.is_file():
            card = card_path.read_text(encoding="utf-8")
            print("\n" + card.split("## Curves")[0].split("## Settings")[0].rstrip())
        print(f"\nreport card: {out / 'report.md'}")
        print(f"chat with the result:  lmforge chat --checkpoint {result} --temperature 0.7")
        print(f"serve it:              lmforge serve --checkpoint {result} --port 8000")
    return status
