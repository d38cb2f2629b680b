"""The MoE training step, checked on the CPU for what costs time on a GPU: host syncs (ops that
read a device value back, found by a dispatch-mode proxy) and torch.compile graph breaks.

The CPU normally takes the grouped path's per-segment loop (it reads the expert counts on the
host); these tests let ``torch._grouped_mm`` (which runs on CPU in torch ≥ 2.9) take its place,
so the CPU runs the GPU's sequence of ops. The Triton gather/combine/gate kernels have torch
stand-ins off CUDA; their compiled form is checked by the gpu test.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.model import ModelConfig, TransformerLM
from lmforge.model import moe as M
from lmforge.model.moe_config import MoEConfig

# aten ops that make the host wait for the device on CUDA (item/tolist/bool read a scalar;
# nonzero, masked_select, unique and bincount size their output from the data).
_SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive", "bincount", "is_nonzero", "equal"}  # fmt: skip


class _SyncOps(TorchDispatchMode):
    """Counts the aten ops of a region that would sync on CUDA (and all ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name.split("::")[-1]
        self.ops += 1
        if name in _SYNCING:
            self.syncs[name] += 1
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is None:
            self.syncs[name] += 1
        if name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                self.syncs[f"{name} (bool mask)"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture()
def gpu_like(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")

    def available(x: torch.Tensor, w: torch.Tensor | None = None) -> bool:
        dims = x.shape[-1] % 8 == 0 and (w is None or w.shape[-1] % 8 == 0)
        return dims and x.shape[0] > 0

    monkeypatch.setattr(M, "grouped_mm_available", available)


MOE = MoEConfig(n_experts=8, top_k=2, expert_d_ff=32, z_loss_coef=1e-3, bias_update_rate=1e-3)


def _trainer(tmp: Path, moe: MoEConfig, **train: object):
    from lmforge.config import RunConfig
    from lmforge.parallel._testing import tiny_model_config
    from lmforge.train import DataConfig, TrainConfig, Trainer
    from lmforge.train.data import write_shard

    shard = write_shard(tmp / "t.bin", np.arange(4000) % 97, 512)
    base = dict(out_dir=str(tmp / "run"), device="cpu", precision="bf16", batch_size=2,
                context_length=16, max_steps=4, progress=False, grad_clip=1.0)  # fmt: skip
    base.update(train)
    cfg = RunConfig(
        model=tiny_model_config(vocab_size=512, moe=moe),
        train=TrainConfig(**base),
        data=DataConfig(train=(str(shard),)),
    )
    tr = Trainer(cfg)
    tr.deferred = True  # the sync-free step, as on a GPU
    return tr


# Python-level reads of a tensor's value (on a CPU tensor ``tolist`` reads memory without an
# aten op; on CUDA each of these copies to the host and waits).
_HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}


class _HostReads(TorchFunctionMode):
    def __init__(self, into: collections.Counter[str]) -> None:
        super().__init__()
        self.into = into

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.into[f"Tensor.{name}"] += 1
        return func(*args, **(kwargs or {}))


def _launch_syncs(tr) -> tuple[collections.Counter[str], int]:
    tr.finish_step(tr.launch_step())  # warm-up (lazy optimizer state)
    with _SyncOps() as mode, _HostReads(mode.syncs):
        pending = tr.launch_step()  # forward, backward, clip, update, bias update
    tr.finish_step(pending)  # the loop's read of the record, one step late: not counted
    return mode.syncs, mode.ops


def test_moe_training_step_launches_without_host_syncs(tmp_path: Path, gpu_like: None) -> None:
    syncs, ops = _launch_syncs(_trainer(tmp_path, MOE))
    assert ops > 200 and not syncs, syncs


def test_sync_proxy_sees_the_cpu_loop_read_counts(tmp_path: Path) -> None:
    # Not vacuous: the CPU's per-segment loop reads the expert counts (tolist) in every layer.
    syncs, _ = _launch_syncs(_trainer(tmp_path, MOE))
    assert syncs["Tensor.tolist"] > 0, syncs


def test_moe_forward_backward_compiles_in_one_graph(gpu_like: None) -> None:
    # A grouped GEMM's alignment check read data_ptr, which broke the graph in every MoE layer
    # (and, inside the block loop, sent the whole forward back to eager).
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=128, context_length=32,
                      d_ff=128, attention="sdpa", moe=MOE)  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(cfg).train()
    ids = torch.randint(0, 128, (2, 32))

    def loss(m: torch.nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(ids)
        return out.float().square().mean() + M.aux_loss(m)

    explained = torch._dynamo.explain(lambda: loss(model))()
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    torch._dynamo.reset()
    want = loss(model)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = loss(torch.compile(model, backend="aot_eager", fullgraph=True))
    got.backward()  # the written-out backward of the grouped GEMMs traces too
    torch.testing.assert_close(got, want)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-4, msg=n)
    torch._dynamo.reset()


def _cuda_moe_model() -> tuple[TransformerLM, torch.Tensor]:
    """A 2-layer MoE model on CUDA with the backends the trainer resolves there, and a batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from lmforge.model.fastpath import resolve_backends

    cfg = ModelConfig(d_model=128, n_layers=2, n_heads=4, vocab_size=256, context_length=64,
                      d_ff=256, moe=dataclasses.replace(MOE, expert_d_ff=64))  # fmt: skip
    cfg = resolve_backends(dataclasses.replace(cfg, swiglu="auto"), "cuda")
    torch.manual_seed(0)
    model = TransformerLM(cfg, device="cuda").train()
    return model, torch.randint(0, 256, (2, 64), device="cuda")


@pytest.mark.gpu
def test_moe_forward_compiles_in_one_graph_on_cuda() -> None:
    model, ids = _cuda_moe_model()

    def loss() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(ids).float().square().mean() + M.aux_loss(model)

    explained = torch._dynamo.explain(loss)()
    torch._dynamo.reset()
    # Each graph break is named: the Triton gather/combine/gate kernels must trace as well.
    assert explained.graph_break_count == 0, [str(b.reason)[:300] for b in explained.break_reasons]


@pytest.mark.gpu
def test_moe_model_compiled_with_inductor_matches_eager_on_cuda() -> None:
    # What the trainer runs: the whole MoE model through Inductor (fullgraph), the Triton
    # gather/combine kernels as custom-op nodes, the router GEMM with its fp32-output overload.
    model, ids = _cuda_moe_model()
    with torch.no_grad():  # a router of realistic spread: no near-tied top-k choices to flip
        for layer in M.moe_layers(model):
            layer.router.weight.normal_(0, 0.5)

    def loss(m: torch.nn.Module) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(ids).float().square().mean() + M.aux_loss(m)

    want = loss(model)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    got = loss(torch.compile(model, fullgraph=True))
    got.backward()
    torch._dynamo.reset()
    # bf16: Inductor fuses the elementwise work differently, so bf16 tolerance, per tensor.
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
    for n, p in model.named_parameters():
        scale = grads[n].abs().max().item()
        torch.testing.assert_close(p.grad, grads[n], rtol=5e-2, atol=5e-2 * scale, msg=n)


def test_routing_statistics_are_computed_only_when_read() -> None:
    # The per-layer statistics (load ratio, dropped share, entropy) are logged every
    # train.log_every steps; computing them in every training forward cost ~18 kernels a layer
    # (216 of a 12-layer MoE step's ~2,750 compute ops on the CPU's op sequence).
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, context_length=16,
                      moe=MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.0))  # fmt: skip
    layer = M.MoEFFN(cfg).train()
    x = torch.randn(2, 16, 32)

    class _Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func._schema.name.split("::")[-1])
            return func(*args, **(kwargs or {}))

    with _Ops() as fwd:
        layer(x)
    assert "log" not in fwd.names  # the entropy's log: not in the forward
    with _Ops() as read:
        stats = layer._stats
    assert stats is not None and "log" in read.names
    r = layer._stats_src
    assert r is not None
    load, kept, scores = r
    p = scores / scores.sum(-1, keepdim=True)
    want = torch.stack(
        [load.max() / load.mean(), 1 - kept.float().mean(), -(p * p.log()).sum(-1).mean()]
    )
    torch.testing.assert_close(stats, want)
