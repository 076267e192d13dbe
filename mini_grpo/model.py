"""A small GPT (nanoGPT-like) with a KV cache for incremental decoding. Knows nothing about RL.

Rows of a batch may be left-padded. Callers then pass, for every forward pass:
  pos   (B, T) absolute positions, so a row's real tokens get the positions they would get alone
        (`positions(valid)`), and
  mask  (B, 1, T, S) bool attention mask over the S keys seen so far (`attention_mask(...)`).
With neither, the batch is taken as unpadded and attention is plain causal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 192
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    # GPT-2 checkpoints (hf_io.py): tanh-approximated GELU, their epsilon, their MLP width
    activation: str = "gelu"  # gelu (exact) | gelu_new (tanh approximation, GPT-2)
    layer_norm_epsilon: float = 1e-5
    n_inner: int | None = None  # MLP width; None = 4 * n_embd


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
    """Pre-allocated keys and values for every layer: (n_layer, B, nh, max_len, hs)."""

    def __init__(self, n_layer, batch, n_head, max_len, head_dim, device, dtype):
        shape = (n_layer, batch, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.len = 0  # positions filled so far

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Writes this step's (B, nh, T, hs) keys/values; returns all keys/values up to them."""
        T = k.size(2)
        self.k[layer, :, :, self.len:self.len + T] = k
        self.v[layer, :, :, self.len:self.len + T] = v
        end = self.len + T
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


@dataclass
class SharedPrefix:
    """Layout of a shared-prefix pass (GPT.forward with `prefix=`): U prompts of P columns,
    then B completions of m input tokens each; row i's prompt is prompts[index[i]]."""
    U: int
    P: int
    B: int
    m: int
    index: torch.Tensor  # (B,) long: each row's prompt
    mask_p: torch.Tensor  # (U, 1, P, P) prompt tokens: causal, pad keys hidden
    mask_c: torch.Tensor  # (B, 1, m, P + m) completion tokens: own prompt + causal


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.manual = False  # plain matmul-softmax attention instead of SDPA (see GPT.attn_impl)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, mask=None, cache: KVCache | None = None, layer: int = 0,
                shared: SharedPrefix | None = None):
        if shared is not None:
            return self._forward_shared(x, shared)
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, nh, S, hs)
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
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))

    def _attend(self, q, k, v, mask, manual: bool):
        """softmax(q k^T / sqrt(hs)) v over the keys `mask` allows (bool, True = attend, or
        "causal"); manual = matmul, softmax, matmul, else SDPA."""
        p = self.dropout if self.training else 0.0
        if not manual:
            if isinstance(mask, str):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        # scale q, not the (T, S) scores, and mask in place: each pass over the scores costs
        # as much as the matmul that made them on a CPU
        att = (q * (1.0 / math.sqrt(k.size(-1)))) @ k.transpose(-2, -1)  # (B, nh, T, S)
        att = att.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
        return F.dropout(att, p) @ v if p else att @ v

    def _forward_shared(self, x, s: SharedPrefix):
        """x (U*P + B*m, C): the U prompts' tokens, then the B completions' input tokens."""
        C, nh = x.size(-1), self.n_head
        qkv = self.c_attn(x)
        n_p = s.U * s.P
        qp, kp, vp = qkv[:n_p].view(s.U, s.P, 3, nh, C // nh).permute(2, 0, 3, 1, 4)
        y = [self._attend(qp, kp, vp, s.mask_p, self.manual).transpose(1, 2).reshape(n_p, C)]
        if s.m:
            qc, kc, vc = qkv[n_p:].view(s.B, s.m, 3, nh, C // nh).permute(2, 0, 3, 1, 4)
            # each completion sees its prompt's keys (computed once) and its own
            k = torch.cat([kp[s.index], kc], 2)  # (B, nh, P + m, hs)
            v = torch.cat([vp[s.index], vc], 2)
            y.append(self._attend(qc, k, v, s.mask_c, self.manual).transpose(1, 2)
                     .reshape(s.B * s.m, C))
        return self.resid_drop(self.c_proj(torch.cat(y)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, inner)
        self.c_proj = nn.Linear(inner, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.activation == "gelu_new" else "none"

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, mask=None, cache=None, layer=0, shared=None):
        x = x + self.attn(self.ln_1(x), mask, cache, layer, shared)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.gradient_checkpointing = False
        self._attn_impl = "sdpa"
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, impl: str) -> None:
        """"sdpa" (F.scaled_dot_product_attention) or "manual" (matmul, softmax, matmul) for
        passes without a KV cache; sampling with the cache always runs SDPA.

        Measured on a 2-core AVX-512-BF16 CPU: under bf16 autocast SDPA's backward ran 2-3x
        slower than the manual form, while in fp32 SDPA was as fast or faster.
        """
        if impl not in ("sdpa", "manual"):
            raise ValueError(f"attn_impl must be sdpa or manual, got {impl!r}")
        self._attn_impl = impl
        for block in self.blocks:
            block.attn.manual = impl == "manual"

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def new_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layer, batch, c.n_head, max_len, c.n_embd // c.n_head,
                       self.wte.weight.device, dtype or self.wte.weight.dtype)

    def forward(self, idx, pos=None, mask=None, cache: KVCache | None = None,
                logits_from: int = 0, prefix: tuple[torch.Tensor, ...] | None = None):
        """idx (B, T) -> logits (B, T - logits_from, V).

        `logits_from` skips the LM head for positions whose logits nobody needs (the prompt).
        With `prefix=(prompt_ids, prompt_mask, prompt_index)`, (U, P) left-padded prompts and
        each row's prompt (B,), idx is instead (B, N) completions, and the logits are those
        that predict each completion token (see forward_shared).
        With a cache, keys/values are appended to it and it advances by T. Positions must stay
        below block_size; callers check lengths up front (a check here would sync every token).
        """
        if prefix is not None:
            return self.forward_shared(*prefix, idx)
        B, T = idx.shape
        if pos is None:
            start = cache.len if cache is not None else 0
            pos = torch.arange(start, start + T, device=idx.device)[None]  # (1, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        ckpt = self.gradient_checkpointing and self.training and cache is None
        for i, block in enumerate(self.blocks):
            if ckpt:
                x = checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask, cache, i)
        if cache is not None:
            cache.len += T
        x = self.ln_f(x[:, logits_from:])
        return self.lm_head(x)  # (B, T', V)

    def forward_shared(self, prompt_ids, prompt_mask, prompt_index, completion_ids):
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
        s = SharedPrefix(U, P, B, m, prompt_index, attention_mask(prompt_mask, P), torch.cat([
            prompt_mask[prompt_index][:, None, None, :].expand(B, 1, m, P),
            own[None, None].expand(B, 1, m, m)], -1))
        pos_c = prompt_mask.sum(1)[prompt_index][:, None] + torch.arange(m, device=dev)[None]
        x = torch.cat([(self.wte(prompt_ids) + self.wpe(positions(prompt_mask))).flatten(0, 1),
                       (self.wte(completion_ids[:, :m]) + self.wpe(pos_c)).flatten(0, 1)])
        x = self.drop(x)
        ckpt = self.gradient_checkpointing and self.training
        for block in self.blocks:
            if ckpt:
                x = checkpoint(block, x, None, None, 0, s, use_reentrant=False)
            else:
                x = block(x, shared=s)
        # completion token 0 is predicted at the prompt's last column, token t at input t-1
        last = x[:U * P].view(U, P, -1)[:, -1][prompt_index][:, None]  # (B, 1, C)
        x = torch.cat([last, x[U * P:].view(B, m, x.size(-1))], 1)  # (B, N, C); m may be 0
        return self.lm_head(self.ln_f(x))
