"""Cross-layer KV sharing (CLA, Brandon et al. 2024) for standard attention (MHA / GQA).

With ``kv_share_every = k`` layer i attends with the keys (after QK-norm and RoPE) and values
of layer i − i mod k and computes only its own queries. Checked here, fp32 on the CPU:

- the training forward equals a readable float64 loop that writes the CLA math out (producers
  project K/V, consumers reuse them) from the model's weights; consumers own no k/v projection;
- the contiguous KV cache (``lmforge.generate``) holds ceil(L / k) layers and prefill + decode
  through it equals the full forward; packed SFT rows (a cache stand-in) equal one by one;
- the engine allocates ceil(L / k) page layers; its compiled decode step (fullgraph), the
  CUDA-graph replay logic and prefix caching give ``lmforge.generate``'s tokens (chunked
  prefill and the every-switch rows are in tests/test_engine_switches.py);
- parameters, FLOPs (against torch's FlopCounterMode) and KV bytes match the built model and
  the engine; checkpoints carry the field; the trainer trains it; bad values and what does
  not fit (hybrids, HF export, tensor/pipeline parallelism, pruning, calibrated
  quantization) are one line;
- under ``TRITON_INTERPRET=1`` (a subprocess): the Triton training kernels (flash attention,
  RoPE, packed RoPE) and the compiled decode step with the decode GEMV, the fused RoPE + KV
  write and the Triton paged decode kernel.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from _interp import run_pytest_in_interpreter
from lmforge.generate import generate, greedy_generate_reference
from lmforge.model import KVCache, ModelConfig, TransformerLM, accounting
from lmforge.model.attention import CausalSelfAttention
from lmforge.serve import Engine, SamplingParams
from lmforge.utils.errors import LmforgeError

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None
V = 97
BASE = dict(vocab_size=V, context_length=64, d_model=64, n_heads=4)
# every switch on the q side, and QK-norm's k gain (producers only)
ALL = dict(n_layers=3, n_kv_heads=1, kv_share_every=2, qk_norm=True, mup=True, mup_base_width=32,
           mup_base_head_dim=8, attn_output_gate=True, rotary_dim=8, logit_soft_cap=5.0,
           tie_embeddings=True)  # fmt: skip
VARIANTS = {  # L not a multiple of k
    "gqa_cla2": dict(n_layers=5, n_kv_heads=2, kv_share_every=2),
    "mha_cla3": dict(n_layers=4, kv_share_every=3),
    "gqa_cla2_all": ALL,
}


def _model(peaked: bool = True, **kw) -> TransformerLM:
    """A model with non-trivial norm gains; ``peaked``: matrices doubled, logits far from flat
    (greedy not decided by rounding; fp32 rounding then grows to ~3e-5 in a logit)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**BASE, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif peaked:
                p.mul_(2.0)
    return model


def _tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _prompts(lengths=(3, 13, 21, 6)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def _reference_logits(model: TransformerLM, idx: torch.Tensor) -> torch.Tensor:
    """CLA written out in float64 from the model's weights (no lmforge attention code): every
    layer's queries; layers i with i mod k == 0 project, QK-norm and rotate their own keys and
    values, the others reuse the last producer's; causal softmax attention with K kv-heads
    each serving H/K query heads; the output gate, muP's q scale and soft-cap where set."""
    cfg = model.config
    b, t = idx.shape
    h, kv, e, k = cfg.n_heads, cfg.kv_heads, int(cfg.head_dim), cfg.kv_share_every
    r = e if cfg.rotary_dim is None else cfg.rotary_dim  # rotated dims: pairs below r/2

    def w(lin):
        return lin.weight.detach().double()

    def rms(x, gain):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * gain.double()

    inv = cfg.rope_theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)  # (r/2,)
    inv = torch.cat([inv, torch.zeros(e // 2 - r // 2, dtype=torch.float64)])  # (E/2,)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv  # (T, E/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # (T, 1, E/2)

    def rope(x):  # (B, T, n, E): pairs (x[2i], x[2i+1]) rotated by position · inv[i]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)

    scale = 1 / math.sqrt(e)
    if cfg.mup:
        scale *= math.sqrt(cfg.mup_base_head_dim / e)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = model.token_embeddings.weight.detach().double()[idx]  # (B, T, D)
    keys = values = None
    for i, block in enumerate(model.layers):
        a = block.attn
        hn = rms(x, block.ln1.weight)
        q = (hn @ w(a.q_proj).T).view(b, t, h, e)
        if cfg.qk_norm:
            q = rms(q, a.q_norm.weight)
        q = rope(q)
        if i % k == 0:  # a producer: its own keys and values, kept for the next k − 1 layers
            keys = (hn @ w(a.k_proj).T).view(b, t, kv, e)
            if cfg.qk_norm:
                keys = rms(keys, a.k_norm.weight)
            keys = rope(keys)
            values = (hn @ w(a.v_proj).T).view(b, t, kv, e)
        kk = keys.repeat_interleave(h // kv, dim=2)  # (B, T, H, E)
        vv = values.repeat_interleave(h // kv, dim=2)
        s = torch.einsum("bqhe,bshe->bhqs", q, kk) * scale
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("bhqs,bshe->bqhe", p, vv).reshape(b, t, h * e)
        if cfg.attn_output_gate:
            o = o * torch.sigmoid(hn @ w(a.gate_proj).T)
        x = x + o @ w(a.output_proj).T
        hn = rms(x, block.ln2.weight)
        f = block.ffn
        x = x + (F.silu(hn @ w(f.w1).T) * (hn @ w(f.w3).T)) @ w(f.w2).T
    hn = rms(x, model.ln_final.weight)
    if cfg.mup:
        hn = hn * (cfg.mup_base_width / cfg.d_model)
    logits = hn @ w(model.lm_head).T
    if cfg.logit_soft_cap is not None:
        logits = cfg.logit_soft_cap * torch.tanh(logits / cfg.logit_soft_cap)
    return logits


if not _CHILD:

    @pytest.mark.parametrize("name", list(VARIANTS))
    @pytest.mark.parametrize("attention", ["sdpa", "reference"])
    def test_forward_equals_the_written_out_cla(name: str, attention: str) -> None:
        model = _model(**VARIANTS[name], attention=attention)
        idx = _tokens(2, 19)
        with torch.no_grad():
            got = model(idx).double()
        torch.testing.assert_close(got, _reference_logits(model, idx), atol=2e-5, rtol=2e-5)

    def test_consumers_have_no_kv_projections() -> None:
        model = _model(**VARIANTS["gqa_cla2"], qk_norm=True)
        attn = [layer.attn for layer in model.layers]
        assert all(type(a) is CausalSelfAttention for a in attn)
        assert [a.produces_kv for a in attn] == [True, False, True, False, True]
        assert [a.kv_index for a in attn] == [a.cache_index for a in attn] == [0, 0, 1, 1, 2]
        names = {n.removeprefix("layers.1.") for n, _ in model.named_parameters()}
        assert not {"attn.k_proj.weight", "attn.v_proj.weight", "attn.k_norm.weight"} & names
        assert {"attn.q_proj.weight", "attn.q_norm.weight", "attn.output_proj.weight"} <= names
        with pytest.raises(LmforgeError, match="attends with layer 0's keys/values"):
            model.layers[1].attn(torch.zeros(1, 3, 64))  # alone: nothing to attend with

    @pytest.mark.parametrize("name", list(VARIANTS))
    def test_kv_cache_holds_the_producers_and_equals_the_full_forward(name: str) -> None:
        """Prefill then token-by-token decode through the contiguous KVCache (ceil(L / k) layers)
        == the training forward."""
        model = _model(peaked=False, **VARIANTS[name])
        cfg = model.config
        idx = _tokens(2, 14)
        cache = KVCache.for_model(model, 2, 32)
        layers = math.ceil(cfg.n_layers / cfg.kv_share_every)
        assert cache.k.shape == cache.v.shape == (layers, 2, cfg.kv_heads, 32, int(cfg.head_dim))
        with torch.no_grad():
            want = model(idx)
            steps = [model(idx[:, :6], kv_cache=cache)]
            steps += [model(idx[:, i : i + 1], kv_cache=cache) for i in range(6, 14)]
        torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("name", ["gqa_cla2", "mha_cla3"])
    def test_greedy_generate_equals_full_recompute(name: str) -> None:
        """A left-padded batch through the KV cache == re-running the whole sequence per token."""
        model = _model(**VARIANTS[name])
        prompts = [[5, 17, 3, 44, 9, 1, 2], [60, 7], [11, 12, 13, 14]]
        got = generate(model, prompts, 10, temperature=0.0)
        for prompt, out in zip(prompts, got, strict=True):
            assert out == greedy_generate_reference(model, prompt, 10)

    def test_packed_sft_rows_equal_one_by_one() -> None:
        """Packed SFT passes its block-diagonal mask as a cache stand-in that stores nothing:
        consumers take the producer's K/V from the block, per-token log-probs and gradients
        equal the examples' one by one."""
        from test_posttrain_sft import _check_packing, _examples

        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=40, context_length=32, d_model=32, n_layers=3, n_heads=4,
                          n_kv_heads=2, kv_share_every=2)  # fmt: skip
        _check_packing(TransformerLM(cfg), _examples(40, (5, 9, 4, 7, 3)))

    @pytest.mark.parametrize("name", ["gqa_cla2", "mha_cla3"])
    def test_engine_allocates_the_producers_and_equals_generate(name: str) -> None:
        """The paged cache holds ceil(L / k) layers of K/V (bytes as the accounting says) and
        the eager engine, chunked prefill included, gives lmforge.generate's tokens."""
        from lmforge.serve.model_runner import kv_bytes_per_block

        model = _model(**VARIANTS[name])
        cfg = model.config
        layers = math.ceil(cfg.n_layers / cfg.kv_share_every)
        eng = Engine(model, block_size=4, num_blocks=48, max_num_batched_tokens=8)
        assert eng.runner.cache.k.shape == (layers, 49, 4, cfg.kv_heads, int(cfg.head_dim))
        assert eng.runner.cache.v.shape == eng.runner.cache.k.shape
        per_token = kv_bytes_per_block(model, 16, torch.bfloat16) // 16
        assert per_token == accounting.kv_cache_bytes_per_token(cfg, 2)
        assert per_token == layers * 2 * cfg.kv_heads * int(cfg.head_dim) * 2
        prompts = _prompts()
        want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
        outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want

    # (the every-switch kind is also traced whole, fast, by tests/test_engine_switches.py)
    @pytest.mark.parametrize(
        "name", ["gqa_cla2", pytest.param("gqa_cla2_all", marks=pytest.mark.slow)]
    )
    def test_compiled_decode_step_and_graph_replay_equal_generate(monkeypatch, name: str) -> None:
        """The compiled decode step traces whole (fullgraph: consumers pass no K/V to the
        decode-attention op and read the producer's pages) and the CUDA-graph replay logic
        (emulated on the CPU: padded buckets) give lmforge.generate's tokens; a repeated
        prompt's full blocks come from the prefix cache."""
        from torch._dynamo.utils import counters

        from lmforge.serve import compiled
        from lmforge.serve.cuda_graphs import DecodeGraphs

        torch._dynamo.reset()
        model = _model(**VARIANTS[name])
        prompts = _prompts()
        want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        real = torch.compile
        monkeypatch.setattr(
            torch, "compile",
            lambda fn, **kw: real(fn, dynamic=True, fullgraph=True, backend="aot_eager"),
        )  # fmt: skip
        counters.clear()
        eng = Engine(model, compile=True, block_size=4, num_blocks=64, max_num_seqs=4)
        assert isinstance(eng.decoder, compiled.CompiledDecode)
        eng.runner.graphs = DecodeGraphs(eng.runner, emulate=True)
        outs = eng.generate(prompts[:3], params)  # three sequences: the bucket of 4
        assert eng.decoder.failed is None and not counters["graph_break"]
        assert [o.outputs[0].token_ids for o in outs] == want[:3]
        eng.runner.graphs = None  # the compiled step itself
        hits = eng.allocator.hits
        outs = eng.generate([prompts[3], prompts[2]], params)
        assert [o.outputs[0].token_ids for o in outs] == [want[3], want[2]]
        assert eng.allocator.hits - hits == 5  # prompt 2's 20 of 21 tokens: five full blocks
        assert eng.stats["decode_steps"] > 0 and eng.decoder.failed is None
        torch._dynamo.reset()

    def test_gemv_plan_keeps_consumers_off_the_fused_kv_write() -> None:
        """The decode GEMV plan (forced on: fp32 on the CPU): producers fuse RoPE + the KV write,
        consumers run their q projection alone on the GEMV, unfused (no K/V to write)."""
        from lmforge.serve.compiled import CompiledDecode, pack_weights
        from lmforge.serve.model_runner import new_kv_cache

        model = _model(**VARIANTS["gqa_cla2"])
        cache = new_kv_cache(model, 4, 4, torch.device("cpu"), torch.float32)
        plan = CompiledDecode(model, cache, None, gemv=True).gemv
        assert plan is not None
        assert [layer[4] for layer in plan[0]] == [True, False, True, False, True]
        assert all(layer[0] > 0 for layer in plan[0])  # q/k/v (or q) on the GEMV everywhere
        packed = pack_weights(model)
        assert [p[0] is None for p in packed] == [False, True, False, True, False]

    @pytest.mark.parametrize("name", list(VARIANTS))
    def test_accounting_matches_the_model(name: str) -> None:
        """Parameters == the built model's; forward FLOPs == torch's FlopCounterMode (reference
        attention: the dense score and value matmuls accounting counts); KV bytes ==
        kv_bytes_per_token at ceil(L / k) layers."""
        from torch.utils.flop_counter import FlopCounterMode

        from lmforge.model.cla import kv_bytes_per_token

        cfg = ModelConfig(**{**BASE, **VARIANTS[name], "attention": "reference"})
        model = TransformerLM(cfg)
        assert accounting.parameter_count(cfg) == model.num_parameters()
        matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # embedding too
        untied = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
        assert accounting.matmul_parameters(cfg) == matrices - untied
        t = 16
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(_tokens(1, t))
        assert counter.get_total_flops() == accounting.flops_per_token(cfg, t, backward=False) * t
        nocla = ModelConfig(**{**BASE, **VARIANTS[name], "kv_share_every": 1})
        assert accounting.parameter_count(cfg) < accounting.parameter_count(nocla)
        kv = kv_bytes_per_token("gqa", n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                                head_dim=int(cfg.head_dim), n_kv_heads=cfg.kv_heads,
                                kv_share_every=cfg.kv_share_every)  # fmt: skip
        assert accounting.kv_cache_bytes_per_token(cfg, 2) == kv
        assert kv == math.ceil(cfg.n_layers / cfg.kv_share_every) * 2 * cfg.kv_heads * 16 * 2

    def test_tiny_model_trains_and_every_parameter_learns() -> None:
        """Loss falls; every parameter (producers' k/v get the consumers' gradients too) gets
        a gradient; activation checkpointing (the block's (x, (K, V)) output through
        torch.utils.checkpoint) gives the same gradients."""
        from lmforge.train.wrap import apply_activation_checkpointing

        def build():
            torch.manual_seed(0)
            return TransformerLM(ModelConfig(**{**BASE, **VARIANTS["gqa_cla2"]}))

        model, wrapped = build(), apply_activation_checkpointing(build())
        x = _tokens(2, 10)
        for m in (model, wrapped):
            m(x).logsumexp(-1).mean().backward()
        for (n, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
            assert p.grad is not None, n
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6)
        batch = _tokens(4, 33, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(25):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.7 * losses[0], losses

    def test_the_trainer_trains_and_the_checkpoint_reloads(tmp_path: Path) -> None:
        """The one Trainer (``lmforge.train.train``), unchanged, on a GQA + CLA model: the loss
        of a learnable stream falls; the checkpoint reloads with the field and the logits."""
        import numpy as np

        from lmforge.config import load_run_config
        from lmforge.train import load_for_inference, train
        from lmforge.train.data import write_shard
        from lmforge.train.trainer import read_metrics

        rng = np.random.default_rng(0)
        base = np.tile(np.arange(50), 300)
        toks = np.where(rng.random(base.size) < 0.1, rng.integers(0, V, base.size), base)
        tr = write_shard(tmp_path / "train.bin", toks[:12000], V, num_bytes=36000)
        va = write_shard(tmp_path / "val.bin", toks[12000:], V, num_bytes=9000)
        model = {**BASE, "n_layers": 3, "n_kv_heads": 2, "kv_share_every": 2}
        overrides = [f"model.{k}={v}" for k, v in model.items()] + [
            f'data.train=["{tr}"]', f'data.val=["{va}"]', f"train.out_dir={tmp_path / 'run'}",
            "train.device=cpu", "train.precision=fp32", "train.batch_size=4",
            "train.context_length=32", "train.lr=3e-3", "train.warmup_steps=5",
            "train.max_steps=30", "train.log_every=1", "train.eval_every=30",
            "train.eval_batches=2", "train.save_every=30", "train.progress=false",
        ]  # fmt: skip
        train(load_run_config(None, overrides))
        losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
                  if r.get("event") == "train"]  # fmt: skip
        assert len(losses) == 30 and losses[-1] < 0.7 * losses[0], losses
        loaded, _ = load_for_inference(tmp_path / "run")
        assert loaded.config.kv_share_every == 2 and loaded.config.n_kv_heads == 2
        assert not hasattr(loaded.layers[1].attn, "k_proj")
        # the saved weights: the reloaded model's logits are the training run's model's
        from lmforge.checkpoint import checkpoint_path
        from lmforge.config import RunConfig
        from lmforge.train import AdamW, save_checkpoint

        cfg = ModelConfig(**{**BASE, **VARIANTS["gqa_cla2_all"]})
        src = _model(**VARIANTS["gqa_cla2_all"])
        save_checkpoint(checkpoint_path(tmp_path / "ck", 1), src,
                        AdamW(src.parameters(), lr=1e-3), 1, config=RunConfig(model=cfg))  # fmt: skip
        again, _ = load_for_inference(tmp_path / "ck")
        assert again.config.kv_share_every == 2
        idx = _tokens(1, 10)
        with torch.no_grad():
            torch.testing.assert_close(again(idx), src(idx), atol=0, rtol=0)

    @pytest.mark.parametrize(
        ("overrides", "match"),
        [
            (["model.kv_share_every=0"], "kv_share_every must be an integer >= 1"),
            (["model.kv_share_every=-2"], "kv_share_every must be an integer >= 1"),
            (["model.kv_share_every=1.5"], "kv_share_every"),
            (["model.kv_share_every=2", "model.layers=GA"], "needs full-attention layers only"),
            (["model.kv_share_every=2", "model.layers=AW"], "needs full-attention layers only"),
        ],
    )
    def test_config_errors_are_one_line(overrides: list[str], match: str) -> None:
        from lmforge.config import load_run_config

        base = [f"model.{k}={v}" for k, v in BASE.items()] + ["model.n_layers=4"]
        with pytest.raises(LmforgeError, match=match) as err:
            load_run_config(None, [*base, *overrides])
        assert "\n" not in str(err.value)

    def test_what_does_not_fit_is_one_line(tmp_path: Path) -> None:
        """HF export (no HF architecture shares K/V across layers), tensor/pipeline
        parallelism, pruning and the block-by-block calibrated quantization refuse CLA."""
        from types import SimpleNamespace

        from lmforge.hf import export_model, model_config_to_hf_config
        from lmforge.parallel.config import ParallelConfig
        from lmforge.parallel.strategies import build_strategy
        from lmforge.prune.importance import Importance
        from lmforge.prune.prune import prune_depth
        from lmforge.quant.calib import BlockRunner

        model = _model(**VARIANTS["mha_cla3"])  # 4 layers, 4 heads: tp = pp = 2 divide them
        errors = []
        for call in (
            lambda: model_config_to_hf_config(model.config),
            lambda: export_model(model, tmp_path / "hf"),
            lambda: build_strategy(
                model, ParallelConfig(tp=2), SimpleNamespace(world_size=2, rank=0, device="cpu")
            ),
            lambda: build_strategy(
                model, ParallelConfig(pp=2), SimpleNamespace(world_size=2, rank=0, device="cpu")
            ),
            lambda: prune_depth(model, Importance.__new__(Importance), 2),
            lambda: BlockRunner(model, _tokens(2, 8)),
        ):
            with pytest.raises(LmforgeError) as err:
                call()
            errors.append(str(err.value))
        assert all("\n" not in e and "kv_share_every" in e for e in errors), errors
        assert not (tmp_path / "hf").exists()  # refused before writing anything

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_triton_paths_in_interpreter_subprocess() -> None:
        run_pytest_in_interpreter(__file__, timeout=600)

else:

    @pytest.mark.parametrize("rope", ["triton", "packed"])
    def test_training_kernels_match_the_reference_backends(rope: str) -> None:
        """The flash attention kernel, Triton RoPE (producers: packed q|k GEMM + rotation;
        consumers: q alone) and Triton norm on a GQA + CLA model against sdpa + the reference
        modules: logits and every parameter's gradient."""
        import dataclasses

        cfg = ModelConfig(vocab_size=V, context_length=32, d_model=32, n_layers=3, n_heads=4,
                          n_kv_heads=2, kv_share_every=2, attention="sdpa")  # fmt: skip
        torch.manual_seed(0)
        ref = TransformerLM(cfg)
        fast = TransformerLM(dataclasses.replace(cfg, attention="flash", norm="triton", rope=rope))
        fast.load_state_dict(ref.state_dict())
        x = _tokens(2, 21)  # ragged against the kernels' tiles
        outs = []
        for m in (ref, fast):
            logits = m(x)
            logits.logsumexp(-1).mean().backward()
            outs.append(logits)
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
        for (n, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, atol=2e-5, rtol=2e-4, msg=n)

    def test_compiled_step_with_gemv_and_triton_decode_equals_generate(monkeypatch) -> None:
        """The engine's compiled decode step (aot_eager, fullgraph) with the decode GEMV forced
        on, the fused RoPE + KV write for producers (one call per producer per step) and the
        Triton paged decode kernel: lmforge.generate's tokens and log-probs within 1e-5 of the
        eager torch engine's."""
        from lmforge.serve import _rope_kv_triton, compiled

        model = _model(n_layers=3, n_kv_heads=2, kv_share_every=2, qk_norm=True)
        prompts = _prompts((3, 9))
        want = [generate(model, [p], 4, temperature=0)[0] for p in prompts]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
        eager = Engine(model, block_size=4, num_blocks=16, use_triton=False).generate(
            prompts, params
        )
        calls = {"n": 0}
        real_rope = _rope_kv_triton.rope_write_kv

        def counting(*a, **k):
            calls["n"] += 1
            return real_rope(*a, **k)

        monkeypatch.setattr(_rope_kv_triton, "rope_write_kv", counting)
        monkeypatch.setattr(compiled.CompiledDecode, "warmup", lambda self, *a: None)
        eng = Engine(model, block_size=4, num_blocks=16, use_triton=True, compile=True)
        real = compiled.CompiledDecode(eng.runner.model, eng.runner.cache, True, gemv=True)
        real._fn = torch.compile(compiled.decode_forward, dynamic=True, fullgraph=True,
                                 backend="aot_eager")  # fmt: skip
        eng.runner.decoder = real
        got = eng.generate(prompts, params)
        assert real.failed is None and real.gemv is not None
        assert [o.outputs[0].token_ids for o in got] == want
        assert [o.outputs[0].token_ids for o in eager] == want
        assert calls["n"] == 2 * eng.stats["decode_steps"]  # producers 0 and 2, not consumer 1
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs),
                                       torch.tensor(b.outputs[0].logprobs), atol=1e-5, rtol=0)  # fmt: skip

    def test_fused_kv_write_goes_to_the_cache_layer_of_a_hybrid(monkeypatch) -> None:
        """The fused RoPE + KV-write op writes an attention layer's pages at its cache index,
        not its layer index (they differ after a linear layer, as after CLA consumers): a
        hybrid's compiled step keeps the decode GEMV (it raised IndexError and fell back to
        cuBLAS before) and gives lmforge.generate's tokens."""
        from lmforge.serve import compiled

        model = _model(n_layers=2, layers="LA", n_kv_heads=2)
        prompts = _prompts((3, 9))
        want = [generate(model, [p], 4, temperature=0)[0] for p in prompts]
        monkeypatch.setattr(compiled.CompiledDecode, "warmup", lambda self, *a: None)
        eng = Engine(model, block_size=4, num_blocks=16, compile=True)
        dec = compiled.CompiledDecode(eng.runner.model, eng.runner.cache, None, gemv=True,
                                      states=eng.runner.states)  # fmt: skip
        dec._fn = torch.compile(compiled.decode_forward, dynamic=True, fullgraph=True,
                                backend="aot_eager")  # fmt: skip
        assert dec.gemv is not None and dec.gemv[0][1][4]  # layer 1 (A) fuses its KV write
        eng.runner.decoder = dec
        got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert dec.failed is None and dec.gemv is not None  # no fallback on the way
        assert [o.outputs[0].token_ids for o in got] == want
