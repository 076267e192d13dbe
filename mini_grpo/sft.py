"""Supervised warm start: teacher forcing on prompt -> target, loss on target tokens only.

Its checkpoint lives in <out_dir>/sft/ (under fsdp as shards, `step_N.dcp/`); GRPO starts from
it (policy and reference). A finished stage is reused when the job is restarted, but only
when the options it was trained with (STAGE_KEYS) are the same and its weights are finite;
otherwise it is trained again, and the console says why (shards are checked once read:
non-finite ones stop the job, naming them). The same NaN/Inf guard as GRPO's skips
non-finite steps (AMP off, lr halved, stop), and a stage whose weights end non-finite is
never saved.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from . import distributed as D
from . import fsdp
from .checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from .chunked import token_logprobs
from .config import ConfigError, load_config
from .data import batch_indices, sft_batch, shard
from .guards import Guard, NonFiniteError, params_finite
from .logprobs import head_weight
from .optim import lr_at, make_optimizer, set_lr

# the options that shape a trained stage: a stage saved with others is not reused. The RFT
# stage starts from the SFT one, so it depends on both.
STAGE_KEYS = {"sft": ("task", "task_args", "data_path", "num_eval", "seed", "n_layer", "n_head",
                      "n_embd", "block_size", "dropout", "init_from", "chat_template",
                      "system_prompt", "sft_steps",
                      "sft_batch_size", "sft_lr", "weight_decay", "warmup_steps", "grad_clip",
                      "use_amp", "amp_dtype")}
STAGE_KEYS["rft"] = STAGE_KEYS["sft"] + ("rft_sft_steps", "rft_lr", "rft_oversample",
                                         "rft_min_reward", "rft_keep", "rft_num_prompts",
                                         "temperature", "top_k", "top_p", "max_new_tokens",
                                         "rewards")
# what shapes RFT's generated data (not the SFT on it): data made with others is not resumed
STAGE_KEYS["rft_data"] = tuple(k for k in STAGE_KEYS["rft"] if k not in ("rft_sft_steps",
                                                                          "rft_lr"))


def sft_dir(cfg) -> Path:
    return Path(cfg.out_dir) / "sft"


def stage_changes(saved: dict, cfg, tag: str = "sft") -> list[str]:
    """The STAGE_KEYS of `tag` whose values differ between a saved stage's config and this
    (the saved one resolved like a user's, so keys of older versions migrate)."""
    try:
        saved = load_config(None, env={}, base=saved).to_dict()
    except ConfigError:
        return ["config (unreadable)"]
    now = cfg.to_dict()
    return [k for k in STAGE_KEYS[tag] if saved.get(k) != now.get(k)]


def _reusable(run, directory: Path, steps: int, tag: str):
    """The finished stage's checkpoint state if it can be reused, else None (says why)."""
    path, state = latest_checkpoint(directory)
    if state is None or state.get("step") != steps:
        return None
    changed = stage_changes(state.get("config") or {}, run.cfg, tag)
    if changed:
        run.print0(f"[{tag}] not reusing {path}: trained with other {', '.join(changed)}")
        return None
    if "model" in state and not all(torch.isfinite(v).all() for v in state["model"].values()
                                    if torch.is_tensor(v) and v.is_floating_point()):
        run.print0(f"[{tag}] not reusing {path}: its weights are not finite")
        return None
    run.print0(f"[{tag}] reusing finished stage from {path}")
    return state


def train_sft(run, examples=None, steps=None, lr=None, directory=None, tag="sft"):
    """Trains run.model in place, or loads the finished stage from disk.

    Defaults: the task's training split, cfg.sft_steps at cfg.sft_lr, into <out_dir>/sft.
    The RFT stage passes its accepted rows instead; a row with a "completion" in its metadata
    is trained on that completion, else on its target.
    """
    cfg, dist, model, device = run.cfg, run.dist, run.model, run.device
    examples = run.task.train if examples is None else examples
    steps = cfg.sft_steps if steps is None else steps
    base_lr = cfg.sft_lr if lr is None else lr
    directory = sft_dir(cfg) if directory is None else Path(directory)
    state = _reusable(run, directory, steps, tag)
    if state is not None:
        if not state.get("sharded"):
            fsdp.load_model_state(model, state["model"])
            return
        fsdp.load_sharded(state["sharded"], model)  # checked once read (never saved non-finite)
        bad = D.all_reduce_max((~params_finite(model.parameters())).float().reshape(1))
        if not bad.item():
            return
        raise CheckpointError(f"{state['sharded']}: its weights are not finite; delete it to "
                              f"train the stage again")
    opt = make_optimizer(model, base_lr, cfg.weight_decay, fused=cfg.fused_optimizer)
    guard = Guard(cfg.guard_patience, amp=run.precision.dtype is not None, stage=tag.upper())
    scaler = run.precision.scaler(guard.amp)
    warmup = min(cfg.warmup_steps * 5, steps // 10)
    model.train()
    t0, tokens = time.perf_counter(), 0
    for step in range(1, steps + 1):
        idx = batch_indices(len(examples), cfg.sft_batch_size, step - 1, cfg.seed)
        pairs = [(examples[i].model_input, examples[i].meta.get("completion", examples[i].target))
                 for i in shard(idx, dist.rank, dist.world_size)]
        x, y = sft_batch(run.tok, pairs, device)
        lr = lr_at(step, base_lr, warmup, steps) * guard.lr_scale
        set_lr(opt, lr)
        loss = sft_loss(run.net, x, y, lambda: run.precision.autocast(enabled=guard.amp))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gnorm = fsdp.clip_grad_norm(model.parameters(), cfg.grad_clip or float("inf"))
        if guard.check(loss.detach(), loss.detach() if scaler.is_enabled() else gnorm,
                       params_finite(model.parameters())):
            scaler.step(opt)  # skips the step when fp16 gradients overflowed
            scaler.update()
        else:
            amp = guard.amp
            what = guard.fallback(False, lambda: "", where=f"step {step}")
            if what:
                run.print0(f"[{tag}] step {step}: {guard.patience} non-finite steps: {what}")
            if guard.amp != amp:
                scaler = run.precision.scaler(guard.amp)
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        if dist.is_main and (step % cfg.log_every == 0 or step == steps):
            dt = time.perf_counter() - t0
            m = {"loss": loss.item(), "lr": lr, "grad_norm": gnorm.item(),
                 "tokens_per_s": tokens * dist.world_size / dt, "guard/skipped": guard.skipped}
            if run.logger is not None:
                run.logger.scalars(step, m, prefix=f"{tag}/")
            if step % max(cfg.log_every, 10) == 0 or step == steps:
                eta = dt / step * (steps - step)
                print(f"[{tag}] step {step}/{steps} loss {m['loss']:.4f} lr {lr:.2e} "
                      f"{m['tokens_per_s']:.0f} tok/s ETA {eta / 60:.1f}m", flush=True)
    run.amp = guard.amp  # evaluations after this stage run without autocast if it was cut
    if not params_finite(model.parameters()):
        raise NonFiniteError(f"{tag.upper()}: the weights are not finite after {steps} steps "
                             f"(lr {base_lr:g} too high?); nothing was saved")
    meta = {"kind": tag, "step": steps, **run.identity()}
    path = None
    if run.sharded:  # every rank writes its shards
        path = fsdp.save_sharded(model, None, meta, directory, steps, keep=1)
    elif dist.is_main:
        path = save_checkpoint({**meta, "model": model.state_dict()}, directory, steps, keep=1)
    run.print0(f"[{tag}] done in {(time.perf_counter() - t0) / 60:.1f}m, saved {path}")
    D.barrier()


def sft_loss(net, x: torch.Tensor, y: torch.Tensor, autocast) -> torch.Tensor:
    """Mean cross-entropy over this rank's target tokens (-1 = ignored); ranks hold equal
    shares up to one row."""
    keep = y >= 0
    with autocast():  # the LM head in chunks: a big vocabulary never holds (B, T, V) logits
        logp = token_logprobs(net(x, hidden=True), head_weight(net), y.clamp(min=0))
    return -(logp * keep).sum() / keep.sum().clamp(min=1)
