"""One sequence's grammar state, and the batch's token bitmask filled from all of them.

A :class:`GuidedMatcher` follows one guided sequence: :meth:`~GuidedMatcher.accept`
advances it by each sampled token, :attr:`~GuidedMatcher.stopped` says the JSON is
complete (nothing but EOS may follow, so the engine can finish the sequence without
sampling that EOS), :meth:`~GuidedMatcher.fork` copies it for another choice of the
same prompt. :func:`fill_bitmask` writes the next-token bitmask of many matchers into
one host tensor in a single call that llguidance spreads over a thread pool (with the
GIL released), one row per matcher, ready for
:func:`engine.guided.bitmask.apply_bitmask`.

A matcher that took a token its grammar forbids (which masking prevents; a caller that
skipped the mask for a step) enters an error state and allows EOS only from then on,
so the sequence ends instead of producing invalid JSON; :attr:`~GuidedMatcher.error`
says why.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tokenrelay.engine.guided.bitmask import bitmask_words

if TYPE_CHECKING:
    from tokenrelay.engine.guided.compiler import Grammar

_EXECUTORS: dict[int | None, Any] = {}
_EXECUTORS_LOCK = threading.Lock()


class GuidedMatcher:
    """The grammar state of one sequence (not thread-safe: one sequence, one thread)."""

    __slots__ = ("_matcher", "grammar", "vocab_size")

    def __init__(self, tokenizer: Any, grammar: Grammar, *, _matcher: Any = None) -> None:
        """A matcher at the start of ``grammar``, for ``tokenizer`` (an ``LLTokenizer``).

        Raises ``ValueError`` if llguidance refuses the grammar.
        """
        self.grammar = grammar
        self.vocab_size = int(tokenizer.vocab_size)
        if _matcher is None:
            import llguidance

            _matcher = llguidance.LLMatcher(tokenizer, grammar.text, log_level=0)
            if _matcher.is_error():
                raise ValueError(f"response_format: {_matcher.get_error()}")
        self._matcher = _matcher

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar forbids it (the matcher is then
        in its error state for good). An EOS token is accepted once the JSON is complete."""
        return bool(self._matcher.consume_token(int(token)))

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow: the JSON is complete (or the matcher failed)."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The text so far is a complete document: EOS is allowed now."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a forbidden token), or None."""
        if not self._matcher.is_error():
            return None
        return str(self._matcher.get_error()) or "error"

    def fork(self) -> GuidedMatcher:
        """An independent copy in the same state (for ``n`` > 1 choices)."""
        copy = GuidedMatcher.__new__(GuidedMatcher)
        copy.grammar = self.grammar
        copy.vocab_size = self.vocab_size
        copy._matcher = self._matcher.deep_copy()
        return copy

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` accepted tokens (speculative decoding)."""
        if tokens and not self._matcher.rollback(int(tokens)):
            raise ValueError(f"cannot roll back {tokens} tokens")

    def allowed(self) -> torch.Tensor:
        """The ids allowed next, ascending (for tests and debugging; one mask)."""
        bitmask = torch.zeros((1, bitmask_words(self.vocab_size)), dtype=torch.int32)
        fill_bitmask([self], bitmask)
        bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.view(-1)[: self.vocab_size].nonzero().view(-1)


def executor(threads: int | None = None) -> Any:
    """The shared ``LLExecutor`` with ``threads`` threads (None: llguidance's default,
    80% of the CPUs up to 32)."""
    with _EXECUTORS_LOCK:
        pool = _EXECUTORS.get(threads)
        if pool is None:
            import llguidance

            pool = llguidance.LLExecutor(num_threads=threads)
            _EXECUTORS[threads] = pool
        return pool


def fill_bitmask(
    matchers: Sequence[GuidedMatcher], bitmask: torch.Tensor, *, threads: int | None = None
) -> None:
    """Write row ``i`` of ``bitmask`` from ``matchers[i]`` (1 = token allowed), in one call.

    ``bitmask``: a contiguous host int32 tensor of ``[rows >= len(matchers), words]``
    with ``words`` = ``ceil(vocab / 32)`` for the matchers' vocabulary
    (:func:`engine.guided.bitmask.allocate_bitmask`); rows past ``len(matchers)`` are
    left as they are.
    """
    if not matchers:
        return
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError("bitmask: expected a 2-D int32 host tensor")
    if not bitmask.is_contiguous():
        raise ValueError("bitmask: expected a contiguous tensor")
    rows, words = bitmask.shape
    if len(matchers) > rows:
        raise ValueError(f"bitmask: {rows} rows for {len(matchers)} matchers")
    for m in matchers:
        need = bitmask_words(m.vocab_size)
        if need != words:
            raise ValueError(f"bitmask: {words} words a row, the vocabulary needs {need}")
    pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
    executor(threads).unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)
