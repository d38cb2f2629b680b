"""The engine in its own process: what ``lmforge serve`` runs (the API server is the parent).

Why: in one process the engine's step loop and the HTTP event loop share one GIL, so with 64
streams every handler's JSON and SSE work stretches the engine's step (issue 33 measured a
7.7 ms time per output token against a ~3 ms step). vLLM runs its API server and engine core as
separate processes for this reason; so does this module.

Layout (one pipe each way, pickled messages, batched)::

    API process (FastAPI, uvicorn)                  engine process (spawned)
    handlers: validate, tokenize ──submit──▶ sender ══ [ops] ══▶ drain ops, Engine.step()
    output processor: detok, stops ◀─ reader ◀══ [deltas of one step + counts] ══┘

- The parent's handlers never wait on the pipe: ``submit`` / ``abort`` append to a list a
  sender thread ships as one message (a prompt bigger than the pipe's buffer cannot block the
  event loop). The child drains every message between two steps.
- After each step the child sends one message with every request's new ids and logprobs
  (:class:`~lmforge.serve.output.Delta`, packed as flat arrays by :func:`pack_step`) and its
  counters (for ``/metrics`` and the 429 check). The event loop reads it when the pipe is readable (``add_reader``: no thread
  hop) and puts each delta on its request's queue.
- Text and stop strings are the parent's (:mod:`lmforge.serve.output`); the child is ids-only.
- Images (a VLM's prompts): the parent decodes and preprocesses them (CPU work that would
  otherwise stall every running stream's step) and sends the pixels, (3, S, S) float32 per image
  (S = 64: 48 KiB, smaller than the (N, D) embeddings and independent of the LM's width); the
  child's vision tower turns them into the slots' embeddings on the engine's device.
- The child ignores SIGINT / SIGTERM: the parent drains and then sends ``stop``; if the parent
  dies, the child sees the pipe close and exits. If the child dies, every open request gets a
  500 and ``/health`` answers 500.

The child builds its own model and engine from an :class:`EngineSpec` (a CUDA model cannot be
handed across processes), then sends back the tokenizer, chat template and the facts the
server needs. :class:`EngineLoop` runs the same loop in a thread over the same pipe (tests).
Exercised by ``pytest tests/test_serve_server_process.py tests/test_serve_server.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from lmforge.serve.output import Delta, DeltaTracker, SampleDelta, engine_counts
from lmforge.serve.sampling import SamplingParams
from lmforge.serve.scheduler import check_fits
from lmforge.utils.errors import LmforgeError

__all__ = ["EngineLoop", "EngineProcess", "EngineSpec", "engine_info", "pack_step", "unpack_step"]


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """How the engine process builds its model and engine (plain data: it is pickled)."""

    load: dict[str, Any]
    "keyword arguments of :func:`lmforge.serve.loading.load_for_serving` (the model source)"
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    "keyword arguments of :class:`lmforge.serve.engine.Engine` besides the model (no tokenizer)"
    builder: Callable[[EngineSpec], tuple[Any, dict[str, Any]]] | None = None
    "builds ``(engine, info)`` in the child instead of loading a model (a module-level function:"
    " it is pickled by name); ``benchmarks/serve_api_cost.py`` plugs a fake engine in here"


class EngineProcess:
    """The parent's handle on the engine process (``submit``, ``abort``, ``metrics``, ...; what
    :class:`~lmforge.serve.server.ServerState` holds; :class:`EngineLoop` is the in-thread kind).

    :meth:`launch` spawns the process and blocks until the engine is built (it returns what the
    server needs: tokenizer, template, name, the startup line); :meth:`start` (the server's
    startup, inside the event loop) attaches the pipe to the loop; :meth:`stop` stops the child.
    """

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.error: BaseException | str | None = None
        self.requests_total = 0
        self._queues: dict[str, asyncio.Queue] = {}
        self._ops: list[tuple] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._adds_sent = 0
        self._counts: dict[str, float] = {}
        self._tokens_window: deque[tuple[float, int]] = deque()
        self._last_generated = 0
        self._proc: Any = None
        self._conn: Any = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._sender: threading.Thread | None = None
        self.info: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle
    def launch(self, timeout: float | None = None) -> dict[str, Any]:
        """Spawn the engine process and wait until its engine is built; returns its info
        (``tokenizer``, ``template``, ``name``, ``context_length``, ``vocab_size``,
        ``eos_token_id``, ``num_blocks``, ``max_queue``, ``summary``, ...). A loading error in
        the child is raised here as one :class:`LmforgeError` line."""
        ctx = mp.get_context("spawn")  # fork after torch / CUDA initialisation is unsafe
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_engine_main, args=(self.spec, child), name="lmforge-engine", daemon=True
        )
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(timeout):
            self._proc.kill()
            raise LmforgeError(f"the engine process did not start within {timeout} s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            self._proc.join(5)
            raise LmforgeError(
                f"the engine process exited while loading (exit code {self._proc.exitcode})"
            ) from None
        if kind == "error":
            self._proc.join(30)
            raise LmforgeError(payload)
        self._set_info(payload)
        return payload

    def _set_info(self, info: dict[str, Any]) -> None:
        self.info = info
        self.context_length: int = info["context_length"]
        self.vocab_size: int = info["vocab_size"]
        self.eos_token_id: int | None = info["eos_token_id"]
        self.num_blocks: int = info["num_blocks"]
        self.block_size: int = info["block_size"]
        self.max_queue: int | None = info["max_queue"]
        self.vision: dict[str, int] | None = info.get("vision")
        "a VLM's image_size, n_image_tokens and image_id (None: text only)"
        self._counts = info["counts"]

    def start(self) -> None:
        """Attach to the running event loop (the server's startup)."""
        assert self._conn is not None, "launch() first"
        self._aloop = asyncio.get_running_loop()
        fd = self._conn.fileno()
        self._aloop.add_reader(fd, self._on_readable)
        # uvloop's add_reader (libuv's uv_poll_init; uvicorn takes uvloop when it is installed)
        # makes the socket non-blocking. The sender thread's send of a message bigger than the
        # socket's buffer (an image's pixels, a long prompt) then stopped half-way on EAGAIN and
        # the child waited forever for the rest; a big step message read here could fail
        # half-way too. Both directions here move whole messages with blocking I/O (the reader
        # only once the pipe is readable): blocking again.
        os.set_blocking(fd, True)
        self._sender = threading.Thread(target=self._send_loop, name="lmforge-send", daemon=True)
        self._sender.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the child to finish what it has and exit; wait for it (kill after ``timeout``)."""
        self._detach()
        with self._cv:
            self._ops.append(("stop",))
            self._stopping = True
            self._cv.notify_all()
        if self._sender is not None:
            self._sender.join(timeout=10)
        elif self._conn is not None and self._proc is not None and self._proc.is_alive():
            self._ship([("stop",)])  # launched but never started
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._kill()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.join(5)

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before launch)."""
        return getattr(self._proc, "pid", None)

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        images: tuple | None = None,
    ) -> str:
        """Queue a request whose :class:`Delta` objects go to ``queue``. Requests that could
        never fit raise LmforgeError; a full queue (as of the child's last counts plus what was
        sent since) raises QueueFull. Never waits for the engine.

        ``images`` (a VLM's prompt, its placeholders already expanded): ``(pixels (M, 3, S, S)
        float32 numpy, spans, digests)``, preprocessed here; the child's vision tower turns
        them into the slots' embeddings (:func:`_image_prompt`)."""
        from lmforge.serve.engine import QueueFull

        if self.error is not None:
            raise LmforgeError(f"the engine failed: {self.error}")
        prompt = [int(t) for t in prompt]
        check_fits(len(prompt), params.max_tokens, self.context_length, self.block_size,
                   self.num_blocks)  # fmt: skip
        waiting = self._counts.get("waiting", 0) + self._adds_sent - self._counts.get("adds", 0)
        if self.max_queue is not None and waiting >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
        rid = f"cmpl-{uuid.uuid4().hex}"
        self._queues[rid] = queue
        self._adds_sent += 1
        self.requests_total += 1
        with self._cv:
            self._ops.append(("add", rid, prompt, params, images))
            self._cv.notify_all()
        return rid

    def abort(self, rid: str) -> None:
        """Drop a request; the child frees its blocks before its next step."""
        if self._queues.pop(rid, None) is None:
            return  # finished (or never admitted): nothing to free
        with self._cv:
            self._ops.append(("abort", rid))
            self._cv.notify_all()

    def metrics(self) -> dict[str, float]:
        """The gauges and counters of ``/metrics`` (the child's as of its last step)."""
        now = time.monotonic()
        recent = sum(n for t, n in list(self._tokens_window) if now - t <= 10.0)
        return {**self._counts, "requests_total": self.requests_total,
                "tokens_per_second": recent / 10.0}  # fmt: skip

    # ------------------------------------------------------------------ plumbing
    def _ship(self, ops: list[tuple]) -> None:
        try:
            self._conn.send(ops)
        except BlockingIOError:  # part of a message is in the pipe: the child cannot go on
            why = "the pipe to the engine process became non-blocking mid-message"
            if self._aloop is not None:
                self._aloop.call_soon_threadsafe(self._fail_all, why)
        except (BrokenPipeError, OSError, EOFError):
            pass  # the child is gone: the reader reports it

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while not self._ops:
                    self._cv.wait()
                ops, self._ops = self._ops, []
            self._ship(ops)
            if any(op[0] == "stop" for op in ops):
                return

    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                self._dispatch(conn.recv())
        except (EOFError, OSError):
            self._child_died()

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "failed":
            self.error = msg[1]
            return
        _, deltas, counts = msg
        made = counts["generated_tokens"] - self._last_generated
        self._last_generated = counts["generated_tokens"]
        if made:
            self._tokens_window.append((time.monotonic(), made))
            while len(self._tokens_window) > 4096:
                self._tokens_window.popleft()
        self._counts = counts
        queues = self._queues
        for rid, delta in unpack_step(deltas):
            queue = queues.get(rid)
            if queue is None:
                continue  # aborted meanwhile
            if delta.finished:
                del queues[rid]
            queue.put_nowait(delta)

    def _detach(self) -> None:
        if self._aloop is not None and self._conn is not None:
            try:
                self._aloop.remove_reader(self._conn.fileno())
            except (ValueError, OSError):
                pass

    def _child_died(self) -> None:
        self._detach()
        if self._stopping:
            return
        code = getattr(self._proc, "exitcode", None)
        self._fail_all(f"the engine process exited (exit code {code})")

    def _fail_all(self, why: str) -> None:
        """Every open request ends with a 500 saying ``why``; new ones are refused."""
        self.error = why
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(Delta([], True, self.error, 500))


# ---------------------------------------------------------------------- the step message
_FINISH = (None, "stop", "length")


def pack_step(items: list[tuple]) -> tuple:
    """One step's ``(rid, finished, error, status, samples)`` rows (``samples``: tuples of
    :class:`SampleDelta`'s fields) as a few flat arrays: the ids and logprobs of 64 streams
    become two ``bytes``, not 64 nested lists, so the API process's unpickling allocates a
    handful of objects instead of hundreds (and triggers no collections). Inverse:
    :func:`unpack_step`."""
    rids, reqs, rows, toks, lps = [], array("q"), array("q"), array("q"), array("d")
    errors: dict[int, str] = {}
    tops: dict[int, list] = {}
    for rid, finished, error, status, samples in items:
        if error is not None:
            errors[len(rids)] = error
        rids.append(rid)
        reqs.extend((int(finished), status, len(samples)))
        for index, ids, lp, top, reason in samples:
            if top:
                tops[len(rows) // 3] = list(top)
            rows.extend((index, len(ids), _FINISH.index(reason)))
            toks.extend(ids)
            lps.extend(lp)
    return rids, reqs.tobytes(), rows.tobytes(), toks.tobytes(), lps.tobytes(), errors, tops


def unpack_step(packed: tuple) -> list[tuple[str, Delta]]:
    """``(rid, Delta)`` per request of a :func:`pack_step` message."""
    rids, reqs_b, rows_b, toks_b, lps_b, errors, tops = packed
    reqs, rows, toks, lps = array("q"), array("q"), array("q"), array("d")
    reqs.frombytes(reqs_b)
    rows.frombytes(rows_b)
    toks.frombytes(toks_b)
    lps.frombytes(lps_b)
    reqs_l, rows_l, toks_l, lps_l = reqs.tolist(), rows.tolist(), toks.tolist(), lps.tolist()
    out = []
    row = pos = 0
    for k, rid in enumerate(rids):
        finished, status, n = reqs_l[3 * k : 3 * k + 3]
        samples = []
        for _ in range(n):
            index, m, code = rows_l[3 * row : 3 * row + 3]
            samples.append(SampleDelta(index, toks_l[pos : pos + m], lps_l[pos : pos + m],
                                       tops.get(row, []), _FINISH[code]))  # fmt: skip
            row += 1
            pos += m
        out.append((rid, Delta(samples, bool(finished), errors.get(k), status)))
    return out


# ---------------------------------------------------------------------- the child
def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 writes every Python thread's stack to stderr (``faulthandler``, so it works
    while the interpreter is stuck in C code too): how a hung server shows where it waits."""
    import faulthandler

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _engine_main(spec: EngineSpec, conn: Any) -> None:
    """The engine process: build the engine, then :func:`_serve_engine` until told to stop."""
    # The parent owns shutdown (it drains first); a Ctrl-C reaching the whole process group
    # must not kill a step half-way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dump_stacks_on_sigusr1()
    try:
        engine, info = _build(spec)
    except LmforgeError as e:
        conn.send(("error", str(e)))
        return
    except Exception as e:  # a bug while loading: one line to the parent, the trace here
        conn.send(("error", f"the engine process failed to start: {type(e).__name__}: {e}"))
        raise
    gc.freeze()  # the model and engine live as long as the process: keep them out of collections
    vision = info.pop("vision_tower", None)  # stays here, with the weights
    conn.send(("ready", {**info, "counts": _counts(engine, 0, 0.0, 0)}))
    _serve_engine(engine, conn, vision)


def _image_prompt(vision: Any, prompt: list[int], images: tuple) -> Any:
    """The engine's ``image_embeds`` of a submitted prompt: ``images`` = (pixels, spans,
    digests) through ``vision`` (the VLM's tower, on the engine's device), one forward."""
    from lmforge.vision.serving import ImagePrompt

    if vision is None:
        raise LmforgeError("this model has no vision tower: it cannot take images")
    pixels, spans, digests = images
    rows = vision.embed_rows(list(pixels), list(digests))  # an image seen lately: cached rows
    return ImagePrompt(prompt, rows, list(spans), list(digests))


SLOW_STEP_S = 60.0
"seconds an engine step may run before :class:`StepWatch` prints where it is"


class StepWatch:
    """A daemon thread that prints, once per step, the stack of an engine step running past
    ``limit`` seconds (to stderr, from Python's own frames: safe while Dynamo compiles, where a
    ``faulthandler`` dump can crash): a first compile of a new shape takes minutes on a 22-layer
    model, a hung kernel never ends, and the log says which. ``with watch.step():`` brackets a
    step; the thread reads only its start time."""

    def __init__(self, limit: float = SLOW_STEP_S, poll: float = 5.0) -> None:
        self.limit, self.poll = limit, poll
        self._started: float | None = None
        self._warned: float | None = None
        self._thread_id = threading.get_ident()  # the engine loop's thread
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="lmforge-step-watch", daemon=True).start()

    def close(self) -> None:
        """End the thread (at its next poll)."""
        self._closed.set()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Watch the body as one step; say when a step that was reported ends."""
        started = self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None
            if self._warned == started:
                took = time.monotonic() - started
                print(f"lmforge serve: that engine step ended after {took:.0f} s",
                      file=sys.stderr, flush=True)  # fmt: skip

    def _watch(self) -> None:
        while not self._closed.wait(self.poll):
            started = self._started
            if started is None or started == self._warned:
                continue
            running = time.monotonic() - started
            if running < self.limit:
                continue
            self._warned = started
            frame = sys._current_frames().get(self._thread_id)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
            print(f"lmforge serve: an engine step has run for {running:.0f} s (a first compile "
                  f"of a new shape can take minutes); where it is:\n{stack}", file=sys.stderr,
                  end="", flush=True)  # fmt: skip


def _serve_engine(engine: Any, conn: Any, vision: Any = None) -> None:
    """The engine side's loop (a process's, or :class:`EngineLoop`'s thread): drain the
    parent's ops, step, send the step's deltas and counters; until ``stop`` or the pipe closes.
    ``vision``: a VLM's tower, which turns submitted images into embeddings here; a step (or a
    tower forward) past :data:`SLOW_STEP_S` prints its stack (:class:`StepWatch`)."""
    watch = StepWatch()
    try:
        _serve_loop(engine, conn, vision, watch)
    finally:
        watch.close()


def _serve_loop(engine: Any, conn: Any, vision: Any, watch: StepWatch) -> None:
    from lmforge.serve.engine import QueueFull

    adds = 0
    trackers: dict[str, DeltaTracker] = {}
    step_seconds, step_count = 0.0, 0
    failed: str | None = None
    while True:
        out: list[tuple] = []
        try:
            if not engine.has_unfinished() and not conn.poll(0.5):
                continue
            while conn.poll(0):  # everything the parent sent since the last step
                for op in conn.recv():
                    if op[0] == "add":
                        _, rid, prompt, params, images = op
                        adds += 1
                        if failed is not None:
                            out.append((rid, True, failed, 500, []))
                            continue
                        try:
                            # (a text request's call is unchanged: EngineSpec builders' fakes)
                            kw = {}
                            if images is not None:  # the tower's forward: watched as a step
                                with watch.step():
                                    kw["image_embeds"] = _image_prompt(vision, prompt, images)
                            engine.add_request(prompt, params, request_id=rid, **kw)
                        except LmforgeError as e:
                            status = 429 if isinstance(e, QueueFull) else 400
                            out.append((rid, True, str(e), status, []))
                            continue
                        trackers[rid] = DeltaTracker(params.n)
                    elif op[0] == "abort":
                        if trackers.pop(op[1], None) is not None:
                            engine.abort(op[1])
                    else:  # the parent has drained: whatever is left was given up on
                        for rid in trackers:
                            engine.abort(rid)
                        return
        except (EOFError, OSError):
            return  # the parent is gone
        if engine.has_unfinished() and failed is None:
            try:
                t0 = time.perf_counter()
                with watch.step():
                    outs = engine.step()
                step_seconds += time.perf_counter() - t0
                step_count += 1
            except Exception as e:  # a bug, not a user error: fail every request loudly
                failed = f"engine failed: {type(e).__name__}: {e}"
                for rid in trackers:
                    engine.abort(rid)
                    out.append((rid, True, failed, 500, []))
                trackers.clear()
                try:
                    conn.send(("failed", failed))
                except (BrokenPipeError, OSError):
                    return
                outs = []
            for ro in outs:
                tracker = trackers.get(ro.request_id)
                if tracker is None:
                    continue
                if ro.finished:
                    del trackers[ro.request_id]
                d = tracker.delta(ro)
                samples = [(s.index, s.token_ids, s.logprobs, s.top_logprobs, s.finish_reason)
                           for s in d.samples]  # fmt: skip
                out.append((ro.request_id, d.finished, None, 200, samples))
        try:
            conn.send(("out", pack_step(out), _counts(engine, adds, step_seconds, step_count)))
        except (BrokenPipeError, OSError):
            return


def _build(spec: EngineSpec) -> tuple[Any, dict[str, Any]]:
    if spec.builder is not None:
        return spec.builder(spec)
    import torch

    from lmforge.serve.engine import Engine
    from lmforge.serve.loading import load_model

    loaded = load_model(**spec.load)
    model, tokenizer, template, name = loaded.model, loaded.tokenizer, loaded.template, loaded.name
    if next(model.parameters()).device.type == "cpu":
        # Leave a core to the API process: intra-op threads spin-wait between parallel regions,
        # and on an oversubscribed CPU a step then waits for a descheduled thread (measured on
        # 2 cores: ~25-48 ms per tiny-model step with 2 threads against ~2-4 ms with 1).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (cores or 1) - 1)))
    kw = dict(spec.engine)
    kw.setdefault("eos_token_id", getattr(tokenizer, "eot_id", None))
    flag, k = kw.pop("speculative", None), kw.pop("speculative_k", 4)
    if isinstance(flag, str):  # a --speculative value: the proposer needs the loaded model
        from lmforge.serve.speculative import speculative_from_flag

        flag = speculative_from_flag(model, flag, k)
    engine = Engine(model, speculative=flag, **kw)
    info = {
        **engine_info(engine),
        "tokenizer": tokenizer,
        "template": template,
        "name": name,
        "num_parameters": model.num_parameters(),
        "summary": engine_summary(engine),
        "kv_budget": getattr(engine, "kv_budget", None),
        "vision": _vision_info(loaded.vision),
        "vision_tower": loaded.vision,  # kept by the child (_engine_main), never sent
    }
    return engine, info


def _vision_info(vision: Any) -> dict[str, int] | None:
    """What the API side needs of a VLM's tower to prepare images (None: no tower)."""
    if vision is None:
        return None
    return {"image_size": vision.image_size, "n_image_tokens": vision.n_image_tokens,
            "image_id": vision.image_id}  # fmt: skip


def engine_info(engine: Any) -> dict[str, Any]:
    """What the API side needs to know of an engine (for its request checks)."""
    return {
        "context_length": engine.config.context_length,
        "vocab_size": engine.config.vocab_size,
        "eos_token_id": engine.eos_token_id,
        "num_blocks": engine.allocator.num_blocks,
        "block_size": engine.block_size,
        "max_queue": engine.max_queue,
    }


def _counts(engine: Any, adds: int, step_seconds: float, step_count: int) -> dict[str, float]:
    """The counters the child sends with every step (``/metrics``, the parent's 429 check)."""
    return {**engine_counts(engine), "adds": adds, "step_seconds": step_seconds,
            "step_count": step_count}  # fmt: skip


class EngineLoop(EngineProcess):
    """The engine in a thread of the server's process, behind the same pipe and loop as the
    engine process (:func:`_serve_engine`): tests, which reach into ``engine``, and the
    in-process peer ``benchmarks/serve.py`` measures. Requests are checked against the engine
    itself before they are queued (an invalid one is a 400 before any stream starts)."""

    def __init__(self, engine: Any, vision: Any = None) -> None:
        super().__init__(EngineSpec({}))
        self.engine = engine
        self._set_info({**engine_info(engine), "counts": _counts(engine, 0, 0.0, 0),
                        "vision": _vision_info(vision)})  # fmt: skip
        self._conn, self._child = mp.Pipe(duplex=True)
        self._proc = threading.Thread(target=_serve_engine, args=(engine, self._child, vision),
                                      name="lmforge-engine", daemon=True)  # fmt: skip

    def start(self) -> None:
        self._proc.start()
        super().start()

    def stop(self, timeout: float = 60.0) -> None:
        if self._proc.is_alive():  # else never started (or stopped already)
            super().stop(timeout)

    def _kill(self) -> None:
        pass  # a thread cannot be killed; it is a daemon and ends with the pipe

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        images: tuple | None = None,
    ) -> str:
        return super().submit(self.engine.check_request(prompt, params), params, queue, images)


def engine_summary(engine: Any) -> str:
    """One line saying what the engine chose: device, CUDA graphs, compiled step, KV cache
    (the engine's own ``startup_line``) and the KV dtype."""
    dtype = str(engine.runner.kv_dtype).removeprefix("torch.")
    if dtype in ("float8_e4m3fn", "int8"):  # quantized pages
        dtype = ("fp8 e4m3" if dtype != "int8" else dtype) + " + a float32 scale per token/head"
    return f"{engine.startup_line}, KV dtype {dtype}"
