"""Trainer pieces: activation checkpointing, loss paths, RNG state, metrics, plotting."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM, load_preset
from lmforge.train import DataConfig, TrainConfig, Trainer, apply_activation_checkpointing
from lmforge.train.data import write_shard
from lmforge.train.metrics import plot_loss_curve, read_metrics
from lmforge.train.state import rng_state as _rng_state
from lmforge.train.state import set_rng_state as _set_rng_state
from lmforge.utils.errors import LmforgeError


def test_activation_checkpointing_same_grads_same_names() -> None:
    cfg = load_preset("tiny")
    torch.manual_seed(0)
    plain = TransformerLM(cfg)
    torch.manual_seed(0)
    ckpt = apply_activation_checkpointing(TransformerLM(cfg))
    assert list(plain.state_dict()) == list(ckpt.state_dict())
    assert type(ckpt.layers[0]).__name__ == "CheckpointedTransformerBlock"
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (plain, ckpt):
        m(idx).float().pow(2).mean().backward()
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=n)


def _cfg(tmp: Path, **train: object) -> RunConfig:
    toks = np.arange(4000) % 97
    shard = write_shard(tmp / "t.bin", toks, 512)
    base = dict(out_dir=str(tmp / "run"), device="cpu", precision="fp32", batch_size=2)
    base.update(train)
    base.setdefault("context_length", 16)
    return RunConfig(
        model=load_preset("tiny"), train=TrainConfig(**base), data=DataConfig(train=(str(shard),))
    )


def test_fused_loss_path_matches_reference(tmp_path: Path) -> None:
    ref = Trainer(_cfg(tmp_path, loss="reference", z_loss=1e-3))
    fused = Trainer(_cfg(tmp_path, loss="fused", z_loss=1e-3))
    assert ref.fused is None and fused.fused is not None
    x, y = ref.sampler.next_batch(2, "cpu")
    a = ref.loss_fn(ref.model, x, y)
    b = fused.loss_fn(fused.model, x, y)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    a.backward()
    b.backward()
    torch.testing.assert_close(
        ref.model.lm_head.weight.grad, fused.model.lm_head.weight.grad, rtol=1e-4, atol=1e-6
    )


def test_fused_loss_chunk_rows_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.loss_chunk_rows reaches the fused op (as its chunk size) and changes only the
    schedule, not the loss or gradients; a negative value is one clear error."""
    from lmforge import kernels

    seen: list[object] = []
    real = kernels.fused_linear_cross_entropy

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(kwargs.get("chunk_rows"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "fused_linear_cross_entropy", spy)
    results = []
    for rows in (0, 5):
        t = Trainer(_cfg(tmp_path, loss="fused", loss_chunk_rows=rows))
        x, y = t.sampler.next_batch(2, "cpu")
        loss = t.loss_fn(t.model, x, y)
        loss.backward()
        results.append((loss.detach(), t.model.lm_head.weight.grad.clone()))
    assert seen == [None, 5]
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)
    with pytest.raises(LmforgeError, match="loss_chunk_rows"):
        Trainer(_cfg(tmp_path, loss="fused", loss_chunk_rows=-1))


def test_fused_with_soft_cap_is_an_error(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, loss="fused")
    capped = ModelConfig(**{**vars(cfg.model), "logit_soft_cap": 30.0})
    with pytest.raises(LmforgeError, match="logit_soft_cap"):
        Trainer(RunConfig(model=capped, train=cfg.train, data=cfg.data))


def test_adamw_setting_resolves_and_refuses_clearly(tmp_path: Path) -> None:
    # On a CPU auto keeps the foreach update; triton needs one CUDA process and no CUDA graph.
    t = Trainer(_cfg(tmp_path, adamw="auto"))
    assert not t.optimizer.fused and not t.optimizer.compiled
    with pytest.raises(LmforgeError, match=r"train\.adamw=triton needs a CUDA device"):
        Trainer(_cfg(tmp_path, adamw="triton"))
    with pytest.raises(LmforgeError, match=r"train\.adamw must be"):
        Trainer(_cfg(tmp_path, adamw="fast"))


def test_bf16_residual_stream_step_runs_on_cpu(tmp_path: Path) -> None:
    # model.residual_dtype=autocast under bf16: a finite step, fp32 master weights and state.
    cfg = _cfg(tmp_path, precision="bf16")
    model = ModelConfig(**{**vars(cfg.model), "residual_dtype": "autocast"})
    trainer = Trainer(RunConfig(model=model, train=cfg.train, data=cfg.data))
    loss, norm, reason = trainer.train_step()
    assert reason is None and np.isfinite(loss) and np.isfinite(norm)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_bf16_autocast_step_runs_on_cpu(tmp_path: Path) -> None:
    trainer = Trainer(_cfg(tmp_path, precision="bf16", activation_checkpointing=True))
    loss, norm, reason = trainer.train_step()
    assert reason is None and np.isfinite(loss) and np.isfinite(norm)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    state = next(iter(trainer.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32


def test_rng_state_roundtrip_through_json() -> None:
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    state = json.loads(json.dumps(_rng_state()))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    _set_rng_state(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_read_metrics_views_attempts_as_one_run_and_skips_torn_lines(tmp_path: Path) -> None:
    # attempt 1 logged steps 1..7 and died; attempt 2 resumed from the step-5 checkpoint
    path = tmp_path / "metrics.jsonl"
    first = [{"event": "attempt", "step": 0, "attempt": 1}, {"event": "plan", "step": 0}]
    first += [{"event": "train", "step": s, "loss": 1.0 / s} for s in range(1, 8)]
    second = [{"event": "attempt", "step": 5, "attempt": 2}, {"event": "plan", "step": 5}]
    second += [{"event": "train", "step": s, "loss": 2.0 / s} for s in range(6, 9)]
    text = "\n".join(json.dumps(r) for r in first) + '\n{"event": "tra\n'
    path.write_text(text + "\n".join(json.dumps(r) for r in second) + "\n")
    view = [r for r in read_metrics(path) if r["event"] == "train"]
    assert [r["step"] for r in view] == list(range(1, 9))
    assert view[5]["loss"] == 2.0 / 6  # the redone step, not the first attempt's
    assert len(read_metrics(path, all_attempts=True)) == len(first) + len(second)
    assert [r["event"] for r in read_metrics(path)].count("plan") == 1


def test_plot_loss_curve(tmp_path: Path) -> None:
    recs = [{"event": "train", "step": s, "loss": 5.0 / s} for s in range(1, 20)]
    recs.append({"event": "eval", "step": 10, "val_loss": 0.6})
    plot_loss_curve(recs, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_compiled_steps_match_eager(tmp_path: Path, activation_checkpointing: bool) -> None:
    # ~90 s on 2 CPU cores (inductor compiles C++); the order AC → compile keeps parameter names.
    eager = Trainer(_cfg(tmp_path, activation_checkpointing=activation_checkpointing))
    comp = Trainer(_cfg(tmp_path, compile=True, activation_checkpointing=activation_checkpointing))
    assert list(comp.model.state_dict()) == list(eager.model.state_dict())
    for _ in range(3):
        (la, na, _), (lb, nb, _) = eager.train_step(), comp.train_step()
        assert la == pytest.approx(lb, rel=1e-5) and na == pytest.approx(nb, rel=1e-5)


def test_optional_loggers_and_out_dir_guard(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(LmforgeError, match="tensorboard package"):
            Trainer(_cfg(tmp_path, tensorboard=True, max_steps=1)).run()
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(LmforgeError, match="wandb package"):
            Trainer(_cfg(tmp_path, wandb="proj", max_steps=1)).run()
    Trainer(_cfg(tmp_path, max_steps=2, eval_every=0, plot=False, progress=False)).run()
    with pytest.raises(LmforgeError, match="already holds checkpoints"):
        Trainer(_cfg(tmp_path, resume=False))


def test_max_minutes_without_a_progress_bar_runs_past_step_20(tmp_path: Path) -> None:
    """A time budget sizes the bar after 20 steps; with the bar off (a non-interactive run, as
    the recipe's) that used to raise AttributeError ('tqdm' object has no attribute 'initial')."""
    cfg = _cfg(tmp_path, max_steps=22, max_minutes=60.0, eval_every=0, plot=False, progress=False)
    result = Trainer(cfg).run()
    assert result["iteration"] == 22


def test_max_minutes_stops_with_final_eval_and_checkpoint(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, max_steps=10_000, max_minutes=1e-6, eval_every=0, plot=False)
    val = write_shard(tmp_path / "v.bin", np.arange(500) % 97, 512, num_bytes=1000)
    cfg = RunConfig(
        model=cfg.model, train=cfg.train, data=DataConfig(train=cfg.data.train, val=(str(val),))
    )
    result = Trainer(cfg).run()
    assert result["stopped"] == "max_minutes" and result["iteration"] < 10_000
    assert np.isfinite(result["val_loss"]) and result["val_bpb"] > 0
    assert Path(result["checkpoint"]).name == f"step_{result['iteration']:07d}"
    attempt, plan = read_metrics(tmp_path / "run" / "metrics.jsonl")[:2]
    assert attempt == {"event": "attempt", "step": 0, "attempt": 1}
    assert plan["event"] == "plan" and plan["tokens_per_step"] == 2 * 16


def _master_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    # The model's weights as fp32: the masters where the model holds bf16 copies.
    state = {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}
    for name, (_, master) in trainer.masters.items():
        state[name] = master.detach().clone()
    return state


def _same_steps(a: list, b: list) -> None:
    # Same losses; norms to the last bits: torch 2.13's CPU foreach norm sums bf16 gradients
    # (the copies') in another order than the same values held in fp32 (autocast's).
    assert [r[0] for r in a] == [r[0] for r in b] and [r[2] for r in a] == [r[2] for r in b]
    np.testing.assert_allclose([r[1] for r in a], [r[1] for r in b], rtol=1e-6)


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7, msg=k)


def test_master_weights_train_exactly_like_autocast_over_fp32(tmp_path: Path) -> None:
    # bf16 copies of fp32 masters (train.master_weights=on) against bf16 autocast over fp32
    # weights: the same losses, norms and weights, bit for bit, with clipping active; the
    # checkpoint holds the fp32 masters, and a resumed run continues exactly.
    from lmforge.checkpoint import latest_checkpoint, load_model_state

    kw = dict(precision="bf16", grad_clip=0.5, lr=3e-3, warmup_steps=2, max_steps=8)
    runs = {}
    for mw in ("off", "on"):
        t = Trainer(_cfg(tmp_path / mw, master_weights=mw, **kw))
        t.deferred = True  # the same (sync-free) step on both
        t.current_lr = 0.0
        runs[mw] = (t, [t.train_step() for _ in range(4)])
    off, on = runs["off"][0], runs["on"][0]
    assert not off.masters
    linear = [n for n, p in on.model.named_parameters() if p.dtype == torch.bfloat16]
    assert linear and sorted(linear) == sorted(on.masters)
    assert "token_embeddings.weight" not in on.masters
    _same_steps(runs["off"][1], runs["on"][1])
    ref = _master_state(off)
    _same_state(ref, _master_state(on))
    for _, (copy, master) in on.masters.items():
        assert torch.equal(copy, master.bfloat16())
    on.save()
    saved = load_model_state(latest_checkpoint(on.out_dir) / "model.safetensors")
    assert all(saved[k].dtype == torch.float32 for k in ref)
    _same_state(ref, saved)
    # Resume from the checkpoint and compare four more steps with the uninterrupted run.
    resumed = Trainer(_cfg(tmp_path / "on", master_weights="on", **kw))
    resumed.deferred = True
    assert resumed.iteration == 4
    more = [resumed.train_step() for _ in range(4)]
    _same_steps(more, [off.train_step() for _ in range(4)])
    _same_state(_master_state(off), _master_state(resumed))


def test_master_weights_setting_resolves_and_refuses_clearly(tmp_path: Path) -> None:
    # auto stays off on a CPU; on needs bf16 autocast, one process and no accumulation.
    assert not Trainer(_cfg(tmp_path / "a", precision="bf16")).masters
    with pytest.raises(LmforgeError, match=r"master_weights=on needs train\.precision=bf16"):
        Trainer(_cfg(tmp_path / "b", master_weights="on"))
    with pytest.raises(LmforgeError, match=r"train\.grad_accum=1 \(got 2"):
        Trainer(_cfg(tmp_path / "c", master_weights="on", precision="bf16", grad_accum=2))
    with pytest.raises(LmforgeError, match=r"train\.master_weights must be auto, on or off"):
        Trainer(_cfg(tmp_path / "d", master_weights="yes"))
