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

from typing import TYPE_CHECKING

from .base import Engine, EngineError, Sampling

if TYPE_CHECKING:
    from ..run import Run

__all__ = ["Engine", "EngineError", "Sampling", "check_engine", "make_engine"]


def check_engine(cfg, device) -> None:
    """What the engine options refuse on `device`, before the set-up does any work."""
    from ..fields import ConfigError

    if cfg.rollout_engine == "vllm" and cfg.vllm_sleep and device.type != "cuda":
        raise ConfigError("vllm_sleep: sleep mode gives GPU memory back between rollouts; "
                          "it needs a GPU (this run is on the CPU)")


def make_engine(run: Run, max_len: int | None = None) -> Engine:
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
