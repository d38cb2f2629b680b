"""The planner's cost model: formulas, monotonic trends, crossover shifts, CLI."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lmforge.parallel.planner import (
    GPT2_SMALL_BENCH,
    HARDWARE,
    MODELS,
    Hardware,
    Mix,
    ModelSpec,
    calibrate,
    collective_time,
    compute_time,
    dp_comm_time,
    estimate,
    fsdp_crossover,
    fsdp_times,
    memory_per_gpu,
    plan,
    predict_step_time,
)

HW = Hardware(latency=0.0)  # pure bandwidth terms make the formulas checkable by hand
M7 = MODELS["7b"]


def test_memory_zero_stages_divide_the_right_terms() -> None:
    full = memory_per_gpu(M7, Mix(dp=8), 4096, 1, 1)
    assert full["weights"] == pytest.approx(2 * M7.total_params)
    assert full["grads"] == pytest.approx(2 * M7.total_params)
    assert full["optimizer"] == pytest.approx(12 * M7.total_params)
    z1 = memory_per_gpu(M7, Mix(dp=8, zero=1), 4096, 1, 1)
    z2 = memory_per_gpu(M7, Mix(dp=8, zero=2), 4096, 1, 1)
    z3 = memory_per_gpu(M7, Mix(dp=8, zero=3), 4096, 1, 1)
    assert z1["optimizer"] == pytest.approx(full["optimizer"] / 8)
    assert z1["grads"] == full["grads"] and z2["grads"] == pytest.approx(full["grads"] / 8)
    assert z2["weights"] == full["weights"] and z3["weights"] == pytest.approx(full["weights"] / 8)
    rc = memory_per_gpu(M7, Mix(dp=8, recompute=True), 4096, 1, 1)
    assert rc["activations"] < full["activations"] / 8  # block inputs plus one live block
    tp = memory_per_gpu(M7, Mix(dp=1, tp=8), 4096, 1, 1)
    assert tp["weights"] == pytest.approx(full["weights"] / 8)
    # tp splits the per-head and FFN activations, not the d-wide norm and matmul inputs.
    assert full["activations"] / 8 < tp["activations"] < full["activations"] / 2
    pp = memory_per_gpu(M7, Mix(dp=1, pp=4), 4096, 1, 4)  # 1F1B: 4 micro-batches in flight
    assert pp["weights"] == pytest.approx(full["weights"] / 4)
    assert pp["activations"] > full["activations"]  # 1/4 of the blocks, 4 micro-batches


def test_planner_memory_is_the_accounting_memory_model() -> None:
    # One memory model: the planner's per-GPU bytes are accounting.memory_estimate with bf16
    # master weights and the mix as a Sharding, for every named model and mix kind.
    from lmforge.model import accounting

    mixes = [Mix(dp=8), Mix(dp=8, zero=1), Mix(dp=8, zero=3, recompute=True), Mix(2, 4, 2)]
    for model in [*MODELS.values(), GPT2_SMALL_BENCH]:
        for mix in mixes:
            got = memory_per_gpu(model, mix, 2048, 2, 2 if mix.pp > 1 else 1)
            est = accounting.memory_estimate(
                model.config, 2, 2048, "bf16", mix.recompute, fused_attention=True,
                master_weights=True,
                sharding=accounting.Sharding(mix.dp, mix.tp, mix.pp, mix.zero,
                                             2 if mix.pp > 1 else 1),
            )  # fmt: skip
            want = [est.parameters, est.gradients, est.optimizer, est.activations]
            assert list(got.values()) == [float(x) for x in want]
            # The state is the previous 16 bytes/parameter accounting (ZeRO paper), unchanged.
            n = model.total_params / (mix.tp * mix.pp)
            shard = {k: mix.dp if mix.zero >= z else 1 for k, z in (("o", 1), ("g", 2), ("w", 3))}
            assert got["weights"] == pytest.approx(2 * n / shard["w"], rel=1e-9)
            assert got["grads"] == pytest.approx(2 * n / shard["g"], rel=1e-9)
            assert got["optimizer"] == pytest.approx(12 * n / shard["o"], rel=1e-9)


def test_one_device_plan_memory_equals_bench_model_estimate() -> None:
    # `lmforge plan` on one GPU and `lmforge bench model`'s estimate are the same function:
    # with the same layout (master weights) the figures agree exactly; the fp32-weight layout
    # (bench model, the trainer's default) has the same 16 bytes/parameter, split 4 + 4 + 8.
    from lmforge.model import accounting

    cfg = GPT2_SMALL_BENCH.config
    plan_mem = memory_per_gpu(GPT2_SMALL_BENCH, Mix(dp=1), 1024, 8, 1)
    est = accounting.memory_estimate(cfg, 8, 1024, "bf16", master_weights=True)
    assert sum(plan_mem.values()) == est.total
    fp32 = accounting.memory_estimate(cfg, 8, 1024, "bf16")
    state = fp32.parameters + fp32.gradients + fp32.optimizer
    assert state == est.parameters + est.gradients + est.optimizer == 16 * 162_220_800
    # autocast's saved bf16 weight copies are the whole activation difference of the layouts
    assert fp32.activations - est.activations == pytest.approx(
        2 * accounting.matmul_parameters(cfg), rel=1e-6
    )


def test_sharding_is_checked() -> None:
    from lmforge.model import accounting

    with pytest.raises(ValueError, match="zero"):
        accounting.Sharding(zero=4)
    with pytest.raises(ValueError, match="tp"):
        accounting.Sharding(tp=0)


def test_size_only_models_get_a_shape_of_that_size() -> None:
    from lmforge.model import accounting
    from lmforge.parallel.planner import config_for

    cfg = config_for(13e9, 40, 5120)
    assert cfg.n_layers == 40 and cfg.d_model == 5120
    assert accounting.parameter_count(cfg) == pytest.approx(13e9, rel=1e-3)
    small = config_for(1e6, 2, 256)  # embeddings alone exceed it: the default FFN width
    assert small.d_ff is None
    mem = memory_per_gpu(ModelSpec("x", 13e9, 40, 5120), Mix(dp=1), 2048, 1, 1)
    assert mem["weights"] == pytest.approx(2 * 13e9)  # the given size, not the shape's count


def test_compute_and_communication_formulas() -> None:
    tokens = 1024 * 4096
    assert compute_time(M7, tokens, 64, HW) == pytest.approx(
        6 * M7.total_params * tokens / (64 * 989e12 * 0.45)
    )
    p = M7.total_params
    # Inside one NVLink domain: a ring all-reduce sends 2·(n−1)/n of the bytes per GPU.
    assert collective_time(p * 2, 8, HW) == pytest.approx(2 * p * 2 * 7 / 8 / 450e9)
    # ZeRO-3 moves 3× the parameter bytes, DDP 2×: the 1.5× of the issue.
    ddp = dp_comm_time(M7, Mix(dp=8), HW)
    z3 = dp_comm_time(M7, Mix(dp=8, zero=3), HW)
    assert z3 / ddp == pytest.approx(1.5)
    # Across domains only 1/k of the bytes per GPU go over the slow links.
    t = collective_time(1e9, 64, HW, "all_gather")
    assert t == pytest.approx(1e9 * 7 / 8 / 450e9 + 1e9 / 8 * 7 / 8 / 50e9)


def test_fsdp_crossover_moves_with_batch_sparsity_and_domain() -> None:
    base = fsdp_crossover(M7, HW, 1024, 4096)
    assert base is not None
    c, m = fsdp_times(M7, HW, int(base), 1024, 4096)
    assert m >= c  # communication has caught up at the crossover …
    c, m = fsdp_times(M7, HW, int(base) - 1, 1024, 4096)
    assert m < c  # … and not one GPU earlier
    bigger = fsdp_crossover(M7, HW, 4096, 4096)
    sparse = fsdp_crossover(
        dataclasses.replace(M7, active_params=M7.total_params / 4), HW, 1024, 4096
    )
    tpu = fsdp_crossover(M7, dataclasses.replace(HW, domain_size=64), 1024, 4096)
    assert bigger > base  # a larger batch moves it right
    assert sparse < base  # sparsity moves it left
    assert tpu > base  # bigger fast domains help
    # Pure bandwidth model: crossover ∝ tokens per step (4× batch → ~4× GPUs).
    assert bigger / base == pytest.approx(4, rel=0.02)


def test_plan_finds_feasible_mixes_and_binding_constraints() -> None:
    ests = plan(MODELS["70b"], Hardware(), 1024, 1024, 4096)
    feasible = [e for e in ests if e.feasible]
    assert feasible and all(e.memory_total <= 141e9 * 0.9 for e in feasible)
    assert feasible[0].step_s == min(e.step_s for e in feasible)
    assert all(0 < e.mfu <= 0.45 + 1e-9 for e in feasible)
    # Plain DDP of a 70B model cannot fit 16 bytes/param on one GPU.
    ddp = estimate(MODELS["70b"], Hardware(), Mix(dp=1024), 1024, 4096)
    assert not ddp.feasible and ddp.binding == "memory"
    # More data-parallel ranks than sequences: the batch floor.
    floor = estimate(M7, Hardware(), Mix(dp=2048, zero=3), 1024, 4096)
    assert not floor.feasible and floor.binding == "batch floor"
    # Far past the crossover FSDP is communication-bound.
    comm_bound = estimate(M7, Hardware(), Mix(dp=8192, zero=3), 8192, 512)
    assert comm_bound.binding == "dp-comm"


def test_pipeline_bubble_and_tp_cost() -> None:
    e = estimate(M7, HW, Mix(dp=8, pp=4), 256, 4096)
    m = 256 // 8
    assert e.bubble == pytest.approx(3 / m)
    assert e.step_s >= e.compute_s * (1 + 3 / m)
    t = estimate(M7, HW, Mix(dp=8, tp=8), 256, 4096)
    assert t.comm_s["tp"] > 0 and t.step_s > t.compute_s


def test_predict_step_time() -> None:
    single = predict_step_time(124e6, 16 * 1024, 1)
    assert single == pytest.approx(6 * 124e6 * 16 * 1024 / (989e12 * 0.45))
    two = predict_step_time(124e6, 2 * 16 * 1024, 2, "ddp")
    assert two >= single  # same per-GPU work, plus whatever communication is not hidden
    assert predict_step_time(124e6, 2 * 16 * 1024, 2, "fsdp") >= single
    with pytest.raises(ValueError):
        predict_step_time(1e9, 1e6, 2, "nope")
    with pytest.raises(ValueError):
        predict_step_time(1e9, 1e6, 1, "nope")
    assert math.isfinite(predict_step_time(405e9, 16e6, 16384, "fsdp"))


def test_custom_model_spec_active_defaults_to_total() -> None:
    m = ModelSpec("x", 1e9, 10, 1024)
    assert m.active == 1e9
    assert dataclasses.replace(m, active_params=2e8).active == 2e8


def test_plan_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from lmforge.cli import main

    assert main(["plan", "--model", "70b", "--gpus", "1024", "--top", "3", "--crossover"]) == 0
    out = capsys.readouterr().out
    assert "| mix |" in out and "best:" in out and "4× global batch" in out
    assert main(["plan", "--model", "nope"]) == 2
    assert "unknown --model 'nope'" in capsys.readouterr().err
    assert (
        main(["plan", "--params", "1e12", "--layers", "100", "--d-model", "20000", "--gpus", "8"])
        == 1  # nothing fits: a non-zero exit
    )
    assert "no feasible mix" in capsys.readouterr().out


def _predict(hw: Hardware, strategy: str, gpus: int, tokens_per_gpu: int) -> float:
    m = GPT2_SMALL_BENCH
    return predict_step_time(
        m.total_params,
        tokens_per_gpu * gpus,
        gpus,
        strategy,
        hw,
        flops_per_token=m.flops_per_token,
        n_units=m.n_layers + 2,
    )


def test_bench_model_spec_matches_accounting() -> None:
    from lmforge.model import ModelConfig, accounting

    cfg = ModelConfig(vocab_size=50304, context_length=1024, d_model=768, n_layers=12, n_heads=12)
    assert GPT2_SMALL_BENCH.total_params == accounting.parameter_count(cfg)
    assert GPT2_SMALL_BENCH.flops_per_token == accounting.flops_per_token(cfg, 1024)
    # The MFU the fit implies is lmforge's own MFU of the measured throughput.
    hw = calibrate(0.0689, GPT2_SMALL_BENCH, 32 * 1024)
    assert hw.mfu == pytest.approx(
        accounting.model_flops_utilization(32 * 1024 / 0.0689, cfg, 1024, 989e12)
    )


@pytest.mark.parametrize(("step_s", "tokens"), [(0.0814, 16 * 1024), (0.0689, 32 * 1024)])
def test_calibrate_round_trip_single_gpu(step_s: float, tokens: int) -> None:
    hw = calibrate(step_s, GPT2_SMALL_BENCH, tokens)
    assert _predict(hw, "single", 1, tokens) == pytest.approx(step_s, rel=0.01)
    # Same per-GPU work on more GPUs with no communication model: the same step.
    assert _predict(hw, "single", 4, tokens) == pytest.approx(step_s, rel=0.01)
    # Only the MFU moved; the interconnect stays nominal.
    assert dataclasses.replace(hw, mfu=0.45, source=Hardware().source) == Hardware()
    # Twice the tokens at the fitted MFU: twice the time (compute-bound, linear).
    assert _predict(hw, "single", 1, 2 * tokens) == pytest.approx(2 * step_s, rel=1e-9)


def test_presets_are_the_documented_fits() -> None:
    assert HARDWARE["h200"] == Hardware()
    eager = calibrate(0.0814, GPT2_SMALL_BENCH, 16 * 1024)
    compiled = calibrate(0.0689, GPT2_SMALL_BENCH, 32 * 1024)
    assert HARDWARE["h200-eager"].mfu == pytest.approx(eager.mfu, rel=1e-4)
    assert HARDWARE["h200-compiled"].mfu == pytest.approx(compiled.mfu, rel=1e-4)
    assert "81.4 ms" in HARDWARE["h200-eager"].source
    assert "68.9 ms" in HARDWARE["h200-compiled"].source
    assert _predict(HARDWARE["h200-eager"], "single", 1, 16 * 1024) == pytest.approx(
        0.0814, rel=0.01
    )
    assert _predict(HARDWARE["h200-compiled"], "single", 1, 32 * 1024) == pytest.approx(
        0.0689, rel=0.01
    )


@pytest.mark.parametrize("ddp_ms", [81.0, 81.9, 85.8, 120.0])
def test_calibrate_communication_round_trip(ddp_ms: float) -> None:
    tokens = 16 * 1024
    hw = calibrate(0.0814, GPT2_SMALL_BENCH, tokens, ddp_step_s=ddp_ms / 1e3)
    pred = _predict(hw, "ddp", 2, tokens)
    # A DDP step faster than the 1-GPU compute cannot be matched (the model never beats compute):
    # perfect overlap is the closest; otherwise the fit reproduces the DDP step.
    assert pred == pytest.approx(max(ddp_ms, 81.4) / 1e3, rel=0.01)
    assert _predict(hw, "single", 1, tokens) == pytest.approx(0.0814, rel=0.01)
    assert 0.0 <= hw.comm_overlap <= 1.0
    if ddp_ms <= 81.4:
        assert hw.comm_overlap == 1.0 and hw.nvlink_bw == Hardware().nvlink_bw
    elif ddp_ms < 82.0:  # a little exposed: partial overlap at nominal bandwidth
        assert 0.0 < hw.comm_overlap < 1.0 and hw.nvlink_bw == Hardware().nvlink_bw
    else:  # more than the whole nominal all-reduce: no overlap and a lower bandwidth
        assert hw.comm_overlap == 0.0 and hw.nvlink_bw < Hardware().nvlink_bw
    # The fitted hardware predicts the other strategies too, each at least the compute.
    assert _predict(hw, "fsdp", 2, tokens) >= 0.0814 * 0.999
    assert _predict(hw, "zero1", 2, tokens) > pred  # plus the exposed parameter broadcast


def test_calibrate_rejects_impossible_inputs() -> None:
    with pytest.raises(ValueError, match="of peak"):
        calibrate(1e-6, GPT2_SMALL_BENCH, 16 * 1024)
    with pytest.raises(ValueError):
        calibrate(0.0, GPT2_SMALL_BENCH, 16 * 1024)
    with pytest.raises(ValueError, match="one domain"):
        calibrate(0.0814, GPT2_SMALL_BENCH, 16 * 1024, ddp_step_s=0.09, ddp_gpus=16)


def test_comm_overlap_interpolates_between_max_and_sum() -> None:
    m, tokens = GPT2_SMALL_BENCH, 16 * 1024
    full = _predict(Hardware(mfu=0.17), "ddp", 2, tokens)
    none = _predict(Hardware(mfu=0.17, comm_overlap=0.0), "ddp", 2, tokens)
    compute = _predict(Hardware(mfu=0.17), "single", 1, tokens)
    comm = collective_time(
        m.total_params * 4, 2, Hardware(), "all_reduce", math.ceil(m.total_params * 4 / 25e6)
    )
    assert full == pytest.approx(max(compute, comm))
    assert none == pytest.approx(compute + comm)
    half = _predict(Hardware(mfu=0.17, comm_overlap=0.5), "ddp", 2, tokens)
    assert half == pytest.approx(compute + comm / 2)
    # estimate() applies the same rule to the overlapped DP traffic.
    e1 = estimate(M7, HW, Mix(dp=64, zero=3), 64, 4096)
    e0 = estimate(M7, dataclasses.replace(HW, comm_overlap=0.0), Mix(dp=64, zero=3), 64, 4096)
    assert e0.step_s == pytest.approx(e1.compute_s + e1.comm_s["dp"])
    assert e1.step_s == pytest.approx(max(e1.compute_s, e1.comm_s["dp"]))


def test_plan_cli_hardware_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from lmforge.cli import main

    assert main(["plan", "--model", "7b", "--gpus", "64", "--hardware", "h200-eager"]) == 0
    assert "17.4%" in capsys.readouterr().out  # compute-bound at the eager MFU
    assert main(["plan", "--hardware", "nope"]) == 2
    assert "unknown --hardware 'nope'" in capsys.readouterr().err
    # An explicit flag overrides the preset.
    args = ["plan", "--model", "7b", "--gpus", "64", "--hardware", "h200-eager", "--mfu", "0.3"]
    assert main(args) == 0
    assert "30.0%" in capsys.readouterr().out


def test_calibration_benchmark_table() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "planner.py"
    spec = importlib.util.spec_from_file_location("_planner_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, table = mod.calibration_table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(mod.MEASURED)
    calib = [ln for ln in lines if ln.endswith("| calibration point |")]
    assert len(calib) == 2 and all("(+0.0%) |" in ln.split("|")[7] + "|" for ln in calib)


def test_plan_accepts_config_presets(capsys: pytest.CaptureFixture[str]) -> None:
    # The configs/ presets (1b, 350m) plan like the built-in shapes, with their exact counts.
    from lmforge.cli import main
    from lmforge.model import accounting, load_preset

    assert (
        main(["plan", "--model", "1b", "--gpus", "8", "--global-batch", "64", "--seq", "2048"]) == 0
    )
    out = capsys.readouterr().out
    billions = accounting.parameter_count(load_preset("1b")) / 1e9
    assert out.startswith(f"# 1b: {billions:.1f}B params") and "best:" in out
    assert main(["plan", "--model", "350m", "--gpus", "8", "--top", "2"]) == 0


def test_plan_exits_nonzero_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    from lmforge.cli import main

    assert main(["plan", "--model", "405b", "--gpus", "2", "--global-batch", "8"]) == 1
    assert "no feasible mix" in capsys.readouterr().out


def test_plan_never_picks_a_dp_degree_that_does_not_divide_the_batch() -> None:
    # 12 sequences on 8 GPUs: dp 8 would give 1.5 sequences a rank; the plan splits evenly.
    model = MODELS["gpt2-small"]
    ests = plan(model, Hardware(), 8, 12, 1024)
    assert all(12 % e.mix.dp == 0 for e in ests if e.feasible)
    bad = [e for e in ests if e.mix.dp == 8]
    assert bad and all(not e.feasible and e.binding == "batch split" for e in bad)


def test_plan_cli_memory_comes_from_the_presets_shape(capsys: pytest.CaptureFixture[str]) -> None:
    # `lmforge plan --model 70b` prints the memory of the 70b shape (memory_per_gpu of MODELS,
    # grouped-query attention included), not of config_for's size-only stand-in (6 GB apart).
    from lmforge.cli import main

    args = ["plan", "--model", "70b", "--gpus", "8", "--global-batch", "8", "--all"]
    assert main([*args, "--top", "100"]) == 1  # nothing fits 8 GPUs
    out = capsys.readouterr().out
    row = next(r for r in out.splitlines() if r.startswith("| dp8 zero3 |"))
    m70 = MODELS["70b"]
    mem = sum(memory_per_gpu(m70, Mix(dp=8, zero=3), 4096, 1, 1).values())
    stand_in = memory_per_gpu(dataclasses.replace(m70, config=None), Mix(dp=8, zero=3), 4096, 1, 1)
    assert abs(mem - sum(stand_in.values())) > 1e9
    assert row.split("|")[2].strip() == f"{mem / 1e9:.1f}"
