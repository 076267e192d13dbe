"""The native engine: our batched, KV-cached sampler (rollout.generate) on the policy itself."""

from __future__ import annotations

from contextlib import nullcontext

from .. import fsdp
from ..rollout import Rollout, sample


class NativeEngine:
    name = "native"
    alone = True  # each rank samples its own rows with its own (gathered) policy

    def __init__(self, model, tok, use_cache: bool = True):
        self.model, self.tok, self.use_cache = model, tok, use_cache

    def generate(self, prompts: list, sampling, generator=None, autocast=None) -> Rollout:
        # under fsdp every rank gathers the full weights once for the whole rollout
        with fsdp.full_params(self.model), autocast or nullcontext():
            return sample(self.model, self.tok, prompts, sampling.max_new_tokens,
                          temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, greedy=sampling.greedy, generator=generator,
                          use_cache=self.use_cache)

    def sync(self, model) -> None:
        """Nothing to do: this engine samples with the policy itself."""

    def close(self) -> None:
        pass
