"""AdamW with nanoGPT's weight-decay groups, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch.autograd.graph import increment_version


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                   betas=(0.9, 0.99), fused: bool = True) -> torch.optim.AdamW:
    """Decay matrices only (not biases, LayerNorm or embeddings' 1-D params).

    fused=True: the fused AdamW kernel (CUDA, and CPU in torch >= 2.4); False: the plain
    per-parameter loop (no foreach), the slow baseline benchmark.py compares against.

    Every step that goes through moves its parameters' version counters, as any in-place
    op does: the fused kernel alone does not (torch 2.13), and an engine that keeps a copy
    of the weights tells by them whether it has something to sync (engines.WeightsSeen). A
    step the fp16 GradScaler skipped inside the fused kernel (`found_inf`) moves none.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if fused:
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    else:
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=False)
    opt.register_step_post_hook(_written)
    return opt


def _written(opt: torch.optim.Optimizer, args, kwargs) -> None:
    found_inf = getattr(opt, "found_inf", None)  # set by GradScaler for the fused kernel
    if found_inf is not None and bool(found_inf):
        return
    for g in opt.param_groups:
        for p in g["params"]:
            increment_version(p)  # one at a time: a list needs torch >= 2.5


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to min_ratio * base_lr at `total`.

    `step` counts from 1 (the step about to be taken).
    """
    if warmup > 0 and step <= warmup:
        return base_lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
