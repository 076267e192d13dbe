"""Test hooks: faults and NaNs injected through environment variables, read in one place.

    MINI_GRPO_FAULT=crash:N   the last rank exits abruptly at GRPO step N (first attempt only,
                              so an elastic restart can finish the job)
    MINI_GRPO_FAULT=raise:N   the last rank raises at step N
    MINI_GRPO_NAN_STEPS=3,4   the last rank's loss and gradient are poisoned at those steps

Unset (the normal case), every hook is a no-op. The trainer calls them at fixed points of the
step, so the guard, elastic restart and failure reporting are tested through the real loop.
"""

from __future__ import annotations

import os

import torch


def _last_rank(dist) -> bool:
    return dist.rank == dist.world_size - 1


def inject_fault(step: int, dist) -> None:
    kind, _, at = os.environ.get("MINI_GRPO_FAULT", "").partition(":")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if kind and int(at) == step and _last_rank(dist) and first_attempt:
        if kind == "crash":
            print(f"[fault] rank {dist.rank} exits abruptly at step {step}", flush=True)
            os._exit(13)
        raise RuntimeError(f"injected fault on rank {dist.rank} at step {step}")


def poison_gradients(step: int, dist, loss: torch.Tensor, model: torch.nn.Module) -> None:
    """Sets this rank's loss and first gradient to NaN at the steps MINI_GRPO_NAN_STEPS names."""
    steps = os.environ.get("MINI_GRPO_NAN_STEPS", "")
    if _last_rank(dist) and str(step) in steps.split(","):
        loss.fill_(float("nan"))
        next(model.parameters()).grad.fill_(float("nan"))
