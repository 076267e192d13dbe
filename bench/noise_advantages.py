"""A control for bench/rl_screen.py: GRPO's own advantages, shuffled across the batch's rows,
so that an update has the size and sparsity of a real one and none of its signal:

    PYTHONPATH=bench .venv/bin/python bench/rl_screen.py --sft ... \\
        'shuffled:--advantage_estimator=noise_advantages:shuffled'

A variant that loses as much validation accuracy as this control does learns nothing its
noise does not undo.
"""

import torch

from mini_grpo.advantages import ADVANTAGES


def shuffled(x):
    """(P, G) grpo advantages, permuted over all P x G rows (the run's seeded RNG)."""
    a = ADVANTAGES["grpo"](x)
    return a.reshape(-1)[torch.randperm(a.numel(), device=a.device)].view_as(a)
