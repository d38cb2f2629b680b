"""The bodies of ``lmforge sft | dpo | rl | distill`` (argument parsing and the config tree in
``_cli``): each loads its model and data, builds its objective and runs it in the one
:class:`~lmforge.train.Trainer` (rerunning a command resumes from ``train.out_dir``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from lmforge.model import ModelConfig
from lmforge.posttrain import rl
from lmforge.posttrain.chat import prompt_text
from lmforge.posttrain.core import Example, encode_text
from lmforge.posttrain.distill import DistillObjective, check_vocabularies
from lmforge.posttrain.dpo import (
    DPOObjective,
    RewardModel,
    RewardModelObjective,
    hidden_size,
    steps_per_epoch,
    tokenize_pairs,
)
from lmforge.posttrain.models import clone_frozen, eos_ids, load_model, save_model
from lmforge.posttrain.pipeline import ListPrompts, PipelineConfig, check_inputs, run_pipeline
from lmforge.posttrain.ppo import PolicyWithValue, PPOConfig, PPOObjective
from lmforge.posttrain.rollout import rollout_engine
from lmforge.posttrain.scratchpad import ScratchpadAdditionTask
from lmforge.posttrain.sft import SFTObjective, examples_from_records
from lmforge.posttrain.tasks import (
    ArithmeticTask,
    gsm8k_reward,
    gsm8k_user_message,
    math_reward,
    read_jsonl,
)
from lmforge.train import Trainer
from lmforge.train.metrics import plot_curves, read_metrics
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text, ensure_writable_dir
from lmforge.utils.runtime import Runtime

if TYPE_CHECKING:
    from lmforge.config import RunConfig


def _setup(
    cfg: RunConfig, threads: int | None, data: str = "", default_threads: int | None = None
) -> tuple[Any, Path]:
    """(runtime, output folder), after checking the file at the dotted key ``data``
    (``"sft.data"``) and setting the threads, before any model is read."""
    if data:
        branch, name = data.split(".")
        p = Path(getattr(getattr(cfg, branch), name))
        if p.is_dir() and not (p / "config.toml").is_file() and not (p / "config.json").is_file():
            raise LmforgeError(f"{data} {p} is a directory, expected a file")
        if not p.exists():
            raise LmforgeError(f"{data} not found: {p}")
    n = threads or default_threads
    if n:
        torch.set_num_threads(n)
    dev = cfg.train.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise LmforgeError(f"train.device={dev}: CUDA is not available")
    runtime = Runtime.from_env(device=dev, seed=cfg.train.seed)
    if runtime.is_main:  # a read-only or occupied output folder is one line before loading
        ensure_writable_dir(cfg.train.out_dir, "train.out_dir (--out)")
    return runtime, Path(cfg.train.out_dir)


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _measured_once(f: Path, resumed: bool, write: bool, measure: Callable[[], Any]) -> Any:
    # the starting policy's measurement: taken (and written by rank 0) once, read back on resume
    if resumed and f.is_file():
        return json.loads(f.read_text(encoding="utf-8"))
    value = measure()
    if write:
        f.parent.mkdir(parents=True, exist_ok=True)
        _write_json(f, value)
    return value


def _with_model_config(cfg: RunConfig, model: torch.nn.Module) -> RunConfig:
    # config.toml names the model trained (an import too; not a reward or value-head wrapper)
    mc = getattr(model, "config", None)
    return dataclasses.replace(cfg, model=mc) if isinstance(mc, ModelConfig) else cfg


def _run_trainer(
    cfg: RunConfig, runtime: Any, model: torch.nn.Module, objective: Any
) -> tuple[Trainer, dict[str, Any]]:
    trainer = Trainer(_with_model_config(cfg, model), runtime, model=model, objective=objective)
    return trainer, trainer.run()


def _records(out_dir: Path, event: str = "train") -> list[dict[str, Any]]:
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if r.get("event") == event]


def _load_with_tokenizer(path: str, device: str) -> tuple[Any, Any]:
    model, tok = load_model(path, device)
    if tok is None:
        raise LmforgeError(f"{path} has no tokenizer to encode the data with")
    return model, tok


def _summary(out: Path, summary: dict[str, Any], first_last: bool = False) -> int:
    # summary.json (printed too); first_last: with the first and last train losses
    if first_last:
        hist = _records(out)
        summary["first_loss"] = hist[0]["loss"] if hist else None
        summary["last_loss"] = hist[-1]["loss"] if hist else None
    _write_json(out / "summary.json", summary)
    print(json.dumps(summary))
    return 0


def run_sft(cfg: RunConfig, threads: int | None = None) -> int:
    """``lmforge sft``: the SFT objective on ``cfg.sft``'s model and data."""
    sc, tc = cfg.sft, cfg.train
    runtime, out = _setup(cfg, threads, "sft.data")
    model, tok = _load_with_tokenizer(sc.model, runtime.device)
    eos = eos_ids(tok)
    exs = examples_from_records(read_jsonl(sc.data, "sft.data"), tok, chat=sc.chat,
                                eos_id=eos[0] if eos else None, where=sc.data)  # fmt: skip
    objective = SFTObjective(exs, sc, tc.batch_size, runtime.device, seed=tc.seed)
    trainer, result = _run_trainer(cfg, runtime, model, objective)
    if not trainer.is_main:
        return 0
    save_model(model, tok, out / "model")
    return _summary(out, {"examples": len(exs), "steps": result.get("iteration")}, True)


def run_dpo(cfg: RunConfig, threads: int | None = None) -> int:
    """``lmforge dpo``: DPO/IPO/cDPO/SimPO, or a reward model, on ``cfg.dpo``'s pairs;
    ``train.max_steps`` is ``dpo.epochs`` passes over the training pairs."""
    dc, tc = cfg.dpo, cfg.train
    runtime, out = _setup(cfg, threads, "dpo.data")
    model, tok = _load_with_tokenizer(dc.model, runtime.device)
    recs = read_jsonl(dc.data, "dpo.data")
    if dc.limit:
        recs = recs[: dc.limit]
    if len(recs) < 2:
        raise LmforgeError(f"{dc.data}: need at least 2 preference pairs, found {len(recs)}")
    eos = eos_ids(tok)
    pairs = tokenize_pairs(recs, tok, dc.max_len, eos[0] if eos else None, dc.data)
    n_eval = max(1, int(len(pairs) * dc.eval_fraction)) if dc.eval_fraction > 0 else 0
    train, held = (pairs[:-n_eval], pairs[-n_eval:]) if n_eval else (pairs, [])
    steps = dc.epochs * steps_per_epoch(len(train), tc.batch_size)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(tc, max_steps=steps))
    if dc.reward_model:
        torch.manual_seed(tc.seed)  # the head's initial weights
        rm = RewardModel(model, hidden_size(model)).to(runtime.device)
        objective: Any = RewardModelObjective(train, held, tc.batch_size, seed=tc.seed)
        trained: torch.nn.Module = rm
    else:
        objective = DPOObjective(model, train, held, dc, tc.batch_size, seed=tc.seed,
                                 progress=tc.progress)  # fmt: skip
        trained = model
    trainer = Trainer(_with_model_config(cfg, trained), runtime, model=trained, objective=objective)
    resumed = trainer.iteration > 0
    before = _measured_once(out / "before.json", resumed, trainer.is_main,
                            lambda: None if resumed else objective.evaluate(trainer.model))  # fmt: skip
    trainer.model.train()
    result = trainer.run()
    if not trainer.is_main:
        return 0
    if dc.reward_model:
        save_file({k: v.contiguous() for k, v in rm.head.state_dict().items()},
                  str(out / "reward_head.safetensors"))  # fmt: skip
    save_model(model, tok, out / "model")
    after = {k: v for k, v in result.items() if k.startswith("eval_")}
    return _summary(out, {"loss": "reward_model" if dc.reward_model else dc.loss,
                          "pairs_train": len(train), "pairs_eval": len(held),
                          "steps": result.get("iteration"), "heldout_before": before,
                          "heldout_after": after})  # fmt: skip


def run_distill(cfg: RunConfig, threads: int | None = None) -> int:
    """``lmforge distill``: the distillation objective, on a corpus or on-policy."""
    kc, tc = cfg.distill, cfg.train
    runtime, out = _setup(cfg, threads, "distill.data")
    teacher, _ = load_model(kc.teacher, runtime.device)
    student, tok = _load_with_tokenizer(kc.student, runtime.device)
    check_vocabularies(teacher, student)
    teacher = clone_frozen(teacher)
    recs = read_jsonl(kc.data, "distill.data")
    if kc.on_policy:
        prompts = [encode_text(tok, r.get("prompt") or r.get("text", ""))[-kc.max_len :]
                   for r in recs]  # fmt: skip
        objective = DistillObjective(teacher, kc, tc.batch_size, prompts=[p for p in prompts if p],
                                     eos_ids=eos_ids(tok), seed=tc.seed)  # fmt: skip
    else:
        texts = [encode_text(tok, r["text"])[: kc.max_len + 1] for r in recs if "text" in r]
        corpus = [Example(ids, [True] * len(ids)) for ids in texts]
        corpus += examples_from_records([r for r in recs if "text" not in r], tok)
        objective = DistillObjective(teacher, kc, tc.batch_size, corpus=corpus, seed=tc.seed)
    trainer, _ = _run_trainer(cfg, runtime, student, objective)
    if not trainer.is_main:
        return 0
    save_model(student, tok, out / "model")
    return _summary(out, {}, True)


_TOY_TASKS = ("arithmetic", "scratchpad")  # a tiny model warm-started here, char tokenizer


def arithmetic_start(cfg: RunConfig, runtime: Any) -> tuple[Any, Any, Any]:
    """(task, tokenizer, model): ``rl.model`` when given, else a tiny model warm-started here
    (:func:`~lmforge.posttrain.rl.warm_start` in ``OUT/warm_start``)."""
    rc, tc = cfg.rl, cfg.train
    cls = ScratchpadAdditionTask if rc.task == "scratchpad" else ArithmeticTask
    task = cls(digits=rc.digits)
    tok = task.tokenizer()
    if rc.model:
        model, _ = load_model(rc.model, runtime.device)
        if model.config.vocab_size != tok.vocab_size:
            raise LmforgeError(f"{rc.model}: vocabulary {model.config.vocab_size} is not the "
                               f"arithmetic task's ({tok.vocab_size})")  # fmt: skip
        return task, tok, model
    # room for the prompt (two operands, '+', '=') and the answer with its EOS, in 16s
    ctx = 16 * ((3 * rc.digits + 3 + task.answer_tokens) // 16 + 1)
    model = rl.arithmetic_model(tok.vocab_size, seed=tc.seed, context_length=max(32, ctx))
    model = model.to(runtime.device)
    if rc.warmup_steps:
        rl.warm_start(model, task, rc.warmup_steps, str(Path(tc.out_dir) / "warm_start"),
                      seed=tc.seed, device=runtime.device, progress=tc.progress)  # fmt: skip
    model.eval()
    return task, tok, model


def run_rl(cfg: RunConfig, threads: int | None = None) -> int:
    """``lmforge rl``: the GRPO family, PPO (:class:`~lmforge.posttrain.ppo.PPOObjective`) or
    Pipeline RL (:func:`~lmforge.posttrain.pipeline.run_pipeline`) as Trainer objectives, rollouts
    on the serving engine; ``train.max_steps`` = ``rl.iterations`` × ``rl.epochs``."""
    rc, tc = cfg.rl, cfg.train
    toy = rc.task in _TOY_TASKS
    runtime, out = _setup(cfg, threads, "rl.data" if rc.data else "", 1 if toy else None)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tc.seed)
    if toy:
        task, tok, model = arithmetic_start(cfg, runtime)
        reward_fn = task.reward
        answer_tokens = rc.max_tokens or task.answer_tokens
        eval_items = task.eval_set(rc.eval_size)
        draw = task.sample
    else:
        task, tok, model, reward_fn, items, eval_items = _math_task(cfg, runtime.device)
        answer_tokens = rc.max_tokens or 256

        def draw(n: int, rng: random.Random) -> list[dict[str, Any]]:
            if n > len(items):
                raise LmforgeError(f"{n} prompts per step from {len(items)} problems")
            return [items[i] for i in rng.sample(range(len(items)), n)]

    max_tokens, overlong_cache = answer_tokens, 0
    if rc.algo != "ppo":
        max_tokens, overlong_cache = rl.overlong_budget(answer_tokens, rl.algorithm(rc.algo))
    eos = eos_ids(tok)
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(tc, max_steps=rc.iterations * rc.epochs)
    )
    if rc.pipeline:
        return _pipeline(cfg, task, tok, model, reward_fn, None if toy else items, eval_items,
                         max_tokens, overlong_cache, eos)  # fmt: skip
    engine = rollout_engine(model, eos, seed=tc.seed)
    trained: torch.nn.Module = model
    if rc.algo == "ppo":
        trained = PolicyWithValue(model, hidden_size(model)).to(runtime.device)
        pcfg = PPOConfig(max_tokens=max_tokens, kl_coef=rc.kl_coef, temperature=rc.temperature,
                         epochs=rc.epochs, samples_per_prompt=rc.group_size)  # fmt: skip
        objective: Any = PPOObjective(trained, engine, tok, draw, reward_fn, pcfg,  # type: ignore[arg-type]
                                      prompts_per_step=rc.prompts_per_step, eos_ids=eos,
                                      eval_items=eval_items, seed=tc.seed + 1,
                                      target=rc.target)  # fmt: skip
    else:
        ref = clone_frozen(model) if rc.kl_coef > 0 else None
        objective = rl.GRPOObjective(
            engine, tok, draw, reward_fn, rc.algo, prompts_per_step=rc.prompts_per_step,
            group_size=rc.group_size, epochs=rc.epochs, micro_batch=tc.batch_size,
            max_tokens=max_tokens, temperature=rc.temperature, kl_coef=rc.kl_coef, std=rc.std,
            overlong_cache=overlong_cache, eos_ids=eos, eval_items=eval_items, ref_model=ref,
            seed=tc.seed + 1, target=rc.target,
        )  # fmt: skip
    t_start = time.perf_counter()
    trainer = Trainer(_with_model_config(cfg, trained), runtime, model=trained, objective=objective)
    # The starting policy's accuracy, kept beside the run for resumed attempts.
    got = _measured_once(out / "accuracy_before.json", trainer.iteration > 0, trainer.is_main,
                         lambda: objective.evaluate(trainer.model))  # fmt: skip
    objective.should_stop = False  # a starting policy already at the target still trains
    a0 = float(got.get("eval_accuracy", float("nan")))
    result = trainer.run()
    if not trainer.is_main:
        return 0
    return _rl_outputs(cfg, out, model, None if toy else tok, a0, objective.samples_seen,
                       result, time.perf_counter() - t_start)  # fmt: skip


def _rl_outputs(cfg: RunConfig, out: Path, model: torch.nn.Module, tok: Any, a0: float,
                samples: int, result: dict[str, Any], wall: float,
                extra: dict[str, Any] | None = None) -> int:  # fmt: skip
    """curve.png, model/, summary.json of an RL run (printed too)."""
    rc = cfg.rl
    evals = [(r["step"], r["eval_accuracy"]) for r in _records(out, "eval") if "eval_accuracy" in r]
    final = evals[-1][1] if evals else a0
    per = rc.prompts_per_step * rc.group_size / rc.epochs  # samples per optimizer step
    curve = [(0.0, a0)] + [(step * per, acc) for step, acc in evals]
    name = rc.algo + (" (pipeline)" if rc.pipeline else "")
    plot_curves(out / "curve.png", {name: curve}, "rollout samples",
                "held-out greedy accuracy", f"lmforge rl --task {rc.task}")  # fmt: skip
    save_model(model, tok, out / "model")
    summary = {"task": rc.task, "algo": rc.algo, "pipeline": rc.pipeline, "accuracy_before": a0,
               "accuracy_after": final, "iterations": -(-int(result["iteration"]) // rc.epochs),
               "samples": samples, "wall_s": round(wall, 1), "stopped": result.get("stopped"),
               **(extra or {})}  # fmt: skip
    return _summary(out, summary)


def _pipeline(cfg: RunConfig, task: Any, tok: Any, model: Any, reward_fn: Any,
              items: list[dict[str, Any]] | None, eval_items: Any, max_tokens: int,
              overlong_cache: int, eos: list[int]) -> int:  # fmt: skip
    """``lmforge rl --pipeline``: an engine process and :class:`PipelineObjective` in the
    Trainer (:func:`~lmforge.posttrain.pipeline.run_pipeline`)."""
    rc, tc = cfg.rl, cfg.train
    out = Path(tc.out_dir)
    pcfg = PipelineConfig.from_run(cfg, task=task, max_tokens=max_tokens,
                                   overlong_cache=overlong_cache)  # fmt: skip
    prompts = check_inputs(model, pcfg, None if items is None else ListPrompts(items, tc.seed),
                           tok)  # fmt: skip
    eval_engine = rollout_engine(model, eos, seed=tc.seed)

    def evaluate() -> float:
        return rl.evaluate_accuracy(eval_engine, tok, eval_items, reward_fn, max_tokens,
                                    eos_ids=eos)  # fmt: skip

    t_start = time.perf_counter()
    a0 = _measured_once(out / "accuracy_before.json", (out / "checkpoints").is_dir(), True,
                        lambda: {"eval_accuracy": evaluate()})["eval_accuracy"]  # fmt: skip
    ref = clone_frozen(model) if rc.kl_coef > 0 else None
    hist = run_pipeline(model, pcfg, progress=tc.progress, reward_fn=reward_fn, prompts=prompts,
                        tokenizer=tok, eos_ids=eos, eval_fn=evaluate, ref_model=ref,
                        run_config=_with_model_config(cfg, model))  # fmt: skip
    trains = _records(out)  # every attempt's (a resumed run's history holds only its own)
    result = {"iteration": trains[-1]["step"] if trains else 0, "stopped": None}
    extra = {"staleness_histogram": hist[-1].get("staleness_histogram")} if hist else {}
    return _rl_outputs(cfg, out, model, None if items is None else tok, a0,  # toy: no tokenizer
                       trains[-1].get("samples", 0) if trains else 0, result,
                       time.perf_counter() - t_start, extra)  # fmt: skip


def math_items(task: str, tok: Any, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GSM8K (``task="gsm8k"``) or MATH records as ``lmforge rl`` samples them: each with the
    chat-templated ``prompt`` of its problem (a record without problem or answer: one line)."""
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


def _math_task(cfg: RunConfig, device: str) -> tuple[Any, ...]:
    rc = cfg.rl
    if not rc.model:
        raise LmforgeError(f"rl.task {rc.task} needs rl.model (--model: an SFT'd policy)")
    model, tok = _load_with_tokenizer(rc.model, device)

    # ../shared beside the checkout, as the tests look for it (LMFORGE_SHARED_DATA overrides)
    shared = os.environ.get("LMFORGE_SHARED_DATA")
    root = (
        Path(shared) if shared else Path(__file__).resolve().parents[4] / "shared" / "data"
    ) / "eval"
    gsm8k = rc.task == "gsm8k"
    folder = root / "gsm8k" if gsm8k else root / "math" / "math"
    reward = gsm8k_reward if gsm8k else math_reward
    train_p = Path(rc.data) if rc.data else folder / "train.jsonl"
    test_p = Path(rc.eval_data) if rc.eval_data else folder / "test.jsonl"
    train = read_jsonl(train_p, "rl.data")
    test = (
        read_jsonl(test_p, "rl.eval_data")
        if test_p.is_file() or rc.eval_data
        else train[-rc.eval_size :]
    )
    items = math_items(rc.task, tok, train)
    return (None, tok, model, reward, items,
            math_items(rc.task, tok, test[: rc.eval_size]))  # fmt: skip
