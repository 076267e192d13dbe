"""NaN/Inf guards: skip non-finite steps, then walk a fallback ladder if they keep coming.

Before each optimizer step the loop asks `Guard.check(...)` whether the loss, the gradient norm,
the parameters (as the previous step left them) and the step's sampling were all finite. The
answer is agreed across ranks (a max all-reduce of the "bad" flag), so every rank skips
together and none desynchronises. After `patience` consecutive skips, `fallback()` applies the
next rung:

    amp_off   autocast off (fp32) for the rest of the run   (passed over when AMP is off)
    halve_lr  halve the learning rate (lr_scale)
    restore   reload the newest checkpoint (model and optimizer; passed over when none exists)
    stop      raise GuardError with what was tried

The guard owns this state (skips, rungs used, lr scale, autocast on/off) and it travels in
every checkpoint (`state_dict`), so a resumed run keeps AMP off or the lr halved. The config is
never changed at run time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import distributed as D
from .fsdp import local_params

RUNGS = ("amp_off", "halve_lr", "restore", "stop")


class GuardError(RuntimeError):
    """Training kept producing non-finite values after every fallback."""


class NonFiniteError(RuntimeError):
    """A stage without a fallback ladder (SFT) produced non-finite weights or losses."""


def params_finite(params) -> torch.Tensor:
    """0-d bool tensor: every parameter is finite (one fused norm per parameter, no sync)."""
    params = local_params(params)  # this rank's shards under fsdp: the guard agrees across ranks
    if not params:
        return torch.ones((), dtype=torch.bool)
    return torch.isfinite(torch.stack(torch._foreach_norm(params))).all()


def finite_everywhere(model: torch.nn.Module) -> bool:
    """Every parameter is finite on every rank (a collective: all ranks agree)."""
    bad = (~params_finite(model.parameters())).float().reshape(1)
    return D.all_reduce_max(bad).item() == 0


class Guard:
    def __init__(self, patience: int, amp: bool = True, stage: str = "GRPO",
                 autocast: bool = True):
        """`amp`: autocast still trusted (the verdict the previous stage handed on);
        `autocast`: this stage runs any autocast at all (else the amp_off rung is passed
        over, and the verdict is handed on unchanged)."""
        self.patience = patience
        self.stage = stage
        self.autocast = autocast
        self.consecutive = 0  # skips in a row
        self.skipped = 0  # skips in all
        self.next_rung = 0  # index into RUNGS
        self.last_ok = True  # the latest step went through
        self.lr_scale = 1.0  # the halve_lr rung's factor on the schedule
        self.amp = amp  # autocast allowed (False after the amp_off rung)

    def check(self, *values: torch.Tensor) -> bool:
        """True when every value (0-d tensors: losses, norms, flags that are True when good)
        is finite on every rank."""
        bad = torch.stack([~torch.isfinite(v.float()) if v.dtype != torch.bool else ~v
                           for v in values]).any().float()
        ok = D.all_reduce_max(bad.reshape(1)).item() == 0
        self.last_ok = ok
        if ok:
            self.consecutive = 0
        else:
            self.consecutive += 1
            self.skipped += 1
        return ok

    def fallback(self, have_checkpoint: bool, restore: Callable[[], str],
                 where: str = "") -> str | None:
        """After `patience` skips in a row: applies the next rung and says what it did; None
        before that. `restore()` reloads the newest checkpoint and returns its path."""
        if self.consecutive < self.patience:
            return None
        self.consecutive = 0
        while True:
            rung = RUNGS[min(self.next_rung, len(RUNGS) - 1)]
            self.next_rung += 1
            if rung == "amp_off" and self.amp and self.autocast:
                self.amp = False
                return "autocast turned off (fp32) for the rest of the run"
            if rung == "halve_lr":
                self.lr_scale /= 2
                return f"learning rate halved (x{self.lr_scale:g} of the schedule)"
            if rung == "restore" and have_checkpoint:
                return f"restored {restore()}"
            if rung == "stop":
                raise GuardError(f"{self.stage} {where}: loss or gradients stayed non-finite for "
                                 f"{self.patience} steps after every fallback (AMP off, "
                                 f"learning rate halved, last checkpoint restored)")

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "next_rung": self.next_rung,
                "lr_scale": self.lr_scale, "amp": self.amp}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.next_rung = int(state.get("next_rung", 0))
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.amp = bool(state.get("amp", self.amp))
