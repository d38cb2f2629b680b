"""GGUF served quantized: Q8_0 / Q4_0 / Q4_1 blocks kept as Int8Linear / Int4Linear (no float
copy), logits equal to the dequantizing import; Q4_K / Q6_K as Int4Linear g32 / Int8Linear g16
equal to the gguf package's own dequantization, Q5_K refused in one line; on the shipped
SmolLM2 Q4_1 file (skipped when absent) logits match and the weights take about the file's bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.hf.gguf import import_gguf
from lmforge.quant import Int4Linear, Int8Linear, import_gguf_quantized
from lmforge.quant.formats import QuantEmbedding
from lmforge.utils import LmforgeError

gguf = pytest.importorskip("gguf")

SMOL = Path(__file__).resolve().parents[1].parent / "shared/models/SmolLM2-135M-Instruct.Q4_1.gguf"
D, L, H, K, F, V = 64, 2, 4, 2, 256, 96
K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block of 256 weights
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_1"}  # fmt: skip


def _k_raw(rng: np.random.Generator, shape: tuple[int, int], kind: str) -> np.ndarray:
    """Random valid K-quant blocks for an (N, K) matrix: random codes and sub-block scales,
    finite positive fp16 super-block scales (d, and dmin where the type has one)."""
    n, k = shape
    size = K_BYTES[kind]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 2e-2, (n, k // 256, 2)).astype(np.float16).view(np.uint8)  # (.., 4)
    if kind == "Q6_K":  # fp16 d is the block's last two bytes
        raw[..., size - 2 :] = d[..., :2]
    else:  # fp16 d, fp16 dmin lead the block
        raw[..., :4] = d
    return raw.reshape(n, k // 256 * size)


def _write(path: Path, arch: str = "llama", tied: bool = True, down: str = "Q4_1") -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_uint32(f"{arch}.vocab_size", V)
    e = D // H

    def add(name: str, shape: tuple[int, ...], kind: str) -> None:
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, x)
        else:
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(x, q), raw_dtype=q)

    add("token_embd.weight", (V, D), "Q8_0")
    if not tied:
        add("output.weight", (V, D), "Q4_0")
    add("output_norm.weight", (D,), "F32")
    shapes = {"attn_q": (H * e, D), "attn_k": (K * e, D), "attn_v": (K * e, D),
              "attn_output": (D, H * e), "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}  # fmt: skip
    for i in range(L):
        for name, shape in shapes.items():
            kind = down if name == "ffn_down" else TYPES[name]
            if kind in K_BYTES:  # raw blocks (the gguf package only dequantizes K-quants)
                raw = _k_raw(rng, shape, kind)
                w.add_tensor(
                    f"blk.{i}.{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind]
                )
                continue
            add(f"blk.{i}.{name}.weight", shape, kind)
        add(f"blk.{i}.attn_norm.weight", (D,), "F32")
        add(f"blk.{i}.ffn_norm.weight", (D,), "F32")
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", (e,), "F32")
            add(f"blk.{i}.attn_k_norm.weight", (e,), "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen3", True)])
def test_quantized_import_matches_dequantized(tmp_path: Path, arch: str, tied: bool) -> None:
    path = _write(tmp_path / "m.gguf", arch, tied)
    model, tok = import_gguf_quantized(path)
    ref, _, _ = import_gguf(path)
    assert tok is None  # the file has no vocabulary
    attn = model.layers[0].attn
    assert isinstance(attn.q_proj, Int4Linear) and attn.q_proj.symmetric  # Q4_0
    assert isinstance(attn.k_proj, Int4Linear) and not attn.k_proj.symmetric  # Q4_1
    assert isinstance(attn.v_proj, Int8Linear)  # Q8_0
    assert isinstance(model.token_embeddings, QuantEmbedding)
    assert (model.lm_head is model.token_embeddings.table) == tied
    for name, m in model.named_modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            want = ref.get_submodule(name.removesuffix(".table")).weight
            torch.testing.assert_close(m.dequantize(), want, rtol=0, atol=0)
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-5, atol=1e-5)
        assert model.to(torch.bfloat16)(ids).dtype == torch.bfloat16


@pytest.mark.parametrize("kind,cls,group", [("Q4_K", Int4Linear, 32), ("Q6_K", Int8Linear, 16)])
def test_k_quant_matrix_matches_gguf_dequantize(kind: str, cls: type, group: int) -> None:
    from lmforge.quant.gguf import gguf_linear

    shape = (24, 512)
    raw = _k_raw(np.random.default_rng(1), shape, kind)
    m = gguf_linear(raw, kind, shape)
    assert isinstance(m, cls) and m.group_size == group
    # no float copy: codes and fp16 group parameters only (Q6_K's 6-bit codes take int8's 8 bits)
    assert {b.dtype for b in m.buffers()} <= {torch.uint8, torch.int8, torch.float16}
    assert sum(b.numel() * b.element_size() for b in m.buffers()) <= 1.4 * raw.nbytes
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(shape)
    want = torch.from_numpy(np.ascontiguousarray(want)).float()
    # the only rounding is each sub-block scale (and Q4_K min) stored in fp16: 2^-11 relative
    tol = 2e-3 * want.abs().amax().item()
    torch.testing.assert_close(m.dequantize(), want, rtol=2e-3, atol=tol)
    x = torch.randn(3, shape[1], dtype=torch.float64)
    torch.testing.assert_close(m(x.float()).double(), x @ m.dequantize().double().t(),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_model_imports_quantized(tmp_path: Path, kind: str) -> None:
    model, _ = import_gguf_quantized(_write(tmp_path / "k.gguf", down=kind))
    down = model.layers[1].ffn.w2
    assert isinstance(down, Int4Linear if kind == "Q4_K" else Int8Linear)
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    assert out.shape == (2, 10, V) and torch.isfinite(out).all()


def test_unsupported_k_quant_is_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "k.gguf", down="Q5_K")
    with pytest.raises(LmforgeError, match="Q5_K cannot be served quantized"):
        import_gguf_quantized(path)


@pytest.mark.slow
@pytest.mark.skipif(not SMOL.is_file(), reason="shared SmolLM2 GGUF not present")
def test_smollm2_q4_1_served_at_file_size() -> None:
    model, tok = import_gguf_quantized(SMOL, context_length=256)
    ref, _, _ = import_gguf(SMOL, context_length=256)
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Germany is")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=1e-4)
    seen: dict[int, int] = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if "rope" not in n:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    weights = sum(seen.values())
    assert 0.95 * SMOL.stat().st_size < weights < 1.02 * SMOL.stat().st_size
    fp32 = sum(p.numel() * 4 for p in ref.parameters())
    assert weights < 0.2 * fp32


def test_served_quantized_matches_dequantized_on_the_engine(tmp_path: Path) -> None:
    """``load_gguf_quantized`` keeps import_gguf's (model, tokenizer, template) contract, and the
    serving engine decodes the quantized model greedily to the same tokens as the float import."""
    from lmforge.quant import load_gguf_quantized
    from lmforge.serve import Engine, SamplingParams

    path = _write(tmp_path / "m.gguf", down="Q4_K")
    model, tok, template = load_gguf_quantized(path)
    assert tok is None and template is None  # the synthetic file has neither
    ref = model.__class__(model.config).eval()  # the float model: every matrix dequantized
    state = {}
    for name, m in model.named_modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            state[name.replace("token_embeddings.table", "token_embeddings") + ".weight"] = (
                m.dequantize()
            )
    quant_buffers = (".qweight", ".scales", ".offsets", "._probe")
    state.update({k: v for k, v in model.state_dict().items() if not k.endswith(quant_buffers)})
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing)  # tied to the table
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    got = Engine(model, device="cpu").generate(prompts, greedy)
    want = Engine(ref, device="cpu").generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.skipif(not SMOL.is_file(), reason="shared SmolLM2 GGUF not present")
def test_serving_loader_keeps_the_gguf_quantized_on_request() -> None:
    """``--gguf-weights quantized`` (auto on CUDA): the loader every inference command uses holds
    about the file's bytes, and the engine decodes the same greedy tokens as from the float copy."""
    from lmforge.serve import Engine, SamplingParams
    from lmforge.serve.loading import load_model

    def nbytes(m: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    kw = dict(gguf=str(SMOL), device="cpu", context_length=256)
    quant = load_model(**kw, gguf_weights="quantized").model
    flt = load_model(**kw, gguf_weights="auto").model  # the CPU default: dequantized
    assert nbytes(quant) < 1.2 * SMOL.stat().st_size < nbytes(flt) / 4
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356]
    got = Engine(quant).generate([prompt], params)[0].outputs[0].token_ids
    assert got == Engine(flt).generate([prompt], params)[0].outputs[0].token_ids
    with pytest.raises(LmforgeError, match="--gguf-weights must be one of"):
        load_model(**kw, gguf_weights="int3")
