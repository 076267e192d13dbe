"""Test hooks: callbacks that tests install to inject faults and NaNs into the real GRPO loop.

Production installs none: the lists stay empty and nothing here reads the environment. The
trainer calls `step_start` at the top of each step and `after_backward` after each policy pass
(before the guard looks at the loss and gradients), and run.Run.rank0_with_weights
`rank0_alone` on rank 0, so elastic restart, failure reporting, the guard's ladder and the
wait for rank 0's work alone are tested through the loop users run. Tests append callables in
process, or run tests/fault_worker.py under torchrun, which installs them from its flags.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (step, dist) at the top of a GRPO step
STEP_START: list[Callable[[int, object], None]] = []
# (step, dist, loss of the pass (0-d, may be filled in place), model) after a policy pass
AFTER_BACKWARD: list[Callable[[int, object, torch.Tensor, torch.nn.Module], None]] = []
# (dist) on rank 0 as it starts work alone (Run.rank0_with_weights: evaluations, export)
RANK0_ALONE: list[Callable[[object], None]] = []


def step_start(step: int, dist) -> None:
    for hook in STEP_START:
        hook(step, dist)


def after_backward(step: int, dist, loss: torch.Tensor, model: torch.nn.Module) -> None:
    for hook in AFTER_BACKWARD:
        hook(step, dist, loss, model)


def rank0_alone(dist) -> None:
    for hook in RANK0_ALONE:
        hook(dist)
