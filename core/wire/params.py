"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one completion.

    ``temperature`` 0 means greedy. ``top_k`` 0 (or -1) disables top-k.
    ``seed`` makes sampling reproducible whatever else shares the batch.
    ``stop`` strings end the completion and never appear in its text.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
