"""What every model family shares: left-padded positions and masks, the KV cache, attention
(SDPA or manual, grouped-query), and CausalLM, the forward passes the trainer relies on.

A family (gpt.py, llama.py) supplies its blocks, `embed(idx, pos)`, `rope(pos)` (rotary
cos/sin, or None when positions are learned embeddings), `norm_f` and `lm_head`; CausalLM runs
them the same way for every family:
  forward(idx, pos, mask, cache, logits_from)   full pass, or one decoding step with a cache
  forward(completions, prefix=(prompts, ...))    the shared-prompt pass (forward_shared)
Rows of a batch may be left-padded. Callers then pass, for every forward pass:
  pos   (B, T) absolute positions, so a row's real tokens get the positions they would get alone
        (`positions(valid)`), and
  mask  (B, 1, T, S) bool attention mask over the S keys seen so far (`attention_mask(...)`).
With neither, the batch is taken as unpadded and attention is plain causal. The model code
knows nothing of RL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# the CPU has AMX tiles (Sapphire Rapids and later), where SDPA's bf16 kernel is the fastest
_AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def positions(valid: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B, T) long: index of each real token within its row (pads get 0)."""
    return (valid.long().cumsum(1) - 1).clamp(min=0)


def attention_mask(key_valid: torch.Tensor, q_len: int) -> torch.Tensor:
    """Causal mask for the last `q_len` of S keys, hiding pad keys: (B, S) -> (B, 1, q_len, S).

    A pad query still attends to itself so no row is fully masked (SDPA would return NaN);
    its output is never used.
    """
    S = key_valid.size(1)
    q = torch.arange(S - q_len, S, device=key_valid.device)[:, None]  # (q_len, 1)
    k = torch.arange(S, device=key_valid.device)[None, :]  # (1, S)
    m = (k <= q)[None] & key_valid[:, None, :]  # (B, q_len, S)
    return (m | (k == q)[None])[:, None]


class KVCache:
    """Pre-allocated keys and values for every layer: (n_layer, B, n_kv_head, max_len, hs)."""

    def __init__(self, n_layer, batch, n_head, max_len, head_dim, device, dtype):
        shape = (n_layer, batch, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.len = 0  # positions filled so far

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Writes this step's (B, nkv, T, hs) keys/values; returns all keys/values up to them."""
        T = k.size(2)
        self.k[layer, :, :, self.len:self.len + T] = k
        self.v[layer, :, :, self.len:self.len + T] = v
        end = self.len + T
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def keep(self, rows: torch.Tensor) -> None:
        """Keeps the batch rows where `rows` (B,) is True, moved to the front in place, one
        layer at a time; the cache becomes a view of its first rows. Gathering every layer's
        kept rows at once allocated a second cache beside the first at each drop: on a CPU,
        in a heap that training had left in pieces, each landed on pages of its own, and the
        LM job's evaluations peaked at 4.5 GiB against 3.9 in place (docs/history.md)."""
        idx = rows.nonzero().flatten()
        n = len(idx)
        for t in (self.k, self.v):
            for layer in range(t.size(0)):  # the right side is gathered before it is written
                t[layer, :n, :, :self.len] = t[layer, idx, :, :self.len]
        self.k, self.v = self.k[:, :n], self.v[:, :n]


@dataclass
class SharedPrefix:
    """Layout of a shared-prefix pass (CausalLM.forward with `prefix=`): U prompts of P
    columns, then B completions of m input tokens each; row i's prompt is prompts[index[i]]."""
    U: int
    P: int
    B: int
    m: int
    index: torch.Tensor  # (B,) long: each row's prompt
    mask_p: torch.Tensor  # (U, 1, P, P) prompt tokens: causal, pad keys hidden
    mask_c: torch.Tensor  # (B, 1, m, P + m) completion tokens: own prompt + causal
    rope_p: tuple | None = None  # rotary (cos, sin) of the prompt tokens (U, P, hs)
    rope_c: tuple | None = None  # ... and of the completion tokens (B, m, hs)


def windowed(mask, T: int, S: int, window: int, device) -> torch.Tensor:
    """`mask` (B, 1, T, S) bool, or None / "causal" for plain causal attention, where the T
    queries are the last T of S columns, less the keys `window` or more columns before their
    query (a sliding-window layer's: query q sees key k where q - k < window, as Hugging
    Face's sliding_window_overlay). Columns stand for positions: rows are left-padded, so
    between two real tokens the distance in columns is the distance in positions (the
    sampler's shared-prefix layout, which pads mid-row, is never used with a window:
    engines/native._windowed)."""
    q = torch.arange(S - T, S, device=device)[:, None]  # (T, 1)
    k = torch.arange(S, device=device)[None, :]  # (1, S)
    band = q - k < window  # (T, S)
    if mask is None or isinstance(mask, str):
        return (band & (k <= q))[None, None]
    return mask & band


def rotate(x: torch.Tensor, rope: tuple | None) -> torch.Tensor:
    """Rotary embedding of x (N, heads, T, hs) with cos/sin (N, T, hs): the half-split
    (rotate_half) form Llama's checkpoints are trained with."""
    if rope is None:
        return x
    cos, sin = (t[:, None].to(x.dtype) for t in rope)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal self-attention; a family supplies `project(x) -> q (..., nh, hs), k, v
    (..., nkv, hs)` and `out(y)`. Keys and values are cached with their nkv heads; queries
    share them in groups of nh / nkv (grouped-query attention). A family may set `scale` (the
    scores' factor; None: 1 / sqrt(head size)) and `window` (a sliding-window layer's: keys
    fewer than this many positions back; None: all of them)."""

    scale: float | None = None
    window: int | None = None

    def __init__(self, n_head: int, n_kv_head: int, head_dim: int, dropout: float):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.dropout = dropout
        self.manual = False  # plain matmul-softmax attention instead of SDPA (CausalLM.attn_impl)

    def forward(self, x, mask=None, cache: KVCache | None = None, layer: int = 0,
                shared: SharedPrefix | None = None, rope: tuple | None = None):
        if shared is not None:
            return self._forward_shared(x, shared)
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.project(x))  # (B, h, T, hs)
        q, k = rotate(q, rope), rotate(k, rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, nkv, S, hs)
        if self.window is not None:
            mask = windowed(mask, T, k.size(2), self.window, x.device)
        if mask is None:
            if cache is not None and cache.len > 0:
                raise ValueError("incremental decoding needs an attention mask")
            if not self.manual:
                mask = "causal"
            else:
                S = k.size(2)
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        # with a cache (sampling) always SDPA: it reads the cache's strided slice in place,
        # where a bf16 matmul on a CPU first copies it (1.9 vs 0.8 ms a layer at batch 128)
        y = self._attend(q, k, v, mask, self.manual and cache is None)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))

    def _attend(self, q, k, v, mask, manual: bool):
        """softmax(q k^T / sqrt(hs)) v over the keys `mask` allows (bool, True = attend, or
        "causal"); manual = matmul, softmax, matmul, else SDPA."""
        p = self.dropout if self.training else 0.0
        gqa = self.n_kv_head != self.n_head
        B, nh, T, hs = q.shape
        if T == 1 and q.device.type == "cpu" and q.dtype != torch.float32 and not p \
                and not _AMX and not isinstance(mask, str):  # (a one-token pass without
            # a cache or mask, SFT's, stays SDPA's: the manual path needs a mask tensor)
            # a decode step under bf16 on a CPU without AMX: SDPA's kernel costs several
            # times what grouped matmuls do (each key/value head with its g query heads, no
            # copies of the keys); with AMX, SDPA wins; in fp32 SDPA is as fast (the figures:
            # docs/history.md)
            manual = True
        if not manual:
            causal = isinstance(mask, str)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask,
                                                  dropout_p=p, is_causal=causal, enable_gqa=gqa,
                                                  scale=self.scale)
        # each key/value head with its g query heads as one matmul, not keys and values copied
        # g times (repeat_interleave): autograd keeps k and v for the backward, at 1/g the size
        nkv, S = self.n_kv_head, k.size(2)
        g = nh // nkv
        # scale q, not the (T, S) scores, and mask in place: each pass over the scores costs
        # as much as the matmul that made them on a CPU
        scale = hs**-0.5 if self.scale is None else self.scale
        att = (q * scale).reshape(B, nkv, g * T, hs) @ k.transpose(-2, -1)  # (B, nkv, gT, S)
        att = att.view(B, nkv, g, T, S).masked_fill_(~mask.unsqueeze(-3), float("-inf"))
        att = att.softmax(dim=-1).view(B, nkv, g * T, S)
        y = F.dropout(att, p) @ v if p else att @ v  # (B, nkv, gT, hs)
        return y.view(B, nh, T, hs)

    def _forward_shared(self, x, s: SharedPrefix):
        """x (U*P + B*m, C): the U prompts' tokens, then the B completions' input tokens."""
        n_p = s.U * s.P
        if self.window is not None:
            s = replace(s, mask_p=windowed(s.mask_p, s.P, s.P, self.window, x.device),
                        mask_c=windowed(s.mask_c, s.m, s.P + s.m, self.window, x.device))
        q, k, v = self.project(x)  # (U*P + B*m, h, hs)
        qp, kp, vp = (t[:n_p].unflatten(0, (s.U, s.P)).transpose(1, 2) for t in (q, k, v))
        qp, kp = rotate(qp, s.rope_p), rotate(kp, s.rope_p)  # (U, h, P, hs)
        y = [self._attend(qp, kp, vp, s.mask_p, self.manual).transpose(1, 2).flatten(0, 1)]
        if s.m:
            qc, kc, vc = (t[n_p:].unflatten(0, (s.B, s.m)).transpose(1, 2) for t in (q, k, v))
            qc, kc = rotate(qc, s.rope_c), rotate(kc, s.rope_c)
            # each completion sees its prompt's keys (computed once) and its own
            k = torch.cat([kp[s.index], kc], 2)  # (B, nkv, P + m, hs)
            v = torch.cat([vp[s.index], vc], 2)
            y.append(self._attend(qc, k, v, s.mask_c, self.manual).transpose(1, 2)
                     .flatten(0, 1))
        return self.out(torch.cat(y).flatten(1))


class CausalLM(nn.Module):
    """The passes every family runs the same way (see the module docstring). A family sets
    `cfg` (with vocab_size, block_size, n_layer), `blocks`, `norm_f`, `lm_head` and
    `gradient_checkpointing`, and defines embed() and, for rotary positions, rope()."""

    family = ""  # the registry's name (models/__init__.py)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lookup(self, emb: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
        """emb(idx) for a family's embed(): the token embedding, whose weight gradient is
        sparse (the rows looked up) where that is safe, i.e. the weight is the LM head's, so
        every backward through it also brings the head's dense gradient, which autograd adds
        the rows into in place. A dense embedding backward instead zero-fills a (V, C)
        buffer and adds it to the head's: on a CPU, 113 MB for SmolLM2 at each micro-batch,
        the fill page-faulting fresh memory. Dense on GPUs, where that
        costs little, and under torch.compile."""
        w = emb.weight
        if (idx.device.type == "cpu" and w.requires_grad and torch.is_grad_enabled()
                and getattr(self.lm_head, "weight", None) is w
                and not torch.compiler.is_compiling()):
            return F.embedding(idx, w, sparse=True)
        return emb(idx)

    def rope(self, pos: torch.Tensor) -> tuple | None:
        """Rotary (cos, sin) for positions (..., T) -> (..., T, hs) each; None: no rotary."""
        return None

    def cache_heads(self) -> tuple[int, int]:
        """(key/value heads, head size) per layer of the KV cache."""
        raise NotImplementedError

    @property
    def attn_impl(self) -> str:
        return getattr(self, "_attn_impl", "sdpa")

    @attn_impl.setter
    def attn_impl(self, impl: str) -> None:
        """"sdpa" (F.scaled_dot_product_attention) or "manual" (matmul, softmax, matmul) for
        passes without a KV cache; sampling with the cache always runs SDPA.

        On CPUs with AVX-512 BF16, under bf16 autocast SDPA's backward ran a few times slower
        than the manual form, while in fp32 SDPA was as fast or faster (docs/history.md).
        """
        if impl not in ("sdpa", "manual"):
            raise ValueError(f"attn_impl must be sdpa or manual, got {impl!r}")
        self._attn_impl = impl
        for m in self.modules():
            if isinstance(m, Attention):
                m.manual = impl == "manual"

    def new_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        (heads, hs), w = self.cache_heads(), self.lm_head.weight
        return KVCache(self.cfg.n_layer, batch, heads, max_len, hs, w.device, dtype or w.dtype)

    def forward(self, idx, pos=None, mask=None, cache: KVCache | None = None,
                logits_from: int = 0, prefix: tuple[torch.Tensor, ...] | None = None,
                hidden: bool = False):
        """idx (B, T) -> logits (B, T - logits_from, V); `hidden=True` returns the final
        normed hidden states (B, T', C) instead, for a caller that applies the LM head itself
        in chunks (logprobs.py).

        `logits_from` skips the LM head for positions whose logits nobody needs (the prompt).
        With `prefix=(prompt_ids, prompt_mask, prompt_index)`, (U, P) left-padded prompts and
        each row's prompt (B,), idx is instead (B, N) completions, and the logits are those
        that predict each completion token (see forward_shared).
        With a cache, keys/values are appended to it and it advances by T. Positions must stay
        below block_size; callers check lengths up front (a check here would sync every token).
        """
        if prefix is not None:
            return self.forward_shared(*prefix, idx, hidden=hidden)
        B, T = idx.shape
        if pos is None:
            start = cache.len if cache is not None else 0
            pos = torch.arange(start, start + T, device=idx.device)[None]  # (1, T)
        x, rope = self.embed(idx, pos), self.rope(pos)  # (B, T, C)
        ckpt = self.gradient_checkpointing and self.training and cache is None
        for i, block in enumerate(self.blocks):
            if ckpt:
                x = checkpoint(block, x, mask, None, 0, None, rope, use_reentrant=False)
            else:
                x = block(x, mask, cache, i, None, rope)
        if cache is not None:
            cache.len += T
        x = self.norm_f(x[:, logits_from:])
        return x if hidden else self.lm_head(x)  # (B, T', V)

    def forward_shared(self, prompt_ids, prompt_mask, prompt_index, completion_ids,
                       hidden: bool = False):
        """Logits (B, N, V) predicting each of the B completions' N tokens, where row i is a
        completion of prompt `prompt_index[i]` of the U left-padded prompts.

        Each prompt goes through the model once, however many rows share it: its keys and
        values serve all of them. Token positions and what each token sees equal those of
        `generate` and of a full pass over prompt + completion, so the log-probs are the same
        up to float rounding; only the work differs (U*P + B*(N-1) token positions instead
        of B*(P+N-1)).
        """
        (U, P), (B, N) = prompt_ids.shape, completion_ids.shape
        m, dev = N - 1, prompt_ids.device
        own = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        pos_p = positions(prompt_mask)  # (U, P)
        pos_c = prompt_mask.sum(1)[prompt_index][:, None] + torch.arange(m, device=dev)[None]
        s = SharedPrefix(U, P, B, m, prompt_index, attention_mask(prompt_mask, P), torch.cat([
            prompt_mask[prompt_index][:, None, None, :].expand(B, 1, m, P),
            own[None, None].expand(B, 1, m, m)], -1), self.rope(pos_p), self.rope(pos_c))
        # one lookup for prompts and completions: each call's backward costs a pass over the
        # embedding's whole (V, C) gradient where it is dense
        x = self.embed(torch.cat([prompt_ids.flatten(), completion_ids[:, :m].flatten()]),
                       torch.cat([pos_p.flatten(), pos_c.flatten()]))
        ckpt = self.gradient_checkpointing and self.training
        for block in self.blocks:
            if ckpt:
                x = checkpoint(block, x, None, None, 0, s, use_reentrant=False)
            else:
                x = block(x, shared=s)
        # completion token 0 is predicted at the prompt's last column, token t at input t-1
        last = x[:U * P].view(U, P, -1)[:, -1][prompt_index][:, None]  # (B, 1, C)
        x = self.norm_f(torch.cat([last, x[U * P:].view(B, m, x.size(-1))], 1))  # (B, N, C)
        return x if hidden else self.lm_head(x)

    def assign(self, state: dict) -> None:
        """Takes `state`'s tensors as the parameters, without copying (a model built on the
        meta device gets real ones), keeping a tied head tied to its embedding."""
        tied = self.tied_head()
        if tied:
            state = {**state, "lm_head.weight": state[tied]}
        self.load_state_dict(state, assign=True)
        if tied:  # assign replaced both tensors: tie them again
            self.lm_head.weight = self.get_parameter(tied)

    def tied_head(self) -> str | None:
        """The name of the embedding whose weight the LM head shares, if it does."""
        for name, p in self.named_parameters(remove_duplicate=False):
            if name != "lm_head.weight" and p is self.lm_head.weight:
                return name
        return None

    def num_params(self) -> int:
        """Every parameter, embeddings included (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())
