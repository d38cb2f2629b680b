"""The one training loop: objective → step (forward/backward, clip, AdamW) → callbacks → logs,
eval, saves. Every phase is an :class:`~lmforge.train.Objective` (:mod:`lmforge.train.objective`):
pretraining's :class:`~lmforge.train.LMObjective` (built here from ``[model]`` and ``[data]``, with
all the fast paths below), or one given with its model (:mod:`lmforge.posttrain`; without master
weights, compile or the step graph).

The model is built single-device with the backends of the run's :class:`~lmforge.train.FastPath`
(:func:`~lmforge.train.resolve_fast_path`), then wrapped from outside in one fixed order:

    1. master weights (bf16 copies of fp32 masters, :func:`~lmforge.train.wrap.bf16_weight_copies`)
    2. activation checkpointing (each block's ``forward`` recomputed in backward; names unchanged)
    3. ``torch.compile`` (``module.compile()`` in place, so parameter names stay unchanged)
    4. the parallelism :class:`~lmforge.parallel.Strategy` (``Strategy(model)`` on one process,
       ``lmforge.parallel.build_strategy`` under torchrun)

Beside this loop: :mod:`~lmforge.train.step` (one step, the skip rule, the sync-free step and
its CUDA graph), :mod:`~lmforge.train.metrics`, :mod:`~lmforge.train.state`,
:mod:`~lmforge.train.resume` (checkpoints; a skipped step still consumes its data and advances
the schedule). Extension points: ``callbacks``, modules' ``aux_loss()`` (added to the LM loss),
:func:`~lmforge.train.build_optimizer` (parameter groups) and ``train.allow_config_change``.
Exercised by ``lmforge train --config configs/tiny.toml`` and ``pytest tests/test_train_e2e.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm import tqdm

from lmforge.model.mup import lr_multipliers
from lmforge.train import resume
from lmforge.train.data import (
    MixtureSampler,
    TokenShard,
    _to_device,
    bits_per_byte,
    bytes_per_token,
    eval_batches,
    open_source,
)
from lmforge.train.fastpath import (
    FastPath,
    FastPathRuntime,
    _auto_device,
    _group_joined,
    _triton_installed,
    resolve_fast_path,
    strategy_kind,
)
from lmforge.train.hooks import model_callbacks
from lmforge.train.loss import cross_entropy, fused_model_loss, model_loss
from lmforge.train.metrics import plot_loss_curve, read_metrics, start_run_log
from lmforge.train.objective import LMObjective, Objective
from lmforge.train.objective import forward_backward as objective_forward_backward
from lmforge.train.optim import AdamW, build_optimizer
from lmforge.train.plan import TrainingPlan, objective_plan, training_plan
from lmforge.train.schedule import lr_at
from lmforge.train.state import OutDirLock, set_rng_state
from lmforge.train.step import Pending, StepRunner
from lmforge.train.wrap import apply_activation_checkpointing, bf16_weight_copies
from lmforge.utils.errors import LmforgeError
from lmforge.utils.runtime import Runtime

if TYPE_CHECKING:
    from lmforge.config import RunConfig
    from lmforge.parallel import Strategy

Callback = Callable[[Any, int, dict[str, Any]], None]
"""``cb(trainer, step, metrics)``: runs on rank 0 after each optimizer step, before logging
(on every rank when the callable has ``all_ranks = True``); keys it adds to ``metrics`` go to
metrics.jsonl with the step's ``train`` record (written every ``train.log_every`` steps)."""


class Trainer:
    """One training run from a :class:`~lmforge.config.RunConfig` (its ``model``, ``train``,
    ``data`` and ``parallel`` branches). Construction builds the model, strategy, optimizer and
    data and restores the latest intact checkpoint; ``run()`` returns the final metrics.
    ``Trainer(cfg, runtime, model=m, objective=o)`` trains ``m`` on objective ``o`` (or a factory
    called with the built trainer); ``[model]`` and ``[data]`` are then not read. SIGINT /
    SIGTERM end a run with a checkpoint."""

    def __init__(
        self,
        cfg: RunConfig,
        runtime: Runtime | None = None,
        callbacks: Sequence[Callback] = (),
        *,
        model: nn.Module | None = None,
        objective: Objective | Callable[[Trainer], Objective] | None = None,
    ) -> None:
        self.run_config = cfg
        self.mcfg, self.tcfg, self.dcfg, self.pcfg = cfg.model, cfg.train, cfg.data, cfg.parallel
        tc = self.tcfg
        if runtime is None:
            runtime = Runtime(device=_auto_device(tc.device), seed=tc.seed)
        self.runtime = runtime
        self.device = runtime.device
        self.device_type = torch.device(self.device).type
        self.T = tc.context_length or self.mcfg.context_length
        self.callbacks: list[Callback] = list(callbacks)
        self.pretraining = objective is None
        sources: list[Any] = []
        self.val_shards: list[TokenShard] = []
        if self.pretraining:
            mc = self.mcfg
            if not self.dcfg.train:
                raise LmforgeError(
                    "data.train is empty: give token shards, e.g. --data.train='[\"shards/train.bin\"]'"
                )
            if self.T > mc.context_length:
                raise LmforgeError(
                    f"train.context_length {self.T} exceeds model.context_length {mc.context_length}"
                )
            # Data first: a missing shard or a vocabulary mismatch fails before a big model.
            sources = [open_source(src, mc.vocab_size) for src in self.dcfg.train]
            self.val_shards = [s for src in self.dcfg.val for s in open_source(src, mc.vocab_size)]
            # a shard shorter than one window gives no validation batch: refuse it by name
            short = [s for s in self.val_shards if len(s) < self.T + 1]
            if short:
                raise LmforgeError(
                    f"validation shard {short[0].path} holds {len(short[0])} tokens, fewer than one "
                    f"window of {self.T + 1}; give a longer one or drop it from data.val"
                )
        self.val_bytes_per_token = bytes_per_token(self.val_shards) if self.val_shards else None

        kind = strategy_kind(self.pcfg, runtime.world_size, _group_joined())
        if not self.pretraining and kind in ("tp", "pp", "ep"):
            raise LmforgeError(
                f"post-training objectives run on one process, DDP or FSDP, not {kind}; "
                "drop parallel.tp/pp/ep"
            )
        self._replicated_grads = kind in ("single", "ddp")  # clipping may go into the update
        fast_rt = FastPathRuntime(
            device_type=self.device_type,
            world_size=runtime.world_size,
            strategy=kind,
            triton=self.device_type == "cuda" and _triton_installed(),
        )
        if self.pretraining:
            self.fast: FastPath = resolve_fast_path(self.mcfg, tc, fast_rt)
            from lmforge.model import TransformerLM

            torch.manual_seed(tc.seed)  # same initial weights on every rank and every rerun
            model = TransformerLM(self.fast.model_config(self.mcfg), device=self.device)
        else:
            if model is None:
                raise LmforgeError("a Trainer with an objective needs its model")
            # no master weights, compile, fused loss or step graph (they assume the pretraining
            # batch); the fast AdamW and the sync-free step hold for any objective
            plain = dataclasses.replace(
                tc, master_weights="off", compile=False, loss="reference", cuda_graph=False
            )
            self.fast = resolve_fast_path(self.mcfg, plain, fast_rt)
            model = model.to(self.device)
        assert model is not None
        self.model = model
        # name -> (bf16 parameter, fp32 master) under master weights
        self.masters = bf16_weight_copies(model) if self.fast.master_weights else {}
        if tc.activation_checkpointing:
            apply_activation_checkpointing(model)
        # Modules whose aux_loss() (e.g. MoE balancing terms of the last forward) joins the loss.
        self._aux_modules = [m for m in model.modules() if callable(getattr(m, "aux_loss", None))]
        if self.pretraining:
            self.callbacks[:0] = model_callbacks(self.mcfg, model)  # e.g. MoE bias, routing
        self._ce: Callable[..., torch.Tensor] = cross_entropy
        self._fused_loss: Callable[..., torch.Tensor] = fused_model_loss
        self._model_loss: Callable[..., torch.Tensor] | None = None
        if self.fast.compile:
            model.compile()
            self._ce = torch.compile(cross_entropy)
            # forward and loss in one graph: the (B, T, V) logits and their fp32 upcast stay inside
            self._model_loss = torch.compile(model_loss)
            # likewise hidden states + fused loss (the kernels are custom ops the compiler traces)
            self._fused_loss = torch.compile(fused_model_loss)
        from lmforge.kernels import fused_linear_cross_entropy

        self.fused = fused_linear_cross_entropy if self.fast.loss == "fused" else None
        if runtime.world_size > 1 or _group_joined():
            from lmforge.parallel import build_strategy

            self.strategy: Strategy = build_strategy(model, self.pcfg, runtime)
        else:
            from lmforge.parallel import Strategy

            self.strategy = Strategy(model)
        self.is_main = self.strategy.is_main
        if getattr(model, "mtp", None) is not None and self.fused is None:
            if self.strategy.world_size > 1:  # the wrapped model's plain forward has no MTP terms
                raise LmforgeError(
                    "model.mtp_depth > 0 on several processes needs train.loss=fused "
                    "(the reference loss path calls the wrapped model's forward, without MTP)"
                )
        # master weights: AdamW updates the fp32 masters, reading and rewriting the bf16 copies
        to_master = {id(p): m for p, m in self.masters.values()}
        copies = {m: p for p, m in self.masters.values()}
        # muP's per-parameter LR scales ({} unless model.mup; an objective's model may have none)
        mup_scales = lr_multipliers(model) if hasattr(model, "config") else {}
        self.optimizer = self.strategy.make_optimizer(
            lambda ps: build_optimizer(
                [to_master.get(id(p), p) for p in ps if p.requires_grad],
                tc,
                adamw=self.fast.adamw,
                copies=copies,
                lr_scales=[mup_scales.get(id(p), 1.0) for p in ps if p.requires_grad],
            )
        )
        sync_free = self.fast.sync_free and isinstance(self.optimizer, AdamW)
        # tokens per step and windows follow the data-parallel rank (tp/pp ranks share a batch)
        dp_size = int(getattr(self.strategy, "dp_size", self.strategy.world_size))
        self.dp_rank = int(getattr(self.strategy, "dp_rank", self.strategy.rank))
        self.plan: TrainingPlan = (
            training_plan(self.mcfg, tc, dp_size)
            if self.pretraining
            else objective_plan(model, tc, dp_size)
        )
        self.sampler_sources = sources
        self.sampler: MixtureSampler | None = None
        if self.pretraining:
            self.sampler = self._new_sampler()
            self.objective: Any = LMObjective(
                self.sampler,
                tc.batch_size,
                self.device,
                lambda m, x, y: self.loss_fn(m, x, y),  # looked up per call (tests swap it)
            )
        else:
            assert objective is not None
            # A factory receives the built trainer (device, strategy, optimizer are known).
            self.objective = objective if hasattr(objective, "loss") else objective(self)
        obj = self.objective
        self.stepper = StepRunner(
            self.strategy,
            self.optimizer,
            lambda m, x, y: self.loss_fn(m, x, y),  # looked up per call (tests swap loss_fn)
            grad_clip=tc.grad_clip,
            spike_factor=tc.spike_factor,
            sync_free=sync_free,
            clip_in_update=sync_free and self.fast.clip_in_update,
            cuda_graph=sync_free and self.fast.cuda_graph,
            device=self.device,
            forward_backward=None
            if self.pretraining
            else (lambda micro: objective_forward_backward(self.strategy, micro, obj)[0]),
        )
        self.out_dir = Path(tc.out_dir)
        self.iteration = 0
        self.current_lr = 0.0
        # set by a callback (e.g. an RL target reached): the run ends after this step
        self.should_stop = False
        self.stop_signal: str | None = None  # SIGINT / SIGTERM received during run()
        self.resumed_from = resume.restore_latest(
            self.strategy,
            self.optimizer,
            self.masters,
            self.out_dir,
            cfg,
            self._apply_checkpoint,
            is_main=self.is_main,
        )

    def _apply_checkpoint(self, it: int, state: dict[str, Any], objective: dict | None) -> None:
        # What a checkpoint holds besides weights and optimizer (resume.restore_latest).
        if not self.pretraining:
            if objective is None:
                raise LmforgeError(f"checkpoint file missing: {resume.OBJECTIVE_FILE}")
            self.objective.load_state_dict(objective)
        elif str(self.dp_rank) in state.get("samplers", {}):
            self.sampler.load_state_dict(state["samplers"][str(self.dp_rank)])
        else:
            # a replica the checkpoint did not have: a fresh stream seeded by rank and step
            self.sampler = self.objective.sampler = self._new_sampler(it)
        set_rng_state(state["rng"])
        self.stepper.restore(
            state.get("loss_ema"), int(state.get("good_steps", 0)), int(state.get("bad_steps", 0))
        )
        self.iteration = it

    def _new_sampler(self, step: int = 0) -> MixtureSampler:
        # each data-parallel replica draws its own windows (its stream seeded by its rank)
        seed = self.tcfg.seed + 1_000_003 * self.dp_rank + step
        return MixtureSampler(
            self.sampler_sources, self.T, self.dcfg.weights, seed, self.mcfg.vocab_size
        )

    # -- the step's state, as the loop and tests see it

    @property
    def deferred(self) -> bool:
        """Whether steps run sync-free (read one step late); settable between steps."""
        return self.stepper.sync_free

    @deferred.setter
    def deferred(self, on: bool) -> None:
        self.stepper.sync_free = on
        self.stepper.clip_in_update = on and self._replicated_grads

    # -- the loss

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.tcfg.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=torch.bfloat16)

    def loss_fn(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss (+ the modules' aux losses) of one micro-batch x, y (B, T)."""
        with self._autocast():
            if self.fused is not None:
                loss = self._fused_loss(
                    self.model, self.fused, x, y, self.tcfg.z_loss, self.tcfg.loss_chunk_rows
                )
            elif self.strategy.world_size == 1:  # one graph when compiled; MTP terms if any
                loss = (self._model_loss or model_loss)(model, x, y, self.tcfg.z_loss)
            else:
                logits = model(x)  # (B, T, V)
                loss = self._ce(logits, y, z_loss=self.tcfg.z_loss)
        for m in self._aux_modules:
            aux = m.aux_loss()
            if aux is not None:
                loss = loss + aux.float()
        return loss

    # -- checkpoints and evaluation

    def save(self, val_loss: float | None = None) -> Path:
        """Checkpoint to ``out_dir/checkpoints/step_…`` and prune (every rank must call it)."""
        tc = self.tcfg
        schedule = {"name": tc.schedule, "lr": self.current_lr, "max_steps": tc.max_steps}
        state = resume.trainer_state(self.strategy, self.dp_rank, self.sampler, schedule,
                                     self.stepper)  # fmt: skip
        return resume.save(
            self.strategy,
            self.optimizer,
            self.masters,
            self.out_dir,
            self.iteration,
            state=state,
            objective_state=None if self.pretraining else self.objective.state_dict(),
            run_config=self.run_config,
            tokenizer_dir=self.dcfg.tokenizer or None,
            tokens=self.iteration * self.plan.tokens_per_step,
            keep_last=tc.keep_last,
            is_main=self.is_main,
            val_loss=val_loss,
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss, perplexity and bits per byte over fixed sequential windows (an
        objective's own ``evaluate(model)`` when it has one)."""
        own = getattr(self.objective, "evaluate", None)
        if own is None and not self.val_shards:
            return {}
        model = self.strategy.model
        model.eval()
        total, count = 0.0, 0
        try:
            if own is not None:
                return dict(own(model))
            tc = self.tcfg
            for x_np, y_np in eval_batches(self.val_shards, tc.batch_size, self.T, tc.eval_batches):
                x, y = _to_device(x_np, self.device), _to_device(y_np, self.device)
                loss = self.loss_fn(model, x, y)
                total += float(loss) * y.numel()
                count += y.numel()
        finally:
            model.train()
        if count == 0:
            return {}
        val = total / count
        out = {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
        if self.val_bytes_per_token:
            out["val_bpb"] = bits_per_byte(val, self.val_bytes_per_token)
        return out

    # -- the loop

    def _time_is_up(self, mine: bool) -> bool:
        # Every rank must stop at the same step, or the next collective hangs.
        if self.strategy.world_size == 1 or not torch.distributed.is_initialized():
            return mine
        flag = torch.tensor([1.0 if mine else 0.0], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def train_step(self) -> tuple[float, float, str | None]:
        """One optimizer step (or a skipped one), waited for; (loss, grad norm, skip reason)."""
        return self.finish_step(self.launch_step())

    def launch_step(self) -> Pending:
        """Launch one step without waiting for it; :meth:`finish_step` reads its result."""
        tc = self.tcfg
        self.current_lr = lr_at(
            self.iteration, tc.schedule, tc.lr, tc.min_lr, tc.warmup_steps, tc.max_steps,
            tc.decay_fraction,
        )  # fmt: skip
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr * group.get("lr_scale", 1.0)
        obj = self.objective
        before = getattr(obj, "before_step", None)
        if before is not None:
            before(self, self.iteration + 1)  # e.g. RL rollouts under the current weights
        count = getattr(obj, "micro_batches", None)
        n = int(count()) if count is not None else tc.grad_accum
        micro = [obj.next_batch() for _ in range(n)]
        pending = self.stepper.launch(micro, self.iteration + 1, self.current_lr)
        stats = getattr(obj, "metrics", None)
        pending.extra = dict(stats()) if stats is not None else {}  # this step's, read now
        self.iteration += 1
        for cb in (c for c in self.callbacks if hasattr(c, "after_launch")):  # hooks.py
            cb.after_launch(self)  # device work queued behind the step, e.g. the MoE bias update
        return pending

    def finish_step(self, pending: Pending) -> tuple[float, float, str | None]:
        """Wait for a launched step's record and update the skip statistics (in launch order)."""
        return self.stepper.finish(pending)

    def run(self) -> dict[str, Any]:
        """Train until ``max_steps`` or ``max_minutes``; final eval, checkpoint and plot."""
        lock = OutDirLock(self.out_dir) if self.is_main else None
        if lock is not None:
            lock.acquire()
        try:
            if self.resumed_from is not None and self.iteration >= self.tcfg.max_steps:
                return resume.finished_result(self.out_dir, self.iteration, self.tcfg.max_steps,
                                              self.resumed_from, self.is_main)  # fmt: skip
            with self._stop_on_signals():
                return self._run()
        finally:
            if lock is not None:
                lock.release()

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Any:
        """SIGINT / SIGTERM end the run after the step in flight, with a checkpoint (a second
        one stops at once, as Ctrl-C does). Only in the main thread, where Python delivers them."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.stop_signal is not None:  # a second signal: stop now
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            self.should_stop = True

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _run(self) -> dict[str, Any]:
        tc, plan = self.tcfg, self.plan
        loggers = None
        if self.is_main:
            if self.pretraining:
                start_line = (
                    f"lmforge train: {plan.n_params / 1e6:.2f}M params, {plan.tokens_per_step} "
                    f"tokens/step, {plan.max_steps} steps = {plan.total_tokens / 1e6:.2f}M tokens, "
                    f"{plan.flops_per_step:.3g} FLOPs/step, device {self.device}; {self.fast.summary()}"
                )
            else:
                start_line = (
                    f"lmforge train: objective {self.objective.name}, {plan.n_params / 1e6:.2f}M "
                    f"params, {plan.max_steps} steps, device {self.device}; adamw {self.fast.adamw}"
                )
            loggers = start_run_log(
                self.out_dir,
                self.run_config,
                plan,
                iteration=self.iteration,
                resumed_from=self.resumed_from,
                fast_summary=self.fast.summary(),
                start_line=start_line,
            )
        bar = tqdm(
            total=tc.max_steps,
            initial=self.iteration,
            desc="train" if self.pretraining else self.objective.name,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not (tc.progress and self.is_main),
        )
        start = time.monotonic()
        first = self.iteration  # a disabled tqdm keeps no ``initial``: count from here
        last_save = start
        last_t, last_it = start, self.iteration
        last_eval: dict[str, float] = {}
        last_loss = float("nan")
        stopped = "max_steps"

        def report(p: Pending) -> None:
            # Host side of a finished step: skip handling, callbacks and logs (reads its record).
            nonlocal last_t, last_it, last_loss
            loss_v, norm_v, reason = self.finish_step(p)
            it = p.iteration
            if reason is not None:
                if loggers:
                    loggers.log({"event": "skip", "step": it, "loss": loss_v,
                                 "grad_norm": norm_v, "reason": reason})  # fmt: skip
                if self.is_main:
                    bar.write(f"step {it}: skipped ({reason})", file=sys.stderr)
                if self.stepper.bad_steps >= tc.max_bad_steps:
                    latest = resume.latest_checkpoint(self.out_dir)
                    raise LmforgeError(
                        f"stopped at step {it} after {self.stepper.bad_steps} consecutive bad steps "
                        f"(last: {reason}); last good checkpoint: {latest or 'none'}"
                    )
            else:
                last_loss = loss_v
            metrics: dict[str, Any] = {"loss": loss_v, "lr": p.lr, "grad_norm": norm_v,
                                       "skipped": reason is not None, **p.extra}  # fmt: skip
            for cb in self.callbacks:
                if self.is_main or getattr(cb, "all_ranks", False):
                    cb(self, it, metrics)
            added = {
                k: v for k, v in metrics.items() if k not in ("loss", "lr", "grad_norm", "skipped")
            }
            if added and loggers and it % tc.log_every and it != tc.max_steps:
                loggers.log({"event": "callbacks", "step": it, **added})  # between log steps
            if it % tc.log_every == 0 or it == tc.max_steps:
                now = time.monotonic()
                tok_s = (it - last_it) * plan.tokens_per_step / max(now - last_t, 1e-9)
                mfu = tok_s * plan.flops_per_token / (tc.peak_tflops * 1e12)
                last_t, last_it = now, it
                extra = {k: v for k, v in metrics.items() if k != "skipped"}
                rec = {"event": "train", "step": it, **extra, "elapsed_s": now - start}
                if self.pretraining:  # an objective's tokens per step vary: not planned
                    rec.update(tokens=it * plan.tokens_per_step, tokens_per_s=tok_s, mfu=mfu)
                if loggers:
                    loggers.log(rec)
                if self.pretraining:
                    post = {"loss": f"{loss_v:.4f}", "tok_s": f"{tok_s:,.0f}"}
                    if self.device_type == "cuda":  # MFU against a GPU peak means nothing on CPU
                        post["mfu"] = f"{100 * mfu:.1f}%"
                    bar.set_postfix(**post)
                else:
                    bar.set_postfix(loss=f"{loss_v:.4f}")

        pending: Pending | None = None
        try:
            while self.iteration < tc.max_steps:
                launched = self.launch_step()
                it = self.iteration
                bar.update(1)
                if tc.max_minutes and it - first == 20:
                    # A time-limited run: size the bar (and its ETA) to the steps the budget allows.
                    per_step = (time.monotonic() - start) / 20
                    budget = int(60 * tc.max_minutes / max(per_step, 1e-9))
                    bar.total = min(tc.max_steps, first + budget)
                    bar.refresh()
                if pending is not None:
                    report(pending)  # the previous step, read while this one runs
                    pending = None
                eval_due = bool(tc.eval_every) and it % tc.eval_every == 0 and it < tc.max_steps
                save_due = bool(tc.save_every) and it % tc.save_every == 0 and it < tc.max_steps
                now = time.monotonic()
                # Every rank must decide alike (a save is a collective): on several processes the
                # wall-clock and stop decisions are agreed at log steps only (one all-reduce).
                agree = self.strategy.world_size == 1 or it % tc.log_every == 0
                if tc.save_every_minutes and agree and it < tc.max_steps:
                    save_due = save_due or self._time_is_up(
                        now - last_save > 60 * tc.save_every_minutes
                    )
                time_up = bool(tc.max_minutes) and self._time_is_up(
                    now - start > 60 * tc.max_minutes
                )

                # Callbacks may change the model between steps: they see each step at once,
                # unless ``deferrable`` (their device work ran at launch; hooks.py).
                late = all(getattr(cb, "deferrable", False) for cb in self.callbacks)
                late_ok = self.deferred and late and self.pretraining
                if not late_ok or eval_due or save_due or time_up or it == tc.max_steps:
                    report(launched)  # the loop looks at the model after this step: read it now
                else:
                    pending = launched
                # after this step's callbacks (which may ask to stop); a signal sets it too
                stop = agree and self._time_is_up(
                    self.should_stop or bool(getattr(self.objective, "should_stop", False))
                )
                if stop and pending is not None:
                    report(pending)
                    pending = None
                if eval_due:
                    last_eval = self.evaluate()
                    if last_eval and loggers:
                        loggers.log({"event": "eval", "step": it, **last_eval})
                if save_due and not stop:
                    self.save(last_eval.get("val_loss"))
                    last_save = time.monotonic()
                if time_up:
                    stopped = "max_minutes"
                    break
                if stop:
                    stopped = self.stop_signal or "requested"
                    if self.stop_signal and self.is_main:
                        bar.write(f"lmforge train: {self.stop_signal} at step {it}: saving a "
                                  f"checkpoint and stopping", file=sys.stderr)  # fmt: skip
                    break
            if pending is not None:
                report(pending)
            bar.close()
            # A signal asks to stop soon: the checkpoint, not a full validation pass.
            final = {} if self.stop_signal else self.evaluate()
            if final and loggers:
                loggers.log({"event": "eval", "step": self.iteration, **final})
            # Saved even if a periodic save just wrote this step: the final one records val_loss.
            ckpt = self.save(final.get("val_loss"))
            result: dict[str, Any] = {
                "iteration": self.iteration,
                "stopped": stopped,
                "train_loss": last_loss,
                **final,
                "tokens": self.iteration * plan.tokens_per_step,
                "tokens_seen": self.iteration * plan.tokens_per_step,
                "elapsed_s": time.monotonic() - start,
                "checkpoint": str(ckpt),
            }
            if loggers:
                loggers.log({"event": "final", "step": self.iteration, **result})
                if tc.plot:
                    plot_loss_curve(read_metrics(loggers.path), self.out_dir / "loss_curve.png")
            return result
        finally:
            bar.close()
            if loggers:
                loggers.close()


def train(
    cfg: RunConfig, runtime: Runtime | None = None, callbacks: Sequence[Callback] = ()
) -> dict[str, Any]:
    """Run one training job from a RunConfig; returns the final metrics (see :class:`Trainer`).
    Exercised by ``lmforge train`` and ``lmforge demo``."""
    return Trainer(cfg, runtime, callbacks).run()
