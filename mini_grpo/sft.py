"""Supervised warm start: teacher forcing on prompt -> target, loss on target tokens only.

Its checkpoints live in <out_dir>/sft/; GRPO starts from the last one (policy and reference).
A finished SFT stage is not repeated when the run is restarted.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import distributed as D
from .checkpoint import latest_checkpoint, save_checkpoint
from .config import GRPOConfig
from .data import batch_indices, sft_batch, shard
from .optim import lr_at, make_optimizer, set_lr
from .precision import autocast, grad_scaler


def sft_dir(cfg: GRPOConfig) -> Path:
    return Path(cfg.out_dir) / "sft"


def train_sft(cfg, task, tok, model, device, dist: D.DistInfo, logger=None, ddp_model=None,
              examples=None, steps=None, lr=None, directory=None, tag="sft"):
    """Trains `model` in place, or loads the finished stage from disk.

    Defaults: the task's training split, cfg.sft_steps at cfg.sft_lr, into <out_dir>/sft.
    The RFT stage passes its accepted rows instead; a row with a "completion" in its metadata
    is trained on that completion, else on its target.
    """
    examples = task.train if examples is None else examples
    steps = cfg.sft_steps if steps is None else steps
    base_lr = cfg.sft_lr if lr is None else lr
    directory = sft_dir(cfg) if directory is None else Path(directory)
    path, state = latest_checkpoint(directory)
    if state is not None and state.get("step") == steps:
        model.load_state_dict(state["model"])
        if dist.is_main:
            print(f"[{tag}] reusing finished stage from {path}")
        return path
    net = ddp_model or model
    opt = make_optimizer(model, base_lr, cfg.weight_decay, fused=cfg.fused_optimizer)
    scaler = grad_scaler(cfg, device)
    warmup = min(cfg.warmup_steps * 5, steps // 10)
    model.train()
    t0, tokens = time.perf_counter(), 0
    for step in range(1, steps + 1):
        idx = batch_indices(len(examples), cfg.sft_batch_size, step - 1, cfg.seed)
        pairs = [(examples[i].prompt, examples[i].meta.get("completion", examples[i].target))
                 for i in shard(idx, dist.rank, dist.world_size)]
        x, y = sft_batch(tok, pairs, device)
        lr = lr_at(step, base_lr, warmup, steps)
        set_lr(opt, lr)
        with autocast(cfg, device):
            logits = net(x)
        # mean over this rank's target tokens; ranks hold equal shares up to one row
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        scaler.step(opt)  # skips the step when fp16 gradients overflowed
        scaler.update()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        if dist.is_main and (step % cfg.log_every == 0 or step == steps):
            dt = time.perf_counter() - t0
            m = {"loss": loss.item(), "lr": lr, "grad_norm": gnorm.item(),
                 "tokens_per_s": tokens * dist.world_size / dt}
            if logger is not None:
                logger.scalars(step, m, prefix=f"{tag}/")
            if step % max(cfg.log_every, 10) == 0 or step == steps:
                eta = dt / step * (steps - step)
                print(f"[{tag}] step {step}/{steps} loss {m['loss']:.4f} lr {lr:.2e} "
                      f"{m['tokens_per_s']:.0f} tok/s ETA {eta / 60:.1f}m", flush=True)
    path = None
    if dist.is_main:
        state = {"kind": tag, "model": model.state_dict(), "step": steps,
                 "config": cfg.to_dict(), "tokenizer": tok.chars}
        path = save_checkpoint(state, directory, steps, keep=1)
        print(f"[{tag}] done in {(time.perf_counter() - t0) / 60:.1f}m, saved {path}")
    D.barrier()
    return path
