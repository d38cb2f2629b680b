"""Hugging Face interoperability: export lmforge models as Llama/Qwen3 (DeepSeek-V3 for MLA,
Bamba and Qwen3-Next for hybrids) folders, import them back.

=====================================  =================================  =====================
lmforge model                          Hugging Face class                 mapping
=====================================  =================================  =====================
layers = A (GQA), no QK-norm           LlamaForCausalLM                   lmforge.hf.convert
layers = A, qk_norm (MoE: moe.*)       Qwen3ForCausalLM (Qwen3Moe…)       lmforge.hf.convert
attention_type = mla (+ mtp_depth)     DeepseekV3ForCausalLM              lmforge.hf.deepseek
layers of M and A (or rotary_dim < E)  BambaForCausalLM                   lmforge.hf.bamba
layers of G and A (attn_output_gate,   Qwen3NextForCausalLM (grouped      lmforge.hf.qwen3_next
qk_norm, norm_eps 1e-6; MoE: moe.*     value heads, MoE with a gated
with shared_gate)                      shared expert)
=====================================  =================================  =====================

L, W and S layers have no mapping yet and are refused in one line, as is any option of a
mapped class that lmforge does not model (each module's docstring lists them).

This is the public API of ``lmforge.hf``. transformers is not needed at run time (only the tests
use it, to check that logits agree); ``tokenizers`` is needed to wrap non-GPT-2 tokenizers.
CLI: ``lmforge hf export --checkpoint DIR --out DIR``, ``lmforge hf import --model DIR --out DIR``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.hf.api import export_model, import_model, load_pretrained, save_as_checkpoint
    from lmforge.hf.convert import (
        hf_config_to_model_config,
        hf_to_lmforge_state,
        lmforge_to_hf_state,
        model_config_to_hf_config,
        rope_permutation,
    )
    from lmforge.hf.tokenizer import HFTokenizer, load_hf_tokenizer, save_tokenizer_for_hf

# name → defining module; resolved on first access so ``lmforge hf --help`` (which imports
# this package's ``_cli``) does not pull in torch.
_EXPORTS = {
    "HFTokenizer": "lmforge.hf.tokenizer",
    "export_model": "lmforge.hf.api",
    "hf_config_to_model_config": "lmforge.hf.convert",
    "hf_to_lmforge_state": "lmforge.hf.convert",
    "import_model": "lmforge.hf.api",
    "lmforge_to_hf_state": "lmforge.hf.convert",
    "load_hf_tokenizer": "lmforge.hf.tokenizer",
    "load_pretrained": "lmforge.hf.api",
    "model_config_to_hf_config": "lmforge.hf.convert",
    "rope_permutation": "lmforge.hf.convert",
    "save_as_checkpoint": "lmforge.hf.api",
    "save_tokenizer_for_hf": "lmforge.hf.tokenizer",
}

__all__ = [
    "HFTokenizer",
    "export_model",
    "hf_config_to_model_config",
    "hf_to_lmforge_state",
    "import_model",
    "lmforge_to_hf_state",
    "load_hf_tokenizer",
    "load_pretrained",
    "model_config_to_hf_config",
    "rope_permutation",
    "save_as_checkpoint",
    "save_tokenizer_for_hf",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
