"""Bamba (transformers' Mamba-2 + attention hybrid) and Qwen3-Next (Gated DeltaNet + gated
attention) to and from lmforge's M/A and G/A layer patterns.

A random tiny ``BambaForCausalLM`` imports to the same logits (fp32, 1e-4) for several
``attn_layer_indices`` (all Mamba-2 included) and partial-rotary factors; a random lmforge
hybrid exports to the same logits in transformers and imports back bit-equal; the imported
model serves (engine greedy decode = ``lmforge.generate``); what Bamba or lmforge cannot hold
is one line. Qwen3-Next likewise, with its grouped value heads (q/k heads < value heads, value
width ≠ key width) and its MoE layers (softmax top-k, a shared expert scaled by σ(x W_g),
``decoder_sparse_step`` / ``mlp_only_layers``).
"""

from __future__ import annotations

import pytest
import torch

from conftest import optional_import
from lmforge.model import ModelConfig, MoEConfig, TransformerLM
from lmforge.utils.errors import LmforgeError

optional_import("transformers")
from transformers import BambaConfig, BambaForCausalLM  # noqa: E402

V = 61


def _bamba(attn_layer_indices, n_layers=4, **kw) -> BambaForCausalLM:
    """A random tiny Bamba whose Mamba parameters (A_log, dt_bias, D, norms) are far from
    their constant inits, so a misplaced one changes the logits."""
    args = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=attn_layer_indices,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
        max_position_embeddings=64,
    )  # fmt: skip
    cfg = BambaConfig(**{**args, **kw})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = BambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("A_log", "dt_bias", "D"):
                p.uniform_(-0.5, 0.5)
            elif p.dim() == 1:  # norm gains and the conv bias
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.mul_(3.0)  # logits far from flat
    return model


def _logits(model: BambaForCausalLM, idx: torch.Tensor) -> torch.Tensor:
    # no cache: transformers 5.25's all-Mamba Bamba fails building an attention mask with one
    return model(idx, use_cache=False).logits


def _ids(t=21, seed=1) -> torch.Tensor:
    return torch.randint(0, V, (2, t), generator=torch.Generator().manual_seed(seed))


IMPORTS = {
    "MMAM": dict(attn_layer_indices=[2]),
    "all_M": dict(attn_layer_indices=None, n_layers=3),
    "AMMA_full_rotary_tied": dict(
        attn_layer_indices=[0, 3],
        rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 1.0},
        tie_word_embeddings=True,
    ),
    "head_dim_mqa": dict(
        attn_layer_indices=[1],
        head_dim=12,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        mamba_d_conv=3,
    ),
}
PATTERNS = {"MMAM": "MMAM", "all_M": "MMM", "AMMA_full_rotary_tied": "AMMA", "head_dim_mqa": "MAMM"}


@pytest.mark.parametrize("name", list(IMPORTS))
def test_import_logits_equal_transformers(tmp_path, name) -> None:
    from lmforge.hf import import_model

    kw = dict(IMPORTS[name])
    theirs = _bamba(kw.pop("attn_layer_indices"), **kw)
    theirs.save_pretrained(tmp_path)
    ours, tok = import_model(tmp_path)
    assert tok is None
    assert ours.config.layers == PATTERNS[name]
    head_dim = getattr(theirs.config, "head_dim", 32 // 4)
    factor = theirs.config.rope_parameters["partial_rotary_factor"]
    assert int(ours.config.head_dim) == head_dim
    assert (ours.config.rotary_dim or head_dim) == int(head_dim * factor)
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), _logits(theirs, idx), atol=1e-4, rtol=1e-4)


def _lmforge(**kw) -> TransformerLM:
    base = dict(vocab_size=V, context_length=64, d_model=32, n_layers=4, n_heads=4,
                n_kv_heads=2, ssm_state=8, ssm_head_dim=16, ssm_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**base, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                p.uniform_(-0.5, 0.5)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


EXPORTS = {
    "MAMM_partial": dict(layers="MAMM", rotary_dim=4),
    "all_M_tied": dict(layers="M", n_layers=3, tie_embeddings=True),
    "MA_head_dim": dict(layers="MA", head_dim=12, rotary_dim=12, rope_theta=500.0, conv_size=3),
    # full attention with partial rotary: Llama cannot hold it, Bamba with no Mamba layer can
    "A_partial": dict(layers="A", n_layers=2, rotary_dim=2),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_logits_equal_transformers_and_import_is_exact(tmp_path, name) -> None:
    """export -> BambaForCausalLM: logits equal (fp32, 1e-4); import back: the same config and
    every tensor bit-equal."""
    from transformers import AutoModelForCausalLM

    from lmforge.hf import export_model, import_model

    ours = _lmforge(**EXPORTS[name])
    out = export_model(ours, tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(theirs).__name__ == "BambaForCausalLM"
    idx = _ids(19, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), _logits(theirs, idx), atol=1e-4, rtol=1e-4)
    back, _ = import_model(out)
    want = ours.config
    assert back.config.layers * (want.n_layers // len(back.config.layers)) == "".join(
        want.layer_types
    )
    mine = ours.state_dict()
    theirs_back = back.state_dict()
    assert theirs_back.keys() == mine.keys()
    for k, v in theirs_back.items():
        torch.testing.assert_close(v, mine[k], atol=0, rtol=0)


def test_state_round_trip_is_exact() -> None:
    """lmforge -> Bamba names -> lmforge is the identity on every tensor (conv (C, W) <->
    (C, 1, W), q/k rows permuted and back)."""
    from lmforge.hf.bamba import bamba_state_from_hf, bamba_state_to_hf

    model = _lmforge(layers="MMAM", rotary_dim=6, head_dim=12)
    state = model.state_dict()
    hf = bamba_state_to_hf(state, model.config)
    assert hf["model.layers.0.mamba.conv1d.weight"].shape == (64 + 16, 1, 4)
    back = bamba_state_from_hf(hf, model.config)
    assert back.keys() == state.keys()
    for k, v in back.items():
        torch.testing.assert_close(v, state[k], atol=0, rtol=0)


def test_imported_bamba_serves_as_generate(tmp_path) -> None:
    """An imported Bamba (Mamba-2 slots + partial-rotary paged attention) decodes greedily on
    the engine exactly as lmforge.generate's reference loop, and the checkpoint written by
    ``lmforge hf import`` loads back to the same model."""
    from lmforge.generate import generate
    from lmforge.hf import import_model, load_pretrained, save_as_checkpoint
    from lmforge.serve import Engine, SamplingParams

    _bamba([1, 3]).save_pretrained(tmp_path / "hf")
    model, tok = import_model(tmp_path / "hf")
    ckpt = save_as_checkpoint(model, tok, tmp_path / "ckpt", str(tmp_path / "hf"))
    loaded, _ = load_pretrained(ckpt)
    assert loaded.config == model.config
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 13, 7)]
    want = [generate(loaded, [p], 8, temperature=0)[0] for p in prompts]
    eng = Engine(loaded, block_size=4, num_blocks=64)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_partial_rotary_tables() -> None:
    """rotary_dim R: pairs below R/2 turn as a head of width R would, the rest not at all."""
    from lmforge.model.attention import PartialRotaryEmbedding
    from lmforge.model.layers import RotaryEmbedding

    part = PartialRotaryEmbedding(500.0, 16, 32, rotary_dim=6)
    small = RotaryEmbedding(500.0, 6, 32)
    torch.testing.assert_close(part.cos[:, :3], small.cos, atol=0, rtol=0)
    assert (part.cos[:, 3:] == 1).all() and (part.sin[:, 3:] == 0).all()
    x = torch.randn(2, 5, 16)
    y = part(x, torch.arange(5))
    torch.testing.assert_close(y[..., 6:], x[..., 6:], atol=0, rtol=0)
    with pytest.raises(ValueError, match="rotary_dim"):
        ModelConfig(d_model=32, n_heads=4, rotary_dim=5)
    with pytest.raises(ValueError, match="rotary_dim"):
        ModelConfig(d_model=32, n_heads=4, rotary_dim=4, mrope_sections=(2, 1, 1))
    with pytest.raises(ValueError, match="attn_output_gate"):
        ModelConfig(d_model=32, n_heads=4, attn_output_gate=True, layers="SA")
    with pytest.raises(ValueError, match="ssm_norm_eps"):
        ModelConfig(d_model=32, n_heads=4, ssm_norm_eps=0.0)


def _one_line(fn, *args, match: str) -> None:
    with pytest.raises(LmforgeError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value)


def test_refusals_are_one_line() -> None:
    from lmforge.hf import hf_config_to_model_config, model_config_to_hf_config

    hf = _bamba([1], n_layers=2).config.to_dict()
    for change, match in (
        ({"mamba_n_groups": 2}, "mamba_n_groups"),
        ({"mamba_proj_bias": True}, "mamba_proj_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mamba_conv_bias": False}, "mamba_conv_bias"),
        ({"time_step_limit": [0.0, 2.0]}, "time_step_limit"),
        ({"time_step_limit": "fast"}, "time_step_limit"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attn_layer_indices": [5]}, "attn_layer_indices"),
        ({"mamba_n_heads": 3}, "mamba_n_heads"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.4}}, "partial"),
    ):
        _one_line(hf_config_to_model_config, {**hf, **change}, match=match)
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, ssm_state=8, ssm_head_dim=16)
    for kw, match in (
        (dict(layers="LA"), "'L' layers"),  # no M, G: the Llama path refuses it
        (dict(layers="WA", attn_output_gate=True), "'W' layers"),  # Qwen3-Next's
        (dict(layers="MG"), "'M' layers"),
        (dict(layers="MW"), "'W' layers"),
        (dict(layers="GA", norm_eps=1e-6), "output gate"),
        (dict(layers="GA", qk_norm=True, attn_output_gate=True), "norm_eps"),
        (dict(layers="MA", qk_norm=True, ssm_norm_eps=1e-5), "qk_norm"),
        (dict(layers="MA", mup=True, ssm_norm_eps=1e-5), "mup"),
        (dict(layers="MA"), "ssm_norm_eps"),
    ):
        _one_line(model_config_to_hf_config, ModelConfig(**base, **kw), match=match)
    gated = dict(base, layers="GA", qk_norm=True, attn_output_gate=True, norm_eps=1e-6)
    moe = dict(n_experts=4, top_k=2, n_shared_experts=1, shared_gate=True)
    for change, match in (  # Qwen3-Next's MoE layers: softmax top-k, one gated shared expert
        (dict(shared_gate=False), "gated shared expert"),
        (dict(n_shared_experts=0, shared_gate=False), "gated shared expert"),
        (dict(score="sigmoid"), "softmax"),
        (dict(routing="expert_choice"), "top-k"),
        (dict(routed_scale=2.5), "routed_scale"),
    ):
        cfg = ModelConfig(**gated, moe=MoEConfig(**{**moe, **change}))
        _one_line(model_config_to_hf_config, cfg, match=match)


def test_qwen3_next_export_refuses_a_selection_bias(tmp_path) -> None:
    from lmforge.hf import export_model

    moe = MoEConfig(n_experts=4, top_k=2, expert_d_ff=16, n_shared_experts=1, shared_gate=True)
    model = _lmforge(layers="GA", qk_norm=True, attn_output_gate=True, norm_eps=1e-6, moe=moe)
    with torch.no_grad():
        model.layers[1].ffn.expert_bias[0] = 0.5
    _one_line(export_model, model, tmp_path / "hf", match="layer 1 has a non-zero expert")


def test_unexpected_or_missing_tensor_is_one_line(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from lmforge.hf import import_model

    _bamba([1], n_layers=2).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    save_file({**state, "model.layers.0.mamba.extra": torch.zeros(2)}, str(path))
    _one_line(import_model, tmp_path, match="mamba.extra")
    del state["model.layers.0.mamba.A_log"]
    save_file(state, str(path))
    _one_line(import_model, tmp_path, match="A_log")


# ------------------------------------------------------------------------------- Qwen3-Next
def _qwen3_next(layer_types, **kw):
    """A random tiny dense Qwen3-Next (every MLP in mlp_only_layers), its zero-centred gains
    and GDN output-norm gains far from their inits."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    n = len(layer_types)
    args = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=n,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        mlp_only_layers=list(range(n)), max_position_embeddings=64, layer_types=layer_types,
    )  # fmt: skip
    cfg = Qwen3NextConfig(**{**args, **kw})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # a plain gain
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif p.dim() == 1:  # zero-centred gains (1 + w), A_log, dt_bias
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.mul_(3.0)
    return model


G, A = "linear_attention", "full_attention"
GROUPED = dict(linear_num_value_heads=4, linear_value_head_dim=8)  # 2 q/k heads of 16
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=32)  # fmt: skip
QWEN_IMPORTS = {
    "GGGA": ([G, G, G, A], {}),
    "GAGA_full_rotary_tied": (
        [G, A, G, A],
        dict(
            rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 1.0},
            tie_word_embeddings=True,
        ),
    ),
    "all_G": ([G, G], {}),
    "GGA_grouped_v_heads": ([G, G, A], GROUPED),
    # the real model's shape at tiny size: grouped value heads, MoE past a dense first layer
    "GGGA_grouped_moe": ([G, G, G, A], dict(GROUPED, **MOE, mlp_only_layers=[0])),
    "GAGA_moe_every_2": (
        [G, A, G, A],
        dict(MOE, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False),
    ),
}


@pytest.mark.parametrize("name", list(QWEN_IMPORTS))
def test_qwen3_next_import_logits_equal_transformers(tmp_path, name) -> None:
    from lmforge.hf import import_model

    types, kw = QWEN_IMPORTS[name]
    theirs = _qwen3_next(types, **kw)
    theirs.save_pretrained(tmp_path)
    ours, _ = import_model(tmp_path)
    assert ours.config.layers == "".join("G" if t == G else "A" for t in types)
    assert ours.config.qk_norm and ours.config.attn_output_gate
    factor = theirs.config.rope_parameters["partial_rotary_factor"]
    assert (ours.config.rotary_dim or 8) == int(8 * factor)
    c = theirs.config
    assert ours.config.linear_dims == (c.linear_num_key_heads, c.linear_key_head_dim,
                                       c.linear_num_value_heads, c.linear_value_head_dim)  # fmt: skip
    sparse = [
        type(layer.mlp).__name__ == "Qwen3NextSparseMoeBlock" for layer in theirs.model.layers
    ]
    assert [ours.config.moe.is_moe_layer(i) for i in range(len(types))] == sparse
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), _logits(theirs, idx), atol=1e-4, rtol=1e-4)


QWEN_EXPORTS = {
    "GGA_partial": dict(layers="GGA", n_layers=3, rotary_dim=2),
    "GA_linear_dims_tied": dict(
        layers="GA", linear_heads=2, linear_head_dim=12, tie_embeddings=True, conv_size=3
    ),
    "A_gated": dict(layers="A", n_layers=2),
    "GGA_grouped_v_heads": dict(
        layers="GGA",
        n_layers=3,
        linear_heads=2,
        linear_head_dim=12,
        linear_v_heads=4,
        linear_v_head_dim=6,
    ),
    "GGGA_grouped_moe": dict(
        layers="GGGA",
        linear_heads=2,
        linear_v_heads=4,
        linear_v_head_dim=8,
        moe=MoEConfig(
            n_experts=4,
            top_k=2,
            expert_d_ff=16,
            n_shared_experts=1,
            shared_gate=True,
            first_dense_layers=1,
        ),
    ),
    "GAGA_moe_every_2": dict(
        layers="GA",
        moe=MoEConfig(
            n_experts=4,
            top_k=3,
            expert_d_ff=8,
            n_shared_experts=2,
            shared_gate=True,
            every=2,
            norm_top_k=False,
        ),
    ),
}


@pytest.mark.parametrize("name", list(QWEN_EXPORTS))
def test_qwen3_next_export_logits_equal_transformers(tmp_path, name) -> None:
    """export -> Qwen3NextForCausalLM: logits equal (fp32, 1e-4); import back: the same config
    and every tensor equal (the zero-centred gains to fp32 rounding of w − 1 + 1)."""
    from transformers import AutoModelForCausalLM

    from lmforge.hf import export_model, import_model

    kw = dict(qk_norm=True, attn_output_gate=True, norm_eps=1e-6, **QWEN_EXPORTS[name])
    ours = _lmforge(**kw)
    out = export_model(ours, tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(theirs).__name__ == "Qwen3NextForCausalLM"
    idx = _ids(19, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), _logits(theirs, idx), atol=1e-4, rtol=1e-4)
    back, _ = import_model(out)
    mine = ours.state_dict()
    assert back.state_dict().keys() == mine.keys()
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, mine[k], atol=1e-7, rtol=0)
    dims = ("linear_dims", "moe", "layer_types")
    assert [getattr(back.config, n) for n in dims] == [getattr(ours.config, n) for n in dims]


@pytest.mark.parametrize("grouped_moe", [False, True])
def test_qwen3_next_state_round_trip(grouped_moe: bool) -> None:
    from lmforge.hf.qwen3_next import qwen3_next_state_from_hf, qwen3_next_state_to_hf

    kw = {}
    if grouped_moe:  # 2 q/k heads of 8 → 4 value heads of 6; MoE on layers 1 and 2
        kw = dict(linear_heads=2, linear_v_heads=4, linear_v_head_dim=6,
                  moe=MoEConfig(n_experts=3, top_k=2, expert_d_ff=8, n_shared_experts=1,
                                shared_gate=True, first_dense_layers=1))  # fmt: skip
    model = _lmforge(layers="GGA", n_layers=3, qk_norm=True, attn_output_gate=True,
                     norm_eps=1e-6, rotary_dim=4, **kw)  # fmt: skip
    state = model.state_dict()
    hf = qwen3_next_state_to_hf(state, model.config)
    assert hf["model.layers.2.self_attn.q_proj.weight"].shape == (2 * 4 * 8, 32)
    qkvz = hf["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    ba = hf["model.layers.0.linear_attn.in_proj_ba.weight"]
    conv = hf["model.layers.0.linear_attn.conv1d.weight"]
    if grouped_moe:  # per q/k head [q 8 | k 8 | v 2·6 | z 2·6], [β 2 | a 2]
        assert qkvz.shape == (2 * (8 + 8 + 12 + 12), 32) and ba.shape == (2 * 4, 32)
        assert conv.shape == (2 * 2 * 8 + 4 * 6, 1, 4)
        v = state["layers.0.attn.v_proj.weight"]  # (4·6, D): value heads 2, 3 under q/k head 1
        torch.testing.assert_close(qkvz[40 + 16 : 40 + 28], v[12:24], atol=0, rtol=0)
        b = state["layers.0.attn.b_proj.weight"]
        torch.testing.assert_close(ba[4:6], b[2:4], atol=0, rtol=0)
        assert hf["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 32)
        assert hf["model.layers.1.mlp.experts.2.down_proj.weight"].shape == (32, 8)
        assert "model.layers.0.mlp.gate_proj.weight" in hf  # the dense first layer
    else:
        assert qkvz.shape == (4 * 4 * 8, 32) and ba.shape == (2 * 4, 32)
    back = qwen3_next_state_from_hf(hf, model.config)
    assert back.keys() == state.keys()
    for k, v in back.items():
        torch.testing.assert_close(v, state[k], atol=1e-7, rtol=0)


@pytest.mark.parametrize("grouped_moe", [False, True])
def test_imported_qwen3_next_serves_as_generate(tmp_path, grouped_moe: bool) -> None:
    """Gated attention (the output gate in the engine's paged step), GDN state slots (of the
    value heads, with grouped value heads) and the gated shared expert: an imported Qwen3-Next
    decodes greedily on the engine exactly as lmforge.generate."""
    from lmforge.generate import generate
    from lmforge.hf import import_model
    from lmforge.serve import Engine, SamplingParams

    kw = dict(GROUPED, **MOE, mlp_only_layers=[0]) if grouped_moe else {}
    _qwen3_next([G, A, G, A], **kw).save_pretrained(tmp_path)
    model, _ = import_model(tmp_path)
    assert model.config.moe.enabled == grouped_moe
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 13, 7)]
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    for kw in ({}, {"max_num_batched_tokens": 4}):  # whole prompts, and chunked prefill
        eng = Engine(model, block_size=4, num_blocks=64, **kw)
        outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want


def test_qwen3_next_refusals_are_one_line() -> None:
    from lmforge.hf import hf_config_to_model_config

    hf = _qwen3_next([G, A]).config.to_dict()
    for change, match in (
        ({"linear_num_value_heads": 3}, r"linear_num_value_heads \(3\) is not a multiple"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers \[1\]"),  # layer 0 MoE, 1 dense
        ({**MOE, "mlp_only_layers": [], "shared_expert_intermediate_size": 24}, "multiple of"),
        ({**MOE, "mlp_only_layers": None, "num_experts_per_tok": 5}, "top_k"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": [G, "sliding_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ):
        _one_line(hf_config_to_model_config, {**hf, **change}, match=match)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "source",
    ["bamba_MMAM", "qwen3_next_GAGA", "qwen3_next_grouped_moe", "gated_partial_full_attention"],
)
def test_hybrid_imports_serve_on_cuda(tmp_path, source) -> None:
    """On CUDA: imported hybrids (eager hybrid steps) and a full-attention model with the output
    gate and partial rotary (the compiled step and CUDA graphs: the gate's GEMV, the rotary
    tables) decode greedily as lmforge.generate does."""
    from lmforge.generate import generate
    from lmforge.hf import import_model
    from lmforge.serve import Engine, SamplingParams

    if source == "bamba_MMAM":
        _bamba([2]).save_pretrained(tmp_path)
        model, _ = import_model(tmp_path)
    elif source == "qwen3_next_GAGA":
        _qwen3_next([G, A, G, A]).save_pretrained(tmp_path)
        model, _ = import_model(tmp_path)
    elif source == "qwen3_next_grouped_moe":  # grouped value heads, gated shared expert
        _qwen3_next([G, G, G, A], **GROUPED, **MOE, mlp_only_layers=[0]).save_pretrained(tmp_path)
        model, _ = import_model(tmp_path)
    else:
        model = _lmforge(layers="A", n_layers=2, qk_norm=True, attn_output_gate=True,
                         rotary_dim=4)  # fmt: skip
    model = model.cuda()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 13, 21, 6)]
    eng = Engine(model, block_size=16, num_blocks=64, max_num_seqs=8)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == generate(model, [p], 10, temperature=0)[0]
