"""Every example in the README and in every ``--help`` runs on a fresh clone after ``./run demo``.

The harness collects the examples itself (the epilog of every parser and sub-parser, and the
``./run lmforge …`` / ``lmforge …`` lines of the README's bash blocks), then runs each through
``lmforge.cli.main`` in a scratch folder that looks like a fresh clone after the demo: it holds
``configs/`` and ``examples/`` from the repository and a tiny ``runs/demo`` made by the demo
itself. Each example must match a row of :data:`ROWS` (first match wins), which says how to
run it: the arguments appended to keep it tiny (argparse lets a later flag override an earlier
one), or why it cannot run here (GPU, torchrun, network, a model download), or — for a stale
example in a file this suite's owner does not edit — an expected failure naming the fix. A new
command's examples need new rows: ``test_every_example_has_a_row`` says which.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmforge.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Row:
    """How to run the examples whose command line matches ``pattern`` (``re.search``)."""

    pattern: str
    extra: tuple[str, ...] = ()
    "arguments appended to keep the run tiny"
    skip: str = ""
    "why it cannot run here (GPU, torchrun, network, a download); empty = run it"
    xfail: str = ""
    "a known stale example in a file another owner edits: the fix, for them"
    slow: bool = False
    "run in the slow tier only"
    needs: tuple[str, ...] = ()
    "optional modules it imports (skipped, naming the extra, without them)"
    rc: int = 0
    "the exit status the example documents (e.g. 1 for a probe that finds a leak)"


# The real demo (configs/recipes/tiny-cpu.toml, what ./run demo runs) with its step budgets cut:
# every stage runs and every shape the examples depend on stays (tokenizer vocabulary and special
# tokens, the model config, the folder layout), so an example that works here works after the
# real ./run demo. Only lengths change: steps, iterations, evaluation sizes, how much text.
DEMO_SHORT = ("recipe.launcher=inprocess", "recipe.threads=1", "data.code_mb=3",
              "data.tokens=4e6", "tokenizer.train_mb=3", "pretrain.steps=2",
              "pretrain.eval_every=0", "pretrain.eval_batches=1", "pretrain.save_every=2",
              "sft.steps=1", "sft.batch_size=2", "sft.micro_batch=2", "rl.iterations=1",
              "rl.prompts_per_step=2", "rl.group_size=2", "rl.eval_size=2", "rl.eval_every=1",
              "rl.max_tokens=4", "eval.tasks=ppl,arc", "eval.limit=1")  # fmt: skip


DEMO_ARGS = tuple(f"--{o}" for o in DEMO_SHORT)
TINY_TRAIN = ("--train.max_steps=2", "--train.batch_size=2", "--train.eval_batches=1",
              "--train.device=cpu", "--train.progress=false")  # fmt: skip
GEN = ("--max-new-tokens", "4", "--device", "cpu")
EVAL = ("--limit", "2", "--max-new-tokens", "4", "--device", "cpu", "--no-progress")
WEB = ("fastwarc", "resiliparse", "fasttext")  # the [data] extra's WARC, HTML and language ID

ROWS: tuple[Row, ...] = (
    # top level (src/lmforge/cli.py: the lead's file)
    Row(r"^lmforge <command> --help", skip="a template, not a command"),
    # demo
    Row(r"^lmforge demo --preset gpt2-small .*--device cuda", skip="needs a GPU"),
    Row(r"^lmforge demo$", extra=DEMO_ARGS),  # runs/demo is complete: every stage is skipped
    Row(r"^lmforge demo", extra=(*DEMO_ARGS, "--sample-tokens", "4"), slow=True),
    # recipe
    Row(r"^lmforge recipe run configs/recipes/h200\.toml", skip="needs a GPU (an H200)"),
    Row(r"^lmforge recipe run configs/recipes/tiny-cpu\.toml$", extra=DEMO_ARGS),  # all skipped
    Row(r"^lmforge recipe run ", extra=DEMO_ARGS, slow=True),
    Row(r"^lmforge recipe (eval|pack) configs/recipes/h200\.toml",
        skip="the GPU tier's run folder and benchmark copy (benchmarks/h200_session.sh recipe-prep)"),
    Row(r"^lmforge recipe unpack \.carry/", skip="a pack made on another machine (recipe pack)"),
    Row(r"^lmforge recipe (eval|pack) configs/recipes/tiny-cpu\.toml", extra=DEMO_ARGS),
    # download (a model)
    Row(r"^lmforge download --list$"),
    Row(r"^lmforge download ", skip="downloads over the network; tests/test_download_model.py "
        "checks the offline line"),
    # tokenizer
    Row(r"^lmforge tokenizer train ", extra=("--vocab-size", "300", "--workers", "1")),
    Row(r"^lmforge tokenizer encode ", extra=("--workers", "1")),
    # data
    Row(r"^lmforge data download --list$"),
    Row(r"^lmforge data download ", skip="downloads over the network"),
    Row(r"^lmforge data run .* --executor ray", skip="needs the ray package ([ray] extra)"),
    Row(r"^lmforge data run configs/pipelines/web\.toml --workers 2", slow=True, needs=WEB),
    Row(r"^lmforge data run configs/pipelines/web\.toml$", extra=("--no-progress",), needs=WEB),
    Row(r"^lmforge data run ", extra=("--no-progress",), slow=True, needs=(*WEB, "xxhash")),
    Row(r"^lmforge data train-classifier ", extra=("--epoch", "1", "--bucket", "1000"), slow=True,
        needs=("fasttext",)),
    Row(r"^lmforge data dedup ", needs=("xxhash",)),
    Row(r"^lmforge data mix --source web=examples/web/", needs=("fastwarc",)),
    Row(r"^lmforge data mix "),
    # train (src/lmforge/train/_cli.py: core's file)
    Row(r"^torchrun ", skip="several processes (torchrun); tests/test_parallel_dist.py runs them"),
    Row(r"--train\.device=cuda", skip="needs a GPU"),
    Row(r"^lmforge train ", extra=TINY_TRAIN),
    # generate, eval
    Row(r"^lmforge generate ", extra=GEN),
    Row(r"^lmforge eval --pairwise ", extra=("--bootstrap", "10")),
    Row(r"^lmforge eval .*--samples", extra=(*EVAL, "--samples", "2"), slow=True),
    Row(r"^lmforge eval ", extra=EVAL),
    # hf (src/lmforge/hf/_cli.py: serve's file)
    Row(r"^lmforge hf import --model '?~/", skip="needs a Hugging Face model folder downloaded"),
    Row(r"^lmforge hf import --gguf ", skip="needs the GGUF file lmforge download fetches; tests/test_hf_gguf.py"),
    Row(r"^lmforge hf export "),
    # serve, chat (src/lmforge/serve/_cli.py)
    Row(r"^lmforge serve ", skip="a long-running server; tests/test_serve_server.py starts one"),
    Row(r"^lmforge chat ", skip="interactive (reads stdin); tests/test_serve_server.py runs it"),
    # quantize, prune (src/lmforge/quant/_cli.py, src/lmforge/prune/_cli.py)
    Row(r"^lmforge (quantize|prune) --gguf runs/models/", skip="needs the GGUF lmforge download "
        "fetches; tests/test_quant_gguf.py and tests/test_prune.py run the GGUF paths"),
    Row(r"^lmforge quantize --hf ", skip="needs a Hugging Face model folder downloaded"),
    Row(r"^lmforge (quantize|prune) --checkpoint runs/demo/"),
    # vision (src/lmforge/vision/_cli.py)
    Row(r"^lmforge vision pretrain .*--data\.source=(folder|tar)", skip="needs your own images"),
    Row(r"^lmforge vision pretrain ", slow=True,
        extra=("--train.steps=2", "--train.eval_every=2", "--train.save_every=2",
               "--data.val_size=16", "--train.batch_size=8")),
    Row(r"^lmforge vision vlm ", skip="needs the pretrain example's CLIP run; "
        "tests/test_vision_vlm.py runs the command end to end"),
    Row(r"^lmforge vision vqvae ", slow=True,
        extra=("--vq_train.steps=2", "--lm_train.steps=2", "--run.eval_images=4")),
    # probe (src/lmforge/probe/_cli.py)
    Row(r"^lmforge probe causality --checkpoint runs/moe/", skip="needs a trained MoE run"),
    Row(r"^lmforge probe causality .*(expert_choice|token_choice_capacity)", rc=1),
    Row(r"^lmforge probe causality "),
    # posttrain (src/lmforge/posttrain/_cli.py)
    Row(r"^lmforge rl --task arithmetic", extra=("--iterations", "1", "--warmup-steps", "2",
        "--eval-size", "4", "--prompts-per-step", "2", "--group-size", "2", "--quiet",
        "--out", "runs/rl-example"), slow=True),
    Row(r"^lmforge rl --task scratchpad", extra=("--iterations", "1", "--warmup-steps", "2",
        "--eval-size", "4", "--prompts-per-step", "2", "--group-size", "2", "--quiet",
        "--out", "runs/rl-example"), slow=True),
    Row(r"^lmforge rl --task gsm8k --pipeline", skip="the shared GGUF on a GPU; "
        "tests/test_posttrain_pipeline.py runs --task gsm8k --pipeline on a tiny model"),
    Row(r"^lmforge rl --config configs/posttrain/rl-arithmetic\.toml", extra=("--iterations", "1",
        "--warmup-steps", "2", "--eval-size", "4", "--prompts-per-step", "2", "--group-size", "2",
        "--quiet", "--out", "runs/rl-example"), slow=True),
    Row(r"^lmforge (sft|dpo|rl|distill) ", skip="names your own data or an earlier post-training "
        "run (runs/sft/model, prefs.jsonl, ...); tests/test_posttrain_cli.py runs each command"),
    # scaling (src/lmforge/scaling/_cli.py)
    Row(r"^lmforge scaling \w+ --help$", skip="prints a subcommand's help (argparse exits)"),
    Row(r"^lmforge scaling plan "),
    Row(r"^lmforge scaling coord-check --out", slow=True),
    Row(r"^lmforge scaling ", skip="a sweep, its results or a fit made earlier, or a GPU; "
        "tests/test_scaling_*.py run each command on tiny inputs"),
    # bench, plan (core's files)
    Row(r"^lmforge bench model --preset tiny --device cpu"),
    Row(r"^lmforge bench ", skip="GPU benchmarks (H100/H200)"),
    Row(r"^lmforge plan "),
    # README-only lines
    Row(r"^\./run (test|lint)\b", skip="the test suite / linter itself"),
)  # fmt: skip

# Paths some examples name as "your data": made on demand inside the scratch clone.


def _labelled(ws: Path) -> None:
    rows = [
        {"label": "hq", "text": f"A careful encyclopedic sentence number {i}."} for i in range(20)
    ]
    rows += [{"label": "cc", "text": f"buy now click here cheap deal {i} !!!"} for i in range(20)]
    (ws / "labelled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _hf_demo(ws: Path) -> None:
    assert main(["hf", "export", "--checkpoint", "runs/demo/train", "--out", "runs/hf/demo"]) == 0


PREPARE: dict[str, Callable[[Path], None]] = {
    "labelled.jsonl": _labelled,
    "runs/hf/demo": _hf_demo,
}


# ----------------------------------------------------------------------------- collection


@dataclass(frozen=True)
class Example:
    source: str
    "where it was found: 'lmforge data run --help' or 'README.md:LINE'"
    command: str
    "the command line, continuations joined"


def _parsers(
    p: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _joined(lines: list[str]) -> Iterator[tuple[int, str]]:
    buf, start = "", 0
    for i, line in enumerate(lines):
        if not buf:
            start = i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1].strip() + " "
            continue
        yield start, (buf + line.strip()).strip()
        buf = ""


def _is_command(line: str) -> bool:
    return line.startswith(("lmforge ", "./run ", "torchrun ")) or line == "lmforge"


def help_examples() -> list[Example]:
    """The example lines of every parser's epilog (the block after 'examples…:')."""
    out = []
    for path, p in _parsers(build_parser(), "lmforge"):
        if not p.epilog:
            continue
        lines = p.epilog.splitlines()
        heads = [i for i, ln in enumerate(lines) if ln.startswith("examples")]
        if not heads:
            continue
        body = []
        for ln in lines[heads[0] + 1 :]:
            if not ln.strip() or not ln.startswith(" "):
                break
            body.append(ln)
        for _, cmd in _joined(body):
            if _is_command(cmd):
                out.append(Example(f"{path} --help", cmd))
    return out


def readme_examples() -> list[Example]:
    """The command lines of the README's ```bash blocks."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    out, block, inside = [], [], False
    start = 0
    for i, ln in enumerate(lines):
        if ln.startswith("```"):
            if inside:
                for j, cmd in _joined(block):
                    if _is_command(cmd):
                        out.append(Example(f"README.md:{start + j + 2}", cmd))
            inside = not inside and ln.strip() == "```bash"
            block, start = [], i
            continue
        if inside:
            block.append(ln)
    return out


def all_examples() -> list[Example]:
    """README and --help examples, each command once (the first place it appears)."""
    seen: dict[str, Example] = {}
    for ex in readme_examples() + help_examples():
        seen.setdefault(_normal(ex.command), ex)
    return list(seen.values())


def _normal(command: str) -> str:
    """``./run lmforge x`` → ``lmforge x``, ``./run demo`` → ``lmforge demo``, comments dropped."""
    words = shlex.split(command, comments=True)
    if words[:2] == ["./run", "lmforge"]:
        words = ["lmforge", *words[2:]]
    elif words[:2] == ["./run", "demo"]:
        words = ["lmforge", "demo", *words[2:]]
    return shlex.join(words).replace("'<command>'", "<command>")


def _row(command: str) -> Row | None:
    norm = _normal(command)
    return next((r for r in ROWS if re.search(r.pattern, norm)), None)


# ----------------------------------------------------------------------------- the scratch clone


def build_demo(cache: Path, threads: int = 1) -> Path:
    """runs/demo as the real demo makes it (step-reduced), in ``cache``: rebuilt only where the
    recipe's completion markers say a stage's settings or inputs changed, else reused."""
    import importlib.util

    import torch

    from lmforge.recipe import load_recipe, run_recipe

    overrides = [*DEMO_SHORT, f"recipe.out={cache}"]
    if any(importlib.util.find_spec(m) is None for m in WEB):
        overrides += ["data.pipelines=[]", "data.extra_web=[]"]  # without the [data] extra
    cfg = load_recipe(REPO / "configs" / "recipes" / "tiny-cpu.toml", overrides)
    saved = torch.get_num_threads()
    try:
        run_recipe(cfg, threads=threads)
    finally:
        torch.set_num_threads(saved)
    return cache


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """configs/ and examples/ of this checkout, plus runs/demo made by the real demo's recipe
    (step-reduced; cached across sessions in pytest's cache folder)."""
    ws = tmp_path_factory.mktemp("clone")
    shutil.copytree(REPO / "configs", ws / "configs")
    shutil.copytree(REPO / "examples", ws / "examples")
    cached = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    root = cached.mkdir("lmforge-demo") if cached else tmp_path_factory.mktemp("lmforge-demo")
    cache = root / "runs-demo"
    cwd = os.getcwd()
    os.chdir(REPO)  # the recipe's paths (configs/, examples/) are the repository's
    try:
        build_demo(cache)
    finally:
        os.chdir(cwd)
    shutil.copytree(cache, ws / "runs" / "demo")
    return ws


def _cases() -> list:
    cases = []
    for ex in all_examples():
        row = _row(ex.command)
        marks = []
        if row is None:
            continue  # reported by test_every_example_has_a_row
        if row.skip:
            marks.append(pytest.mark.skip(reason=row.skip))
        if row.xfail:
            marks.append(pytest.mark.xfail(strict=True, reason=row.xfail))
        if row.slow:
            marks.append(pytest.mark.slow)
        if row.needs:
            marks.append(pytest.mark.requires(*row.needs))
        cases.append(pytest.param(ex, row, marks=marks, id=f"{ex.source}: {_normal(ex.command)}"))
    return cases


def test_every_example_has_a_row() -> None:
    examples = all_examples()
    assert len(examples) >= 40  # the collector found the README's and the --help examples
    missing = [f"{ex.source}: {ex.command}" for ex in examples if _row(ex.command) is None]
    assert not missing, "add a row to ROWS for:\n" + "\n".join(missing)


def test_readme_says_how_to_call_lmforge() -> None:
    # A bare `lmforge` is not on PATH after ./run demo (issue 21 item 3).
    bare = [ex for ex in readme_examples() if ex.command.startswith("lmforge ")]
    assert not bare, bare
    assert "source .venv/bin/activate" in (REPO / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(("example", "row"), _cases())
def test_example_runs(
    example: Example, row: Row, clone: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(clone)
    words = shlex.split(_normal(example.command), comments=True)
    argv = [os.path.expanduser(w) for w in words[1:]] + list(row.extra)
    if argv[0] == "train" and not any(a.startswith("--train.out_dir") for a in argv):
        # each example its own run folder: one folder holds one config (issue 21 item 7)
        argv.append(f"--train.out_dir=runs/example-{abs(hash(example.command)) % 10**8}")
    for name, make in PREPARE.items():
        if any(name in w for w in argv) and not (clone / name).exists():
            make(clone)
    assert main(argv) == row.rc, f"{example.source}: {example.command}"
