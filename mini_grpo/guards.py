"""NaN/Inf guards: skip non-finite steps, then walk a fallback ladder if they keep coming.

Before each optimizer step the trainer asks `Guard.step_ok(loss, grad_norm)`; the answer is
agreed across ranks (a max all-reduce of the "bad" flag), so every rank skips together and none
desynchronises. After `patience` consecutive skips the guard returns the next rung:

    amp_off   turn autocast off (fp32) for the rest of the run   (skipped when AMP is off)
    halve_lr  halve the learning rate
    restore   reload the newest checkpoint (model and optimizer)  (skipped when none exists)
    stop      raise GuardError with what was tried

Each rung is logged as an event by the trainer (console, TensorBoard text, metrics.jsonl).
"""

from __future__ import annotations

import torch

from . import distributed as D

RUNGS = ("amp_off", "halve_lr", "restore", "stop")


class GuardError(RuntimeError):
    """Training kept producing non-finite values after every fallback."""


class Guard:
    def __init__(self, patience: int):
        self.patience = patience
        self.consecutive = 0  # skips in a row
        self.skipped = 0  # skips in all
        self.next_rung = 0  # index into RUNGS
        self.last_ok = True  # the latest step went through

    def step_ok(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True when loss and gradient norm are finite on every rank."""
        bad = torch.stack([~torch.isfinite(loss), ~torch.isfinite(grad_norm)]).any().float()
        ok = D.all_reduce_max(bad.reshape(1)).item() == 0
        self.last_ok = ok
        if ok:
            self.consecutive = 0
        else:
            self.consecutive += 1
            self.skipped += 1
        return ok

    def rung(self, amp_on: bool, have_checkpoint: bool) -> str | None:
        """The fallback to apply now, or None. Rungs that cannot apply are passed over."""
        if self.consecutive < self.patience:
            return None
        self.consecutive = 0
        while True:
            rung = RUNGS[min(self.next_rung, len(RUNGS) - 1)]
            self.next_rung += 1
            if (rung == "amp_off" and not amp_on) or (rung == "restore" and not have_checkpoint):
                continue
            return rung
