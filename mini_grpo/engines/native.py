"""The native engine: our batched, KV-cached sampler, on the policy itself.

    r = generate(model, prompt_ids, max_new_tokens, eos_ids, pad_id, temperature=0.7)
    r = sample(model, tok, ["2+3="], 16)                   # text in, texts out
    engine = NativeEngine(model, tok); engine.generate(prompts, Sampling(16), generator)

Prompts of different lengths are left-padded (after the tokens all of them share, if there
are SHARED_PREFIX_MIN of them: a system prompt, a tool list, computed once; not for a model
with a sliding window, whose mask counts columns as positions); every real token
gets the absolute position it would have alone, both while sampling and in
`logprobs.completion_logprobs`, so the log-probs recorded at sampling time equal those of
the training forward pass (up to float rounding).

Log-probs are those of the sampling distribution before top-k/top-p truncation:
log_softmax(logits / temperature). Re-scoring uses the same temperature (the Rollout's
`sampling` carries it).

Non-finite logits (a policy whose weights blew up) never reach the sampler: such rows
sample from uniform logits instead and the Rollout says so (`nonfinite`), for the guard.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
import torch.nn.functional as F

from .. import fsdp
from ..models import CausalLM, attention_mask, positions
from ..models.core import Attention
from ..models.packed import packed
from ..tokenizer import Tokenizer
from .base import Rollout, Sampling, pad_left
from .turns import ToolSetup, Turns, TurnState


class NativeEngine:
    name = "native"
    alone = True  # each rank samples its own rows with its own (gathered) policy

    def __init__(self, model, tok, use_cache: bool = True, tools: ToolSetup | None = None):
        self.model, self.tok, self.use_cache, self.tools = model, tok, use_cache, tools

    def generate(self, prompts: list, sampling: Sampling, generator=None,
                 autocast=None) -> Rollout:
        # under fsdp every rank gathers the full weights once for the whole rollout
        with fsdp.full_params(self.model), autocast or nullcontext():
            return sample(self.model, self.tok, prompts, sampling.max_new_tokens,
                          temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, greedy=sampling.greedy, generator=generator,
                          use_cache=self.use_cache, tools=self.tools)

    def sync(self, model) -> None:
        """Nothing to do: this engine samples with the policy itself."""

    def close(self) -> None:
        pass


def sample(model: CausalLM, tokenizer: Tokenizer, prompts: list, max_new_tokens: int,
           tools: ToolSetup | None = None, **kw) -> Rollout:
    """Text (or chat messages) in, Rollout with decoded `texts` out; prompts are encoded as
    the tokenizer says (`encode_prompt`: a leading BOS, or the chat template). With `tools`,
    multi-turn conversations (turns.py): `texts` holds each row's last reply, and the
    Rollout its conversation and counts."""
    if tools is None:
        enc = [tokenizer.encode_prompt(p) for p in prompts]
        r = generate(model, enc, max_new_tokens, tokenizer.eos_ids, tokenizer.pad_id, **kw)
        return replace(r, texts=[tokenizer.decode(row) for row in r.completion_ids.tolist()])
    turns = Turns(tools, tokenizer, prompts)
    return generate(model, turns.prompt_ids(), max_new_tokens, tokenizer.eos_ids,
                    tokenizer.pad_id, turns=turns, **kw)


def _pick(logits, temperature, top_k, top_p, greedy, generator):
    """logits (B, V) fp32 -> (token (B,), its log-prob under logits / temperature (B,))."""
    logp = F.log_softmax(logits / temperature, dim=-1)
    if greedy:
        tok = logits.argmax(-1)
    else:
        filt = logp
        if top_k and top_k < logits.size(-1):
            kth = filt.topk(top_k, dim=-1).values[:, -1:]
            filt = filt.masked_fill(filt < kth, float("-inf"))
        if top_p < 1.0:
            sorted_lp, idx = filt.sort(dim=-1, descending=True)
            cum = sorted_lp.softmax(-1).cumsum(-1)
            drop = cum - sorted_lp.softmax(-1) >= top_p  # keep the smallest set reaching top_p
            filt = filt.scatter(-1, idx, sorted_lp.masked_fill(drop, float("-inf")))
        # the exponential race (gpt-fast, vLLM): argmax_i p_i / E_i with E_i ~ Exp(1) picks i
        # with probability p_i (any scale of p: the filtered log-probs need no renormalising),
        # at a fraction of torch.multinomial's cost on a wide vocabulary (32 ms a call on
        # 32 x 49152). E = -log U, U ~ U[0, 1): never 0, so a filtered token's p = 0 stays 0;
        # Tensor.exponential_ draws the same law 6x slower on a CPU (7.5 vs 1.2 ms, 8 x 49152)
        e = torch.rand(filt.shape, generator=generator, device=filt.device).log_().neg_()
        tok = filt.exp().div_(e).argmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


@torch.no_grad()
def generate(model: CausalLM, prompts: list[list[int]], max_new_tokens: int,
             eos_id: int | list[int], pad_id: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None,
             use_cache: bool = True, turns: Turns | None = None) -> Rollout:
    """Samples up to max_new_tokens per prompt, one forward pass per new token for the batch
    (_Decoding: rows that have ended drop out). A row ends at the first of its tokens in
    `eos_id` (one id, or a tokenizer's `eos_ids`). `use_cache=False` recomputes the whole
    sequence at each step (the baseline the KV cache is measured against). With `turns`
    (multi-turn, turns.py), an EOS ends the row's turn: its TurnState's answer (tools'
    results, the next generation prompt) is taken one id per step in place of a sampled
    token, from the row's KV cache, attended to and left out of `model_mask`; the row ends as
    TurnState's rules say. When no turn is answered, the rollout equals the one without
    `turns` bit for bit."""
    device = model.lm_head.weight.device
    shared = _shared_prefix(prompts) if use_cache and not _windowed(model) else 0
    ids, pmask = _layout(prompts, pad_id, device, shared)  # (B, P)
    B, P = ids.shape
    N = max_new_tokens
    if P + N > model.cfg.block_size:
        raise ValueError(f"prompt length {P} + max_new_tokens {N} exceeds block_size "
                         f"{model.cfg.block_size}")
    was_training = model.training
    model.eval()
    d = _Decoding.of(ids, pmask, N, pad_id)
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), device=device)
    state = TurnState(turns, B, N, device) if turns is not None else None
    # under autocast, keep the cache in the autocast dtype: half the memory traffic per step,
    # and no re-cast of the whole cache at every token
    amp = torch.is_autocast_enabled(device.type)
    cache_dtype = torch.get_autocast_dtype(device.type) if amp else None
    cache = model.new_cache(B, P + N, dtype=cache_dtype) if use_cache else None
    # frozen weights cast once, not at every token; on a CPU, linear layers on weights cast
    # and prepacked once (models/packed.py: all of them in bf16, the LM head in fp32)
    with _casts_cached(model, amp), packed(model, cache_dtype or model.lm_head.weight.dtype,
                                           rows=B):
        logits = _prefill(model, prompts, ids, pmask, d.pos[:, :P], cache, shared)
        for t in range(N):
            tok, lp = _pick(d.finite(logits[:, -1].float()), temperature, top_k, top_p,
                            greedy, generator)
            if state is not None:  # (b,) rows taking their conversation's ids
                given = state.is_forced[d.live, t]
                tok = torch.where(given, state.forced[d.live, t], tok)
                lp = lp.masked_fill(given, 0.0)
            tok = d.record(t, tok, lp)
            if state is None:
                d.done |= torch.isin(tok, eos)
            else:
                turn_ended = (torch.isin(tok, eos) & ~given & ~d.done).nonzero().flatten()
                if len(turn_ended):
                    rows = d.live[turn_ended].tolist()
                    nxt = state.end_turns(rows, d.out[rows, :t + 1].tolist())
                    d.done[turn_ended] = torch.tensor([x is None for x in nxt], device=device)
            if t == N - 1 or d.all_ended():
                break
            tok = d.drop_ended(tok, cache)
            logits = d.forward(model, tok, t, cache)
    model.train(was_training)
    r = d.rollout(ids, pmask, Sampling(max_new_tokens, temperature, top_k, top_p, greedy))
    return r if state is None else state.rollout(r)


class _Decoding:
    """generate's batch as it decodes: the completions so far (B, N) with their masks and
    log-probs, the keys every row may attend to and each position's index (B, P + N), and
    the rows still in the batch (`live`, those that ended drop out) with which of them have
    ended (`done`, (b,))."""

    def __init__(self, ids, out, key_valid, pos, pad_id):
        B, device = ids.size(0), ids.device
        self.P, self.pad_id, self.steps = ids.size(1), pad_id, 0
        self.out, self.pos, self.key_valid = out, pos, key_valid
        self.out_mask = torch.zeros(out.shape, dtype=torch.bool, device=device)
        self.out_lp = torch.zeros(out.shape, dtype=torch.float32, device=device)
        self.seq = torch.cat([ids, out], dim=1)  # (B, P + N) for the no-cache path
        self.live = torch.arange(B, device=device)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # non-finite logits seen

    @classmethod
    def of(cls, ids, pmask, N: int, pad_id: int) -> _Decoding:
        (B, P), device = ids.shape, ids.device
        key_valid = torch.zeros((B, P + N), dtype=torch.bool, device=device)
        key_valid[:, :P] = pmask
        pos = torch.zeros((B, P + N), dtype=torch.long, device=device)
        pos[:, :P] = positions(pmask)
        pos[:, P:] = pmask.sum(1, keepdim=True) + torch.arange(N, device=device)
        out = torch.full((B, N), pad_id, dtype=torch.long, device=device)
        return cls(ids, out, key_valid, pos, pad_id)

    def finite(self, last):
        """The last position's logits (b, V) fp32 with a row's non-finite ones zeroed, and
        flagged (the rollout's `nonfinite`: its update is skipped)."""
        finite = torch.isfinite(last).all(-1, keepdim=True)  # (b, 1)
        self.bad |= ~finite.all()
        return torch.where(finite, last, 0.0)

    def record(self, t: int, tok, lp):
        """Column t's tokens of the live rows (pad where a row has ended) -> those tokens."""
        live, done = self.live, self.done
        tok = tok.masked_fill(done, self.pad_id)
        self.out[live, t] = tok
        self.out_mask[live, t] = ~done
        self.out_lp[live, t] = lp.masked_fill(done, 0.0)
        self.key_valid[live, self.P + t] = ~done
        self.steps = t + 1
        return tok

    def all_ended(self) -> bool:
        """The one host sync per token: whether every row has ended (or logits went bad)."""
        self.ended = int(torch.where(self.bad, len(self.live), self.done.sum()))
        return self.ended == len(self.live)

    def drop_ended(self, tok, cache):
        """Once a quarter of the batch has ended, the others go on without them (their cache
        rows copied out, so the copies cost little) -> the live rows' tokens."""
        if 4 * self.ended < len(self.live):
            return tok
        keep = ~self.done
        self.live, self.done = self.live[keep], self.done[keep]
        if cache is not None:
            cache.keep(keep)
        return tok[keep]

    def forward(self, model, tok, t: int, cache):
        """The next position's logits for the live rows, from the cache, or (no cache) from
        the whole sequence again."""
        P, live = self.P, self.live
        if cache is not None:
            mask = attention_mask(self.key_valid[live, :P + t + 1], 1)
            return model(tok[:, None], self.pos[live, P + t:P + t + 1], mask, cache)
        S = P + t + 1
        self.seq[live, P + t] = tok
        return model(self.seq[live, :S], self.pos[live, :S],
                     attention_mask(self.key_valid[live, :S], S), logits_from=S - 1)

    def rollout(self, ids, pmask, sampling: Sampling) -> Rollout:
        finished = torch.ones(ids.size(0), dtype=torch.bool, device=ids.device)
        finished[self.live] = self.done  # rows that dropped out ended
        n = self.steps
        mask = self.out_mask[:, :n]
        return Rollout(prompt_ids=ids, prompt_mask=pmask, completion_ids=self.out[:, :n],
                       completion_mask=mask, logprobs=self.out_lp[:, :n], finished=finished,
                       model_mask=mask, nonfinite=self.bad, sampling=sampling)


@contextmanager
def _casts_cached(model: CausalLM, amp: bool):
    """Autocast caches its casts of trainable weights for the whole autocast region, but
    casts frozen ones (LoRA's base and head, a frozen reference) again at every call: for
    one generation they count as trainable (no graph is built under no_grad), so each is
    cast once. A frozen fp32 LM head cast per decoded token cost a SmolLM2-135M decode step
    about ten times what its cached cast costs (docs/history.md)."""
    frozen = [p for p in model.parameters()
              if amp and not p.requires_grad and p.dtype == torch.float32]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


SHARED_PREFIX_MIN = 16  # tokens all prompts must share before they are computed once


def _windowed(model: CausalLM) -> bool:
    """Whether a layer attends to a sliding window (Gemma 3's): its mask counts columns as
    positions (core.windowed), which holds for left padding alone, so such a model's prompts
    never get the shared-prefix layout (padding between real tokens)."""
    return any(isinstance(m, Attention) and m.window is not None for m in model.modules())


def _shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (a system prompt, a tool list), leaving
    each at least one of its own; 0 below SHARED_PREFIX_MIN or for one prompt."""
    if len(prompts) < 2:
        return 0
    n = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)
    return n if n >= SHARED_PREFIX_MIN else 0


def _layout(prompts: list[list[int]], pad_id: int, device, shared: int):
    """(ids (B, P), mask (B, P)): the prompts left-padded; with `shared` leading tokens in
    common, those first in every row and the rest left-padded after them (padding in the
    middle: positions and masks follow the real tokens, so what each token sees is the same,
    and the shared part's keys and values are one computation)."""
    if not shared:
        return pad_left(prompts, pad_id, device)
    ids, mask = pad_left([p[shared:] for p in prompts], pad_id, device)
    head = torch.tensor(prompts[0][:shared], dtype=torch.long, device=device)
    return (torch.cat([head.expand(len(prompts), shared), ids], 1),
            torch.cat([torch.ones((len(prompts), shared), dtype=torch.bool, device=device),
                       mask], 1))


def _prefill(model: CausalLM, prompts, ids, pmask, pos, cache, shared: int = 0):
    """The prompts' forward pass: fills the cache, returns the logits of each row's last
    prompt token (B, 1, V). Rows that repeat a prompt (a GRPO group, RFT's oversampling) are
    computed once and their keys/values copied: 16 prompts x 8 rows cost 16 rows of work. The
    first `shared` columns, the same in every row (_layout), are computed once for all."""
    P = ids.size(1)
    if cache is None:
        return model(ids, pos, attention_mask(pmask, P), None, logits_from=P - 1)
    slot: dict[tuple, int] = {}
    inv = [slot.setdefault(tuple(p), len(slot)) for p in prompts]
    rows = [inv.index(u) for u in range(len(slot))]  # a row of each distinct prompt
    part = cache if len(slot) == len(prompts) else \
        model.new_cache(len(slot), P, dtype=cache.k.dtype)
    if shared:
        head = model.new_cache(1, shared, dtype=cache.k.dtype)
        model(ids[:1, :shared], pos[:1, :shared], attention_mask(pmask[:1, :shared], shared),
              head, logits_from=shared - 1)
        part.k[:, :, :, :shared] = head.k
        part.v[:, :, :, :shared] = head.v
        part.len = shared
    logits = model(ids[rows, shared:], pos[rows, shared:], attention_mask(pmask[rows], P - shared),
                   part, logits_from=P - shared - 1)
    if part is cache:
        return logits
    back = torch.tensor(inv, device=ids.device)
    cache.k[:, :, :, :P] = part.k[:, back]
    cache.v[:, :, :, :P] = part.v[:, back]
    cache.len = P
    return logits[back]
