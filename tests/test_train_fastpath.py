"""The fast-path resolver (lmforge.train.fastpath, lmforge.model.fastpath): every branch on CPU.

Pure functions of (model config, train config, runtime): no device is touched, so the CUDA and
multi-process rows are checked here too.
"""

from __future__ import annotations

import dataclasses

import pytest

from lmforge.config import load_run_config
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.fastpath import resolve_backends
from lmforge.parallel.config import ParallelConfig
from lmforge.train.config import TrainConfig
from lmforge.train.fastpath import FastPathRuntime, resolve_fast_path, strategy_kind
from lmforge.utils.errors import LmforgeError

AUTO = ModelConfig(
    vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=2,
    attention="auto", norm="auto", rope="auto", swiglu="auto",
)  # fmt: skip
CUDA = FastPathRuntime(device_type="cuda", triton=True)
CPU = FastPathRuntime()


def _rt(kind: str = "single", device: str = "cuda", triton: bool = True) -> FastPathRuntime:
    return FastPathRuntime(
        device_type=device, world_size=1 if kind == "single" else 2, strategy=kind, triton=triton
    )


def test_model_backends_auto_resolve_per_device() -> None:
    cuda = resolve_backends(AUTO, "cuda", triton=True)
    assert (cuda.attention, cuda.norm, cuda.rope, cuda.swiglu) == (
        "sdpa", "reference", "packed", "triton",
    )  # fmt: skip
    cpu = resolve_backends(AUTO, "cpu", triton=True)
    assert (cpu.attention, cpu.norm, cpu.rope, cpu.swiglu) == ("sdpa",) + ("reference",) * 3
    no_triton = resolve_backends(AUTO, "cuda", triton=False)
    assert (no_triton.rope, no_triton.swiglu) == ("reference", "reference")
    # Concrete choices are kept; a config without auto comes back as it is.
    explicit = dataclasses.replace(AUTO, attention="flash", norm="triton")
    assert resolve_backends(explicit, "cpu").attention == "flash"
    assert resolve_backends(explicit, "cpu").norm == "triton"
    plain = ModelConfig()
    assert resolve_backends(plain, "cuda", triton=True) is plain


def test_model_built_on_cpu_holds_the_resolved_backends() -> None:
    model = TransformerLM(AUTO)
    assert model.config == resolve_backends(AUTO, "cpu")
    assert model.layers[0].attn.backend == "sdpa" and model.layers[0].ffn.backend == "reference"


def test_single_cuda_process_takes_the_whole_fast_path() -> None:
    tc = TrainConfig(compile=True, cuda_graph=True, loss="auto", master_weights="auto")
    fp = resolve_fast_path(AUTO, tc, CUDA)
    assert (fp.loss, fp.adamw, fp.master_weights) == ("fused", "triton", True)
    assert fp.sync_free and fp.clip_in_update and fp.cuda_graph and fp.compile
    assert fp.model_config(AUTO).rope == "packed"
    assert "CUDA graph" in fp.summary() and "adamw triton" in fp.summary()


def test_cpu_keeps_the_reference_paths() -> None:
    tc = TrainConfig(cuda_graph=True, loss="auto", compile=True)
    fp = resolve_fast_path(AUTO, tc, CPU)
    assert (fp.loss, fp.adamw, fp.master_weights) == ("reference", "foreach", False)
    assert not (fp.sync_free or fp.clip_in_update or fp.cuda_graph)
    # Forced master weights on a CPU: the sync-free step comes with them (clip in the update).
    fp = resolve_fast_path(AUTO, TrainConfig(master_weights="on"), CPU)
    assert fp.master_weights and fp.sync_free and fp.clip_in_update
    # An explicit fused loss runs on a CPU too (its torch chunk path).
    assert resolve_fast_path(AUTO, TrainConfig(loss="fused"), CPU).loss == "fused"


def test_adamw_paths() -> None:
    # auto: triton where the optimizer sees whole fp32 tensors; compiled with compile on CUDA.
    assert resolve_fast_path(AUTO, TrainConfig(), _rt("ddp")).adamw == "triton"
    assert resolve_fast_path(AUTO, TrainConfig(), _rt("fsdp")).adamw == "triton"
    assert resolve_fast_path(AUTO, TrainConfig(compile=True), _rt("zero1")).adamw == "compiled"
    assert resolve_fast_path(AUTO, TrainConfig(), _rt("tp")).adamw == "foreach"
    assert resolve_fast_path(AUTO, TrainConfig(), _rt(triton=False)).adamw == "foreach"
    assert resolve_fast_path(AUTO, TrainConfig(adamw="foreach"), CUDA).adamw == "foreach"
    with pytest.raises(LmforgeError, match=r"train\.adamw=triton needs a CUDA device"):
        resolve_fast_path(AUTO, TrainConfig(adamw="triton"), CPU)
    with pytest.raises(LmforgeError, match=r"got cuda, pp"):
        resolve_fast_path(AUTO, TrainConfig(adamw="triton"), _rt("pp"))
    with pytest.raises(LmforgeError, match=r"train\.adamw must be"):
        resolve_fast_path(AUTO, TrainConfig(adamw="fast"), CUDA)  # type: ignore[arg-type]


def test_master_weights_rules() -> None:
    assert resolve_fast_path(AUTO, TrainConfig(), _rt("ddp")).master_weights
    assert resolve_fast_path(AUTO, TrainConfig(), _rt("zero1")).master_weights
    assert not resolve_fast_path(AUTO, TrainConfig(), _rt("fsdp")).master_weights
    assert not resolve_fast_path(AUTO, TrainConfig(grad_accum=2), CUDA).master_weights
    assert not resolve_fast_path(AUTO, TrainConfig(precision="fp32"), CUDA).master_weights
    assert not resolve_fast_path(AUTO, TrainConfig(master_weights="off"), CUDA).master_weights
    with pytest.raises(LmforgeError, match=r"master_weights=on needs train\.precision=bf16"):
        resolve_fast_path(AUTO, TrainConfig(master_weights="on", precision="fp32"), CUDA)
    with pytest.raises(LmforgeError, match=r"got fsdp"):
        resolve_fast_path(AUTO, TrainConfig(master_weights="on"), _rt("fsdp"))
    with pytest.raises(LmforgeError, match=r"must be auto, on or off"):
        resolve_fast_path(AUTO, TrainConfig(master_weights="yes"), CUDA)  # type: ignore[arg-type]


def test_fused_loss_rules() -> None:
    auto = TrainConfig(loss="auto")
    assert resolve_fast_path(AUTO, auto, _rt("ddp")).loss == "fused"
    assert resolve_fast_path(AUTO, auto, _rt("zero1")).loss == "fused"
    assert resolve_fast_path(AUTO, auto, _rt("fsdp")).loss == "reference"
    capped = dataclasses.replace(AUTO, logit_soft_cap=30.0)
    assert resolve_fast_path(capped, auto, CUDA).loss == "reference"
    assert resolve_fast_path(AUTO, TrainConfig(loss="reference"), CUDA).loss == "reference"
    with pytest.raises(LmforgeError, match=r"train\.loss=fused needs model\.logit_soft_cap"):
        resolve_fast_path(capped, TrainConfig(loss="fused"), CUDA)
    with pytest.raises(LmforgeError, match=r"got tp"):
        resolve_fast_path(AUTO, TrainConfig(loss="fused"), _rt("tp"))
    with pytest.raises(LmforgeError, match=r"loss_chunk_rows must be 0 or more"):
        resolve_fast_path(AUTO, TrainConfig(loss_chunk_rows=-1), CUDA)
    with pytest.raises(LmforgeError, match=r"train\.loss must be"):
        resolve_fast_path(AUTO, TrainConfig(loss="liger"), CUDA)  # type: ignore[arg-type]


def test_step_rules_per_strategy() -> None:
    tc = TrainConfig(cuda_graph=True)
    ddp = resolve_fast_path(AUTO, tc, _rt("ddp"))
    assert ddp.sync_free and ddp.clip_in_update and not ddp.cuda_graph
    fsdp = resolve_fast_path(AUTO, tc, _rt("fsdp"))
    assert fsdp.sync_free and not fsdp.clip_in_update and not fsdp.cuda_graph
    for kind in ("zero1", "tp", "pp"):
        fp = resolve_fast_path(AUTO, tc, _rt(kind))
        assert not (fp.sync_free or fp.clip_in_update or fp.cuda_graph), kind
    assert not resolve_fast_path(AUTO, TrainConfig(cuda_graph=False), CUDA).cuda_graph


def test_strategy_kind() -> None:
    assert strategy_kind(ParallelConfig(), 1) == "single"
    assert strategy_kind(ParallelConfig(), 2) == "ddp"
    assert strategy_kind(ParallelConfig(zero1=True), 2) == "zero1"
    assert strategy_kind(ParallelConfig(fsdp=True, zero1=True), 2) == "fsdp"
    assert strategy_kind(ParallelConfig(tp=2), 2) == "tp"
    assert strategy_kind(ParallelConfig(pp=2), 2) == "pp"


def test_presets_agree_with_the_measurements() -> None:
    # Both GPT-2-small presets resolve to the same (measured-best) model path on CUDA.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    a = load_run_config(root / "gpt2-small.toml").model
    b = load_run_config(root / "gpt2-small-train.toml").model
    for cfg in (a, b):
        r = resolve_backends(cfg, "cuda", triton=True)
        assert (r.attention, r.norm, r.rope, r.swiglu) == ("sdpa", "reference", "packed", "triton")


def test_a_joined_process_group_counts_as_distributed() -> None:
    assert strategy_kind(ParallelConfig(), 1, process_group=True) == "ddp"
    assert strategy_kind(ParallelConfig(fsdp=True), 1, process_group=True) == "fsdp"
