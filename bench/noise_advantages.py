"""Controls and probes for bench/rl_screen.py, as user estimators:

    PYTHONPATH=bench .venv/bin/python bench/rl_screen.py --sft ... \\
        'shuffled:--advantage_estimator=noise_advantages:shuffled'

`shuffled`: GRPO's own advantages, shuffled across the batch's rows, so that an update has the
size and sparsity of a real one and none of its signal: a variant that loses as much
validation accuracy as this control learns nothing its noise does not undo. `positive_only`:
GRPO's with the negative ones set to 0 (nothing pushed down).
"""

import torch

from mini_grpo.advantages import ADVANTAGES


def shuffled(x):
    """(P, G) grpo advantages, permuted over all P x G rows (the run's seeded RNG)."""
    a = ADVANTAGES["grpo"](x)
    return a.reshape(-1)[torch.randperm(a.numel(), device=a.device)].view_as(a)


def positive_only(x):
    """(P, G) grpo advantages with the negative ones set to 0: only the rows that beat their
    group's mean are pushed up, none pushed down (an on-policy RFT). A probe of whether the
    negative half of GRPO's update is what costs the validation accuracy."""
    return ADVANTAGES["grpo"](x).clamp(min=0)
