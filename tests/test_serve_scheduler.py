"""The engine's scheduler alone, in plain Python (no torch is imported by this file or by
``lmforge.serve.scheduler``): admission, chunked prefill under the token budget, preemption by
recompute, the prefix cache and its token comparison, n-sample prompt sharing, blocks given
back behind a sliding window."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from lmforge.serve.blocks import BlockAllocator, block_keys
from lmforge.serve.scheduler import Scheduler, Seq, check_fits
from lmforge.utils.errors import LmforgeError

_arrivals = itertools.count()


def _seq(tokens: list[int], rid: str = "r", index: int = 0, first: Seq | None = None) -> Seq:
    return Seq(rid, index, list(tokens), len(tokens), next(_arrivals), first=first)


def _run(sched: Scheduler, chosen: list[tuple[Seq, int]], new_token: int = 7) -> list[Seq]:
    """What the engine does after a forward: advance, then every ready sequence samples."""
    sched.inputs(chosen)  # also checks that every written block is the sequence's own
    ready = [seq for _, seq in sched.advance(chosen)]
    for seq in ready:
        seq.tokens.append(new_token)
    return ready


def test_scheduler_imports_no_torch() -> None:
    code = "import sys, lmforge.serve.scheduler; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_chunked_prefill_under_the_budget_mixed_with_decodes() -> None:
    sched = Scheduler(64, 4, max_num_batched_tokens=8)
    a, b = _seq(list(range(3))), _seq(list(range(100, 120)))
    sched.add([a, b])
    first = sched.schedule()
    assert [(s is a, n) for s, n in first] == [(True, 3), (False, 5)]  # b starts on the rest
    assert _run(sched, first) == [a]
    second = sched.schedule()  # a decodes one token, b's next chunk fills the budget
    assert [(s is a, n) for s, n in second] == [(True, 1), (False, 7)]
    inputs = sched.inputs(second)
    assert inputs.q_lens == [1, 7] and inputs.ctx_lens == [4, 12]
    assert inputs.positions == [3, *range(5, 12)] and inputs.last_rows == [0, 7]
    assert inputs.slots[0] == a.blocks[0] * 4 + 3
    _run(sched, second)
    third = sched.schedule()
    assert [(s is a, n) for s, n in third] == [(True, 1), (False, 7)]
    _run(sched, third)
    assert [(s is b, n) for s, n in sched.schedule()] == [(False, 1), (True, 1)]


def test_admission_is_fcfs_and_stops_at_the_first_that_does_not_fit() -> None:
    sched = Scheduler(4, 4, max_num_batched_tokens=64)
    big, small = _seq(list(range(20))), _seq([1, 2])  # big needs 5 blocks of the 4
    sched.add([big, small])
    assert sched.schedule() == []  # nobody overtakes the head of the queue
    assert sched.allocator.num_used == 0 and list(sched.waiting) == [big, small]


def test_preemption_by_recompute_frees_the_latest_and_resumes_it() -> None:
    sched = Scheduler(3, 4, max_num_batched_tokens=64, enable_prefix_cache=False)
    a, b = _seq([1, 2, 3]), _seq([4, 5, 6])
    sched.add([a, b])
    _run(sched, sched.schedule())  # both prefilled: one block each, 4 tokens each now
    _run(sched, sched.schedule())  # both decode into their block's last slot... 5 tokens each
    chosen = sched.schedule()  # a's 5th token needs a 2nd block (1 free), then b's needs one
    assert [s for s, _ in chosen] == [a]
    assert sched.preemptions == 1 and list(sched.waiting) == [b]
    assert not b.blocks and b.n_cached == 0 and b.tokens == [4, 5, 6, 7, 7]  # tokens kept
    _run(sched, chosen)
    sched.finish(a)
    resumed = sched.schedule()
    assert resumed == [(b, 5)]  # recomputed from scratch


def test_prefix_cache_hit_takes_full_blocks_and_compares_tokens() -> None:
    sched = Scheduler(16, 4, max_num_batched_tokens=64)
    a = _seq(list(range(10)))
    sched.add([a])
    _run(sched, sched.schedule())
    sched.finish(a)  # its two full blocks stay cached
    b = _seq([*range(8), 50, 51, 52])
    sched.add([b])
    chosen = sched.schedule()
    assert chosen == [(b, 3)] and b.n_cached == 8 and sched.allocator.hits == 2
    # a key holds its block's tokens: equal hashes with other tokens never hit
    alloc = BlockAllocator(4)
    block = alloc.allocate()
    (k1,) = block_keys([-1], 1, parent=0)
    (k2,) = block_keys([-2], 1, parent=0)
    assert hash(k1) == hash(k2) and k1 != k2  # CPython: hash(-1) == hash(-2)
    alloc.register(block, k1)
    assert alloc.lookup(k2) is None and alloc.lookup(k1) == block


def test_keys_are_rooted_at_the_policy_version() -> None:
    sched = Scheduler(16, 4, max_num_batched_tokens=64)
    a = _seq(list(range(9)))
    sched.add([a])
    _run(sched, sched.schedule())
    sched.finish(a)
    sched.reset_prefix_cache(1)
    b = _seq(list(range(9)))
    sched.add([b])
    assert sched.schedule() == [(b, 9)] and sched.allocator.hits == 0


def test_later_samples_wait_for_the_prompt_then_share_it() -> None:
    sched = Scheduler(16, 4, max_num_batched_tokens=6)
    s0 = _seq(list(range(9)), rid="n")
    s1 = _seq(list(range(9)), rid="n", index=1, first=s0)
    sched.add([s0, s1])
    assert sched.schedule() == [(s0, 6)]  # s1 waits: s0 is mid-prefill
    _run(sched, [(s0, 6)])
    chosen = sched.schedule()
    assert chosen == [(s0, 3)]
    _run(sched, chosen)
    chosen = sched.schedule()
    assert (s1, 1) in chosen and s1.blocks[:2] == s0.blocks[:2]  # two shared prompt blocks


def test_sliding_window_gives_back_the_blocks_behind_the_window() -> None:
    """window 6, blocks of 4, chunks of 8: a 40-token sequence holds at most
    ceil((8 + 6 - 1) / 4) + 1 = 5 blocks at any step (the allocator has 6 and the sequence
    needs 10 without the window); the blocks behind the window point at the null block and
    every position a later query may see stays in a block of its own."""
    null = 6
    sched = Scheduler(6, 4, max_num_batched_tokens=8, window=6, null_block=null)
    seq = _seq(list(range(30)))
    sched.add([seq])
    most = 0
    while len(seq.tokens) < 40:
        chosen = sched.schedule()
        assert chosen, "the sequence must always fit"
        _run(sched, chosen)
        live = [b for b in seq.blocks if b != null]
        most = max(most, len(live))
        assert sched.allocator.num_used == len(live) == len(set(live))
        assert list(seq.blocks[: seq.n_freed]) == [null] * seq.n_freed
        oldest_seen = max(0, seq.n_cached - 6 + 1)  # the next query's oldest key
        assert seq.n_freed * 4 <= oldest_seen  # no block a later query reads is given back
        assert (seq.n_freed + 1) * 4 > oldest_seen - 4  # and none is held needlessly
    assert most <= 5
    sched.finish(seq)
    assert sched.allocator.num_used == 0  # the freed entries are not freed twice


def test_window_check_fits_counts_the_window_not_the_length() -> None:
    check_fits(30, 10, 64, 4, 6, window=6, chunk=8)  # 5 blocks at once
    with pytest.raises(LmforgeError, match="needs 10 KV blocks"):
        check_fits(30, 10, 64, 4, 6)
    with pytest.raises(LmforgeError, match="needs 7 KV blocks"):
        check_fits(30, 10, 64, 4, 6, window=6, chunk=16)


def test_window_prefix_hit_holds_only_the_windows_blocks() -> None:
    """A cached 8-block prefix: the sequence taking it holds the blocks its window needs (a
    long hit that is not trimmed could exceed the pool and wait forever)."""
    null = 12
    sched = Scheduler(12, 4, max_num_batched_tokens=64, window=6, null_block=null)
    a = _seq(list(range(33)))
    sched.add([a])
    _run(sched, sched.schedule())
    sched.finish(a)  # its 8 full blocks stay cached (registered before they were given back)
    b = _seq(list(range(33)), rid="b")
    sched.add([b])
    chosen = sched.schedule()
    assert chosen == [(b, 1)] and sched.allocator.hits >= 7
    assert b.n_freed == (32 - 6 + 1) // 4 and sched.allocator.num_used <= 4
