"""What the API process costs per output token: ``lmforge serve``'s real server over a FAKE engine.

Issue 33: 64 streaming clients got a TPOT p50 of 7.89 ms on an H200 against a 2.94 ms engine
step, so something besides the engine sets the pace. This script takes the engine out of the
question: the engine process runs the real child loop (:mod:`lmforge.serve.engine_process`)
around a fake engine that samples one token per running request per step (no model; a step
takes ``--step-ms``, 0 = as fast as Python goes), and the parent is the real FastAPI / uvicorn
app with its output processor and SSE streaming. Real streaming clients (raw httpx SSE, or the
official openai client with ``--client openai``) drive it from this process.

Reported per round: output tok/s, TPOT p50 (ms), and CPU µs per output token of the API
process, of the engine process and of the clients (from /proc: user + system time over the
load). ``--profile DIR`` also writes the API process's cProfile (``api.prof`` and the top
functions as text). Rounds are interleaved with ``--baseline-src DIR`` (another checkout's
``src``) when given; the table shows medians.

Run (CPU, no model, < 2 minutes)::

    PYTHONPATH=src python benchmarks/serve_api_cost.py                     # 64 streams x 128
    PYTHONPATH=src python benchmarks/serve_api_cost.py --step-ms 3         # a ~3 ms engine step
    PYTHONPATH=src python benchmarks/serve_api_cost.py --profile /tmp/api  # + cProfile
    PYTHONPATH=src python benchmarks/serve_api_cost.py --client openai --client-procs 4
    PYTHONPATH=src python benchmarks/serve_api_cost.py --baseline-src /tmp/old/src --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_CLK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- the fake engine
class _Out:
    __slots__ = ("finish_reason", "index", "logprobs", "policy_versions", "token_ids",
                 "top_logprobs")  # fmt: skip

    def __init__(self) -> None:
        self.index = 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs = None
        self.policy_versions: list[int] = []
        self.finish_reason: str | None = None


class _Req:
    __slots__ = ("finished", "max_tokens", "outputs", "prompt_token_ids", "request_id")

    def __init__(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.request_id = rid
        self.prompt_token_ids = prompt
        self.outputs = [_Out()]
        self.max_tokens = max_tokens
        self.finished = False


class _Allocator:
    num_used = 0
    num_blocks = 1 << 20
    hits = 0


class FakeEngine:
    """The engine's surface the child loop uses; ``step`` samples one id per request: the
    letters ``a``..``z`` and a space every fifth token (one character per token, so the text
    side does its ordinary work)."""

    def __init__(self, step_ms: float) -> None:
        self.step_s = step_ms / 1e3
        self.running: list[_Req] = []
        self.waiting: list[_Req] = []
        self.allocator = _Allocator()
        self.stats = {"generated_tokens": 0, "preemptions": 0}

    def add_request(self, prompt: list[int], params: Any, request_id: str) -> None:
        self.running.append(_Req(request_id, list(prompt), params.max_tokens))

    def abort(self, rid: str) -> None:
        self.running = [r for r in self.running if r.request_id != rid]

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[_Req]:
        t_end = time.perf_counter() + self.step_s
        for r in self.running:
            o = r.outputs[0]
            k = len(o.token_ids)
            o.token_ids.append(32 if k % 5 == 4 else 97 + k % 26)
            o.logprobs.append(-0.5)
            o.policy_versions.append(0)
            if k + 1 >= r.max_tokens:
                o.finish_reason = "length"
                r.finished = True
        self.stats["generated_tokens"] += len(self.running)
        outs = list(self.running)
        self.running = [r for r in self.running if not r.finished]
        left = t_end - time.perf_counter()
        if left > 0:  # the GPU's step time; a sleep leaves the shared CPU to the other processes
            time.sleep(left)
        return outs


def build_fake(spec: Any) -> tuple[FakeEngine, dict[str, Any]]:
    """The :class:`EngineSpec` builder of the fake engine (runs in the engine process)."""
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    eng = FakeEngine(float(spec.engine.get("step_ms", 0.0)))
    info = {"tokenizer": tok, "template": None, "name": "fake", "context_length": 4096,
            "vocab_size": 257, "eos_token_id": 256, "num_blocks": 1 << 20, "block_size": 16,
            "max_queue": None, "num_parameters": 0, "summary": "fake engine",
            "kv_budget": None}  # fmt: skip
    return eng, info


# ---------------------------------------------------------------------- the server process
def _serve(src: str, port: int, step_ms: float, profile: str | None) -> None:
    sys.path.insert(0, src)
    import cProfile
    import pstats

    from lmforge.serve.engine_process import EngineProcess, EngineSpec
    from lmforge.serve.server import ServerState, make_server

    mod = _this_module()
    ep = EngineProcess(EngineSpec(load={}, engine={"step_ms": step_ms}, builder=mod.build_fake))
    info = ep.launch(timeout=120)
    state = ServerState(ep, info["tokenizer"], "fake", None)
    server = make_server(state, host="127.0.0.1", port=port, drain_timeout=5)
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if prof is not None:
            prof.disable()
            Path(profile).mkdir(parents=True, exist_ok=True)
            prof.dump_stats(f"{profile}/api.prof")
            with open(f"{profile}/api_top.txt", "w") as f:
                st = pstats.Stats(prof, stream=f).sort_stats("tottime")
                st.print_stats(45)
                st.sort_stats("cumulative").print_stats(45)


def _this_module() -> Any:
    """This file as an importable module (the engine process unpickles ``build_fake`` by
    name: ``serve_api_cost.build_fake`` with ``benchmarks/`` on the path)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    import serve_api_cost

    return serve_api_cost


# ---------------------------------------------------------------------- clients
def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK  # utime, stime


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


async def _stream_httpx(
    client: Any, url: str, prompt: list[int], new: int
) -> tuple[float, int, int]:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first = last = None
    n = chunks = 0
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("choices"):
                chunks += 1
                last = time.perf_counter()
                first = first or last
            if ch.get("usage"):
                n = ch["usage"]["completion_tokens"]
    return ((last - first) / (n - 1) if first and n > 1 else -1.0), n, chunks


async def _stream_openai(client: Any, prompt: list[int], new: int) -> tuple[float, int, int]:
    first = last = None
    n = chunks = 0
    stream = await client.completions.create(model="fake", prompt=prompt, max_tokens=new,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})  # fmt: skip
    async for ch in stream:
        if ch.choices:
            chunks += 1
            last = time.perf_counter()
            first = first or last
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    return ((last - first) / (n - 1) if first and n > 1 else -1.0), n, chunks


def _load(
    port: int, streams: int, new: int, kind: str, procs: int = 1
) -> tuple[list, float, float]:
    """Run ``streams`` streams at once (over ``procs`` client processes); (results, wall s,
    the clients' CPU s during the load)."""
    prompts = [[65 + (i + j) % 26 for j in range(16)] for i in range(streams)]
    if procs <= 1:
        c0 = os.times()
        res, wall = _load_part(port, prompts, new, kind)
        c1 = os.times()
        return res, wall, (c1.user - c0.user) + (c1.system - c0.system)
    ctx = mp.get_context("spawn")
    parts = [prompts[i::procs] for i in range(procs)]
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_client_proc, args=(port, p, new, kind, barrier, out)) for p in parts]
    for pr in ps:
        pr.start()
    got = [out.get(timeout=600) for _ in ps]
    for pr in ps:
        pr.join(60)
    res = [r if not isinstance(r, str) else RuntimeError(r) for g in got for r in g[0]]
    return res, max(g[2] for g in got) - min(g[1] for g in got), sum(g[3] for g in got)


def _client_proc(port: int, prompts: list, new: int, kind: str, barrier: Any, out: Any) -> None:
    _load_part(port, prompts[:1], 2, kind)  # warm-up: the client's first call is not measured
    barrier.wait()
    t0, c0 = time.time(), os.times()
    res, wall = _load_part(port, prompts, new, kind)
    c1 = os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    out.put(([r if not isinstance(r, BaseException) else repr(r) for r in res], t0, t0 + wall, cpu))


def _load_part(port: int, prompts: list[list[int]], new: int, kind: str) -> tuple[list, float]:
    import httpx

    async def run() -> tuple[list, float]:
        if kind == "openai":
            import openai

            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                                        max_retries=0, timeout=600)  # fmt: skip
            coros = [_stream_openai(client, p, new) for p in prompts]
        else:
            limits = httpx.Limits(max_connections=len(prompts) + 8)
            client = httpx.AsyncClient(timeout=600, limits=limits)
            url = f"http://127.0.0.1:{port}/v1/completions"
            coros = [_stream_httpx(client, url, p, new) for p in prompts]
        try:
            t0 = time.perf_counter()
            res = await asyncio.gather(*coros, return_exceptions=True)
            return res, time.perf_counter() - t0
        finally:
            await client.aclose() if kind != "openai" else await client.close()

    return asyncio.run(run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(port: int, proc: Any, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise SystemExit(f"the server process exited (code {proc.exitcode})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not come up")


def run_round(src: str, args: argparse.Namespace, profile: str | None) -> dict[str, float]:
    """One server (this ``src``), one warm-up, one measured load; its figures."""
    port = _free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_serve, args=(src, port, args.step_ms, profile))
    proc.start()
    try:
        _wait_health(port, proc)
        _load(port, 4, 16, args.client)  # warm-up: imports, first-request paths
        kids = _children(proc.pid)
        api0 = _cpu_s(proc.pid)
        eng0 = sum(_cpu_s(k) for k in kids)
        res, wall, client_cpu = _load(port, args.streams, args.tokens, args.client,
                                      args.client_procs)  # fmt: skip
        api1 = _cpu_s(proc.pid)
        eng1 = sum(_cpu_s(k) for k in kids)
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    ok = [r for r in res if not isinstance(r, BaseException) and r[1] == args.tokens]
    tokens = sum(r[1] for r in ok)
    tpots = sorted(r[0] * 1e3 for r in ok) or [float("nan")]
    errs = [r for r in res if isinstance(r, BaseException)]
    if errs:
        print(f"  {len(errs)} errors, e.g. {errs[0]!r}", file=sys.stderr)
    per = 1e6 / max(tokens, 1)
    chunks = sum(r[2] for r in ok)
    return {"tok_s": tokens / wall, "tpot50": tpots[len(tpots) // 2],
            "tok_per_chunk": tokens / max(chunks, 1), "api_us_chunk": (api1 - api0) * 1e6 / max(chunks, 1),
            "api_us": (api1 - api0) * per, "engine_us": (eng1 - eng0) * per,
            "client_us": client_cpu * per, "errors": len(res) - len(ok)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("Run (CPU")[1])  # fmt: skip
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each stream")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="the fake engine's step time (0: as fast as it goes)")  # fmt: skip
    ap.add_argument("--client", choices=("httpx", "openai"), default="httpx")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="spread the streams over this many client processes")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="another checkout's src, run interleaved with this one")  # fmt: skip
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="write the API process's cProfile of one extra round here")  # fmt: skip
    args = ap.parse_args()
    mine = str(Path(__file__).resolve().parents[1] / "src")
    srcs = {"this tree": mine}
    if args.baseline_src:
        srcs["baseline"] = str(Path(args.baseline_src).resolve())
    rows: dict[str, list[dict]] = {k: [] for k in srcs}
    for r in range(args.rounds):
        for name, src in srcs.items():
            fig = run_round(src, args, None)
            rows[name].append(fig)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in fig.items()),
                  file=sys.stderr)  # fmt: skip
    if args.profile:
        run_round(mine, args, args.profile)
        print(f"cProfile of the API process: {args.profile}/api_top.txt", file=sys.stderr)
    print(f"\n# serve API cost: {args.streams} streams x {args.tokens} tokens, fake engine step "
          f"{args.step_ms} ms, {args.client} clients in {args.client_procs} process(es), "
          f"{os.cpu_count()} CPUs, medians of "
          f"{args.rounds} rounds\n")  # fmt: skip
    print(
        "| src | output tok/s | TPOT p50 ms | API µs/token | engine proc µs/token "
        "| client µs/token | tokens/chunk | API µs/chunk | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, figs in rows.items():
        med = {k: statistics.median(f[k] for f in figs) for k in figs[0]}
        print(
            f"| {name} | {med['tok_s']:.0f} | {med['tpot50']:.2f} | {med['api_us']:.1f} | "
            f"{med['engine_us']:.1f} | {med['client_us']:.1f} | {med['tok_per_chunk']:.2f} | "
            f"{med['api_us_chunk']:.1f} | {int(med['errors'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
