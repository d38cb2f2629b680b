"""Pipeline RL (engine and trainer processes over gloo) and bucketed weight sync."""

from __future__ import annotations

import dataclasses

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


def test_pipeline_rl_two_processes_gloo() -> None:
    """The serving engine behind the engine process, stepped by it so weights swap in
    mid-sequence; the trainer side is PipelineObjective in the Trainer."""
    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = PipelineConfig(iterations=4, prompts_per_step=4, group_size=4, digits=1,
                         max_tokens=task.answer_tokens, eval_every=4, eval_size=10, max_lag=1,
                         lr=1e-2)  # fmt: skip

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
    for k in ("wait_s", "score_s", "broadcast_s", "engine_gen_s", "engine_recv_s",
              "engine_idle_s"):  # fmt: skip
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


# ---------------------------------------------------------------------------------------------
# Any task, any lmforge model: a GSM8K-shaped task on a tiny random model with a byte tokenizer


def _byte_tokenizer():
    from lmforge.tokenizer import Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {i: bytes([i]) for i in range(256)}
    vocab.update({256 + k: s.encode() for k, s in enumerate(specials)})
    return Tokenizer(vocab, [], specials)


def _odd_model(seed: int = 0):
    """A tiny lmforge model with every non-default shape option the engine must rebuild: tied
    embeddings, an explicit head_dim, GQA, QK-norm and llama3 RoPE scaling; random weights
    (not the init of any seed), so a rebuild that re-initialised anything would show."""
    from lmforge.model import ModelConfig, TransformerLM

    cfg = ModelConfig(vocab_size=259, context_length=256, d_model=32, n_layers=1, n_heads=2,
                      n_kv_heads=1, head_dim=24, qk_norm=True, tie_embeddings=True,
                      rope_theta=500.0, rope_scaling="llama3", rope_scaling_factor=4.0,
                      rope_original_context=32)  # fmt: skip
    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.01 * torch.randn_like(p))
    return model.eval()


def _word_problems(n: int) -> list[dict]:
    rows = []
    for a in range(n):
        b = 3 * a + 2
        rows.append({"question": f"Ann has {a} pens and gets {b} more. How many pens now?",
                     "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"})  # fmt: skip
    return rows


def _gsm8k_items(tok, n: int) -> list[dict]:
    from lmforge.posttrain.chat import prompt_text
    from lmforge.posttrain.tasks import gsm8k_user_message

    return [{**r, "prompt": prompt_text(tok, gsm8k_user_message(r["question"]), True)}
            for r in _word_problems(n)]  # fmt: skip


def test_engine_rebuilds_the_trainers_model_exactly() -> None:
    from lmforge.posttrain.pipeline import fingerprint_mismatch, rebuild_model, weight_fingerprint

    model = _odd_model()
    torch.manual_seed(123)  # the rebuild's own init must not matter
    twin = rebuild_model(model.config, {k: v.clone() for k, v in model.state_dict().items()}, "cpu")
    ids = torch.randint(0, 259, (2, 40))  # past rope_original_context: the scaled frequencies
    with torch.no_grad():
        assert torch.equal(twin(ids), model(ids))
    assert twin.lm_head.weight is twin.token_embeddings.weight  # still tied: one Parameter
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert fingerprint_mismatch(weight_fingerprint(model), weight_fingerprint(twin)) == 0.0
    with torch.no_grad():
        twin.layers[0].ffn.w2.weight[0, 0] += 1e-3  # one element, one update's size
    assert fingerprint_mismatch(weight_fingerprint(model), weight_fingerprint(twin)) > 1e-7


def test_prompt_sources_follow_the_synchronous_stream() -> None:
    """ListPrompts draws what random.Random(seed).sample(items, n) draws (`lmforge rl --task
    gsm8k`'s stream), and a pickled copy — the engine's — draws the same, with token ids."""
    import pickle
    import random

    from lmforge.posttrain.pipeline import ListPrompts, TaskPrompts, item_stream
    from lmforge.utils.errors import LmforgeError

    tok = _byte_tokenizer()
    items = _gsm8k_items(tok, 30)
    src = ListPrompts(items, seed=3)
    ref, sync = random.Random(3), item_stream(src)
    engine_side = pickle.loads(pickle.dumps(src.with_token_ids(tok)))
    for n in (4, 4, 7):
        want = ref.sample(items, n)
        assert sync(n) == want
        got, ids = engine_side.draw(n)
        assert got == want and ids == [tok.encode(it["prompt"]) for it in want]
    assert src(4) == random.Random(3).sample(items, 4)  # item_stream left src untouched
    with pytest.raises(LmforgeError, match="need more data"):
        src(31)
    task = ArithmeticTask(digits=2)
    rng5 = random.Random(5)
    toy, twin = TaskPrompts(task, 5), (lambda n: task.sample(n, rng5))
    got, ids = pickle.loads(pickle.dumps(toy)).draw(6)
    assert got == twin(6) and ids == [task.tokenizer().encode(it["prompt"]) for it in got]


def test_pipeline_rl_on_a_gsm8k_shaped_task() -> None:
    """The serve engine (the default for real tasks) in the engine process on a rebuilt model
    with a non-default config, prompts drawn there from the task's list, replies decoded and
    scored by the trainer with the GSM8K checker; the rebuild and the broadcasts are exact."""
    from lmforge.posttrain.pipeline import ListPrompts, item_stream
    from lmforge.posttrain.tasks import gsm8k_reward

    tok = _byte_tokenizer()
    model = _odd_model()
    before = [p.detach().clone() for p in model.parameters()]
    prompts = ListPrompts(_gsm8k_items(tok, 12), seed=0)
    sync = item_stream(prompts)
    want = [it["question"] for _ in range(3) for it in sync(4)]
    seen: list[str] = []

    def reward(item: dict, text: str) -> Reward:
        # the GSM8K checker plus a graded digit share, so groups differ and the weights move
        if not seen or seen[-1] != item["question"]:
            seen.append(item["question"])
        r = gsm8k_reward(item, text)
        shaped = sum(c.isdigit() for c in text) / max(len(text), 1)
        return Reward(r.total + shaped, r.answer, r.format)

    # the shared-bucket transport (shared memory here, CUDA IPC on a GPU); the toy tests above
    # cover the gloo broadcast
    cfg = PipelineConfig(iterations=3, prompts_per_step=4, group_size=4, max_tokens=8,
                         eval_every=3, lr=1e-2, max_lag=1, micro_batch=8,
                         transport="shared")  # fmt: skip
    hist = run_pipeline(model, cfg, progress=False, reward_fn=reward, prompts=prompts,
                        tokenizer=tok)  # fmt: skip
    assert [h["version"] for h in hist] == [1, 2, 3]
    assert hist[-1]["samples"] == 3 * 16 and all(h["kept"] == 16 for h in hist)
    assert seen == want  # the engine drew the synchronous run's prompts, in order
    assert set(hist[-1]["staleness_histogram"]) <= {"0", "1"}
    assert hist[0]["sync_check_tokens"] > 0 and hist[0]["sync_check"] < 1e-4
    # batch 1 at version 0; batch 3 is started after the trainer's first broadcast (version ≥ 1)
    checks = [(h["weight_check_version"], h["weight_check"]) for h in hist if "weight_check" in h]
    assert len(checks) == 2 and checks[0] == (0, 0.0) and checks[1][0] >= 1 and checks[1][1] == 0.0
    assert all(0 < h["response_len"] <= 8 for h in hist)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert model.lm_head.weight is model.token_embeddings.weight


@pytest.mark.gpu
def test_pipeline_rl_gsm8k_shaped_on_one_gpu() -> None:
    """The GSM8K-shaped run with both processes on cuda:0: the serve engine with CUDA graphs in
    the engine process; weights staged through CPU buckets over gloo, then CUDA IPC buckets."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from lmforge.posttrain.pipeline import ListPrompts

    tok = _byte_tokenizer()
    model = _odd_model().cuda()

    def reward(item: dict, text: str) -> Reward:
        shaped = sum(c.isdigit() for c in text) / max(len(text), 1)
        return Reward(shaped, 0.0, 0.0)

    for transport in ("broadcast", "shared"):  # CPU-staged gloo, then CUDA IPC buckets
        cfg = PipelineConfig(iterations=3, prompts_per_step=4, group_size=4, max_tokens=8,
                             eval_every=3, lr=1e-2, max_lag=1, micro_batch=8,
                             transport=transport)  # fmt: skip
        hist = run_pipeline(model, cfg, progress=False, reward_fn=reward,
                            prompts=ListPrompts(_gsm8k_items(tok, 12), seed=0), tokenizer=tok)  # fmt: skip
        _assert_gpu_run(hist)


def _assert_gpu_run(hist: list) -> None:
    assert [h["version"] for h in hist] == [1, 2, 3]
    # fp32 on the GPU: paged decode vs the trainer's full forward differ by kernel choice only
    assert hist[0]["sync_check_tokens"] > 0 and hist[0]["sync_check"] < 1e-3
    assert all(h["weight_check"] < 1e-12 for h in hist if "weight_check" in h)


def test_pipeline_refuses_what_it_cannot_run() -> None:
    from lmforge.posttrain.pipeline import ListPrompts
    from lmforge.utils.errors import LmforgeError

    tok = _byte_tokenizer()
    cfg = PipelineConfig(iterations=1, prompts_per_step=4, max_tokens=8)
    with pytest.raises(LmforgeError, match="lmforge model"):
        run_pipeline(torch.nn.Embedding(4, 4), cfg, progress=False)
    few = ListPrompts(_gsm8k_items(tok, 3), seed=0)
    with pytest.raises(LmforgeError, match="need more data"):
        run_pipeline(_odd_model(), cfg, progress=False, reward_fn=lambda i, t: Reward(0.0),
                     prompts=few, tokenizer=tok)  # fmt: skip
    with pytest.raises(LmforgeError, match="context"):
        run_pipeline(_odd_model(), dataclasses.replace(cfg, prompts_per_step=2, max_tokens=250),
                     progress=False, reward_fn=lambda i, t: Reward(0.0), prompts=few,
                     tokenizer=tok)  # fmt: skip
    with pytest.raises(LmforgeError, match="tokenizer and a reward_fn"):
        run_pipeline(_odd_model(), cfg, progress=False, prompts=few)
    with pytest.raises(LmforgeError, match="weight transport"):
        run_pipeline(_odd_model(), dataclasses.replace(cfg, transport="rdma"), progress=False)
    with pytest.raises(LmforgeError, match="trainer's device"):
        run_pipeline(_odd_model(), dataclasses.replace(cfg, transport="shared", engine_device="meta"),
                     progress=False)  # fmt: skip


def _gsm8k_cli_files(tmp_path):
    import json

    from lmforge.posttrain.models import save_model

    model = save_model(_odd_model(), _byte_tokenizer(), tmp_path / "tiny")
    for name, rows in (("train.jsonl", _word_problems(12)), ("test.jsonl", _word_problems(4))):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, tmp_path / "train.jsonl", tmp_path / "test.jsonl"


def test_rl_gsm8k_pipeline_command_runs(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lmforge rl --task gsm8k --pipeline`: a saved lmforge model with its tokenizer, the serve
    engine by default; bad combinations are one line each."""
    import json

    from lmforge.cli import main

    model, train, test = _gsm8k_cli_files(tmp_path)
    out = tmp_path / "rl"
    common = ["rl", "--task", "gsm8k", "--pipeline", "--model", str(model), "--data", str(train),
              "--eval-data", str(test), "--max-tokens", "8", "--eval-size", "4", "--quiet"]  # fmt: skip
    args = [*common, "--iterations", "2", "--prompts-per-step", "2", "--group-size", "2",
            "--eval-every", "2", "--micro-batch", "2", "--lr", "1e-3", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "gsm8k" and summary["pipeline"] and summary["samples"] == 8
    assert set(summary["staleness_histogram"]) <= {"0", "1"}
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["event"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2]
    assert [r["step"] for r in recs if r["event"] == "eval"] == [2]
    assert train[0]["sync_check_tokens"] > 0 and train[0]["sync_check"] < 1e-4
    assert (out / "model" / "model.safetensors").is_file()
    capsys.readouterr()
    for extra, says in ((["--algo", "ppo"], "not ppo"),
                        (["--prompts-per-step", "20"], "need more data")):  # fmt: skip
        assert main([*common, *extra, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert not (tmp_path / "bad" / "metrics.jsonl").exists()  # before the first evaluation


@pytest.mark.slow  # ~5 s: keeps this file's new default-tier tests within their ~20 s
def test_benchmark_gsm8k_mode_compares_on_one_prompt_stream(tmp_path, monkeypatch) -> None:
    """`benchmarks/posttrain_rl.py --task gsm8k`: synchronous GRPO and Pipeline RL (serve
    engines) on the same prompts; the first batch, same weights and same generator state, is
    sampled identically by both; the checks hold."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    model, train, _ = _gsm8k_cli_files(tmp_path)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "posttrain_rl.py"
    spec = importlib.util.spec_from_file_location("posttrain_rl_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench"
    monkeypatch.setattr(sys, "argv", ["posttrain_rl.py", "--task", "gsm8k", "--model", str(model),
                                      "--data", str(train), "--iterations", "3", "--prompts", "2",
                                      "--group", "2", "--max-tokens", "8", "--micro-batch", "2",
                                      "--lr", "1e-3", "--out", str(out)])  # fmt: skip
    bench.main()
    sync, pipe = json.loads((out / "results.json").read_text())["runs"]
    assert sync["mode"] == "sync 1t" and pipe["mode"].startswith("pipeline")
    assert sync["prompt_stream"] == pipe["prompt_stream"] and sync["problems_scored"] == 6
    assert sync["reward"][0] == pipe["reward"][0]
    assert sync["response_len"][0] == pipe["response_len"][0]
    assert pipe["sync_check"][0][2] > 0 and pipe["sync_check"][0][1] < 1e-4
    assert all(c[2] == 0.0 for c in pipe["weight_check"]) and len(pipe["iteration_s"]) == 3
    assert set(pipe["staleness"]) <= {"0", "1"} and sync["per_iteration_s"]["gen_s"] > 0


class _FailingPrompts:
    """A prompt source whose second draw fails in the engine process (module level: pickled)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def draw(self, n: int):
        self.calls += 1
        if self.calls == 2:
            raise ValueError("prompt store went away")
        return self.inner.draw(n)


def test_an_engine_failure_is_one_line_in_the_trainer() -> None:
    """The engine process's error reaches the trainer as one LmforgeError (no hang, no
    traceback from the other process), whatever collective the trainer was in. A hang fails
    on the trainer's own wait for rollouts (a timeout with its message)."""
    from lmforge.posttrain.pipeline import ListPrompts
    from lmforge.utils.errors import LmforgeError

    tok = _byte_tokenizer()
    src = _FailingPrompts(ListPrompts(_gsm8k_items(tok, 8), seed=0).with_token_ids(tok))
    cfg = PipelineConfig(iterations=3, prompts_per_step=2, group_size=2, max_tokens=4)
    with pytest.raises(LmforgeError, match="engine process: prompt store went away"):
        run_pipeline(_odd_model(), cfg, progress=False, prompts=src, tokenizer=tok,
                     reward_fn=lambda i, t: Reward(float(len(t))))  # fmt: skip
