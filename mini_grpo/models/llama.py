"""The Llama family in one class: Llama 3.x, Qwen2/2.5, Qwen3 (dense), SmolLM2, Mistral
(without sliding window). RoPE (with `rope_theta` and the linear or llama3 frequency scaling),
RMSNorm, SwiGLU MLP, grouped-query attention, and the switches the members differ by: q/k/v
(and o) bias, per-head q/k RMSNorm, tied or untied head, head_dim other than width / heads.

Parameter names are those of the Hugging Face checkpoints without their "model." prefix
(`layers.0.self_attn.q_proj.weight`), so hf.py maps weights by name alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..fields import show
from .core import Attention, CausalLM


@dataclass
class LlamaConfig:
    vocab_size: int
    block_size: int  # max_position_embeddings: the longest sequence a run may use
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    head_dim: int
    n_inner: int  # intermediate_size of the SwiGLU MLP
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # as rope_scaling() returns it
    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    tie_word_embeddings: bool = False
    dropout: float = 0.0

    def param_count(self) -> int:
        """Every parameter of the model this config builds, counted without building it."""
        C, hs, inner = self.n_embd, self.head_dim, self.n_inner
        q, kv = self.n_head * hs, self.n_kv_head * hs
        attn = C * (q + 2 * kv) + q * C + (q + 2 * kv) * self.qkv_bias + C * self.o_bias \
            + 2 * hs * self.qk_norm
        mlp = 3 * C * inner + (2 * inner + C) * self.mlp_bias
        head = 0 if self.tie_word_embeddings else self.vocab_size * C
        return self.vocab_size * C + self.n_layer * (attn + mlp + 2 * C) + C + head


# the rope scalings rope_frequencies applies, each with the numbers it reads
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}


def rope_scaling(params: dict) -> dict:
    """The scaling rope_frequencies applies, checked: {} or {"rope_type": ..., and the
    numbers it reads, as floats}. The one rule for config.json's rope_scaling or
    rope_parameters (`type` the old spelling of `rope_type`) and a checkpoint's spec;
    ValueError naming the key."""
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise ValueError(f"rope type {show(kind)} is not supported ({', '.join(ROPE_TYPES)})")
    out = {"rope_type": kind} if kind != "default" else {}
    for key in ROPE_TYPES[kind]:
        v = params.get(key)
        # compared, never float()-ed, before the range check: float(10**400) overflows
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e15:
            raise ValueError(f"{key} must be a number in (0.0, 1e+15), got {show(v)}")
        out[key] = float(v)
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError("rope high_freq_factor must exceed low_freq_factor")
    return out


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """(head_dim / 2,) fp32 inverse frequencies, with the config's scaling applied."""
    hs = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.int64).float() / hs)
    kind = cfg.rope_scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / cfg.rope_scaling["factor"]
    if kind != "llama3":
        return inv
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    r = cfg.rope_scaling
    factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old = r["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as Llama's
    checkpoints were trained).

    `feeds_linear`: only linear layers read the output, and under autocast each would cast it
    to autocast's dtype; the norm casts it once instead (the same values), so q, k and v (gate
    and up) read one copy and their backward keeps one where it kept three (two)."""

    def __init__(self, dim: int, eps: float, feeds_linear: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.feeds_linear = eps, feeds_linear

    def forward(self, x):
        dev = x.device.type
        cast = (torch.get_autocast_dtype(dev) if self.feeds_linear
                and torch.is_autocast_enabled(dev) else None)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return RMSNormFn.apply(x, self.weight, self.eps, cast)
        return rms_norm(x, self.weight, self.eps, cast)[0]


def rms_norm(x, weight, eps: float, cast):
    """(the norm's output, 1 / rms(x) in fp32): the operations of Llama's RMSNorm."""
    h = x.float()
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * (h * r).to(x.dtype)
    if cast is not None and y.dtype != torch.float64:
        y = y.to(cast)
    return y, r


class RMSNormFn(torch.autograd.Function):
    """rms_norm whose backward keeps x and 1 / rms(x) alone and normalises x again, where
    autograd's kept the fp32 normalised x too: one (tokens, width) fp32 tensor less a norm.
    The backward does autograd's operations in its order, so the gradients are autograd's."""

    @staticmethod
    def forward(ctx, x, weight, eps, cast):
        y, r = rms_norm(x, weight, eps, cast)
        ctx.save_for_backward(x, weight, r)
        ctx.dtype = torch.result_type(weight, x)  # the output's dtype before the cast
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, r = ctx.saved_tensors
        h = x.float()
        grad = grad.to(ctx.dtype)
        gw = None
        if ctx.needs_input_grad[1]:  # a frozen norm (LoRA) skips normalising x again
            gw = (grad * (h * r).to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            gn = (grad * weight).to(x.dtype).float()
            gr = (gn * h).sum(-1, keepdim=True)
            gm = -0.5 * gr * r.pow(3)
            gx = (gn * r + gm.expand(h.shape) / h.shape[-1] * (2 * h)).to(x.dtype)
        return gx, gw, None, None


class SelfAttention(Attention):
    fuse = ("q_proj", "k_proj", "v_proj")  # one input: one matmul on packed weights (packed.py)
    fused = None  # ... that packed.packed sets while sampling on a CPU

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.dropout)
        hs = cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * hs, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * hs, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * hs, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_head * hs, cfg.n_embd, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hs, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hs, cfg.rms_norm_eps)

    def project(self, x):
        hs = self.head_dim
        if self.fused is not None:
            q, k, v = self.fused(x).unflatten(-1, (-1, hs)).split(
                [self.n_head, self.n_kv_head, self.n_kv_head], -2)
        else:
            q = self.q_proj(x).unflatten(-1, (self.n_head, hs))  # (..., nh, hs)
            k = self.k_proj(x).unflatten(-1, (self.n_kv_head, hs))  # (..., nkv, hs)
            v = self.v_proj(x).unflatten(-1, (self.n_kv_head, hs))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def out(self, y):
        return self.o_proj(y)


class MLP(nn.Module):
    fuse = ("gate_proj", "up_proj")
    fused = None

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_inner, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.n_inner, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.n_inner, cfg.n_embd, bias=cfg.mlp_bias)

    def forward(self, x):
        if self.fused is not None:
            gate, up = self.fused(x).chunk(2, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
            return self.down_proj(F.silu(gate) * up)
        a = SiluMul.apply(gate, up)
        if torch.compiler.is_compiling() or saved_tensors_hooked():
            return self.down_proj(a)
        with torch.autograd.graph.saved_tensors_hooks(*recompute(a, gate, up)):
            return self.down_proj(a)


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are on already (activation checkpointing, offloading): ours
    must not stand in for theirs."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def recompute(a, gate, up):
    """Saved-tensor hooks under which down_proj keeps, in place of its input a = silu(gate) *
    up, the way to compute it again from gate and up, which SiluMul keeps anyway: one (tokens,
    n_inner) tensor less a layer, for one silu and one product in the backward. The values
    are the same bits, so the gradients are too."""
    key = a.untyped_storage().data_ptr()

    def pack(t):
        if t.untyped_storage().data_ptr() != key:
            return t
        return t.shape, t.stride(), t.storage_offset()

    def unpack(p):
        if isinstance(p, torch.Tensor):
            return p
        return (F.silu(gate) * up).as_strided(*p)
    return pack, unpack


class SiluMul(torch.autograd.Function):
    """silu(gate) * up whose backward keeps gate and up alone and computes silu(gate) again,
    where autograd's silu and mul kept silu(gate) too: one (tokens, n_inner) tensor less a
    layer. The gradients are autograd's, the same operations on the same values."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps, feeds_linear=True)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps,
                                                feeds_linear=True)
        self.mlp = MLP(cfg)

    def forward(self, x, mask=None, cache=None, layer=0, shared=None, rope=None):
        x = x + self.self_attn(self.input_layernorm(x), mask, cache, layer, shared, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    family = "llama"

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.gradient_checkpointing = False
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for m in self.modules():  # random init (tests, from-scratch runs); checkpoints overwrite
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self._inv_freq: torch.Tensor | None = None  # not a buffer: never meta, never saved

    @property
    def blocks(self):
        return self.layers

    @property
    def norm_f(self):
        return self.norm

    def embed(self, idx, pos):
        return self.lookup(self.embed_tokens, idx)

    def rope(self, pos):
        if self._inv_freq is None or self._inv_freq.device != pos.device:
            self._inv_freq = rope_frequencies(self.cfg).to(pos.device)
        freqs = pos[..., None].float() * self._inv_freq  # (..., T, hs / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def cache_heads(self):
        return self.cfg.n_kv_head, self.cfg.head_dim
