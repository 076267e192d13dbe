"""Our GPT (nanoGPT-like: learned positions, LayerNorm, GELU MLP, tied head), which is also
the architecture of Hugging Face GPT-2 checkpoints (hf.py maps their weights onto it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

from .core import Attention, CausalLM

ACTIVATIONS = ("gelu", "gelu_new")  # exact | tanh approximation (GPT-2)


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 192
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    # GPT-2 checkpoints: tanh-approximated GELU, their epsilon, their MLP width
    activation: str = "gelu"  # one of ACTIVATIONS
    layer_norm_epsilon: float = 1e-5
    n_inner: int | None = None  # MLP width; None = 4 * n_embd
    tie_word_embeddings: bool = True  # the LM head shares the token embedding's weight

    def param_count(self) -> int:
        """Every parameter of the model this config builds (embeddings included), counted
        without building it."""
        C, inner = self.n_embd, self.n_inner or 4 * self.n_embd
        # 2 LayerNorms, c_attn, c_proj, c_fc, c_proj (weights and biases)
        block = 4 * C + (3 * C * C + 3 * C) + (C * C + C) + (C * inner + inner) + inner * C + C
        head = 0 if self.tie_word_embeddings else self.vocab_size * C
        return (self.vocab_size + self.block_size) * C + self.n_layer * block + 2 * C + head


class CausalSelfAttention(Attention):
    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.n_head, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.dropout)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def project(self, x):
        q, k, v = self.c_attn(x).unflatten(-1, (3, self.n_head, self.head_dim)).unbind(-3)
        return q, k, v  # (..., nh, hs) each

    def out(self, y):
        return self.resid_drop(self.c_proj(y))


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

    def forward(self, x, mask=None, cache=None, layer=0, shared=None, rope=None):
        x = x + self.attn(self.ln_1(x), mask, cache, layer, shared)
        return x + self.mlp(self.ln_2(x))


class GPT(CausalLM):
    family = "gpt"

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.gradient_checkpointing = False
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
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
    def norm_f(self):
        return self.ln_f

    def embed(self, idx, pos):
        return self.drop(self.lookup(self.wte, idx) + self.wpe(pos))

    def cache_heads(self):
        return self.cfg.n_head, self.cfg.n_embd // self.cfg.n_head

