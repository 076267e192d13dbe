"""Supervised warm start: teacher forcing on prompt -> target, loss on target tokens only.

Its checkpoint lives in <out_dir>/sft/ (under fsdp as shards, `step_N.dcp/`); GRPO starts from
it (policy and reference). A finished stage is reused when the job is restarted, but only
when the options it was trained with (STAGE_KEYS), its tokenizer and the rows it trained on
(a digest: a data file edited in place) are the same and its weights are finite; otherwise
it is trained again, and the console says why (shards are checked once read:
non-finite ones stop the job, naming them). The same NaN/Inf guard as GRPO's skips
non-finite steps (AMP off, lr halved, stop) through the same TrainState, a stage whose
weights end non-finite is never saved, and the stage hands its autocast verdict on (stored
with it, so a reused stage hands on the same).
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import distributed as D
from . import fsdp
from .checkpoint import CheckpointError, latest_checkpoint, load_weights, set_rng_state
from .chunked import SFT_CPU_BUDGET_BYTES, token_logprobs
from .config import ConfigError, GRPOConfig, load_config
from .data import batch_indices, sft_batch, sft_target, shard
from .guards import NonFiniteError, finite_everywhere, params_finite
from .logprobs import head_weight
from .options import keys_with
from .plan import plan_micro_batches
from .precision import release_freed_memory
from .state import TrainState, check_train_state

if TYPE_CHECKING:
    from .run import Run

# the options that shape a trained stage, by their declared roles (options.ROLES): a stage
# saved with others is not reused. The RFT stage starts from the SFT one, so it depends on
# both; its data on the SFT stage's options and its own generation's.
STAGE_KEYS = {"sft": keys_with(GRPOConfig, "sft"),
              "rft_data": keys_with(GRPOConfig, "sft", "rft_data"),
              "rft": keys_with(GRPOConfig, "sft", "rft_data", "rft")}


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


def stage_inputs(run: Run, examples, tag: str = "sft") -> dict:
    """What a stage trains on besides its options, as its checkpoint records it: the
    tokenizer, and a digest of its rows as SFT reads them (a data file edited in place
    keeps its name, so the options alone did not tell; nor an RFT file made again)."""
    multi_turn = bool(run.cfg.tools or run.cfg.environment)
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps([ex.model_input, sft_target(ex, multi_turn)]).encode())
        digest.update(b"\n")
    return {"tokenizer": run.tok.state(), "data": f"{tag}:{digest.hexdigest()}"}


def finished_stage(cfg, directory: Path, steps: int, tag: str, say=None,
                   inputs: dict | None = None):
    """(path, state) of the stage of `steps` steps in `directory` if it can be reused, else
    None (`say`: told why not): trained with these options and, where given, these `inputs`
    (stage_inputs). Its tensors are mapped, not read: the job asks once for what it logged
    (job.logged_until), the stage again for its weights."""
    path, state = latest_checkpoint(directory, mmap=True, step=steps)
    if state is None or state.get("step") != steps:
        return None
    check_train_state(state, str(path))
    why = [f"other {k}" for k in stage_changes(state.get("config") or {}, cfg, tag)]
    why += [f"another {k}" if k == "tokenizer" else f"other {k}" for k, v in
            (inputs or {}).items() if state.get(k) != v]
    if why:
        if say:
            say(f"[{tag}] not reusing {path}: trained with {', '.join(why)}")
        return None
    return path, state


def _reusable(run: Run, directory: Path, steps: int, tag: str, inputs: dict):
    """The finished stage's checkpoint if it can be reused, else None (says why)."""
    found = finished_stage(run.cfg, directory, steps, tag, run.print0, inputs)
    if found is not None:
        run.print0(f"[{tag}] reusing finished stage from {found[0]}")
    return found


def load_stage(run: Run, found) -> bool:
    """A finished stage's weights into run.model, and the RNG where it left it (dropout
    draws on after it); returns its autocast verdict. Never saved non-finite, but a file
    may lie: checked once read."""
    path, ckpt = found
    load_weights(ckpt, run.model, source=str(path))
    if not finite_everywhere(run.model):
        raise CheckpointError(f"{ckpt.get('sharded') or path}: its weights are not "
                              f"finite; delete it to train the stage again")
    rngs = ckpt.get("rng")
    if isinstance(rngs, list) and rngs:
        set_rng_state(rngs[min(run.dist.rank, len(rngs) - 1)], source=str(path))
    return bool(ckpt.get("guard", {}).get("amp", True))


def train_sft(run: Run, examples=None, steps=None, lr=None, directory=None, tag="sft",
              amp: bool = True) -> bool:
    """Trains run.model in place, or loads the finished stage from disk; returns the stage's
    autocast verdict for the next (`amp` is the one it starts from: see state.py).

    Defaults: the task's training split, cfg.sft_steps at cfg.sft_lr, into <out_dir>/sft.
    The RFT stage passes its accepted rows instead; a row is trained on its conversation
    (multi-turn), its accepted completion, or its target (`data.sft_target`).
    """
    cfg, dist, model = run.cfg, run.dist, run.model
    examples = run.task.train if examples is None else examples
    steps = cfg.sft_steps if steps is None else steps
    base_lr = cfg.sft_lr if lr is None else lr
    directory = sft_dir(cfg) if directory is None else Path(directory)
    inputs = stage_inputs(run, examples, tag)
    found = _reusable(run, directory, steps, tag, inputs)
    if found is not None:
        return amp and load_stage(run, found)
    state = TrainState(run, base_lr, steps, min(cfg.warmup_steps * 5, steps // 10), amp=amp,
                       tag=tag)
    multi_turn = bool(cfg.tools or cfg.environment)
    model.train()
    release_freed_memory(run.device)  # the sampling before: its blocks, not this stage's
    t0, tokens = time.perf_counter(), 0
    for step in range(1, steps + 1):
        idx = batch_indices(len(examples), cfg.sft_batch_size, step - 1, cfg.seed)
        pairs = [(examples[i].model_input, sft_target(examples[i], multi_turn))
                 for i in shard(idx, dist.rank, dist.world_size)]
        x, y = sft_batch(run.tok, pairs, run.device)
        lr = state.begin(step)
        loss = sft_pass(run.net, x, y, cfg.micro_batch_tokens, state)
        state.step(loss)  # fp16: the scaler skips steps whose gradients overflowed
        tokens += x.numel()
        if dist.is_main and (step % cfg.log_every == 0 or step == steps):
            dt = time.perf_counter() - t0
            m = {"loss": loss.item(), "lr": lr, "grad_norm": state.grad_norm.item(),
                 "tokens_per_s": tokens * dist.world_size / dt,
                 "guard/skipped": state.guard.skipped}
            if run.logger is not None:
                run.logger.scalars(step, m, prefix=f"{tag}/")
            if step % max(cfg.log_every, 10) == 0 or step == steps:
                eta = dt / step * (steps - step)
                print(f"[{tag}] step {step}/{steps} loss {m['loss']:.4f} lr {lr:.2e} "
                      f"{m['tokens_per_s']:.0f} tok/s ETA {eta / 60:.1f}m", flush=True)
    if not params_finite(model.parameters()):
        raise NonFiniteError(f"{tag.upper()}: the weights are not finite after {steps} steps "
                             f"(lr {base_lr:g} too high?); nothing was saved")
    path = state.save(steps, optimizer=False, directory=directory, keep=1, extra=inputs)
    run.print0(f"[{tag}] done in {(time.perf_counter() - t0) / 60:.1f}m, saved {path}")
    return state.guard.amp


def sft_loss(net, x: torch.Tensor, y: torch.Tensor, num_tokens=None) -> torch.Tensor:
    """Mean cross-entropy over the target tokens of (x, y) (-1 = ignored). `num_tokens`: the
    divisor instead of their count (positive; sft_pass: the step's, over every rank)."""
    keep = y >= 0
    # the LM head at the target tokens alone: a prompt's positions have no loss, and their
    # logits were most of the head's work (the LM job: ~60 prompt tokens to ~20 of answer);
    # a pass without targets takes every position at weight 0, so its graph stays whole
    at = keep if keep.any() else torch.ones_like(keep)
    # in chunks: a big vocabulary never holds (tokens, V) logits (on a CPU, smaller chunks:
    # chunked.SFT_CPU_BUDGET_BYTES)
    budget = SFT_CPU_BUDGET_BYTES if x.device.type == "cpu" else None
    logp = token_logprobs(net(x, hidden=True)[at], head_weight(net), y[at].clamp(min=0),
                          budget_bytes=budget)
    total = keep.sum().clamp(min=1) if num_tokens is None else num_tokens
    return -(logp * keep[at]).sum() / total


def sft_pass(net, x: torch.Tensor, y: torch.Tensor, budget: int, state: TrainState):
    """The gradient of the step's mean cross-entropy over every rank's target tokens, from
    this rank's rows (x, y) (right-padded), accumulated over micro-batches of at most
    `budget` token positions (0: one pass), each cut to its longest row; DDP's all-reduce on
    the last only, fsdp's ranks padded to as many passes (with no loss). Returns the
    detached mean over this rank's target tokens."""
    keep = y >= 0
    # DDP and FSDP average the ranks' gradients, and ranks hold different numbers of target
    # tokens: each divides its sum by the step's count over the world size (one all-reduce),
    # so the average is the gradient of one process holding the whole batch
    mine = keep.sum()
    num_tokens = D.all_reduce_sum(mine.clone()).clamp(min=1) / D.world_size()
    lengths = (y.size(1) - keep.int().flip(1).argmax(1)).tolist()  # to each row's last target
    plan = plan_micro_batches(lengths, len(lengths), lambda rows: len(rows) * max(
        lengths[i] for i in rows), budget) if budget else [list(range(x.size(0)))]
    passes = plan + plan[-1:] * (fsdp.pad_passes(net, len(plan), x.device) if budget else 0)
    loss = torch.zeros((), device=x.device)
    with state.cast_once(net):
        for j, rows in enumerate(passes):
            n = max(lengths[i] for i in rows)
            sync = j == len(passes) - 1 or not hasattr(net, "no_sync")
            with nullcontext() if sync else net.no_sync():
                with state.autocast():
                    part = sft_loss(net, x[rows, :n], y[rows, :n], num_tokens)
                if j >= len(plan):
                    part = part * 0.0
                state.backward(part)
            loss += part.detach()
    return loss * num_tokens / mine.clamp(min=1)
