"""The evaluation suite end to end: a hand-wired bigram TransformerLM whose greedy output is known,
task files generated in tmp in the formats of /work/shared/data/eval, and the ``lmforge eval`` CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from lmforge.config import RunConfig
from lmforge.eval import EvalOptions, evaluate_multiple_choice, format_table, run_eval
from lmforge.eval.scoring import encode_pair, score_continuations
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import Tokenizer
from lmforge.train import save_checkpoint

EOT = "<|endoftext|>"


def _tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], [EOT])


def _bigram_model(tok: Tokenizer, chains: list[str]) -> TransformerLM:
    """A real TransformerLM wired as a bigram model: the next byte depends on the current one only.

    Attention and FFN outputs are zeroed, so the residual stream is the current token's embedding;
    the LM-head row of each wanted successor is that embedding's RMS-normalised direction, giving it
    a logit of ~0.5·D = 32 while every other logit stays near 0. Each chain "abc" wires a→b→c→EOT.
    """
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, context_length=256, d_model=64, n_layers=1, n_heads=2
    )
    model = TransformerLM(cfg)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.output_proj.weight.zero_()
            layer.ffn.w2.weight.zero_()
        model.lm_head.weight.zero_()
        emb = model.token_embeddings.weight
        for chain in chains:
            ids = [*chain.encode(), tok.eot_id]
            for cur, nxt in itertools.pairwise(ids):
                direction = emb[cur] / emb[cur].pow(2).mean().sqrt()
                model.lm_head.weight[nxt] += 0.5 * direction
    return model.eval()


# GSM8K prompts end in "Answer:" and MATH prompts in "Solution:\n": the model then writes
# " 42" and "\boxed{7}" respectively, whatever the question.
CHAINS = [": 42", "\n\\boxed{7}"]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _data_dir(root: Path) -> Path:
    d = root / "eval"
    arc = []
    for i, (good, bad, key) in enumerate([("42", "17", "A"), ("42", "17", "A"), ("17", "42", "B")]):
        choices = [{"text": good, "label": "A"}, {"text": bad, "label": "B"}]
        # key names the correct label; the third item's correct answer is "42" (label B)
        arc.append(
            {"question": {"stem": f"What is item {i}?", "choices": choices}, "answerKey": key}
        )
    arc.append(
        {
            "question": {
                "stem": "Pick",
                "choices": [{"text": "42", "label": "A"}, {"text": "13", "label": "B"}],
            },
            "answerKey": "B",
        }
    )
    _write_jsonl(d / "arc_challenge" / "ARC-Challenge-Test.jsonl", arc)
    _write_jsonl(d / "arc_challenge" / "ARC-Challenge-Dev.jsonl", arc)
    gsm = [
        {"question": f"Problem {i}?", "answer": f"Work <<1+1=2>>.\n#### {a}"}
        for i, a in enumerate(["42", "42", "7", "42.0"])
    ]
    swag = [
        {"ctx": "He said:", "endings": [" 42", " 17"], "label": 0},
        {"ctx": "She said:", "endings": [" 17", " 42"], "label": 0},
    ]
    _write_jsonl(d / "hellaswag" / "val.jsonl", swag)
    _write_jsonl(d / "gsm8k" / "test.jsonl", gsm)
    _write_jsonl(d / "gsm8k" / "train.jsonl", gsm)
    math_rows = [
        {"problem": "What is 7?", "solution": r"It is $\boxed{7}$.", "answer": "7"},
        {
            "problem": "What is 14/2?",
            "solution": r"$\boxed{\dfrac{14}{2}}$",
            "answer": r"\dfrac{14}{2}",
        },
        {"problem": "What is 8?", "solution": r"$\boxed{8}$", "answer": "8"},
    ]
    _write_jsonl(d / "math" / "math_oai" / "test.jsonl", math_rows)
    _write_jsonl(
        d / "math" / "math" / "test.jsonl",
        [{k: r[k] for k in ("problem", "solution")} for r in math_rows],
    )
    for split in ("dev", "test"):
        (d / "mmlu" / split).mkdir(parents=True)
        rows = "".join(f"Q{i}?,w,x,y,z,{'ABCD'[i % 4]}\n" for i in range(5))
        (d / "mmlu" / split / f"anatomy_{split}.csv").write_text(rows, encoding="utf-8")
    return d


def test_multiple_choice_accuracy_follows_the_model(tmp_path: Path) -> None:
    tok = _tokenizer()
    model = _bigram_model(tok, CHAINS)
    opts = EvalOptions(data_dir=str(_data_dir(tmp_path)), progress=False)
    report = run_eval(model, tok, ["arc", "hellaswag"], opts)
    swag = report["results"]["hellaswag"]
    assert swag["acc"] == pytest.approx(0.5) and swag["n"] == 2 and swag["shots"] == 0
    arc = report["results"]["arc"]
    # the model prefers " 42" everywhere: right on items 0, 1, 2, wrong on item 3
    assert arc["acc"] == pytest.approx(0.75) and arc["n"] == 4
    assert arc["acc_norm"] == pytest.approx(0.75)
    assert arc["acc_stderr"] == pytest.approx(0.25)
    assert report["details"]["arc"] == [1.0, 1.0, 1.0, 0.0]


def test_mmlu_by_generation(tmp_path: Path) -> None:
    tok = _tokenizer()
    model = _bigram_model(tok, [": B"])  # after "Answer:" the model writes " B" and stops
    d = _data_dir(tmp_path)
    report = run_eval(
        model, tok, ["mmlu_gen", "mmlu"], EvalOptions(data_dir=str(d), shots=1, progress=False)
    )
    gen = report["results"]["mmlu_gen"]
    answers = [r["answer"] for r in report["details"]["mmlu_gen"]]
    assert [r["prediction"] for r in report["details"]["mmlu_gen"]] == ["B"] * 5
    assert gen["acc"] == pytest.approx(answers.count("B") / 5) and gen["unparsed"] == 0.0
    # by log-likelihood the same model also prefers " B"
    assert report["results"]["mmlu"]["acc"] == pytest.approx(gen["acc"])


def test_acc_norm_divides_by_bytes() -> None:
    tok = _tokenizer()
    model = _bigram_model(tok, CHAINS)
    ctx = "Q: x\nAnswer:"
    conts = [" 4", " 4242424242"]  # the long one is likelier per byte, less likely in total
    res = evaluate_multiple_choice(model, tok, [(ctx, conts, 1)])
    lls = [ll for ll, _ in score_continuations(model, [encode_pair(tok, ctx, c) for c in conts])]
    assert (lls[1] > lls[0]) == (res["acc"] == 1.0)
    per_byte = [lls[0] / 2, lls[1] / 11]
    assert (per_byte[1] > per_byte[0]) == (res["acc_norm"] == 1.0)


def test_generative_math_pass_at_k(tmp_path: Path) -> None:
    tok = _tokenizer()
    model = _bigram_model(tok, CHAINS)
    d = _data_dir(tmp_path)
    greedy = run_eval(
        model,
        tok,
        ["gsm8k", "math500"],
        EvalOptions(data_dir=str(d), shots=1, max_new_tokens=12, progress=False),
    )
    gsm, math500 = greedy["results"]["gsm8k"], greedy["results"]["math500"]
    assert gsm["pass@1"] == pytest.approx(0.75)  # answers 42, 42, 7, 42.0 → right on 3 of 4
    assert [r["predictions"] for r in greedy["details"]["gsm8k"]] == [["42"]] * 4
    assert math500["pass@1"] == pytest.approx(2 / 3)  # 7 = \dfrac{14}{2}; 8 is wrong
    assert greedy["details"]["math500"][1]["predictions"] == ["7"]
    assert greedy["results"]["math500"]["shots"] == 1
    sampled = run_eval(
        model,
        tok,
        ["gsm8k"],
        EvalOptions(
            data_dir=str(d), shots=0, max_new_tokens=8, samples=2, temperature=1.0, progress=False
        ),
    )
    res = sampled["results"]["gsm8k"]
    assert res["samples"] == 2 and 0.0 <= res["pass@1"] <= res["pass@2"] <= 1.0
    table = format_table(greedy)
    assert "| gsm8k | pass@1 | 0.7500 |" in table and "| math500 | pass@1 | 0.6667 |" in table


def _checkpoint(root: Path, model: TransformerLM, tok: Tokenizer) -> Path:
    tok_dir = tok.save(root / "tok")
    return save_checkpoint(
        root / "ckpt", model, None, 0, config=RunConfig(model=model.config), tokenizer_dir=tok_dir
    )


def test_cli_writes_report_and_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lmforge.cli import main

    tok = _tokenizer()
    ckpt = _checkpoint(tmp_path, _bigram_model(tok, CHAINS), tok)
    data = _data_dir(tmp_path)
    text = tmp_path / "heldout.txt"
    text.write_text("Answer: 42\n" * 20, encoding="utf-8")
    out = tmp_path / "report.json"
    args = ["eval", "--checkpoint", str(ckpt), "--data-dir", str(data), "--device", "cpu"]
    rc = main(
        [
            *args,
            "--tasks",
            "ppl,mmlu,arc,gsm8k,math500",
            "--ppl-text",
            str(text),
            "--limit",
            "3",
            "--shots",
            "1",
            "--max-new-tokens",
            "10",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"ppl", "mmlu", "arc", "gsm8k", "math500"}
    assert report["results"]["arc"]["n"] == 3  # the first three items, all answered " 42"
    assert report["results"]["gsm8k"]["pass@1"] == pytest.approx(2 / 3)  # 42, 42, 7
    assert report["results"]["ppl"]["bytes"] == len(text.read_text())
    assert report["checkpoint"] == str(ckpt) and report["model"]["d_model"] == 64
    assert "| arc | acc | 1.0000 |" in captured.out
    assert "eval" in captured.err  # the progress bar went to stderr


def _cli_error(args: list[str], capsys: pytest.CaptureFixture) -> str:
    from lmforge.cli import main

    rc = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    lines = [line for line in err if "error:" in line]
    assert len(lines) == 1
    return lines[0]


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = _tokenizer()
    ckpt = _checkpoint(tmp_path, _bigram_model(tok, CHAINS), tok)
    data = _data_dir(tmp_path)
    base = [
        "eval",
        "--checkpoint",
        str(ckpt),
        "--data-dir",
        str(data),
        "--device",
        "cpu",
        "--no-progress",
        "--out",
        str(tmp_path / "r.json"),
    ]
    (data / "gsm8k" / "test.jsonl").unlink()
    msg = _cli_error([*base, "--tasks", "arc,gsm8k"], capsys)
    assert "task file not found" in msg and "gsm8k/test.jsonl" in msg
    assert not (tmp_path / "r.json").exists()  # nothing ran, nothing written
    arc = data / "arc_challenge" / "ARC-Challenge-Test.jsonl"
    arc.write_text(arc.read_text() + '{"question": {"stem": "q", "choices": []}}\n')
    msg = _cli_error([*base, "--tasks", "arc"], capsys)
    assert "ARC-Challenge-Test.jsonl:5" in msg and "answerKey" in msg
    assert "unknown task" in _cli_error([*base, "--tasks", "squad"], capsys)
    small_cfg = ModelConfig(vocab_size=200, context_length=32, d_model=32, n_layers=1, n_heads=2)
    small = _checkpoint(tmp_path / "small", TransformerLM(small_cfg), tok)
    msg = _cli_error(
        ["eval", "--checkpoint", str(small), "--tasks", "arc", "--data-dir", str(data)], capsys
    )
    assert "tokenizer has 257 ids but the model's vocab_size is 200" in msg
    assert "not found" in _cli_error(["eval", "--checkpoint", str(tmp_path / "nope")], capsys)


def test_cli_pairwise(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lmforge.cli import main

    records = tmp_path / "battles.jsonl"
    rows = [{"model_a": "a", "model_b": "b", "winner": "a"}] * 6 + [
        {"model_a": "a", "model_b": "b", "winner": "b"}
    ] * 2
    _write_jsonl(records, rows)
    out = tmp_path / "elo.json"
    assert main(["eval", "--pairwise", str(records), "--bootstrap", "20", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ratings"]["a"] > report["ratings"]["b"] and report["n_games"] == 8
    assert "| a |" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_on_the_real_benchmark_files(
    tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture
) -> None:
    from lmforge.cli import main

    tok = _tokenizer()
    ckpt = _checkpoint(tmp_path, _bigram_model(tok, CHAINS), tok)
    out = tmp_path / "report.json"
    rc = main(
        ["eval", "--checkpoint", str(ckpt), "--data-dir", str(shared_data / "eval"),
         "--tasks", "ppl,mmlu,mmlu_gen,arc,gsm8k,math500,math", "--limit", "3", "--ppl-max-tokens", "300",
         "--max-new-tokens", "12", "--device", "cpu", "--no-progress", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    results = json.loads(out.read_text())["results"]
    assert results["mmlu"]["shots"] == 5 and results["mmlu"]["n"] == 3
    assert results["ppl"]["tokens"] == 300 and results["ppl"]["files"][0].endswith("test.txt")
    assert all(results[t]["n"] == 3 for t in ("mmlu_gen", "arc", "gsm8k", "math500", "math"))


def _old_loop_texts(model, tok, prompts, new_tokens: int, stops) -> list[str]:
    """The pre-engine path: the reference loop, one prompt at a time, text cut at a stop string."""
    from lmforge.generate import generate

    keep = model.config.context_length - new_tokens
    out = []
    for p in prompts:
        ids = [tok.eot_id, *tok.encode(p)][-keep:]
        (new,) = generate(model, [ids], new_tokens, temperature=0.0, stop_tokens=[tok.eot_id])
        text = tok.decode(new)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        out.append(text[:cut])
    return out


def test_generation_on_the_engine_equals_the_old_loop(tmp_path: Path) -> None:
    """Greedy GSM8K/MATH on a random tiny model: the engine's texts (all prompts in one batch,
    stop strings applied inside the engine) and so every prediction and pass@1 equal the
    reference loop's, prompt by prompt."""
    from lmforge.eval import tasks as T
    from lmforge.eval.answers import parse_gsm8k_response, parse_math_response
    from lmforge.eval.runner import _STOP_STRINGS, _math_examples, generate_texts

    tok = _tokenizer()
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=512, d_model=32, n_layers=2,
                      n_heads=4, n_kv_heads=2)  # fmt: skip
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # make the digits, spaces and newlines likely: answers get parsed
        model.lm_head.weight[[ord(c) for c in "0123456789 \n"]] *= 6
    d = _data_dir(tmp_path)
    opts = EvalOptions(data_dir=str(d), shots=1, max_new_tokens=16, progress=False)
    report = run_eval(model, tok, ["gsm8k", "math500"], opts)
    for task, kind, parse in [("gsm8k", "gsm8k", parse_gsm8k_response),
                              ("math500", "math", parse_math_response)]:  # fmt: skip
        examples, shots = _math_examples(task, opts)  # the shots run_eval chose
        prompt_fn = T.gsm8k_prompt if kind == "gsm8k" else T.math_prompt
        prompts = [prompt_fn(ex, shots) for ex in examples]
        want = _old_loop_texts(model, tok, prompts, 16, _STOP_STRINGS[kind])
        got = [t[0] for t in generate_texts(model, tok, prompts, max_new_tokens=16,
                                            stops=_STOP_STRINGS[kind])]  # fmt: skip
        assert got == want
        preds = [r["predictions"][0] for r in report["details"][task]]
        assert preds == [parse(t) for t in want]
        if kind == "gsm8k":  # the comparison is not vacuous (MATH wants a \\boxed{} answer)
            assert sum(p is not None for p in preds) >= 2


@pytest.mark.parametrize("package", ["lmforge.eval", "lmforge.model"])
def test_type_checking_imports_match_the_lazy_exports(package: str) -> None:
    """``__all__`` is the export table; the imports type checkers read list the same names from
    the same modules (the two copies cannot drift apart)."""
    import ast
    import importlib
    import inspect

    mod = importlib.import_module(package)
    tree = ast.parse(inspect.getsource(mod))
    block = next(n for n in tree.body if isinstance(n, ast.If))  # if TYPE_CHECKING:
    imported = {
        alias.name: node.module.rsplit(".", 1)[-1] if node.module != package else alias.name
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == mod._EXPORTS
    assert mod.__all__ == sorted(imported)
