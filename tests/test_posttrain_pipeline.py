"""Pipeline RL (engine and trainer processes over gloo) and bucketed weight sync."""

from __future__ import annotations

import pytest
import torch

from lmforge.posttrain import rl
from lmforge.posttrain.pipeline import PipelineConfig, run_pipeline
from lmforge.posttrain.tasks import ArithmeticTask, Reward
from lmforge.posttrain.weight_sync import bucket_layout, pack_buckets, unpack_buckets


def test_bucket_layout_round_trip() -> None:
    torch.manual_seed(0)
    named = {
        "a": torch.randn(3, 4),
        "b": torch.randn(100),
        "c": torch.randn(7).half(),
        "d": torch.randn(2, 2),
    }
    layout = bucket_layout(named.items(), bucket_bytes=64 * 4)
    assert layout.num_buckets == 4  # a (48 B) + b would overflow 256 B; dtype change; then d
    buckets = layout.empty_buckets("cpu")
    pack_buckets(layout, named, buckets)
    got = dict(unpack_buckets(layout, buckets))
    assert set(got) == set(named)
    for k in named:
        assert torch.equal(got[k], named[k]) and got[k].dtype == named[k].dtype


@pytest.mark.parametrize("engine", ["local", "serve"])
def test_pipeline_rl_two_processes_gloo(engine: str) -> None:
    """Both rollout engines behind the engine process: LocalEngine (lockstep) and the batched
    serve engine, stepped by the caller so weights swap in mid-sequence."""
    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = PipelineConfig(iterations=4, prompts_per_step=4, group_size=4, digits=1,
                         max_tokens=task.answer_tokens, eval_every=4, eval_size=10, max_lag=1,
                         lr=1e-2, engine=engine)  # fmt: skip

    def first_digit_value(item: dict, text: str) -> Reward:
        # A graded reward, so a group of 4 samples almost never has equal rewards (an all-equal
        # group has zero advantage): with a 0/1 reward of chance 1/14 every group of a run came
        # out all-zero about once in a hundred runs, and then nothing moved the weights.
        r = int(text[0]) / 9 if text[:1].isdigit() else 0.0
        return Reward(r, r, 0.0)

    hist = run_pipeline(model, cfg, progress=False, reward_fn=first_digit_value)
    assert [h["version"] for h in hist] == [1, 2, 3, 4]
    assert hist[-1]["samples"] == 4 * 16
    staleness = hist[-1]["staleness_histogram"]
    assert sum(staleness.values()) > 0 and min(int(k) for k in staleness) >= 0
    assert all(h["kept"] <= 16 for h in hist)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # tokens the engine sampled with the trainer's current version: ratio 1, so the bucketed
    # gloo broadcast delivered the weights intact
    assert max(h["sync_check"] for h in hist if "sync_check" in h) < 1e-4
    # queue_size 0: the engine starts batch k only once the trainer took batch k - 1, so no
    # token is more than one version old and max_lag 1 drops nothing
    assert cfg.queue_size == 0
    assert all(h["max_lag"] <= 1 for h in hist) and all(h["kept"] == 16 for h in hist)
    for k in ("wait_s", "score_s", "fwd_s", "bwd_s", "opt_s", "broadcast_s", "engine_gen_s",
              "engine_recv_s", "engine_idle_s"):  # fmt: skip
        assert all(h[k] >= 0.0 for h in hist), k


@pytest.mark.gpu
def test_pipeline_rl_on_one_gpu_gloo_staging() -> None:
    """Both processes on cuda:0, weights staged through CPU buckets over gloo (one shared GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    named = {"a": torch.randn(3, 4, device="cuda"), "b": torch.randn(5, device="cuda")}
    layout = bucket_layout(named.items())
    buckets = layout.empty_buckets("cpu")
    pack_buckets(layout, named, buckets)
    assert all(torch.equal(v.cpu(), named[k].cpu()) for k, v in unpack_buckets(layout, buckets))
    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1).cuda()
    cfg = PipelineConfig(iterations=3, prompts_per_step=4, group_size=4, digits=1,
                         max_tokens=task.answer_tokens, eval_every=3, eval_size=10, lr=1e-2)  # fmt: skip
    hist = run_pipeline(model, cfg, progress=False)
    assert [h["version"] for h in hist] == [1, 2, 3] and all(h["max_lag"] <= 1 for h in hist)
    # fp32 on the GPU: KV-cache decode vs full forward differ by kernel choice only
    assert max(h["sync_check"] for h in hist if "sync_check" in h) < 1e-3


def test_pipeline_rejects_an_unknown_engine() -> None:
    from lmforge.utils.errors import LmforgeError

    task = ArithmeticTask(digits=1)
    model = rl.arithmetic_model(task.tokenizer().vocab_size, seed=0, d_model=32, n_layers=1)
    with pytest.raises(LmforgeError, match="engine"):
        run_pipeline(model, PipelineConfig(iterations=1, engine="vllm"), progress=False)


def test_serve_decoding_steps_like_local_decoding() -> None:
    """make_engine(...).start(): the serve engine stepped by the caller gives one row per sample
    with the same greedy tokens as LocalEngine, and records the version set between steps."""
    from lmforge.posttrain.rollout import LocalEngine, SamplingParams, make_engine

    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1).eval()
    prompts = [[3, 4, 5], [6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=5, n=2, ignore_eos=True)
    local = LocalEngine(model).start(prompts, params)
    while not local.done:
        local.step()
    eng = make_engine(model, prefer="serve")
    dec = eng.start(prompts, params)
    steps = 0
    while not dec.done:
        dec.step()
        steps += 1
        if steps == 1:
            eng.version = 7  # a weight swap between two steps: later tokens carry version 7
    rows, want = dec.outputs(), local.outputs()
    assert len(rows) == 4 and [r.outputs[0].token_ids for r in rows] == [
        w.outputs[0].token_ids for w in want
    ]
    versions = [r.outputs[0].policy_versions for r in rows]
    assert versions[0][0] == 0  # the first sample's first token came before the swap
    assert all(v == sorted(v) and v[-1] == 7 and len(v) == 5 for v in versions)
