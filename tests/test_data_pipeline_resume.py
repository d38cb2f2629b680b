"""Pipeline reruns after a change: fingerprinted markers, pipeline.json, disk full, a split schema."""

from __future__ import annotations

import errno
import gzip
import json
import random
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.data import executors, load_pipeline, run_pipeline
from lmforge.utils.errors import LmforgeError

STOP = "the of and to with that have".split()
WORDS = [f"word{i}" for i in range(3000)]


def _corpus(d: Path, files: int = 3, docs: int = 30, seed: int = 0) -> Path:
    rng = random.Random(seed)
    d.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        rows = []
        for i in range(docs):
            n = rng.choice((30, 60, 120, 600))  # words: some pass min_words 50, fewer 500
            text = " ".join(rng.choice(STOP if j % 3 else WORDS) for j in range(n)) + "."
            rows.append(json.dumps({"id": f"f{f}-{i}", "text": text}))
        (d / f"part{f}.jsonl").write_text("\n".join(rows) + "\n")
    return d


def _pipeline(path: Path, inputs: Path, out: Path, min_words: int, shards: int = 3) -> Path:
    path.write_text(
        f'[input]\npaths = ["{inputs}"]\nformat = "jsonl"\n'
        f'[output]\ndir = "{out}"\nshards = {shards}\n'
        f'[[steps]]\ntype = "gopher"\nmin_words = {min_words}\nmax_symbol_word_ratio = 1.0\n'
        '[[steps]]\ntype = "pii"\n'
    )
    return path


def _docs(out: Path) -> list[str]:
    return sorted(
        json.loads(x)["id"]
        for p in out.glob("shard-*.jsonl.gz")
        for x in gzip.decompress(p.read_bytes()).splitlines()
    )


def _fresh(tmp_path: Path, inputs: Path, min_words: int) -> list[str]:
    out = tmp_path / f"fresh{min_words}"
    run_pipeline(load_pipeline(_pipeline(tmp_path / "f.toml", inputs, out, min_words)), log=None)
    return _docs(out)


def test_changed_option_reruns_the_stage_and_names_the_change(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    p = _pipeline(tmp_path / "p.toml", inputs, out, 50)
    first = run_pipeline(load_pipeline(p), progress=False, log=None)
    kept50 = _docs(out)
    assert first.shards_run == 3 and not first.changes
    again = run_pipeline(load_pipeline(p), progress=False, log=None)
    assert again.shards_skipped == 3 and not again.changes and _docs(out) == kept50

    lines: list[str] = []
    _pipeline(p, inputs, out, 500)
    rep = run_pipeline(load_pipeline(p), progress=False, log=lines.append)
    assert rep.shards_run == 3 and rep.shards_skipped == 0
    assert len(lines) == 1 and "min_words 50 → 500" in lines[0] and "gopher" in lines[0]
    assert _docs(out) == _fresh(tmp_path, inputs, 500) != kept50
    recorded = json.loads((out / "pipeline.json").read_text())
    assert recorded["steps"][0]["options"]["min_words"] == 500


def test_kill_during_a_changed_rerun_never_mixes_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    p = _pipeline(tmp_path / "p.toml", inputs, out, 50)
    run_pipeline(load_pipeline(p), progress=False, log=None)
    _pipeline(p, inputs, out, 500)
    real = executors._run_shard

    def dies_on_shard_2(shard: int, *a: object, **kw: object) -> dict:
        if shard == 2:
            raise KeyboardInterrupt  # as a kill between shards would leave it
        return real(shard, *a, **kw)

    monkeypatch.setattr(executors, "_run_shard", dies_on_shard_2)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(load_pipeline(p), progress=False, log=None)
    # Old-setting shard 2 is gone, and no pipeline.json vouches for the half-done outputs.
    assert not (out / "pipeline.json").exists()
    assert sorted(f.name for f in out.glob("shard-*")) == [
        "shard-00000.jsonl.gz",
        "shard-00001.jsonl.gz",
    ]
    monkeypatch.setattr(executors, "_run_shard", real)
    rep = run_pipeline(load_pipeline(p), progress=False, log=None)
    assert rep.shards_skipped == 2 and rep.shards_run == 1 and not rep.changes
    assert _docs(out) == _fresh(tmp_path, inputs, 500)
    assert (
        json.loads((out / "pipeline.json").read_text())["steps"][0]["options"]["min_words"] == 500
    )


def test_changed_input_and_layout_rerun(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    p = _pipeline(tmp_path / "p.toml", inputs, out, 50)
    run_pipeline(load_pipeline(p), progress=False, log=None)
    _corpus(inputs, seed=1)  # same names, new content
    lines: list[str] = []
    rep = run_pipeline(load_pipeline(p), progress=False, log=lines.append)
    assert rep.shards_run == 3 and lines and "input files changed" in lines[0]
    _pipeline(p, inputs, out, 50, shards=2)
    lines.clear()
    rep = run_pipeline(load_pipeline(p), progress=False, log=lines.append)
    assert rep.shards_run == 2 and "shards 3 → 2" in lines[0]
    assert sorted(f.name for f in out.glob("shard-*")) == [
        "shard-00000.jsonl.gz",
        "shard-00001.jsonl.gz",
    ]


def test_markers_without_fingerprint_are_redone(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    p = _pipeline(tmp_path / "p.toml", inputs, out, 50)
    run_pipeline(load_pipeline(p), progress=False, log=None)
    (out / executors.STAGE_RECORD).unlink()  # as an older lmforge left the folder
    lines: list[str] = []
    rep = run_pipeline(load_pipeline(p), progress=False, log=lines.append)
    assert rep.shards_run == 3 and "without a fingerprint" in lines[0]


def test_disk_full_is_one_line_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    p = _pipeline(tmp_path / "p.toml", inputs, out, 50)
    from lmforge.data import dedup

    real = dedup.write_documents
    calls = []

    def full(path: Path, *a: object, **kw: object) -> object:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **kw)

    monkeypatch.setattr(dedup, "write_documents", full)
    assert main(["data", "run", str(p), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left" in err[0] and str(out) in err[0]
    assert "shard 1 not written" in err[0] and "finished shards are kept" in err[0]
    assert [f.name for f in out.glob("shard-*")] == ["shard-00000.jsonl.gz"]
    assert not list(out.glob(".*.tmp"))
    with pytest.raises(LmforgeError):  # and the library call raises the same one-liner
        calls.clear()
        run_pipeline(load_pipeline(p), progress=False, log=None)


def test_pipeline_modules_stay_small() -> None:
    # The 806-line pipeline.py was split (issue 20 item 3b): schema, executors, steps by logic.
    data = Path(__file__).resolve().parents[1] / "src" / "lmforge" / "data"
    sizes = {f.name: len(f.read_text().splitlines()) for f in data.glob("*.py")}
    assert {"schema.py", "executors.py", "pipeline.py"} <= set(sizes)
    assert max(sizes.values()) <= 620, sizes


@pytest.mark.parametrize(
    ("step", "needle"),
    [
        ('type = "gopher"\nmin_words = -5', "steps[0](gopher).min_words': must be >= 0, got -5"),
        ('type = "gopher"\nmin_words = 500\nmax_words = 100', "must be <= max_words (100)"),
        ('type = "gopher"\nmax_dup_line_fraction = 1.5', "is a fraction, must be in [0, 1]"),
        ('type = "language"\nthreshold = 2.0', "steps[0](language).threshold"),
        ('type = "language"\nlanguages = []', "must list at least one language"),
        ('type = "minhash_dedup"\nnum_hashes = 100\nnum_bands = 30', "multiple of num_bands"),
        ('type = "minhash_dedup"\nnum_bands = 0', "num_bands': must be >= 1"),
        ('type = "c4"\nmin_sentences = -1', "steps[0](c4).min_sentences"),
        ('type = "exact_dedup"\nnum_buckets = 0', "num_buckets': must be >= 1"),
    ],
)
def test_invalid_step_values_are_refused_before_work(
    tmp_path: Path, step: str, needle: str
) -> None:
    inputs = _corpus(tmp_path / "in", files=1, docs=2)
    p = tmp_path / "p.toml"
    out = tmp_path / "out"
    p.write_text(
        f'[input]\npaths = ["{inputs}"]\nformat = "jsonl"\n[output]\ndir = "{out}"\n'
        f"[[steps]]\n{step}\n"
    )
    with pytest.raises(LmforgeError) as e:
        load_pipeline(p)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()
