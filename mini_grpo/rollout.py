"""Batched sampling with a KV cache -> Rollout, and the micro-batch plan of the passes over it.

Prompts of different lengths are left-padded; every real token gets the absolute position it
would have alone, both while sampling and in `logprobs.completion_logprobs`, so the log-probs
recorded at sampling time equal those of the training forward pass (up to float rounding).

Log-probs are those of the sampling distribution before top-k/top-p truncation:
log_softmax(logits / temperature). Use the same temperature when re-scoring.

Non-finite logits (a policy whose weights blew up) never reach the sampler: such rows
sample from uniform logits instead and the Rollout says so (`nonfinite`), for the guard.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .logprobs import completion_logprobs
from .models import CausalLM, attention_mask, positions
from .models.packed import packed
from .tokenizer import Tokenizer


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, P) left-padded with pad_id
    prompt_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    completion_ids: torch.Tensor  # (B, N) pad_id after each row's EOS
    completion_mask: torch.Tensor  # (B, N) bool, True up to and including EOS
    logprobs: torch.Tensor  # (B, N) fp32 log-prob of each sampled token, 0 where masked
    finished: torch.Tensor  # (B,) bool, the row emitted EOS (else it hit max_new_tokens)
    texts: list[str] | None = None  # decoded completions, without EOS
    nonfinite: torch.Tensor | None = None  # 0-d bool: some logits were NaN/Inf while sampling

    def lengths(self) -> list[int]:
        """Each completion's length in tokens (EOS included)."""
        return self.completion_mask.sum(1).tolist()


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
             use_cache: bool = True) -> Rollout:
    """Samples up to max_new_tokens per prompt, one forward pass per new token for the batch.

    A row ends at the first of its tokens in `eos_id` (one id, or every id that ends a
    completion: a tokenizer's `eos_ids`); sampling stops as soon as every row has ended.
    Rows that have ended stop costing compute: once a quarter of the batch has, the others
    go on without them (their cache rows copied out, so the copies cost little).
    `use_cache=False` recomputes the whole
    sequence at each step (the baseline the KV cache is measured against).
    """
    device = model.lm_head.weight.device
    ids, pmask = pad_left(prompts, pad_id, device)  # (B, P)
    B, P = ids.shape
    N = max_new_tokens
    if P + N > model.cfg.block_size:
        raise ValueError(f"prompt length {P} + max_new_tokens {N} exceeds block_size "
                         f"{model.cfg.block_size}")
    was_training = model.training
    model.eval()

    out = torch.full((B, N), pad_id, dtype=torch.long, device=device)
    out_mask = torch.zeros((B, N), dtype=torch.bool, device=device)
    out_lp = torch.zeros((B, N), dtype=torch.float32, device=device)
    key_valid = torch.zeros((B, P + N), dtype=torch.bool, device=device)
    key_valid[:, :P] = pmask
    all_pos = torch.zeros((B, P + N), dtype=torch.long, device=device)
    all_pos[:, :P] = positions(pmask)
    all_pos[:, P:] = pmask.sum(1, keepdim=True) + torch.arange(N, device=device)
    seq = torch.cat([ids, out], dim=1)  # (B, P + N) for the no-cache path
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), device=device)
    live = torch.arange(B, device=device)  # the rows in the batch (those that ended drop out)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (b,) which of them have ended

    # under autocast, keep the cache in the autocast dtype: half the memory traffic per step,
    # and no re-cast of the whole cache at every token
    amp = torch.is_autocast_enabled(device.type)
    cache_dtype = torch.get_autocast_dtype(device.type) if amp else None
    cache = model.new_cache(B, P + N, dtype=cache_dtype) if use_cache else None
    # frozen weights cast once, not at every token; on a CPU, linear layers on weights cast
    # and prepacked once (models/packed.py: all of them in bf16, the LM head in fp32)
    with _casts_cached(model, amp), packed(model, cache_dtype or model.lm_head.weight.dtype,
                                           rows=B):
        logits = _prefill(model, prompts, ids, pmask, all_pos[:, :P], cache, pad_id)
        steps = 0
        bad = torch.zeros((), dtype=torch.bool, device=device)
        for t in range(N):
            last = logits[:, -1].float()
            finite = torch.isfinite(last).all(-1, keepdim=True)  # (b, 1)
            bad |= ~finite.all()
            last = torch.where(finite, last, 0.0)
            tok, lp = _pick(last, temperature, top_k, top_p, greedy, generator)
            tok = tok.masked_fill(done, pad_id)
            out[live, t] = tok
            out_mask[live, t] = ~done
            out_lp[live, t] = lp.masked_fill(done, 0.0)
            key_valid[live, P + t] = ~done
            done |= torch.isin(tok, eos)
            steps = t + 1
            # the one host sync per token: how many rows have ended (all, or bad: stop)
            ended = int(torch.where(bad, len(live), done.sum()))
            if t == N - 1 or ended == len(live):
                break
            if 4 * ended >= len(live):  # a quarter has ended: the others go on without them
                keep = ~done
                live, tok, done = live[keep], tok[keep], done[keep]
                if use_cache:
                    cache.k, cache.v = cache.k[:, keep], cache.v[:, keep]
            if use_cache:
                mask = attention_mask(key_valid[live, :P + t + 1], 1)
                logits = model(tok[:, None], all_pos[live, P + t:P + t + 1], mask, cache)
            else:
                S = P + t + 1
                seq[live, P + t] = tok
                logits = model(seq[live, :S], all_pos[live, :S],
                               attention_mask(key_valid[live, :S], S), logits_from=S - 1)
    finished = torch.ones(B, dtype=torch.bool, device=device)  # rows that dropped out ended
    finished[live] = done
    model.train(was_training)
    return Rollout(ids, pmask, out[:, :steps], out_mask[:, :steps], out_lp[:, :steps],
                   finished, nonfinite=bad)


@contextmanager
def _casts_cached(model: CausalLM, amp: bool):
    """Autocast caches its casts of trainable weights for the whole autocast region, but
    casts frozen ones (LoRA's base and head, a frozen reference) again at every call: for
    one generation they count as trainable (no graph is built under no_grad), so each is
    cast once. A frozen fp32 LM head cast per decoded token cost 24.5 ms of a SmolLM2-135M
    step on the 2-core Xeon, against 2.2 ms cached."""
    frozen = [p for p in model.parameters()
              if amp and not p.requires_grad and p.dtype == torch.float32]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _prefill(model: CausalLM, prompts, ids, pmask, pos, cache, pad_id):
    """The prompts' forward pass: fills the cache, returns the logits of each row's last
    prompt token (B, 1, V). Rows that repeat a prompt (a GRPO group, RFT's oversampling) are
    computed once and their keys/values copied: 16 prompts x 8 rows cost 16 rows of work."""
    P = ids.size(1)
    slot: dict[tuple, int] = {}
    inv = [slot.setdefault(tuple(p), len(slot)) for p in prompts]
    if cache is None or len(slot) == len(prompts):
        return model(ids, pos, attention_mask(pmask, P), cache, logits_from=P - 1)
    u_ids, u_mask = pad_left([list(p) for p in slot], pad_id, ids.device)  # same width P
    part = model.new_cache(len(slot), P, dtype=cache.k.dtype)
    logits = model(u_ids, positions(u_mask), attention_mask(u_mask, P), part, logits_from=P - 1)
    rows = torch.tensor(inv, device=ids.device)
    cache.k[:, :, :, :P] = part.k[:, rows]
    cache.v[:, :, :, :P] = part.v[:, rows]
    cache.len = P
    return logits[rows]


def score(scorer, examples: list, texts: list[str], lengths: list[int], max_new_tokens: int):
    """The scorer's result for completions `texts` of `examples` (one each), whose metadata
    gets what sampling knows of each completion: `completion_tokens` (its length) and
    `max_new_tokens` (the cap it may have hit). The trainer, evaluation and RFT score here."""
    metas = [{**ex.meta, "completion_tokens": int(n), "max_new_tokens": max_new_tokens}
             for ex, n in zip(examples, lengths)]
    return scorer.score([ex.prompt for ex in examples], texts, [ex.target for ex in examples],
                        metas)


def sample(model: CausalLM, tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int,
           **kw) -> Rollout:
    """Text in, Rollout with decoded `texts` out; prompts are encoded as the tokenizer
    says (`encode_prompt`: a leading BOS, or the chat template)."""
    enc = [tokenizer.encode_prompt(p) for p in prompts]
    r = generate(model, enc, max_new_tokens, tokenizer.eos_ids, tokenizer.pad_id, **kw)
    r.texts = [tokenizer.decode(row) for row in r.completion_ids.tolist()]
    return r


def plan_micro_batches(keys: list, size: int, cost=None, budget: int = 0) -> list[list[int]]:
    """Indices sorted by `keys` (a length first) and cut into micro-batches of at most `size`
    (the last may be smaller), so each micro-batch holds items of similar length and little
    padding. With a `budget`, a micro-batch is also cut before `cost(indices)` would exceed
    it (an item alone may: it has nowhere else to go).

    Cutting early where lengths jump would push a little less padding, but on the 2-core CPU
    it made the default step's policy update 1.4x slower (0.95 vs 0.65 s): every new
    micro-batch shape costs oneDNN a kernel set-up, and with fixed-size micro-batches only
    the length varies.
    """
    plan: list[list[int]] = [[]]
    for i in sorted(range(len(keys)), key=keys.__getitem__):
        cur = plan[-1]
        if cur and (len(cur) == size or (budget and cost(cur + [i]) > budget)):
            plan.append(cur := [])
        cur.append(i)
    return plan if plan[0] else []


@dataclass
class MicroBatch:
    """Rows of a rollout that go through the model together (the reference pass and every
    policy pass), each distinct prompt once, cut to the columns that hold a real token; and
    what the loss needs of those rows, sliced once (in the manner of torchtune's
    GRPOTrajectory): advantages, the engine's log-probs, the reference's (Reference.fill)
    and the old policy's (the first policy pass's)."""
    rows: torch.Tensor  # (b,) the rollout's rows
    prompt_ids: torch.Tensor  # (U, P) the distinct prompts of these rows, left-padded
    prompt_mask: torch.Tensor  # (U, P) bool
    prompt_index: torch.Tensor  # (b,) each row's prompt in prompt_ids
    ids: torch.Tensor  # (b, n) completion tokens
    mask: torch.Tensor  # (b, n) bool, True on the tokens that carry loss
    adv: torch.Tensor | None = None  # (b,)
    engine_logp: torch.Tensor | None = None  # (b, n) what the rollout engine sampled with
    ref_logp: torch.Tensor | None = None  # (b, n) the reference policy's; None: no reference
    old_logp: torch.Tensor | None = None  # (b, n) the policy's before this step's update

    def logprobs(self, model, temperature: float, entropy: bool = False):
        """logp (b, n) of the completion tokens under `model` (and entropy: see
        logprobs.completion_logprobs)."""
        return completion_logprobs(model, self.prompt_ids, self.prompt_mask, self.ids,
                                   self.mask, temperature, self.prompt_index, entropy=entropy)

    def positions(self) -> tuple[int, int]:
        """(token positions pushed through the model, padding included; the real ones)."""
        b, n = self.ids.shape
        real = self.prompt_mask.sum() + (self.mask.sum(1) - 1).clamp(min=0).sum()
        return self.prompt_ids.numel() + b * (n - 1), int(real)


def micro_batches(r: Rollout, cmask: torch.Tensor, size: int, group: int,
                  adv: torch.Tensor | None = None, budget: int = 0) -> list[MicroBatch]:
    """The micro-batches of `row_batches`' plan, each with its rows' advantages (`adv`, (B,))
    and engine log-probs; `cmask` (B, N) is the completion mask less the rows that carry no
    loss."""
    out = []
    for rows in row_batches(r, cmask, size, group, budget):
        cm = cmask[rows]
        n = max(1, int(cm.sum(1).max()))
        groups, index = torch.unique(rows // group, return_inverse=True)
        pids, pm = r.prompt_ids[groups * group], r.prompt_mask[groups * group]
        first = int(pm.any(0).int().argmax())  # prompts are left-padded
        out.append(MicroBatch(rows, pids[:, first:], pm[:, first:], index,
                              r.completion_ids[rows, :n], cm[:, :n],
                              adv=None if adv is None else adv[rows],
                              engine_logp=r.logprobs[rows, :n]))
    return out


def row_batches(r, cmask: torch.Tensor, size: int, group: int,
                budget: int = 0) -> list[torch.Tensor]:
    """The rows a training or reference pass pushes through the model, as index tensors of
    micro-batches; each micro-batch computes the prompts of its rows once.

    Two plans, and the one that pushes fewer token positions wins: whole groups (`group`
    consecutive rows share a prompt) sorted by their longest completion, size // group groups
    each, so every prompt is computed once; or rows sorted by completion length, `size`
    each, which pads less where completions of one prompt differ widely (a random-init
    policy, reasoning traces) at the price of a prompt computed in more than one
    micro-batch. `budget` > 0: no micro-batch pushes more token positions than that (but a
    row alone), which bounds a pass's activation memory whatever the completions' lengths;
    the whole-groups plan counts only where it keeps it. Rows with no token in `cmask` (left
    out by dynamic sampling) carry no loss and are skipped, but one is always kept so every
    rank runs a backward (DDP's all-reduce).
    """
    n = cmask.sum(1).tolist()
    p = r.prompt_mask.sum(1).tolist()
    live = [i for i, k in enumerate(n) if k] or [0]
    groups: dict[int, list[int]] = {}
    for i in live:
        groups.setdefault(i // group, []).append(i)
    members = list(groups.values())

    def pushed(rows):  # token positions of one micro-batch: each prompt once, padding included
        return (len({i // group for i in rows}) * max(p[i] for i in rows)
                + len(rows) * (max(n[i] for i in rows) - 1))

    def rows_of(gs):
        return [i for g in gs for i in members[g]]

    by_group = [rows_of(b) for b in plan_micro_batches(
        [(max(n[i] for i in rows), p[rows[0]]) for rows in members], max(1, size // group),
        lambda gs: pushed(rows_of(gs)), budget)]
    by_row = [[live[j] for j in b] for b in plan_micro_batches(
        [(n[i], i // group) for i in live], size, lambda js: pushed([live[j] for j in js]),
        budget)]
    plans = [by_group, by_row] if not budget or all(
        pushed(b) <= budget for b in by_group) else [by_row]
    best = min(plans, key=lambda plan: sum(map(pushed, plan)))  # ties: whole groups
    return [torch.tensor(b, device=cmask.device) for b in best]
