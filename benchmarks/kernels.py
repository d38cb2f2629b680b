"""lmforge's Triton kernels against their peers on one GPU: correctness first, then tables.

Checks FlashAttention-2, RMSNorm, fused linear + cross-entropy, the SwiGLU gate and RoPE against
float64 references (printing max errors next to the peer's), then times them next to torch SDPA
(flash and cuDNN backends), ``F.rms_norm``, unfused matmul + cross-entropy, torch SwiGLU/RoPE and
Liger-Kernel (when installed), with warmup, CUDA events and medians, and prints markdown tables.
Conventions (see ``lmforge.bench.kernels``): causal attention forward FLOPs = 4·B·H·S²·E / 2,
forward + backward = 3.5 × forward; RMSNorm bytes = read x + write y (+ weight), backward adds
read x, dy, write dx.
Default run: attention S ∈ {1k, 2k, 4k, 8k, 16k} × E ∈ {64, 128}, three RMSNorm shapes, two
cross-entropy shapes, one SwiGLU and one RoPE shape; a few minutes on one H100/H200
(autotuning 5 configs per attention kernel). ``--quick`` for a one-shape-per-suite smoke run.

    PYTHONPATH=src python benchmarks/kernels.py
    PYTHONPATH=src python benchmarks/kernels.py --only attention --seqs 4096,16384 --dims 128
    PYTHONPATH=src python benchmarks/kernels.py --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from lmforge.bench import kernels

    args = kernels.build_parser(parser).parse_args()
    from lmforge.utils.errors import LmforgeError

    try:
        return kernels.run(args, "python benchmarks/kernels.py " + " ".join(sys.argv[1:]))
    except LmforgeError as e:
        print(f"benchmarks/kernels.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
