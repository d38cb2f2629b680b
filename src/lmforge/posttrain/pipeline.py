"""Pipeline RL: generation never stops for training.

Two processes (``torch.multiprocessing``, spawn), joined by a ``torch.distributed`` group (gloo
on CPU; NCCL when each has its own GPU):

- the **engine** decodes batches of ``prompts_per_step × group_size`` rollouts continuously with
  :class:`~lmforge.posttrain.rollout.LocalEngine` (or, ``engine="serve"``, the batched serve
  engine through :func:`~lmforge.posttrain.rollout.make_engine`). Before every decode step it checks the
  trainer's published version; when newer, it receives the weights (bucketed broadcast,
  :mod:`lmforge.posttrain.weight_sync`) and swaps them in **mid-sequence**, keeping the KV
  cache; every token records the version that sampled it. Finished batches go to a queue.
- the **trainer** takes finished batches as they arrive, scores them, drops (or down-weights)
  rollouts whose oldest token is more than ``max_lag`` versions behind, runs one optimizer
  step, publishes the new version and broadcasts the weights.

The importance ratio uses the engine's recorded log-probs (the behaviour policy, possibly mixed
across versions within a sequence), clipped as in GRPO; that is what makes lag tolerable.
Logged per step: the staleness histogram (token lag = trainer version − token version).

The engine runs on credit: it starts a batch only when the trainer has taken all but
``queue_size`` of the batches it finished (``queue_size=0``: it samples batch k+1 while the
trainer trains on batch k, so no token is more than one version old).

Simplification: one engine, lockstep batches (no continuous batching); the arithmetic task.
Placement across hosts belongs to an existing launcher (torchrun, Ray), not to this module.
Exercised by ``pytest tests/test_posttrain_pipeline.py`` and ``lmforge rl --pipeline``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmforge.utils.errors import LmforgeError


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline RL run settings (the arithmetic task)."""

    algo: str = "grpo"
    iterations: int = 40
    prompts_per_step: int = 32
    group_size: int = 8
    lr: float = 1e-3
    max_tokens: int = 5
    temperature: float = 1.0
    max_lag: int = 4
    "rollouts whose oldest token is more than this many versions old are dropped (or down-weighted)"
    stale: str = "drop"
    "drop | downweight (weight 1 / (1 + lag − max_lag))"
    digits: int = 3
    task: Any = None
    "the task object (an ArithmeticTask or subclass; None = ArithmeticTask(digits))"
    seed: int = 0
    eval_every: int = 5
    eval_size: int = 200
    target: float | None = None
    threads: int = 1
    "torch threads of the trainer process"
    engine_threads: int | None = None
    "torch threads of the engine process (None = threads)"
    backend: str = "gloo"
    "gloo (CPU, or one GPU shared by both processes: weights staged through CPU buckets) | nccl (each process its own GPU)"
    engine_device: str | None = None
    "the engine's device (None = the trainer model's device)"
    bucket_mib: int = 64
    overlong_cache: int = 0
    "DAPO's soft overlong penalty ramp (0 = off)"
    engine: str = "local"
    "the engine process's rollout engine: local (LocalEngine, lockstep) | serve (the batched serve engine: paged KV, CUDA graphs on a GPU)"
    queue_size: int = 0
    "finished batches the engine may hold unconsumed when it starts the next one: 0 = it samples batch k+1 while the trainer trains on batch k (token lag ≤ 1); each more adds overlap slack and one version of lag"


def _task(cfg: PipelineConfig) -> Any:
    from lmforge.posttrain.tasks import ArithmeticTask

    return cfg.task if cfg.task is not None else ArithmeticTask(digits=cfg.digits)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int, backend: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip


def _bucket_device(cfg: PipelineConfig, model_device: torch.device) -> torch.device:
    return torch.device("cpu") if cfg.backend == "gloo" else model_device


def _engine_main(cfg: PipelineConfig, model_cfg: Any, state: dict[str, torch.Tensor], port: int,
                 published: Any, consumed: Any, stop: Any, out_q: Any,
                 device: str) -> None:  # fmt: skip
    """The engine process: decode forever, swapping weights in between decode steps.

    It starts batch k only once the trainer has taken batch k − 1 − ``queue_size`` (credit
    ``consumed``), so lag stays bounded when generation is faster than training. Each payload
    carries the engine's time breakdown for that batch: decoding (``gen_s``, weight receives
    included), receiving weights (``recv_s``) and idling for credit or queue room (``idle_s``).
    """
    import random

    import torch.distributed as dist

    from lmforge.model import TransformerLM
    from lmforge.posttrain.core import encode_text
    from lmforge.posttrain.rollout import LocalEngine, SamplingParams, make_engine
    from lmforge.posttrain.weight_sync import broadcast_model, bucket_layout

    torch.set_num_threads(cfg.engine_threads or cfg.threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    model = TransformerLM(model_cfg)
    model.load_state_dict(state)
    model.to(device).eval()
    task = _task(cfg)
    tok = task.tokenizer()
    if cfg.engine == "serve":
        engine = make_engine(model, [tok.eos_id], prefer="serve")
    else:
        engine = LocalEngine(model, eos_ids=[tok.eos_id])
    layout = bucket_layout(model.named_parameters(), cfg.bucket_mib << 20)
    buckets = layout.empty_buckets(_bucket_device(cfg, torch.device(device)))
    rng = random.Random(cfg.seed + 1)
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                            n=cfg.group_size)  # fmt: skip
    # Warm up (first-call allocations) before joining the group: the trainer's clock starts
    # when the group forms, and a synchronous run's engine is warm by then too.
    engine.generate([encode_text(tok, it["prompt"]) for it in task.sample(2, random.Random(0))],
                    SamplingParams(max_tokens=2))  # fmt: skip
    torch.manual_seed(cfg.seed + 1)
    _init(1, port, cfg.backend)

    recv = [0.0]

    def sync() -> None:
        while published.value > engine.version:  # one broadcast per published version, in order
            t = time.perf_counter()
            broadcast_model(model, layout, buckets, src=0)
            recv[0] += time.perf_counter() - t
            engine.version += 1

    produced = 0
    while not stop.value:
        t_idle = time.perf_counter()
        while not stop.value and consumed.value < produced - cfg.queue_size:
            sync()  # keep answering broadcasts while the trainer is busy
            time.sleep(0.0005)
        items = task.sample(cfg.prompts_per_step, rng)
        sync()
        recv[0] = 0.0
        t_gen = time.perf_counter()
        idle_s = t_gen - t_idle
        dec = engine.start([encode_text(tok, it["prompt"]) for it in items], params)
        while not dec.done:
            sync()  # in-flight: new weights mid-sequence, the KV cache is kept
            dec.step()
        gen_s = time.perf_counter() - t_gen
        rows = [(o.prompt_token_ids, o.outputs[0]) for o in dec.outputs()]
        payload = (items, rows, {"gen_s": gen_s, "recv_s": recv[0], "idle_s": idle_s})
        while not stop.value:
            try:
                out_q.put(payload, timeout=0.05)
                produced += 1
                break
            except queue.Full:
                sync()
    while published.value > engine.version:  # the trainer may still be broadcasting
        sync()
    dist.barrier()
    dist.destroy_process_group()


def run_pipeline(
    model: nn.Module,
    cfg: PipelineConfig,
    log: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
    reward_fn: Callable[..., Any] | None = None,
    on_step: Callable[[dict[str, Any], nn.Module], None] | None = None,
) -> list[dict[str, Any]]:
    """Train ``model`` (an lmforge TransformerLM on the arithmetic task) with Pipeline RL.

    ``reward_fn(item, text)`` replaces the task's exact-match reward when given. The first and
    every ``eval_every``-th record hold ``sync_check``: the largest |π_θ/μ − 1| over the tokens of
    rows sampled wholly by the current version (lag 0, no mid-sequence swap) before the step — 0
    up to rounding when the broadcast weights arrived intact.

    Each record has the trainer's time breakdown (``wait_s`` for a batch, ``score_s``,
    ``fwd_s``/``bwd_s``/``opt_s`` of the step, ``broadcast_s``, ``eval_s``) and the engine's for
    that batch (``engine_gen_s``, ``engine_recv_s``, ``engine_idle_s``). ``time_s`` leaves out
    ``on_step(record, model)``, called after every step (the engine keeps decoding meanwhile, so
    keep it short: the benchmark only snapshots the weights there).
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from tqdm import tqdm

    from lmforge.posttrain import rl
    from lmforge.posttrain.core import sequence_logprobs
    from lmforge.posttrain.rollout import LocalEngine
    from lmforge.posttrain.weight_sync import broadcast_model, bucket_layout

    if cfg.engine not in ("local", "serve"):
        raise LmforgeError(f"unknown rollout engine {cfg.engine!r} (local, serve)")
    torch.set_num_threads(cfg.threads)
    task = _task(cfg)
    tok = task.tokenizer()
    algo = rl.algorithm(cfg.algo)
    step_cfg = rl.StepConfig(algo, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                             micro_batch=256)  # fmt: skip
    eval_items = task.eval_set(cfg.eval_size)
    eval_engine = LocalEngine(model, eos_ids=[tok.eos_id])

    ctx = mp.get_context("spawn")
    published = ctx.Value("i", 0)
    consumed = ctx.Value("i", 0)
    stop = ctx.Value("b", False)
    out_q = ctx.Queue(maxsize=cfg.queue_size + 1)
    port = _free_port()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    device = next(model.parameters()).device
    proc = ctx.Process(
        target=_engine_main,
        args=(
            cfg,
            model.config,
            state,
            port,
            published,
            consumed,
            stop,
            out_q,
            cfg.engine_device or str(device),
        ),
        daemon=True,
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc.start()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init(0, port, cfg.backend)
    layout = bucket_layout(model.named_parameters(), cfg.bucket_mib << 20)
    buckets = layout.empty_buckets(_bucket_device(cfg, device))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    version = 0
    hist_total: collections.Counter[int] = collections.Counter()
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    paused = 0.0  # seconds in on_step: not part of time_s
    samples = 0
    try:
        for it in tqdm(
            range(1, cfg.iterations + 1), desc=f"pipeline {cfg.algo}", disable=not progress
        ):
            t_wait = time.perf_counter()
            items, rows, eng_t = out_q.get(timeout=600)
            with consumed.get_lock():
                consumed.value += 1  # credit: the engine may start the next batch now
            wait_s = time.perf_counter() - t_wait
            t_score = time.perf_counter()
            samples += len(rows)
            comps = [c for _, c in rows]
            prompts = [p for p, _ in rows]
            n = cfg.group_size
            grouped = [type("O", (), {"outputs": comps[g * n : (g + 1) * n]})()
                       for g in range(len(items))]  # fmt: skip
            r, adv, stats = rl.score_groups(items, grouped, tok, reward_fn or task.reward, algo,
                                            cfg.max_tokens, cfg.overlong_cache,
                                            eos_ids=[tok.eos_id])  # fmt: skip
            s = rl.build_samples(prompts, comps, adv.flatten(), r.flatten())
            score_s = time.perf_counter() - t_score
            if it == 1 or it % cfg.eval_every == 0:  # a diagnostic forward: not every step
                with torch.no_grad():
                    logp, _ = sequence_logprobs(model, s.batch.input_ids.to(device),
                                                s.batch.labels.to(device), cfg.temperature)  # fmt: skip
                logp = logp.cpu()
                # Rows sampled wholly by the current version: a row with a mid-sequence swap keeps
                # KV entries of the older weights, so its later tokens need not have ratio 1.
                mine = s.versions == version  # (B, T)
                whole = ((s.versions == version) | (s.versions < 0)).all(dim=1)  # (B,)
                fresh = mine & whole[:, None]
                dev = ((logp - s.old_logp).exp() - 1).abs()[fresh]
                stats["sync_check"] = float(dev.max()) if dev.numel() else 0.0
            lags = [version - v for c in comps for v in c.policy_versions]
            step_hist = collections.Counter(lags)
            hist_total.update(step_hist)
            oldest = torch.tensor([version - min(c.policy_versions) if c.policy_versions else 0
                                   for c in comps])  # fmt: skip
            if cfg.stale == "drop":
                s = s.select((oldest <= cfg.max_lag).nonzero().flatten())
            else:
                s.weights = 1.0 / (1.0 + (oldest - cfg.max_lag).clamp_min(0).float())
            if algo.dynamic_sampling and len(s):
                keep = (s.advantages != 0).nonzero().flatten()
                s = s.select(keep)
            model.train()
            if len(s):
                stats.update(rl.rl_train_step(model, opt, s, step_cfg))
            model.eval()
            version += 1
            published.value = version
            t_bc = time.perf_counter()
            broadcast_model(model, layout, buckets, src=0)
            broadcast_s = time.perf_counter() - t_bc
            rec: dict[str, Any] = {"iteration": it, "samples": samples,
                                   "time_s": time.perf_counter() - t0 - paused,
                                   "version": version,
                                   "kept": len(s), "mean_lag": sum(lags) / max(len(lags), 1),
                                   "max_lag": max(lags, default=0),
                                   "wait_s": wait_s, "score_s": score_s,
                                   "broadcast_s": broadcast_s,
                                   **{f"engine_{k}": v for k, v in eng_t.items()},
                                   "mixed_version_rollouts": sum(len(set(c.policy_versions)) > 1
                                                                 for c in comps),
                                   **stats}  # fmt: skip
            if it % cfg.eval_every == 0 or it == cfg.iterations:
                t_eval = time.perf_counter()
                rec["eval_accuracy"] = rl.evaluate_accuracy(
                    eval_engine, tok, eval_items, task.reward, cfg.max_tokens
                )
                rec["eval_s"] = time.perf_counter() - t_eval
            if on_step is not None:
                t_pause = time.perf_counter()
                on_step(rec, model)
                paused += time.perf_counter() - t_pause
            if it == cfg.iterations or (cfg.target is not None
                                        and rec.get("eval_accuracy", -1) >= cfg.target):  # fmt: skip
                rec["staleness_histogram"] = {str(k): v for k, v in sorted(hist_total.items())}
            history.append(rec)
            if log is not None:
                log(rec)
            if cfg.target is not None and rec.get("eval_accuracy", -1) >= cfg.target:
                break
    finally:
        stop.value = True
        try:
            while True:
                out_q.get_nowait()
        except (queue.Empty, OSError, EOFError):
            pass
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
    return history
