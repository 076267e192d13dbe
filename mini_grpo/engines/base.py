"""The engine interface: Sampling (how to sample), Engine (what an engine offers) and
EngineError; a leaf module, so that every engine imports it and the package imports them."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from ..rollout import Rollout


class EngineError(RuntimeError):
    """An engine that failed mid-run (a server gone): the run ends with one line, exit 1."""


@dataclass(frozen=True)
class Sampling:
    """How to sample, the same for every engine."""
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False

    @classmethod
    def of(cls, cfg, greedy: bool = False) -> Sampling:
        """The config's sampling options (greedy: the most likely token, for evaluation)."""
        return cls(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, greedy)


class Engine(Protocol):
    name: str
    # whether one rank may generate while the others do not (no collective in generate):
    # evaluation runs on rank 0 alone
    alone: bool

    def generate(self, prompts: list, sampling: Sampling,
                 generator: torch.Generator | None = None,
                 autocast: AbstractContextManager | None = None) -> Rollout:
        """Completions of `prompts` (one row each). `generator` seeds the sampling; `autocast`:
        the precision our own forward passes run in (engines with their own ignore it)."""
        ...

    def sync(self, model: torch.nn.Module) -> None:
        """Serve `model`'s current weights from now on (a collective under fsdp)."""
        ...

    def close(self) -> None:
        ...
