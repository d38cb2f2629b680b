"""Incremental detokenization and stop strings: the pieces equal the full decode (UTF-8 split
across tokens held back), the windowed decoder reads O(new tokens), the stop matcher equals a
token-by-token full-text reference, and the engine ends samples on stop strings (spanning token
boundaries) with the text before them and its blocks freed at once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.detok import IncrementalDetokenizer, StopMatcher, make_detokenizer
from lmforge.tokenizer import Tokenizer
from lmforge.utils import LmforgeError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], SPECIALS)


class _DecodeOnly:
    """The same tokenizer seen only through ``decode`` (forces the windowed decoder)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.longest = 0

    def decode(self, ids: list[int]) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids)


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.feed(t) for t in ids] + [detok.flush()]


_TEXT = st.text(alphabet=st.sampled_from("ab é€😀\n"), max_size=40)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(_TEXT, st.lists(st.integers(0, 255), max_size=6))
def test_pieces_equal_the_full_decode_and_hold_incomplete_characters(text: str, junk) -> None:
    tok = _byte_tokenizer()
    ids = list(text.encode("utf-8"))  # one token per byte: every multi-byte character is split
    for detok in (make_detokenizer(tok), make_detokenizer(_DecodeOnly(tok), prompt_ids=[97, 98])):
        pieces = _run(detok, ids)
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)  # nothing released half-decoded
    # Invalid bytes too: the byte path replaces exactly as tokenizer.decode does.
    bad = ids + junk
    assert "".join(_run(make_detokenizer(tok), bad)) == tok.decode(bad)


def test_windowed_decoder_reads_only_the_new_tokens() -> None:
    tok = _DecodeOnly(_byte_tokenizer())
    detok = make_detokenizer(tok, prompt_ids=list(b"a prompt of many tokens"))
    text = ("word é€ " * 200).encode()
    out = "".join(_run(detok, list(text)))
    assert out == text.decode()
    assert tok.longest <= 5 + 4  # the prompt context plus one character's bytes, never the output


def _reference_stop(pieces: list[str], stops: list[str]) -> tuple[str, int | None]:
    """Token-by-token on the full text: the cut at the first step whose text holds a stop."""
    for k in range(1, len(pieces) + 1):
        text = "".join(pieces[:k])
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)], k
    return "".join(pieces), None


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    st.lists(st.text(alphabet="abc", max_size=3), max_size=12),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_matcher_equals_the_full_text_reference(pieces: list[str], stops: list[str]) -> None:
    want, at = _reference_stop(pieces, stops)
    m = StopMatcher(stops)
    released = ""
    for k, p in enumerate(pieces, 1):
        got, hit = m.feed(p)
        released += got
        assert want.startswith(released)  # never past the cut, never text that is taken back
        if hit is not None:
            assert k == at and hit in stops
            break
    else:
        assert at is None
        released += m.flush()
    assert released == want


def _model(vocab: int = 259) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2
    )
    return TransformerLM(cfg).eval()


def test_engine_stop_string_across_tokens_frees_blocks_at_once() -> None:
    tok = _byte_tokenizer()
    model = _model()
    prompt = tok.encode("The stop test: ")
    free = Engine(model, block_size=4, tokenizer=tok)
    base = free.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    text = base.text
    assert text == tok.decode(base.token_ids) and len(text) >= 8
    stop = text[4:7]  # three one-byte tokens: the match spans token boundaries
    cut = text.find(stop)
    engine = Engine(model, block_size=4, tokenizer=tok)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        done = [o for o in outs if o.finished]
    assert engine.allocator.num_used == 0  # freed in the step that matched
    out = done[0].outputs[0]
    assert done[0].request_id == rid and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    # Tokens up to the one that completed the stop string (one byte per token here), no more.
    assert out.token_ids == base.token_ids[: cut + len(stop)]
    assert steps == cut + len(stop)


def test_engine_text_is_the_decode_for_sampled_multibyte_output() -> None:
    """Sampled bytes are often invalid or split UTF-8: the released text is still exactly the
    decode of the ids (EOS excluded), streamed pieces never show a half character."""
    tok = _byte_tokenizer()
    eos = tok.special_ids["<|im_end|>"]
    engine = Engine(_model(), block_size=8, eos_token_id=eos, tokenizer=tok)
    prompts = [tok.encode(p) for p in ("é€", "😀 x", "plain")]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=30, n=3, seed=5))
    for out in outs:
        for o in out.outputs:
            ids = o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids
            assert o.text == tok.decode(ids)
    assert engine.allocator.num_used == 0


def test_engine_stops_need_a_tokenizer_and_valid_strings() -> None:
    engine = Engine(_model(), block_size=8)
    with pytest.raises(LmforgeError, match="stop strings need an engine with a tokenizer"):
        engine.add_request([1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="list of strings"):
        SamplingParams(stop="x")  # type: ignore[arg-type]
    out = engine.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert out.text_pieces == [] and len(out.token_ids) == 3  # ids-only engine: no text


def _sentencepiece_like(tmp_path) -> object:
    """An HF ``tokenizers`` tokenizer decoding as SentencePiece does: '▁' is a space, the
    leading one is stripped, and <0xNN> byte-fallback tokens carry UTF-8 split over tokens."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models

    from lmforge.hf.tokenizer import HFTokenizer

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "<0xC3>": 3, "<0xA9>": 4, "▁": 5, "x": 6}
    t = HF(models.WordLevel(vocab, unk_token="<unk>"))
    t.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    t.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path)


def test_windowed_decoder_on_a_sentencepiece_style_tokenizer(tmp_path) -> None:
    """In context: the text a stream shows equals decode(prompt + output) past the prompt's
    text (a leading '▁' is a space, as it reads after the prompt); split UTF-8 bytes are held
    back until the character is whole."""
    tok = _sentencepiece_like(tmp_path)
    prompt = [1]  # "hello"

    @settings(max_examples=80, deadline=None, derandomize=True, database=None)
    @given(st.lists(st.sampled_from([1, 2, 5, 6, 34]), max_size=12))
    def check(words: list[int]) -> None:
        ids = [t for w in words for t in ((3, 4) if w == 34 else (w,))]  # 34: 'é' as 2 bytes
        pieces = _run(make_detokenizer(tok, prompt_ids=prompt), ids)
        full = tok.decode(prompt + ids)
        assert "".join(pieces) == full[len(tok.decode(prompt)) :]
        assert not any("\ufffd" in p for p in pieces)

    check()
    pieces = _run(make_detokenizer(tok, prompt_ids=prompt), [2, 3, 4, 1])
    assert pieces[:3] == [" world", "", "é"] and "".join(pieces) == " worldé hello"


def test_output_processor_stop_strings_eos_and_n() -> None:
    """The server's output processor: a stop string spanning deltas ends its sample at the
    token completing it (ids and text cut there, later deltas ignored); an EOS-ended sample
    does not show the EOS token as text; each of n samples ends on its own."""
    from lmforge.serve.output import Delta, OutputProcessor, SampleDelta
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|eos|>"])
    eos = tok.special_ids["<|eos|>"]
    ids = list(b"hello STOP more")
    proc = OutputProcessor(tok, tok.encode("p"), 2, ["STOP"])

    def delta(i: int, part: list[int], finish: str | None = None) -> Delta:
        return Delta([SampleDelta(i, part, [-0.5] * len(part), [], finish)], False)

    a = proc.process([delta(0, ids[:8]), delta(1, [*b"ok", eos], "stop")])
    assert a[0].text == "hello " and a[0].finish_reason is None  # "ST" held back
    assert a[1].text == "ok" and a[1].finish_reason == "stop" and a[1].token_ids[-1] == eos
    b = proc.process([delta(0, ids[8:12]), delta(0, ids[12:])])
    assert b[0].text == "" and b[0].finish_reason == "stop"
    assert b[0].token_ids == ids[8:10] and proc.finished  # ends at the token completing STOP
    assert proc.process([delta(0, [1, 2])]) == {}  # a finished sample adds nothing
