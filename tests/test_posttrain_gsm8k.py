"""GSM8K evidence (issue 23 item 2): SFT targets the checker can read, and a smoke run of
``benchmarks/posttrain_gsm8k.py`` (before → SFT → GRPO, resumable) on a tiny random model."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmforge.posttrain.tasks import gsm8k_reward, gsm8k_sft_response, read_jsonl
from lmforge.utils.errors import LmforgeError

REPO = Path(__file__).resolve().parents[1]
TRAIN = Path("/work/shared/data/eval/gsm8k/train.jsonl")


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_sft_response_drops_calculator_marks_and_keeps_the_answer() -> None:
    ans = "She has 48/2 = <<48/2=24>>24 clips.\n\nIn all 48+24 = <<48+24=72>>72.\n#### 72"
    assert gsm8k_sft_response(ans) == "She has 48/2 = 24 clips.\nIn all 48+24 = 72.\n#### 72"
    assert gsm8k_reward({"answer": ans}, gsm8k_sft_response(ans)).answer == 1.0
    assert gsm8k_sft_response("#### 1,000") == "#### 1,000"
    with pytest.raises(LmforgeError, match="####"):
        gsm8k_sft_response("no final line")


@pytest.mark.skipif(not TRAIN.is_file(), reason="shared GSM8K train split not present")
def test_every_train_answer_stays_parseable_by_the_eval_checker() -> None:
    recs = read_jsonl(TRAIN)
    assert len(recs) == 7473
    wrong = [r for r in recs if gsm8k_reward(r, gsm8k_sft_response(r["answer"])).answer != 1.0]
    assert not wrong, wrong[:1]
    assert not any("<<" in gsm8k_sft_response(r["answer"]) for r in recs[:500])


def _bench():
    spec = importlib.util.spec_from_file_location(
        "posttrain_gsm8k", REPO / "benchmarks" / "posttrain_gsm8k.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tiny_model(folder: Path) -> Path:
    """A random 1-layer lmforge model with a byte-level tokenizer (ChatML specials), saved."""
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.posttrain.models import save_model
    from lmforge.tokenizer import Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {i: bytes([i]) for i in range(256)}
    vocab.update({256 + k: s.encode() for k, s in enumerate(specials)})
    tok = Tokenizer(vocab, [], specials)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=259, context_length=1024, d_model=32, n_layers=1, n_heads=2)
    return save_model(TransformerLM(cfg).eval(), tok, folder)


def _gsm8k_files(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, n in (("train.jsonl", 16), ("test.jsonl", 6)):
        rows = [
            {"question": f"Tom has {a} apples and buys {a + 1}. How many?",
             "answer": f"{a} + {a + 1} = <<{a}+{a + 1}={2 * a + 1}>>{2 * a + 1}\n#### {2 * a + 1}"}
            for a in range(n)
        ]  # fmt: skip
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_benchmark_smoke_runs_all_stages_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _bench()
    model = _tiny_model(tmp_path / "tiny")
    data = _gsm8k_files(tmp_path / "gsm8k")
    out, fig = tmp_path / "out", tmp_path / "fig.png"
    argv = ["--model", str(model), "--data-dir", str(data), "--out", str(out),
            "--figure", str(fig), "--quick", "--quiet", "--max-tokens", "8", "--eval-chunk", "4"]  # fmt: skip
    assert bench.main(argv) == 0
    res = json.loads((out / "results.json").read_text())["stages"]
    assert list(res) == ["before", "sft", "grpo"]
    for r in res.values():
        assert r["n"] == 6 and 0.0 <= r["accuracy"] <= 1.0
        assert r["stderr"] == pytest.approx(math.sqrt(r["accuracy"] * (1 - r["accuracy"]) / 6))
        assert 1 <= r["mean_reply_tokens"] <= 8
    assert res["sft"]["train"]["steps"] == 2
    assert res["grpo"]["train"]["samples"] == 4 and res["grpo"]["train"]["task"] == "gsm8k"
    assert (out / "sft" / "model" / "model.safetensors").is_file()
    assert (out / "grpo" / "model" / "model.safetensors").is_file()
    assert fig.is_file() and not list(out.glob("*.partial.jsonl"))
    # The before-stage generations are greedy: its accuracy is what the checker says of its replies.
    capsys.readouterr()
    assert bench.main(argv) == 0  # every stage finished: all skipped, same results
    assert capsys.readouterr().out.count("finished earlier") == 3
    assert json.loads((out / "results.json").read_text())["stages"] == res


def test_evaluation_resumes_from_finished_chunks(tmp_path: Path) -> None:
    bench = _bench()
    model = _tiny_model(tmp_path / "tiny")
    data = _gsm8k_files(tmp_path / "gsm8k")
    out = tmp_path / "out"
    out.mkdir()
    argv = ["--model", str(model), "--data-dir", str(data), "--out", str(out), "--quick",
            "--quiet", "--max-tokens", "4", "--eval-chunk", "2"]  # fmt: skip
    args = bench._args(argv)
    problems = read_jsonl(data / "test.jsonl")
    full = bench.evaluate(str(model), problems, args, "before", out)
    assert full["eval_problems_timed"] == 6
    part = out / "eval_before.partial.jsonl"
    lines = part.read_text().splitlines()
    part.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])  # a stopped run: 2 done, 1 cut
    again = bench.evaluate(str(model), problems, args, "before", out)
    assert again["eval_problems_timed"] == 4
    assert again["correct"] == full["correct"] and again["examples"] == full["examples"]


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    data = _gsm8k_files(tmp_path / "gsm8k")
    assert bench.main(["--model", str(tmp_path / "nope"), "--data-dir", str(data),
                       "--out", str(tmp_path / "o")]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model not found" in err[0]
    assert bench.main(["--stages", "dpo", "--out", str(tmp_path / "o")]) == 2
    assert "unknown stage 'dpo'" in capsys.readouterr().err


@pytest.mark.gpu
def test_benchmark_smoke_on_the_gpu(tmp_path: Path) -> None:
    """The same smoke run with ``--device cuda`` (SFT, GRPO and the serve engine on the GPU)."""
    bench = _bench()
    model = _tiny_model(tmp_path / "tiny")
    data = _gsm8k_files(tmp_path / "gsm8k")
    out = tmp_path / "out"
    argv = ["--model", str(model), "--data-dir", str(data), "--out", str(out), "--figure", "",
            "--quick", "--quiet", "--max-tokens", "8", "--device", "cuda"]  # fmt: skip
    assert bench.main(argv) == 0
    res = json.loads((out / "results.json").read_text())["stages"]
    assert [r["n"] for r in res.values()] == [6, 6, 6]
    assert res["grpo"]["train"]["samples"] == 4
