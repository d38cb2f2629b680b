"""The engine's scheduler: which sequences run in the next step, and with how many tokens.

Plain Python (no torch: ``pytest tests/test_serve_scheduler.py`` runs without it). It owns the
queues, the block allocator (:mod:`lmforge.serve.blocks`) and each sequence's block table;
the :class:`~lmforge.serve.model_runner.ModelRunner` turns its decision into tensors and the
:class:`~lmforge.serve.engine.Engine` samples.

1. **Schedule** (FCFS, no starvation). Running sequences go first, in arrival order: a decoding
   one needs 1 token, a partly prefilled one its next chunk. If a sequence needs a new block and
   none is free, the most recently arrived running sequence is *preempted by recompute*: its
   blocks are freed and it goes back to the head of the queue (its tokens so far are kept, so
   it resumes where it was; the prefix cache often makes the recompute cheap). Then waiting
   sequences are admitted in order while the step's token budget, free blocks and
   ``max_num_seqs`` last; the first one that does not fit stops admission (nobody overtakes
   it). Prompts longer than the budget are prefilled in chunks over several steps (chunked
   prefill), mixed with other sequences' decodes in the same step.
2. **Prefix cache** on admission: the longest run of the sequence's full blocks already cached
   (keys chain the parent's hash and hold the block's tokens, so a hit compares tokens:
   :func:`~lmforge.serve.blocks.block_keys`) is taken as is, and only the rest is computed. At
   least one token is always computed (its logits start sampling). Keys are rooted at the
   policy version, so KV computed under old weights never matches. Blocks that became full
   after a step are registered. A prompt's image slots (a VLM's, :attr:`Seq.images`) enter the
   keys as their image's pixel digest instead of the placeholder id: two prompts with the same
   tokens but different images share no block from the first image slot on.

3. **Recurrent-state slots** (hybrid models with G/M/L layers, ``num_state_slots`` > 0): a
   sequence takes a state slot at admission (none free: it waits, FCFS) and gives it back on
   finish, abort or preemption; a step starting a sequence at token 0 (fresh, or re-admitted
   after preemption by recompute) marks its slot to be zeroed (:attr:`StepInputs.state_fresh`).
   The engine turns the prefix cache off for such models: a cached block holds K/V, not the
   recurrent state after it.

4. **Sliding windows** (``window``: every paged layer attends to its last ``window`` keys, e.g.
   pattern ``W`` or ``GGGW``): blocks whose positions all lie before ``n_cached − window + 1``
   are seen by no later query, so they are given back as the sequence grows (after the step's
   full blocks are registered: a finished sequence's prefix stays findable while it is cached);
   their table entries point at ``null_block`` (the runner's scratch block, finite values that
   the window mask hides). A sequence then holds at most ``ceil((chunk + window − 1) / BS) + 1``
   blocks, whatever its length (:func:`check_fits`). W layers beside A/S layers (``WWWA``)
   are not paged here: they keep a ring in the sequence's state slot (item 3), and the A/S
   layers' blocks are kept whole.

Sample i > 0 of an n-sample request waits until sample 0 has prefilled the prompt, then shares
its prompt blocks through the prefix cache instead of recomputing them.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from lmforge.serve.blocks import BlockAllocator, BlockKey, block_keys
from lmforge.utils.errors import LmforgeError

__all__ = ["Scheduler", "Seq", "StepInputs", "check_fits"]


def check_fits(
    n_prompt: int,
    max_tokens: int,
    context: int,
    block_size: int,
    blocks: int,
    window: int | None = None,
    chunk: int = 0,
) -> None:
    """Raise :class:`LmforgeError` (one line) unless a request can ever run: a non-empty prompt
    that leaves room for one token, and a longest sequence within ``blocks`` KV blocks (with a
    ``window``, the blocks it holds at once: its window and one ``chunk`` of new tokens)."""
    if not n_prompt:
        raise LmforgeError("the prompt needs at least one token")
    if n_prompt >= context:
        raise LmforgeError(f"prompt has {n_prompt} tokens; the model's context is {context} "
                           "(at least one token must be generated)")  # fmt: skip
    need = math.ceil(min(n_prompt + max_tokens, context) / block_size)
    if window is not None:  # blocks behind the window are given back as the sequence grows
        need = min(need, math.ceil((chunk + window - 1) / block_size) + 1)
    if need > blocks:
        raise LmforgeError(f"request needs {need} KV blocks, the cache has {blocks}")


@dataclasses.dataclass(eq=False)
class Seq:
    """One sample being generated: its tokens, its KV blocks and its progress.

    ``payload`` fields (sampling parameters, RNG, output, detokenizer) belong to the engine;
    the scheduler reads only the token and block bookkeeping."""

    request_id: str
    index: int
    tokens: list[int]
    n_prompt: int
    arrival: int
    first: Seq | None = None
    "sample 0 of the same request (None for sample 0 itself)"
    blocks: array = dataclasses.field(default_factory=lambda: array("i"))
    "block table, C ints: a step stages them by memory copies, not int by int"
    n_cached: int = 0
    "tokens whose KV is in the blocks"
    n_hashed: int = 0
    "full blocks registered in (or taken from) the prefix cache"
    keys: list[BlockKey] = dataclasses.field(default_factory=list)
    root: int = 0
    "policy version the KV (and so the key chain) was computed under"
    done: bool = False
    params: Any = None
    generator: Any = None
    out: Any = None
    detok: Any = None
    stops: Any = None
    images: Any = None
    "the prompt's images (``spans``, ``digests``, ``embeds`` (rows, D)), e.g. a VLM's"
    " :class:`~lmforge.vision.serving.ImagePrompt`; None for text"
    state_slot: int | None = None
    "the recurrent-state slot held while running (hybrid models), else None"
    n_freed: int = 0
    "leading blocks given back (behind a sliding window); their entries are the null block"

    def key_tokens(self, start: int, stop: int) -> list[Any]:
        """``tokens[start:stop]`` as prefix-cache keys hold them: an image slot is its image's
        digest (the placeholder id says nothing about the pixels)."""
        out: list[Any] = self.tokens[start:stop]
        if self.images is not None:
            for (s, n), digest in zip(self.images.spans, self.images.digests, strict=True):
                for p in range(max(s, start), min(s + n, stop)):
                    out[p - start] = digest
        return out

    @property
    def n_out(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - self.n_prompt


@dataclasses.dataclass
class StepInputs:
    """One step's inputs as host lists (the runner stages them to the device)."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    "flat KV slot (block · block_size + offset) of every token"
    last_rows: list[int]
    "row of each sequence's last token in the step"
    q_lens: list[int]
    ctx_lens: list[int]
    "tokens cached per sequence after the step"
    tables: list[Sequence[int]]
    "each sequence's block table (the sequence's own ``array('i')``: staged by a memory copy)"
    image_rows: list[int] = dataclasses.field(default_factory=list)
    "rows of the step whose input is an image embedding, not the token's"
    image_parts: list[tuple[Any, int, int]] = dataclasses.field(default_factory=list)
    "(embeds, lo, hi): those rows' embeddings, ``embeds[lo:hi]`` in row order"
    state_slots: list[int] = dataclasses.field(default_factory=list)
    "each sequence's recurrent-state slot (hybrid models; empty otherwise)"
    state_fresh: list[int] = dataclasses.field(default_factory=list)
    "the slots whose sequence starts at token 0 this step (zeroed before the forward)"


class Scheduler:
    """Queues, block tables and the per-step decision (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_cache: bool = True,
        num_state_slots: int = 0,
        window: int | None = None,
        null_block: int = -1,
        max_seq_tokens: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.window = window
        self.null_block = null_block
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots))[::-1]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, block_size)
        self.max_seq_tokens = max_seq_tokens or self.max_num_batched_tokens
        "the most tokens one sequence computes in a step (a ring's chunk; the budget otherwise)"
        self.allocator = BlockAllocator(num_blocks, enable_prefix_cache=enable_prefix_cache)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.version = 0
        "policy version new key chains are rooted at"
        self.preemptions = 0

    # ------------------------------------------------------------ queue
    def add(self, seqs: Iterable[Seq]) -> None:
        """Queue sequences (arrival order)."""
        self.waiting.extend(seqs)

    def remove(self, seq: Seq) -> None:
        """Drop ``seq`` wherever it is and free its blocks (abort)."""
        self.release(seq)
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def finish(self, seq: Seq) -> None:
        """``seq`` is done: register its full blocks (a follow-up request may reuse them), then
        free them."""
        seq.done = True
        self.running.remove(seq)
        self.register_full_blocks(seq)
        self.release(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence is queued or running."""
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self, version: int) -> None:
        """New weights: later key chains are rooted at ``version``; idle cached blocks go."""
        self.version = version
        self.allocator.reset_prefix_cache()

    # ------------------------------------------------------------ blocks
    def release(self, seq: Seq) -> None:
        """Free ``seq``'s blocks; its tokens are kept (a preempted sequence recomputes)."""
        if seq.blocks:
            self.allocator.free_all(seq.blocks[seq.n_freed :])
        if seq.state_slot is not None:  # a recomputed sequence restarts from a zeroed slot
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        seq.blocks = array("i")
        seq.n_cached = 0
        seq.n_hashed = 0
        seq.n_freed = 0

    def ensure_blocks(self, seq: Seq, n_tokens: int) -> bool:
        """Give ``seq`` blocks for its first ``n_tokens`` slots; False (nothing kept) if short."""
        need = math.ceil(n_tokens / self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        for _ in range(need):
            seq.blocks.append(self.allocator.allocate())
        return True

    def _take_prefix(self, seq: Seq) -> None:
        """Reuse cached full blocks of ``seq``'s tokens (never its last token's block)."""
        if seq.blocks:
            return
        seq.root = self.version
        prefix = seq.key_tokens(0, len(seq.tokens) - 1)
        seq.keys = block_keys(prefix, self.block_size, hash(("policy", seq.root)))
        for key in seq.keys:
            block = self.allocator.lookup(key)
            if block is None:
                break
            seq.blocks.append(block)
        seq.n_hashed = len(seq.blocks)
        seq.n_cached = seq.n_hashed * self.block_size
        self.trim_window(seq)  # a long cached prefix: only its window's blocks are held

    def register_full_blocks(self, seq: Seq) -> None:
        """Register the blocks of ``seq`` that became full (prefix cache)."""
        if not self.allocator.enable_prefix_cache:
            return
        bs = self.block_size
        full = seq.n_cached // bs
        if full <= seq.n_hashed:
            return
        parent = hash(seq.keys[seq.n_hashed - 1]) if seq.n_hashed else hash(("policy", seq.root))
        new = block_keys(seq.key_tokens(seq.n_hashed * bs, full * bs), bs, parent)
        seq.keys = seq.keys[: seq.n_hashed] + new
        for i in range(seq.n_hashed, full):
            self.allocator.register(seq.blocks[i], seq.keys[i])
        seq.n_hashed = full

    def trim_window(self, seq: Seq) -> None:
        """With a sliding ``window``: give back ``seq``'s leading blocks that no later query
        sees (every position before ``n_cached − window + 1``); their entries become the null
        block. Nothing without a window."""
        if self.window is None:
            return
        dead = min(max(0, seq.n_cached - self.window + 1) // self.block_size, len(seq.blocks))
        for i in range(seq.n_freed, dead):
            self.allocator.free(seq.blocks[i])
            seq.blocks[i] = self.null_block
        seq.n_freed = max(seq.n_freed, dead)

    # ------------------------------------------------------------ the decision
    def _preempt(self) -> Seq | None:
        """Preempt the most recent running sequence (returned); None if none is left."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self.release(victim)
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def _prompt_ready(self, seq: Seq) -> bool:
        """Whether sample ``seq`` (of n > 1) may start: sample 0 has prefilled the prompt, so
        its full blocks are in the prefix cache (always true for sample 0 or without a cache)."""
        first = seq.first
        if first is None or not self.allocator.enable_prefix_cache:
            return True
        return first.n_cached >= first.n_prompt or first.done

    def schedule(self) -> list[tuple[Seq, int]]:
        """The next step: (sequence, tokens to compute) pairs, running ones first."""
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Seq, int]] = []
        preempted: set[int] = set()  # ids, not `in self.running`: O(1), not O(S), per sequence
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if id(seq) in preempted:
                continue  # preempted below to make room for an earlier one
            n = min(len(seq.tokens) - seq.n_cached, budget, self.max_seq_tokens)
            if n <= 0:
                continue
            while not self.ensure_blocks(seq, seq.n_cached + n):
                victim = self._preempt()
                if victim is None:
                    break
                preempted.add(id(victim))
                if victim is seq:
                    break
            if id(seq) in preempted:
                continue
            if math.ceil((seq.n_cached + n) / self.block_size) > len(seq.blocks):
                continue
            chosen.append((seq, n))
            budget -= n
            if budget <= 0:
                break
        n_running = len(self.running)
        while self.waiting and budget > 0 and n_running < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._prompt_ready(seq):
                break  # next step it shares sample 0's prompt blocks instead of recomputing
            if self.num_state_slots and not self.free_state_slots:
                break  # every recurrent-state slot is held: wait for one (FCFS)
            self._take_prefix(seq)
            n = min(len(seq.tokens) - seq.n_cached, budget, self.max_seq_tokens)
            if not self.ensure_blocks(seq, seq.n_cached + n):
                self.release(seq)  # give the prefix back: it waits whole (FCFS, no skipping)
                break
            self.waiting.popleft()
            if self.num_state_slots:
                seq.state_slot = self.free_state_slots.pop()
            self.running.append(seq)
            n_running += 1
            chosen.append((seq, n))
            budget -= n
        return chosen

    def inputs(self, chosen: list[tuple[Seq, int]]) -> StepInputs:
        """The step's host inputs; checks that every block written is the sequence's own."""
        bs = self.block_size
        out = StepInputs([], [], [], [], [], [], [])
        for seq, n in chosen:
            start = seq.n_cached
            for p in range(start, start + n):
                block = seq.blocks[p // bs]
                if p % bs == 0 or p == start:
                    self.allocator.check_writable(block)
                out.slots.append(block * bs + p % bs)
            if seq.images is not None:
                _image_rows(seq.images, start, start + n, len(out.tokens), out)
            out.tokens.extend(seq.tokens[start : start + n])
            out.positions.extend(range(start, start + n))
            out.last_rows.append(len(out.tokens) - 1)
            out.q_lens.append(n)
            out.ctx_lens.append(start + n)
            out.tables.append(seq.blocks)
            if seq.state_slot is not None:
                out.state_slots.append(seq.state_slot)
                if start == 0:
                    out.state_fresh.append(seq.state_slot)
        return out

    def advance(self, chosen: list[tuple[Seq, int]]) -> list[tuple[int, Seq]]:
        """After the forward: the chosen tokens are cached; (row, sequence) of those whose step
        reached their last token (they sample now; the others are mid-prefill)."""
        for seq, n in chosen:
            seq.n_cached += n
            self.register_full_blocks(seq)
            self.trim_window(seq)
        return [(i, seq) for i, (seq, _) in enumerate(chosen) if seq.n_cached == len(seq.tokens)]


def _image_rows(images: Any, start: int, stop: int, row0: int, out: StepInputs) -> None:
    """Add the image slots among positions [start, stop) of a sequence (its step rows start at
    ``row0``) to ``out``: a chunk boundary may cut an image, so each span is clipped."""
    first = 0  # the span's first row in ``images.embeds``
    for s, n in images.spans:
        lo, hi = max(s, start), min(s + n, stop)
        if lo < hi:
            out.image_rows.extend(range(row0 + lo - start, row0 + hi - start))
            out.image_parts.append((images.embeds, first + lo - s, first + hi - s))
        first += n
