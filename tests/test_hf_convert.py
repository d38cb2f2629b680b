"""Hugging Face interop: export → transformers gives the same logits; HF Llama/Qwen3 → import gives
the same logits; the CLI round trip; one-line errors for what lmforge cannot represent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import optional_import
from lmforge.hf import (
    export_model,
    hf_config_to_model_config,
    import_model,
    load_pretrained,
    rope_permutation,
)
from lmforge.model import ModelConfig, RotaryEmbedding, TransformerLM
from lmforge.utils import LmforgeError

transformers = optional_import("transformers")

TOL = 1e-4


def _lmforge_model(**kw) -> TransformerLM:
    torch.manual_seed(0)
    base = dict(vocab_size=101, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    model = TransformerLM(ModelConfig(**{**base, **kw})).eval()
    with torch.no_grad():  # non-trivial norm gains, so a mis-mapped gain would show
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def _tokens(vocab: int, t: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def test_rope_permutation_maps_interleaved_to_rotate_half() -> None:
    e, t = 8, 5
    rope = RotaryEmbedding(10000.0, e, 16)
    x = torch.randn(t, e)
    pos = torch.arange(t)
    ours = rope(x, pos)  # interleaved pairs (2i, 2i+1)
    perm = rope_permutation(e)
    xh = x[:, perm]  # HF layout: pair (i, i + E/2)
    inv_freq = 10000.0 ** (-torch.arange(0, e, 2).float() / e)
    ang = torch.outer(pos.float(), inv_freq)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rotate_half = torch.cat([-xh[:, e // 2 :], xh[:, : e // 2]], -1)
    hf = xh * cos + rotate_half * sin
    torch.testing.assert_close(hf, ours[:, perm], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("kw", "arch"),
    [
        ({}, "LlamaForCausalLM"),  # GQA, untied
        ({"qk_norm": True, "tie_embeddings": True, "n_kv_heads": 4}, "Qwen3ForCausalLM"),
        (
            {"n_kv_heads": 1, "d_ff": 96, "rope_theta": 500000.0, "norm_eps": 1e-6},
            "LlamaForCausalLM",
        ),
        # Qwen3-0.6B's shape trait: head_dim independent of d_model / n_heads (32 · 4 ≠ 64).
        ({"qk_norm": True, "head_dim": 32, "tie_embeddings": True}, "Qwen3ForCausalLM"),
        # Llama 3.1's RoPE scaling, with an original context short enough that the 24-token
        # input spans all three frequency bands.
        (
            {
                "rope_scaling": "llama3",
                "rope_scaling_factor": 4.0,
                "rope_original_context": 16,
                "rope_theta": 500.0,
            },
            "LlamaForCausalLM",
        ),
    ],
)
def test_export_matches_transformers_logits(tmp_path: Path, kw: dict, arch: str) -> None:
    model = _lmforge_model(**kw)
    out = export_model(model, tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    x = _tokens(101)
    with torch.no_grad():
        assert _max_diff(model(x), hf(x).logits) < TOL
    # and back: import gives the same model
    back, tok = import_model(out)
    assert tok is None
    with torch.no_grad():
        assert _max_diff(back(x), model(x)) < TOL
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, atol=0, rtol=0)


def _save_hf(model, d: Path) -> Path:
    model.save_pretrained(d)
    return d


def test_import_hf_llama(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    model, _ = import_model(_save_hf(hf, tmp_path / "llama"))
    # a bf16 checkpoint imports as fp32 weights equal to the bf16 values
    _save_hf(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16), tmp_path / "bf16")
    half, _ = import_model(tmp_path / "bf16")
    assert all(p.dtype == torch.float32 for p in half.parameters())
    assert model.config.n_kv_heads == 2 and model.config.ffn_dim == 160 and not model.config.qk_norm
    assert all(p.device.type == "cpu" for p in model.parameters())
    x = _tokens(97, 32)
    with torch.no_grad():
        assert _max_diff(model(x), hf(x).logits) < TOL


def test_import_hf_qwen3_tied_with_qk_norm(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model, _ = import_model(_save_hf(hf, tmp_path / "qwen3"), context_length=48)
    assert (
        model.config.qk_norm and model.config.tie_embeddings and model.config.context_length == 48
    )
    assert model.lm_head.weight is model.token_embeddings.weight
    x = _tokens(97, 40)
    with torch.no_grad():
        assert _max_diff(model(x), hf(x).logits) < TOL


def test_cli_export_and_import_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lmforge.cli import main
    from lmforge.config import RunConfig
    from lmforge.train import load_for_inference, save_checkpoint

    model = _lmforge_model()
    ckpt = save_checkpoint(tmp_path / "ckpt", model, None, 7, config=RunConfig(model=model.config))
    assert main(["hf", "export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    assert (
        main(["hf", "import", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "back")])
        == 0
    )
    assert "imported" in capsys.readouterr().err
    back, _ = load_for_inference(tmp_path / "back")
    x = _tokens(101)
    with torch.no_grad():
        assert _max_diff(back(x), model(x)) < TOL
    meta = json.loads((tmp_path / "back" / "meta.json").read_text())
    assert meta["source"] == "huggingface"
    # an HF folder is also accepted directly wherever a checkpoint is
    direct, _ = load_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert _max_diff(direct(x), model(x)) < TOL


def test_sharded_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    out = export_model(_lmforge_model(), tmp_path / "hf")
    state = load_file(str(out / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = import_model(out)
    assert model.num_parameters() == _lmforge_model().num_parameters()


def _cfg(**kw) -> dict:
    base = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    return {**base, **kw}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"attention_bias": True}, "attention_bias = true is not supported"),
        ({"mlp_bias": True}, "mlp_bias = true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 RoPE scaling lacks"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling type 'yarn'"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "sliding-window attention"),
    ],
)
def test_unsupported_configs_name_the_problem(kw: dict, message: str) -> None:
    with pytest.raises(LmforgeError, match=message):
        hf_config_to_model_config(_cfg(**kw))
    assert hf_config_to_model_config(_cfg()).kv_heads == 2  # the base config itself is fine


def test_missing_and_unsupported_files(tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match=r"config\.json is missing"):
        import_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_cfg()))
    with pytest.raises(LmforgeError, match=r"no model\.safetensors"):
        import_model(tmp_path)
    with pytest.raises(LmforgeError, match="logit soft-cap"):
        export_model(_lmforge_model(logit_soft_cap=30.0), tmp_path / "out")
    # an extra bias tensor in the weights is named, not silently dropped
    out = export_model(_lmforge_model(), tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        LmforgeError, match=r"biases are present \('model.layers.0.self_attn.q_proj.bias'"
    ):
        import_model(out)
    # weights that disagree with config.json: one line, not a torch traceback
    del state["model.layers.0.self_attn.q_proj.bias"]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(LmforgeError, match=r"weights do not match config\.json") as info:
        import_model(out)
    assert "\n" not in str(info.value)


def test_cli_unsupported_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lmforge.cli import main

    (tmp_path / "config.json").write_text(json.dumps(_cfg(model_type="mamba")))
    rc = main(["hf", "import", "--model", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "model_type 'mamba' is not supported" in err
