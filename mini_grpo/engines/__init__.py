"""Rollout engines: what samples a GRPO step's completions, behind one interface.

    engine = make_engine(cfg, model, tok, device, dist)   # rollout_engine: native | vllm
    r = engine.generate(prompts, Sampling(80, temperature=0.7), generator, autocast)
    engine.sync(model)                    # serve the current weights (a no-op if unchanged)

`generate` takes prompts as the task gives them (text, or chat messages), encodes them with
the run's tokenizer as `native.sample` does, and returns a Rollout (base.py): left-padded
prompt ids, completion ids and masks (up to and including EOS, any of the tokenizer's `eos_ids`),
`finished`, the decoded `texts`, and `logprobs`, the engine's own log-prob of each sampled
token, and the `Sampling` it was drawn with. Sampling options mean the same in every engine.
The trainer never knows which one runs; it calls `sync` (Run.sync_engine) before every
rollout, and an engine with a copy of the weights sends them only where they changed since
its last sync (base.WeightsSeen).

- native (native.py): our batched, KV-cached sampler on the policy itself; `sync` has nothing
  to do. Its log-probs are log_softmax(logits / temperature), before top-k/top-p.
- vllm (vllm.py): an in-process vLLM engine on each rank (`vllm_mode: colocate`), its weights
  sent from the policy's in memory; or (client.py, `vllm_mode: server`) a `mini-grpo
  vllm-serve` process (server.py) that every rank sends prompts to and rank 0 pushes weights
  into. Its log-probs are those of the distribution vLLM sampled from (temperature, then
  top-k/top-p renormalised): with neither, the same quantity.
"""

from __future__ import annotations

from .base import Engine, EngineError, Rollout, Sampling

__all__ = ["Engine", "EngineError", "Rollout", "Sampling", "check_engine", "make_engine"]


def check_engine(cfg, device) -> None:
    """What the engine options refuse on `device`, before the set-up does any work."""
    from ..fields import ConfigError

    if cfg.rollout_engine == "vllm" and cfg.vllm_sleep and device.type != "cuda":
        raise ConfigError("vllm_sleep: sleep mode gives GPU memory back between rollouts; "
                          "it needs a GPU (this run is on the CPU)")
    if (cfg.tools or cfg.environment) and cfg.rollout_engine == "vllm" and \
            cfg.vllm_mode == "colocate" and cfg.vllm_tensor_parallel_size > 1:
        raise ConfigError(f"{'tools' if cfg.tools else 'environment'}: multi-turn rollouts "
                          f"take one engine per rank (vllm_tensor_parallel_size: 1), or a "
                          f"server (vllm_mode: server)")


def make_engine(cfg, model, tok, device, dist, max_len: int | None = None,
                tools=None) -> Engine:
    """The engine `cfg.rollout_engine` names, for the policy `model` and its tokenizer `tok`,
    on this rank's `device` (`dist`: the run's distributed.DistInfo); `max_len`: the longest
    prompt + completion it must hold (default: the model's block size); `tools`: the run's
    turns.ToolSetup (None: single-turn rollouts). A model the engine cannot serve is a
    ConfigError here, at the start, not in the first step."""
    if cfg.rollout_engine == "vllm" and cfg.vllm_mode == "server":
        from .client import ServerEngine

        return ServerEngine(cfg, model, tok, device, dist.rank, tools)
    if cfg.rollout_engine == "vllm":
        from .vllm import VLLMEngine

        return VLLMEngine(cfg, model, tok, device, dist, max_len, tools)
    from .native import NativeEngine

    return NativeEngine(model, tok, cfg.kv_cache, tools)
