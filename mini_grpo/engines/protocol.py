"""What the vLLM engines share, in-process (vllm.py) and over HTTP (client.py, server.py):
the model they can serve (check_servable, engine_config), our Sampling as vLLM's keywords, a
seed per row, vLLM's request loop (complete), multi-turn rollouts as rounds of requests
(complete_turns) and its token ids and log-probs as a Rollout, and vllm-serve's shared secret
(server_token). Nothing here imports vLLM, so the client needs none."""

from __future__ import annotations

import os
import re

import torch

from ..fields import ConfigError
from ..models.hf import export_config
from ..tokenizer import HFTokenizer
from .base import Rollout, Sampling, pad_left

TOKEN_ENV = "MINI_GRPO_VLLM_TOKEN"  # vllm-serve's shared secret, the server's and its clients'


def server_token(given: str = "") -> str:
    """vllm-serve's shared secret: `given` (its --token), else $MINI_GRPO_VLLM_TOKEN, else ""
    (none). Visible ASCII, so that it travels in a header as it is: a ConfigError otherwise,
    which never shows it."""
    token = given or os.environ.get(TOKEN_ENV, "")
    if token and not re.fullmatch(r"[!-~]+", token):
        raise ConfigError(f"{TOKEN_ENV} (or vllm-serve's --token): must be printable ASCII "
                          f"without spaces")
    return token


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


def complete(llm, SamplingParams, prompts: list[list[int]], options: dict, seeds: list[int],
             max_tokens: list[int] | None = None):
    """One request per row -> (token ids, their log-probs) per row; `max_tokens`: each row's
    own budget in place of options' (the rounds of complete_turns)."""
    budgets = max_tokens or [options["max_tokens"]] * len(prompts)
    params = [SamplingParams(**{**options, "max_tokens": int(m)}, seed=int(s))
              for s, m in zip(seeds, budgets)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[d[t].logprob for t, d in zip(ts, o.outputs[0].logprobs)]
           for ts, o in zip(toks, outs)]
    return toks, lps


def complete_turns(request, turns, prompts: list[list[int]], max_new_tokens: int,
                   eos_ids: list[int], seeds: list[int]):
    """Multi-turn rollouts (turns.py) on an engine that takes whole prefixes: rounds of
    requests, `request(prefixes, budgets, seeds) -> (token ids, log-probs)` per row. A row's
    turn ends at an EOS; its conversation's answer (tools' results, the next generation
    prompt) is appended as tokens the model did not write (log-prob 0), and the row goes on
    in the next round from its whole prefix (the engine's prefix cache holds the rest). The
    rules are the native engine's (native.generate): max_new_tokens counts every token after
    the prompt, an answer needs room for one token of the model's own after it (else the row
    is cut off: `Turns.unanswered`), and a row out of tokens mid-turn is not finished.
    -> (token ids, log-probs, the model's own tokens, finished) per row."""
    B, eos = len(prompts), set(eos_ids)
    toks, lps, own = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    finished, turn_start, live, rnd = [False] * B, [0] * B, list(range(B)), 0
    while live:
        # a fresh seed per round: a row's draws in round k must not repeat round 0's
        got_t, got_l = request([prompts[g] + toks[g] for g in live],
                               [max_new_tokens - len(toks[g]) for g in live],
                               [(seeds[g] + rnd * 1_000_003) % (2**31 - 1) for g in live])
        ended = []
        for g, t, lp in zip(live, got_t, got_l):
            toks[g] += t
            lps[g] += lp
            own[g] += [True] * len(t)
            if t and t[-1] in eos:
                ended.append(g)
            else:  # out of tokens in its turn: the turn stays unfinished
                turns.cut(g, toks[g][turn_start[g]:])
        answers = turns.end_turn(ended, [toks[g][turn_start[g]:] for g in ended]) \
            if ended else []
        live = []
        for g, ids in zip(ended, answers):
            if ids is not None and len(ids) < max_new_tokens - len(toks[g]):
                toks[g] += ids
                lps[g] += [0.0] * len(ids)
                own[g] += [False] * len(ids)
                turn_start[g] = len(toks[g])
                live.append(g)
            elif ids is not None:  # no room for the answer and a token of its own
                turns.unanswered(g)
            else:
                finished[g] = True
        rnd += 1
    return toks, lps, own, finished


def turns_rollout(tok, turns, prompts, toks, lps, own, finished, device, sampling) -> Rollout:
    """complete_turns' rows as a Rollout, with the conversations, their counts and rewards,
    and the model's own tokens as `model_mask` (what the loss sees)."""
    r = to_rollout(tok, prompts, toks, lps, device, sampling)
    r.finished = torch.tensor(finished, dtype=torch.bool, device=device)
    mask = torch.zeros_like(r.completion_mask)
    for i, o in enumerate(own):
        mask[i, :len(o)] = torch.tensor(o, dtype=torch.bool)
    r.model_mask = mask
    r.texts, r.conversations = turns.last_replies(), turns.conversations()
    r.env_rewards = turns.env_rewards()
    r.turn_counts = turns.counts.to(device)
    return r


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
