"""The one model loader of the inference commands (``generate``, ``chat``, ``serve``): an lmforge
checkpoint (trained, or made by ``lmforge hf import``), a Hugging Face folder or a GGUF file, with
its tokenizer, chat template and a display name.

:func:`add_model_source_args` adds the same source flags to every command, so ``lmforge generate
--gguf FILE`` reads what ``lmforge serve --gguf FILE`` reads; :func:`load_for_serving` loads it.
Nothing here imports torch until a model is loaded (the CLI registers commands without torch).
Exercised by ``pytest tests/test_loading.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from lmforge.utils.errors import LmforgeError

__all__ = [
    "ServingModel",
    "add_engine_args",
    "add_model_source_args",
    "engine_flags",
    "engine_tokenizer",
    "find_chat_template",
    "load_for_serving",
    "load_from_args",
    "load_kwargs",
    "load_model",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
GGUF_WEIGHTS = ("auto", "quantized", "float")
_IMPORT_CONTEXT = 4096  # imports default to this much context (RoPE tables are kept per layer)


def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """``--checkpoint | --hf | --gguf`` (exactly one), ``--device``, ``--dtype``,
    ``--context-length``."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="lmforge checkpoint or run folder (trained, or written by 'lmforge hf import')",
    )
    src.add_argument("--hf", metavar="DIR", help="Hugging Face Llama/Qwen3 folder")
    src.add_argument("--gguf", metavar="FILE", help="llama.cpp GGUF file (Llama/Qwen3)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)"
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="context to serve for --hf/--gguf imports (default: the model's, at most 4096)",
    )
    p.add_argument(
        "--gguf-weights",
        choices=GGUF_WEIGHTS,
        default="auto",
        help="--gguf matrices kept in their quantized format (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K: about "
        "the file's bytes in memory, fused dequant kernels on CUDA) or dequantized to float "
        "(faster on the CPU, ~5x the memory); auto: quantized on CUDA, float on the CPU",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's decode switches every inference command takes: ``--no-compile``,
    ``--no-compile-prefill``, ``--no-cuda-graphs``, ``--speculative``, ``--speculative-k``, ``--kv-cache-dtype`` (read by
    :func:`engine_flags`)."""
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="decode eagerly (default on CUDA: the decode step through torch.compile)",
    )
    p.add_argument(
        "--no-compile-prefill",
        action="store_true",
        help="prefill (mixed) steps eagerly, decode still compiled (default on CUDA: full-"
        "attention models prefill through torch.compile too)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="no CUDA graphs (default on CUDA: decode steps replayed as CUDA graphs)",
    )
    p.add_argument(
        "--speculative",
        default=None,
        metavar="MODE",
        help="speculative decoding, one sequence at a time: ngram (prompt lookup), draft:N "
        "(the model's own first N blocks draft) or mtp (the model's own multi-token-prediction "
        "modules draft); exact rejection sampling keeps the outputs",
    )
    p.add_argument("--speculative-k", type=int, default=4, help="drafted tokens per step (4)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="DTYPE",
        help="KV cache storage: auto (the model's dtype), fp8 (e4m3) or int8, both with a "
        "float32 scale per token and kv-head (about half the bytes of bf16: twice the blocks)",
    )


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """:class:`~lmforge.serve.Engine` keywords of :func:`add_engine_args`' flags (None: the
    engine's measured-best default, CUDA graphs and the compiled step on CUDA); ``speculative``
    is the flag's value (:func:`~lmforge.serve.speculative.speculative_from_flag` makes it)."""
    from lmforge.serve.attention import kv_cache_dtype

    kv_cache_dtype(args.kv_cache_dtype)  # an unknown name: one line, before the model loads
    return dict(
        compile=False if args.no_compile else None,
        compile_prefill=False if args.no_compile_prefill else None,
        cuda_graphs=False if args.no_cuda_graphs else None,
        speculative=args.speculative,
        speculative_k=args.speculative_k,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`load_for_serving`'s keywords from the flags :func:`add_model_source_args` added."""
    keys = ("checkpoint", "hf", "gguf", "device", "dtype", "context_length", "gguf_weights")
    return {k: getattr(args, k) for k in keys if hasattr(args, k)}


def load_from_args(args: argparse.Namespace) -> tuple[Any, Any, str | None, str]:
    """:func:`load_for_serving` with the flags :func:`add_model_source_args` added."""
    return load_for_serving(**load_kwargs(args))


def find_chat_template(folder: Path) -> str | None:
    """A chat template stored with a model: ``chat_template.jinja`` or ``tokenizer_config.json``
    (in the folder, its ``hf_tokenizer/`` or ``tokenizer/``)."""
    for d in (folder, folder / "hf_tokenizer", folder / "tokenizer"):
        jinja = d / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        cfg = d / "tokenizer_config.json"
        if cfg.is_file():
            try:
                tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
            except (json.JSONDecodeError, UnicodeDecodeError):
                tpl = None
            if isinstance(tpl, str):
                return tpl
    return None


def _device(device: str | None) -> str:
    import torch

    from lmforge.utils.runtime import resolve_device

    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(device)


@dataclasses.dataclass
class ServingModel:
    """A loaded model source (:func:`load_model`)."""

    model: Any
    "the language model (a TransformerLM), in eval mode on its device"
    tokenizer: Any
    template: str | None
    name: str
    vision: Any = None
    "a VLM's image side (:class:`lmforge.vision.serving.VisionTower`), else None"


def load_for_serving(**source: Any) -> tuple[Any, Any, str | None, str]:
    """``(model, tokenizer or None, chat template or None, name)``: :func:`load_model`'s
    text side (a VLM's language model alone)."""
    m = load_model(**source)
    return m.model, m.tokenizer, m.template, m.name


def load_model(
    *,
    checkpoint: str | None = None,
    hf: str | None = None,
    gguf: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    context_length: int | None = None,
    gguf_weights: str = "auto",
) -> ServingModel:
    """The model of exactly one source, with its tokenizer, chat template and name.

    A checkpoint folder is read by :func:`lmforge.hf.load_pretrained`: a run folder gives its
    latest checkpoint, and the tokenizer comes from ``tokenizer/`` (trained) or ``hf_tokenizer/``
    (imported). A ``lmforge vision vlm`` run folder gives its language model and its vision
    tower (:func:`lmforge.vision.serving.load_vlm`). The model comes back in eval mode on
    ``device`` (None or ``auto``: CUDA when available) in ``dtype`` (``auto``: bfloat16 on
    CUDA, float32 on the CPU). A GGUF file's matrices stay quantized
    (:func:`lmforge.quant.load_gguf_quantized`) with ``gguf_weights="quantized"`` or, with
    ``auto``, on CUDA; ``float`` (``auto`` on the CPU, where the dequantizing matmuls are ~4x
    slower than float ones) dequantizes them (:func:`lmforge.hf.gguf.import_gguf`).
    """
    import torch

    from lmforge.vision.serving import is_vlm_folder, load_vlm

    if sum(x is not None for x in (checkpoint, hf, gguf)) != 1:
        raise LmforgeError("give exactly one of --checkpoint, --hf, --gguf")
    if dtype not in DTYPES:
        raise LmforgeError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if gguf_weights not in GGUF_WEIGHTS:
        raise LmforgeError(
            f"--gguf-weights must be one of {', '.join(GGUF_WEIGHTS)}, got {gguf_weights!r}"
        )
    dev = _device(device)
    if context_length is not None and context_length < 2:
        raise LmforgeError(f"--context-length must be at least 2, got {context_length}")
    template, vision = None, None
    if checkpoint is not None and is_vlm_folder(checkpoint):
        vlm = load_vlm(checkpoint)
        model, tokenizer, template, name, vision = (vlm.lm, vlm.tokenizer, vlm.template,
                                                    vlm.name, vlm.tower)  # fmt: skip
        if context_length is not None and context_length != model.config.context_length:
            raise LmforgeError(
                f"--context-length: a VLM serves its own ({model.config.context_length})"
            )
    elif gguf is not None:
        import importlib.util

        from lmforge.hf.gguf import import_gguf

        if not Path(gguf).is_file():
            raise LmforgeError(f"GGUF file not found: {gguf}")
        if importlib.util.find_spec("gguf") is None:
            raise LmforgeError("--gguf needs the gguf package: pip install 'lmforge[serve]'")

        quantized = gguf_weights == "quantized" or (
            gguf_weights == "auto" and dev.startswith("cuda")
        )
        if quantized:  # the file's formats in memory, no float copy
            from lmforge.quant import load_gguf_quantized as import_gguf
        model, tokenizer, template = import_gguf(
            gguf, context_length=context_length or _IMPORT_CONTEXT
        )
        name = Path(gguf).stem
    elif hf is not None:
        from lmforge.hf import import_model

        if not Path(hf).is_dir():
            raise LmforgeError(f"Hugging Face model folder not found: {hf}")
        model, tokenizer = import_model(hf, context_length=context_length or _IMPORT_CONTEXT)
        template = find_chat_template(Path(hf))
        name = Path(hf).name
    else:
        from lmforge.hf import load_pretrained
        from lmforge.utils.corpus import run_folder_hint

        assert checkpoint is not None
        try:
            if (Path(checkpoint) / "quantization.json").is_file():  # lmforge quantize's output
                from lmforge.quant import load_quantized

                model, tokenizer = load_quantized(checkpoint, "cpu")
            else:
                model, tokenizer = load_pretrained(checkpoint, "cpu")
        except LmforgeError as e:
            raise LmforgeError(f"{e}{run_folder_hint(checkpoint)}") from None
        template = find_chat_template(Path(checkpoint))
        name = Path(checkpoint).resolve().name
        if context_length is not None and context_length != model.config.context_length:
            raise LmforgeError(
                "--context-length applies to imports; a checkpoint serves its own "
                f"({model.config.context_length})"
            )
    if dtype == "auto":
        want = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    else:
        want = getattr(torch, dtype)
    model = model.to(device=dev, dtype=want).eval()
    if vision is not None:
        vision = vision.to(device=dev, dtype=want).eval()
    return ServingModel(model, tokenizer, template, name, vision)


class _PaddedVocab:
    """``tokenizer`` for a model whose vocabulary is padded past it (e.g. 50304 rows for GPT-2's
    50257 ids): a sampled padding id has no text and reads as nothing, as Hugging Face tokenizers
    read unknown ids, instead of ending the command with a KeyError. A trained model gives such
    ids almost no probability; an untrained one samples them freely."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.eot_id = getattr(tokenizer, "eot_id", None)
        if callable(getattr(tokenizer, "id_to_bytes", None)):  # the byte-exact detokenizer
            self.id_to_bytes = self._id_to_bytes

    def _id_to_bytes(self, i: int) -> bytes:
        return self.tokenizer.id_to_bytes(i) if i < self.vocab_size else b""

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < self.vocab_size])


def engine_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """The tokenizer to give an engine decoding a ``vocab_size`` model: itself, or, when the
    model's vocabulary is padded past it, a view that reads the padding ids as no text."""
    if tokenizer is None or int(tokenizer.vocab_size) >= vocab_size:
        return tokenizer
    return _PaddedVocab(tokenizer)
