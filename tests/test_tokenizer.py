"""Tokenizer: training vs the slow reference, encode vs reference/tiktoken/HF, streaming, formats."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmforge.tokenizer import (
    Tokenizer,
    bytes_to_unicode,
    save_hf_tokenizer_json,
    tiktoken_compatible,
    to_tiktoken,
    train_bpe,
)
from lmforge.tokenizer._reference import reference_encode, reference_train
from lmforge.tokenizer.tokenizer import token_to_str
from lmforge.utils.errors import LmforgeError

EOT = "<|endoftext|>"
HSET = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Text that exercises every branch of the pattern: contractions, letters with and without a
# leading space, digits, punctuation runs, whitespace runs before words and at the end, unicode.
_PIECES = [
    "the",
    " the",
    "cat",
    " sat",
    "don't",
    " we'll",
    "I'm",
    "they're",
    "'ve",
    "'s",
    "héllo",
    " naïve",
    "日本語",
    " 東京",
    "😀",
    " 🎉🎉",
    "123",
    " 4567",
    "3.14",
    "!!",
    " ...",
    "?",
    "@#$",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    " \n ",
    "\r\n",
    "\u00a0",
    "\u3000",
    "x",
    "ß",
    "Ω",
    "'",
]


def _make_text(seed: int, n: int, special_every: int = 0) -> str:
    """Deterministic mixed text: a Zipf-ish choice of pieces and random words, optional specials."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzéü"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(400)]
    out = []
    for i in range(n):
        if special_every and i % special_every == special_every - 1:
            out.append(EOT)
        elif rng.random() < 0.35:
            out.append(rng.choice(_PIECES))
        else:
            w = words[min(int(rng.paretovariate(1.0)) - 1, len(words) - 1)]
            out.append(rng.choice(["", " ", " ", "\n"]) + w)
    return "".join(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    """A tokenizer with ~2700 merges trained on generated text, saved to a folder."""
    d = tmp_path_factory.mktemp("tok")
    corpus = d / "corpus.txt"
    corpus.write_text(_make_text(0, 120_000, special_every=500), encoding="utf-8")
    vocab, merges = train_bpe(corpus, 3000, [EOT], workers=2, chunk_bytes=64 << 10)
    assert len(merges) == 3000 - 257
    tok = Tokenizer(vocab, merges, [EOT])
    tok.save(d / "saved")
    return tok, d


# ------------------------------------------------------------------------- training
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_train_matches_reference(tmp_path: Path, seed: int) -> None:
    text = _make_text(seed, 1500, special_every=97)
    p = tmp_path / "c.txt"
    p.write_text(text, encoding="utf-8")
    got = train_bpe(p, 420, [EOT], workers=1)
    assert got == reference_train(text, 420, [EOT])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.one_of(
        st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=300),
        st.lists(st.sampled_from([*_PIECES, EOT, "aaaa", "abab", "  "]), min_size=1, max_size=80)
        .map("".join)
        .filter(lambda t: t.replace(EOT, "")),
    )
)
def test_train_matches_reference_on_any_text(tmp_path: Path, text: str) -> None:
    """Arbitrary text (every byte value, repeated-token runs like "aaaa"/"abab", specials)."""
    p = tmp_path / "h.txt"
    p.write_bytes(text.encode("utf-8"))
    assert train_bpe(p, 300, [EOT], workers=1) == reference_train(text, 300, [EOT])


@HSET
@given(tokens=st.lists(st.binary(min_size=1, max_size=4), max_size=30))
def test_heap_key_orders_bytes_descending(tokens: list[bytes]) -> None:
    from lmforge.tokenizer.train import _desc_key

    tokens += [t[:1] for t in tokens] + [b"\x00", b"\xff", b"\xff\xff"]  # prefixes, extremes
    assert sorted(tokens, key=_desc_key) == sorted(tokens, reverse=True)


def test_train_tie_break_prefers_greater_pair(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    # (a, b), (" ", c) and (c, d) all occur twice; ties go to the greatest pair as bytes: (c, d).
    p.write_text("ab cd ab cd", encoding="utf-8")
    _, merges = train_bpe(p, 257, workers=1)
    assert merges == [(b"c", b"d")]
    p.write_text("xab xcd", encoding="utf-8")
    _, merges = train_bpe(p, 257, workers=1)
    assert merges == [(b"x", b"c")]  # every pair occurs once; (x, c) is the greatest


def test_train_never_merges_across_pretokens_or_specials(tmp_path: Path) -> None:
    p = tmp_path / "s.txt"
    # Pre-tokens: "a" (x50, between specials), " x", ".", " y", "!", " z": the only pairs
    # are a space followed by a letter.
    p.write_text(("a" + EOT) * 50 + " x. y! z", encoding="utf-8")
    vocab, merges = train_bpe(p, 300, [EOT], workers=1)
    assert sorted(merges) == [(b" ", b"x"), (b" ", b"y"), (b" ", b"z")]
    assert vocab[len(vocab) - 1] == EOT.encode() and len(vocab) == 256 + 3 + 1


def test_train_parallel_chunks_and_file_lists_agree(tmp_path: Path) -> None:
    docs = [_make_text(10 + i, 400) for i in range(4)]
    whole = tmp_path / "all.txt"
    whole.write_text(EOT.join(docs), encoding="utf-8")
    one = train_bpe(whole, 600, [EOT], workers=1)
    many = train_bpe(whole, 600, [EOT], workers=2, chunk_bytes=700)
    assert one == many
    parts = []
    for i, doc in enumerate(docs):
        q = tmp_path / f"d{i}.txt"
        q.write_text(doc, encoding="utf-8")
        parts.append(q)
    assert train_bpe(parts, 600, [EOT], workers=1) == one


def test_chunk_boundaries_without_specials_keep_pretokens(tmp_path: Path) -> None:
    # No special token at all: chunks cut at a newline between printable characters.
    text = _make_text(5, 3000).replace(EOT, "")
    p = tmp_path / "n.txt"
    p.write_text(text, encoding="utf-8")
    assert train_bpe(p, 400, workers=1) == train_bpe(p, 400, workers=1, chunk_bytes=300)
    assert train_bpe(p, 400, workers=1, chunk_bytes=300) == reference_train(text, 400)


def test_train_errors(tmp_path: Path) -> None:
    p = tmp_path / "c.txt"
    p.write_text("hello world", encoding="utf-8")
    with pytest.raises(LmforgeError, match="too small"):
        train_bpe(p, 256, [EOT])
    with pytest.raises(LmforgeError, match="input not found"):
        train_bpe(tmp_path / "missing.txt", 300)
    empty = tmp_path / "e.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(LmforgeError, match="empty corpus"):
        train_bpe(empty, 300)
    only = tmp_path / "o.txt"
    only.write_text(EOT * 3, encoding="utf-8")
    with pytest.raises(LmforgeError, match="empty corpus"):
        train_bpe(only, 300, [EOT])


# ------------------------------------------------------------------------- encoding
def test_encode_matches_reference_and_round_trips(trained: tuple[Tokenizer, Path]) -> None:
    tok, _ = trained
    text = _make_text(99, 3000, special_every=300)
    ids = tok.encode(text)
    assert ids == reference_encode(text, tok.vocab, tok.merges, [EOT])
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 1.4  # the merges compress held-out text
    assert tok.eot_id == tok.vocab_size - 1 and tok.special_tokens == [EOT]


@HSET
@given(text=st.text(max_size=200))
def test_encode_decode_round_trip(trained: tuple[Tokenizer, Path], text: str) -> None:
    tok, _ = trained
    assert tok.decode(tok.encode(text)) == text


def test_decode_invalid_utf8_is_replacement_char(trained: tuple[Tokenizer, Path]) -> None:
    tok, _ = trained
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a truncated 3-byte sequence
    assert tok.decode([ord("a"), 0xFF, ord("b")]) == "a\ufffdb"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.decode([10**6])


def test_overlapping_special_tokens_longest_wins() -> None:
    vocab = {i: bytes([i]) for i in range(256)}
    tok = Tokenizer(vocab, [], [EOT, EOT + EOT, "<|"])
    ids = tok.encode(f"a{EOT}{EOT}{EOT}b<|c")
    s1, s2, s3 = (tok.special_ids[s] for s in (EOT, EOT + EOT, "<|"))
    assert ids == [ord("a"), s2, s1, ord("b"), s3, ord("c")]
    assert tok.decode(ids) == f"a{EOT}{EOT}{EOT}b<|c"


@HSET
@given(
    text=st.one_of(
        st.lists(st.sampled_from([*_PIECES, EOT, "<|endof", "text|>"]), max_size=60).map("".join),
        st.text(max_size=80),
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
)
def test_encode_iterable_equals_encode(
    trained: tuple[Tokenizer, Path], text: str, cuts: list[int]
) -> None:
    tok, _ = trained
    text = text * 40  # long enough to cross the streaming buffer's threshold several times
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert list(tok.encode_iterable(iter(pieces))) == tok.encode(text)


def test_encode_iterable_streams_a_file(trained: tuple[Tokenizer, Path], tmp_path: Path) -> None:
    tok, _ = trained
    text = _make_text(7, 20_000, special_every=1000)
    p = tmp_path / "big.txt"
    p.write_text(text, encoding="utf-8")
    with open(p, encoding="utf-8", newline="") as f:
        streamed = list(tok.encode_iterable(f))
    assert streamed == tok.encode(text)


# ------------------------------------------------------------------------- files and exports
def test_save_load_and_gpt2_files(trained: tuple[Tokenizer, Path]) -> None:
    tok, d = trained
    loaded = Tokenizer.load(d / "saved")
    assert loaded.vocab == tok.vocab and loaded.merges == tok.merges
    assert loaded.sha256 == tok.sha256 == tok.fingerprint()
    again = Tokenizer.from_files(d / "saved" / "vocab.json", d / "saved" / "merges.txt", [EOT])
    assert again.sha256 == tok.sha256
    text = _make_text(3, 500, special_every=50)
    assert loaded.encode(text) == tok.encode(text)


def _write_gpt2_layout(tok: Tokenizer, d: Path) -> tuple[Path, Path]:
    """GPT-2's own id layout: single bytes in bytes_to_unicode order, merges, eot last."""
    b2u = bytes_to_unicode()
    enc = {b2u[b]: i for i, b in enumerate(b2u)}
    for a, b in tok.merges:
        enc[token_to_str(a + b)] = len(enc)
    enc[EOT] = len(enc)
    (d / "encoder.json").write_text(json.dumps(enc), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{token_to_str(a)} {token_to_str(b)}" for a, b in tok.merges]
    (d / "vocab.bpe").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d / "encoder.json", d / "vocab.bpe"


def _tiktoken_from_gpt2_files(encoder_json: Path, vocab_bpe: Path):
    """A tiktoken Encoding built from GPT-2-format files exactly the way tiktoken builds "gpt2"
    (its data_gym loader, the r50k pattern, eot last), reading local files, no network."""
    import os

    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # read the local files, cache nothing
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder_json))
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old
    n = len(ranks) + 1
    return tiktoken.Encoding(
        "gpt2-offline",
        explicit_n_vocab=n,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={EOT: n - 1},
    )


@pytest.fixture(scope="module")
def gpt2_pair(trained: tuple[Tokenizer, Path]):
    """(our Tokenizer.from_files, tiktoken) from the same GPT-2-layout files of the trained merges."""
    tok, d = trained
    g = d / "gpt2"
    g.mkdir(exist_ok=True)
    enc_json, vocab_bpe = _write_gpt2_layout(tok, g)
    return Tokenizer.from_files(enc_json, vocab_bpe, [EOT]), _tiktoken_from_gpt2_files(
        enc_json, vocab_bpe
    )


_ANY_TEXT = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from([*_PIECES, EOT, " ", "  ", "a", "ab"]), max_size=80).map("".join),
)


@HSET
@given(text=_ANY_TEXT)
def test_gpt2_files_match_tiktoken(gpt2_pair, text: str) -> None:
    ours, ref = gpt2_pair
    assert ours.encode(text) == ref.encode(text, allowed_special="all")


@HSET
@given(text=_ANY_TEXT)
def test_tiktoken_export_matches(trained: tuple[Tokenizer, Path], text: str) -> None:
    tok, _ = trained
    enc = _export(tok)
    assert enc.encode(text, allowed_special="all") == tok.encode(text)


_EXPORTS: dict[str, object] = {}


def _export(tok: Tokenizer):
    if tok.sha256 not in _EXPORTS:
        _EXPORTS[tok.sha256] = to_tiktoken(tok)
    return _EXPORTS[tok.sha256]


@pytest.fixture(scope="module")
def hf_tok(trained: tuple[Tokenizer, Path]):
    from tokenizers import Tokenizer as HFTokenizer

    tok, d = trained
    path = save_hf_tokenizer_json(tok, d / "hf" / "tokenizer.json")
    return HFTokenizer.from_file(str(path))


@HSET
@given(text=_ANY_TEXT)
def test_hf_tokenizer_json_matches(trained: tuple[Tokenizer, Path], hf_tok, text: str) -> None:
    tok, _ = trained
    assert hf_tok.encode(text, add_special_tokens=False).ids == tok.encode(text)


# ------------------------------------------------------------------------- real GPT-2 files
GPT2_ASSETS = Path(__file__).resolve().parent / "assets" / "gpt2"
# tiktoken caches each downloaded file under sha1(url); these are the names for the two URLs of
# tiktoken_ext/openai_public.py:gpt2() (checked against that file in _gpt2_cache_names).
_GPT2_CACHE_NAMES = {
    "vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
    "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",
}
_GPT2_REAL: dict[str, object] = {}  # the real "gpt2" Encoding, loaded once per session


def _gpt2_cache_names() -> dict[str, str]:
    """{asset file name: cache file name}, computed from the URLs in tiktoken's gpt2()."""
    import hashlib
    import inspect

    from tiktoken_ext import openai_public

    urls = re.findall(r'"(https://[^"]+)"', inspect.getsource(openai_public.gpt2))
    names = {u.rsplit("/", 1)[1]: hashlib.sha1(u.encode()).hexdigest() for u in urls}
    assert names == _GPT2_CACHE_NAMES, names
    return names


@pytest.fixture
def gpt2_tiktoken(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """tiktoken's REAL "gpt2" encoding, offline: ``tiktoken.get_encoding("gpt2")`` reads
    tests/assets/gpt2 from a temporary TIKTOKEN_CACHE_DIR and checks the pinned SHA-256 itself;
    the conftest network guard (function scope, active here) fails the test on any download.
    Loaded once and kept, since each load costs ~0.5 s; tiktoken's registry is left untouched."""
    import shutil

    import tiktoken
    import tiktoken.registry

    if "gpt2" not in _GPT2_REAL:
        cache = tmp_path_factory.mktemp("tiktoken-cache")
        for asset, name in _gpt2_cache_names().items():
            shutil.copyfile(GPT2_ASSETS / asset, cache / name)
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        # A fresh registry, so "gpt2" cannot come from an earlier load (restored at teardown).
        monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
        _GPT2_REAL["gpt2"] = tiktoken.get_encoding("gpt2")
    return _GPT2_REAL["gpt2"]


@pytest.fixture(scope="module")
def gpt2_ours() -> Tokenizer:
    """lmforge's Tokenizer from the real encoder.json + vocab.bpe (50,000 merges)."""
    return Tokenizer.from_files(GPT2_ASSETS / "encoder.json", GPT2_ASSETS / "vocab.bpe", [EOT])


def test_gpt2_assets_are_the_real_files(gpt2_ours: Tokenizer, gpt2_tiktoken) -> None:
    from lmforge.utils.io import file_sha256

    # The SHA-256 digests tiktoken pins for its "gpt2" encoding.
    assert file_sha256(GPT2_ASSETS / "vocab.bpe") == (
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
    )
    assert file_sha256(GPT2_ASSETS / "encoder.json") == (
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
    )
    assert gpt2_tiktoken.name == "gpt2" and gpt2_tiktoken.n_vocab == 50257
    assert gpt2_ours.eot_id == 50256 == gpt2_tiktoken.eot_token
    assert gpt2_ours.vocab_size == 50257 and len(gpt2_ours.merges) == 50000
    assert tiktoken_compatible(gpt2_ours) is None
    # The export rebuilds exactly tiktoken's ranks and specials from our vocabulary.
    exported = _export(gpt2_ours)
    assert exported._mergeable_ranks == gpt2_tiktoken._mergeable_ranks
    assert exported._special_tokens == gpt2_tiktoken._special_tokens


_GPT2_TEXT = st.one_of(
    st.text(max_size=300),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=120),
    st.lists(
        st.one_of(
            st.sampled_from(
                [*_PIECES, EOT, "<|endoftext", "|>", "   ", "\n\n\n", " \t ", "1234567890"]
            ),
            st.integers(min_value=0, max_value=10**12).map(str),
            st.text(alphabet=" \t\n\r\x0b\x0c\u00a0\u2028\u3000", min_size=1, max_size=8),
            st.text(alphabet=st.characters(categories=["L", "N", "P", "S"]), max_size=8),
        ),
        max_size=60,
    ).map("".join),
)


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(text=_GPT2_TEXT)
def test_real_gpt2_matches_tiktoken(gpt2_ours: Tokenizer, gpt2_tiktoken, text: str) -> None:
    """Loaded from GPT-2's own files, encode returns exactly tiktoken "gpt2"'s ids; the tiktoken
    export gives the same ids; decode inverts both."""
    ref = gpt2_tiktoken.encode(text, allowed_special="all")
    ids = gpt2_ours.encode(text)
    assert ids == ref
    assert _export(gpt2_ours).encode(text, allowed_special="all") == ref
    assert gpt2_ours.decode(ids) == text == gpt2_tiktoken.decode(ref)


@HSET
@given(ids=st.lists(st.integers(min_value=0, max_value=50256), max_size=50))
def test_real_gpt2_decode_matches_tiktoken(gpt2_ours: Tokenizer, gpt2_tiktoken, ids) -> None:
    """Any id sequence (including partial UTF-8 sequences) decodes as tiktoken does."""
    assert gpt2_ours.decode(ids) == gpt2_tiktoken.decode(ids)


def _check_long_text(ours: Tokenizer, ref, text: str) -> list[int]:
    ids = ours.encode(text)
    assert ids == ref.encode(text, allowed_special="all")
    assert _export(ours).encode(text, allowed_special="all") == ids
    assert ours.decode(ids) == text
    return ids


def test_real_gpt2_long_generated_text(gpt2_ours: Tokenizer, gpt2_tiktoken) -> None:
    text = _make_text(11, 20_000, special_every=100)
    text += "".join(f" {i} {i * 7919} x{i}'s we'll\n" for i in range(2000))
    _check_long_text(gpt2_ours, gpt2_tiktoken, text)


def test_real_gpt2_on_a_book(gpt2_ours: Tokenizer, gpt2_tiktoken, shared_data: Path) -> None:
    book = shared_data / "text" / "gutenberg" / "Carroll_Alice_s_Adventures_in_Wonderland.txt"
    if not book.is_file():
        pytest.skip(f"{book} not found")
    text = book.read_text(encoding="utf-8", errors="replace")
    ids = _check_long_text(gpt2_ours, gpt2_tiktoken, text + EOT + text[:5000])
    assert ids.count(50256) == 1
    assert len(ids) < len(text.encode("utf-8")) / 3  # ~3.4 bytes/token on this book


def test_export_refuses_incompatible_layout() -> None:
    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256] = b"ab"
    vocab[257] = b"ab" + b"c"
    merges = [(b"ab", b"c"), (b"a", b"b")]  # merged ids do not rise with merge order
    tok = Tokenizer(vocab, merges)
    assert tiktoken_compatible(tok) is not None
    with pytest.raises(LmforgeError, match="cannot export"):
        to_tiktoken(tok)


@pytest.mark.parametrize(
    ("vocab_text", "merges_text", "match"),
    [
        ("{not json", "#version: 0.2\n", "not valid JSON"),
        ('{"a": "x"}', "#version: 0.2\n", "expected an int"),
        ('{"a": 0, "b": 0}', "#version: 0.2\n", "used twice"),
        ('{"a": 0}', "#version: 0.2\n", "lacks 255 of the 256 single bytes"),
        (None, "#version: 0.2\na b c\n", "expected two byte-mapped tokens"),
        (None, "#version: 0.2\nq z\n", "not in the vocabulary"),
    ],
)
def test_corrupt_gpt2_files(tmp_path: Path, vocab_text, merges_text: str, match: str) -> None:
    if vocab_text is None:
        vocab_text = json.dumps({c: b for b, c in bytes_to_unicode().items()})
    (tmp_path / "vocab.json").write_text(vocab_text, encoding="utf-8")
    (tmp_path / "merges.txt").write_text(merges_text, encoding="utf-8")
    with pytest.raises(LmforgeError, match=match):
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_load_detects_edited_files(trained: tuple[Tokenizer, Path], tmp_path: Path) -> None:
    import shutil

    _, d = trained
    shutil.copytree(d / "saved", tmp_path / "t")
    m = tmp_path / "t" / "merges.txt"
    lines = m.read_text(encoding="utf-8").splitlines()
    m.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")  # drop the last merge
    with pytest.raises(LmforgeError, match="sha256"):
        Tokenizer.load(tmp_path / "t")
    with pytest.raises(LmforgeError, match="not an lmforge tokenizer"):
        Tokenizer.load(tmp_path)


def test_encode_iterable_is_lazy(trained: tuple[Tokenizer, Path]) -> None:
    """Ids come out while the input is still being read: memory does not grow with the input."""
    tok, _ = trained
    consumed = 0

    def chunks():
        nonlocal consumed
        for i in range(10_000):
            consumed += 1
            yield f"line {i}: the cat sat on the mat, don't worry.\n"

    it = tok.encode_iterable(chunks())
    first = [next(it) for _ in range(10)]
    assert consumed < 200 and first == tok.encode("line 0: the cat sat on the mat")[:10]
    rest = list(it)
    assert consumed == 10_000 and len(first) + len(rest) > 100_000


def test_chunk_plan_cuts_on_special_tokens(tmp_path: Path) -> None:
    from lmforge.tokenizer._pretokenize import plan_tasks

    p = tmp_path / "docs.txt"
    data = EOT.join(_make_text(s, 300).replace(EOT, "") for s in range(20)).encode()
    p.write_bytes(data)
    ranges = [r for task in plan_tasks([p], [EOT], 2000) for r in task]
    assert len(ranges) > 3
    assert ranges[0][1] == 0 and ranges[-1][2] == len(data)
    last_eot = data.rfind(EOT.encode())
    for (_, _, end), (_, start, _) in itertools.pairwise(ranges):
        assert end == start
        if start <= last_eot:  # a special token lies ahead: the cut is on it
            assert data[start:].startswith(EOT.encode())
        else:  # none left: a newline between printable characters
            assert data[start - 1 : start] == b"\n" and 0x21 <= data[start] <= 0x7E
    # Without special tokens the cut is after a newline between two printable characters.
    q = tmp_path / "plain.txt"
    q.write_bytes(b"word\n" * 2000)
    ranges = [r for task in plan_tasks([q], [], 1000) for r in task]
    assert len(ranges) > 3
    for _, start, _ in ranges[1:]:
        assert q.read_bytes()[start - 1 : start + 1] == b"\nw"
