"""Pipelines: validation, sharded idempotent runs, kill-and-resume, token shards, classifiers,
contamination, mixing, and the Ray executor (slow)."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lmforge.cli import main
from lmforge.data import (
    ClassifierFilter,
    Document,
    MixSource,
    classify,
    load_pipeline,
    mix_plan,
    run_pipeline,
    train_classifier,
)
from lmforge.data.pipeline import ClassifierOptions, parse_pipeline
from lmforge.utils.errors import LmforgeError

SRC = Path(__file__).resolve().parents[1] / "src"
WORDS = (
    "the of and to in that have with for on people time year work school river market city "
    "family water history story music garden teacher window morning village country doctor "
    "letter bridge summer winter station library kitchen evening mountain harbour museum"
).split()


def _prose(rng: random.Random, n: int = 80) -> str:
    sentences = []
    while sum(len(s.split()) for s in sentences) < n:
        k = rng.randint(6, 14)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
    return " ".join(sentences)


def _corpus(d: Path, files: int, docs: int, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for f in range(files):
        rows = []
        for i in range(docs):
            text = _prose(rng)
            if i % 7 == 0:
                text = "too short to keep"
            if i % 5 == 0:
                text += f" Mail me at user{i}@example.com or call 283-182-{i % 10000:04d}."
            rows.append(json.dumps({"id": f"f{f}-{i}", "text": text}))
        p = d / f"part{f}.jsonl"
        p.write_text("\n".join(rows) + "\n")
        out.append(p)
    return out


def _write_pipeline(
    path: Path, inputs: Path, out: Path, body: str, shards: int = 0, workers: int = 1
) -> Path:
    path.write_text(
        f'executor = "local"\nworkers = {workers}\n'
        f'[input]\npaths = ["{inputs}"]\nformat = "jsonl"\n'
        f'[output]\ndir = "{out}"\nshards = {shards}\nexclusions = true\n' + body
    )
    return path


STEPS = '[[steps]]\ntype = "gopher"\nmin_words = 20\n[[steps]]\ntype = "pii"\n'


def _outputs(d: Path) -> list[list[dict]]:
    return [
        [json.loads(x) for x in gzip.decompress(p.read_bytes()).splitlines()]
        for p in sorted(d.glob("shard-*.jsonl.gz"))
    ]


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('[[steps]]\ntype = "gofer"\n', "unknown step type 'gofer'"),
        ('[[steps]]\ntype = "gopher"\nmin_wrds = 3\n', "steps[0](gopher).min_wrds"),
        ('[[steps]]\ntype = "gopher"\nmin_words = "many"\n', "steps[0](gopher).min_words"),
        ('[[steps]]\ntype = "language"\nthreshold = "high"\n', "steps[0](language).threshold"),
        (
            '[[steps]]\ntype = "tokenize"\ntokenizer = "bytes"\n[[steps]]\ntype = "pii"\n',
            "must be the last",
        ),
        ('[[steps]]\ntype = "classifier"\nlabel = "hq"\n', "steps[0](classifier).model"),
        ("[[steps]]\nmin_words = 3\n", "needs a 'type'"),
    ],
)
def test_bad_pipeline_stops_before_work(tmp_path: Path, body: str, needle: str) -> None:
    inputs = _corpus(tmp_path / "in", 1, 3)[0].parent
    out = tmp_path / "out"
    p = _write_pipeline(tmp_path / "p.toml", inputs, out, body)
    with pytest.raises(LmforgeError) as e:
        run_pipeline(load_pipeline(p))
    assert needle in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


def test_bad_pipeline_cli_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = tmp_path / "p.toml"
    p.write_text('executor = "spark"\n[input]\npaths = ["x"]\n[output]\ndir = "o"\n')
    assert main(["data", "run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "executor" in err and "spark" in err
    with pytest.raises(LmforgeError, match="unknown config key 'outptu'"):
        parse_pipeline({"input": {"paths": ["x"]}, "output": {"dir": "o"}, "outptu": 1})


# ----------------------------------------------------------------------------- runs


def test_pipeline_run_counts_excludes_and_is_idempotent(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path / "in", 3, 40)[0].parent
    out = tmp_path / "out"
    p = _write_pipeline(tmp_path / "p.toml", inputs, out, STEPS, shards=2, workers=2)
    rep = run_pipeline(load_pipeline(p), progress=False)
    gopher, pii = rep.steps
    assert gopher.docs_in == 120 and gopher.dropped["gopher_too_few_words"] == 18
    assert pii.docs_in == gopher.docs_out == pii.docs_out
    # Contacts sit in docs i % 5 == 0 (8 per file); i = 0 and 35 are also too short → 6 per file.
    assert pii.notes["masked_emails"] == 18 and pii.notes["masked_phones"] == 18
    docs = [d for shard in _outputs(out) for d in shard]
    assert len(docs) == gopher.docs_out and len({d["id"] for d in docs}) == len(docs)
    assert all("@example.com" not in d["text"] for d in docs)
    excluded = [
        json.loads(x)
        for f in (out / "excluded").glob("*.gz")
        for x in gzip.decompress(f.read_bytes()).splitlines()
    ]
    assert len(excluded) == 18 and {e["metadata"]["excluded_reason"] for e in excluded} == {
        "gopher_too_few_words"
    }
    assert sorted(x.name for x in (out / ".done").iterdir()) == [
        "shard-00000.json",
        "shard-00001.json",
    ]
    assert "| gopher | 120 |" in rep.table()
    before = {f: f.stat().st_mtime_ns for f in out.glob("shard-*")}
    rep2 = run_pipeline(load_pipeline(p), progress=False)
    assert rep2.shards_skipped == 2 and rep2.shards_run == 0
    assert {f: f.stat().st_mtime_ns for f in out.glob("shard-*")} == before
    assert rep2.steps[0].docs_in == 120  # totals come back from the markers


@pytest.mark.requires("xxhash")
def test_pipeline_with_corpus_stages_and_token_shards(tmp_path: Path) -> None:
    rng = random.Random(5)
    d = tmp_path / "in"
    d.mkdir()
    base = [_prose(rng, 120) for _ in range(6)]
    near = base[0].replace("the", "a", 1)
    rows_a = [base[0], base[1], base[2], base[1]]  # exact duplicate of base[1]
    rows_b = [near, base[3], base[4], base[5]]  # near duplicate of base[0]
    for name, rows in (("a", rows_a), ("b", rows_b)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    body = (
        '[[steps]]\ntype = "exact_dedup"\n[[steps]]\ntype = "minhash_dedup"\nnum_hashes = 64\n'
        'num_bands = 16\n[[steps]]\ntype = "tokenize"\ntokenizer = "bytes"\n'
    )
    out = tmp_path / "out"
    rep = run_pipeline(
        load_pipeline(_write_pipeline(tmp_path / "p.toml", d, out, body)), progress=False
    )
    names = [s.name for s in rep.steps]
    assert names == ["exact_dedup", "minhash_dedup", "tokenize"]
    assert rep.steps[0].docs_out == 7 and rep.steps[1].docs_out == 6
    metas = [json.loads(p.read_text()) for p in sorted(out.glob("shard-*.bin.json"))]
    assert sum(m["documents"] for m in metas) == 6
    ids = np.concatenate([np.fromfile(p, dtype=np.uint16) for p in sorted(out.glob("shard-*.bin"))])
    assert all(m["format"] == "lmforge-tokens-v1" and m["dtype"] == "uint16" for m in metas)
    assert len(ids) == sum(m["count"] for m in metas) and (ids == 256).sum() == 6
    texts = bytes(ids[ids != 256].astype(np.uint8)).decode()
    assert sum(m["bytes"] for m in metas) == len(texts.encode())
    for t in (base[1], base[2], base[3], base[4], base[5]):
        assert t in texts
    assert (base[0] in texts) != (near in texts)


def test_kill_and_resume(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path / "in", 8, 200, seed=3)[0].parent
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    ref = tmp_path / "ref"
    p_ref = _write_pipeline(tmp_path / "ref.toml", inputs, ref, STEPS)
    run_pipeline(load_pipeline(p_ref), progress=False)
    out = tmp_path / "out"
    p = _write_pipeline(tmp_path / "p.toml", inputs, out, STEPS)
    cmd = [sys.executable, "-m", "lmforge", "data", "run", str(p), "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / ".done" / "shard-00000.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before any marker"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_at_kill = len(list((out / ".done").iterdir()))
    assert 1 <= done_at_kill < 8, "the run finished before it could be killed"
    rc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    assert f"already done {done_at_kill}" in rc.stdout
    got, want = _outputs(out), _outputs(ref)
    assert got == want
    ids = [d["id"] for shard in got for d in shard]
    assert len(ids) == len(set(ids))
    assert not list(out.glob(".*.tmp"))


@pytest.mark.requires("fastwarc", "resiliparse", "fasttext")
def test_pipeline_on_real_warc(tmp_path: Path, shared_data: Path) -> None:
    web = shared_data / "web"
    p = tmp_path / "w.toml"
    p.write_text(
        f'[input]\npaths = ["{web}/dolma/sample-0000.warc.gz", "{web}/warcio/example-trunc.warc", '
        f'"{web}/warcio/bad.arc"]\nformat = "warc"\n[output]\ndir = "{tmp_path / "o"}"\n'
        '[[steps]]\ntype = "html"\n[[steps]]\ntype = "language"\n[[steps]]\ntype = "gopher"\n'
        '[[steps]]\ntype = "pii"\n'
    )
    rep = run_pipeline(load_pipeline(p), progress=False)
    html, lang, gopher, pii = rep.steps
    assert html.docs_in == rep.records > 10 and sum(rep.malformed.values()) >= 2
    assert lang.docs_out > 0 and gopher.docs_out > 0 and pii.docs_out == gopher.docs_out
    kept = [d for s in _outputs(tmp_path / "o") for d in s]
    assert len(kept) == pii.docs_out and all(d["metadata"]["language"] == "en" for d in kept)


# ----------------------------------------------------------------------------- classifier, contamination, mixing


@pytest.mark.requires("fasttext")
def test_train_classifier_and_filter(tmp_path: Path) -> None:
    rng = random.Random(0)
    spam = "buy cheap pills now click here free casino bonus win money fast offer".split()
    labelled = [("hq", _prose(rng, 30)) for _ in range(200)]
    labelled += [("cc", " ".join(rng.choice(spam) for _ in range(30))) for _ in range(200)]
    model = tmp_path / "q.bin"
    res = train_classifier(labelled, model, epoch=10, dim=16, bucket=10_000)
    assert res["precision@1"] > 0.95
    assert classify(_prose(rng, 30), str(model))[0] == "hq"
    assert classify("click here for a free casino bonus, buy pills", str(model))[0] == "cc"
    docs = [Document(f"h{i}", _prose(rng, 30)) for i in range(20)]
    docs += [Document(f"s{i}", " ".join(rng.choice(spam) for _ in range(30))) for i in range(20)]
    step = ClassifierFilter(ClassifierOptions(model=str(model), label="hq", threshold=0.5))
    kept = [d.id for d in step.run(docs)]
    assert sorted(kept) == sorted(f"h{i}" for i in range(20))
    pareto = ClassifierFilter(ClassifierOptions(model=str(model), label="hq", mode="pareto"))
    kept_p = {d.id for d in pareto.run(docs)}
    # GPT-3 rule: a score near 1 is kept with probability ≈ (1 + 1 - score)^-9, near 0 with ≈ 2^-9.
    assert (
        sum(k.startswith("h") for k in kept_p) >= 12 and sum(k.startswith("s") for k in kept_p) <= 2
    )
    # The CLI trains from labelled JSONL.
    lj = tmp_path / "l.jsonl"
    lj.write_text("".join(json.dumps({"label": lab, "text": t}) + "\n" for lab, t in labelled))
    assert (
        main(
            [
                "data",
                "train-classifier",
                "--input",
                str(lj),
                "--out",
                str(tmp_path / "c.bin"),
                "--dim",
                "8",
                "--bucket",
                "1000",
            ]
        )
        == 0
    )
    assert (tmp_path / "c.bin").is_file()
    # … and from positive / negative files of any readable format.
    (tmp_path / "pos.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for _, t in labelled[:200])
    )
    (tmp_path / "neg.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for _, t in labelled[200:])
    )
    argv = ["data", "train-classifier", "--positive", str(tmp_path / "pos.jsonl"), "--negative",
            str(tmp_path / "neg.jsonl"), "--out", str(tmp_path / "pn.bin"), "--dim", "8", "--bucket", "1000"]  # fmt: skip
    assert main(argv) == 0
    assert classify(_prose(rng, 30), str(tmp_path / "pn.bin"))[0] == "hq"


@pytest.mark.requires("xxhash")
def test_contamination_report_and_remove(tmp_path: Path) -> None:
    ev = tmp_path / "eval.jsonl"
    q = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May"
    ev.write_text(json.dumps({"question": q, "answer": "72"}) + "\n")
    rng = random.Random(1)
    d = tmp_path / "in"
    d.mkdir()
    rows = [_prose(rng), _prose(rng) + " " + q + ". How many?", _prose(rng)]
    (d / "x.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(rows))
    )
    for action, kept in (("remove", 2), ("report", 3)):
        body = f'[[steps]]\ntype = "contamination"\neval_paths = ["{ev}"]\naction = "{action}"\n'
        out = tmp_path / action
        rep = run_pipeline(
            load_pipeline(_write_pipeline(tmp_path / f"{action}.toml", d, out, body)),
            progress=False,
        )
        assert rep.steps[0].docs_out == kept and rep.steps[0].notes["contaminated_docs"] == 1


@pytest.mark.requires("xxhash")
def test_contamination_against_real_eval_sets(shared_data: Path) -> None:
    from lmforge.data import ContaminationIndex

    gsm = shared_data / "eval" / "gsm8k" / "test.jsonl"
    idx = ContaminationIndex.from_paths([gsm], n=8)
    first = json.loads(gsm.read_text().splitlines()[0])["question"]
    assert idx.items == 1319 and idx.matches("Some preamble. " + first) > 3
    assert idx.matches(_prose(random.Random(0), 200)) == 0


def test_unimax_mix_plan(capsys: pytest.CaptureFixture) -> None:
    rows, short = mix_plan([MixSource("big", 1000), MixSource("small", 100, max_epochs=2)], 1000)
    by = {r.name: r for r in rows}
    assert short == 0 and by["small"].tokens_taken == 200 and by["small"].capped
    assert by["big"].tokens_taken == 800 and by["big"].effective_epochs == pytest.approx(0.8)
    rows, short = mix_plan([MixSource("a", 100, 3.0), MixSource("b", 100, 1.0)], 200)
    assert [r.tokens_taken for r in rows] == [150, 50]
    rows, short = mix_plan([MixSource("a", 10, max_epochs=1)], 100)
    assert short == 90
    assert (
        main(
            ["data", "mix", "--source", "web=1000", "--source", "code=100:1:2", "--tokens", "1000"]
        )
        == 0
    )
    assert "| code | 100 | 200 |" in capsys.readouterr().out


# ----------------------------------------------------------------------------- Ray


@pytest.mark.slow
@pytest.mark.requires("ray")
def test_ray_executor_matches_local(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path / "in", 3, 30)[0].parent
    outs = {}
    for ex in ("local", "ray"):
        out = tmp_path / ex
        p = _write_pipeline(tmp_path / f"{ex}.toml", inputs, out, STEPS, workers=2)
        p.write_text(p.read_text().replace('executor = "local"', f'executor = "{ex}"'))
        rep = run_pipeline(load_pipeline(p), progress=False)
        assert rep.shards_run == 3
        outs[ex] = _outputs(out)
    assert outs["ray"] == outs["local"]


def test_tokenize_step_with_lmforge_tokenizer(tmp_path: Path) -> None:
    from lmforge.tokenizer import Tokenizer, read_shard_info, read_token_shard, train_bpe

    rng = random.Random(7)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(_prose(rng, 400) for _ in range(5)))
    vocab, merges = train_bpe(corpus, 300, ["<|endoftext|>"], workers=1)
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    tok_dir = tok.save(tmp_path / "tok")
    d = tmp_path / "in"
    d.mkdir()
    texts = [_prose(rng, 60) for _ in range(8)]
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    body = f'[[steps]]\ntype = "tokenize"\ntokenizer = "{tok_dir}"\n'
    out = tmp_path / "out"
    run_pipeline(load_pipeline(_write_pipeline(tmp_path / "p.toml", d, out, body)), progress=False)
    info = read_shard_info(out / "shard-00000.bin")
    ids = np.asarray(read_token_shard(out / "shard-00000.bin"))
    assert info.documents == 8 and info.tokenizer_sha256 == tok.sha256
    want = [i for t in texts for i in [*tok.encode(t), tok.eot_id]]
    assert ids.tolist() == want


@pytest.mark.requires("xxhash")
def test_mix_cli_writes_mixture(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for name, n in (("big", 200), ("small", 20)):
        d = tmp_path / name
        d.mkdir()
        rows = [json.dumps({"id": f"{name}{i}", "text": "x" * 100}) for i in range(n)]
        (d / "a.jsonl").write_text("\n".join(rows) + "\n")
    # 20,000 + 2,000 bytes available; budget 8,000 with cap 2 epochs on small: small takes 4,000
    # (2 epochs, capped), big the other 4,000 (0.2 epochs).
    argv = ["data", "mix", "--source", f"big={tmp_path / 'big'}", "--source",
            f"small={tmp_path / 'small'}:1:2", "--tokens", "8000", "--out", str(tmp_path / "mix")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| small | 2,000 | 4,000 |" in out and "| big | 20,000 | 4,000 |" in out
    small = gzip.decompress((tmp_path / "mix" / "small.jsonl.gz").read_bytes()).splitlines()
    big = gzip.decompress((tmp_path / "mix" / "big.jsonl.gz").read_bytes()).splitlines()
    assert len(small) == 40 and 20 <= len(big) <= 60  # 0.2 epochs of 200 docs, sampled
    assert json.loads(small[0])["metadata"]["source"] == "small"


@pytest.mark.parametrize("name", ["web.toml", "quality.toml", "dedup.toml"])
def test_example_pipelines_validate(name: str) -> None:
    cfg = load_pipeline(Path(__file__).resolve().parents[1] / "configs" / "pipelines" / name)
    assert cfg.steps and cfg.output.dir.startswith("runs/data/")


@pytest.mark.requires("xxhash")
def test_corpus_stage_restarts_after_a_kill(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path / "in", 2, 20)[0].parent
    body = '[[steps]]\ntype = "gopher"\nmin_words = 20\n[[steps]]\ntype = "exact_dedup"\n'
    ref = tmp_path / "ref"
    run_pipeline(
        load_pipeline(_write_pipeline(tmp_path / "r.toml", inputs, ref, body)), progress=False
    )
    out = tmp_path / "out"
    p = _write_pipeline(tmp_path / "p.toml", inputs, out, body)
    run_pipeline(load_pipeline(p), progress=False)
    # What a kill inside the dedup stage leaves: no stage marker, a scratch folder, a stray temp.
    (out / ".done" / "stage.json").unlink()
    (out / ".dedup-killed").mkdir()
    (out / "shard-00000.jsonl.gz").write_bytes(b"partial")
    rep = run_pipeline(load_pipeline(p), progress=False)
    assert rep.shards_skipped == 2  # the streaming stage before it is not redone
    assert _outputs(out) == _outputs(ref) and not (out / ".dedup-killed").exists()
