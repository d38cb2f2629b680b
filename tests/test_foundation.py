"""Foundation: config tree loading/validation, CLI dispatch, corpus inputs, atomic writes."""

from __future__ import annotations

import dataclasses
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.cli import main, split_overrides
from lmforge.config import RunConfig, load_run_config
from lmforge.utils import (
    ConfigError,
    LmforgeError,
    atomic_write_text,
    config_to_toml,
    default_corpus_files,
    expand_inputs,
    field_docs,
    iter_texts,
    load_config,
)
from lmforge.utils.config import describe_config


def test_defaults_and_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nd_model = 64\nn_heads = 4\nn_layers = 2\n[train]\nlr = 1e-3\n")
    cfg = load_run_config(toml, ["train.lr=3e-4", "--model.n_layers=3", "train.precision=fp32"])
    assert cfg.model.d_model == 64 and cfg.model.n_layers == 3
    assert cfg.train.lr == 3e-4 and cfg.train.precision == "fp32"
    assert dataclasses.is_dataclass(cfg.train)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_int_promotes_to_float_and_tuples() -> None:
    cfg = load_run_config(None, ["train.lr=1", "data.train=['a.bin', 'b.bin']"])
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1.0
    assert cfg.data.train == ("a.bin", "b.bin")
    assert load_run_config(None, ["data.train=one.bin"]).data.train == ("one.bin",)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.lrr=1e-3", "unknown config key 'train.lrr'"),
        ("train.lr=fast", "'train.lr': expected float"),
        ("model.n_layers=2.5", "'model.n_layers': expected int"),
        ("train.compile=yes", "'train.compile': expected bool"),
        ("train.precision=fp8", "'train.precision'"),
        ("nosuch.key=1", "unknown config key 'nosuch'"),
        ("model.d_model=100", "divisible by n_heads"),
    ],
)
def test_bad_keys_and_types_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        load_run_config(None, [override])


def test_bad_toml_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_run_config(tmp_path / "missing.toml")


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = load_run_config(None, ["model.n_kv_heads=4", "data.weights=[0.7, 0.3]"])
    text = config_to_toml(cfg)
    p = tmp_path / "resolved.toml"
    p.write_text(text)
    assert load_config(RunConfig, p) == cfg


def test_field_docs_cover_every_field() -> None:
    rows = describe_config(RunConfig)
    assert any(k == "train.lr" for k, _, _ in rows)
    missing = [k for k, _, doc in rows if not doc]
    assert not missing, f"fields without a docstring: {missing}"
    assert "peak learning rate" in field_docs(type(RunConfig().train))["lr"]


def test_split_overrides() -> None:
    ov, rest = split_overrides(["--train.lr=1", "--model.d_model", "64", "--other", "x"])
    assert ov == ["train.lr=1", "model.d_model=64"]
    assert rest == ["--other", "x"]


def test_cli_help_lists_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demo" in out
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    assert "examples:" in capsys.readouterr().out


def test_cli_module_entry_runs() -> None:
    r = subprocess.run([sys.executable, "-m", "lmforge", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "COMMAND" in r.stdout


def test_default_corpus_is_stdlib() -> None:
    files = default_corpus_files()
    assert len(files) > 100
    assert any(f.name == "os.py" for f in files)
    assert all(f.suffix == ".py" for f in files)


def test_expand_and_read_inputs(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "doc one"}) + "\n" + json.dumps({"text": "doc two"}) + "\n")
    import zstandard

    (tmp_path / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress((json.dumps({"text": "zst doc"}) + "\n").encode())
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["pq one", "pq two"]}), tmp_path / "d.parquet")
    files = expand_inputs([tmp_path])
    assert [f.name for f in files] == ["a.txt", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"]
    docs = [t for f in files for t in iter_texts(f)]
    assert docs == ["hello world", "doc one", "doc two", "zst doc", "pq one", "pq two"]
    assert expand_inputs([str(tmp_path / "*.txt")]) == [tmp_path / "a.txt"]


def test_bad_inputs_one_line(tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match="input not found"):
        expand_inputs([tmp_path / "nope.txt"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(LmforgeError, match=r"bad.jsonl:2: malformed JSON"):
        list(iter_texts(bad))


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    atomic_write_text(target, "old")
    from lmforge.utils import atomic_write

    with pytest.raises(RuntimeError), atomic_write(target, "w") as f:
        f.write("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_cli_and_config_import_without_torch() -> None:
    """`lmforge --help` and config loading stay light: no stage imports torch at import time."""
    code = (
        "import sys, lmforge.cli as c, lmforge.config as k; c.build_parser(); "
        "k.load_run_config(None); print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


@pytest.mark.parametrize(
    "package",
    [
        "utils",
        "tokenizer",
        "data",
        "model",
        "kernels",
        "train",
        "parallel",
        "generate",
        "eval",
        "hf",
    ],
)
def test_public_api_names_resolve(package: str) -> None:
    """Every name a package lists in __all__ (lazily exported or not) can be imported."""
    import importlib

    mod = importlib.import_module(f"lmforge.{package}")
    missing = [n for n in mod.__all__ if getattr(mod, n, None) is None]
    assert not missing, f"lmforge.{package} lists but cannot provide: {missing}"
