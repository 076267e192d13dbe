"""TrainState: what a training stage carries from step to step, shared by SFT, GRPO and RFT's
SFT: the optimizer, the loss scaler, the NaN/Inf guard (its autocast verdict and lr scale),
the step and the sampling RNG.

    state = TrainState(run, lr=cfg.lr, total=cfg.max_steps, warmup=cfg.warmup_steps, amp=amp)
    for step in range(state.current_step + 1, total + 1):
        lr = state.begin(step)               # the schedule, times the guard's lr scale
        with state.autocast():               # off once the guard has cut it
            loss = ...
        state.backward(loss)
        state.step(loss.detach())            # unscale, clip, guard, AdamW (or a skip)
        state.save(step)                     # one file, or DCP shards under fsdp
    state.restore(checkpoint)                # weights, optimizer, guard, scaler, RNG, step

The autocast verdict is handed from stage to stage on purpose: a stage starts from the
verdict of the one before it (`amp`), and if its guard cuts autocast (the amp_off rung), the
rest of the job, the next stages and the evaluations after them, runs in fp32. The verdict
travels in every checkpoint with the guard's state, so a resumed run keeps it too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import distributed as D
from . import fsdp
from .checkpoint import (
    CheckpointError,
    has_checkpoint,
    latest_checkpoint,
    load_weights,
    rng_state,
    save,
    set_rng_state,
)
from .fields import show
from .guards import RUNGS, Guard, finite_everywhere, params_finite
from .optim import UpdateProbe, lr_at, make_optimizer, set_lr
from .precision import linear_weights_cast_once

if TYPE_CHECKING:
    from .run import Run


class TrainState:
    def __init__(self, run: Run, lr: float, total: int, warmup: int, amp: bool = True,
                 tag: str = "grpo", directory: str | Path | None = None, keep: int = 0,
                 seed: int | None = None):
        """`lr` peaks after `warmup` of `total` steps (lr_at); `amp`: the autocast verdict
        the previous stage handed on; `directory`: where save() writes (keeping the newest
        `keep`, 0 = all) and the guard's restore rung reads (None: no restore rung);
        `seed`: this rank's sampling RNG (GRPO)."""
        # what it uses of the run, and no more
        cfg, self.model, self.tag = run.cfg, run.model, tag
        self.precision, self.device, self.dist = run.precision, run.device, run.dist
        self.logger, self.grad_clip = run.logger, cfg.grad_clip
        self.identity = run.identity()  # what every checkpoint carries besides weights
        self.lr, self.total, self.warmup = lr, total, warmup
        self.directory, self.keep = (Path(directory) if directory else None), keep
        self.opt = make_optimizer(run.model, lr, cfg.weight_decay, fused=cfg.fused_optimizer,
                                  eps=cfg.adam_eps)
        self.probe = UpdateProbe([p for p in run.model.parameters() if p.requires_grad])
        precision = self.precision
        uses = precision.dtype is not None or (tag == "grpo" and
                                               precision.generation_dtype is not None)
        self.guard = Guard(cfg.guard_patience, amp=amp, stage=tag.upper(), autocast=uses)
        self.scaler = precision.scaler(self.guard.amp)
        self.gen = None if seed is None else \
            torch.Generator(device=run.device).manual_seed(seed)
        self.current_step = 0  # the step being taken; after restore(), the checkpoint's
        self.last_lr = 0.0
        self.grad_norm = torch.zeros(())  # before clipping
        self.update_size = torch.zeros(())  # the last step's ||delta theta|| / ||theta||

    # ---- one step
    def begin(self, step: int) -> float:
        """Starts `step` (from 1): sets and returns its learning rate."""
        self.current_step = step
        self.last_lr = lr_at(step, self.lr, self.warmup, self.total) * self.guard.lr_scale
        set_lr(self.opt, self.last_lr)
        return self.last_lr

    def autocast(self, generation: bool = False):
        """The run's autocast for training passes (or sampling), unless the guard cut it."""
        return self.precision.autocast(generation, enabled=self.guard.amp)

    def cast_once(self, net: torch.nn.Module):
        """Around a step's micro-batches: the Linear weights cast to the autocast dtype once,
        not once a micro-batch (precision.linear_weights_cast_once), where the model is
        trained as the plain module (not DDP-wrapped, sharded or compiled) under autocast."""
        if net is not self.model or not self.guard.amp or fsdp.is_sharded(net):
            return contextlib.nullcontext()
        return linear_weights_cast_once(net, self.precision.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()  # scaled only under fp16

    def step(self, loss: torch.Tensor, *good: torch.Tensor) -> bool:
        """The guarded optimizer step over the accumulated gradients: unscale, clip, ask the
        guard (agreed across ranks) whether the loss, the gradient norm, the parameters and
        the flags `good` (True when fine) are all finite, then step, or skip and maybe take
        the next rung of the fallback ladder. Returns whether the update went through."""
        self.scaler.unscale_(self.opt)
        clip = self.grad_clip or float("inf")
        self.grad_norm = fsdp.clip_grad_norm(self.model.parameters(), clip)
        # with fp16 loss scaling, overflowing gradients are the scaler's to skip
        norm = loss if self.scaler.is_enabled() else self.grad_norm
        ok = self.guard.check(loss, norm, *good, params_finite(self.model.parameters()))
        self.update_size = torch.zeros(())
        if ok:
            before = self.probe.read()
            self.scaler.step(self.opt)
            self.scaler.update()
            sums = self.probe.sums(before)
            if fsdp.is_sharded(self.model):  # each rank sampled its shards
                sums = D.all_reduce_sum(sums.to(self.device)).cpu()
            self.update_size = (sums[0] / sums[1].clamp_min(1e-300)).sqrt()
        else:
            self._skipped()
        self.opt.zero_grad(set_to_none=True)
        return ok

    def _skipped(self) -> None:
        """A skipped step, on every rank alike: log it, walk the ladder."""
        step = self.current_step
        if self.scaler.is_enabled():
            self.scaler.update(self.scaler.get_scale() / 2)
        self._say(step, f"non-finite loss, gradient, weights or logits: step skipped "
                        f"({self.guard.consecutive} in a row, {self.guard.skipped} in all)")
        # every rank must see the checkpoint (shared storage) for "restore" to be agreed
        mine = float(self.directory is not None and has_checkpoint(self.directory))
        have = D.all_reduce_sum(torch.tensor([mine], device=self.device)).item() \
            == self.dist.world_size
        amp = self.guard.amp
        what = self.guard.fallback(have, self._restore_newest, where=f"step {step}")
        if what:
            self._say(step, f"fallback after {self.guard.patience} skipped steps: {what}")
        if self.guard.amp != amp:
            self.scaler = self.precision.scaler(self.guard.amp)

    def _restore_newest(self) -> str:
        """The guard's restore rung: the newest checkpoint's weights and optimizer state."""
        path, ckpt = latest_checkpoint(self.directory)
        load_weights(ckpt, self.model, self.opt, source=str(path))
        return str(path)

    def _say(self, step: int, message: str) -> None:
        if self.logger:
            self.logger.event(step, message)
        elif self.tag != "grpo":
            self.dist.print0(f"[{self.tag}] step {step}: {message}")

    def metrics(self) -> dict[str, float]:
        g = self.guard
        return {"grad_norm": self.grad_norm.item(), "update_size": self.update_size.item(),
                "lr": self.last_lr,
                "guard/skipped": g.skipped, "guard/rungs_used": g.next_rung,
                "guard/amp": float(g.amp), "guard/lr_scale": g.lr_scale}

    # ---- on disk
    def save(self, step: int, optimizer: bool = True, directory: str | Path | None = None,
             keep: int | None = None, extra: dict | None = None) -> Path | None:
        """A checkpoint of every rank's state (a collective: every rank calls it), written
        only from finite parameters (a NaN must never reach the disk): under fsdp every
        rank writes its shards, else rank 0 one file. `optimizer=False`: the weights, the
        guard and the step only (a finished SFT stage); `directory` and `keep` default to
        the state's; `extra`: more entries (a stage's inputs). Returns the path (None
        where this rank wrote nothing, or nothing was written)."""
        meta = {"kind": self.tag, "step": step, "guard": self.guard.state_dict(),
                "rng": D.all_gather_object(rng_state(self.gen)),  # every rank's
                # metrics.jsonl's size: a run continuing from here cuts the rows after it
                "logged": self.logger.jsonl.size if self.logger else None,
                **self.identity, **(extra or {})}
        if optimizer:
            meta["scaler"] = self.scaler.state_dict()
        if not finite_everywhere(self.model):
            self.dist.print0(f"[mini-grpo] {self.tag} step {step}: parameters are not finite, "
                             f"checkpoint NOT written")
            return None
        path = save(self.model, self.opt if optimizer else None, meta,
                    directory or self.directory, step, self.keep if keep is None else keep)
        D.wait_for_main()  # rank 0 may have written the one file alone: not dist_timeout
        return path

    def restore(self, ckpt: dict, source: str = "checkpoint") -> None:
        """Continues from a loaded checkpoint: its weights and optimizer state (read once,
        in whichever form they were saved), the guard, the loss scale, this rank's RNG and
        the step."""
        load_weights(ckpt, self.model, self.opt, source=source)
        self.guard.load_state_dict(ckpt.get("guard", {}))
        self.scaler = self.precision.scaler(self.guard.amp)  # follows the verdict
        if ckpt.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(ckpt["scaler"])
        rngs = ckpt.get("rng")
        if not isinstance(rngs, list) or not rngs:
            raise CheckpointError(f"{source}: its 'rng' entry is not a list of each rank's "
                                  f"RNG state")
        rank = self.dist.rank
        state, skipped = rngs[min(rank, len(rngs) - 1)], []
        if rank >= len(rngs):  # more ranks than wrote it: the global RNG is seeded alike on
            # every rank, but a new rank's sampling stream must not repeat another's
            state = {k: v for k, v in state.items() if not k.startswith("generator")}
            skipped.append(f"rank {rank}'s sampling generator ({len(rngs)} rank(s) wrote "
                           f"the checkpoint)")
        skipped += set_rng_state(state, self.gen, source)
        self.current_step = ckpt["step"]
        if skipped:
            message = ("resumed without restoring " + "; ".join(skipped)
                       + ": those draws start from the seed")
            if self.logger is not None:
                self.logger.event(self.current_step, message)
            else:  # only rank 0 logs: another rank says it on the console
                print(f"[mini-grpo] rank {rank} step {self.current_step}: {message}",
                      flush=True)


# ---- a checkpoint's training state, read as untrusted input

def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def _finite(x, low: float, high: float) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and low <= x <= high


# each field's check (None: it may be absent) and what it must be, as the error says it
GUARD_FIELDS = {"skipped": (_count, "an integer >= 0"),
                "next_rung": (lambda x: _count(x) and x <= len(RUNGS),
                              f"an integer in 0..{len(RUNGS)}"),
                "lr_scale": (lambda x: _finite(x, 2**-1074, 1.0), "a number in (0, 1]"),
                "amp": (lambda x: isinstance(x, bool), "true or false")}
# the scaler keeps its scale and growth tracker in float32 and int32 tensors
SCALER_FIELDS = {"scale": (lambda x: _finite(x, 2**-149, 2**127),
                           "a number in [2**-149, 2**127]"),
                 "growth_factor": (lambda x: _finite(x, 1.0, 2**16), "a number in [1, 65536]"),
                 "backoff_factor": (lambda x: _finite(x, 2**-1074, 1.0), "a number in (0, 1]"),
                 "growth_interval": (lambda x: _count(x) and x > 0, "an integer >= 1"),
                 "_growth_tracker": (lambda x: _count(x) and x < 2**31,
                                     "an integer in 0..2**31-1")}


def check_train_state(ckpt: dict, source: str) -> None:
    """What a training checkpoint carries besides weights, configs and the optimizer's
    tensors, checked like a config before any of it is used (a crafted step, guard or
    scaler was a traceback, a step of -5 trained "steps -4..."): the step an integer >= 0,
    the guard's and the loss scaler's fields of their types and ranges, metrics.jsonl's
    size an integer, the optimizer state a dict (optim.check_state checks it against the
    optimizer it goes into). CheckpointError naming the file and the field."""
    def bad(field: str, what: str, value) -> CheckpointError:
        return CheckpointError(f"{source}: its {field!r} must be {what}, got {show(value)}")

    if not _count(ckpt.get("step")):
        raise bad("step", "an integer >= 0", ckpt.get("step"))
    if ckpt.get("logged") is not None and not _count(ckpt["logged"]):
        raise bad("logged", "an integer >= 0 (metrics.jsonl's size) or null", ckpt["logged"])
    if "optimizer" in ckpt and not isinstance(ckpt["optimizer"], dict):
        raise bad("optimizer", "an optimizer state (a dict)", ckpt["optimizer"])
    for name, fields in (("guard", GUARD_FIELDS), ("scaler", SCALER_FIELDS)):
        entry = ckpt.get(name, {})
        if not isinstance(entry, dict) or not set(entry) <= set(fields):
            raise bad(name, f"a dict of {', '.join(fields)}", entry)
        for key, value in entry.items():
            ok, what = fields[key]
            if not ok(value):
                raise bad(f"{name}.{key}", what, value)
    # a guard's missing field keeps its default; torch's scaler reads every one (a disabled
    # scaler saves none)
    scaler = ckpt.get("scaler", {})
    if scaler and set(scaler) != set(SCALER_FIELDS):
        raise bad("scaler", f"all of {', '.join(SCALER_FIELDS)}, or none", scaler)
