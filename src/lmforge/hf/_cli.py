"""``lmforge hf export|import``: registered here so torch is imported only when a command runs."""

from __future__ import annotations

import argparse
import sys

EXAMPLES = """examples:
  lmforge hf export --checkpoint runs/demo/train --out runs/hf/demo    # latest checkpoint of a run
  lmforge hf import --model ~/models/Bamba-9B-v2 --out runs/ckpt/bamba  # Mamba-2 + attention
  lmforge hf import --model ~/models/Qwen3-1.7B --out runs/ckpt/qwen3-1.7b --context-length 4096
  lmforge hf import --model ~/models/SmolLM2-135M --out runs/ckpt/smollm2   # then: lmforge eval --checkpoint runs/ckpt/smollm2
  lmforge hf import --gguf runs/models/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/ckpt/smollm2-instruct --context-length 2048

runs/models/SmolLM2-135M-Instruct.Q4_1.gguf is what `lmforge download smollm2-135m-instruct` fetches.

A run folder exports its latest checkpoint; a folder under its checkpoints/ exports that one.
export writes config.json (LlamaForCausalLM; Qwen3ForCausalLM when model.qk_norm;
DeepseekV3ForCausalLM when model.attention_type=mla, with DeepSeek-V3 MoE layers (sigmoid
routing, groups, routed_scale, first_dense_layers) and MTP modules under DeepSeek-V3's names;
BambaForCausalLM when model.layers mixes Mamba-2 (M) and attention (A) layers, e.g. MMAM;
Qwen3NextForCausalLM when it mixes Gated DeltaNet (G) and attention with model.attn_output_gate,
model.qk_norm and model.norm_eps=1e-6), model.safetensors and tokenizer.json;
transformers.AutoModelForCausalLM.from_pretrained(OUT) gives the same logits. import reads Llama-,
Qwen3-, DeepSeek-V3- (MLA, MoE, MTP), Bamba- and dense Qwen3-Next-style folders (a Bamba's
attn_layer_indices, a Qwen3-Next's layer_types become the letters of model.layers, their partial
rotary model.rotary_dim; no downloads: point it at a local folder) and writes an lmforge checkpoint
folder (model.safetensors, config.toml, meta.json, tokenizer/). Not representable (one error line
says which): RoPE scaling other than Llama 3.1's "llama3" (DeepSeek-V3's YaRN included), biases,
sliding windows, Bamba's mamba_n_groups > 1, Qwen3-Next's grouped value heads
and MoE layers; on export, L/W/S layers (linear, sliding-window, sparse attention: no transformers
class mapped yet). --gguf FILE reads a llama.cpp GGUF file (Llama/Qwen3;
F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors, dequantized to fp32) with its tokenizer and chat template.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``hf`` subcommand with ``export`` and ``import``."""
    p = sub.add_parser(
        "hf",
        help="export to / import from Hugging Face Llama-style and hybrid (Bamba, Qwen3-Next) folders",
        description="Convert between lmforge checkpoints and Hugging Face Llama/Qwen3/DeepSeek-V3"
        "/Bamba/Qwen3-Next folders.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    hsub = p.add_subparsers(dest="hf_command", metavar="ACTION", required=True)
    e = hsub.add_parser(
        "export",
        help="lmforge checkpoint → Hugging Face folder",
        description="Write an lmforge checkpoint as a Hugging Face Llama/Qwen3/DeepSeek-V3/Bamba/"
        "Qwen3-Next folder.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint or run folder")
    e.add_argument("--out", required=True, metavar="DIR", help="output folder")
    e.set_defaults(func=_export)
    i = hsub.add_parser(
        "import",
        help="Hugging Face folder → lmforge checkpoint",
        description="Read a local Hugging Face Llama/Qwen3/DeepSeek-V3/Bamba/Qwen3-Next"
        " folder into an lmforge checkpoint.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="Hugging Face model folder")
    src.add_argument("--gguf", metavar="FILE", help="llama.cpp GGUF file (Llama / Qwen3)")
    i.add_argument("--out", required=True, metavar="DIR", help="lmforge checkpoint folder to write")
    i.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="context length of the lmforge model (default: max_position_embeddings)",
    )
    i.set_defaults(func=_import)


def _export(args: argparse.Namespace) -> int:
    from lmforge.hf import export_model, load_pretrained
    from lmforge.utils.io import ensure_writable_dir

    ensure_writable_dir(args.out, "--out")  # before loading: a read-only folder is one line
    model, tokenizer = load_pretrained(args.checkpoint, "cpu")
    out = export_model(model, args.out, tokenizer)
    note = "" if tokenizer is not None else " (no tokenizer in the checkpoint: weights only)"
    print(f"exported {args.checkpoint} → {out}{note}", file=sys.stderr)
    return 0


def _import(args: argparse.Namespace) -> int:
    from lmforge.hf import HFTokenizer, import_model, save_as_checkpoint
    from lmforge.hf.tokenizer import gpt2_incompatibility
    from lmforge.utils.io import ensure_writable_dir

    ensure_writable_dir(args.out, "--out")
    template = None
    if args.gguf is not None:
        from lmforge.hf.gguf import import_gguf

        source = args.gguf
        model, tokenizer, template = import_gguf(args.gguf, context_length=args.context_length)
    else:
        source = args.model
        model, tokenizer = import_model(args.model, context_length=args.context_length)
    out = save_as_checkpoint(model, tokenizer, args.out, source)
    if template:
        from lmforge.utils.io import atomic_write_text

        atomic_write_text(out / "chat_template.jinja", template)
    if tokenizer is None:
        note = " (no tokenizer in the source: weights only)"
    elif isinstance(tokenizer, HFTokenizer):
        why = (
            gpt2_incompatibility(tokenizer.folder) or "an added token collides with ordinary bytes"
        )
        note = f" (tokenizer kept in HF format under hf_tokenizer/: {why})"
    else:
        note = ""
    n = model.num_parameters()
    print(f"imported {source} ({n / 1e6:.1f}M parameters) → {out}{note}", file=sys.stderr)
    return 0
