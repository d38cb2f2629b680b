"""The tuned GEMM (lmforge.kernels.matmul, train.matmul): the op and its gradients everywhere,
the cuBLASLt candidates and the trainer on a GPU (tier ``gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.kernels import _ops, matmul
from lmforge.model import TransformerLM, load_preset
from lmforge.model.layers import Linear, _fusable
from lmforge.train.trainer import _set_tuned_matmul

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _switch_off():
    yield
    matmul.TUNED = False


def test_linear_matches_matmul_with_gradients() -> None:
    # On the CPU the op runs torch's matmul: same values, and W's gradient comes out contiguous
    # in W's own layout (computed as (gᵀ x), not transposed from (xᵀ g)).
    matmul.TUNED = True
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    w = torch.randn(7, 8, generator=g, requires_grad=True)
    y = matmul.linear(x, w)
    want = matmul.matmul_reference(x, w.t())
    assert torch.equal(y, want)
    dy = torch.randn(y.shape, generator=g)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx_ref, dw_ref = torch.autograd.grad(want, (x, w), dy)
    assert torch.equal(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)
    assert dw.is_contiguous()


def test_mm_tuned_opcheck() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 4, generator=g, requires_grad=True)
    for b in (
        torch.randn(4, 5, generator=g).requires_grad_(),
        torch.randn(5, 4, generator=g).t().requires_grad_(),  # Wᵀ, as Linear passes it
    ):
        torch.library.opcheck(_ops.mm_tuned, (a, b))


def test_mm_into_accumulates() -> None:
    matmul.TUNED = True
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(5, 3, generator=g), torch.randn(3, 4, generator=g)
    out = torch.randn(5, 4, generator=g)
    want = out + a @ b
    matmul.mm_into(a, b, out, accumulate=True)
    torch.testing.assert_close(out, want)
    matmul.mm_into(a, b, out)
    torch.testing.assert_close(out, a @ b)


def test_model_with_tuned_linears_matches_and_compiles() -> None:
    # The switch routes every Linear (and the packed projections) through the op; on the CPU the
    # outputs are torch's, eager and compiled with fullgraph (the op is one graph node).
    torch.manual_seed(0)
    model = TransformerLM(load_preset("tiny"))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    want = model(ids)
    _set_tuned_matmul(model, True)
    assert all(m.matmul is matmul.linear for m in model.modules() if isinstance(m, Linear))
    assert torch.equal(model(ids), want)
    got = torch.compile(model, fullgraph=True)(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.float().square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    _set_tuned_matmul(model, False)
    assert all(m.matmul is None for m in model.modules() if isinstance(m, Linear))


def test_operand_layouts_map_to_column_major() -> None:
    # A row-major (r, c) operand is cuBLASLt's column-major (c, r) untransposed; the transpose of
    # a contiguous (c, r) tensor is column-major (r, c) read transposed; anything else is copied.
    from lmforge.kernels import _cublaslt as lt

    x = torch.randn(6, 4)
    assert lt._operand(x) == (False, 4, 6, 4)
    assert lt._operand(torch.randn(4, 6).t()) == (True, 6, 4, 6)
    assert lt._operand(torch.randn(6, 8)[:, :4]) == (False, 4, 6, 8)  # a row stride > cols
    strided = torch.randn(6, 8)[:, ::2]
    with pytest.raises(lt.LtError, match="not a matrix"):
        lt._operand(strided)
    fixed = lt._matrix(strided)
    assert fixed.is_contiguous() and torch.equal(fixed, strided)
    assert lt._matrix(x) is x


def test_choices_round_trip_through_a_checkpoint_record() -> None:
    # What a checkpoint records ({key text: index and configuration}) is used again only for the
    # same problem with the same configuration at that index; anything else is tuned afresh.
    import json

    from lmforge.kernels import _cublaslt as lt

    key = (8, 4, 2, False, 4, 2, 4, False, 2, 8, 2, torch.bfloat16, torch.bfloat16, 16)
    plan = lt.LtPlan(key, None, None, None, None, [])
    lt._PLANS[key] = plan
    try:
        lt._CHOICE[(*key, False)] = -1
        saved = json.loads(json.dumps(lt.choices()))  # the trainer state is JSON
        text = lt._key_text((*key, False))
        assert saved[text] == {"index": -1, "algo": "torch"}
        del lt._CHOICE[(*key, False)]
        lt.preset_choices(saved)
        assert lt._preset(plan, (*key, False)) == -1
        assert lt._preset(plan, (*key, True)) is None  # another problem
        lt.preset_choices({text: {"index": 3, "algo": "id=66 tile=20"}})
        assert lt._preset(plan, (*key, False)) is None  # no such candidate here
    finally:
        lt._PLANS.pop(key, None)
        lt._CHOICE.pop((*key, False), None)
        lt._PRESET.clear()


def test_wide_search_variants_cover_the_grid_once() -> None:
    # The configurations tried around one candidate: the grid of the axes given (tiles, custom
    # options, cluster shapes: its own cluster first; an omitted axis keeps the base's value),
    # then split-K factors on its own tile, reducing in the compute type where it had no
    # reduction; never the candidate itself, never twice.
    from lmforge.kernels import _cublaslt as lt

    base = {"tile": 20, "custom": 1, "cluster": 3, "splitk": 1, "reduction": 0}
    got = lt.variants(base, tiles=[20, 29], customs=2, clusters=(2, 3), splits=(1, 2, 4))
    keys = [tuple(sorted(v.items())) for v in got]
    assert len(keys) == len(set(keys)) and tuple(sorted(base.items())) not in keys
    grid = {(v["tile"], v["custom"], v["cluster"]) for v in got if v["splitk"] == 1}
    assert grid == {(t, c, k) for t in (20, 29) for c in range(3) for k in (2, 3)} - {(20, 1, 3)}
    assert got[0] == {**base, "custom": 0}  # ordered: tiles, then customs, then clusters
    splits = [v for v in got if v["splitk"] != 1]
    assert splits == [{**base, "splitk": s, "reduction": 2} for s in (2, 4)]
    tiles_only = lt.variants(base, tiles=[7, 20, 29])
    assert tiles_only == [{**base, "tile": 7}, {**base, "tile": 29}]
    shapes = lt.variants(base, customs=1, clusters=(2,))
    assert [(v["custom"], v["cluster"]) for v in shapes] == [(0, 3), (0, 2), (1, 2)]
    assert lt.variants(base) == []


def test_tuning_summary_counts_problems(monkeypatch) -> None:
    from lmforge.kernels import _cublaslt as lt

    monkeypatch.setattr(lt, "_TUNED", [])
    assert lt.summary() == ""
    lt._TUNED.extend([(1.5, True), (0.25, False)])
    assert lt.summary() == (
        f"tuned 2 GEMM problems in 1.8 s ({lt.SEARCH} search): "
        "1 run a faster cuBLASLt kernel than torch's"
    )


def test_fusable_needs_one_matmul() -> None:
    a, b = Linear(4, 3), Linear(4, 3)
    assert _fusable(a, b)
    a.matmul = matmul.linear
    assert not _fusable(a, b)
    b.matmul = matmul.linear
    assert _fusable(a, b)


def test_train_matmul_choices(tmp_path: Path) -> None:
    from lmforge.train import Trainer
    from lmforge.utils.errors import LmforgeError
    from test_train_gpu import _cfg

    cfg = _cfg(tmp_path, device="cpu", precision="fp32", matmul="tuned")
    with pytest.raises(LmforgeError, match=r"train\.matmul=tuned needs a CUDA device"):
        Trainer(cfg)
    matmul.TUNED = True  # a previous trainer's switch: the next one resets it
    trainer = Trainer(_cfg(tmp_path, device="cpu", precision="fp32", matmul="auto"))
    assert not trainer.tuned_matmul and not matmul.TUNED
    with pytest.raises(LmforgeError, match=r"train\.matmul must be auto, torch or tuned"):
        Trainer(_cfg(tmp_path, device="cpu", precision="fp32", matmul="fast"))


# -- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["fwd", "dx", "dw", "dw+"])
def test_tuned_gemm_matches_float64_on_gpu(kind: str) -> None:
    # Every problem layout a training step hands the op, bf16, shapes not multiples of the tiles:
    # the chosen kernel (whichever won) within twice torch's own error of a float64 product.
    from lmforge.kernels import _cublaslt

    matmul.TUNED = True
    torch.manual_seed(0)
    m, k, n = 1000, 392, 776

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") / shape[-1] ** 0.5).bfloat16()

    if kind == "fwd":
        a, b = rnd(m, k), rnd(n, k).t()
    elif kind == "dx":
        a, b = rnd(m, k), rnd(k, n)
    else:
        a, b = rnd(k, m).t(), rnd(k, n)
    base = rnd(m, n)
    acc = kind == "dw+"
    want = a.double() @ b.double() + (base.double() if acc else 0)
    ref = base.clone()
    if acc:
        ref.addmm_(a, b)
    else:
        torch.mm(a, b, out=ref)
    before = len(_cublaslt.TUNING_LOG)
    for _ in range(2):  # the first call tunes, the second runs the choice
        out = base.clone()
        matmul.mm_into(a, b, out, accumulate=acc)
        err = (out.double() - want).abs().max().item()
        assert err <= 2 * (ref.double() - want).abs().max().item() + 1e-3
    assert len(_cublaslt.TUNING_LOG) in (before, before + 1)


@pytest.mark.gpu
@cuda
def test_tuned_linear_gradients_and_cuda_graph_on_gpu() -> None:
    # Forward and both gradients against torch's bf16 matmul, then the same GEMMs captured in a
    # CUDA graph (the choice is made before capture) and replayed on new inputs.
    matmul.TUNED = True
    torch.manual_seed(1)
    x = torch.randn(4, 300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(1536, 512, device="cuda") / 512**0.5).bfloat16().requires_grad_()
    y = matmul.linear(x, w)
    want = x @ w.t()
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), dy)
    ref = torch.autograd.grad(want, (x, w), dy)
    for g, r in zip((y, *got), (want, *ref), strict=True):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)
    assert got[1].is_contiguous()
    xs, out = x.detach().clone(), torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out.copy_(matmul.linear(xs, w.detach()))
    xs.copy_(torch.randn_like(xs))
    graph.replay()
    torch.testing.assert_close(out.float(), (xs @ w.detach().t()).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@cuda
def test_trainer_with_tuned_matmul_trains_like_torch_on_gpu(tmp_path: Path) -> None:
    # train.matmul=tuned (compiled, master weights, fused loss, CUDA graph) against torch's
    # matmul: the same loss curve within bf16 noise.
    from lmforge.train import Trainer
    from lmforge.train.trainer import read_metrics
    from test_train_gpu import _cfg

    losses = {}
    for mode in ("torch", "tuned"):
        (tmp_path / mode).mkdir()
        cfg = _cfg(tmp_path / mode, compile=True, matmul=mode, cuda_graph=True, max_steps=30,
                   eval_every=0, save_every=0)  # fmt: skip
        trainer = Trainer(cfg)
        assert trainer.tuned_matmul == (mode == "tuned")
        trainer.run()
        recs = read_metrics(tmp_path / mode / "run" / "metrics.jsonl")
        losses[mode] = [r["loss"] for r in recs if r.get("event") == "train"]
    assert len(losses["torch"]) == len(losses["tuned"]) > 10
    torch.testing.assert_close(
        torch.tensor(losses["tuned"]), torch.tensor(losses["torch"]), rtol=2e-2, atol=2e-2
    )


@pytest.mark.gpu
@cuda
def test_checkpoint_records_tuned_gemms_and_resume_reuses_them_on_gpu(tmp_path: Path) -> None:
    # A checkpoint of a tuned run holds each problem's choice; a trainer resuming from it (after
    # this process forgot its choices) runs the same kernels without timing again.
    from lmforge.kernels import _cublaslt as lt
    from lmforge.train import Trainer
    from lmforge.train.checkpoint import read_trainer_state
    from test_train_gpu import _cfg

    cfg = _cfg(tmp_path, matmul="tuned", max_steps=6, eval_every=0, save_every=6)
    Trainer(cfg).run()
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    recorded = read_trainer_state(ckpts[-1])["tuned_gemms"]
    assert recorded and recorded == lt.choices()
    before = dict(lt._CHOICE)
    lt._CHOICE.clear()
    lt._PRESET.clear()
    logged = len(lt.TUNING_LOG)
    try:
        trainer = Trainer(_cfg(tmp_path, matmul="tuned", max_steps=8, eval_every=0, save_every=0))
        assert trainer.resumed_from is not None
        trainer.run()
        assert len(lt.TUNING_LOG) == logged  # nothing timed again
        now = lt.choices()  # what the resumed run used: every one of them as recorded
        assert now and all(recorded.get(k) == v for k, v in now.items())
    finally:
        lt._PRESET.clear()
        lt._CHOICE.update(before)


@pytest.mark.gpu
@cuda
def test_wide_search_lists_checked_configurations_on_gpu() -> None:
    # The wide plan keeps the heuristic's candidates first and in order, adds configurations
    # cuBLASLt accepts (all distinct), each of which computes the product; the tuner picks
    # among them and its choice is correct (as in the float64 test above).
    from lmforge.kernels import _cublaslt as lt

    torch.manual_seed(3)
    a = (torch.randn(2048, 768, device="cuda") / 768**0.5).bfloat16()
    b = (torch.randn(768, 1536, device="cuda") / 768**0.5).bfloat16()
    narrow = lt.plan(a, b)
    wide = lt.plan(a, b, wide=True)
    n = len(narrow.algos)
    assert [wide.describe(i) for i in range(n)] == [narrow.describe(i) for i in range(n)]
    out = torch.empty(2048, 1536, device="cuda", dtype=torch.bfloat16)

    def time_one(i: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        wide.run(a, b, out, i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    ranked = lt.search(wide, time_one)
    assert len(wide.algos) > n and set(ranked) <= set(range(len(wide.algos)))
    assert len(ranked) > n and wide.listed == n
    # A second search of the same plan (dW and dW += share one) tries the same configurations
    # again, already listed: nothing appended, the same indices.
    tiles = lt._extend(wide, [0], tiles=True, customs=True)
    listed = len(wide.algos)
    assert tiles and lt._extend(wide, [0], tiles=True, customs=True) == tiles
    assert len(wide.algos) == listed
    described = [wide.describe(i) for i in range(len(wide.algos))]
    assert len(set(described)) == len(described)
    want = a.double() @ b.double()
    ref = (a @ b).double()
    tol = 2 * (ref - want).abs().max().item() + 1e-3
    step = max(1, (len(wide.algos) - n) // 24)  # a sample of the searched ones
    for i in range(n, len(wide.algos), step):
        out.fill_(float("nan"))
        try:
            wide.run(a, b, out, i)
        except lt.LtError:  # accepted by the check, refused at the call: the tuner skips it too
            continue
        assert (out.double() - want).abs().max().item() <= tol, wide.describe(i)
    matmul.TUNED = True
    old = lt.SEARCH
    lt.SEARCH = "wide"
    try:
        out.zero_()
        matmul.mm_into(a, b, out)
        assert (out.double() - want).abs().max().item() <= tol
    finally:
        lt.SEARCH = old
