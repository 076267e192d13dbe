"""Advantages: a rank's rewards, as groups of G completions of one prompt, to each row's
advantage, by an estimator registered by name (`advantage_estimator`), the way reward plugins
are: grpo (today's GRPO, scaled by `scale_rewards`), dr_grpo, rloo, reinforce_pp and
reinforce_pp_baseline; a user's own is `package.module:function` of the same signature
(AdvantageInputs -> (P, G)). Pure tensor functions; the global batch's moments they may use
are all-reduced by the caller (Trajectory.of), so N ranks give one process's advantages.

The group std is the population std (divide by G), not the sample std TRL and verl use (divide
by G - 1, advantages x0.94 at G = 8): with it a group's advantages have exactly unit variance,
and the default learning rate was tuned with it. Only the scale of the advantages differs,
which the learning rate absorbs.

    a = advantages("rloo", AdvantageInputs(rewards.view(-1, G), mean, std, centered_std,
                                          "group", 1e-4))    # (P, G)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import torch

from .fields import ConfigError


def zero_spread(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards -> (B/G,) bool: the groups whose rewards are all equal (no signal)."""
    r = rewards.view(-1, group_size)
    return r.max(dim=1).values == r.min(dim=1).values


def signal_first(rewards: torch.Tensor, group_size: int, keep: int) -> list[int]:
    """(B,) rewards of B/G groups -> the rows of `keep` groups, those whose rewards differ
    first, each part in its sampled order (dynamic_sampling_factor: DAPO's refill, drawn in
    one round; a batch short of such groups is filled with zero-spread ones, which
    dynamic_sampling then drops)."""
    zero = zero_spread(rewards, group_size).tolist()
    order = [g for g, z in enumerate(zero) if not z] + [g for g, z in enumerate(zero) if z]
    return [g * group_size + i for g in sorted(order[:keep]) for i in range(group_size)]


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = 1e-4, batch_std: torch.Tensor | float | None = None):
    """rewards (B,) grouped as B/G consecutive groups -> advantages (B,).

    `batch_std` overrides the local std for scale="batch" (DDP passes the global one).
    Groups whose rewards are all equal (`zero_spread`) get zero advantage under every scaling.
    """
    r = rewards.float().view(-1, group_size)  # (B/G, G)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    a = r - mean
    if scale == "group":
        a = a / (std + eps)
    elif scale == "batch":
        s = rewards.float().std(unbiased=False) if batch_std is None else batch_std
        a = a / (s + eps)
    elif scale != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale!r}")
    a = a.masked_fill(zero_spread(rewards, group_size)[:, None], 0.0)  # exactly 0, no 0/0
    return a.view(-1)


# ---- advantage estimators, by name (advantage_estimator): a rank's rewards as groups -> their
# advantages; a user's own is `package.module:function` of the same signature

class AdvantageInputs(NamedTuple):
    """What an advantage estimator sees."""
    rewards: torch.Tensor  # (P, G) fp32: this rank's P prompts' groups of G completions
    batch_mean: torch.Tensor  # () the global batch's mean reward (every rank's rows)
    batch_std: torch.Tensor  # () its population std
    centered_std: torch.Tensor  # () the global batch's population std of r - group mean
    scale: str  # scale_rewards (grpo's): group | batch | none
    eps: float  # added to a std before dividing by it


ADVANTAGES: dict[str, Callable[[AdvantageInputs], torch.Tensor]] = {}


def advantage(name: str) -> Callable:
    """Registers an advantage estimator under `name`."""
    def deco(fn: Callable) -> Callable:
        ADVANTAGES[name] = fn
        return fn
    return deco


def _centered(r: torch.Tensor) -> torch.Tensor:
    return r - r.mean(dim=1, keepdim=True)


@advantage("grpo")
def grpo_advantages(x: AdvantageInputs) -> torch.Tensor:
    """GRPO (Shao et al. 2024): r - group mean, divided by the group's std (scale_rewards:
    group), the global batch's (batch) or nothing (none); a zero-spread group's are 0."""
    P, G = x.rewards.shape
    return group_advantages(x.rewards.reshape(-1), G, x.scale, x.eps,
                            x.batch_std).view(P, G)


@advantage("dr_grpo")
def dr_grpo_advantages(x: AdvantageInputs) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): r - group mean, unscaled (a group's std divides out its
    difficulty, which biases the update towards the easiest and hardest questions)."""
    return _centered(x.rewards)


@advantage("rloo")
def rloo_advantages(x: AdvantageInputs) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r minus the mean of the group's other G - 1 rewards,
    G / (G - 1) (r - group mean): a baseline that does not hold the row's own reward."""
    G = x.rewards.size(1)
    return _centered(x.rewards) * (G / (G - 1))


@advantage("reinforce_pp")
def reinforce_pp_advantages(x: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): no group baseline; the reward whitened by the global batch's
    mean and std (per row here; verl's whitens per token, which weighs long rows more)."""
    return (x.rewards - x.batch_mean) / (x.batch_std + x.eps)


@advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(x: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu 2025, verl's reinforce_plus_plus_baseline):
    r - group mean, divided by the global batch's std of that."""
    return _centered(x.rewards) / (x.centered_std + x.eps)


@lru_cache(maxsize=64)
def resolve_advantage(name: str) -> Callable[[AdvantageInputs], torch.Tensor]:
    """The estimator a config names: registered, or `package.module:function` (imported)."""
    from .rewards.registry import resolve_named

    return resolve_named("advantage_estimator", name, ADVANTAGES, "estimator")


def advantages(name: str, x: AdvantageInputs) -> torch.Tensor:
    """The estimator `name`'s advantages (P, G), checked: a user's that returns another shape
    or a non-finite value is one line naming it."""
    a = resolve_advantage(name)(x)
    if not isinstance(a, torch.Tensor) or a.shape != x.rewards.shape:
        got = list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
        raise ConfigError(f"advantage_estimator {name!r}: must return a tensor of the "
                          f"rewards' shape {list(x.rewards.shape)}, got {got}")
    if not torch.isfinite(a).all():
        raise ConfigError(f"advantage_estimator {name!r}: returned non-finite advantages")
    return a.float()
