"""What the vLLM engines share, in-process (vllm.py) and over HTTP (client.py, server.py):
the model they can serve (check_servable, engine_config), our Sampling as vLLM's keywords, a
seed per row, vLLM's request loop (complete), multi-turn rollouts as rounds of requests
(complete_turns, by turns.TurnState's rules) and its token ids and log-probs as a Rollout,
and vllm-serve's shared secret (server_token). Nothing here imports vLLM, so the client
needs none."""

from __future__ import annotations

import os
import re

import torch

from ..fields import ConfigError
from ..models.hf import export_config
from ..tokenizer import HFTokenizer
from .base import Rollout, Sampling, pad_left
from .turns import Turns, TurnState

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


def complete_turns(request, state, prompts: list[list[int]], max_new_tokens: int,
                   eos_ids: list[int], seeds: list[int]):
    """Multi-turn rollouts (turns.py) on an engine that takes whole prefixes: rounds of
    requests, `request(prefixes, budgets, seeds) -> (token ids, log-probs)` per row. A row's
    turn ends at an EOS; its TurnState's answer (tools' results, the next generation
    prompt) is appended as tokens the model did not write (log-prob 0), and the row goes on
    in the next round from its whole prefix (the engine's prefix cache holds the rest), by
    the rules TurnState writes for both engines. -> (token ids, log-probs) per row, for
    `state.rollout(to_rollout(...))`."""
    B, eos = len(prompts), set(eos_ids)
    toks, lps = [[] for _ in range(B)], [[] for _ in range(B)]
    live, rnd = list(range(B)), 0
    while live:
        # a fresh seed per round: a row's draws in round k must not repeat round 0's
        got_t, got_l = request([prompts[g] + toks[g] for g in live],
                               [max_new_tokens - len(toks[g]) for g in live],
                               [(seeds[g] + rnd * 1_000_003) % (2**31 - 1) for g in live])
        for g, t, lp in zip(live, got_t, got_l):
            toks[g] += t
            lps[g] += lp
        # a row whose request ended without an EOS is out of tokens: TurnState.rollout
        # hands its unfinished turn to the conversation
        ended = [g for g, t in zip(live, got_t) if t and t[-1] in eos]
        answers = state.end_turns(ended, [toks[g] for g in ended]) if ended else []
        live = [g for g, ids in zip(ended, answers) if ids is not None]
        for g, ids in zip(ended, answers):
            if ids is not None:
                toks[g] += ids
                lps[g] += [0.0] * len(ids)
        rnd += 1
    return toks, lps


def turns_rollout(request, setup, tok, prompts: list, sampling: Sampling, generator,
                  device) -> Rollout:
    """Multi-turn rollouts of `prompts` (this rank's rows) through `request` (complete_turns'):
    their conversations (turns.Turns of `setup`), the rounds, and the Rollout TurnState
    makes of them."""
    turns = Turns(setup, tok, prompts)
    enc = turns.prompt_ids()
    state = TurnState(turns, len(enc), sampling.max_new_tokens)
    toks, lps = complete_turns(request, state, enc, sampling.max_new_tokens, tok.eos_ids,
                               row_seeds(len(enc), generator))
    return state.rollout(to_rollout(tok, enc, toks, lps, device, sampling))


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
    return Rollout(prompt_ids=pids, prompt_mask=pmask, completion_ids=ids.to(device),
                   completion_mask=mask.to(device), logprobs=lp.to(device),
                   finished=finished.to(device), model_mask=mask.to(device),
                   nonfinite=~torch.isfinite(lp).all().to(device), sampling=sampling,
                   texts=[tok.decode(row) for row in ids.tolist()])
