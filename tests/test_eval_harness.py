"""lm-evaluation-harness adapter: the LM interface against lmforge's own scoring, and a locally
defined harness task run through ``lm_eval.simple_evaluate``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import optional_import

lm_eval = optional_import("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from lmforge.eval import evaluate_multiple_choice, perplexity  # noqa: E402
from lmforge.eval.harness import LmforgeLM  # noqa: E402
from lmforge.generate import generate  # noqa: E402
from lmforge.model import ModelConfig, TransformerLM  # noqa: E402
from lmforge.tokenizer import Tokenizer  # noqa: E402

ROWS = [
    {"question": f"{i} plus one is", "choices": [f" {i + 1}", f" {i + 5}"], "label": i % 2}
    for i in range(6)
]


def _tiny() -> tuple[TransformerLM, Tokenizer]:
    torch.manual_seed(0)
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=2, n_heads=2
    )
    return TransformerLM(cfg).eval(), tok


def _inst(request_type: str, args: tuple, idx: int = 0) -> Instance:
    return Instance(request_type=request_type, doc={}, arguments=args, idx=idx)


def test_lm_interface_matches_lmforge_scoring() -> None:
    model, tok = _tiny()
    lm = LmforgeLM(model=model, tokenizer=tok, batch_size=2)
    reqs = [
        _inst("loglikelihood", (r["question"], c), i)
        for i, r in enumerate(ROWS)
        for c in r["choices"]
    ]
    lls = lm.loglikelihood(reqs)
    mc = evaluate_multiple_choice(
        model, tok, [(r["question"], r["choices"], r["label"]) for r in ROWS]
    )
    picks = [int(lls[2 * i + 1][0] > lls[2 * i][0]) for i in range(len(ROWS))]
    assert sum(p == r["label"] for p, r in zip(picks, ROWS)) / len(ROWS) == pytest.approx(mc["acc"])
    text = "a document longer than the context window of thirty-two tokens, scored in windows"
    (rolling,) = lm.loglikelihood_rolling([_inst("loglikelihood_rolling", (text,))])
    assert -rolling == pytest.approx(perplexity(model, tok, [text]).nll, rel=1e-6)
    prompts = ["1 plus one is", "a much longer prompt: 2 plus one is", "3"]
    gen_kwargs = {"until": ["\n", "x"], "max_gen_toks": 6}
    gens = lm.generate_until([_inst("generate_until", (p, gen_kwargs)) for p in prompts])
    for prompt, text in zip(prompts, gens):  # batched == one at a time, cut at "until"
        ids = [tok.eot_id, *tok.encode(prompt)][-(32 - 6) :]  # the adapter keeps the right end
        (alone,) = generate(model, [ids], 6, temperature=0.0, stop_tokens=[tok.eot_id])
        expected = tok.decode(alone)
        cuts = [k for k in (expected.find("\n"), expected.find("x")) if k >= 0]
        assert text == expected[: min(cuts, default=len(expected))]


def _task_yaml(d: Path) -> None:
    data = d / "toy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    )
    (d / "toy_mc.yaml").write_text(
        "task: toy_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    (d / "toy_ppl.yaml").write_text(
        "task: toy_ppl\n" + common + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{question}}"\nmetric_list:\n  - metric: bits_per_byte\n'
    )


def test_simple_evaluate_on_a_local_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _task_yaml(tmp_path)
    model, tok = _tiny()
    out = lm_eval.simple_evaluate(
        model=LmforgeLM(model=model, tokenizer=tok),
        tasks=["toy_mc", "toy_ppl"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
    )
    results = out["results"]
    mc = evaluate_multiple_choice(
        model, tok, [(r["question"], r["choices"], r["label"]) for r in ROWS]
    )
    assert results["toy_mc"]["acc,none"] == pytest.approx(mc["acc"])
    assert out["config"]["model_num_parameters"] == model.num_parameters()
    texts = [r["question"] for r in ROWS]
    # the harness's bits_per_byte = total NLL / (ln 2 · total bytes), like lmforge's
    expected = perplexity(model, tok, texts).bits_per_byte
    assert results["toy_ppl"]["bits_per_byte,none"] == pytest.approx(expected, rel=1e-6)
    assert math.isfinite(expected)


@pytest.mark.slow
def test_command_line_with_a_checkpoint(tmp_path: Path) -> None:
    from lmforge.config import RunConfig
    from lmforge.train import save_checkpoint

    _task_yaml(tmp_path)
    model, tok = _tiny()
    ckpt = save_checkpoint(
        tmp_path / "ckpt",
        model,
        None,
        0,
        config=RunConfig(model=model.config),
        tokenizer_dir=tok.save(tmp_path / "tok"),
    )
    cmd = [
        sys.executable,
        "-m",
        "lmforge.eval.harness",
        "--model",
        "lmforge",
        "--model_args",
        f"checkpoint={ckpt}",
        "--device",
        "cpu",
        "--tasks",
        "toy_mc",
        "--include_path",
        str(tmp_path),
        "--output_path",
        str(tmp_path / "out"),
    ]
    env = {
        "HF_DATASETS_CACHE": str(tmp_path / "cache"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "toy_mc" in proc.stdout and "acc" in proc.stdout
