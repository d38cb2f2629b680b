"""Pipeline RL: generation never stops for training.

Two processes (``torch.multiprocessing``, spawn), joined by a ``torch.distributed`` group (gloo
on CPU; NCCL when each has its own GPU):

- the **engine** decodes batches of ``prompts_per_step × group_size`` rollouts continuously on
  :class:`lmforge.serve.Engine` (:func:`~lmforge.posttrain.rollout.rollout_engine`). Before every
  engine step it checks the trainer's published version; when newer, it receives the weights
  (bucketed broadcast, :mod:`lmforge.posttrain.weight_sync`; or, ``transport="shared"`` on one
  device, copies them out of buckets shared with the trainer) and swaps them in
  **mid-sequence**, keeping the KV cache; every token records the version that sampled it.
- the **trainer** (:class:`PipelineObjective` in the one Trainer) takes finished batches as they
  arrive, scores them, drops (or down-weights) rollouts more than ``max_lag`` versions behind,
  runs one optimizer step and publishes the new weights.

The importance ratio uses the engine's recorded log-probs (the behaviour policy, possibly mixed
across versions within a sequence), clipped as in GRPO; that is what makes lag tolerable.
Logged per step: the staleness histogram (token lag = trainer version − token version).

The engine runs on credit: it starts a batch only when the trainer has taken all but
``queue_size`` of the batches it finished (``queue_size=0``: it samples batch k+1 while the
trainer trains on batch k, so no token is more than one version old).

Any task and any lmforge model: the engine process rebuilds the trainer's model
(:func:`rebuild_model`) and draws token ids from a picklable prompt source (:class:`TaskPrompts`,
:class:`ListPrompts`), so it never needs the tokenizer; a source drawn in the engine gives the
same prompts, in order, as its twin in a synchronous run of the same seed (:func:`item_stream`).
The trainer decodes and scores with the task's reward. Resume after ``kill -9``:
:class:`PipelineObjective`.

Simplification: one engine; a batch is started whole (the engine batches its rows
continuously). Only parameters are sent, not buffers (an MoE router's bias). Placement across
hosts belongs to a launcher (torchrun, Ray), not to this module.
Exercised by ``pytest tests/test_posttrain_pipeline.py``, ``pytest tests/test_posttrain_resume.py
-k pipeline`` and ``lmforge rl --pipeline``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
import queue
import random
import shutil
import socket
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.core import (
    encode_text,
    is_lmforge_model,
    sequence_logprobs,
    set_random_state,
)
from lmforge.posttrain.rl import GRPOObjective, add_eval_accuracy, build_samples, score_groups
from lmforge.utils.errors import LmforgeError


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline RL run settings (the toy tasks by default; any task with a prompt source)."""

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
    "the toy task object (an ArithmeticTask or subclass; None = ArithmeticTask(digits)); unused when run_pipeline gets prompts"
    seed: int = 0
    eval_every: int = 5
    "evaluate (and run the sync and weight checks) every this many iterations, and at the first"
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
    transport: str = "broadcast"
    "broadcast (bucketed torch.distributed broadcast over the backend) | shared (engine on the trainer's device: the trainer packs each version into buckets the engine process maps — CUDA IPC on a GPU, shared memory on the CPU — and the engine copies them out; no collective, no CPU staging)"
    overlong_cache: int = 0
    "DAPO's soft overlong penalty ramp (0 = off)"
    queue_size: int = 0
    "finished batches the engine may hold unconsumed when it starts the next one: 0 = it samples batch k+1 while the trainer trains on batch k (token lag ≤ 1); each more adds overlap slack and one version of lag"
    micro_batch: int = 256
    "sequences per forward/backward of a train step (long replies on a large vocabulary: lower it)"
    kl_coef: float = 0.0
    "weight of the k3 KL to run_pipeline's ref_model (0 = none)"
    epochs: int = 1
    "optimizer steps per rollout batch (one new version per batch either way)"

    @classmethod
    def from_run(cls, cfg: Any, **derived: Any) -> PipelineConfig:
        """The pipeline's settings from a run config's ``rl`` and ``train`` branches (plus the
        ``derived`` values the command computed: task, max_tokens, overlong_cache)."""
        rc, tc = cfg.rl, cfg.train
        return cls(algo=rc.algo, iterations=rc.iterations, prompts_per_step=rc.prompts_per_step,
                   group_size=rc.group_size, lr=tc.lr, temperature=rc.temperature,
                   max_lag=rc.max_lag, digits=rc.digits, seed=tc.seed,
                   eval_every=tc.eval_every or 5, eval_size=rc.eval_size,
                   target=rc.target or None, queue_size=rc.queue_size,
                   engine_threads=rc.engine_threads or None, micro_batch=tc.batch_size,
                   kl_coef=rc.kl_coef, epochs=rc.epochs, transport=rc.weight_transport,
                   **derived)  # fmt: skip


# -- Prompt sources: picklable, so the engine process draws the prompts itself


class TaskPrompts:
    """The toy tasks' prompt stream ``task.sample(n, random.Random(seed))``, as ``GRPOObjective``
    draws it; :meth:`draw` adds the prompts' token ids (the task's tokenizer, which pickles)."""

    def __init__(self, task: Any, seed: int) -> None:
        self.task = task
        self.rng = random.Random(seed)
        self.tokenizer = task.tokenizer()

    def __call__(self, n: int) -> list[dict[str, Any]]:
        return self.task.sample(n, self.rng)

    def draw(self, n: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """``n`` items and their prompts' token ids."""
        items = self(n)
        return items, [encode_text(self.tokenizer, it["prompt"]) for it in items]


class ListPrompts:
    """Records with a ``prompt`` text (GSM8K, MATH) drawn like ``random.Random(seed).sample``,
    ``n`` per call. :meth:`with_token_ids` (in the trainer, which holds the tokenizer) encodes
    every prompt once, so :meth:`draw` in the engine process needs no tokenizer."""

    def __init__(self, items: Sequence[dict[str, Any]], seed: int) -> None:
        if not items:
            raise LmforgeError("no prompts to sample from")
        self.items = list(items)
        self.rng = random.Random(seed)
        self.token_ids: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def _pick(self, n: int) -> list[int]:
        if n > len(self.items):
            raise LmforgeError(
                f"{n} prompts per step from {len(self.items)} problems: need more data"
            )
        # indices, not items: random.sample's picks depend only on the population's length
        return self.rng.sample(range(len(self.items)), n)

    def __call__(self, n: int) -> list[dict[str, Any]]:
        return [self.items[i] for i in self._pick(n)]

    def with_token_ids(self, tokenizer: Any) -> ListPrompts:
        """A copy (same stream position) holding every prompt's token ids."""
        out = copy.copy(self)
        out.rng = copy.deepcopy(self.rng)
        out.token_ids = [encode_text(tokenizer, it["prompt"]) for it in self.items]
        return out

    def draw(self, n: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """``n`` items and their prompts' token ids."""
        if self.token_ids is None:
            raise LmforgeError("ListPrompts.draw needs with_token_ids(tokenizer) first")
        idx = self._pick(n)
        return [self.items[i] for i in idx], [self.token_ids[i] for i in idx]


def item_stream(prompts: Any) -> Callable[[int], list[dict[str, Any]]]:
    """``n -> items`` drawn from a copy of ``prompts``: a synchronous run given this sees the
    prompts the pipeline's engine draws from ``prompts``, in the same order."""
    return copy.deepcopy(prompts)


# -- The engine process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int, backend: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip


def rebuild_model(
    model_cfg: Any, state: dict[str, torch.Tensor], device: str | torch.device
) -> nn.Module:
    """The trainer's lmforge model rebuilt from its config and state dict on ``device``, in the
    state's dtype (the config carries every shape option; RoPE tables are recomputed). A tied
    model stays tied, so both sides list the same parameters for the bucketed broadcast."""
    from lmforge.model import TransformerLM

    dtype = state["token_embeddings.weight"].dtype
    model = TransformerLM(model_cfg, device=device, dtype=dtype)
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def weight_fingerprint(model: nn.Module) -> torch.Tensor:
    """(P, 2) float64 on the CPU: each parameter's sum and sum of magnitudes (a cheap check
    that two processes hold the same weights)."""
    rows = [torch.stack([p.sum(dtype=torch.float64), p.abs().sum(dtype=torch.float64)])
            for p in model.parameters()]  # fmt: skip
    return torch.stack(rows).cpu()


def fingerprint_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |Δ sum| / sum |w| over the parameters of two fingerprints: ~1e-16 when the
    weights are identical (reduction order may differ across thread counts), ≥ one update's
    relative size when one side is a version behind or a bucket was garbled."""
    if a.shape != b.shape:
        return float("inf")
    return float(((a[:, 0] - b[:, 0]).abs() / a[:, 1].clamp_min(1e-30)).max())


def _serve_stats(engine: Any) -> dict[str, float]:
    stats = getattr(engine, "stats", None)
    if not isinstance(stats, dict):
        return {}
    return {k: float(stats[k]) for k in ("decode_s", "mixed_s", "decode_steps", "mixed_steps")
            if k in stats}  # fmt: skip


def _bucket_device(cfg: PipelineConfig, device: torch.device | str) -> torch.device:
    # where the weight broadcast's buckets live: gloo stages them through the CPU
    return torch.device("cpu") if cfg.backend == "gloo" else torch.device(device)


def _engine_main(link: _Link, *args: Any) -> None:
    """The engine process: :func:`_engine_loop` (decode forever on credit, swapping weights in
    between decode steps), its failure sent to the trainer as one line. Each batch carries the
    engine's seconds decoding (``gen_s``, receives included), receiving weights (``recv_s``) and
    idling for credit or queue room (``idle_s``). It exits when the trainer (``parent``) is gone,
    so a resumed run starts a fresh engine (:class:`PipelineObjective`)."""
    import torch.distributed as dist

    try:
        _engine_loop(link, *args)
    except Exception as e:  # the trainer raises it as one line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        try:
            link.out_q.put(("error", f"Pipeline RL engine process: {msg}"), timeout=5)
        except (queue.Full, OSError, ValueError):
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def _engine_loop(link: _Link, cfg: PipelineConfig, model_cfg: Any, state_file: str, port: int,
                 device: str, prompts: Any, eos_ids: list[int],
                 shared: list[torch.Tensor] | None, parent: int) -> None:  # fmt: skip
    import torch.distributed as dist

    from lmforge.posttrain.rollout import rollout_engine
    from lmforge.posttrain.weight_sync import (
        broadcast_model,
        bucket_layout,
        copy_into,
        unpack_buckets,
    )
    from lmforge.serve import SamplingParams

    published, consumed, stop, out_q, acked = (link.published, link.consumed, link.stop,
                                               link.out_q, link.acked)  # fmt: skip
    torch.set_num_threads(cfg.engine_threads or cfg.threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    from lmforge.checkpoint.io import load_model_state

    model = rebuild_model(model_cfg, load_model_state(state_file), device)
    start = consumed.value  # batches the trainer already trained on (a resumed run: > 0)
    # not checkpointed (it depends on batches lost in flight): seeded from the starting batch
    engine = rollout_engine(model, eos_ids, seed=cfg.seed + 1 + 1_000_003 * start)
    engine.update_weights({}, published.value)  # the checkpoint's weights carry its version
    layout = bucket_layout(model.named_parameters(), cfg.bucket_mib << 20)
    buckets = [] if shared is not None else layout.empty_buckets(_bucket_device(cfg, device))
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                            n=cfg.group_size, stop_token_ids=tuple(eos_ids))  # fmt: skip
    # warm up before joining the group (the trainer's clock starts then, as a synchronous run's
    # engine is warm by then), on a copy of the prompt source so the stream is untouched
    engine.generate(copy.deepcopy(prompts).draw(1)[1], SamplingParams(max_tokens=2))
    out_q.put(("ready",))
    _init(1, port, cfg.backend)

    recv = [0.0]

    named = dict(model.named_parameters())  # tied weights once (the layout's names)
    cuda = device.startswith("cuda")

    def sync() -> None:
        # one transfer per published version, in order, between two engine steps
        while published.value > engine.policy_version:
            t = time.perf_counter()
            if shared is None:
                broadcast_model(model, layout, buckets, src=0)
            else:  # the trainer packed version policy_version + 1 and waits for this ack
                copy_into(named, unpack_buckets(layout, shared))
                if cuda:
                    torch.cuda.synchronize()
            recv[0] += time.perf_counter() - t
            # the weights were written in place; the version moves (running KV is kept)
            engine.update_weights({}, engine.policy_version + 1)
            if shared is not None:
                acked.value = engine.policy_version

    def orphaned() -> bool:
        if os.getppid() != parent:  # the trainer was killed: nobody reads the queue any more
            os._exit(0)  # not sys.exit: the queue's feeder thread would wait for a reader
        return False

    produced = start
    while not stop.value:
        t_idle = time.perf_counter()
        while not stop.value and consumed.value < produced - cfg.queue_size and not orphaned():
            sync()  # keep answering broadcasts while the trainer is busy
            time.sleep(0.0005)
        if stop.value:
            break
        items, prompt_ids = prompts.draw(cfg.prompts_per_step)
        sync()
        k = produced + 1  # the trainer consumes in order: this batch is its iteration k
        check = (
            (engine.policy_version, weight_fingerprint(model))
            if k in (1, start + 1) or k % cfg.eval_every == 0
            else None
        )
        recv[0] = 0.0
        s0 = _serve_stats(engine)
        t_gen = time.perf_counter()
        idle_s = t_gen - t_idle
        ids = [engine.add_request(p, params) for p in prompt_ids]
        done: dict[str, Any] = {}
        while engine.has_unfinished():
            sync()  # in-flight: new weights mid-sequence, the KV cache is kept
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        gen_s = time.perf_counter() - t_gen
        rows = [(list(done[i].prompt_token_ids), c) for i in ids for c in done[i].outputs]
        timing = {"gen_s": gen_s, "recv_s": recv[0], "idle_s": idle_s}
        timing.update({f"serve_{n}": v - s0[n] for n, v in _serve_stats(engine).items()})
        payload = ("batch", items, rows, timing, check)
        while not stop.value and not orphaned():
            try:
                out_q.put(payload, timeout=0.05)
                produced += 1
                break
            except queue.Full:
                sync()
    while published.value > engine.policy_version:  # the trainer may still be broadcasting
        sync()
    dist.barrier()
    dist.destroy_process_group()


class _EngineError(LmforgeError):
    """The engine process failed, died or went silent (it joins no more collectives)."""


def _take(out_q: Any, proc: Any, timeout: float = 600.0) -> tuple[Any, ...]:
    """The engine's next message; its error, its death or silence become one-line errors."""
    start = time.monotonic()
    while True:
        try:
            msg = out_q.get(timeout=0.2)
        except queue.Empty:
            if not proc.is_alive():
                raise _EngineError(
                    f"the Pipeline RL engine process exited (code {proc.exitcode})"
                ) from None
            if time.monotonic() - start > timeout:
                raise _EngineError(
                    f"no rollouts from the Pipeline RL engine in {timeout:.0f} s"
                ) from None
            continue
        if msg[0] == "error":
            raise _EngineError(msg[1])
        return msg


# -- The trainer


def check_inputs(model: nn.Module, cfg: PipelineConfig, prompts: Any = None,
                 tokenizer: Any = None) -> Any:  # fmt: skip
    """:func:`run_pipeline`'s checks of its inputs, each a one-line :class:`LmforgeError`; cheap,
    so a command runs them before its first evaluation. Returns ``prompts``: a
    :class:`ListPrompts` with its token ids (encoded with ``tokenizer`` when missing), checked
    against the model's context and ``prompts_per_step``; any other source as given."""
    if cfg.transport not in ("broadcast", "shared"):
        raise LmforgeError(f"unknown weight transport {cfg.transport!r} (broadcast, shared)")
    if not is_lmforge_model(model):
        raise LmforgeError("Pipeline RL needs an lmforge model (a checkpoint, a GGUF or HF import; "
                           "not a transformers model): the engine process rebuilds it from its "
                           "config")  # fmt: skip
    if cfg.transport == "shared":
        device = next(model.parameters()).device
        want = torch.device(cfg.engine_device or device)
        if want.type != device.type or (want.index is not None and want.index != device.index):
            raise LmforgeError("transport 'shared' needs the engine on the trainer's device "
                               f"({device}), not {cfg.engine_device}")  # fmt: skip
    if isinstance(prompts, ListPrompts):
        if prompts.token_ids is None:
            prompts = prompts.with_token_ids(tokenizer)
        longest = max(len(p) for p in prompts.token_ids) + cfg.max_tokens
        ctx = model.config.context_length
        if longest > ctx:
            raise LmforgeError(f"the longest prompt + max_tokens ({longest}) exceeds the model's "
                               f"context ({ctx})")  # fmt: skip
        if cfg.prompts_per_step > len(prompts):
            raise LmforgeError(f"{cfg.prompts_per_step} prompts per step from {len(prompts)} "
                               "problems: need more data")  # fmt: skip
    return prompts


def run_pipeline(
    model: nn.Module,
    cfg: PipelineConfig,
    log: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
    reward_fn: Callable[..., Any] | None = None,
    on_step: Callable[[dict[str, Any], nn.Module], None] | None = None,
    *,
    prompts: Any = None,
    tokenizer: Any = None,
    eos_ids: Sequence[int] | None = None,
    eval_fn: Callable[[], float] | None = None,
    ref_model: nn.Module | None = None,
    run_config: Any = None,
) -> list[dict[str, Any]]:
    """Train ``model`` (an lmforge ``TransformerLM``) with Pipeline RL.

    The task: by default ``cfg.task`` (a toy task: its prompts, tokenizer, reward and held-out
    set). Any other task passes ``prompts`` (a picklable source with ``draw(n)``),
    ``tokenizer`` (decodes the replies), ``reward_fn(item, text)`` and optionally ``eos_ids``
    (default: the tokenizer's), ``eval_fn() -> accuracy`` and ``ref_model`` (for
    ``cfg.kl_coef``). ``reward_fn`` alone replaces a toy task's reward.

    The first and every ``eval_every``-th record hold ``sync_check``: the largest |π_θ/μ − 1|
    over the ``sync_check_tokens`` tokens of rows sampled wholly by the current version — 0 up
    to rounding when the engine's rebuilt model is the trainer's — and ``weight_check``:
    :func:`fingerprint_mismatch` between the engine's weights when it started that batch and the
    trainer's at that version (``weight_check_version``; 0 up to rounding when every broadcast
    arrived intact). The trainer side: :class:`PipelineObjective` under ``run_config``'s
    ``[train]`` (else one built from ``cfg`` in a temporary folder).

    Each record has the trainer's seconds (``wait_s`` for a batch, ``score_s``, ``broadcast_s``)
    and the engine's for that batch (``engine_gen_s``, ``engine_recv_s``, ``engine_idle_s``;
    ``engine_serve_*`` with the serve engine). ``time_s`` leaves out ``on_step(record, model)``,
    called after every step (the engine keeps decoding meanwhile, so keep it short).
    """
    import torch.multiprocessing as mp

    from lmforge.checkpoint.io import save_model_state
    from lmforge.posttrain import rl
    from lmforge.posttrain.models import eos_ids as tokenizer_eos
    from lmforge.posttrain.weight_sync import bucket_layout

    if cfg.kl_coef > 0 and ref_model is None:
        raise LmforgeError("kl_coef > 0 needs a reference model")
    torch.set_num_threads(cfg.threads)
    if prompts is None:  # a toy task: everything comes from it
        from lmforge.posttrain.tasks import ArithmeticTask

        task = cfg.task if cfg.task is not None else ArithmeticTask(digits=cfg.digits)
        tokenizer = tokenizer or task.tokenizer()
        prompts = TaskPrompts(task, cfg.seed + 1)
        reward_fn = reward_fn or task.reward
        if eval_fn is None:
            from lmforge.posttrain.rollout import rollout_engine

            eval_items = task.eval_set(cfg.eval_size)
            eval_engine = rollout_engine(model, [tokenizer.eos_id])

            def eval_fn() -> float:
                return rl.evaluate_accuracy(eval_engine, tokenizer, eval_items, task.reward,
                                            cfg.max_tokens, eos_ids=[tokenizer.eos_id])  # fmt: skip
    elif tokenizer is None or reward_fn is None:
        raise LmforgeError("run_pipeline with prompts needs a tokenizer and a reward_fn")
    prompts = check_inputs(model, cfg, prompts, tokenizer)
    eos = list(eos_ids) if eos_ids is not None else tokenizer_eos(tokenizer)

    from lmforge.train import Trainer

    device = next(model.parameters()).device
    layout = bucket_layout(model.named_parameters(), cfg.bucket_mib << 20)
    shared = None
    if cfg.transport == "shared":
        shared = layout.empty_buckets(device)  # CUDA tensors travel to the engine by IPC
        if device.type == "cpu":
            shared = [b.share_memory_() for b in shared]
    run_dir = None
    if run_config is None:
        run_dir = tempfile.mkdtemp(prefix="lmforge-pipeline-run-")
        run_config = pipeline_run_config(cfg, run_dir, progress, str(device))
    objective = PipelineObjective(cfg, model, tokenizer, reward_fn, eos, prompts, layout,
                                  shared, ref_model=ref_model, eval_fn=eval_fn)  # fmt: skip
    history: list[dict[str, Any]] = []

    def record(trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        # one record per rollout batch (its last epoch's step); on_step off the clock
        if objective.passes_left:
            return
        rec = {"step": step, **{k: v for k, v in metrics.items() if k not in ("lr", "skipped")}}
        rec["time_s"] = time.perf_counter() - objective.t0 - objective.paused
        if on_step is not None:
            t_pause = time.perf_counter()
            on_step(rec, model)
            objective.paused += time.perf_counter() - t_pause
        history.append(rec)

    # restored before the engine starts: a resumed engine starts from what it restored
    trainer = Trainer(run_config, model=model, objective=objective, callbacks=[record])
    ctx = mp.get_context("spawn")
    link = _Link(ctx.Value("i", objective.version), ctx.Value("i", objective.batches),
                 ctx.Value("b", False), ctx.Queue(maxsize=cfg.queue_size + 1),
                 ctx.Value("i", objective.version))  # fmt: skip
    port = _free_port()
    # a file, not process arguments: pickled tensors travel through /dev/shm (often 64 MB)
    handoff = tempfile.mkdtemp(prefix="lmforge-pipeline-")
    state_file = os.path.join(handoff, "state.safetensors")
    save_model_state(state_file, model.state_dict())  # a tied head once; the engine re-ties it
    proc = ctx.Process(
        target=_engine_main,
        args=(link, cfg, model.config, state_file, port, cfg.engine_device or str(device),
              item_stream(objective.prompts or prompts), eos, shared, os.getpid()),
        daemon=True,
    )  # fmt: skip
    objective.link, objective.proc = link, proc
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc.start()
    engine_failed = False
    try:
        _take(link.out_q, proc)  # "ready": the engine is built and warm
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _init(0, port, cfg.backend)
        objective.start()
        trainer.run()
    except _EngineError:
        engine_failed = True
        raise
    except RuntimeError:  # a collective failing because the engine died: say why
        reason = _engine_reported(link.out_q)
        if reason is None and proc.is_alive():
            raise
        engine_failed = True
        raise LmforgeError(
            reason or f"the Pipeline RL engine process exited (code {proc.exitcode})"
        ) from None
    finally:
        link.stop.value = True
        try:
            while True:
                link.out_q.get_nowait()
        except (queue.Empty, OSError, EOFError, ValueError):
            pass
        import torch.distributed as dist

        if dist.is_initialized():
            if not engine_failed and proc.is_alive():
                dist.barrier()
            dist.destroy_process_group()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
        shutil.rmtree(handoff, ignore_errors=True)
    add_eval_accuracy(history, run_config.train.out_dir, "step")
    if history:
        history[-1]["staleness_histogram"] = {
            str(k): v for k, v in sorted(objective.hist_total.items())
        }
    if log is not None:
        for rec in history:
            log(rec)
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return history


def pipeline_run_config(cfg: PipelineConfig, out_dir: str, progress: bool, device: str) -> Any:
    """The Trainer's run config of a Pipeline RL run given only its :class:`PipelineConfig`
    (AdamW β2 0.99 without weight decay at a constant ``cfg.lr``, clipping at 1, one step per
    batch and epoch, evaluation every ``eval_every`` batches)."""
    from lmforge.config import RunConfig
    from lmforge.train import TrainConfig

    tc = TrainConfig(out_dir=out_dir, device=device, precision="fp32", lr=cfg.lr, min_lr=0.0,
                     beta2=0.99, weight_decay=0.0, schedule="constant", warmup_steps=0,
                     max_steps=cfg.iterations * cfg.epochs, batch_size=cfg.micro_batch,
                     eval_every=cfg.eval_every * cfg.epochs, save_every=0, log_every=1,
                     plot=False, progress=progress)  # fmt: skip
    return RunConfig(train=tc)


@dataclasses.dataclass
class _Link:
    """What the trainer and the engine process share (``consumed``: the engine's credit;
    ``acked``: the version the engine copied out of shared buckets)."""

    published: Any
    consumed: Any
    stop: Any
    out_q: Any
    acked: Any


class PipelineObjective(GRPOObjective):
    """Pipeline RL's trainer side: :class:`~lmforge.posttrain.rl.GRPOObjective`'s loss,
    micro-batches and metrics with its own rollouts. Before the step that starts a new rollout
    batch it publishes the last step's weights, takes the engine's next finished batch, scores
    it and drops (or down-weights) rollouts older than ``max_lag`` versions. ``link`` and
    ``proc`` (the engine process) are attached by :func:`run_pipeline` once the Trainer has
    restored the checkpoint, since the engine starts from what it restored.

    Resume after ``kill -9``: the checkpoint holds the learner, the version and batch counters,
    the staleness histogram, the prompt stream's position (a twin of the engine's source, one
    draw per batch taken) and, mid-batch (``epochs`` > 1), the batch being trained on. The
    resumed engine starts from the checkpoint's weights as the next version, at the next batch:
    prompts, batch and version numbering continue exactly (a mid-batch resume adds one
    version). Not exact: the rollouts. Batches in flight at the kill are sampled again with a
    new sampling stream; even two uninterrupted runs differ, since where a weight swap lands
    mid-sequence depends on timing."""

    def __init__(self, cfg: PipelineConfig, model: nn.Module, tokenizer: Any, reward_fn: Any,
                 eos: list[int], prompts: Any, layout: Any, shared: list[torch.Tensor] | None,
                 *, ref_model: nn.Module | None = None,
                 eval_fn: Callable[[], float] | None = None) -> None:  # fmt: skip
        super().__init__(None, tokenizer, None, reward_fn, cfg.algo,  # type: ignore[arg-type]
                         prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size,
                         epochs=cfg.epochs, micro_batch=cfg.micro_batch,
                         max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                         kl_coef=cfg.kl_coef, overlong_cache=cfg.overlong_cache, eos_ids=eos,
                         ref_model=ref_model, target=cfg.target or 0.0)  # fmt: skip
        self.name = f"pipeline {cfg.algo}"
        self.cfg, self.model, self.layout, self.shared = cfg, model, layout, shared
        # a twin of the engine's prompt stream, its RNG saved (a source without one can't resume)
        self.prompts = item_stream(prompts) if hasattr(prompts, "rng") else None
        self.link: _Link | None = None
        self.proc: Any = None
        self.eval_fn = eval_fn
        device = next(model.parameters()).device
        self.buckets = layout.empty_buckets(_bucket_device(cfg, device)) if shared is None else []
        self.version = 0
        self.batches = 0
        self.first = 1  # this attempt's first batch (its sync check always runs)
        self.fresh = True  # the engine already holds the current weights: nothing to publish
        self.hist_total: collections.Counter[int] = collections.Counter()
        self.fingerprints: dict[int, torch.Tensor | None] = {0: weight_fingerprint(model)}
        self.t0 = time.perf_counter()
        self.paused = 0.0

    def start(self) -> None:
        """The clock starts (after the trainer is built and the engine joined)."""
        self.t0 = time.perf_counter()

    def _publish(self) -> float:
        from lmforge.posttrain.weight_sync import broadcast_model

        t = time.perf_counter()
        link = self.link
        assert link is not None
        if self.shared is None:
            self.version += 1
            link.published.value = self.version
            broadcast_model(self.model, self.layout, self.buckets, src=0)
        else:
            _publish_shared(self.model, self.layout, self.shared, self.version, link.acked,
                            self.proc)  # fmt: skip
            self.version += 1
            link.published.value = self.version  # after the pack: a whole version
        # the engine fingerprints batch k at a version in [k - queue_size - 2, k - 1]: keep those
        ahead = range(self.batches + 1, self.batches + self.cfg.queue_size + 3)
        checked = any(k % self.cfg.eval_every == 0 for k in ahead)
        self.fingerprints[self.version] = weight_fingerprint(self.model) if checked else None
        for old in [v for v in self.fingerprints if v < self.version - self.cfg.queue_size - 2]:
            del self.fingerprints[old]  # the engine starts no batch that far behind
        return time.perf_counter() - t

    def before_step(self, trainer: Any, step: int) -> None:
        """At a new rollout batch: publish, take, score, filter; then this step's pass."""
        link = self.link
        assert link is not None, "run_pipeline attaches the engine's link"
        if self.passes_left == 0:
            broadcast_s = 0.0 if self.fresh else self._publish()
            self.fresh = False
            t_wait = time.perf_counter()
            _, items, rows, eng_t, check = _take(link.out_q, self.proc)
            with link.consumed.get_lock():
                link.consumed.value += 1  # credit: the engine may start the next batch
            wait_s = time.perf_counter() - t_wait
            self.batches += 1
            if self.prompts is not None:
                self.prompts(self.cfg.prompts_per_step)  # the twin follows the engine's stream
            t_score = time.perf_counter()
            self.samples_seen += len(rows)
            comps = [c for _, c in rows]
            n = self.cfg.group_size
            grouped = [type("O", (), {"outputs": comps[i * n : (i + 1) * n]})()
                       for i in range(len(items))]  # fmt: skip
            r, adv, stats = score_groups(items, grouped, self.tokenizer, self.reward_fn,
                                         self.algo, self.cfg.max_tokens, self.cfg.overlong_cache,
                                         eos_ids=self.eos, std=self.std)  # fmt: skip
            s = build_samples([p for p, _ in rows], comps, adv.flatten(), r.flatten())
            score_s = time.perf_counter() - t_score
            if check is not None and self.fingerprints.get(check[0]) is not None:
                stats["weight_check"] = fingerprint_mismatch(self.fingerprints[check[0]],
                                                             check[1])  # fmt: skip
                stats["weight_check_version"] = check[0]
            if self.batches == self.first or self.batches % self.cfg.eval_every == 0:
                device = next(self.model.parameters()).device
                stats["sync_check"], stats["sync_check_tokens"] = _sync_check(
                    self.model, s, self.version, self.cfg, device
                )
            lags = [self.version - v for c in comps for v in c.policy_versions]
            self.hist_total.update(collections.Counter(lags))
            oldest = torch.tensor([self.version - min(c.policy_versions) if c.policy_versions
                                   else 0 for c in comps])  # fmt: skip
            if self.cfg.stale == "drop":
                s = s.select((oldest <= self.cfg.max_lag).nonzero().flatten())
            else:
                s.weights = 1.0 / (1.0 + (oldest - self.cfg.max_lag).clamp_min(0).float())
            if self.algo.dynamic_sampling and len(s):
                s = s.select((s.advantages != 0).nonzero().flatten())
            self.samples = s
            self.passes_left = self.cfg.epochs
            # which prompts this batch holds: a resumed run's batches match an uninterrupted one's
            digest = zlib.crc32("\x00".join(it["prompt"] for it in items).encode())
            self._stats = {"iteration": self.batches, "samples": self.samples_seen,
                           "prompt_digest": digest,
                           "version": self.version + 1, "kept": len(s),
                           "mean_lag": sum(lags) / max(len(lags), 1),
                           "max_lag": max(lags, default=0), "wait_s": wait_s,
                           "score_s": score_s, "broadcast_s": broadcast_s,
                           **{f"engine_{k}": v for k, v in eng_t.items()},
                           "mixed_version_rollouts": sum(len(set(c.policy_versions)) > 1
                                                         for c in comps), **stats}  # fmt: skip
        self.passes_left -= 1
        self._split()

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``eval_fn()`` (held-out accuracy), when given; the target check."""
        if self.eval_fn is None:
            return {}
        acc = float(self.eval_fn())
        self.should_stop = bool(self.target) and acc >= self.target
        return {"eval_accuracy": acc}

    def state_dict(self) -> dict:
        """The GRPO state, the version and batch counters, the staleness histogram and the prompt
        stream's RNG (the class docstring says what a resume reproduces)."""
        return {**super().state_dict(), "version": self.version, "batches": self.batches,
                "hist": dict(self.hist_total),
                "prompt_rng": self.prompts.rng.getstate() if self.prompts else None}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (after the Trainer restored the weights):
        those weights become the next version, which the engine starts from."""
        super().load_state_dict(state)
        self.batches = int(state["batches"])
        self.hist_total = collections.Counter({int(k): int(v) for k, v in state["hist"].items()})
        if self.prompts is None or state["prompt_rng"] is None:
            raise LmforgeError("this Pipeline RL prompt source keeps no RNG to resume from; "
                               "use a new train.out_dir")  # fmt: skip
        set_random_state(self.prompts.rng, state["prompt_rng"])
        # The checkpoint's weights are newer than the last published version (a step ran since)
        self.version = int(state["version"]) + 1
        self.fingerprints = {self.version: weight_fingerprint(self.model)}
        self.first = self.batches + 1
        self.fresh = self.passes_left == 0  # mid-batch, the next batch publishes as usual


@torch.no_grad()
def _publish_shared(model: nn.Module, layout: Any, shared: list[torch.Tensor], version: int,
                    acked: Any, proc: Any) -> None:  # fmt: skip
    """Pack the weights into the shared buckets once the engine has copied ``version`` out."""
    from lmforge.posttrain.weight_sync import pack_buckets

    while acked.value < version:  # the buckets still hold a version the engine has not copied
        if not proc.is_alive():
            raise _EngineError(f"the Pipeline RL engine process exited (code {proc.exitcode})")
        time.sleep(0.0002)
    pack_buckets(layout, dict(model.named_parameters()), shared)
    if shared and shared[0].is_cuda:
        torch.cuda.synchronize(shared[0].device)  # the engine reads them from another process


def _engine_reported(out_q: Any) -> str | None:
    """The error the engine sent, if any (the queue is drained looking for it)."""
    try:
        while True:
            msg = out_q.get(timeout=0.5)
            if msg[0] == "error":
                return msg[1]
    except (queue.Empty, OSError, EOFError, ValueError):
        return None


@torch.no_grad()
def _sync_check(
    model: nn.Module, s: Any, version: int, cfg: PipelineConfig, device: torch.device
) -> tuple[float, int]:
    """(max |π_θ/μ − 1|, tokens checked) over the rows sampled wholly by ``version``."""
    # a row with a mid-sequence swap keeps older KV entries: its later tokens need not have ratio 1
    whole = ((s.versions == version) | (s.versions < 0)).all(dim=1)  # (B,)
    rows = whole.nonzero().flatten()
    worst, count = 0.0, 0
    for i in range(0, len(rows), cfg.micro_batch):  # micro-batches: (B, T, V) logits are large
        part = s.select(rows[i : i + cfg.micro_batch])
        logp, _ = sequence_logprobs(model, part.batch.input_ids.to(device),
                                    part.batch.labels.to(device), cfg.temperature)  # fmt: skip
        fresh = part.versions == version  # (b, T)
        dev = ((logp.cpu() - part.old_logp).exp() - 1).abs()[fresh]
        if dev.numel():
            worst, count = max(worst, float(dev.max())), count + dev.numel()
    return worst, count
