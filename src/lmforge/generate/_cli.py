"""``lmforge generate``: load (the shared loader), encode, decode on the serving engine, print
(heavy imports wait inside the handler).

Every prompt and sample goes to one :class:`~lmforge.serve.Engine` at once (continuous
batching); nothing here runs the model itself. Sample ``i`` of prompt ``j`` is seeded with
``seed + j * num_samples + i``, so a run prints the same text whatever else is in the batch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmforge.utils.errors import LmforgeError

EXAMPLES = """examples:
  lmforge generate --checkpoint runs/demo/train --prompt "def main(" --max-new-tokens 100
  lmforge generate --checkpoint runs/demo/train --prompt "import os" --temperature 0.8 --top-p 0.95 \\
      --num-samples 3 --seed 1
  lmforge generate --checkpoint runs/demo/train --prompt "x = " --temperature 0 --stop "\\n"
  lmforge generate --checkpoint runs/demo/train --prompt "class " --prompt "for " --top-k 50
  lmforge generate --checkpoint runs/demo/train --prompt-ids "1 2 3" --stop-id 0  # ids in and out
  lmforge generate --checkpoint runs/demo/train --prompt "def f(x):" --temperature 0 --speculative ngram
  lmforge generate --checkpoint runs/demo/train --prompt "def f(x):" --temperature 0 --speculative draft:2

runs/demo/train is the run ./run demo writes; a run folder loads its latest checkpoint.

other sources (the same flags as lmforge serve and lmforge chat):
  --checkpoint DIR   a folder written by 'lmforge hf import' (tokenizer in hf_tokenizer/)
  --hf DIR           a Hugging Face Llama/Qwen3 folder, e.g. --hf ~/models/Qwen3-0.6B
  --gguf FILE        a llama.cpp file, e.g. --gguf ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    from lmforge.serve.loading import add_engine_args, add_model_source_args

    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint, HF folder or GGUF file",
        description=(
            "Load a model (an lmforge checkpoint, a Hugging Face folder or a GGUF file), encode "
            "the prompts with its tokenizer, decode them all at once on the serving engine "
            "(lmforge.serve.Engine: paged KV cache, continuous batching) and print the "
            "continuations; one prompt and one sample streams as it is generated. Without a "
            "tokenizer, give token ids with --prompt-ids; ids are printed."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_source_args(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="IDS",
        help='prompt as space-separated token ids, e.g. "1 2 3" (repeatable)',
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per sample (128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, e.g. 0.95 (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p × the top one")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sample at this text, not printed (repeatable; \\n and \\t are a newline "
        "and a tab; needs a tokenizer)",
    )
    p.add_argument(
        "--stop-id",
        type=int,
        action="append",
        default=[],
        help="end a sample at this token id (repeatable; the tokenizer's end-of-text always does)",
    )
    add_engine_args(p)
    p.set_defaults(func=main)


_ESCAPES = {"\\n": "\n", "\\t": "\t"}


def _parse_ids(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise LmforgeError(f"--prompt-ids '{text}' must be space-separated integers") from None
    if not ids:
        raise LmforgeError("--prompt-ids needs at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise LmforgeError(f"--prompt-ids: id {bad[0]} outside the vocabulary [0, {vocab})")
    return ids


def _unescape(stop: str) -> str:
    for k, v in _ESCAPES.items():
        stop = stop.replace(k, v)
    return stop


def _check_args(args: argparse.Namespace) -> None:
    if not args.prompt and not args.prompt_ids:
        raise LmforgeError("give at least one --prompt TEXT or --prompt-ids IDS")
    if args.num_samples < 1:
        raise LmforgeError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise LmforgeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        raise LmforgeError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise LmforgeError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise LmforgeError(f"--top-k must be >= 0, got {args.top_k}")
    if not 0.0 <= args.min_p <= 1.0:
        raise LmforgeError(f"--min-p must be in [0, 1], got {args.min_p}")
    if any(not s for s in args.stop):
        raise LmforgeError("--stop needs a non-empty text")


def _prompts(args: argparse.Namespace, tokenizer: Any, vocab: int) -> list[list[int]]:
    """Token ids of the text prompts (first), then of the id prompts."""
    prompts = []
    for text in args.prompt:
        if tokenizer is None:
            raise LmforgeError(f"{_source(args)} has no tokenizer; use --prompt-ids")
        ids = tokenizer.encode(text)
        if not ids:
            raise LmforgeError("--prompt encodes to no tokens; give a non-empty prompt")
        prompts.append(ids)
    prompts += [_parse_ids(text, vocab) for text in args.prompt_ids]
    return prompts


def _source(args: argparse.Namespace) -> str:
    return args.checkpoint or args.hf or args.gguf


def main(args: argparse.Namespace) -> int:
    """Run ``lmforge generate`` with parsed ``args``; returns the exit status."""
    from lmforge.serve import Engine, SamplingParams
    from lmforge.serve.loading import engine_flags, engine_tokenizer, load_from_args
    from lmforge.serve.speculative import speculative_from_flag

    _check_args(args)
    model, tokenizer, _, _ = load_from_args(args)
    cfg = model.config
    prompts = _prompts(args, tokenizer, cfg.vocab_size)
    stops = tuple(_unescape(s) for s in args.stop)
    if stops and tokenizer is None:
        raise LmforgeError(f"--stop needs a tokenizer; {_source(args)} has none (use --stop-id)")
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > cfg.context_length:
        raise LmforgeError(
            f"prompt ({longest} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the "
            f"model's context_length {cfg.context_length}"
        )
    eot = getattr(tokenizer, "eot_id", None)
    tokenizer = engine_tokenizer(tokenizer, cfg.vocab_size)
    kw = engine_flags(args)
    spec = speculative_from_flag(model, kw.pop("speculative"), kw.pop("speculative_k"))
    if spec is not None and args.num_samples > 1:
        raise LmforgeError("--speculative decodes one sample per prompt: drop --num-samples")
    tok = tokenizer if args.prompt or stops else None
    engine = Engine(model, speculative=spec, eos_token_id=eot, tokenizer=tok, seed=args.seed, **kw)
    n = args.num_samples
    params = [
        SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            max_tokens=args.max_new_tokens,
            n=n,
            seed=args.seed + j * n,
            stop_token_ids=tuple(args.stop_id),
            stop=stops,
        )
        for j in range(len(prompts))
    ]
    n_text = len(args.prompt)
    if len(prompts) == 1 and n == 1 and n_text == 1:
        _stream(engine, prompts[0], params[0], args.prompt[0])
        return 0
    outs = engine.generate(prompts, params, progress=len(prompts) * n > 1)
    for j, req in enumerate(outs):
        for sample in req.outputs:
            if n > 1 or len(prompts) > 1:
                print(f"--- prompt {j + 1}, sample {sample.index + 1} ---")
            if j < n_text:
                print(args.prompt[j] + sample.text)
            else:
                print(" ".join(str(t) for t in prompts[j] + _without_stop(sample)))
    sys.stdout.flush()
    return 0


def _without_stop(sample: Any) -> list[int]:
    """The generated ids less the stop / EOS id that ended the sample (it is not text either)."""
    ids = list(sample.token_ids)
    if sample.finish_reason == "stop" and isinstance(sample.stop_reason, int) and ids:
        ids.pop()
    return ids


def _stream(engine: Any, prompt: list[int], params: Any, text: str) -> None:
    """One prompt, one sample: print the text as the engine releases it."""
    from lmforge.serve.chat import stream_text

    sys.stdout.write(text)
    stream_text(engine, prompt, params, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
