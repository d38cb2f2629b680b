"""Token shards, get_batch, source mixing and sequential evaluation windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.train import MixtureSampler, eval_batches, get_batch, open_shard
from lmforge.train.data import bits_per_byte, bytes_per_token, open_source, write_shard
from lmforge.utils.errors import LmforgeError


def test_get_batch_shapes_and_shift() -> None:
    data = np.arange(100, dtype=np.int64)
    x, y = get_batch(
        data, batch_size=4, context_length=7, device="cpu", rng=np.random.default_rng(0)
    )
    assert x.shape == y.shape == (4, 7)
    assert x.dtype == torch.long and x.device.type == "cpu"
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)  # arange data: the target is the next id
    assert int(x.max()) <= 99 - 1
    # every start is reachable, including the last valid one (len − T − 1)
    xs, _ = get_batch(np.arange(9), batch_size=200, context_length=7, device="cpu")
    assert set(xs[:, 0].tolist()) == {0, 1}


def test_get_batch_invalid_device_raises() -> None:
    with pytest.raises(LmforgeError):
        get_batch(np.arange(100), 2, 4, device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(LmforgeError):
            get_batch(np.arange(100), 2, 4, device="cuda:0")


def test_shard_roundtrip_and_errors(tmp_path: Path) -> None:
    toks = np.arange(1000) % 300
    p = write_shard(tmp_path / "a.bin", toks, vocab_size=300, num_bytes=4000)
    s = open_shard(p)
    assert len(s) == 1000 and s.tokens.dtype == np.uint16 and isinstance(s.tokens, np.memmap)
    assert np.array_equal(np.asarray(s.tokens), toks)
    assert bytes_per_token([s]) == 4.0
    big = write_shard(tmp_path / "b.bin", np.array([70000, 1]), vocab_size=70001)
    assert open_shard(big).tokens.dtype == np.uint32
    with pytest.raises(
        LmforgeError, match=r"vocab_size 300 but the model's model\.vocab_size is 256"
    ):
        open_source(str(tmp_path / "a.bin"), model_vocab_size=256)
    side = tmp_path / "a.bin.json"
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "count": 999}))
    with pytest.raises(LmforgeError, match="sidecar says 999"):
        open_shard(p)
    (tmp_path / "c.bin").write_bytes(b"\0\0")
    with pytest.raises(LmforgeError, match="no sidecar"):
        open_shard(tmp_path / "c.bin")
    with pytest.raises(LmforgeError, match="no token shards"):
        open_source(str(tmp_path / "missing" / "*.bin"))


def test_mixing_weights_give_empirical_proportions(tmp_path: Path) -> None:
    # Source A holds ids < 100, source B ids ≥ 100 (two shards), so each window shows its source.
    a = open_source(str(write_shard(tmp_path / "a.bin", np.arange(5000) % 100, 256)))
    (tmp_path / "b").mkdir()
    write_shard(tmp_path / "b" / "1.bin", 100 + np.arange(3000) % 100, 256)
    write_shard(tmp_path / "b" / "2.bin", 100 + np.arange(800) % 100, 256)
    b = open_source(str(tmp_path / "b"))
    assert len(b) == 2
    sampler = MixtureSampler([a, b], context_length=16, weights=(0.25, 0.75), seed=0)
    x, y = sampler.sample(4000)
    from_b = (x[:, 0] >= 100).mean()
    assert abs(from_b - 0.75) < 0.03
    assert ((x >= 100).all(1) | (x < 100).all(1)).all()  # windows never cross sources
    assert np.array_equal(y[:, :-1], x[:, 1:])
    # default weights: proportional to token counts
    sampler = MixtureSampler([a, b], context_length=16, seed=1)
    from_b = (sampler.sample(4000)[0][:, 0] >= 100).mean()
    assert abs(from_b - 3800 / 8800) < 0.03


def test_sampler_state_resumes_exactly(tmp_path: Path) -> None:
    src = open_source(str(write_shard(tmp_path / "a.bin", np.arange(3000) % 200, 256)))
    s1 = MixtureSampler([src], 8, seed=5)
    s1.sample(3)
    state = json.loads(json.dumps(s1.state_dict()))  # survives a JSON round trip
    expected = s1.sample(3)[0]
    s2 = MixtureSampler([src], 8, seed=99)
    s2.load_state_dict(state)
    assert np.array_equal(s2.sample(3)[0], expected)


def test_mixture_errors(tmp_path: Path) -> None:
    src = open_source(str(write_shard(tmp_path / "a.bin", np.arange(100), 256)))
    with pytest.raises(LmforgeError, match=r"data\.weights has 2 entries"):
        MixtureSampler([src], 8, weights=(1.0, 2.0))
    with pytest.raises(LmforgeError, match="context_length"):
        MixtureSampler([src], 500)


def test_eval_windows_sequential_and_deterministic(tmp_path: Path) -> None:
    src = open_source(str(write_shard(tmp_path / "v.bin", np.arange(100), 256)))
    batches = list(eval_batches(src, batch_size=3, context_length=10, max_batches=100))
    again = list(eval_batches(src, batch_size=3, context_length=10, max_batches=100))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(batches, again))
    xs = np.concatenate([b[0] for b in batches])
    ys = np.concatenate([b[1] for b in batches])
    assert xs.shape == (9, 10)  # windows start at 0, 10, …, 80 (each needs T + 1 tokens)
    assert np.array_equal(xs[:, 0], np.arange(0, 90, 10))
    assert np.array_equal(ys, xs + 1)
    assert len(list(eval_batches(src, 3, 10, max_batches=2))) == 2


def test_bits_per_byte() -> None:
    import math

    assert bits_per_byte(math.log(2), 1.0) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 4.0) == pytest.approx(2.0 / (math.log(2) * 4.0))


def test_out_of_vocabulary_ids_fail_with_one_line(tmp_path) -> None:
    # write_shard refuses ids past the vocabulary; a shard corrupted afterwards is caught when
    # a batch is sampled, on the host, before any kernel reads the ids.
    import numpy as np
    import pytest

    from lmforge.train.data import MixtureSampler, open_shard, write_shard
    from lmforge.utils.errors import LmforgeError

    with pytest.raises(LmforgeError, match=r"token ids must lie in \[0, 50\)"):
        write_shard(tmp_path / "bad.bin", np.array([1, 2, 50]), 50)
    path = write_shard(tmp_path / "ok.bin", np.arange(40) % 50, 50)
    raw = bytearray(path.read_bytes())
    raw[10:12] = (60000).to_bytes(2, "little")  # corrupt one uint16 id
    path.write_bytes(bytes(raw))
    sampler = MixtureSampler([[open_shard(path)]], 39, vocab_size=50)
    with pytest.raises(LmforgeError, match=r"token id 60000 .* outside the model's vocabulary"):
        sampler.sample(1)
