"""Readers, HTML extraction, language ID, quality rules and PII masking (lmforge.data)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.data import (
    C4Config,
    Document,
    GopherConfig,
    GopherFilter,
    ReadStats,
    c4_clean,
    extract_text_from_html_bytes,
    gopher_quality_filter,
    identify_language,
    mask_emails,
    mask_ips,
    mask_phone_numbers,
    read_documents,
)
from lmforge.data.quality import gopher_reason

ENGLISH = (
    "The history of the city is long and the people who have lived there with their families "
    "tell many stories about it. In the old days the river was the main road, and boats carried "
    "grain and wood to the market that stood near the bridge. Today the market is a museum, and "
    "visitors come to see the tools, the maps and the paintings that show how life used to be. "
)
PROSE = ENGLISH + (
    "\n\nLater, a railway reached the valley, and with it came new trades: a brewery, a small "
    "printing works and a school for engineers. Some families moved away to larger towns, while "
    "others arrived from the coast looking for work. The square behind the church still keeps "
    "its weekly fair, where farmers sell cheese, apples and honey to anyone who stops by."
)


# ----------------------------------------------------------------------------- PII


@pytest.mark.parametrize(
    "number", ["2831823829", "(283)-182-3829", "(283) 182 3829", "283-182-3829", "283.182.3829"]
)
def test_mask_phone_numbers_us_formats(number: str) -> None:
    text, n = mask_phone_numbers(f"Call me at {number} tomorrow.")
    assert (text, n) == ("Call me at |||PHONE_NUMBER||| tomorrow.", 1)


def test_mask_phone_numbers_leaves_other_digits() -> None:
    for s in ("order 12345678901234", "year 2024", "zip 90210-1234"):
        assert mask_phone_numbers(s) == (s, 0)


def test_mask_emails_and_ips() -> None:
    assert mask_emails("write to jane.doe+x@mail.example.co.uk, or bob@x.org.") == (
        "write to |||EMAIL_ADDRESS|||, or |||EMAIL_ADDRESS|||.",
        2,
    )
    assert mask_emails("no at sign here @ all") == ("no at sign here @ all", 0)
    assert mask_ips("host 192.168.0.1 and 8.8.8.8.") == (
        "host |||IP_ADDRESS||| and |||IP_ADDRESS|||.",
        2,
    )
    assert mask_ips("not 256.1.1.1 nor 1.2.3 nor 1.2.3.4.5")[1] == 0


@settings(max_examples=50, deadline=None)
@given(a=st.integers(0, 255), b=st.integers(0, 255), c=st.integers(0, 255), d=st.integers(0, 255))
def test_mask_ips_every_valid_address(a: int, b: int, c: int, d: int) -> None:
    assert mask_ips(f"x {a}.{b}.{c}.{d} y") == ("x |||IP_ADDRESS||| y", 1)


# ----------------------------------------------------------------------------- quality


def test_gopher_accepts_prose_and_names_each_rejection() -> None:
    assert gopher_reason(PROSE) is None
    assert gopher_reason("only a few words here") == "gopher_too_few_words"
    assert gopher_reason("word " * 100_001) == "gopher_too_many_words"
    assert gopher_reason(" ".join(["a", "ab"] * 40)) == "gopher_mean_word_length"
    assert gopher_reason(" ".join(["extraordinarily"] * 60)) == "gopher_mean_word_length"
    ellipsis = "\n".join(f"the line number {i} goes on and on with the..." for i in range(40))
    assert gopher_reason(ellipsis) in ("gopher_ellipsis_lines", "gopher_symbol_word_ratio")
    numbers = " ".join(["1234", "5678", "the", "and", "to"] * 20)
    assert gopher_reason(numbers) == "gopher_alpha_words"
    hashes = " ".join(["#tag", "there", "and", "of", "to", "with", "people"] * 15)
    assert gopher_reason(hashes) == "gopher_symbol_word_ratio"
    bullets = "\n".join(f"• entry {i} describes another useful product there" for i in range(30))
    assert gopher_reason(bullets) == "gopher_bullet_lines"
    repeated = "\n".join([PROSE] * 4)
    assert gopher_reason(repeated).startswith("gopher_dup")


def test_gopher_thresholds_are_configurable() -> None:
    short = " ".join(ENGLISH.split()[:30])
    assert not gopher_quality_filter(short)
    assert gopher_quality_filter(short, GopherConfig(min_words=10))


def test_gopher_filter_step_counts_reasons_and_excludes() -> None:
    excluded: list[tuple[str, str, str]] = []
    step = GopherFilter(exclusion=lambda d, s, r: excluded.append((d.id, s, r)))
    docs = [Document("a", PROSE), Document("b", "too short")]
    out = list(step.run(docs))
    assert [d.id for d in out] == ["a"]
    assert step.stats.docs_in == 2 and step.stats.docs_out == 1
    assert step.stats.dropped == {"gopher_too_few_words": 1}
    assert excluded == [("b", "gopher", "gopher_too_few_words")]


def test_c4_rules() -> None:
    good = "\n".join(
        [
            "This is the first sentence of the page.",
            "Here comes the second one, also fine!",
            "menu home about",
            "Please enable JavaScript to view this page.",
            "We use cookies. Read our privacy policy.",
            "A third sentence. A fourth sentence. And a fifth one here?",
        ]
    )
    text, reason = c4_clean(good)
    assert reason == "" and text is not None
    assert "menu" not in text and "JavaScript" not in text and "cookies" not in text
    assert c4_clean("lorem ipsum dolor sit amet.")[1] == "c4_lorem_ipsum"
    assert c4_clean("function f() { return 1; }")[1] == "c4_curly_bracket"
    assert c4_clean("One sentence only here.")[1] == "c4_too_few_sentences"
    assert c4_clean("One sentence only here.", C4Config(min_sentences=1))[1] == ""


# ----------------------------------------------------------------------------- language, HTML


@pytest.mark.requires("fasttext")
def test_identify_language_offline_bundled_model() -> None:
    label, score = identify_language(PROSE)
    assert label == "en" and score > 0.8
    assert identify_language("Der schnelle braune Fuchs springt über den faulen Hund.")[0] == "de"
    assert identify_language("这是一个用中文写的句子，用来测试语言识别。")[0] == "zh"


def test_identify_language_loads_with_no_network(tmp_path: Path) -> None:
    # A fresh process with HF offline and every socket connection refused still loads the model.
    code = (
        "import socket\n"
        "def deny(*a, **k): raise RuntimeError('network used')\n"
        "socket.socket.connect = deny\n"
        "from lmforge.data import identify_language\n"
        "print(identify_language('the cat sat on the mat with the dog')[0])\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "en"


@pytest.mark.requires("resiliparse")
def test_extract_text_detects_charset() -> None:
    html = "<html><head><meta charset='windows-1252'></head><body><p>Café crème</p></body></html>"
    assert extract_text_from_html_bytes(html.encode("cp1252")) == "Café crème"
    utf8 = "<html><body><h1>Grüße</h1><p>naïve résumé</p></body></html>".encode()
    text = extract_text_from_html_bytes(utf8)
    assert text is not None and "Grüße" in text and "naïve résumé" in text
    assert extract_text_from_html_bytes(b"") is None


# ----------------------------------------------------------------------------- readers


def test_jsonl_reader_skips_malformed(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl.gz"
    lines = [
        json.dumps({"id": "x", "text": "hello", "url": "u"}),
        "{not json",
        json.dumps({"id": "y"}),
        json.dumps({"id": "z", "text": "world"}),
    ]
    p.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    stats = ReadStats()
    docs = list(read_documents(p, stats=stats))
    assert [(d.id, d.text) for d in docs] == [("x", "hello"), ("z", "world")]
    assert docs[0].metadata["url"] == "u"
    assert stats.malformed == {"bad_json": 1, "no_text": 1}
    # A truncated gzip yields what precedes the cut and is counted, not raised.
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(p.read_bytes()[:-12])
    stats2 = ReadStats()
    list(read_documents(cut, stats=stats2))
    assert stats2.malformed.get("truncated_file", 0) + len(stats2.bad_files) >= 1


def test_zstd_parquet_and_text_readers(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    z = tmp_path / "b.jsonl.zst"
    z.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "zstd doc"}\n'))
    assert [d.text for d in read_documents(z)] == ["zstd doc"]
    pq.write_table(
        pa.table({"text": ["p1", None, "p2"], "id": ["1", "2", "3"]}), tmp_path / "c.parquet"
    )
    stats = ReadStats()
    docs = list(read_documents(tmp_path / "c.parquet", stats=stats))
    assert [(d.id, d.text) for d in docs] == [("1", "p1"), ("3", "p2")]
    assert stats.malformed == {"no_text": 1}
    (tmp_path / "d.txt").write_text("plain text file")
    assert [d.text for d in read_documents(tmp_path / "d.txt")] == ["plain text file"]
    # A missing file is recorded, not raised.
    stats3 = ReadStats()
    assert list(read_documents(tmp_path / "missing.jsonl", stats=stats3)) == []
    assert len(stats3.bad_files) == 1


@pytest.mark.requires("fastwarc")
def test_warc_readers_on_real_and_malformed_files(shared_data: Path) -> None:
    web = shared_data / "web"
    stats = ReadStats()
    docs = list(read_documents(web / "dolma" / "sample-0000.warc.gz", "warc", stats=stats))
    assert len(docs) > 10 and all("html_bytes" in d.metadata for d in docs)
    texts = [extract_text_from_html_bytes(d.metadata["html_bytes"]) for d in docs]
    assert sum(bool(t) for t in texts) > 10
    wet = list(read_documents(web / "cc_whirlwind" / "whirlwind.warc.wet.gz"))
    assert len(wet) == 1 and len(wet[0].text) > 100
    # Deliberately malformed and truncated files: counted and skipped, never raised.
    bad = ReadStats()
    for name in (
        "example-trunc.warc",
        "bad.arc",
        "example-bad.warc.gz.bad",
        "example-wrong-chunks.warc.gz",
    ):
        list(read_documents(web / "warcio" / name, "warc", stats=bad))
    assert bad.files == 4 and sum(bad.malformed.values()) >= 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "bb", "ccc", "the", "x", "river", "ok"]), max_size=60))
def test_vectorised_ngram_stats_match_reference(words: list[str]) -> None:
    from lmforge.data.quality import (
        _dup_ngram_fraction_reference,
        _NgramStats,
        _top_ngram_fraction_reference,
    )

    total = max(sum(len(w) for w in words), 1)
    ng = _NgramStats(words)
    for n in (2, 3, 4):
        assert ng.top_fraction(n) == pytest.approx(_top_ngram_fraction_reference(words, n, total))
    for n in range(5, 11):
        assert ng.dup_fraction(n) == pytest.approx(_dup_ngram_fraction_reference(words, n, total))


@pytest.mark.requires("resiliparse", "trafilatura")
def test_extract_trafilatura_backend_option() -> None:
    html = f"<html><body><nav>Home | About</nav><article><p>{PROSE}</p></article></body></html>"
    text = extract_text_from_html_bytes(html.encode(), backend="trafilatura")
    assert text is not None and "history of the city" in text
    with pytest.raises(ValueError, match="unknown HTML backend"):
        extract_text_from_html_bytes(b"<p>x</p>", backend="lynx")


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=12, alphabet=st.characters(blacklist_categories=("Cs",))),
            st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200),
        ),
        max_size=8,
    )
)
def test_jsonl_write_read_round_trip(tmp_path_factory: pytest.TempPathFactory, rows: list) -> None:
    from lmforge.data.dedup import write_documents

    path = tmp_path_factory.mktemp("rt") / "x.jsonl.gz"
    docs = [Document(i, t, {"k": t[:3]}) for i, t in rows]
    assert write_documents(path, iter(docs), as_text=False) == len(docs)
    back = list(read_documents(path))
    assert [(d.id, d.text, d.metadata) for d in back] == [(d.id, d.text, d.metadata) for d in docs]
