"""Policy losses by name (`policy_loss`): each token's policy-gradient term of the GRPO loss
(grpo.grpo_loss adds the KL term and aggregates), registered the way reward plugins are: grpo
(PPO's clipped surrogate, DAPO's clip-higher), dual_clip, gspo, cispo and sapo; a user's own is
`package.module:function` taking PolicyInputs and returning PolicyTerms. Pure tensor functions.

    terms = policy_terms(PolicyInputs(logp, old_logp, adv[:, None], keep, settings))
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import torch

from .fields import ConfigError


class PolicyInputs(NamedTuple):
    """What a policy loss sees (B rows, T completion tokens)."""
    logp: torch.Tensor  # (B, T) fp32, the policy's log-probs, with their gradient
    old_logp: torch.Tensor  # (B, T) those the rollout was scored with, detached
    adv: torch.Tensor  # (B, 1) advantages
    keep: torch.Tensor  # (B, T) bool: the tokens that carry loss
    s: Any  # grpo.LossSettings: epsilon_low/high, dual_clip_c, sapo_tau_pos/neg, policy_loss


class PolicyTerms(NamedTuple):
    """A policy loss's result: the loss of each token, and what the statistics report."""
    per_token: torch.Tensor  # (B, T); masked positions are ignored by the aggregation
    ratio: torch.Tensor  # (B, T) detached: the importance ratio the loss used (1 if masked)
    clipped_low: torch.Tensor  # (B, T) bool: tokens whose update the loss cut, A < 0 side
    clipped_high: torch.Tensor  # (B, T) bool: and on the A > 0 side


POLICY_LOSSES: dict[str, Callable[[PolicyInputs], PolicyTerms]] = {}


def policy_loss(name: str) -> Callable:
    """Registers a policy loss under `name`."""
    def deco(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def _ratio(x: PolicyInputs) -> torch.Tensor:
    return torch.exp(torch.where(x.keep, x.logp - x.old_logp, 0.0))  # 1 where masked


def _clip_terms(x: PolicyInputs, ratio: torch.Tensor) -> PolicyTerms:
    """PPO's clipped surrogate -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) of `ratio`."""
    s, A = x.s, x.adv
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    r = ratio.detach()
    return PolicyTerms(-torch.min(ratio * A, clipped * A), r,
                       (r < 1 - s.epsilon_low) & (A < 0), (r > 1 + s.epsilon_high) & (A > 0))


@policy_loss("grpo")
def grpo_policy(x: PolicyInputs) -> PolicyTerms:
    """GRPO / PPO's clipped surrogate per token, with DAPO's clip-higher (epsilon_high)."""
    return _clip_terms(x, _ratio(x))


@policy_loss("dual_clip")
def dual_clip_policy(x: PolicyInputs) -> PolicyTerms:
    """Dual-clip PPO (Ye et al. 2020): where A < 0, the loss is also bounded by c |A|
    (dual_clip_c), so a token whose ratio ran far up cannot take a huge step down."""
    t = _clip_terms(x, _ratio(x))
    bound = -x.s.dual_clip_c * x.adv  # (B, 1), > 0 where A < 0
    capped = (x.adv < 0) & (t.per_token > bound)
    return t._replace(per_token=torch.where(x.adv < 0, torch.min(t.per_token, bound),
                                            t.per_token),
                      clipped_low=t.clipped_low | capped)


@policy_loss("gspo")
def gspo_policy(x: PolicyInputs) -> PolicyTerms:
    """GSPO (Zheng et al. 2025), its token form: the sequence's ratio, exp of the mean
    log-ratio over its tokens, clipped as one; each token's gradient is the sequence ratio
    times its own log-prob's (sg[s_i] * pi / sg[pi]). Its ratios sit near 1: GSPO's clip
    ranges are ~3e-4 and 4e-4 (epsilon_low, epsilon_high)."""
    m = x.keep.float()
    d = torch.where(x.keep, x.logp - x.old_logp, 0.0)
    seq = (d.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)).detach()  # (B, 1)
    log_s = seq + x.logp - x.logp.detach()
    ratio = torch.exp(torch.where(x.keep, log_s, 0.0))
    return _clip_terms(x, ratio)


@policy_loss("cispo")
def cispo_policy(x: PolicyInputs) -> PolicyTerms:
    """CISPO (MiniMax-M1, 2025): -sg[min(r, 1 + epsilon_high)] A log pi. The importance
    weight is clipped, never the gradient: every token keeps its update, a rare one with a
    large ratio at most 1 + epsilon_high times (MiniMax uses a wide one)."""
    ratio = _ratio(x).detach()
    weight = ratio.clamp(max=1 + x.s.epsilon_high)
    return PolicyTerms(-weight * x.adv * x.logp, ratio, torch.zeros_like(x.keep),
                       (ratio > 1 + x.s.epsilon_high) & (x.adv > 0))


@policy_loss("sapo")
def sapo_policy(x: PolicyInputs) -> PolicyTerms:
    """SAPO (Gao et al. 2025): a soft gate in place of the clip, -g(r) A with
    g(r) = sigmoid(tau (r - 1)) 4 / tau (its slope at r = 1 is 1: the plain surrogate's
    gradient there), tau = sapo_tau_pos where A > 0 and sapo_tau_neg where A < 0. Its clip
    fractions count the ratios outside [1 - epsilon_low, 1 + epsilon_high], for comparison."""
    s, A = x.s, x.adv
    ratio = _ratio(x)
    tau = torch.full_like(A, s.sapo_tau_neg).masked_fill(A > 0, s.sapo_tau_pos)  # (B, 1)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    r = ratio.detach()
    return PolicyTerms(-gate * A, r, (r < 1 - s.epsilon_low) & (A < 0),
                       (r > 1 + s.epsilon_high) & (A > 0))


@lru_cache(maxsize=64)
def resolve_policy_loss(name: str) -> Callable[[PolicyInputs], PolicyTerms]:
    """The policy loss a config names: registered, or `package.module:function` (imported)."""
    from .rewards.registry import resolve_named

    return resolve_named("policy_loss", name, POLICY_LOSSES, "loss")


def policy_terms(x: PolicyInputs) -> PolicyTerms:
    """The chosen policy loss's terms, checked: a user's of other shapes or types is one line
    naming it (a non-finite loss is the guard's to catch, as any other)."""
    name = x.s.policy_loss
    t = resolve_policy_loss(name)(x)
    shape = x.logp.shape
    if not (isinstance(t, PolicyTerms) and all(
            isinstance(v, torch.Tensor) and v.shape == shape for v in t)):
        raise ConfigError(f"policy_loss {name!r}: must return a grpo.PolicyTerms of "
                          f"{list(shape)} tensors, got {type(t).__name__}")
    return t
