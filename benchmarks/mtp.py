"""Issue 36: multi-token prediction (DeepSeek-V3's MTP) — training and self-speculative decoding.

(a) Training. The same main model (MHA, the shape of ``benchmarks/attention_quality.py``) trains
twice through the user's command (``python -m lmforge train --config FILE …``, subprocesses),
with ``mtp_depth = 0`` and ``mtp_depth = 1`` (``mtp_weight`` the config default, 0.3), on the
same token windows for the same steps: equal main-model FLOPs (the MTP module's own forward and
backward come on top; the table gives both per token, :func:`lmforge.model.accounting.
flops_per_token`). The curves are the runs' ``metrics.jsonl`` validation losses. The trainer
adds the MTP loss only in training mode (``lmforge.train.loss._mtp_of``), so the logged
``val_loss`` is the main head's alone; the script checks it: it reloads the MTP run's final
checkpoint, computes on the same validation windows (same precision) the main head's loss and
the training objective (main + λ·MTP), and says which one the log holds (exit status 1 when it
is not the main head's). One PNG (``<out>/mtp_training.png``), one table.

(b) Self-speculative decoding. The trained MTP model, loaded as ``lmforge generate/serve
--checkpoint`` load it (:func:`lmforge.serve.loading.load_model`: bf16 on CUDA), serves
``--prompts`` validation windows of ``--prompt-len`` tokens at batch 1, greedy, ``--new`` tokens
each, through :class:`lmforge.serve.Engine` with its defaults (CUDA graphs and the compiled
decode step on CUDA) — plain, and with ``speculative=Speculative(mtp_draft_for(model), k)``
(``--speculative mtp --speculative-k K``) for each k in ``--ks``. Each engine gets its own copy
of the model (the MTP proposer hooks the model's last block). Correctness first: every
speculative output must equal the plain one token for token (exit status 1 otherwise); on CUDA
this check runs first on float32 copies (two prompts, the largest k), since in bf16 the speculative verify
forward (k + 1 rows: another graph and GEMV shape than the plain step's one row) and the plain
decode step may round a near-tie apart (the bf16 rows' "identical" column is then reported, not
required). Then,
per engine: acceptance (accepted / proposed draft tokens, the engine's ``SpecStats``), tokens
per target forward, decode ms per generated token (the first step, prefill + first token,
excluded; CUDA events on CUDA, ``perf_counter`` on the CPU; median over prompts; every prompt
runs every engine back to back in a rotated order, after one warm-up request per engine) and
the speedup over plain decode; also the time per decode-phase engine step, which says what a
speculative step (drafting + verify forward) costs against a plain one. The table is printed
last; ``<out>/mtp.json`` holds everything.

The defaults are sized for one H200 (d_model 512, 8 layers, T 1024, batch 16, 800 steps, 8 prompts
of 128 tokens, 256 new tokens, k in 1 and 4; each training run capped at 0.3 · ``--minutes``).
On an H100 the two training runs took 42 and 50 s and part (b) 166 s; the whole script ran past
one 320-second step, so run part (b) with ``--serve-only`` on the same warm machine (it reads
``<out>/mtp1``, which a fresh machine does not have). Simplification: prompts are validation-text
windows (continuation of book text), not chat requests.

    PYTHONPATH=src python benchmarks/mtp.py --data .carry/mq/shards --out runs/mtp
    PYTHONPATH=src python benchmarks/mtp.py --data runs/data/shards --device cpu --d-model 128 \
        --layers 4 --seq 128 --steps 400 --new 64 --prompt-len 64 --out runs/mtp_cpu
    PYTHONPATH=src python benchmarks/mtp.py --serve-only --out runs/mtp   # part (b) again
    PYTHONPATH=src python benchmarks/mtp.py --quick --out /tmp/mtp   # CPU smoke run
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # attention_quality's helpers

import torch

import attention_quality as aq


def _args(argv: list[str] | None) -> Any:
    p = aq._parser(__doc__)
    p.add_argument("--mtp-weight", type=float, default=None, help="λ (default: the config's)")
    p.add_argument("--prompts", type=int, default=8, help="validation windows served")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256, help="greedy tokens generated per prompt")
    p.add_argument("--ks", default="1,4", help="draft lengths k (the CLI's default is 4)")
    p.add_argument("--serve-only", action="store_true",
                   help="skip (a): serve <out>/mtp1's trained model again")  # fmt: skip
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",") if k]
    return args


# ------------------------------------------------------------------------------ (a) training


def _main_head_check(args: Any, run: Path, data: tuple) -> dict[str, float]:
    """The MTP run's logged final val_loss beside its main-head loss and its training objective,
    both recomputed from the final checkpoint on the trainer's validation windows."""
    from lmforge.checkpoint import load_for_inference
    from lmforge.model.mtp import mtp_loss
    from lmforge.train.data import eval_batches, open_source
    from lmforge.train.loss import cross_entropy

    logged = aq.final_record(run)["val_loss"]
    model, _ = load_for_inference(run, device=args.device)
    cuda = args.device.startswith("cuda")
    val = open_source(str(data[1]), data[2])
    main = both = 0.0
    count = 0
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=cuda):
        for x_np, y_np in eval_batches(val, args.batch, args.seq, args.eval_batches):
            x = torch.from_numpy(x_np).to(args.device)  # (B, T)
            y = torch.from_numpy(y_np).to(args.device)  # (B, T)
            h = model.forward_hidden(x)  # (B, T, D)
            ce = cross_entropy(model.logits_from_hidden(h), y)
            extra, _ = mtp_loss(model.mtp, h, x, y, model.token_embeddings,
                                model.logits_from_hidden, model.config.mtp_weight)  # fmt: skip
            main += float(ce) * y.numel()
            both += float(ce + extra) * y.numel()
            count += y.numel()
    main, both = main / count, both / count
    holds = "main head" if abs(logged - main) <= abs(logged - both) else "main + MTP"
    return {"logged": logged, "main_head": main, "main_plus_mtp": both, "log_holds": holds}


def train_part(args: Any, data: tuple) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from lmforge.model import ModelConfig, accounting

    base = aq.base_model(args, data[2])
    mtp = {**base, "mtp_depth": 1}
    if args.mtp_weight is not None:
        mtp["mtp_weight"] = args.mtp_weight
    train = aq.train_table(args, 0.0 if args.quick else 0.6 * args.minutes / 2)
    results = []
    for name, keys in (("mtp0", base), ("mtp1", mtp)):
        run = aq.run_train(args, name, keys, train, data)
        cfg = ModelConfig(**keys)
        fin = aq.final_record(run)
        main_cfg = ModelConfig(**{**keys, "mtp_depth": 0})
        results.append({
            "variant": name, "model": keys, "params": accounting.parameter_count(cfg),
            "main_params": accounting.parameter_count(main_cfg),
            "main_flops_per_token": accounting.flops_per_token(main_cfg, args.seq),
            "flops_per_token": accounting.flops_per_token(cfg, args.seq),
            "steps": fin.get("iteration"), "tokens": fin.get("tokens"), "curve": aq.curve(run),
            "train_loss": fin.get("train_loss"),
        })  # fmt: skip
    check = _main_head_check(args, args.out / "mtp1" / "train", data)
    return results, check


def train_table(results: list[dict[str, Any]], check: dict[str, float]) -> str:
    ref = results[0]["curve"][-1][1]
    rows = ["| run | main-head val loss | Δ vs no MTP | params (main) | GFLOP/token train"
            " (main) | tokens |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        last = r["curve"][-1][1]
        rows.append(f"| {'mtp_depth=' + r['variant'][-1]} | {last:.4f} |"
                    f" {100 * (last / ref - 1):+.2f}% | {r['params']:,} ({r['main_params']:,}) |"
                    f" {3 * r['flops_per_token'] / 1e9:.3f} ({3 * r['main_flops_per_token'] / 1e9:.3f})"
                    f" | {r['tokens'] / 1e6:.2f}M |")  # fmt: skip
    rows.append(f"\nMTP run's logged final val_loss {check['logged']:.4f}; recomputed from its"
                f" checkpoint: main head {check['main_head']:.4f}, main + λ·MTP"
                f" {check['main_plus_mtp']:.4f} -> the log holds the {check['log_holds']}'s loss")  # fmt: skip
    return "\n".join(rows)


# ------------------------------------------------------------------------------ (b) serving


class _Clock:
    """Milliseconds between two marks: CUDA events on CUDA, perf_counter on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def _serve_one(
    engine: Any, prompt: list[int], new: int, clock: _Clock
) -> tuple[list[int], float, int]:
    """Greedy ``new`` tokens after ``prompt`` at batch 1: (tokens, decode ms after the first
    step, which carries the prefill and the first token, and the decode steps it took)."""
    from lmforge.serve import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    t0 = clock.mark()
    outs = engine.step()
    t1 = clock.mark()
    before = engine.stats["steps"]  # counts the steps that ran a forward
    while engine.has_unfinished():
        outs = engine.step() or outs
    t2 = clock.mark()
    steps = engine.stats["steps"] - before
    tokens = list(outs[0].outputs[0].token_ids)
    clock.ms(t0, t1)  # waits for the first step; its time is not part of the figure
    return tokens, clock.ms(t1, t2), steps


def _engines(args: Any, ckpt: Path, ks: list[int], dtype: str = "auto") -> dict[str, Any]:
    """Plain and one speculative engine per k, each on its own copy of the model."""
    from lmforge.serve import Engine
    from lmforge.serve.loading import load_model
    from lmforge.serve.speculative import Speculative, mtp_draft_for

    out = {}
    for k in [0, *ks]:
        model = load_model(checkpoint=str(ckpt), device=args.device, dtype=dtype).model
        spec = Speculative(mtp_draft_for(model), k) if k else None
        eng = Engine(model, speculative=spec)
        name = f"mtp k={k}" if k else "plain"
        print(f"{name} ({dtype}): {eng.startup_line}", flush=True)
        out[name] = eng
    return out


def _fp32_check(args: Any, ckpt: Path, prompts: list[list[int]]) -> bool:
    """On CUDA, where the timed engines run in bf16 (whose verify forward, eager over k + 1
    rows, and graph-replayed decode step may round a near-tie differently), the exactness check
    runs first in float32: plain and every speculative engine, greedy, token for token."""
    engines = _engines(args, ckpt, [max(args.ks)], dtype="float32")  # the longest drafts
    clock = _Clock(args.device)
    ok = True
    for prompt in prompts:
        ref = _serve_one(engines["plain"], prompt, args.new, clock)[0]
        for name, eng in engines.items():
            same = _serve_one(eng, prompt, args.new, clock)[0] == ref
            ok &= same
            if not same:
                print(f"MISMATCH (float32) {name}: a greedy output differs from plain decoding")
    print(f"float32 check: speculative greedy outputs {'equal' if ok else 'DIFFER from'} plain"
          f" decoding on {len(prompts)} prompts x {args.new} tokens", flush=True)  # fmt: skip
    del engines
    torch.cuda.empty_cache()
    return ok


def serve_part(args: Any, data: tuple) -> tuple[list[dict[str, Any]], bool]:
    from lmforge.train.data import open_shard

    ckpt = args.out / "mtp1" / "train"
    val = open_shard(data[1])
    n, plen = len(val), args.prompt_len
    stride = max(plen, (n - plen) // (args.prompts + 1))
    prompts = [[int(t) for t in val.tokens[i * stride : i * stride + plen]]
               for i in range(args.prompts + 1)]  # fmt: skip
    checked = _fp32_check(args, ckpt, prompts[:2]) if args.device.startswith("cuda") else True
    engines = _engines(args, ckpt, args.ks)
    clock = _Clock(args.device)
    for eng in engines.values():  # warm-up: compile, graphs, the first allocations
        _serve_one(eng, prompts[-1], min(args.new, 16), clock)
        if eng.speculative is not None:
            eng.speculative.stats = type(eng.speculative.stats)()
    names = list(engines)
    got: dict[str, list[list[int]]] = {name: [] for name in names}
    ms: dict[str, list[float]] = {name: [] for name in names}
    steps: dict[str, list[int]] = {name: [] for name in names}
    total: dict[str, float] = {name: 0.0 for name in names}
    for i, prompt in enumerate(prompts[:-1]):
        for j in range(len(names)):  # rotated order: every engine sees the same load
            name = names[(i + j) % len(names)]
            tokens, decode_ms, n_steps = _serve_one(engines[name], prompt, args.new, clock)
            got[name].append(tokens)
            ms[name].append(decode_ms / max(1, len(tokens) - 1))
            steps[name].append(n_steps)
            total[name] += decode_ms
    ok = checked
    rows = []
    plain_ms = statistics.median(ms["plain"])
    for name in names:
        eng = engines[name]
        same = sum(a == b for a, b in zip(got[name], got["plain"]))
        if not args.device.startswith("cuda"):  # float32 here: the timed run is the check
            ok &= same == len(prompts) - 1
        st = eng.speculative.stats if eng.speculative is not None else None
        forwards = len(prompts) - 1 + sum(steps[name])  # one target forward per engine step
        # ms of one decode-phase step (plain: a decode forward; speculative: drafts + verify)
        step_ms = total[name] / max(1, sum(steps[name]))
        generated = sum(len(t) for t in got[name])
        med = statistics.median(ms[name])
        rows.append({
            "engine": name, "identical": f"{same}/{len(prompts) - 1}",
            "acceptance": st.acceptance if st else None,
            "drafted": st.drafted if st else 0, "accepted": st.accepted if st else 0,
            "tokens_per_forward": generated / forwards if forwards else None,
            "ms_per_step": step_ms, "ms_per_token": med, "ms_all": ms[name], "speedup": plain_ms / med,
            "startup": eng.startup_line,
        })  # fmt: skip
    if any(r["identical"] != f"{len(prompts) - 1}/{len(prompts) - 1}" for r in rows):
        for name in names:
            for p, (a, b) in enumerate(zip(got[name], got["plain"])):
                if a != b:
                    at = next(
                        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
                    )
                    print(f"MISMATCH {name} prompt {p}: first differing token at {at}")
    return rows, ok


def serve_table(rows: list[dict[str, Any]], args: Any) -> str:
    out = [f"batch 1, greedy, {args.prompts} prompts of {args.prompt_len} tokens, {args.new} new"
           " tokens each; decode ms/token = median over prompts (prefill step excluded);"
           " ms / decode step = decode time / decode-phase engine steps (plain: one decode"
           " forward; speculative: drafting + one verify forward)", "",
           "| engine | identical to plain | acceptance | tokens / target forward |"
           " ms / decode step | decode ms/token | speedup |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        acc = (
            "-"
            if r["acceptance"] is None
            else f"{100 * r['acceptance']:.1f}% ({r['accepted']}/{r['drafted']})"
        )
        tpf = "-" if r["tokens_per_forward"] is None else f"{r['tokens_per_forward']:.2f}"
        out.append(f"| {r['engine']} | {r['identical']} | {acc} | {tpf} |"
                   f" {r['ms_per_step']:.3f} | {r['ms_per_token']:.3f} | {r['speedup']:.2f}x |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from lmforge.utils.io import atomic_write_text

    args = _args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        aq.quick(args)
        args.prompts, args.prompt_len, args.new, args.steps = 2, 8, 8, 12
    data = aq.resolve(args)
    torch.manual_seed(0)
    report: dict[str, Any] = {"env": aq.environment(args.device)}
    old = args.out / "mtp.json"
    if args.serve_only and old.is_file():  # keep part (a)'s results of the earlier call
        report.update({k: v for k, v in json.loads(old.read_text()).items() if k != "serving"})
    text = []
    ok = True
    if not args.serve_only:
        results, check = train_part(args, data)
        png = args.out / "mtp_training.png"
        aq.figure({f"mtp_depth={r['variant'][-1]} (main head)": r["curve"] for r in results},
                  png, f"MTP: main-head validation loss at equal main-model FLOPs\n(d={args.d_model},"
                  f" L={args.layers}, T={args.seq})")  # fmt: skip
        report.update(training=results, main_head_check=check)
        ok &= check["log_holds"] == "main head"
        text += [f"figure: {png}", "", "(a) training", train_table(results, check), ""]
    rows, same = serve_part(args, data)
    ok &= same
    report["serving"] = rows
    atomic_write_text(args.out / "mtp.json", json.dumps(report, indent=1, default=str))
    text += ["(b) self-speculative decoding with the MTP module", serve_table(rows, args)]
    print(f"\n{report['env']}")
    print("\n".join(text))
    if not same:
        print("FAILED: a speculative output differs from plain greedy decoding")
    return 0 if ok else 1


if __name__ == "__main__":
    from lmforge.utils.errors import LmforgeError

    try:
        sys.exit(main())
    except LmforgeError as err:
        sys.exit(f"mtp: {err}")
