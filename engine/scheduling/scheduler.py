"""Continuous batching: which sequences compute which tokens at each step (torch-free).

Every step has a token budget (``max_num_batched_tokens``) and a cap on live
sequences (``max_num_seqs``). A step is filled in this order:

1. decodes of running sequences, oldest first (one token each), so a stream
   never waits behind prompts;
2. the next chunk of running sequences still prefilling (chunked prefill: a
   long prompt takes at most what is left of the budget, so running streams
   stall at most one budget of tokens; when the step decodes, its prompt tokens
   (here and in 3.) are at most ``prefill_while_decoding``, so on a CPU, where a
   step's time grows with its tokens, a long prompt delays the streams' next
   token by a short chunk's time, and takes the whole budget only when alone);
3. waiting sequences, first come first served, reusing their longest cached
   prefix; the last of them may get a partial chunk. A waiting sequence whose next
   uncached prompt block a running sequence is still computing (``n`` choices of
   one prompt, or the same prompt twice) waits for it and then takes it from the
   prefix cache: a fork of the prompt's KV blocks, not a second prefill.

When a running sequence needs a block and none is free, the *newest* running
sequence not yet scheduled this step is preempted (recompute: its blocks are
freed and it goes back to the front of the waiting queue, to recompute
prompt + generated tokens later). Older sequences therefore always progress,
and the oldest one alone always fits (the engine caps the context at the pool
size), so every request completes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from tokenrelay.core.wire.vocabulary import FinishReason
from tokenrelay.engine.scheduling.batch import BatchItem, StepStats
from tokenrelay.engine.scheduling.block_manager import BlockManager
from tokenrelay.engine.scheduling.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's plan: ``items[i]`` is what ``seqs[i]`` computes."""

    items: list[BatchItem] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    aborted: list[Sequence] = field(default_factory=list)  # dropped at the start of this step
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def stats(self) -> StepStats:
        return StepStats(
            num_seqs=len(self.items),
            num_tokens=self.num_prefill_tokens + self.num_decode_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
        )


class Scheduler:
    """Owns the waiting queue and the running batch; asks the block manager for room."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_while_decoding: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_while_decoding = prefill_while_decoding or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._live: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        self._pending_aborts: dict[str, None] = {}  # ordered set, guarded by _abort_lock
        self._abort_lock = threading.Lock()  # abort() may come from another thread
        # New admissions leave this many blocks free for running decodes (not
        # when nothing runs: then the head of the queue must always get in).
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # prefill (and recompute) tokens
        self.decode_tokens_computed = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def get(self, request_id: str) -> Sequence | None:
        return self._live.get(request_id)

    def live_sequences(self) -> list[Sequence]:
        return list(self._live.values())

    # ----------------------------------------------------------------- changes
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._live:
            raise ValueError(f"request_id {seq.request_id!r} is already running")
        seq.status = SequenceStatus.WAITING
        with self._abort_lock:
            self._live[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop ``request_id`` at the next :meth:`schedule`; False if it is unknown.

        The only method safe to call from another thread than the step loop's.
        """
        with self._abort_lock:
            if request_id not in self._live:
                return False
            self._pending_aborts[request_id] = None
            return True

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` (stop, length, abort) and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        with self._abort_lock:
            self._live.pop(seq.request_id, None)
            self._pending_aborts.pop(seq.request_id, None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _newest_unscheduled(self, scheduled: set[str]) -> Sequence | None:
        for seq in reversed(self.running):  # running is kept in arrival order
            if seq.request_id not in scheduled:
                return seq
        return None

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step: drop aborted sequences, then fill the token budget."""
        out = SchedulerOutput()
        with self._abort_lock:
            pending, self._pending_aborts = list(self._pending_aborts), {}
        for request_id in pending:
            seq = self._live.get(request_id)
            if seq is not None:
                self.finish(seq, FinishReason.CANCELLED)
                out.aborted.append(seq)

        bm = self.block_manager
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        scheduled: set[str] = set()
        self.running.sort(key=lambda s: s.arrival)

        # 1. decodes, oldest first; make room by preempting the newest.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                continue
            while not bm.can_append(seq, 1):
                victim = self._newest_unscheduled(scheduled)
                assert victim is not None  # seq itself is unscheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                bm.allocate_slots(seq, 1)
                plan.append((seq, 1))
                scheduled.add(seq.request_id)
                budget -= 1

        if plan:  # the step decodes: its prompt tokens are capped (see the module doc)
            budget = min(budget, self.prefill_while_decoding)

        # 2. chunks of running prefills, oldest first; only newer ones are preempted.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.request_id in scheduled:
                continue
            want = min(seq.num_uncomputed_tokens, budget)
            while bm.appendable_tokens(seq) < want:
                victim = self._newest_unscheduled(scheduled | {seq.request_id})
                if victim is None or victim.arrival < seq.arrival:
                    break
                self._preempt(victim)
                out.preempted.append(victim)
            n = min(want, bm.appendable_tokens(seq))
            if n > 0:
                bm.allocate_slots(seq, n)
                plan.append((seq, n))
                scheduled.add(seq.request_id)
                budget -= n

        # 3. admit waiting sequences, first come first served (no skipping ahead), except
        #    that one whose prompt a running prefill is computing waits for its blocks.
        forks: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = bm.match_prefix(seq)
            if any(bm.will_cache_more(seq, r, len(hit)) for r in self.running):
                forks.append(self.waiting.popleft())
                continue
            cached = len(hit) * bm.block_size
            free_after = bm.num_free_blocks_after(hit)
            if self.running:
                free_after -= self.watermark_blocks
            room = (len(hit) + max(0, free_after)) * bm.block_size - cached
            n = min(seq.num_tokens - cached, budget, room)
            if n <= 0:
                break
            self.waiting.popleft()
            bm.take_prefix(seq, hit)
            bm.allocate_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            scheduled.add(seq.request_id)
            budget -= n
        self.waiting.extendleft(reversed(forks))  # back in front, in their order

        for seq, n in plan:
            start = seq.num_computed_tokens
            is_decode = n == 1 and start == seq.num_tokens - 1 and seq.num_output_tokens > 0
            if is_decode:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += n
            sample = start + n == seq.num_tokens
            out.seqs.append(seq)
            out.items.append(
                BatchItem(
                    request_id=seq.request_id,
                    token_ids=seq.token_ids[start : start + n],
                    start_pos=start,
                    block_table=list(seq.block_table),
                    sample=sample,
                    params=seq.params,
                    output_index=seq.num_output_tokens,
                    # penalties read every token so far (prompt, then output)
                    past_token_ids=list(seq.token_ids)
                    if sample and seq.params.uses_history
                    else None,
                )
            )
        self.prompt_tokens_computed += out.num_prefill_tokens
        self.decode_tokens_computed += out.num_decode_tokens
        return out

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[tuple[Sequence, int]]:
        """Record a finished step: advance computed counts, append sampled tokens.

        Returns the ``(sequence, new token)`` pairs; the caller decides which of
        them finish (EOS, stop strings, length) and calls :meth:`finish`.
        """
        if len(sampled) != len(out.items):
            raise ValueError(f"expected {len(out.items)} results, got {len(sampled)}")
        new_tokens: list[tuple[Sequence, int]] = []
        for seq, item, token in zip(out.seqs, out.items, sampled, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += len(item.token_ids)
            self.block_manager.register_computed(seq)
            if item.sample:
                if token is None:
                    raise RuntimeError(f"no token sampled for {seq.request_id!r}")
                seq.append_token(token)
                new_tokens.append((seq, token))
        return new_tokens
