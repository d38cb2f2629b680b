"""Vision on the GPU: the VLM training step through lmforge's Trainer (images/s, MFU) against
Hugging Face's LLaVA of the same shape, and contrastive pretraining CLIP vs SigLIP at batch 64
and 1024 (zero-shot retrieval recall@1/@5).

Correctness first, on the device: CLIP and SigLIP losses against float64 references (the
SigLIP paper's double loop), and the VLM's logits against a float64 CPU copy of the model.

VLM step (stage 2: ViT frozen, projector + LM trained): a ViT-B/16 at 224 px (196 image tokens)
and a 12-layer, 768-wide lmforge LM on 1 + 196 + ``--text`` tokens per sample, run as
``lmforge vision vlm`` runs it: :class:`~lmforge.vision.vlm.VLMObjective` (bf16 autocast on
CUDA, fp32 loss) in the one :class:`~lmforge.train.Trainer` (its AdamW, clipping, sync-free
step), one ``Trainer.train_step()`` per timed call. The batch is drawn once and replayed
(drawing scenes is not timed): token ids and images on the device, targets on the host as the
objective draws them. The peer is ``transformers``' ``LlavaForConditionalGeneration`` with the
same shapes (CLIP ViT-B/16 tower, Llama LM, 2-layer GELU projector), same batch, frozen tower,
bf16 autocast and torch's fused AdamW. CUDA-event medians (``lmforge.bench.timing.time_ms``).
MFU counts model FLOPs, written out with the table: per sample, the frozen ViT's forward
(N+1)·(2·N_vit + 4·L_v·D_v·(N+1)), the projector's 6·N_proj·N and the LM's
T·(6·N_lm + 12·L·D·T) (PaLM's formula; N_· are matmul parameters), against the H200's 989 TFLOP/s
bf16 dense peak.

Retrieval: the user's path, :func:`lmforge.vision.contrastive.pretrain` (the Trainer) on
``configs/vision/clip-tiny.toml`` with the loss, batch, steps and device overridden (worker
processes draw the scenes), the same number of steps at both batch sizes; recall@1/@5
image→text and text→image on ``--val-size`` held-out scenes (chance 1/n and 5/n).

    PYTHONPATH=src python benchmarks/vision.py --out bench_out/vision
    PYTHONPATH=src python benchmarks/vision.py --skip-retrieval
    PYTHONPATH=src python benchmarks/vision.py --quick          # CPU smoke test, tiny shapes
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
    p.add_argument("--val-size", type=int, default=1024, help="held-out scenes for retrieval")
    p.add_argument("--out", help="folder for results.json")
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke test: tiny VLM, 2 retrieval steps, 128 held-out scenes",
    )
    args = p.parse_args()
    if args.quick:
        small = dict(device="cpu", batch=2, text=16, width=64, vit_layers=1, lm_layers=1,
                     vocab=512, iters=2, retrieval_steps=2, val_size=128)  # fmt: skip
        for k, v in small.items():
            setattr(args, k, v)
    return args


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


def vlm_flops(model, batch: int, n_img: int, t: int) -> dict[str, float]:
    """Model FLOPs of one stage-2 step (frozen ViT forward, projector + LM forward/backward),
    with the terms that make them up (see the module docstring)."""
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
    f_vit = (n_img + 1) * (2 * n_vit + 4 * l_v * d_v * (n_img + 1))
    f_proj = 6 * n_proj * n_img
    f_lm = t * (6 * n_lm + 12 * layers * d * t)
    return {"n_vit": n_vit, "n_proj": n_proj, "n_lm": n_lm, "vit_per_sample": f_vit,
            "proj_per_sample": f_proj, "lm_per_sample": f_lm, "tokens": t,
            "total": float(batch * (f_vit + f_proj + f_lm))}  # fmt: skip


def synthetic_batch(args: argparse.Namespace, device: str, n_img: int = 196):
    """(token ids, targets, images): ``<bos> <image>×N text``; the loss on the text tokens."""
    g = torch.Generator().manual_seed(0)
    t = 1 + n_img + args.text
    tokens = torch.randint(5, args.vocab, (args.batch, t), generator=g)
    tokens[:, 1 : 1 + n_img] = 4
    targets = torch.randint(5, args.vocab, (args.batch, t), generator=g)
    targets[:, : 1 + n_img] = -100
    images = torch.randn(args.batch, 3, 224, 224, generator=g)
    return tokens.to(device), targets, images.to(device)


def time_lmforge_step(args: argparse.Namespace, device: str) -> dict[str, object]:
    """``Trainer.train_step()`` of stage 2 (VLMObjective on a replayed batch)."""
    from lmforge.bench.timing import time_ms
    from lmforge.config import RunConfig
    from lmforge.train import Trainer
    from lmforge.vision._train import phase_train_config
    from lmforge.vision.data import WordTokenizer
    from lmforge.vision.scenes import ProceduralScenes, vocabulary
    from lmforge.vision.vlm import VLMObjective

    class Replay(VLMObjective):
        """VLMObjective's loss on one batch, drawn once."""

        def next_batch(self):
            return batch

    torch.manual_seed(0)
    model = build_vlm(args, device)
    model.vision.requires_grad_(False)  # stage 2: the Trainer's AdamW gets projector + LM
    batch = synthetic_batch(args, device, model.n_image_tokens)
    bf16 = device.startswith("cuda")
    objective = Replay(ProceduralScenes(image_size=224), WordTokenizer(vocabulary()),
                       model.n_image_tokens, args.batch, "image", "answer", "stage2", bf16)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tc = phase_train_config(tmp, steps=1000, lr=1e-4, warmup=0, batch_size=args.batch,
                                device=device, seed=0, precision="bf16" if bf16 else "fp32")  # fmt: skip
        trainer = Trainer(RunConfig(train=tc), model=model, objective=objective)
        ms = time_ms(trainer.train_step, warmup=3, iters=args.iters, device=device)
        loss = trainer.train_step()[0]
    t = 1 + model.n_image_tokens + args.text
    flops = vlm_flops(model, args.batch, model.n_image_tokens, t)
    mfu = flops["total"] / (ms / 1e3) / PEAK_BF16
    return {"ms": ms, "images_s": args.batch / ms * 1e3, "mfu": mfu, "flops": flops,
            "adamw": trainer.fast.adamw, "loss": loss}  # fmt: skip


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
    ids, labels, pixels = synthetic_batch(args, device)
    labels = labels.to(device)
    bf16 = device.startswith("cuda")

    def step() -> None:
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, pixel_values=pixels).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # as the Trainer clips
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
                    f"data.val_size={args.val_size}",
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
        print(
            "no CUDA device: run with --quick (or --device cpu) for a smoke test", file=sys.stderr
        )
        return 2
    checks = [*check_losses(device), check_vlm(args, device)]
    print("correctness: all relative errors below 1e-4", flush=True)
    ours = time_lmforge_step(args, device)
    flops = ours["flops"]
    print(f"lmforge VLM step: {ours['ms']:.2f} ms (loss {ours['loss']:.3f})", flush=True)
    peer = time_hf_llava_step(args, device, flops["total"])
    results: dict[str, object] = {
        "env": environment_line(),
        "args": vars(args),
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
    t = flops["tokens"]
    print(
        f"Model FLOPs per step = B·(ViT fwd + projector + LM) = {args.batch}·("
        f"{flops['vit_per_sample']:.4g} + {flops['proj_per_sample']:.4g} + "
        f"{flops['lm_per_sample']:.4g}) = {flops['total']:.4g}; ViT 197·(2·{flops['n_vit']:,} + "
        f"4·{args.vit_layers}·{args.width}·197), projector 6·{flops['n_proj']:,}·196, "
        f"LM {t}·(6·{flops['n_lm']:,} + 12·{args.lm_layers}·{args.width}·{t})"
    )
    autocast = "bf16 autocast" if device.startswith("cuda") else "fp32"
    shape = (
        f"ViT {args.vit_layers}L/{args.width} 224px/16 frozen, LM {args.lm_layers}L/{args.width} "
        f"vocab {args.vocab}, batch {args.batch}, {t} tokens/sample, {autocast}"
    )
    print(f"VLM stage-2 training step ({shape}); MFU against {PEAK_BF16 / 1e12:.0f} TFLOP/s")
    rows = [
        [f"lmforge Trainer + VLMObjective (AdamW {ours['adamw']})", ours["ms"],
         ours["images_s"], ours["mfu"]],
    ]  # fmt: skip
    if isinstance(peer, dict):
        rows.append(["transformers LlavaForConditionalGeneration + torch AdamW (peer)",
                     peer["ms"], peer["images_s"], peer["mfu"]])  # fmt: skip
    print(markdown_table(["step", "ms", "images/s", "MFU"], rows))
    if not isinstance(peer, dict):
        print(f"peer: {peer}")
    if ret_rows:
        n = args.val_size
        print()
        print(
            f"Retrieval after `lmforge vision pretrain` (clip-tiny, {args.retrieval_steps} steps) "
            f"on {n} held-out procedural scenes (chance: @1 {1 / n:.4f}, @5 {5 / n:.4f})"
        )
        print(
            markdown_table(["loss", "batch", "steps", "i2t@1", "i2t@5", "t2i@1", "t2i@5"], ret_rows)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
