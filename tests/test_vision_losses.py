"""CLIP/SigLIP losses against open_clip and the SigLIP paper's formula; the cross-rank gather."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.vision.losses import (
    clip_loss,
    retrieval_recall,
    siglip_loss,
    siglip_loss_reference,
)


def _open_clip_loss_module():
    """open_clip's loss module, loaded from its file: the package's __init__ imports
    torchvision (no CPU build matches torch here), while loss.py needs only torch."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "open-clip-torch not installed (test-only: pip install --no-deps open-clip-torch)"
        )
    path = Path(spec.submodule_search_locations[0]) / "loss.py"
    mod_spec = importlib.util.spec_from_file_location("_open_clip_loss", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _features(b: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    txt = F.normalize(img + 0.7 * torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    return img, txt


@pytest.mark.parametrize(("b", "scale"), [(8, 1 / 0.07), (33, 3.0)])
def test_clip_loss_equals_open_clip(b: int, scale: float) -> None:
    ClipLoss = _open_clip_loss_module().ClipLoss
    img, txt = _features(b, 16, b)
    img.requires_grad_(True)
    ref_img = img.detach().clone().requires_grad_(True)
    log_scale = torch.tensor(math.log(scale), dtype=torch.float64)
    ours = clip_loss(img, txt, log_scale)
    theirs = ClipLoss()(ref_img, txt, torch.tensor(scale, dtype=torch.float64))
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(img.grad, ref_img.grad, rtol=1e-10, atol=1e-12)


def test_siglip_loss_equals_paper_formula() -> None:
    img, txt = _features(12, 8, 1)
    scale = torch.tensor(math.log(10.0), dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-10.0, dtype=torch.float64, requires_grad=True)
    fast = siglip_loss(img, txt, scale, bias)
    slow = siglip_loss_reference(img, txt, scale, bias)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    g_fast = torch.autograd.grad(fast, (scale, bias))
    g_slow = torch.autograd.grad(slow, (scale, bias))
    for a, b in zip(g_fast, g_slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_losses_prefer_matched_pairs_and_recall() -> None:
    img, txt = _features(16, 32, 2)
    shuffled = txt[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
    s = torch.tensor(math.log(10.0), dtype=torch.float64)
    assert clip_loss(img, txt, s) < clip_loss(img, shuffled, s)
    assert siglip_loss(img, txt, s, -s.exp()) < siglip_loss(img, shuffled, s, -s.exp())
    perfect = retrieval_recall(img, img)
    assert perfect == {"i2t@1": 1.0, "t2i@1": 1.0, "i2t@5": 1.0, "t2i@5": 1.0}
    r = retrieval_recall(img, shuffled, ks=(1, 16))
    assert r["i2t@16"] == 1.0 and r["i2t@1"] < 1.0


def _dist_worker(rank: int, world: int, kind: str) -> dict:
    img_all, txt_all = _features(8 * world, 16, 5)
    b = 8
    img = img_all[rank * b : (rank + 1) * b].clone().requires_grad_(True)
    txt = txt_all[rank * b : (rank + 1) * b].clone().requires_grad_(True)
    s = torch.tensor(math.log(5.0), dtype=torch.float64)
    bias = torch.tensor(-3.0, dtype=torch.float64)
    loss = clip_loss(img, txt, s) if kind == "clip" else siglip_loss(img, txt, s, bias)
    loss.backward()
    # numpy arrays pickle by value; torch tensors would travel as file descriptors that die
    # with this process before the parent reads them
    return {"loss": loss.item(), "img_grad": img.grad.numpy(), "txt_grad": txt.grad.numpy()}


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_gathered_loss_matches_full_batch(kind: str) -> None:
    from lmforge.parallel._testing import run_workers

    world = 2
    results = run_workers(_dist_worker, world, kind)
    img_all, txt_all = _features(8 * world, 16, 5)
    img_all.requires_grad_(True)
    txt_all.requires_grad_(True)
    s = torch.tensor(math.log(5.0), dtype=torch.float64)
    bias = torch.tensor(-3.0, dtype=torch.float64)
    full = (
        clip_loss(img_all, txt_all, s) if kind == "clip" else siglip_loss(img_all, txt_all, s, bias)
    )
    full.backward()
    # mean of the local losses = the full-batch loss; each rank's feature gradient = W × the
    # full-batch gradient (DDP's average over ranks divides the W back out)
    mean_loss = sum(r["loss"] for r in results) / world
    assert math.isclose(mean_loss, full.item(), rel_tol=1e-10)
    for rank, r in enumerate(results):
        rows = slice(rank * 8, (rank + 1) * 8)
        img_grad, txt_grad = torch.from_numpy(r["img_grad"]), torch.from_numpy(r["txt_grad"])
        torch.testing.assert_close(img_grad, world * img_all.grad[rows], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(txt_grad, world * txt_all.grad[rows], rtol=1e-9, atol=1e-12)
