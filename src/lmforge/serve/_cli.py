"""``lmforge serve`` and ``lmforge chat``: registered here; torch is imported only when they run."""

from __future__ import annotations

import argparse
import sys

SERVE_EXAMPLES = """examples:
  lmforge serve --gguf ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf      # CPU, port 8000
  lmforge serve --checkpoint runs/demo/train --port 8080 --api-key secret
  lmforge serve --hf ~/models/Qwen3-0.6B --device cuda --context-length 4096
  lmforge serve --checkpoint runs/vision/vlm-tiny      # a VLM ('lmforge vision vlm' run folder)

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
  python -c "import openai; c = openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-');
             print(c.completions.create(model='SmolLM2-135M-Instruct.Q4_1', prompt='Hi').choices[0].text)"

Endpoints: /v1/completions, /v1/chat/completions (stream: true for server-sent events),
/v1/models, /health (503 while draining), /metrics (Prometheus). Binds 127.0.0.1 unless --host
says otherwise. The engine runs in its own process; on CUDA it uses CUDA graphs and the compiled
decode and prefill steps (--no-cuda-graphs, --no-compile, --no-compile-prefill turn them off;
startup prints what it chose).
SIGTERM or Ctrl-C drains: in-flight requests finish, new ones get 503; a second signal exits.
SIGUSR1 writes every thread's stack, of this process and of the engine process, to stderr (a
request that never answers: kill -USR1 -- -PGID reaches both). An engine step that runs past
60 s (a first compile of a new shape, or a hung kernel) prints its stack by itself.
A VLM takes images as chat content parts {"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}} (data: URLs only: nothing is fetched; a bad image is a 400).
"""

CHAT_EXAMPLES = """examples:
  lmforge chat --gguf ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf
  lmforge chat --checkpoint runs/demo/train --temperature 0.7 --system "You are terse."
  lmforge chat --checkpoint runs/vision/vlm-tiny --image scene.png     # a VLM ('vision vlm')

Type a message and press Enter; the reply streams as it is generated. /reset starts over,
/quit (or Ctrl-D) leaves. --image FILE (a VLM) shows the image with the first message.
"""


def _model_args(p: argparse.ArgumentParser) -> None:
    from lmforge.serve.loading import add_engine_args, add_model_source_args

    add_model_source_args(p)
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size (tokens)")
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV-cache blocks (default: from memory)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=256, help="most sequences in one step (default 256)"
    )
    add_engine_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` and ``chat`` subcommands."""
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (paged KV cache, continuous batching)",
        description="Serve a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).",
        epilog=SERVE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--model-name", default=None, help="name in /v1/models (default: the source)")
    s.add_argument(
        "--max-queue", type=int, default=1024, help="waiting requests before 429 (default 1024)"
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="larger request bodies are refused (413) before they are read (default 4 MiB; "
        "about 22 MiB for a VLM: a 16 MiB image as base64)",
    )
    s.set_defaults(func=_serve)
    c = sub.add_parser(
        "chat",
        help="interactive terminal chat on the serving engine",
        description="Chat with a model in the terminal (streamed replies).",
        epilog=CHAT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_args(c)
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--max-tokens", type=int, default=256, help="longest reply (default 256)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument(
        "--image",
        metavar="FILE",
        default=None,
        help="an image shown with the first message (a VLM: a 'lmforge vision vlm' run folder)",
    )
    c.set_defaults(func=_chat)


def _engine_kwargs(args: argparse.Namespace, **kw: object) -> dict:
    from lmforge.serve.loading import engine_flags

    return dict(block_size=args.block_size, num_blocks=args.num_blocks,
                max_num_seqs=args.max_num_seqs, **engine_flags(args), **kw)  # fmt: skip


def _bind(host: str, port: int) -> object:
    """The listening socket, bound before anything is loaded: a busy port is one line."""
    import errno
    import socket

    from lmforge.utils.errors import LmforgeError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LmforgeError(
                f"port {port} on {host} is already in use (is another server running? "
                "choose another with --port)"
            ) from None
        raise LmforgeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _serve(args: argparse.Namespace) -> int:
    from lmforge.serve.engine_process import EngineProcess, EngineSpec, dump_stacks_on_sigusr1
    from lmforge.serve.loading import load_kwargs
    from lmforge.serve.server import DEFAULT_MAX_REQUEST_BYTES, ServerState, run_server
    from lmforge.utils.errors import LmforgeError

    limit = args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
    if limit < 1:
        raise LmforgeError(f"--max-request-bytes must be at least 1, got {limit}")
    sock = _bind(args.host, args.port)
    dump_stacks_on_sigusr1()
    # The engine runs in its own process (lmforge.serve.engine_process): it loads the model,
    # builds the engine and hands back the tokenizer; this process serves HTTP.
    proc = EngineProcess(
        EngineSpec(load_kwargs(args), _engine_kwargs(args, max_queue=args.max_queue))
    )
    try:
        info = proc.launch()
        if info["tokenizer"] is None:
            raise LmforgeError("the model has no tokenizer; lmforge serve needs one to read text")
    except BaseException:
        proc.stop(timeout=5)  # a failed or interrupted start: do not wait on the model load
        sock.close()  # type: ignore[attr-defined]
        raise
    if info.get("vision") and args.max_request_bytes is None:  # room for a base64 image
        from lmforge.vision.serving import DEFAULT_MAX_IMAGE_BYTES

        limit = max(limit, DEFAULT_MAX_IMAGE_BYTES * 4 // 3 + (1 << 20))
    name = args.model_name or info["name"]
    state = ServerState(proc, info["tokenizer"], name, info["template"], args.api_key,
                        max_request_bytes=limit)  # fmt: skip
    print(
        info["summary"] + " (--no-cuda-graphs / --no-compile / --no-compile-prefill turn them off)",
        file=sys.stderr,
    )
    budget = info.get("kv_budget")
    if budget:
        print(
            f"KV cache sized after CUDA-graph capture: {budget['free_after_capture'] / 2**30:.2f} "
            f"GiB free, {budget['fraction']} of it less {budget['activation_reserve'] / 2**20:.0f} "
            "MiB kept for the largest eager step",
            file=sys.stderr,
        )
    print(
        f"serving {name} ({info['num_parameters'] / 1e6:.1f}M parameters, context "
        f"{info['context_length']}, {info['num_blocks']} KV blocks of {args.block_size}) on "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    run_server(state, sock)  # type: ignore[arg-type]
    return 0


def _chat(args: argparse.Namespace) -> int:
    from lmforge.serve.chat import chat_repl
    from lmforge.serve.engine import Engine
    from lmforge.serve.engine_process import engine_summary
    from lmforge.serve.loading import load_kwargs, load_model
    from lmforge.serve.speculative import speculative_from_flag

    loaded = load_model(**load_kwargs(args))
    model, tokenizer, template = loaded.model, loaded.tokenizer, loaded.template
    image = _read_image(args.image, loaded.vision) if args.image else None
    kw = _engine_kwargs(args)
    spec = speculative_from_flag(model, kw.pop("speculative"), kw.pop("speculative_k"))
    engine = Engine(
        model,
        eos_token_id=getattr(tokenizer, "eot_id", None),
        tokenizer=tokenizer,
        speculative=spec,
        **kw,
    )
    print(engine_summary(engine), file=sys.stderr)
    return chat_repl(engine, tokenizer, template, args.temperature, args.max_tokens, args.system,
                     image=image, vision=loaded.vision)  # fmt: skip


def _read_image(path: str, vision: object) -> tuple:
    """``(pixels, digest)`` of ``--image FILE`` for the VLM's tower; one line if it cannot be."""
    from pathlib import Path

    from lmforge.utils.errors import LmforgeError
    from lmforge.vision.serving import decode_image, image_pixels

    if vision is None:
        raise LmforgeError("--image needs a VLM (--checkpoint a 'lmforge vision vlm' run folder)")
    if not Path(path).is_file():
        raise LmforgeError(f"image not found: {path}")
    return image_pixels(decode_image(Path(path).read_bytes(), path), vision.image_size)
