"""Rollouts on the one engine: :func:`rollout_engine` builds the :class:`lmforge.serve.Engine`
that samples RL and on-policy distillation rollouts from the trained module itself.

Log-prob semantics (the RL losses depend on it): the engine records ``logprobs[i] =
log_softmax(logits / T)[token_i]`` over the full vocabulary in float32, T the request's
temperature (1 for greedy), before any top-k / top-p / min-p truncation — exactly what
:func:`lmforge.posttrain.core.token_logprobs` computes in the trainer, so at learning rate 0
every importance ratio is 1 (up to paged-KV vs full-forward rounding; tested in
``tests/test_posttrain_resume.py``). Each token records the engine's ``policy_version``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.core import is_lmforge_model
from lmforge.utils.errors import LmforgeError

ROLLOUT_KV_FRACTION = 0.3
"Share of the free device memory a rollout engine's KV cache may take: the trainer shares the GPU."


def rollout_kv_blocks(
    context_length: int,
    bytes_per_block: int,
    free_bytes: int,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    fraction: float = ROLLOUT_KV_FRACTION,
) -> int:
    """KV blocks for a rollout engine that shares its device with a trainer (whose reference
    model, optimizer state and activations are allocated after the engine): enough for
    ``max_num_seqs`` full contexts, capped at ``fraction`` of ``free_bytes``, at least one full
    context (the engine refuses less)."""
    per_seq = -(-context_length // block_size)
    cap = int(fraction * free_bytes) // max(bytes_per_block, 1)
    return max(per_seq, min(max_num_seqs * per_seq, cap))


# -- The one engine


def rollout_engine(model: nn.Module, eos_ids: Iterable[int] = (), seed: int = 0) -> Any:
    """A :class:`lmforge.serve.Engine` sampling from ``model`` itself (no copy: the trainer
    updates the weights in place and bumps ``policy_version`` with ``update_weights({},
    version)``). On CUDA the KV cache is sized by :func:`rollout_kv_blocks` and decode runs
    through CUDA graphs (which read the weights in place). The engine's EOS: ``eos_ids[0]``."""
    from lmforge.serve import Engine

    if not is_lmforge_model(model):
        raise LmforgeError(
            "rollouts run on lmforge.serve.Engine, which needs an lmforge model (a checkpoint, "
            "GGUF or HF import), not a transformers module"
        )
    param = next(model.parameters())
    eos = list(eos_ids)
    num_blocks = None
    cuda = param.device.type == "cuda"
    if cuda:
        from lmforge.serve.model_runner import kv_bytes_per_block

        # the engine's own count: MLA latents, CLA, K/V of attention layers only, S indexer keys
        per_block = kv_bytes_per_block(model, 16, param.dtype)
        free = int(torch.cuda.mem_get_info(param.device)[0])
        num_blocks = rollout_kv_blocks(model.config.context_length, per_block, free)
    return Engine(model, device=param.device, block_size=16, num_blocks=num_blocks,
                  eos_token_id=eos[0] if eos else None, seed=seed,
                  cuda_graphs=cuda)  # fmt: skip


def sample(engine: Any, prompts: Sequence[Sequence[int]], rng: random.Random, version: int, *,
           n: int = 1, temperature: float = 1.0, max_tokens: int,
           eos_ids: Sequence[int] = ()) -> list[Any]:  # fmt: skip
    """``n`` completions per prompt under policy ``version`` (the shared module's weights), each
    request seeded from ``rng`` in order, so a resumed run samples exactly what the
    uninterrupted one did."""
    from lmforge.serve import SamplingParams

    engine.update_weights({}, version)  # the module is shared: only the version moves
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n,
                             seed=rng.randrange(2**31), stop_token_ids=tuple(eos_ids))
              for _ in prompts]  # fmt: skip
    return engine.generate(prompts, params)
