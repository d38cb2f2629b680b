"""Quality of hybrid layer patterns at equal tokens and parameters: validation-loss curves.

Family ``hybrids`` trains, through lmforge's Trainer (the ``lmforge train`` loop: bf16 autocast,
its AdamW and schedule, validation every ``--eval-every`` steps), the same model shape with
  full     ``model.layers = "A"``     full attention in every block
  gdn      ``"GGGA"``                 3:1 Gated DeltaNet : attention (Qwen3-Next)
  mamba    ``"MMMA"``                 3:1 Mamba-2 : attention (Nemotron-H)
  swa      ``"WWWA"``                 3:1 sliding window (T/8) : global attention
  linear   ``"G"``                    all linear (Gated DeltaNet in every block)
on the same token windows, each variant's ``d_ff`` set so that its parameter count equals the
full-attention model's (:func:`lmforge.model.accounting.parameter_count`).
Family ``dsa`` is DeepSeek-V3.2's warm start: a full-attention model is trained for ``--steps``,
then (a) an indexer is added (:func:`lmforge.model.sparse_attention.add_indexer`) and trained
alone against the dense attention for ``--warmup-steps`` (stage 1), then the whole model trains
with top-k = T/8 attention for ``--sparse-steps`` (stage 2); (b) the dense model continues for
the same steps and tokens, as the baseline. Stages run in the Trainer with an objective that adds
the indexer loss (the pretraining path cannot start from a given model yet). The attention
FLOPs the S layers save come from :func:`lmforge.model.sparse_attention.attention_flop_fraction`.
The warm start's knobs: ``--base FILE`` keeps the dense base (trained once, then read by every
later call), ``--topk``, ``--dsa-layers`` (which blocks become S, e.g. ``ASSS``), ``--index-lr``
(stage 1), ``--sparse-lr`` (stage 2 and the dense continuation), ``--index-loss-scale``,
``--seed`` (data order of the continuations and the indexer's init) and ``--label`` (names the
DSA result, so that several sit in one ``--out`` next to their dense continuation).

Each variant writes ``<out>/<variant>.json`` (its curve, parameters, tokens); every call then
draws all curves found in ``--out`` into ``<out>/hybrid_quality.png`` and prints the table last;
``--merge`` draws the results of several calls (one per family) into one figure and table.
``--data DIR`` holds ``train.bin`` and ``val.bin`` (lmforge token shards with their sidecars).

    PYTHONPATH=src python benchmarks/hybrid_quality.py --data shards/ --family hybrids --out runs/hq
    PYTHONPATH=src python benchmarks/hybrid_quality.py --data shards/ --family dsa --out runs/hq --base runs/hq/base.pt
    PYTHONPATH=src python benchmarks/hybrid_quality.py --data shards/ --family dsa --out runs/hq --base runs/hq/base.pt --variants dsa --dsa-layers ASSSSSSS --sparse-lr 1e-4 --label lr
    PYTHONPATH=src python benchmarks/hybrid_quality.py --merge runs/hq_a runs/hq_b --out runs/hq
    PYTHONPATH=src python benchmarks/hybrid_quality.py --quick --out /tmp/hq   # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import numpy as np
import torch
import torch.nn.functional as F

FAMILIES = {
    "hybrids": {"full": "A", "gdn": "GGGA", "mamba": "MMMA", "swa": "WWWA", "linear": "G"},
    # the dense base, the DSA warm start from it, the base continued dense (the DSA's peer)
    "dsa": {"full": "A", "dsa": "S", "dense-cont": "A"},
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__[: __doc__.index("    PYTHONPATH")].rstrip(),
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", type=Path, help="directory with train.bin and val.bin shards")
    p.add_argument("--family", choices=tuple(FAMILIES), default="hybrids")
    p.add_argument("--variants", default="", help="comma-separated subset of the family's")
    p.add_argument("--out", type=Path, default=Path("runs/hybrid_quality"))
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024, help="context length T")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600, help="steps per variant (dsa: the base)")
    p.add_argument("--warmup-steps", type=int, default=100, help="dsa stage 1 (indexer only)")
    p.add_argument("--sparse-steps", type=int, default=200, help="dsa stage 2 (top-k)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--index-heads", type=int, default=4, help="dsa: lightning-indexer heads")
    p.add_argument("--index-dim", type=int, default=32, help="dsa: lightning-indexer head width")
    p.add_argument("--topk", type=int, default=0, help="dsa: keys per query (default T/8)")
    p.add_argument("--sparse-lr", type=float, default=0.0,
                   help="dsa: peak lr of stage 2 and of the dense continuation (default lr/10, "
                        "the base run's final lr)")  # fmt: skip
    p.add_argument("--index-lr", type=float, default=0.0, help="dsa: stage-1 lr (default lr)")
    p.add_argument("--index-loss-scale", type=float, default=1.0,
                   help="dsa: weight of the indexer loss; AdamW's step hardly depends on it, but "
                        "the gradient-norm clip (shared with the LM's gradient) does")  # fmt: skip
    p.add_argument("--dsa-layers", default="",
                   help="dsa: the pattern after add_indexer, e.g. ASSS (default every A -> S)")  # fmt: skip
    p.add_argument("--base", type=Path,
                   help="dsa: the dense base model's file: loaded when it exists (no base "
                        "training), else written after training it")  # fmt: skip
    p.add_argument("--seed", type=int, default=0,
                   help="dsa: seed of the continuations' data order and the indexer init")  # fmt: skip
    p.add_argument("--label", default="",
                   help="dsa: suffix of the DSA result's name, to keep several in one --out")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--minutes", type=float, default=7.5, help="training budget of the whole call")
    p.add_argument("--device", default="auto")
    p.add_argument("--merge", type=Path, nargs="+", default=(),
                   help="no training: draw the results of these earlier --out dirs into --out")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: a tiny model on synthetic shards (numbers mean nothing)")  # fmt: skip
    return p


def _quick(args: argparse.Namespace) -> None:
    """Shrink everything for a CPU smoke run; synthetic shards when no --data is given."""
    args.d_model, args.layers, args.heads, args.seq, args.batch = 32, 4, 4, 32, 4
    args.steps, args.warmup_steps, args.sparse_steps = 8, 4, 4
    args.eval_every, args.eval_batches, args.device = 4, 2, "cpu"
    args.index_heads, args.index_dim = 2, 8
    if args.data is None:
        from lmforge.train.data import write_shard

        args.data = args.out / "synthetic"
        rng = np.random.default_rng(0)
        # a noisy copy task: runs of 8 random tokens, each run repeated once
        runs = rng.integers(0, 61, (800, 8))
        toks = np.concatenate([np.concatenate([r, r]) for r in runs])
        args.data.mkdir(parents=True, exist_ok=True)
        write_shard(args.data / "train.bin", toks[:10000], 64)
        write_shard(args.data / "val.bin", toks[10000:], 64)


def _shards(args: argparse.Namespace) -> tuple[str, str, int]:
    from lmforge.train.data import open_shard
    from lmforge.utils.errors import LmforgeError

    if args.data is None:
        raise LmforgeError("--data DIR (with train.bin and val.bin) is required without --quick")
    train, val = args.data / "train.bin", args.data / "val.bin"
    vocab = open_shard(train).vocab_size
    if open_shard(val).vocab_size != vocab:
        raise LmforgeError(f"{train} and {val} come from different vocabularies")
    return str(train), str(val), vocab


def _model_config(args: argparse.Namespace, vocab: int, layers: str) -> Any:
    """The variant's config, its d_ff chosen so that its parameters equal full attention's."""
    from lmforge.model import ModelConfig, accounting

    base = ModelConfig(
        vocab_size=vocab, context_length=args.seq, d_model=args.d_model, n_layers=args.layers,
        n_heads=args.heads, window=max(1, args.seq // 8), dsa_topk=max(1, args.seq // 8),
        dsa_index_heads=args.index_heads, dsa_index_dim=args.index_dim, ssm_head_dim=min(64, 2 * args.d_model // 4),
        ssm_state=min(64, args.d_model), attention="auto",
    )  # fmt: skip
    target = accounting.parameter_count(base)
    cfg = dataclasses.replace(base, layers=layers)
    per_ffn = 3 * cfg.d_model * cfg.n_layers  # parameters per unit of d_ff
    rest = accounting.parameter_count(cfg) - per_ffn * cfg.ffn_dim
    d_ff = max(8, 8 * round((target - rest) / per_ffn / 8))
    return dataclasses.replace(cfg, d_ff=d_ff)


def _train_config(args: argparse.Namespace, out: Path, steps: int, lr: float, warmup: int) -> Any:
    from lmforge.train import TrainConfig

    shutil.rmtree(out, ignore_errors=True)  # this script's own scratch run: always from step 0
    cpu = args.device == "cpu"
    return TrainConfig(
        out_dir=str(out), device=args.device, seed=0, batch_size=args.batch,
        context_length=args.seq, max_steps=steps, lr=lr, min_lr=lr / 10, warmup_steps=warmup,
        eval_every=args.eval_every, eval_batches=args.eval_batches, save_every=0,
        save_every_minutes=0.0, precision="fp32" if cpu else "bf16", master_weights="off",
        resume=False, plot=False,
        progress=True, max_minutes=args.budget_min,  # (progress=False + max_minutes: Trainer bug)
    )  # fmt: skip


def _curve(out: Path, offset: int = 0, key: str = "val_loss") -> list[tuple[int, float]]:
    from lmforge.train.metrics import read_metrics

    recs = read_metrics(out / "metrics.jsonl")
    # one point per step: the last step's periodic and final evaluations are the same
    points = {offset + int(r["step"]): float(r[key]) for r in recs if key in r}
    return sorted(points.items())


class _LMWithIndexer:
    """Next-token loss on the train shard plus the S layers' indexer loss (an objective of the
    Trainer: the pretraining objective's data, a model given from outside); evaluated on the
    fixed validation windows the Trainer uses."""

    name = "lm+indexer"

    def __init__(self, train: str, val: str, vocab: int, args: argparse.Namespace, dev: str):
        from lmforge.train.data import MixtureSampler, open_source

        seed = 1 + 1000 * args.seed
        self.sampler = MixtureSampler([open_source(train, vocab)], args.seq, (), seed, vocab)
        self.val = open_source(val, vocab)
        self.args, self.device = args, dev
        self._sums = [0.0, 0.0, 0]  # LM loss, indexer loss, steps since the last evaluation

    def _ce(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", torch.bfloat16, enabled=self.device.startswith("cuda")):
            logits = model(x)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sampler.next_batch(self.args.batch, self.device)

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from lmforge.model.sparse_attention import indexer_loss

        loss = self._ce(model, *batch)
        aux = indexer_loss(model)
        self._sums[0] += float(loss.detach())
        self._sums[1] += 0.0 if aux is None else float(aux.detach())
        self._sums[2] += 1
        if aux is not None:
            loss = loss + self.args.index_loss_scale * aux
        return loss, torch.ones((), device=loss.device)

    def batch_weight(self, batch: Any) -> float:
        return 1.0

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Validation loss with top-k attention, also during the dense warm-up (stage 1)."""
        from lmforge.model.sparse_attention import sparse_layers
        from lmforge.train.data import _to_device, eval_batches

        layers = sparse_layers(model)
        stage = [m.dense_warmup for m in layers]
        for m in layers:
            m.dense_warmup = False
        total, n = 0.0, 0
        for x, y in eval_batches(self.val, self.args.batch, self.args.seq, self.args.eval_batches):
            total += float(self._ce(model, _to_device(x, self.device), _to_device(y, self.device)))
            n += 1
        for m, dense in zip(layers, stage):
            m.dense_warmup = dense
        # the training losses since the last evaluation: the LM's and the S layers' indexer
        # loss (stage 1: KL to the dense attention over all past keys; stage 2: over the top-k)
        ce, kl, steps = self._sums
        self._sums = [0.0, 0.0, 0]
        out = {"val_loss": total / max(n, 1)}
        if steps:
            out |= {"train_lm_loss": ce / steps, "train_indexer_loss": kl / steps}
        if layers:
            out["val_topk_mass"] = self._topk_mass(model, layers)
        return out

    def _topk_mass(self, model: torch.nn.Module, layers: list) -> float:
        """The indexer's recall: the share of the dense attention's probability (mean over heads)
        that lands on the top-k keys it picks, averaged over queries (those before k keep all
        their keys), S layers and 2 validation batches. Read from the indexer-loss target that
        a training forward computes, with the causal mask in place of the top-k one."""
        from unittest import mock

        from lmforge.model import sparse_attention as sa
        from lmforge.train.data import _to_device, eval_batches

        original, masses = sa.attention_target, []

        def target(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            dense = original(q, k, sa.causal_mask(q.shape[2], q.device))  # (B, T, T)
            masses.append(float((dense * mask).sum(-1).mean()))
            return original(q, k, mask)

        stage = [m.dense_warmup for m in layers]
        for m in layers:
            m.dense_warmup = False
        model.train()  # the target exists in training forwards only (no dropout in the model)
        try:
            with torch.enable_grad(), mock.patch.object(sa, "attention_target", target):
                for x, _ in eval_batches(self.val, self.args.batch, self.args.seq, 2):
                    model(_to_device(x, self.device))
        finally:
            model.eval()
            for m, dense in zip(layers, stage):
                m.dense_warmup, m._aux = dense, None
        return sum(masses) / max(len(masses), 1)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])


def _save(args: argparse.Namespace, name: str, result: dict[str, Any]) -> None:
    from lmforge.utils.io import atomic_write_text

    atomic_write_text(args.out / f"{name}.json", json.dumps(result, indent=1))


def _pretrain(args: argparse.Namespace, name: str, layers: str, data: tuple) -> Any:
    """Train one variant from scratch through the Trainer; returns the trained model."""
    from lmforge.config import RunConfig
    from lmforge.model import accounting
    from lmforge.train import DataConfig, Trainer

    train, val, vocab = data
    cfg = _model_config(args, vocab, layers)
    out = args.out / "runs" / name
    tc = _train_config(args, out, args.steps, args.lr, max(1, args.steps // 20))
    run = RunConfig(model=cfg, train=tc, data=DataConfig(train=(train,), val=(val,)))
    trainer = Trainer(run)
    start = time.monotonic()
    trainer.run()
    curve = _curve(out)
    tokens = trainer.iteration * args.batch * args.seq
    _save(args, name, {
        "variant": name, "layers": layers, "params": accounting.parameter_count(cfg),
        "d_ff": cfg.ffn_dim, "tokens": tokens, "steps": trainer.iteration, "curve": curve,
        "flops_per_token": accounting.flops_per_token(cfg, args.seq),
        "seconds": time.monotonic() - start,
    })  # fmt: skip
    return trainer.model


def _continue(
    args: argparse.Namespace, name: str, model: Any, stages: list, data: tuple, peer: str = ""
) -> None:
    """Train a given model through (steps, lr, dsa stage or None) stages; one curve."""
    from lmforge.config import RunConfig
    from lmforge.model import accounting
    from lmforge.model.sparse_attention import attention_flop_fraction, set_dsa_stage
    from lmforge.train import Trainer

    train, val, vocab = data
    offset, curve, start = args.steps, [], time.monotonic()
    extra: dict[str, list] = {"train_indexer_loss": [], "val_topk_mass": []}
    for i, (steps, lr, stage) in enumerate(stages):
        if stage is not None:
            set_dsa_stage(model, stage)
        out = args.out / "runs" / f"{name}{i}"
        run = RunConfig(model=model.config, train=_train_config(args, out, steps, lr, 1))
        objective = _LMWithIndexer(train, val, vocab, args, args.dev)
        trainer = Trainer(run, model=model, objective=objective)
        trainer.run()
        curve += _curve(out, offset)
        for key, points in extra.items():
            points += _curve(out, offset, key)
        offset += trainer.iteration
    cfg = model.config
    saved = attention_flop_fraction(cfg, args.seq) if "S" in cfg.layers else 1.0
    # over the whole model: the A layers it keeps attend densely (every block the same shape)
    kinds = "".join(cfg.layer_types)
    whole = (kinds.count("S") * saved + kinds.count("A")) / max(1, len(kinds))
    _save(args, name, {
        "variant": name, "layers": "".join(cfg.layer_types), "params":
        accounting.parameter_count(cfg), "tokens": (offset - args.steps) * args.batch * args.seq,
        "steps": offset - args.steps, "curve": curve, "attention_flop_fraction": saved,
        "model_attention_flop_fraction": whole,
        "flops_per_token": accounting.flops_per_token(cfg, args.seq),
        "seconds": time.monotonic() - start, "peer": peer, "seed": args.seed,
        "stages": [list(st) for st in stages], **{f"{k}_curve": v for k, v in extra.items()},
        "topk": cfg.dsa_topk if "S" in cfg.layers else None,
    })  # fmt: skip


def _figure(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r["curve"]:
            steps, losses = zip(*r["curve"])
            ax.plot(steps, losses, label=f"{r['variant']} ({r['layers'][:8]})")
    ax.set_xlabel("step (equal tokens per step)")
    ax.set_ylabel("validation loss")
    dsa = any("S" in r["layers"] for r in results)
    ax.set_title(
        "lmforge DSA warm start (after the dense base) vs the dense continuation"
        if dsa
        else "lmforge hybrid layer patterns at equal parameters"
    )
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)


def _table(results: list[dict[str, Any]]) -> str:
    final = {r["variant"]: r["curve"][-1][1] for r in results if r["curve"]}
    rows = ["| variant | layers | params | tokens | final val loss | vs | attn FLOPs |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        last = final.get(r["variant"], math.nan)
        # the DSA warm start against the dense model continued for the same tokens
        peer = r.get("peer") or "full"
        rel = f"{100 * (last / final[peer] - 1):+.2f}% vs {peer}" if peer in final else "-"
        frac = r.get("model_attention_flop_fraction", r.get("attention_flop_fraction"))
        rows.append(
            f"| {r['variant']} | {r['layers'][:8]} | {r['params']:,} | "
            f"{r['tokens'] / 1e6:.2f}M | {last:.4f} | {rel} | "
            f"{'' if frac is None else f'{100 * frac:.1f}% of dense'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        found = {p.name: p for d in args.merge for p in sorted(d.glob("*.json"))}
        _report([json.loads(p.read_text()) for _, p in sorted(found.items())], args.out)
        return 0
    if args.quick:
        _quick(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dev = args.device
    torch.manual_seed(0)
    data = _shards(args)
    names = FAMILIES[args.family]
    chosen = [v for v in args.variants.split(",") if v] or list(names)
    n_runs = len(chosen) if args.family == "hybrids" else 3
    args.budget_min = 0.0 if args.quick else args.minutes / n_runs
    if args.family == "hybrids":
        for name in chosen:
            _pretrain(args, name, names[name], data)
    else:
        _dsa(args, chosen, data)
    _report([json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))], args.out)
    return 0


def _base(args: argparse.Namespace, data: tuple) -> Any:
    """The dense base: read from ``--base`` when that file exists, else trained (and written
    there when ``--base`` is given)."""
    from lmforge.model import TransformerLM
    from lmforge.utils.errors import LmforgeError

    if args.base is not None and args.base.exists():
        cfg = _model_config(args, data[2], "A")
        try:
            saved = torch.load(args.base, map_location="cpu", weights_only=True)
            # the Trainer resolved the "auto" backends: take those, compare the rest
            backends = ("attention", "norm", "rope", "swiglu", "residual_dtype")
            base = json.loads(saved["config"])
            cfg = dataclasses.replace(cfg, **{k: base.pop(k) for k in backends})
            want = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in backends}
            # the indexer's shape (dsa_*) is add_indexer's business, not the dense base's
            base = {k: v for k, v in base.items() if not k.startswith("dsa_")}
            want = {k: v for k, v in want.items() if not k.startswith("dsa_")}
            if json.dumps(base) != json.dumps(want):
                raise ValueError("its model differs from this call's --seq/--d-model/... and data")
            model = TransformerLM(cfg).to(args.device)
            model.load_state_dict(saved["state"])
            result = json.loads(saved["result"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise LmforgeError(f"--base {args.base}: not this call's dense base ({err})") from None
        args.steps = result["steps"]  # the continuations' curves start where the base ended
        _save(args, "full", result)
        return model
    model = _pretrain(args, "full", "A", data)
    if args.base is not None:
        from lmforge.utils.io import atomic_write_bytes

        buf = io.BytesIO()
        result = json.loads((args.out / "full.json").read_text())
        cfg = json.dumps(dataclasses.asdict(model.config))
        torch.save({"config": cfg, "state": model.state_dict(), "result": json.dumps(result)}, buf)
        atomic_write_bytes(args.base, buf.getvalue())
    return model


def _dsa(args: argparse.Namespace, chosen: list[str], data: tuple) -> None:
    """The dense base, then the DSA warm start from it and/or the dense continuation."""
    from lmforge.model.sparse_attention import add_indexer

    dense = _base(args, data)
    low = args.sparse_lr or args.lr / 10  # by default the base run's final learning rate
    tail = f"-s{args.seed}" if args.seed else ""
    if "dsa" in chosen:
        sparse = add_indexer(
            dense, args.topk or max(1, args.seq // 8), index_heads=args.index_heads,
            index_dim=args.index_dim, layers=args.dsa_layers or None, seed=args.seed,
        )  # fmt: skip
        _continue(args, "-".join(["dsa", args.label] if args.label else ["dsa"]) + tail, sparse, [
            (args.warmup_steps, args.index_lr or args.lr, "dense"),
            (args.sparse_steps, low, "sparse"),
        ], data, peer=f"dense-cont{tail}")  # fmt: skip
    if "dense-cont" in chosen:
        _continue(args, f"dense-cont{tail}", dense, [
            (args.warmup_steps + args.sparse_steps, low, None)
        ], data)  # fmt: skip


def _report(results: list[dict[str, Any]], out: Path) -> None:
    """The figure of every curve, then the table, printed last."""
    _figure(results, out / "hybrid_quality.png")
    print(f"figure: {out / 'hybrid_quality.png'}")
    print(_table(results))


if __name__ == "__main__":
    from lmforge.utils.errors import LmforgeError

    try:
        sys.exit(main())
    except LmforgeError as err:
        sys.exit(f"hybrid_quality: {err}")
