"""Rollout engines: what samples a GRPO step's completions, behind one interface.

    engine = make_engine(run)                      # rollout_engine: native | vllm
    r = engine.generate(prompts, Sampling(80, temperature=0.7), generator, autocast)
    engine.sync(run.model)                         # after the weights changed

`generate` takes prompts as the task gives them (text, or chat messages), encodes them with
the run's tokenizer as `rollout.sample` does, and returns a Rollout: left-padded prompt ids,
completion ids and masks (up to and including EOS, any of the tokenizer's `eos_ids`),
`finished`, the decoded `texts`, and `logprobs`, the engine's own log-prob of each sampled
token. Sampling options mean the same in every engine. The trainer never knows which one
runs; it calls `sync` whenever an update (or a restore) changed the policy's weights.

- native (native.py): our batched, KV-cached sampler on the policy itself; `sync` has nothing
  to do. Its log-probs are log_softmax(logits / temperature), before top-k/top-p.
- vllm (vllm.py): an in-process vLLM engine on each rank (`vllm_mode: colocate`), its weights
  sent from the policy's in memory; or (client.py, `vllm_mode: server`) a `mini-grpo
  vllm-serve` process (server.py) that every rank sends prompts to and rank 0 pushes weights
  into. Its log-probs are those of the distribution vLLM sampled from (temperature, then
  top-k/top-p renormalised): with neither, the same quantity.
"""

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


class Engine(Protocol):
    name: str

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


def make_engine(run, max_len: int | None = None) -> Engine:
    """The engine `run.cfg.rollout_engine` names, for `run.model`; `max_len`: the longest
    prompt + completion it must hold (default: the model's block size). A model the engine
    cannot serve is a ConfigError here, at the start, not in the first step."""
    cfg = run.cfg
    if cfg.rollout_engine == "vllm" and cfg.vllm_mode == "server":
        from .client import ServerEngine

        return ServerEngine(run)
    if cfg.rollout_engine == "vllm":
        from .vllm import VLLMEngine

        return VLLMEngine(run, max_len)
    from .native import NativeEngine

    return NativeEngine(run.model, run.tok, cfg.kv_cache)
