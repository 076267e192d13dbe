"""What the vLLM engines share, in-process (vllm.py) and over HTTP (client.py, server.py):
the model they can serve (check_servable, engine_config), our Sampling as vLLM's keywords, a
seed per row, vLLM's request loop (complete) and its token ids and log-probs as a Rollout.
Nothing here imports vLLM, so the client needs none."""

from __future__ import annotations

import torch

from ..fields import ConfigError
from ..models.hf import export_config
from ..tokenizer import HFTokenizer
from .base import Rollout, Sampling, pad_left


def check_servable(tok) -> None:
    """vLLM serves Hugging Face models: a ConfigError for our character-level GPT."""
    if not isinstance(tok, HFTokenizer):
        raise ConfigError("rollout_engine: vllm serves Hugging Face models: set init_from "
                          "to a model directory (this run's policy is our character-level "
                          "GPT, whose tokenizer vLLM cannot load)")


def engine_config(model, dtype: torch.dtype) -> dict:
    """config.json for the engine: the model's, in `dtype`, its LM head untied (vLLM 0.32's
    in-place reload leaves a tied head on its old weights, so the engine holds the head as a
    weight of its own, sent like any other)."""
    return {**export_config(model, dtype), "tie_word_embeddings": False}


def sampling_options(sampling, eos_ids: list[int]) -> dict:
    """SamplingParams' keywords for our Sampling (JSON, for the server too); a seed per row
    is added by `complete`."""
    return {"temperature": 0.0 if sampling.greedy else sampling.temperature,
            "top_k": sampling.top_k or -1, "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens, "stop_token_ids": list(eos_ids),
            "logprobs": 0, "detokenize": False}


def complete(llm, SamplingParams, prompts: list[list[int]], options: dict, seeds: list[int]):
    """One request per row -> (token ids, their log-probs) per row."""
    params = [SamplingParams(**options, seed=int(s)) for s in seeds]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[d[t].logprob for t, d in zip(ts, o.outputs[0].logprobs)]
           for ts, o in zip(toks, outs)]
    return toks, lps


def row_seeds(n: int, generator) -> list[int]:
    """A seed per row from the run's sampling RNG: the same config gives the same run."""
    device = generator.device if generator is not None else "cpu"
    return torch.randint(2**31 - 1, (n,), generator=generator, device=device).tolist()


def to_rollout(tok, prompts: list[list[int]], toks: list[list[int]], lps: list[list[float]],
               device, sampling: Sampling) -> Rollout:
    """An engine's token ids and log-probs per row, drawn as `sampling` says -> Rollout (texts
    by our tokenizer)."""
    B, pad, eos = len(prompts), tok.pad_id, set(tok.eos_ids)
    N = max(1, max(len(t) for t in toks))
    ids = torch.full((B, N), pad, dtype=torch.long)
    mask = torch.zeros((B, N), dtype=torch.bool)
    lp = torch.zeros((B, N), dtype=torch.float32)
    finished = torch.zeros(B, dtype=torch.bool)
    for i, (t, l) in enumerate(zip(toks, lps)):
        if len(t) != len(l) or len(t) > N:
            raise ValueError(f"row {i}: {len(t)} tokens but {len(l)} log-probs")
        ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        mask[i, :len(t)] = True
        lp[i, :len(t)] = torch.tensor(l, dtype=torch.float32)
        finished[i] = bool(t) and t[-1] in eos
    pids, pmask = pad_left(prompts, pad, device)
    r = Rollout(pids, pmask, ids.to(device), mask.to(device), lp.to(device),
                finished.to(device), nonfinite=~torch.isfinite(lp).all().to(device),
                sampling=sampling)
    r.texts = [tok.decode(row) for row in ids.tolist()]
    return r
