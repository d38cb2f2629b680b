"""Evaluation's generative tasks on the serving engine (issue 33, item 2): ``lmforge eval --tasks
gsm8k`` decodes every problem at once on :class:`lmforge.serve.Engine`; before, it ran the
reference loop (``lmforge.generate``) eight prompts at a time. This script times the very function
the command calls, :func:`lmforge.eval.run_eval`, against that loop (the peer, rebuilt here as it
was) on the same GSM8K-format problems.

Model: SmolLM2-135M's shape (30 layers, d 576, vocab 49152) with random weights; tokenizer: bytes
(257 ids; the padding ids a random model samples read as no text). Problems: synthetic, in the
layout of examples/eval (``gsm8k/test.jsonl``, ``gsm8k/train.jsonl`` for the shots), written to a
temporary folder. Greedy, so the stop strings and the end-of-text id end samples as in a real run.

Correctness first, in float32 on a few problems: the engine's texts (run_eval's own decode,
:func:`lmforge.eval.runner.generate_texts`) equal the reference loop's, prompt by prompt. Then
bfloat16 timing: run_eval twice (the first pays the engine's compile and CUDA-graph capture, the
second shows the steady state), then the peer loop once; problems/s and the speedup, table last.

    PYTHONPATH=src python benchmarks/eval_generate.py                 # on a GPU, ~3 min
    PYTHONPATH=src python benchmarks/eval_generate.py --device cpu --quick   # smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from lmforge.bench.timing import environment_line, markdown_table
from lmforge.eval import EvalOptions, run_eval
from lmforge.eval.runner import _STOP_STRINGS, _math_examples, generate_texts
from lmforge.eval.tasks import gsm8k_prompt
from lmforge.generate import generate
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import Tokenizer

SMOLLM2_135M = dict(
    vocab_size=49152, context_length=2048, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
    d_ff=1536, tie_embeddings=True, rope_theta=100000.0,
)  # fmt: skip
TINY = dict(vocab_size=512, context_length=1024, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)


def _line(s: str = "") -> None:
    print(s, flush=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _model(shape: dict, dtype: torch.dtype, device: str) -> TransformerLM:
    torch.manual_seed(0)
    m = TransformerLM(ModelConfig(**shape), device=device).to(dtype).eval()
    with torch.no_grad():  # logits that are not flat, so greedy has few near-ties
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    return m


def _data(root: Path, n: int) -> Path:
    """GSM8K-format problems: ``question`` and an ``answer`` ending in ``#### N``."""
    rng = random.Random(0)
    names = ["Ann", "Ben", "Cleo", "Dev", "Eli", "Fay"]
    things = ["apples", "pencils", "stamps", "marbles", "cards"]

    def row(i: int) -> dict:
        a, b, c = rng.randint(2, 90), rng.randint(2, 90), rng.randint(2, 9)
        who, what = rng.choice(names), rng.choice(things)
        q = (f"{who} has {a} {what}. A friend gives {who} {b} more, and then {who} buys {c} "
             f"boxes with {c} {what} in each. How many {what} does {who} have now? ({i})")  # fmt: skip
        total = a + b + c * c
        ans = (
            f"{a} + {b} = {a + b}. {c} * {c} = {c * c}. {a + b} + {c * c} = {total}.\n#### {total}"
        )
        return {"question": q, "answer": ans}

    d = root / "gsm8k"
    d.mkdir(parents=True)
    for name, count in (("test.jsonl", n), ("train.jsonl", 64)):
        (d / name).write_text("".join(json.dumps(row(i)) + "\n" for i in range(count)))
    return root


def reference_texts(model, tok, prompts, max_new_tokens: int, batch_size: int = 8) -> list[str]:
    """The pre-engine decode of ``run_eval``: lmforge.generate, ``batch_size`` prompts at a
    time (left-padded), the end-of-text id as BOS and stop, text cut at the first stop string."""
    ctx = model.config.context_length
    new_tokens = max(1, min(max_new_tokens, ctx // 2))
    keep = ctx - new_tokens
    stops = _STOP_STRINGS["gsm8k"]
    encoded = [[tok.eot_id, *tok.encode(p)][-keep:] for p in prompts]
    out = []
    for start in range(0, len(encoded), batch_size):
        new = generate(model, encoded[start : start + batch_size], new_tokens, temperature=0.0,
                       stop_tokens=[tok.eot_id], vocab_limit=None)  # fmt: skip
        for ids in new:
            text = tok.decode([t for t in ids if t < tok.vocab_size])
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
            out.append(text[:cut])
    return out


def check(shape: dict, device: str, data: Path, tok: Tokenizer, shots: int) -> None:
    """float32: run_eval's engine decode == the reference loop, text by text."""
    model = _model(shape, torch.float32, device)
    opts = EvalOptions(data_dir=str(data), shots=shots, limit=6, max_new_tokens=24, progress=False)
    examples, shot_rows = _math_examples("gsm8k", opts)
    prompts = [gsm8k_prompt(ex, shot_rows) for ex in examples]
    got = [t[0] for t in generate_texts(model, tok, prompts, max_new_tokens=24,
                                        stops=_STOP_STRINGS["gsm8k"])]  # fmt: skip
    want = reference_texts(model, tok, prompts, 24)
    bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    if bad:
        raise SystemExit(f"check FAILED: engine text {got[bad[0]]!r} != reference {want[bad[0]]!r}")
    _line(f"check: run_eval's engine decode == the reference loop on {len(prompts)} problems "
          f"(float32, 24 new tokens): True")  # fmt: skip
    del model


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--problems", type=int, default=256, help="GSM8K-format problems (256)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="as lmforge eval (256)")
    ap.add_argument("--shots", type=int, default=2, help="few-shot examples per prompt (2)")
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (smoke run)")
    ap.add_argument("--out", default=None, help="folder for results.json")
    args = ap.parse_args()
    shape = TINY if args.quick else SMOLLM2_135M
    n = 16 if args.quick else args.problems
    max_new = 32 if args.quick else args.max_new_tokens
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    _line(environment_line())
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    with tempfile.TemporaryDirectory() as tmp:
        data = _data(Path(tmp), n)
        check(shape, args.device, data, tok, args.shots)
        model = _model(shape, dtype, args.device)
        opts = EvalOptions(data_dir=str(data), shots=args.shots, max_new_tokens=max_new,
                           progress=False)  # fmt: skip
        rows, results = [], {}
        for run in ("first (engine setup included)", "second"):
            _sync(args.device)
            t0 = time.perf_counter()
            report = run_eval(model, tok, ["gsm8k"], opts)
            _sync(args.device)
            sec = time.perf_counter() - t0
            results[f"run_eval {run}"] = sec
            rows.append([f"run_eval (engine), {run}", f"{sec:.2f}", f"{n / sec:.1f}", ""])
            _line(f"run_eval {run}: {sec:.2f} s, pass@1 {report['results']['gsm8k']['pass@1']:.3f}")
        examples, shot_rows = _math_examples("gsm8k", opts)
        prompts = [gsm8k_prompt(ex, shot_rows) for ex in examples]
        _sync(args.device)
        t0 = time.perf_counter()
        texts = reference_texts(model, tok, prompts, max_new)
        _sync(args.device)
        peer = time.perf_counter() - t0
        results["reference loop, batches of 8"] = peer
        n_chars = sum(len(t) for t in texts)
        _line(f"reference loop: {peer:.2f} s ({n_chars} characters of output)")
        for r in rows:
            r[3] = f"{peer / float(r[1]):.1f}x"
        rows.append(["peer: lmforge.generate, 8 prompts at a time (before)", f"{peer:.2f}",
                     f"{n / peer:.1f}", "1.0x"])  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _line()
    _line(f"GSM8K-format eval, {n} problems, {args.shots} shots, up to {max_new} new tokens, greedy, "
          f"{'SmolLM2-135M shape' if not args.quick else 'tiny'} random weights, "
          f"{str(dtype)[6:]}, {args.device}")  # fmt: skip
    _line(markdown_table(["path", "seconds", "problems/s", "speedup"], rows))


if __name__ == "__main__":
    main()
