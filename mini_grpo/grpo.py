"""The GRPO loss as a pure tensor function, with what it takes by name: the policy loss of each
token (losses.py: grpo, dual_clip, gspo, cispo, sapo; or a user's package.module:function)
and the KL estimator (KL_ESTIMATORS). The advantages it is given come from advantages.py.

Shapes: B sequences (prompts x group size, flattened group-major), T completion tokens.

Per token: the policy loss (grpo's is the clipped surrogate -min(r A, clip(r, 1 - eps_low,
1 + eps_high) A) with r = exp(logp - old_logp)), weighted by the rollout engine's importance
correction where one sampled, plus beta * KL(pi || ref) by `kl_estimator` (k3,
exp(ref - logp) - (ref - logp) - 1, by default). Both exponents are masked before the
exponential: at a padded position the reference log-prob is 0 and the policy's may be -95,
and exp(95) = inf times a 0 mask is NaN, in the loss and in its gradient. Then over tokens:
  loss_agg  grpo:    mean over each sequence's tokens, then over sequences
            dapo:    sum over all tokens / number of tokens in the global batch
            dr_grpo: sum over all tokens / (rows x max_new_tokens), every row of the batch
                     counted, those that carry no loss (dynamic sampling, mask_truncated)
                     too: a constant, as Dr. GRPO and TRL have it

The normalisers (`num_seqs`, `num_tokens`) are for the *global* batch, so summing the losses of
micro-batches (and of ranks, for DDP) gives the loss of the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .losses import PolicyInputs, policy_terms
from .options import keys_with


@dataclass(frozen=True)
class LossSettings:
    """The loss's knobs, named as the config fields whose role is "loss" (`LossSettings.of`).
    No defaults of their own: the config's are the only ones (`LossSettings.default`)."""
    beta: float  # KL weight; 0 needs no reference
    epsilon_low: float  # clip range of the ratio: [1 - epsilon_low, 1 + epsilon_high]
    epsilon_high: float
    loss_agg: str  # grpo | dapo | dr_grpo
    max_new_tokens: int | None  # dr_grpo's constant
    vllm_is_cap: float  # importance sampling of the engine's samples past which; 0 = off
    vllm_is_mode: str  # token | sequence ratio, truncated or masked past the cap
    off_policy_mask: float  # off-policy sequence masking's threshold; 0 = off
    top_entropy_quantile: float  # loss on the tokens of the top share of entropy; 1 = all
    kl_estimator: str  # KL_ESTIMATORS' name: k1 | k2 | k3 | low_var_kl
    kl_in_reward: bool  # beta's KL is in the rewards (kl_reward_penalty), not in the loss
    policy_loss: str  # POLICY_LOSSES' name, or package.module:function
    dual_clip_c: float  # dual_clip's bound on a negative advantage's loss: c x |A|
    sapo_tau_pos: float  # sapo's gate temperature where the advantage is positive
    sapo_tau_neg: float  # and where it is negative

    @classmethod
    def default(cls, **changes) -> LossSettings:
        """GRPOConfig's defaults, with `changes`."""
        from .config import GRPOConfig

        return replace(cls.of(GRPOConfig()), **changes)

    @classmethod
    def of(cls, cfg) -> LossSettings:
        """The config's loss fields, by their declared role; the importance-sampling cap only
        where an engine other than the policy itself sampled (native: the weight is 1)."""
        values = {k: getattr(cfg, k) for k in keys_with(type(cfg), "loss")}
        if cfg.rollout_engine != "vllm":
            values["vllm_is_cap"] = 0.0
        return cls(**values)


class LossStats(NamedTuple):
    """Detached 0-d token means over one (micro-)batch."""
    kl: torch.Tensor
    clip_low: torch.Tensor  # ratio below 1 - eps_low where the advantage is negative
    clip_high: torch.Tensor  # ratio above 1 + eps_high where the advantage is positive
    ratio: torch.Tensor
    entropy: torch.Tensor
    engine_diff: torch.Tensor  # |logp_old - logp_engine|: the rollout engine's mismatch
    engine_kl: torch.Tensor  # KL(engine || trainer), k3 on the engine's samples


def engine_is_weight(old_logp, engine_logp, mask, cap: float, mode: str = "token_truncate"):
    """Importance sampling of the engine's samples (TRL's and verl's vLLM correction): the
    rollout was sampled by an engine whose log-probs differ from the trainer's (other
    kernels, other precision), so each token's policy-gradient term is weighted, detached,
    by the ratio trainer / engine of (`mode`) its token or its whole sequence (the product of
    its tokens'), past `cap` truncated to it or masked to 0: (B, T), 1 where masked; None
    when cap is 0 (off). Also returns the mismatch's token means (|logp_old - logp_engine|,
    and KL(engine || trainer) by the k3 estimator on the engine's samples), for the metrics."""
    keep, m = mask.bool(), mask.float()
    d = torch.where(keep, old_logp.detach() - engine_logp, 0.0)  # log(trainer / engine)
    weight = None
    if cap > 0:
        level, how = mode.split("_")
        log_w = d if level == "token" else d.sum(1, keepdim=True).expand_as(d)
        w = torch.exp(log_w.clamp(max=math.log(cap) + 1.0))  # past the cap either way
        weight = w.clamp(max=cap) if how == "truncate" else torch.where(w > cap, 0.0, w)
        weight = torch.where(keep, weight, 1.0)
    return weight, _masked_mean(d.abs(), m), _masked_mean(torch.exp(d) - 1 - d, m)


def off_policy_mask(logp, sampled_logp, adv, mask, threshold: float) -> torch.Tensor | None:
    """Off-policy sequence masking (DeepSeek-V3.2): a row whose advantage is negative and
    whose policy has drifted from the one that sampled it by more than `threshold` (the mean
    over its tokens of log pi_sampler - log pi, a KL estimate) carries no loss: pushing such a
    sample down teaches little and destabilises. (B, 1) bool of the rows kept; None when off."""
    if threshold <= 0:
        return None
    m = mask.float()
    kl = (torch.where(mask.bool(), sampled_logp - logp.detach(), 0.0).sum(1)
          / m.sum(1).clamp(min=1))
    return ~((adv < 0) & (kl > threshold))[:, None]


def high_entropy_mask(entropy, mask, quantile: float) -> torch.Tensor | None:
    """Top-entropy token masking (Wang et al. 2025, "Beyond the 80/20 rule"): the tokens whose
    entropy is at least the (1 - quantile) quantile of the masked tokens' (B, T) bool; None
    when `quantile` is 1 (every token). The policy-gradient term of the others is 0: the few
    high-entropy tokens where a reasoning path forks carry the learning."""
    if quantile >= 1.0:
        return None
    keep = mask.bool()
    h = entropy.detach().float()
    if not keep.any():
        return keep
    threshold = torch.quantile(h[keep], 1.0 - quantile)
    return keep & (h >= threshold)


# ---- KL estimators, by name (kl_estimator): d = log ref - log pi per token -> KL(pi || ref)
# (Schulman's k1, k2, k3); 0 where d is 0 (masked positions)

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda d: -d,  # log pi - log ref: unbiased, high variance, can be < 0
    "k2": lambda d: 0.5 * d.square(),  # low variance, biased
    "k3": lambda d: torch.exp(d) - d - 1,  # unbiased, >= 0 (GRPO's)
    # k3 clamped to [-10, 10] (verl's low_var_kl): a token far off the reference cannot
    # dominate the term
    "low_var_kl": lambda d: (torch.exp(d) - d - 1).clamp(-10.0, 10.0),
}


def kl_reward_penalty(sampling_logp, ref_logp, mask, beta: float, estimator: str):
    """KL in the reward: beta x each row's KL(pi || ref), the sum over its tokens of the
    estimator on the sampled tokens (log-probs of the policy that sampled them), detached:
    (B,), subtracted from the rows' rewards before their advantages (kl_in_reward)."""
    d = torch.where(mask.bool(), ref_logp - sampling_logp, 0.0).detach()
    return beta * KL_ESTIMATORS[estimator](d).sum(1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(logp, old_logp, adv, mask, s: LossSettings, *, ref_logp=None,
              entropy=None, num_seqs=None, num_tokens=None, num_rows=None,
              engine_logp=None) -> tuple[torch.Tensor, LossStats]:
    """The GRPO loss of one (micro-)batch and its detached statistics.

    logp, old_logp, ref_logp, entropy: (B, T) fp32; adv: (B,); mask: (B, T) completion mask.
    With `s.top_entropy_quantile` < 1 the policy-gradient term (not the KL term) is kept on
    the micro-batch's tokens of highest entropy alone (`high_entropy_mask`).
    num_seqs / num_tokens / num_rows: the global batch's counts of sequences that carry loss,
    of their tokens, and of all its rows (dr_grpo's); default: this batch's.
    engine_logp: (B, T) the log-probs the rollout engine sampled with; with `s.vllm_is_cap` the
    policy-gradient term (not the KL term) of each token is weighted by truncated importance
    sampling (`engine_is_weight`), and the stats say how far the two disagree.
    """
    beta, agg = s.beta, s.loss_agg
    keep, m = mask.bool(), mask.float()
    num_seqs = logp.size(0) if num_seqs is None else num_seqs
    num_tokens = m.sum() if num_tokens is None else num_tokens
    num_rows = logp.size(0) if num_rows is None else num_rows
    A = adv[:, None]  # (B, 1)
    terms = policy_terms(PolicyInputs(logp, old_logp, A, keep, s))
    per_token, ratio = terms.per_token, terms.ratio
    zero = torch.zeros((), device=logp.device)
    diff = engine_kl = zero
    if engine_logp is not None:
        weight, diff, engine_kl = engine_is_weight(old_logp, engine_logp, mask, s.vllm_is_cap,
                                                   s.vllm_is_mode)
        if weight is not None:
            per_token = per_token * weight
    kept = off_policy_mask(logp, old_logp if engine_logp is None else engine_logp, adv, mask,
                           s.off_policy_mask)
    if kept is not None:  # the rows still count in the normalisers: their loss is 0
        per_token = per_token * kept
    if s.top_entropy_quantile < 1.0:  # so do the tokens left out (TRL's as well)
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the tokens' entropy")
        per_token = per_token * high_entropy_mask(entropy, mask, s.top_entropy_quantile)
    kl = None
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        d = torch.where(keep, ref_logp - logp, 0.0)
        kl = KL_ESTIMATORS[s.kl_estimator](d)  # 0 where masked
        if not s.kl_in_reward:  # else it is in the advantages already: measured only
            per_token = per_token + beta * kl

    if agg == "grpo":
        loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).sum() / num_seqs
    elif agg == "dapo":
        loss = (per_token * m).sum() / num_tokens
    elif agg == "dr_grpo":
        if s.max_new_tokens is None:
            raise ValueError("agg='dr_grpo' needs max_new_tokens")
        loss = (per_token * m).sum() / (num_rows * s.max_new_tokens)
    else:
        raise ValueError(f"agg must be grpo, dapo or dr_grpo, got {agg!r}")

    with torch.no_grad():  # tensors, not floats: no host sync per micro-batch
        stats = LossStats(
            kl=_masked_mean(kl, m) if kl is not None else zero,
            clip_low=_masked_mean(terms.clipped_low.float(), m),
            clip_high=_masked_mean(terms.clipped_high.float(), m),
            ratio=_masked_mean(ratio, m),
            entropy=_masked_mean(entropy, m) if entropy is not None else zero,
            engine_diff=diff, engine_kl=engine_kl)
    return loss, stats
