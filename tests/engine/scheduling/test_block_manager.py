"""Block manager: allocation, reference counts, prefix caching, LRU eviction (torch-free)."""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.engine.scheduling.block_manager import BlockManager
from tokenrelay.engine.scheduling.sequence import Sequence

BS = 4
PARAMS = SamplingParams(max_tokens=8)


def make_seq(rid: str, tokens: list[int], arrival: int = 0) -> Sequence:
    return Sequence(rid, tokens, PARAMS, arrival)


def admit_and_compute(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit ``seq`` with its cached prefix, compute the rest of it; return the hit."""
    hit = bm.match_prefix(seq)
    bm.take_prefix(seq, hit)
    n = seq.num_uncomputed_tokens
    bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.register_computed(seq)
    return hit


def test_module_imports_no_torch() -> None:
    import tokenrelay.engine.scheduling.block_manager
    import tokenrelay.engine.scheduling.scheduler
    import tokenrelay.engine.scheduling.sequence

    for module in (
        tokenrelay.engine.scheduling.block_manager,
        tokenrelay.engine.scheduling.scheduler,
        tokenrelay.engine.scheduling.sequence,
    ):
        assert "torch" not in vars(module)
    if "torch" not in sys.modules:  # only meaningful when nothing else imported torch
        assert "torch" not in sys.modules


def test_allocate_free_roundtrip() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq("a", list(range(10)))
    admit_and_compute(bm, seq)
    assert len(seq.block_table) == 3  # 10 tokens -> 3 blocks of 4
    assert bm.num_free_blocks == 5
    assert bm.num_cached_blocks == 2  # only full blocks are registered
    bm.free(seq)
    assert bm.num_free_blocks == 8
    assert bm.stats()["blocks_cached_free"] == 2
    bm.check_invariants([])


def test_double_free_is_refused() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq("a", [1, 2, 3])
    admit_and_compute(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table  # a stale table freed again
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(seq)


def test_prefix_hit_reuses_blocks_but_never_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq("a", list(range(12)))  # exactly 3 full blocks
    admit_and_compute(bm, first)
    same = make_seq("b", list(range(12)))
    hit = bm.match_prefix(same)
    assert hit == first.block_table[:2]  # the last block is left to compute
    longer = make_seq("c", [*range(12), 99])
    assert bm.match_prefix(longer) == first.block_table
    other = make_seq("d", [0, 1, 2, 7, *range(4, 12)])  # differs in block 0
    assert bm.match_prefix(other) == []
    bm.take_prefix(longer, bm.match_prefix(longer))
    assert longer.num_computed_tokens == 12
    assert bm.stats()["prefix_cache_hit_tokens"] == 12
    bm.check_invariants([first, longer])


def test_cached_free_blocks_are_evicted_lru_tail_first() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    old = make_seq("old", [*range(8), 50])  # 2 full blocks + 1 partial
    admit_and_compute(bm, old)
    first_block = old.block_table[0]
    bm.free(old)  # the tail is freed first, so it is the least recently used
    assert bm.stats()["blocks_cached_free"] == 2
    newer = make_seq("new", [*range(100, 104), 50])  # 1 full block + 1
    admit_and_compute(bm, newer)  # takes the 2 never-cached blocks: nothing evicted
    assert bm.num_cached_blocks == 3
    third = make_seq("third", [*range(200, 204), 51])
    admit_and_compute(bm, third)  # needs 2 blocks: 1 plain free + evict "old"'s tail
    assert bm.num_free_blocks == 1 and bm.stats()["blocks_cached_free"] == 1
    # "old"'s first block survived, its second was evicted and unregistered.
    assert bm.match_prefix(make_seq("x", [*range(8), 1])) == [first_block]
    bm.free(newer)
    bm.free(third)
    assert len(bm.match_prefix(make_seq("y", [*range(100, 104), 1]))) == 1
    bm.check_invariants([])


def test_duplicate_content_stays_unregistered_and_is_freed_plainly() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq("a", list(range(9))), make_seq("b", list(range(9)))
    admit_and_compute(bm, a)
    bm.take_prefix(b, [])  # computed concurrently, without the hit
    bm.allocate_slots(b, 9)
    b.num_computed_tokens = 9
    bm.register_computed(b)
    assert bm.num_cached_blocks == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    admit_and_compute(bm, a)
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_seq("b", list(range(9)))) == []


# ---------------------------------------------------------------- property test
OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(0, 3)),
    st.tuples(st.just("append"), st.integers(0, 1000), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("finish"), st.integers(0, 1000)),
    st.tuples(st.just("preempt"), st.integers(0, 1000)),
)
BASES = [list(range(i * 100, i * 100 + 40)) for i in range(4)]
TOTAL_OPS = [0]


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(OPS, min_size=25, max_size=60))
def test_random_operations_never_leak_or_double_free(ops: list[tuple]) -> None:
    """Random add / append / abort / finish / preempt on a tiny pool.

    Checked after every operation: refcounts equal block-table references, each
    unreferenced block is free exactly once, free + used == total, and a prefix
    hit only ever returns blocks whose computed content equals the new prompt.
    """
    bm = BlockManager(num_blocks=12, block_size=BS)
    content: dict[int, dict[int, int]] = {}  # block -> offset -> token written there
    live: list[Sequence] = []
    counter = 0
    for op in ops:
        TOTAL_OPS[0] += 1
        kind = op[0]
        if kind == "add":
            _, base, length, salt = op
            counter += 1
            seq = make_seq(f"r{counter}", BASES[base][:length] + [1000 + salt] * (salt % 2))
            live.append(seq)
        elif live:
            seq = live[op[1] % len(live)]
            if kind == "append":
                if not seq.block_table:  # admit: take the cached prefix first
                    hit = bm.match_prefix(seq)
                    for i, block in enumerate(hit):
                        for off, token in content[block].items():
                            assert seq.token_ids[i * BS + off] == token
                    if bm.num_free_blocks_after(hit) < 1:
                        continue
                    bm.take_prefix(seq, hit)
                n = min(op[2], bm.appendable_tokens(seq))
                if n == 0:
                    continue
                if seq.num_uncomputed_tokens < n:  # generate tokens to compute
                    for _ in range(n - seq.num_uncomputed_tokens):
                        seq.append_token(5000 + len(seq.token_ids))
                bm.allocate_slots(seq, n)
                for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                    block = seq.block_table[pos // BS]
                    content.setdefault(block, {})[pos % BS] = seq.token_ids[pos]
                seq.num_computed_tokens += n
                bm.register_computed(seq)
            elif kind in ("abort", "finish"):
                bm.free(seq)
                live.remove(seq)
            elif kind == "preempt" and seq.block_table:
                bm.free(seq)
                assert seq.num_computed_tokens == 0 and not seq.block_table
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_property_test_ran_enough_operations() -> None:
    # Runs after the property test in file order (pytest keeps definition order).
    if TOTAL_OPS[0] == 0:
        pytest.skip("property test not run in this session")
    assert TOTAL_OPS[0] >= 1000
