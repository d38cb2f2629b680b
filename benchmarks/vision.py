"""Vision on the GPU: the VLM training step (images/s, MFU) against Hugging Face's LLaVA of the
same shape, and contrastive pretraining CLIP vs SigLIP at batch 64 and 1024 (retrieval recall).

Correctness first, on the device: CLIP and SigLIP losses against float64 references (the
SigLIP paper's double loop), and the VLM's logits against a float64 CPU copy of the model.

VLM step (stage 2: ViT frozen, projector + LM trained; bf16 autocast, AdamW): a ViT-B/16 at
224 px (196 image tokens) and a 12-layer, 768-wide lmforge LM on 196 + ``--text`` tokens per
sample; the peer is ``transformers``' ``LlavaForConditionalGeneration`` built with the same
shapes (CLIP ViT-B/16 tower, Llama LM, 2-layer GELU projector), same batch, same frozen tower,
same autocast. CUDA-event medians (``lmforge.bench.timing.time_ms``). MFU counts the model FLOPs
(PaLM's 6·N + 12·L·D·T per trained token, 2·N + 4·L·D·T per frozen ViT token) against the
H200's 989 TFLOP/s bf16 dense peak.

Retrieval: the user's path, :func:`lmforge.vision.contrastive.pretrain` on
``configs/vision/clip-tiny.toml`` with the loss, batch and device overridden (workers draw the
scenes), the same number of steps at both batch sizes; recall@1/@5 image→text and text→image on
1024 held-out scenes (chance 0.1% / 0.5%).

    PYTHONPATH=src python benchmarks/vision.py --out bench_out/vision
    PYTHONPATH=src python benchmarks/vision.py --skip-retrieval
    PYTHONPATH=src python benchmarks/vision.py --device cpu --vit-layers 1 --lm-layers 1 --width 64 --batch 2 --skip-retrieval
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

# the script's folder holds kernels.py, which would shadow the `kernels` package transformers
# imports; drop it, and put src/ first so the script runs without install
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = 989e12  # H200 SXM dense bf16 FLOP/s


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=32, help="images per VLM step")
    p.add_argument("--text", type=int, default=64, help="text tokens per VLM sample")
    p.add_argument("--width", type=int, default=768, help="ViT and LM width")
    p.add_argument("--vit-layers", type=int, default=12)
    p.add_argument("--lm-layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip-retrieval", action="store_true")
    p.add_argument("--retrieval-steps", type=int, default=300)
    p.add_argument("--out", help="folder for results.json")
    return p.parse_args()


def check_losses(device: str) -> list[list[object]]:
    """CLIP and SigLIP on the device (fp32) against float64 references."""
    from lmforge.vision.losses import clip_loss, siglip_loss, siglip_loss_reference

    g = torch.Generator().manual_seed(0)
    rows = []
    for b in (64, 1024):
        img = F.normalize(torch.randn(b, 128, generator=g, dtype=torch.float64), dim=-1)
        txt = F.normalize(img + torch.randn(b, 128, generator=g, dtype=torch.float64), dim=-1)
        s = torch.tensor(math.log(10.0), dtype=torch.float64)
        logits = s.exp() * img @ txt.t()
        labels = torch.arange(b)
        ref = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        got = clip_loss(img.float().to(device), txt.float().to(device), s.float().to(device))
        rows.append([f"CLIP loss B={b}", abs(got.item() - ref.item()) / ref.item()])
    img, txt = img[:48], txt[:48]
    bias = torch.tensor(-10.0, dtype=torch.float64)
    ref = siglip_loss_reference(img, txt, s, bias)
    got = siglip_loss(*(t.float().to(device) for t in (img, txt, s, bias)))
    rows.append(["SigLIP loss B=48 vs paper loop", abs(got.item() - ref.item()) / ref.item()])
    for name, err in rows:
        assert err < 1e-4, f"{name}: relative error {err:.2e}"
    return rows


def build_vlm(args: argparse.Namespace, device: str):
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.vision.encoders import ViT, ViTConfig
    from lmforge.vision.vlm import VisionLanguageModel

    heads = max(1, args.width // 64)
    vit = ViT(ViTConfig(224, 16, args.width, args.vit_layers, heads))
    lm_cfg = ModelConfig(
        vocab_size=args.vocab,
        context_length=512,
        d_model=args.width,
        n_layers=args.lm_layers,
        n_heads=heads,
        attention="sdpa",
    )
    lm = TransformerLM(lm_cfg, device=device)
    return VisionLanguageModel(vit, lm, image_id=4).to(device)


def check_vlm(args: argparse.Namespace, device: str) -> list[object]:
    """The VLM's logits on the device (fp32) against a float64 CPU copy."""
    small = argparse.Namespace(**{**vars(args), "vit_layers": 1, "lm_layers": 2, "vocab": 512})
    torch.manual_seed(0)
    model = build_vlm(small, "cpu").double()
    images = torch.randn(2, 3, 224, 224, dtype=torch.float64)
    tokens = torch.randint(5, 512, (2, 196 + 8))
    tokens[:, 1:197] = 4
    ref = model(tokens, images)
    got = model.float().to(device)(tokens.to(device), images.float().to(device)).double().cpu()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-4, f"VLM logits relative error {err:.2e}"
    return ["VLM logits (fp32 device vs fp64 CPU)", err]


def vlm_flops(model, batch: int, n_img: int, t: int) -> float:
    """Model FLOPs of one stage-2 step (frozen ViT forward, projector + LM forward/backward)."""
    vit = model.vision
    n_vit = sum(p.numel() for n, p in vit.named_parameters() if p.ndim == 2 and "embed" not in n)
    n_vit += vit.patch_embed.weight.numel()
    n_proj = sum(p.numel() for p in model.projector.parameters())
    lm = model.lm
    n_lm = lm.num_parameters(exclude_embeddings=True)
    if lm.config.tie_embeddings:
        n_lm += lm.lm_head.weight.numel()
    d_v, l_v = vit.config.d_model, vit.config.n_layers
    d, layers = lm.config.d_model, lm.config.n_layers
    per_sample = (n_img + 1) * (2 * n_vit + 4 * l_v * d_v * (n_img + 1))
    per_sample += 6 * n_proj * n_img + t * (6 * n_lm + 12 * layers * d * t)
    return batch * per_sample


def time_lmforge_step(args: argparse.Namespace, device: str) -> dict[str, float]:
    from lmforge.bench.timing import time_ms

    torch.manual_seed(0)
    model = build_vlm(args, device)
    model.vision.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
    n_img = model.n_image_tokens
    t = 1 + n_img + args.text
    tokens = torch.randint(5, args.vocab, (args.batch, t), device=device)
    tokens[:, 1 : 1 + n_img] = 4
    targets = torch.randint(5, args.vocab, (args.batch, t), device=device)
    targets[:, : 1 + n_img] = -100
    images = torch.randn(args.batch, 3, 224, 224, device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tokens, images)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    ms = time_ms(step, warmup=3, iters=args.iters, device=device)
    flops = vlm_flops(model, args.batch, n_img, t)
    mfu = flops / (ms / 1e3) / PEAK_BF16
    return {"ms": ms, "images_s": args.batch / ms * 1e3, "mfu": mfu, "flops": flops}


def time_hf_llava_step(
    args: argparse.Namespace, device: str, flops: float
) -> dict[str, float] | str:
    """The same step on transformers' LLaVA; returns a reason string when it cannot be built."""
    try:
        from transformers import (
            CLIPVisionConfig,
            LlamaConfig,
            LlavaConfig,
            LlavaForConditionalGeneration,
        )
    except ImportError as e:
        return f"transformers LLaVA unavailable ({e})"
    from lmforge.bench.timing import time_ms
    from lmforge.model.config import default_d_ff

    heads = max(1, args.width // 64)
    vision = CLIPVisionConfig(
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.vit_layers,
        num_attention_heads=heads,
        image_size=224,
        patch_size=16,
    )
    text = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=default_d_ff(args.width),
        num_hidden_layers=args.lm_layers,
        num_attention_heads=heads,
        max_position_embeddings=512,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=4,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    try:
        model = LlavaForConditionalGeneration(cfg).to(device)
    except Exception as e:  # a peer that cannot be built is reported, not fatal
        return f"LLaVA build failed ({type(e).__name__}: {e})"
    model.model.vision_tower.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
    n_img = 196
    t = 1 + n_img + args.text
    ids = torch.randint(5, args.vocab, (args.batch, t), device=device)
    ids[:, 1 : 1 + n_img] = 4
    labels = torch.randint(5, args.vocab, (args.batch, t), device=device)
    labels[:, : 1 + n_img] = -100
    pixels = torch.randn(args.batch, 3, 224, 224, device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(input_ids=ids, pixel_values=pixels).logits
        loss = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    try:
        ms = time_ms(step, warmup=3, iters=args.iters, device=device)
    except Exception as e:
        return f"LLaVA step failed ({type(e).__name__}: {e})"
    return {"ms": ms, "images_s": args.batch / ms * 1e3, "mfu": flops / (ms / 1e3) / PEAK_BF16}


def retrieval(args: argparse.Namespace, device: str) -> list[list[object]]:
    """pretrain() on configs/vision/clip-tiny.toml for each loss and batch size."""
    from lmforge.utils.config import load_config
    from lmforge.vision.contrastive import ContrastiveRunConfig, pretrain

    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    rows = []
    for batch in (64, 1024):
        for loss in ("clip", "siglip"):
            with tempfile.TemporaryDirectory() as tmp:
                overrides = [
                    f"train.loss={loss}",
                    f"train.batch_size={batch}",
                    f"train.device={device}",
                    f"train.steps={args.retrieval_steps}",
                    "train.eval_every=0",
                    "train.threads=0",
                    f"train.out={tmp}",
                    f"data.workers={workers}",
                    "data.val_size=1024",
                ]
                cfg = load_config(
                    ContrastiveRunConfig, ROOT / "configs/vision/clip-tiny.toml", overrides
                )
                r = pretrain(cfg, log=lambda rec: None)
            rows.append(
                [loss, batch, args.retrieval_steps, r["i2t@1"], r["i2t@5"], r["t2i@1"], r["t2i@5"]]
            )
            print("retrieval", rows[-1], flush=True)
    return rows


def main() -> int:
    from lmforge.bench.timing import environment_line, markdown_table

    args = _parse()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    checks = [*check_losses(device), check_vlm(args, device)]
    print("correctness: all relative errors below 1e-4", flush=True)
    ours = time_lmforge_step(args, device)
    n_img = 196
    peer = time_hf_llava_step(args, device, ours["flops"])
    results: dict[str, object] = {
        "env": environment_line(),
        "checks": checks,
        "lmforge": ours,
        "peer": peer,
    }
    ret_rows = [] if args.skip_retrieval else retrieval(args, device)
    results["retrieval"] = ret_rows
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print()
    print(environment_line())
    print(markdown_table(["check", "relative error"], checks))
    print()
    shape = (
        f"ViT {args.vit_layers}L/{args.width} 224px/16, LM {args.lm_layers}L/{args.width}, "
        f"batch {args.batch}, {1 + n_img + args.text} tokens/sample, bf16 autocast"
    )
    print(f"VLM stage-2 training step ({shape})")
    rows = [["lmforge VisionLanguageModel", ours["ms"], ours["images_s"], ours["mfu"]]]
    if isinstance(peer, dict):
        rows.append(
            [
                "transformers LlavaForConditionalGeneration (peer)",
                peer["ms"],
                peer["images_s"],
                peer["mfu"],
            ]
        )
    print(markdown_table(["model", "step ms", "images/s", "MFU"], rows))
    if not isinstance(peer, dict):
        print(f"peer: {peer}")
    if ret_rows:
        print()
        print("Retrieval on 1024 held-out procedural scenes (chance: @1 0.001, @5 0.005)")
        print(
            markdown_table(["loss", "batch", "steps", "i2t@1", "i2t@5", "t2i@1", "t2i@5"], ret_rows)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
