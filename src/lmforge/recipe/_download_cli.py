"""``lmforge download``: a pretrained model the examples use (today SmolLM2-135M-Instruct's GGUF),
from the Hugging Face Hub, resumable and checksummed (:mod:`lmforge.data.download`)."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lmforge download smollm2-135m-instruct            # → runs/models/ (needs the network)
  lmforge download --list
  lmforge chat --gguf runs/models/SmolLM2-135M-Instruct.Q4_1.gguf

Offline, the command says in one line where to put the file by hand. Corpora: lmforge data download.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``download``."""
    p = sub.add_parser(
        "download",
        help="download a pretrained model (SmolLM2-135M-Instruct GGUF) from the Hugging Face Hub",
        description="Download a pinned model file (size and SHA-256 checked; reruns resume).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", help="model name (see --list)")
    p.add_argument(
        "--out", default="runs/models", help="folder (default: runs/models, git-ignored)"
    )
    p.add_argument("--url", help="a mirror's URL of the file instead of the Hub's")
    p.add_argument("--list", action="store_true", help="list the models")
    p.add_argument("--retries", type=int, default=3, help="resume attempts in this call")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from lmforge.data.download import MODELS, download_model

    if args.list or not args.name:
        for name, (desc, rf) in MODELS.items():
            print(f"{name:24s} {desc}\n{'':24s}   {rf.url}")
        return 0
    print(download_model(args.name, args.out, url=args.url, retries=args.retries))
    return 0
