"""Scheduler unit tests with a fake runner (torch-free, fast).

The fake runner checks the paged-KV contract of every BatchItem against a
shadow KV store (each position's token, per physical block slot) and "samples"
a token that is a pure function of the sequence so far, like greedy decoding,
so a preempted sequence that recomputes must produce the same output.
"""

from __future__ import annotations

import random

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine.scheduling.batch import BatchItem
from tokenrelay.engine.scheduling.block_manager import BlockManager
from tokenrelay.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from tokenrelay.engine.scheduling.sequence import Sequence, SequenceStatus


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token id

    def execute(self, sched: Scheduler, items: list[BatchItem]) -> list[int | None]:
        bs = self.block_size
        out: list[int | None] = []
        for item in items:
            seq = sched.get(item.request_id)
            assert seq is not None
            end = item.start_pos + len(item.token_ids)
            assert len(item.block_table) * bs >= end
            assert seq.token_ids[item.start_pos : end] == item.token_ids
            for pos in range(item.start_pos):  # everything before start_pos is in the cache
                assert self.kv[item.block_table[pos // bs], pos % bs] == seq.token_ids[pos]
            for i, token in enumerate(item.token_ids):
                pos = item.start_pos + i
                self.kv[item.block_table[pos // bs], pos % bs] = token
            history = seq.token_ids[:end]
            out.append(hash(tuple(history)) % 997 if item.sample else None)
        return out


def make(num_blocks: int = 256, block_size: int = 4, max_seqs: int = 8, budget: int = 16):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_seqs, budget), FakeRunner(block_size)


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 5) -> Sequence:
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival=len(sched._live))
    seq.arrival = int(rid.strip("r")) if rid.strip("r").isdigit() else seq.arrival
    sched.add(seq)
    return seq


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = sched.schedule()
    sampled = runner.execute(sched, out.items)
    for seq, _token in sched.update(out, sampled):
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    sched.block_manager.check_invariants(sched.live_sequences())
    return out


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched, runner))
        assert len(outs) < max_steps, "no progress"
    return outs


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    sched, runner = make(max_seqs=4, budget=16)
    seqs = [add(sched, f"r{i}", p, max_tokens=6) for i, p in enumerate(random_prompts(20))]
    for out in run_all(sched, runner):
        assert sum(len(i.token_ids) for i in out.items) <= 16
        assert len(out.items) <= 4
        assert sched.num_running <= 4
    assert all(s.num_output_tokens == 6 and s.finish_reason == "length" for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_long_prompt_is_prefilled_in_chunks() -> None:
    sched, runner = make(budget=16)
    add(sched, "r0", list(range(1, 51)), max_tokens=2)
    items = [o.items[0] for o in run_all(sched, runner)]
    chunks = [(i.start_pos, len(i.token_ids), i.sample) for i in items]
    expected = [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True), (50, 1, True)]
    assert chunks == expected


def test_decodes_go_first_and_a_long_prompt_never_stalls_them() -> None:
    sched, runner = make(budget=16)
    for i in range(3):
        add(sched, f"r{i}", [i + 1] * 5, max_tokens=40)
    step(sched, runner)  # the three short prompts prefill together
    add(sched, "r9", list(range(1, 101)), max_tokens=2)
    chunk_steps = 0
    while sched.get("r9") is not None and sched.get("r9").num_output_tokens == 0:  # type: ignore[union-attr]
        out = step(sched, runner)
        decodes = [i for i in out.items if i.request_id != "r9"]
        assert [i.request_id for i in out.items[:3]] == ["r0", "r1", "r2"]  # decodes first
        assert all(len(i.token_ids) == 1 for i in decodes)
        assert len(decodes) == 3  # every stream got its token this step
        chunk_steps += 1
    assert chunk_steps == -(-100 // 13)  # 13 tokens of budget left per step for the prompt


def test_preemption_is_newest_first_and_output_is_unchanged() -> None:
    prompts = random_prompts(10, seed=3, lo=10, hi=30)
    big, big_runner = make(num_blocks=512, budget=32)
    expected = [add(big, f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    run_all(big, big_runner)

    small, small_runner = make(num_blocks=24, budget=32)  # 96 slots: ~3 sequences at once
    got = [add(small, f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    preempted_seen = 0
    while small.has_unfinished():
        running_before = {s.request_id: s.arrival for s in small.running}
        out = step(small, small_runner)
        if out.preempted:
            preempted_seen += len(out.preempted)
            scheduled = {i.request_id for i in out.items}
            still_idle = [s for s in small.running if s.request_id not in scheduled]
            for victim in out.preempted:  # no newer sequence was spared without being scheduled
                assert victim.request_id in running_before
                assert all(s.arrival < victim.arrival for s in still_idle)
    assert small.num_preemptions == preempted_seen > 0
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in expected]
    assert small.block_manager.num_free_blocks == 24


def test_preempted_sequence_goes_back_to_the_front_of_the_queue() -> None:
    sched, runner = make(num_blocks=6, block_size=4, budget=64, max_seqs=8)
    a = add(sched, "r0", list(range(1, 9)), max_tokens=12)  # 8 tokens: 2 blocks
    b = add(sched, "r1", list(range(20, 28)), max_tokens=12)
    step(sched, runner)  # both admitted: 4 blocks used
    add(sched, "r2", list(range(40, 44)), max_tokens=2)  # waits (watermark / room)
    preempted = None
    for _ in range(20):
        out = step(sched, runner)
        if out.preempted:
            preempted = out.preempted
            break
    assert preempted == [b]  # the newer running one, never the older
    assert a.status is SequenceStatus.RUNNING
    assert sched.waiting[0] is b and b.num_computed_tokens == 0 and not b.block_table
    run_all(sched, runner)
    assert b.num_output_tokens == 12 and b.num_preemptions >= 1


def test_abort_drops_waiting_and_running_at_the_next_step() -> None:
    sched, runner = make(num_blocks=64, max_seqs=2, budget=16)
    for i in range(4):
        add(sched, f"r{i}", list(range(1 + i, 20 + i)), max_tokens=30)
    step(sched, runner)
    step(sched, runner)
    assert sched.num_running == 2 and sched.num_waiting == 2
    assert sched.abort("r0") and sched.abort("r3")
    assert not sched.abort("nope")
    assert sched.get("r0").status is SequenceStatus.RUNNING  # type: ignore[union-attr]
    out = step(sched, runner)
    assert sorted(s.request_id for s in out.aborted) == ["r0", "r3"]
    assert all(s.finish_reason == "cancelled" and not s.block_table for s in out.aborted)
    assert "r0" not in [i.request_id for i in out.items]
    assert not sched.abort("r0")  # already gone
    for rid in ("r1", "r2"):
        sched.abort(rid)
    step(sched, runner)
    assert not sched.has_unfinished()
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_cached_blocks > 0  # the computed full blocks stay reusable


def test_prefix_hit_skips_the_cached_tokens() -> None:
    sched, runner = make(block_size=4, budget=64)
    shared = list(range(1, 33))  # 8 full blocks
    add(sched, "r0", [*shared, 7, 8], max_tokens=3)
    run_all(sched, runner)
    add(sched, "r1", [*shared, 9, 10, 11], max_tokens=3)
    out = step(sched, runner)
    assert out.items[0].start_pos == 32 and out.items[0].token_ids == [9, 10, 11]
    assert sched.block_manager.prefix_cache_hit_tokens == 32
    # The same prompt again: the last block is recomputed so there is a logit to sample.
    add(sched, "r2", shared, max_tokens=1)
    run_all(sched, runner)
    assert sched.get("r2") is None


def test_forks_of_one_prompt_wait_for_its_prefill_and_share_its_blocks() -> None:
    sched, runner = make(block_size=4, budget=12)  # the prompt takes three steps
    prompt = list(range(1, 31))  # 7 full blocks and 2 tokens
    forks = [add(sched, f"r{i}", prompt, max_tokens=4) for i in range(3)]
    other = add(sched, "r3", [400, 401, 402], max_tokens=2)  # not a fork: not held up
    outs = [step(sched, runner) for _ in range(3)]
    assert [[i.request_id for i in o.items] for o in outs] == [["r0"], ["r0"], ["r0", "r3"]]
    assert [s.request_id for s in sched.waiting] == ["r1", "r2"]  # in order, in front
    outs += run_all(sched, runner)
    computed = sum(len(i.token_ids) for o in outs for i in o.items if i.request_id != "r3")
    # r0 prefills 30 tokens; r1 and r2 only recompute the 2-token tail past 7 cached blocks
    assert computed == 30 + 2 + 2 + 3 * 3  # and 3 decode steps each after the first token
    assert sched.block_manager.prefix_cache_hit_tokens == 2 * 28
    assert all(s.is_finished for s in forks) and other.is_finished
    assert forks[0].output_token_ids == forks[1].output_token_ids == forks[2].output_token_ids


def test_a_fork_does_not_wait_for_a_sequence_past_the_shared_blocks() -> None:
    sched, runner = make(block_size=4, budget=64)
    add(sched, "r0", list(range(1, 21)), max_tokens=8)
    step(sched, runner)  # r0's prompt is computed and cached
    add(sched, "r1", list(range(1, 21)), max_tokens=2)
    out = step(sched, runner)
    assert "r1" in [i.request_id for i in out.items]  # admitted at once: a cache hit


def test_a_step_that_decodes_caps_its_prompt_tokens() -> None:
    bm = BlockManager(256, 4)
    sched, runner = Scheduler(bm, 8, 64, prefill_while_decoding=8), FakeRunner(4)
    add(sched, "r0", [1, 2, 3], max_tokens=30)
    step(sched, runner)  # r0 prefilled alone: a whole step's budget was free for it
    add(sched, "r1", list(range(1, 101)), max_tokens=2)
    add(sched, "r2", list(range(401, 441)), max_tokens=2)  # (no prefix of r1's)
    while sched.get("r1") is not None and sched.get("r1").num_output_tokens == 0:  # type: ignore[union-attr]
        out = step(sched, runner)
        assert out.num_decode_tokens == 1 and out.num_prefill_tokens <= 8  # beside r0's decode
    sched.abort("r0")
    while sched.get("r1") is not None:  # r1's last decode still caps r2's chunk
        out = step(sched, runner)
        assert out.num_prefill_tokens <= 8
    r2 = sched.get("r2")
    assert r2 is not None
    left = r2.num_tokens - r2.num_computed_tokens
    assert left > 8
    out = step(sched, runner)  # nothing decodes: r2's prompt takes the rest at once
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (0, left)
    run_all(sched, runner)


def test_alone_a_long_prompt_takes_the_whole_budget() -> None:
    bm = BlockManager(256, 4)
    sched, runner = Scheduler(bm, 8, 64, prefill_while_decoding=8), FakeRunner(4)
    add(sched, "r0", list(range(1, 201)), max_tokens=2)
    assert step(sched, runner).num_prefill_tokens == 64
