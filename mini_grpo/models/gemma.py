"""Gemma 3 (text): the Llama family's attention and gated MLP with the switches Gemma 3
differs by, each of which breaks parity if missed:

- the token embeddings scaled by sqrt(hidden size) (in the weight's dtype, as transformers);
- RMSNorm scaled by (1 + weight), in fp32 before the cast back (GemmaRMSNorm);
- four norms a layer: before and after attention, before and after the MLP;
- per-head q/k RMSNorm (QK-norm);
- a GELU (tanh) gated MLP;
- sliding-window attention on the layers `layer_types` names so (five of every six), each
  kind with its own RoPE base (local 10k, global 1M; the global one may be scaled);
- attention scores scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- the LM head tied to the embedding.

Parameter names are those of the Hugging Face checkpoints without their "model." prefix, as
for the Llama family, so hf.py maps weights by name alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .core import Attention, CausalLM
from .llama import MLP, Llama, SelfAttention, rope_frequencies

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GemmaConfig:
    vocab_size: int
    block_size: int  # max_position_embeddings: the longest sequence a run may use
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    head_dim: int
    n_inner: int  # intermediate_size of the gated MLP
    layer_types: list = field(default_factory=list)  # per layer, one of LAYER_TYPES
    sliding_window: int = 512  # a sliding layer's query sees the keys fewer positions back
    query_pre_attn_scalar: float = 256.0  # the scores are scaled by its inverse square root
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # the full-attention layers' RoPE base
    rope_scaling: dict = field(default_factory=dict)  # theirs (llama.rope_scaling's form)
    rope_local_theta: float = 10_000.0  # the sliding layers' (never scaled)
    tie_word_embeddings: bool = True
    dropout: float = 0.0

    def param_count(self) -> int:
        """Every parameter of the model this config builds, counted without building it."""
        C, hs, inner = self.n_embd, self.head_dim, self.n_inner
        q, kv = self.n_head * hs, self.n_kv_head * hs
        attn = C * (q + 2 * kv) + q * C + 2 * hs
        head = 0 if self.tie_word_embeddings else self.vocab_size * C
        return self.vocab_size * C + self.n_layer * (attn + 3 * C * inner + 4 * C) + C + head

    def check(self) -> None:
        """ValueError naming what does not hold (a checkpoint's spec is untrusted)."""
        if len(self.layer_types) != self.n_layer or \
                not all(t in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types: must name each of the {self.n_layer} layers "
                             f"{' or '.join(LAYER_TYPES)}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be at least 1, got {self.sliding_window}")
        if not self.query_pre_attn_scalar > 0 or not self.rope_local_theta > 0:
            raise ValueError("query_pre_attn_scalar and rope_local_theta must be above 0")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in fp32 and cast back after the weight (Gemma's order;
    Llama's casts before). The weight starts at 0: the identity scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(SelfAttention):
    def __init__(self, cfg: GemmaConfig, sliding: bool):
        Attention.__init__(self, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.dropout)
        hs = cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * hs, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * hs, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * hs, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * hs, cfg.n_embd, bias=False)
        self.q_norm = GemmaRMSNorm(hs, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hs, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.window = cfg.sliding_window if sliding else None


class GemmaMLP(MLP):
    def __init__(self, cfg: GemmaConfig):
        nn.Module.__init__(self)
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_inner, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.n_inner, bias=False)
        self.down_proj = nn.Linear(cfg.n_inner, cfg.n_embd, bias=False)

    def forward(self, x):
        if self.fused is not None:
            gate, up = self.fused(x).chunk(2, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaBlock(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        self.full = cfg.layer_types[layer] == "full_attention"
        C, eps = cfg.n_embd, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(C, eps)
        self.self_attn = GemmaAttention(cfg, sliding=not self.full)
        self.post_attention_layernorm = GemmaRMSNorm(C, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(C, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(C, eps)

    def forward(self, x, mask=None, cache=None, layer=0, shared=None, rope=None):
        """`rope` (and a shared pass's) holds both kinds' (cos, sin): (sliding, full)."""
        k = int(self.full)
        if shared is not None:
            shared = replace(shared, rope_p=shared.rope_p[k], rope_c=shared.rope_c[k])
        a = self.self_attn(self.input_layernorm(x), mask, cache, layer, shared,
                           None if rope is None else rope[k])
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma(Llama):
    """Llama's model with Gemma's blocks, norms, embedding scale and two RoPEs; the rest
    (blocks, norm_f, cache_heads) is Llama's."""
    family = "gemma"

    def __init__(self, cfg: GemmaConfig):
        CausalLM.__init__(self)  # Llama's own __init__ builds Llama's blocks
        cfg.check()
        self.cfg = cfg
        self.gradient_checkpointing = False
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(GemmaBlock(cfg, i) for i in range(cfg.n_layer))
        self.norm = GemmaRMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for m in self.modules():  # random init (tests); checkpoints overwrite
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        self._inv_freq: tuple | None = None  # (sliding, full); not buffers: never meta or saved

    def embed(self, idx, pos):
        x = self.lookup(self.embed_tokens, idx)
        return x * torch.tensor(self.cfg.n_embd ** 0.5, dtype=x.dtype)

    def rope(self, pos):
        """((cos, sin) of the sliding layers, (cos, sin) of the full ones)."""
        if self._inv_freq is None or self._inv_freq[0].device != pos.device:
            c = self.cfg
            local = replace(c, rope_theta=c.rope_local_theta, rope_scaling={})
            self._inv_freq = tuple(rope_frequencies(x).to(pos.device) for x in (local, c))
        out = []
        for inv in self._inv_freq:
            freqs = pos[..., None].float() * inv  # (..., T, hs / 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            out.append((emb.cos(), emb.sin()))
        return tuple(out)
