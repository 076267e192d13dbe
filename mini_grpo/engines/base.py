"""The engine interface: Sampling (how to sample), Rollout (what an engine returns), Engine
(what an engine offers), EngineError and WeightsSeen; a leaf module, so that every engine
imports it and the package imports them."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch

from .. import distributed as D


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


class WeightsSeen:
    """Which weights an engine with its own copy holds: the policy's parameters, each with
    its in-place version counter, as they were at the engine's last sync. In-place ops move
    the counter (a restore's copy_, load_state_dict; under fsdp the sharded DTensor's own;
    an optimizer step of optim.make_optimizer's, whose fused kernel alone would not), and a
    replaced parameter is another tensor, so a sync with unchanged weights is known to have
    nothing to send. Writes that bypass the counter (`p.data = ...`, `p.data.copy_(...)`)
    must not touch a policy whose engine keeps a copy (LoRA's store_base_in runs before the
    engine exists)."""

    def __init__(self):
        self.seen: list[tuple[weakref.ref, int]] | None = None

    def changed(self, model: torch.nn.Module) -> bool:
        params = list(model.parameters())
        return self.seen is None or len(params) != len(self.seen) or any(
            ref() is not p or version != p._version
            for (ref, version), p in zip(self.seen, params))

    def changed_anywhere(self, model: torch.nn.Module, device: torch.device) -> bool:
        """`changed` on any rank (a collective): a sync is one (fsdp's gathers, the server's
        barrier), so no rank may skip it alone."""
        flag = torch.tensor([float(self.changed(model))], device=device)
        return bool(D.all_reduce_max(flag).item())

    def mark(self, model: torch.nn.Module) -> None:
        self.seen = [(weakref.ref(p), p._version) for p in model.parameters()]


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """What an engine sampled, built once by keyword (dataclasses.replace for a changed
    copy): the model's own tokens (`model_mask`) are always said, so a multi-turn engine
    cannot leave the loss on its tools' tokens by forgetting them."""
    prompt_ids: torch.Tensor  # (B, P) left-padded with pad_id
    prompt_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    completion_ids: torch.Tensor  # (B, N) pad_id after each row's EOS
    completion_mask: torch.Tensor  # (B, N) bool, True up to and including EOS
    logprobs: torch.Tensor  # (B, N) fp32 log-prob of each sampled token, 0 where masked
    finished: torch.Tensor  # (B,) bool, the row emitted EOS (else it hit max_new_tokens)
    # (B, N) bool, the model's own tokens, the loss's: completion_mask for a single turn; a
    # multi-turn rollout's completion also holds what answered its turns (tools' results,
    # the chat template's turn markers), attended to and not the model's (turns.TurnState)
    model_mask: torch.Tensor
    nonfinite: torch.Tensor  # 0-d bool: some logits were NaN/Inf while sampling
    sampling: Sampling  # how it was drawn: re-scoring uses its temperature
    texts: list[str] | None = None  # decoded completions, without EOS (None: ids alone)
    # multi-turn rollouts (turns.py)
    conversations: list[list[dict]] | None = None  # each row's messages after its prompt
    turn_counts: torch.Tensor | None = None  # (B, 5) turns.COUNTS: calls ... broken
    env_rewards: list[float] | None = None  # an environment's reward parts, summed per row

    def __post_init__(self):
        shape = tuple(self.completion_ids.shape)
        for name in ("completion_mask", "logprobs", "model_mask"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"Rollout: {name} is {tuple(getattr(self, name).shape)}, "
                                 f"completion_ids {shape}")

    def lengths(self) -> list[int]:
        """Each completion's length in tokens (EOS included)."""
        return self.completion_mask.sum(1).tolist()

    def take(self, rows: list[int]) -> Rollout:
        """The rollout of rows `rows` alone, in that order (dynamic_sampling_factor keeps
        the groups that carry signal); what is not per row (nonfinite, sampling) stays."""
        def pick(v):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return v[torch.tensor(rows, dtype=torch.long, device=v.device)]
            return [v[i] for i in rows] if isinstance(v, list) else v
        return replace(self, **{f.name: pick(getattr(self, f.name)) for f in fields(self)})


def pad_left(seqs: list[list[int]], pad_id: int, device=None):
    """list of id lists -> (ids (B, P), mask (B, P) bool), right-aligned."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, P - len(s):] = True
    return ids.to(device), mask.to(device)


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
        """Serve `model`'s current weights from now on (a collective under fsdp, on every
        rank alike); nothing to do where they have not changed since the last sync
        (WeightsSeen)."""
        ...

    def close(self) -> None:
        ...
