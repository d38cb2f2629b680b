"""Structured pruning: importance scores against direct computation, exact slicing (pruning
structures that contribute nothing leaves the logits unchanged), parameter targets, and
``lmforge prune`` end to end with one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.layers import silu
from lmforge.prune import (
    Importance,
    activation_importance,
    count_parameters,
    plan_depth,
    plan_width,
    prune_depth,
    prune_width,
)
from lmforge.tokenizer import Tokenizer
from lmforge.train import save_checkpoint

CFG = ModelConfig(
    vocab_size=272, context_length=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128
)


def _model(**kw: object) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(dataclasses.replace(CFG, **kw)).eval()


def _ids(n: int = 4, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 272, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_ffn_and_layer_scores_match_direct_computation() -> None:
    model = _model()
    ids = _ids()
    imp = activation_importance(model, ids, batch_size=3)
    assert imp.heads.shape == (4, 4) and imp.ffn.shape == (4, 128) and imp.hidden.shape == (64,)
    x = model.token_embeddings(ids)
    block = model.layers[0]
    y = block.ln2(x + block.attn(block.ln1(x)))
    a = silu(block.ffn.w1(y)) * block.ffn.w3(y)  # (N, T, F)
    torch.testing.assert_close(imp.ffn[0], a.abs().mean((0, 1)), rtol=1e-4, atol=1e-6)
    out = block(x)
    bi = 1 - torch.nn.functional.cosine_similarity(x, out, dim=-1).mean()
    torch.testing.assert_close(imp.layers[0], bi, rtol=1e-4, atol=1e-6)
    assert torch.all(imp.heads > 0)


@pytest.mark.parametrize("gate", [False, True])  # True: Qwen3-Next's attention output gate
@torch.no_grad()
def test_pruning_dead_ffn_channels_and_heads_is_exact(gate: bool) -> None:
    model = _model(attn_output_gate=gate)
    dead_f = torch.arange(0, 128, 4)  # a quarter of the FFN channels produce nothing
    for layer in model.layers:
        layer.ffn.w1.weight[dead_f] = 0.0
        layer.ffn.w3.weight[dead_f] = 0.0
        # head 1 (group 0) and head 2 (group 1) write nothing into the residual stream
        layer.attn.output_proj.weight[:, 16:48] = 0.0
    ids = _ids()
    ref = model(ids)
    imp = activation_importance(model, ids)
    assert torch.all(imp.ffn[:, dead_f] == 0)
    imp.heads[:, [1, 2]] = -1.0  # output-side dead: mark them least important
    small = prune_width(model, imp, d_ff=96, heads_per_group=1)
    assert small.config.n_heads == 2 and small.config.ffn_dim == 96 and small.config.head_dim == 16
    torch.testing.assert_close(small(ids), ref, rtol=1e-5, atol=1e-5)
    assert count_parameters(small.config) == small.num_parameters()


@torch.no_grad()
def test_pruning_an_identity_block_is_exact() -> None:
    model = _model()
    model.layers[2].attn.output_proj.weight.zero_()
    model.layers[2].ffn.w2.weight.zero_()  # block 2 returns its input
    ids = _ids()
    ref = model(ids)
    imp = activation_importance(model, ids)
    assert imp.layers.argmin().item() == 2
    small = prune_depth(model, imp, 3)
    assert small.config.n_layers == 3
    torch.testing.assert_close(small(ids), ref, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_width_pruning_keeps_the_top_hidden_channels() -> None:
    model = _model()
    imp = activation_importance(model, _ids())
    small = prune_width(model, imp, d_model=48, d_ff=64)
    keep = torch.sort(torch.topk(imp.hidden, 48).indices).values
    torch.testing.assert_close(
        small.token_embeddings.weight, model.token_embeddings.weight[:, keep]
    )
    assert small(_ids()).shape == (4, 16, 272)


def test_plans_meet_the_target() -> None:
    full = count_parameters(CFG)
    imp = Importance(torch.ones(4, 4), torch.ones(4, 128), torch.ones(64), torch.ones(4), 1)
    n = plan_depth(CFG, imp, int(full * 0.8))
    assert (
        n == 3 and count_parameters(CFG.__class__(**{**CFG.__dict__, "n_layers": n})) <= full * 0.8
    )
    d, f = plan_width(CFG, int(full * 0.8))
    assert d % 32 == 0 and f % 64 == 0 and (d, f) != (64, 128)


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(tmp_path / "tok")
    out = tmp_path / "ckpt"
    save_checkpoint(
        out, _model(), None, 0, config=RunConfig(model=CFG), tokenizer_dir=tmp_path / "tok"
    )
    (tmp_path / "calib.txt").write_text("Pruning keeps what matters. " * 200, encoding="utf-8")
    return out


@pytest.mark.parametrize("mode", ["width", "depth"])
def test_cli_prune(ckpt: Path, tmp_path: Path, mode: str) -> None:
    from lmforge.hf import load_pretrained

    target = int(count_parameters(CFG) * 0.8)
    out = tmp_path / f"p-{mode}"
    argv = ["prune", "--checkpoint", str(ckpt), "--target-params", str(target), "--mode", mode]
    argv += [
        "--calib",
        str(tmp_path / "calib.txt"),
        "--calib-samples",
        "16",
        "--calib-seq-len",
        "32",
    ]
    assert main([*argv, "--out", str(out), "--device", "cpu"]) == 0
    model, tok = load_pretrained(out)
    assert model.num_parameters() <= target and tok is not None
    assert model(torch.tensor([tok.encode("Pruning")])).shape[-1] == 272


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--target-params", "1e12"], "is not below the model's"),
        (["--mode", "sideways"], "--mode must be width or depth"),
        (["--calib", "missing.txt"], "calibration file not found"),
    ],
)
def test_cli_prune_bad_input(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["prune", "--checkpoint", str(ckpt), "--target-params", "1e5", "--calib"]
    argv += [str(tmp_path / "calib.txt"), "--out", str(tmp_path / "out"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@torch.no_grad()
def _kl_to(teacher: torch.nn.Module, student: torch.nn.Module, ids: torch.Tensor) -> float:
    t = torch.log_softmax(teacher(ids).float(), -1)  # (B, T, V)
    s = torch.log_softmax(student(ids).float(), -1)  # (B, T, V)
    return float((t.exp() * (t - s)).sum(-1).mean())


def test_prune_then_distill_recovers(ckpt: Path, tmp_path: Path) -> None:
    """The documented recovery path: ``lmforge prune`` then ``lmforge distill`` from the unpruned
    model (the post-training distillation objective in the Trainer) brings the pruned model's
    logits closer to the original's."""
    import json

    from lmforge.hf import load_pretrained

    pruned = tmp_path / "pruned"
    argv = ["prune", "--checkpoint", str(ckpt), "--target-params", str(int(count_parameters(CFG) * 0.8)),
            "--mode", "width", "--calib", str(tmp_path / "calib.txt"), "--calib-samples", "16",
            "--calib-seq-len", "32", "--out", str(pruned), "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    data = tmp_path / "corpus.jsonl"
    g = torch.Generator().manual_seed(3)
    rows = [{"text": bytes(torch.randint(97, 123, (40,), generator=g).tolist()).decode()}
            for _ in range(16)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    kd = tmp_path / "kd"
    argv = ["distill", "--teacher", str(ckpt), "--student", str(pruned), "--data", str(data),
            "--steps", "8", "--batch-size", "4", "--max-len", "32", "--lr", "3e-3",
            "--out", str(kd), "--device", "cpu", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    teacher, tok = load_pretrained(ckpt)
    before, _ = load_pretrained(pruned)
    after, _ = load_pretrained(kd / "model")
    ids = torch.tensor([tok.encode(r["text"]) for r in rows[:4]])
    assert after.num_parameters() == before.num_parameters()
    assert _kl_to(teacher, after, ids) < 0.8 * _kl_to(teacher, before, ids)
