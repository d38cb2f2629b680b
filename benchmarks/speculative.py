"""Benchmark 4 of issue 22: speculative decoding at batch 1 with real weights.

Target: SmolLM2-135M-Instruct (the Q4_1 GGUF in ``../shared/models``, dequantized to float32 by
``lmforge.hf.gguf.import_gguf``). Prompts, in the model's chat template:

- ``gsm8k``: the first GSM8K test questions (free-form reasoning: little to copy);
- ``grounded``: "repeat this passage word for word" and "correct the spelling in this passage"
  over Gutenberg book text, alternating (the answer copies the input: prompt lookup's case).

Drafts: prompt-lookup n-gram (``NgramDraft``) and a self-speculative draft, the target's first
``--draft-layers`` of its 30 blocks + final norm + tied head (``truncated_draft``: no other
weights). For each prompt set, temperature (greedy and 0.7) and k in {2, 4, 6}: acceptance
(accepted / proposed), tokens per target forward, draft forwards per token, decode ms/token
(prompt prefill excluded; it is the same for every row, plus the draft's own prefill) and the
speedup over plain decoding of the same target on the same runner (``SpeculativeDecoder(target,
None)``: one target forward per token), measured in the same run, interleaved: every prompt runs
every configuration back to back, in an order rotated per prompt, so all rows see the same load.

Correctness first: plain decoding on the runner equals ``Engine.generate`` greedy, and every
greedy speculative output is token-identical to plain greedy decoding (printed; exit status 1
when not). A forward-cost table explains the speedups: on the CPU a (k+1)-token verify forward
costs little more than a 1-token one only while the forward is weight-read-bound.

    PYTHONPATH=src python benchmarks/speculative.py --device cpu --threads 1  # ~20 min, 2 busy cores
    PYTHONPATH=src python benchmarks/speculative.py --device cpu --quick      # ~3 min
    PYTHONPATH=src python benchmarks/speculative.py --device cuda           # unchanged on a GPU
    PYTHONPATH=src python benchmarks/speculative.py --tiny --quick          # tiny random model (a test)
    PYTHONPATH=src python benchmarks/speculative.py --device cpu --threads 1 --ks 2 --temperatures 0 \
        --distill-steps 60      # bonus: also a distilled copy of the truncated draft (~7 min more)

With one CPU thread the tables add decode ms/token in the process's CPU time, the steadier figure
on a machine other jobs load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # runs without install

import torch  # noqa: E402

from lmforge.serve import Engine, SamplingParams  # noqa: E402
from lmforge.serve.engine import CompletionOutput  # noqa: E402
from lmforge.serve.speculative import (  # noqa: E402
    DraftModel,
    NgramDraft,
    Speculative,
    truncated_draft,
)
from lmforge.serve.speculative import SpecStats as _EngineSpecStats  # noqa: E402
from lmforge.utils.errors import LmforgeError  # noqa: E402

SHARED = [REPO.parent / "shared", Path("/work/shared")]
GGUF_NAME = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
BOOKS = [
    "Austen_Pride_and_Prejudice.txt",
    "Austen_Emma.txt",
    "Bront_Jane_Eyre_An_Autobiography.txt",
    "Austen_Persuasion.txt",
    "Austen_Mansfield_Park.txt",
    "Austen_Sense_and_Sensibility.txt",
]


def _shared(rel: str) -> Path | None:
    return next((root / rel for root in SHARED if (root / rel).exists()), None)


def _line(s: str = "") -> None:
    print(s, flush=True)


def _loadavg() -> str:
    f = Path("/proc/loadavg")
    return " ".join(f.read_text().split()[:3]) if f.exists() else "n/a"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- prompts
def _passage(path: Path, words: int, rng: random.Random) -> str:
    """A paragraph of about ``words`` words from the body of a Gutenberg book."""
    text = path.read_text(encoding="utf-8", errors="replace")
    body = text[len(text) // 5 : len(text) * 4 // 5]  # skip the licence header and footer
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body)]
    good = [p for p in paras if words * 0.6 <= len(p.split()) <= words * 1.5 and '"' not in p]
    return rng.choice(good or [" ".join(body.split()[:words])])


def _typos(text: str, rng: random.Random) -> str:
    """Swap two inner letters in about every third long word (a passage to correct)."""
    out = []
    for w in text.split():
        if len(w) > 5 and w.isalpha() and rng.random() < 0.3:
            i = rng.randrange(1, len(w) - 2)
            w = w[:i] + w[i + 1] + w[i] + w[i + 2 :]
        out.append(w)
    return " ".join(out)


def real_prompts(tok: Any, template: str | None, n: int) -> dict[str, list[list[int]]]:
    """``{"gsm8k": [...], "grounded": [...]}``: n chat prompts each, as token ids."""
    from lmforge.serve.templates import render_chat

    gsm = _shared("data/eval/gsm8k/test.jsonl")
    books = _shared("data/text/gutenberg")
    if gsm is None or books is None:
        raise SystemExit("needs ../shared/data (GSM8K test set and Gutenberg text)")
    with gsm.open(encoding="utf-8") as f:
        questions = [json.loads(next(f))["question"] for _ in range(n)]
    rng = random.Random(0)
    grounded = []
    for i in range(n):
        passage = _passage(books / BOOKS[i % len(BOOKS)], 90, rng)
        if i % 2 == 0:
            grounded.append(f"Repeat the following passage word for word.\n\n{passage}")
        else:
            grounded.append(
                "Correct the spelling mistakes in the following passage and write it out in "
                f"full.\n\n{_typos(passage, rng)}"
            )

    def chat(q: str) -> list[int]:
        return tok.encode(render_chat(template, [{"role": "user", "content": q}]))

    return {"gsm8k": [chat(q) for q in questions], "grounded": [chat(q) for q in grounded]}


def tiny_prompts(vocab: int, n: int) -> dict[str, list[list[int]]]:
    """Random ids, and a repeated phrase (n-gram lookup's case), for the tiny random model."""
    g = torch.Generator().manual_seed(0)
    rand = [torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(n)]
    rep = [(torch.randint(0, vocab, (6,), generator=g).tolist() * 4) for _ in range(n)]
    return {"random": rand, "repetitive": rep}


def distill_prompts(tok: Any, template: str | None, n: int) -> list[list[int]]:
    """Prompts for distilling a draft, disjoint from the benchmark's: GSM8K *train* questions and
    "repeat" / "correct" requests over passages of other books."""
    from lmforge.serve.templates import render_chat

    gsm, books = _shared("data/eval/gsm8k/train.jsonl"), _shared("data/text/gutenberg")
    if gsm is None or books is None:
        raise SystemExit("needs ../shared/data (GSM8K train set and Gutenberg text)")
    with gsm.open(encoding="utf-8") as f:
        texts = [json.loads(next(f))["question"] for _ in range(n - n // 2)]
    rng = random.Random(1)
    for i in range(n // 2):
        passage = _passage(books / BOOKS[3 + i % (len(BOOKS) - 3)], 90, rng)
        texts.append(f"Repeat the following passage word for word.\n\n{passage}" if i % 2 else
                     f"Correct the spelling mistakes in the following passage and write it out "
                     f"in full.\n\n{_typos(passage, rng)}")  # fmt: skip
    return [tok.encode(render_chat(template, [{"role": "user", "content": t}])) for t in texts]


def distill_draft(
    target: Any, n_layers: int, prompts: list[list[int]], steps: int, eos: int | None,
    max_tokens: int,
) -> Any:  # fmt: skip
    """A ``truncated_draft`` copy trained for ``steps`` AdamW steps on forward KL to the target,
    over the target's own greedy answers to ``prompts`` (sequence-level distillation data)."""
    import dataclasses
    import tempfile

    from lmforge.config import RunConfig
    from lmforge.posttrain.config import DistillConfig
    from lmforge.posttrain.core import prompt_response_example
    from lmforge.posttrain.distill import DistillObjective
    from lmforge.train import Trainer
    from lmforge.train.metrics import read_metrics
    from lmforge.utils.runtime import Runtime

    student = truncated_draft(target, n_layers, share=False)
    outs = Engine(target, eos_token_id=eos).generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    corpus = [prompt_response_example(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    dc = DistillConfig(loss="forward")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dev = str(next(target.parameters()).device)
        tc = dataclasses.replace(RunConfig().train, lr=1e-4, max_steps=steps, batch_size=4,
                                 out_dir=tmp, device=dev, log_every=1)  # fmt: skip
        cfg = dataclasses.replace(RunConfig(), model=student.config, train=tc, distill=dc)
        objective = DistillObjective(target, dc, 4, corpus=corpus)
        Trainer(cfg, Runtime.from_env(device=dev), model=student, objective=objective).run()
        hist = [r for r in read_metrics(Path(tmp) / "metrics.jsonl") if r.get("event") == "train"]
    first = statistics.mean(h["loss"] for h in hist[: max(1, len(hist) // 10)])
    last = statistics.mean(h["loss"] for h in hist[-max(1, len(hist) // 10) :])
    _line(f"distilled a {n_layers}-layer draft through the Trainer: {steps} steps x 4 sequences "
          f"over {len(corpus)} target answers, forward KL {first:.3f} -> {last:.3f} "
          f"(first/last tenth), {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return student.eval()


# ---------------------------------------------------------------- models
def load_target(args: argparse.Namespace) -> tuple[Any, Any, str | None, int | None, str]:
    """``(model, tokenizer, chat template, eos id, description)``."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        from lmforge.model import ModelConfig, TransformerLM

        torch.manual_seed(0)
        cfg = ModelConfig(
            vocab_size=97, context_length=256, d_model=32, n_layers=2, n_heads=4,
            n_kv_heads=2, tie_embeddings=True,
        )  # fmt: skip
        model = TransformerLM(cfg).to(device=device, dtype=dtype).eval()
        return model, None, None, None, "tiny random model (d 32, 2 layers, vocab 97)"
    from lmforge.hf.gguf import import_gguf

    path = Path(args.gguf) if args.gguf else _shared(GGUF_NAME)
    if path is None or not path.is_file():
        raise SystemExit(f"no GGUF file: {args.gguf or '../shared/' + GGUF_NAME}")
    model, tok, template = import_gguf(path, context_length=2048)
    model = model.to(device=device, dtype=dtype).eval()
    cfg = model.config
    what = (
        f"{path.name} (d {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.kv_heads} "
        f"heads, vocab {cfg.vocab_size}, {args.dtype})"
    )
    return model, tok, template, tok.eot_id, what


@torch.inference_mode()
def forward_costs(
    models: dict[str, Any],
    device: torch.device,
    ctx: int,
    ns: list[int],
    reps: int,
    clock: Any = time.perf_counter,
) -> dict[str, dict[int, float]]:
    """ms of one forward of n tokens after ``ctx`` cached ones (median of ``reps``, the models
    interleaved): a k-draft verify forward feeds k + 1 tokens, a decode step 1."""
    from lmforge.serve.speculative import _Paged

    paged = {}
    for name, m in models.items():
        v = m.config.vocab_size
        paged[name] = _Paged(m, ctx + max(ns) + 1)
        paged[name].feed([1 + i % (v - 1) for i in range(ctx)], all_logits=False)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in ns} for name in models}
    for _ in range(reps):
        for n in ns:
            for name, pg in paged.items():
                pg.n_cached = ctx
                _sync(device)
                t0 = clock()
                pg.feed(list(range(2, 2 + n)), all_logits=True)
                _sync(device)
                times[name][n].append(clock() - t0)
    ms = {name: {n: statistics.median(t) * 1e3 for n, t in d.items()} for name, d in times.items()}
    what = "CPU-time ms" if clock is time.process_time else "ms"
    _line(f"\nForward cost after {ctx} cached tokens, {what} (median of {reps}, interleaved):\n")
    _line("| model | " + " | ".join(f"{n} token{'s' if n > 1 else ''}" for n in ns) + " |")
    _line("|---|" + "---:|" * len(ns))
    for name, d in ms.items():
        _line(f"| {name} | " + " | ".join(f"{d[n]:.2f}" for n in ns) + " |")
    return ms


def break_even(k: int, cost: float) -> float | None:
    """The per-token acceptance a at which k drafts pay: E[tokens per target forward] =
    (1 - a^(k+1)) / (1 - a) (Leviathan et al.'s i.i.d. model) equals ``cost``, the price of one
    speculative step in plain decode steps (verify forward + k draft forwards). None when even
    a = 1 (k + 1 tokens) does not pay."""
    if cost <= 1.0:
        return 0.0
    if cost >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the expectation is increasing in a
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < cost:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def print_break_even(ms: dict[str, dict[int, float]], ks: list[int], draft_name: str) -> None:
    t = ms["target"]
    _line("\nBreak-even per-token acceptance at these costs (the acceptance above which k drafts "
          "beat plain decoding):\n")  # fmt: skip
    _line("| draft | " + " | ".join(f"k = {k}" for k in ks) + " |")
    _line("|---|" + "---:|" * len(ks))
    for name, per_draft in (("n-gram (free drafts)", None), (draft_name, ms[draft_name][1])):
        cells = []
        for k in ks:
            cost = (t[k + 1] + k * (per_draft or 0.0)) / t[1]
            a = break_even(k, cost)
            cells.append("never" if a is None else f"{a:.2f}")
        _line(f"| {name} | " + " | ".join(cells) + " |")


@dataclasses.dataclass
class SpecStats:
    """Counts of one generation: drafted and accepted tokens, target forwards."""

    drafted: int = 0
    accepted: int = 0
    target_steps: int = 0
    "engine steps (target forwards: the prompt's prefill and each verify, >= 1 token each)"
    draft_steps: int = 0
    "draft-model forwards (0 for n-gram drafting)"
    emitted: int = 0
    "tokens generated"
    prefill_seconds: float = 0.0
    "wall time of the prompt prefill steps, so the table can report decode alone"
    prefill_cpu_seconds: float = 0.0
    "the same in this process's CPU time (a clock that other processes' load barely moves)"

    @property
    def acceptance(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per target forward (1 for plain decoding; at most k + 1)."""
        return self.emitted / self.target_steps if self.target_steps else 0.0


class SpeculativeDecoder:
    """One prompt at a time through ``Engine(target, speculative=Speculative(draft, k))``
    (``draft=None``: plain decoding on the same engine, the peer a speedup is measured
    against), with per-generation counts: the decoding is the engine's.

    ``stats``: drafted / accepted tokens, target forwards (``target_steps``, each emitting at
    least one token: the prefill step counts), draft-model forwards, emitted tokens and the
    prefill steps' wall and CPU seconds."""

    def __init__(
        self,
        target: torch.nn.Module,
        draft: DraftModel | NgramDraft | None,
        k: int = 4,
        eos_token_id: int | None = None,
        block_size: int = 16,
    ) -> None:
        spec = Speculative(draft, k) if draft is not None else None
        blocks = math.ceil((target.config.context_length + k + 1) / block_size) + 1
        self.engine = Engine(target, eos_token_id=eos_token_id, block_size=block_size,
                             num_blocks=blocks, max_num_seqs=1, speculative=spec)  # fmt: skip
        self.stats = SpecStats()

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> CompletionOutput:
        """One sample for ``prompt`` (``params.n`` must be 1)."""
        if params.n != 1:
            raise LmforgeError("speculative decoding serves one sample per request (n = 1)")
        eng, st = self.engine, self.engine.stats
        spec = eng.speculative.stats if eng.speculative is not None else _EngineSpecStats()
        before = (dict(st), dataclasses.replace(spec))
        (out,) = eng.generate([prompt], params)
        st0, sp0 = before
        self.stats.drafted += spec.drafted - sp0.drafted
        self.stats.accepted += spec.accepted - sp0.accepted
        self.stats.draft_steps += spec.draft_steps - sp0.draft_steps
        self.stats.target_steps += int(st["steps"] - st0["steps"])
        self.stats.emitted += int(st["generated_tokens"] - st0["generated_tokens"])
        self.stats.prefill_seconds += st["mixed_s"] - st0["mixed_s"]
        self.stats.prefill_cpu_seconds += st["mixed_cpu_s"] - st0["mixed_cpu_s"]
        return out.outputs[0]


# ---------------------------------------------------------------- runs
@dataclasses.dataclass
class _Row:
    name: str
    k: int
    decoder: SpeculativeDecoder
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    tokens: int = 0
    outputs: list[list[int]] = dataclasses.field(default_factory=list)


def run_set(
    rows: list[_Row],
    prompts: list[list[int]],
    params: SamplingParams,
    device: torch.device,
    reps: int,
) -> None:
    """Every prompt through every row, interleaved (order rotated per prompt and repeat)."""
    for r in rows:
        r.decoder.stats = SpecStats()
        r.seconds, r.cpu_seconds, r.tokens, r.outputs = 0.0, 0.0, 0, []
    for rep in range(reps):
        for i, prompt in enumerate(prompts):
            p = dataclasses.replace(params, seed=None if params.greedy else 1000 * rep + i)
            shift = (i + rep) % len(rows)
            for r in rows[shift:] + rows[:shift]:
                st = r.decoder.stats
                pre, cpre = st.prefill_seconds, st.prefill_cpu_seconds
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                out = r.decoder.generate(prompt, p)
                _sync(device)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                r.seconds += dt - (st.prefill_seconds - pre)
                r.cpu_seconds += dc - (st.prefill_cpu_seconds - cpre)
                r.tokens += len(out.token_ids)
                if rep == 0:
                    r.outputs.append(out.token_ids)


def print_table(rows: list[_Row], greedy: bool, cpu_clock: bool) -> bool:
    """The table for one prompt set and temperature; whether greedy outputs all matched.

    ``cpu_clock`` adds decode ms/token in this process's CPU time (one thread: the work done,
    which other processes' load on a shared machine barely moves) and the speedup on it."""
    plain = rows[0]
    base = plain.seconds / max(plain.tokens, 1)
    cbase = plain.cpu_seconds / max(plain.tokens, 1)
    extra = " CPU-time ms/token | speedup (CPU time) |" if cpu_clock else ""
    _line(
        "\n| draft | k | acceptance | tokens / target forward | draft forwards / token "
        f"| decode ms/token | speedup vs plain |{extra} identical to plain |"
    )
    _line("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if cpu_clock else "") + "---|")
    ok = True
    for r in rows:
        st = r.decoder.stats
        ms = r.seconds / max(r.tokens, 1)
        if r is plain:
            same, acc = "(reference)", "-"
        elif greedy:
            match = r.outputs == plain.outputs
            ok &= match
            same, acc = ("yes" if match else "**NO**"), f"{st.acceptance:.3f}"
        else:
            same, acc = "n/a (sampled)", f"{st.acceptance:.3f}"
        cms = r.cpu_seconds / max(r.tokens, 1)
        cells = f" {cms * 1e3:.2f} | {cbase / max(cms, 1e-12):.2f}x |" if cpu_clock else ""
        _line(f"| {r.name} | {r.k if r.k else '-'} | {acc} | {st.tokens_per_step:.2f} | "
              f"{st.draft_steps / max(st.emitted, 1):.2f} | {ms * 1e3:.2f} | {base / ms:.2f}x |"
              f"{cells} {same} |")  # fmt: skip
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gguf", help="target GGUF (default ../shared/" + GGUF_NAME + ")")
    ap.add_argument("--shared", default=None, metavar="DIR",
                    help="a folder laid out like ../shared (data/eval/gsm8k/*.jsonl, "
                         "data/text/gutenberg/*.txt), searched first: for a GPU host, where "
                         "../shared does not travel")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (smoke test)")
    ap.add_argument("--quick", action="store_true", help="1 prompt per set, 16 new tokens")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--reps", type=int, default=1, help="passes over the prompts")
    ap.add_argument("--ks", default="2,4,6", help="draft lengths")
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="blocks kept in the truncated draft (default: 12, 1 for --tiny)")  # fmt: skip
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--distill-steps",
        type=int,
        default=0,
        help="also a distilled copy of the truncated draft, trained this many steps",
    )
    ap.add_argument("--distill-prompts", type=int, default=32, help="prompts it is distilled on")
    args = ap.parse_args(argv)
    if args.shared:
        SHARED.insert(0, Path(args.shared))
    if args.quick:
        args.prompts, args.max_tokens = 1, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    ks = [int(k) for k in args.ks.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]

    model, tok, template, eos, what = load_target(args)
    n_layers = args.draft_layers or (1 if args.tiny else 12)
    draft = truncated_draft(model, n_layers)
    if args.tiny:
        sets = tiny_prompts(model.config.vocab_size, args.prompts)
    else:
        sets = real_prompts(tok, template, args.prompts)

    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"CPU, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores"
    _line(f"# speculative decoding, batch 1 — {where}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
    _line(f"command: python benchmarks/speculative.py {' '.join(argv if argv is not None else sys.argv[1:])}")  # fmt: skip
    _line(f"target: {what}; load average at start: {_loadavg()}")
    _line(f"prompts: {', '.join(f'{k} {len(v)} (mean {statistics.mean(map(len, v)):.0f} tokens)' for k, v in sets.items())}; "
          f"{args.max_tokens} new tokens each, EOS ends a sample")  # fmt: skip

    # Correctness first: the runner's plain greedy decoding == the engine's.
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain = SpeculativeDecoder(model, None, eos_token_id=eos)
    engine = Engine(model, eos_token_id=eos)
    all_prompts = [p for v in sets.values() for p in v]
    eng_out = [o.outputs[0].token_ids for o in engine.generate(all_prompts, greedy)]
    run_out = [plain.generate(p, greedy).token_ids for p in all_prompts]
    same_engine = eng_out == run_out
    _line(f"plain decoding on the speculative runner == Engine.generate (greedy): {same_engine}")
    del engine

    draft_name = f"layers {n_layers}/{model.config.n_layers}"
    ns = sorted({1} | {k + 1 for k in ks})
    ctx = min(256, model.config.context_length - max(ns) - 2)
    # One CPU thread: the process's CPU time is the work done, steadier than wall time on a
    # machine that other jobs load.
    cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1
    clock = time.process_time if cpu_clock else time.perf_counter
    ms = forward_costs({"target": model, draft_name: draft}, device, ctx, ns, reps=5, clock=clock)
    print_break_even(ms, ks, draft_name)

    rows = [_Row("plain (no draft)", 0, SpeculativeDecoder(model, None, eos_token_id=eos))]
    for k in ks:
        rows.append(_Row("n-gram", k, SpeculativeDecoder(model, NgramDraft(), k, eos)))
    distilled = None
    if args.distill_steps:
        if args.tiny:
            g = torch.Generator().manual_seed(9)
            dp = [torch.randint(0, model.config.vocab_size, (12,), generator=g).tolist()
                  for _ in range(args.distill_prompts)]  # fmt: skip
        else:
            dp = distill_prompts(tok, template, args.distill_prompts)
        distilled = distill_draft(model, n_layers, dp, args.distill_steps, eos, args.max_tokens)
    for k in ks:
        if distilled is not None:
            rows.append(_Row(f"distilled {draft_name}", k,
                             SpeculativeDecoder(model, DraftModel(distilled), k, eos)))  # fmt: skip
    for k in ks:
        rows.append(_Row(draft_name, k, SpeculativeDecoder(model, DraftModel(draft), k, eos)))
    warm = SamplingParams(temperature=0, max_tokens=4)
    for r in rows:  # warm-up (allocator, kernels' first calls)
        r.decoder.generate(all_prompts[0], warm)

    ok = same_engine
    for t in temps:
        params = SamplingParams(temperature=t, max_tokens=args.max_tokens)
        for set_name, prompts in sets.items():
            run_set(rows, prompts, params, device, args.reps)
            kind = "greedy" if t == 0 else f"temperature {t:g}"
            _line(f"\n## {set_name} prompts, {kind}; load average now {_loadavg()}")
            ok &= print_table(rows, greedy=t == 0, cpu_clock=cpu_clock)
    _line(f"\ngreedy speculative == plain greedy on every prompt: {ok}")
    _line(f"load average at the end: {_loadavg()}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
