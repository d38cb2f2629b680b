"""The bodies of ``lmforge sft | dpo | rl | distill`` (argument parsing lives in ``_cli``)."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write, atomic_write_text


def _out(args: argparse.Namespace, default: str, threads: int | None = None) -> Path:
    n = args.threads if getattr(args, "threads", None) else threads
    if n:
        torch.set_num_threads(n)
    out = Path(args.out or f"runs/{default}")
    out.mkdir(parents=True, exist_ok=True)
    options = getattr(args, "posttrain_options", None)
    if options is not None:
        # the resolved options: `--config OUT/config.toml` repeats the run
        atomic_write_text(out / "config.toml", options_toml(args.posttrain_command, options))
    return out


def options_toml(command: str, options: dict[str, Any]) -> str:
    """``options`` as a ``[command]`` TOML table (unset options omitted: TOML has no null)."""
    lines = [f"[{command}]"]
    for k, v in options.items():
        if v is None:
            continue
        text = ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)
        lines.append(f"{k} = {text}")
    return "\n".join(lines) + "\n"


def _device(name: str) -> str:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise LmforgeError(f"--device {name}: CUDA is not available")
    return name


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _jsonl_logger(path: Path):
    path.write_text("", encoding="utf-8")

    def log(rec: dict[str, Any]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    return log


def plot_curves(path: Path, series: dict[str, list[tuple[float, float]]], xlabel: str,
                ylabel: str, title: str) -> None:  # fmt: skip
    """A PNG of one or more (x, y) curves (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in series.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(path) as out:  # temp name, fsync, rename
        fig.savefig(out, format="png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def run_sft(args: argparse.Namespace) -> int:
    from lmforge.posttrain.models import eos_ids, load_model, save_model
    from lmforge.posttrain.sft import SFTConfig, examples_from_records, train_sft
    from lmforge.posttrain.tasks import read_jsonl

    out = _out(args, "sft")
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, _device(args.device))
    if tok is None:
        raise LmforgeError(f"{args.model} has no tokenizer to encode the data with")
    eos = eos_ids(tok)
    exs = examples_from_records(read_jsonl(args.data, "--data"), tok, chat=not args.no_chat,
                                eos_id=eos[0] if eos else None, where=str(args.data))  # fmt: skip
    cfg = SFTConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batch=args.micro_batch,
        lr=args.lr,
        max_len=args.max_len,
        packing=not args.no_packing,
        seed=args.seed,
    )
    log = out / "metrics.jsonl"
    log.write_text("", encoding="utf-8")
    hist = train_sft(model, exs, cfg, pad_id=0, log_path=log, progress=not args.quiet)
    save_model(model, tok, out / "model")
    summary = {"examples": len(exs), "first_loss": hist[0]["loss"], "last_loss": hist[-1]["loss"]}
    _write_json(out / "summary.json", summary)
    print(json.dumps(summary))
    return 0


def _preference_pairs(args: argparse.Namespace, tok: Any) -> tuple[list, list]:
    from lmforge.posttrain.dpo import tokenize_pairs
    from lmforge.posttrain.models import eos_ids
    from lmforge.posttrain.tasks import read_jsonl

    recs = read_jsonl(args.data, "--data")
    if args.limit:
        recs = recs[: args.limit]
    if len(recs) < 2:
        raise LmforgeError(f"{args.data}: need at least 2 preference pairs, found {len(recs)}")
    eos = eos_ids(tok)
    pairs = tokenize_pairs(recs, tok, args.max_len, eos[0] if eos else None, str(args.data))
    n_eval = max(1, int(len(pairs) * args.eval_fraction))
    return pairs[:-n_eval], pairs[-n_eval:]


def run_dpo(args: argparse.Namespace) -> int:
    from lmforge.posttrain.dpo import (
        DPOConfig,
        RewardModel,
        hidden_size,
        train_dpo,
        train_reward_model,
    )
    from lmforge.posttrain.models import load_model, save_model

    out = _out(args, "dpo")
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, _device(args.device))
    if tok is None:
        raise LmforgeError(f"{args.model} has no tokenizer to encode the data with")
    train, held = _preference_pairs(args, tok)
    if args.reward_model:
        rm = RewardModel(model, hidden_size(model)).to(next(model.parameters()).device)
        res = train_reward_model(rm, train, held, lr=args.lr, epochs=args.epochs,
                                 batch_size=args.batch_size, seed=args.seed,
                                 progress=not args.quiet)  # fmt: skip
        torch.save({"head": rm.head.state_dict()}, out / "reward_head.pt")
        save_model(model, tok, out / "model")
        summary = {
            "pairs_train": len(train),
            "pairs_eval": len(held),
            "heldout_accuracy_before": res["before"],
            "heldout_accuracy_after": res["after"],
        }
    else:
        cfg = DPOConfig(loss=args.loss, beta=args.beta, label_smoothing=args.label_smoothing,
                        lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
                        max_len=args.max_len, seed=args.seed)  # fmt: skip
        log = out / "metrics.jsonl"
        log.write_text("", encoding="utf-8")
        res = train_dpo(model, train, held, cfg, pad_id=0, log_path=log, progress=not args.quiet)
        save_model(model, tok, out / "model")
        summary = {"loss": args.loss, "pairs_train": len(train), "pairs_eval": len(held),
                   "heldout_before": res["before"], "heldout_after": res["after"]}  # fmt: skip
    _write_json(out / "summary.json", summary)
    print(json.dumps(summary))
    return 0


def run_distill(args: argparse.Namespace) -> int:
    from lmforge.posttrain.core import Example, encode_text
    from lmforge.posttrain.distill import DistillConfig, train_distill
    from lmforge.posttrain.models import eos_ids, load_model, save_model
    from lmforge.posttrain.sft import examples_from_records
    from lmforge.posttrain.tasks import read_jsonl

    out = _out(args, "distill")
    dev = _device(args.device)
    teacher, _ = load_model(args.teacher, dev)
    student, tok = load_model(args.student, dev)
    if tok is None:
        raise LmforgeError(f"{args.student} has no tokenizer to encode the data with")
    recs = read_jsonl(args.data, "--data")
    cfg = DistillConfig(
        loss=args.loss,
        temperature=args.temperature,
        beta=args.beta,
        lr=args.lr,
        steps=args.steps,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
    )
    if args.on_policy:
        prompts = [
            encode_text(tok, r.get("prompt") or r.get("text", ""))[-args.max_len :] for r in recs
        ]
        prompts = [p for p in prompts if p]
        rng = random.Random(args.seed)
        hist = train_distill(student, teacher, cfg, prompts=lambda n: rng.sample(prompts, min(n, len(prompts))),
                             eos_ids=eos_ids(tok), progress=not args.quiet)  # fmt: skip
    else:
        text = [r for r in recs if "text" in r]
        corpus = [Example(encode_text(tok, r["text"])[: args.max_len + 1], [True] * len(encode_text(tok, r["text"])[: args.max_len + 1]))
                  for r in text] + examples_from_records([r for r in recs if "text" not in r], tok)  # fmt: skip
        hist = train_distill(student, teacher, cfg, corpus=corpus, progress=not args.quiet)
    save_model(student, tok, out / "model")
    log = _jsonl_logger(out / "metrics.jsonl")
    for h in hist:
        log(h)
    summary = {"first_loss": hist[0]["loss"], "last_loss": hist[-1]["loss"]}
    _write_json(out / "summary.json", summary)
    print(json.dumps(summary))
    return 0


# ---------------------------------------------------------------------------------------------


_TOY_TASKS = ("arithmetic", "scratchpad")  # a tiny model warm-started here, char tokenizer


def arithmetic_start(args: argparse.Namespace, out: Path) -> tuple[Any, Any, Any]:
    """(task, tokenizer, model): ``--model`` when given, else a tiny model warm-started here on
    the task's carry-dropping mixture (saved to ``out/warm_start``)."""
    from lmforge.posttrain import rl
    from lmforge.posttrain.models import load_model, save_model
    from lmforge.posttrain.scratchpad import ScratchpadAdditionTask
    from lmforge.posttrain.tasks import ArithmeticTask

    cls = ScratchpadAdditionTask if args.task == "scratchpad" else ArithmeticTask
    task = cls(digits=args.digits)
    tok = task.tokenizer()
    if args.model:
        model, _ = load_model(args.model, args.device)
        if model.config.vocab_size != tok.vocab_size:
            raise LmforgeError(f"{args.model}: vocabulary {model.config.vocab_size} is not the "
                               f"arithmetic task's ({tok.vocab_size})")  # fmt: skip
        return task, tok, model
    from tqdm import tqdm

    # room for the prompt (two operands, '+', '=') and the answer with its EOS, in 16s
    ctx = 16 * ((3 * args.digits + 3 + task.answer_tokens) // 16 + 1)
    model = rl.arithmetic_model(tok.vocab_size, seed=args.seed, context_length=max(32, ctx))
    model = model.to(args.device)
    wr = random.Random(args.seed + 5)
    with tqdm(total=args.warmup_steps, desc="warm start", disable=args.quiet) as bar:
        rl.supervised_warmup(model, tok, rl.random_sampler(task, args.seed), args.warmup_steps,
                             64, 3e-3, tok.eos_id, progress=bar,
                             answer_fn=lambda it: task.warmup_answer(it, wr))  # fmt: skip
    model.eval()
    save_model(model, None, out / "warm_start")
    return task, tok, model


def run_rl(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lmforge.posttrain import rl
    from lmforge.posttrain.core import is_lmforge_model
    from lmforge.posttrain.rollout import LocalEngine, make_engine

    if args.algo != "ppo":
        rl.algorithm(args.algo)  # an unknown name fails before any work
    elif args.pipeline:
        raise LmforgeError("--pipeline runs the GRPO family (--algo grpo, dapo, ...), not ppo")
    toy = args.task in _TOY_TASKS
    out = _out(args, f"rl-{args.task}", threads=1 if toy else None)
    dev = _device(args.device)
    args.device = dev
    torch.manual_seed(args.seed)
    if toy:
        task, tok, model = arithmetic_start(args, out)
        reward_fn = task.reward
        answer_tokens = args.max_tokens or task.answer_tokens
        eval_items = task.eval_set(args.eval_size)
        sample_items = rl.random_sampler(task, args.seed + 1)
    else:
        task, tok, model, reward_fn, sample_items, eval_items = _math_task(args)
        answer_tokens = args.max_tokens or 256
    from lmforge.posttrain.models import clone_frozen, eos_ids, save_model

    overlong_cache = 0
    max_tokens = answer_tokens
    if args.algo != "ppo":
        max_tokens, overlong_cache = rl.overlong_budget(answer_tokens, rl.algorithm(args.algo))

    eos = eos_ids(tok)
    # the arithmetic task's tiny model stays on the lockstep LocalEngine (its RESULTS figures);
    # lmforge models of real tasks sample through the batched serve engine when it is there
    choice = args.rollout_engine
    serve = choice == "serve" or (choice == "auto" and not toy and is_lmforge_model(model))
    if serve and not is_lmforge_model(model):
        raise LmforgeError("--rollout-engine serve needs an lmforge model (or a GGUF/HF import)")
    if args.pipeline:
        from lmforge.posttrain.pipeline import PipelineConfig, check_inputs

        pcfg = PipelineConfig(algo=args.algo, iterations=args.iterations,
                              prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                              lr=args.lr, max_tokens=max_tokens, temperature=args.temperature,
                              max_lag=args.max_lag, digits=args.digits, seed=args.seed,
                              eval_every=args.eval_every, eval_size=args.eval_size,
                              target=args.target, overlong_cache=overlong_cache, task=task,
                              queue_size=args.queue_size, engine="serve" if serve else "local",
                              engine_threads=args.engine_threads, micro_batch=args.micro_batch,
                              kl_coef=args.kl_coef, epochs=max(args.epochs, 1),
                              transport=args.weight_transport)  # fmt: skip
        # a mistake (not an lmforge model, too few problems, too long prompts) is one line now,
        # not after the first evaluation; toy tasks (None): run_pipeline draws the task's prompts
        prompts = check_inputs(model, pcfg, None if toy else sample_items, tok)
    engine = make_engine(model, eos, prefer="serve") if serve else LocalEngine(model, eos_ids=eos)
    t_start = time.perf_counter()

    def evaluate() -> float:
        return rl.evaluate_accuracy(engine, tok, eval_items, reward_fn, max_tokens)

    model.eval()
    a0 = evaluate()
    log = _jsonl_logger(out / "metrics.jsonl")
    log({"iteration": 0, "samples": 0, "time_s": 0.0, "eval_accuracy": a0})
    if args.algo == "ppo":
        from lmforge.posttrain.ppo import PPOConfig, run_ppo

        with tqdm(total=args.iterations, desc="ppo", disable=args.quiet) as bar:
            hist = run_ppo(model, engine, tok, sample_items, reward_fn,
                           PPOConfig(max_tokens=max_tokens, kl_coef=args.kl_coef, lr=args.lr,
                                     temperature=args.temperature, epochs=max(args.epochs, 1)),
                           iterations=args.iterations, prompts_per_step=args.prompts_per_step,
                           eval_fn=evaluate, eval_every=args.eval_every, target=args.target,
                           log=log, progress=bar)  # fmt: skip
    elif args.pipeline:
        from lmforge.posttrain.pipeline import run_pipeline

        ref = clone_frozen(model) if args.kl_coef > 0 else None
        # toy tasks (prompts None): the task's own prompts and held-out set, evaluated on a
        # LocalEngine (its RESULTS figures); the others: the synchronous run's prompt stream
        hist = run_pipeline(model, pcfg, log=log, progress=not args.quiet, reward_fn=reward_fn,
                            prompts=prompts, tokenizer=tok, eos_ids=eos,
                            eval_fn=None if toy else evaluate, ref_model=ref)  # fmt: skip
    else:
        step_cfg = rl.StepConfig(
            rl.algorithm(args.algo),
            kl_coef=args.kl_coef,
            max_tokens=max_tokens,
            temperature=args.temperature,
            micro_batch=args.micro_batch,
        )
        ref = clone_frozen(model) if args.kl_coef > 0 else None
        with tqdm(total=args.iterations, desc=args.algo, disable=args.quiet) as bar:
            hist = rl.run_iterations(model, engine, tok, sample_items, reward_fn, step_cfg,
                                     iterations=args.iterations,
                                     prompts_per_step=args.prompts_per_step,
                                     group_size=args.group_size, lr=args.lr, epochs=args.epochs,
                                     eval_fn=evaluate, eval_every=args.eval_every,
                                     target=args.target,
                                     overlong_cache=overlong_cache,
                                     ref_model=ref, log=log, progress=bar)  # fmt: skip
    model.eval()
    final = hist[-1].get("eval_accuracy") if hist and "eval_accuracy" in hist[-1] else evaluate()
    wall = time.perf_counter() - t_start
    curve = [(0.0, a0)] + [(h["samples"], h["eval_accuracy"]) for h in hist if "eval_accuracy" in h]
    plot_curves(
        out / "curve.png",
        {args.algo + (" (pipeline)" if args.pipeline else ""): curve},
        "rollout samples",
        "held-out greedy accuracy",
        f"lmforge rl --task {args.task}",
    )
    save_model(model, None if toy else tok, out / "model")
    summary = {"task": args.task, "algo": args.algo, "pipeline": bool(args.pipeline),
               "accuracy_before": a0, "accuracy_after": final, "iterations": len(hist),
               "samples": hist[-1]["samples"] if hist else 0, "wall_s": round(wall, 1),
               "rl_time_s": round(hist[-1]["time_s"], 1) if hist else 0.0}  # fmt: skip
    if args.pipeline and hist:
        summary["staleness_histogram"] = hist[-1].get("staleness_histogram")
    _write_json(out / "summary.json", summary)
    print(json.dumps(summary))
    return 0


def math_items(task: str, tok: Any, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GSM8K (``task="gsm8k"``) or MATH records as ``lmforge rl`` samples them: each with the
    chat-templated ``prompt`` of its problem (a record without problem or answer: one line)."""
    from lmforge.posttrain.chat import prompt_text
    from lmforge.posttrain.tasks import gsm8k_user_message

    key = "question" if task == "gsm8k" else "problem"
    items = []
    for rec in records:
        if key not in rec or "answer" not in rec:
            raise LmforgeError(f"{task} record lacks '{key}' or 'answer'")
        if task == "gsm8k":
            user = gsm8k_user_message(rec[key])
        else:
            user = rec[key] + " Put the final answer in \\boxed{}."
        items.append({**rec, "prompt": prompt_text(tok, user, chat=True)})
    return items


def _math_task(args: argparse.Namespace) -> tuple[Any, ...]:
    from lmforge.posttrain.models import load_model
    from lmforge.posttrain.tasks import gsm8k_reward, math_reward, read_jsonl

    if not args.model:
        raise LmforgeError(f"--task {args.task} needs --model (an SFT'd policy)")
    model, tok = load_model(args.model, args.device)
    if tok is None:
        raise LmforgeError(f"{args.model} has no tokenizer")
    import os

    # ../shared beside the checkout, as the tests look for it (LMFORGE_SHARED_DATA overrides)
    shared = os.environ.get("LMFORGE_SHARED_DATA")
    root = (
        Path(shared) if shared else Path(__file__).resolve().parents[4] / "shared" / "data"
    ) / "eval"
    if args.task == "gsm8k":
        train_p = Path(args.data) if args.data else root / "gsm8k" / "train.jsonl"
        test_p = root / "gsm8k" / "test.jsonl"
        reward = gsm8k_reward
    else:
        train_p = Path(args.data) if args.data else root / "math" / "math" / "train.jsonl"
        test_p = root / "math" / "math" / "test.jsonl"
        reward = math_reward
    if args.eval_data:
        test_p = Path(args.eval_data)
    train = read_jsonl(train_p, "--data")
    test = (
        read_jsonl(test_p, "--eval-data")
        if test_p.is_file() or args.eval_data
        else train[-args.eval_size :]
    )
    from lmforge.posttrain.pipeline import ListPrompts

    # random.Random(seed).sample(items, n) per call, picklable: --pipeline's engine draws it too
    items = ListPrompts(math_items(args.task, tok, train), args.seed)
    return (None, tok, model, reward, items,
            math_items(args.task, tok, test[: args.eval_size]))  # fmt: skip
