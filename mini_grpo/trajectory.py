"""One GRPO step's data in one record, built once: the Trajectory (in the manner of torchtune's
GRPOTrajectory). The reference pass, every policy pass, the loss and the metrics read it.

    traj = Trajectory.of(rollout, rewards, cfg, model)     # advantages, normalisers, the plan
    traj = traj.replace(ref_logp=reference.logprobs_of(traj))    # a new record, (B, N)
    for mb in traj.micro_batches(): ...                     # its rows, cut from the record

It holds the rollout's tokens and masks (the completion mask says which tokens are attended,
the loss mask which of them carry loss: in a multi-turn rollout, the model's own tokens, not
its tools' results), the engine's log-probs and the `Sampling` they were drawn with
(re-scoring uses its temperature), the rewards and advantages, the global batch's normalisers
and the micro-batch plan every pass follows. The normalisers come from a function the record
is given (`global_stats`: one all-reduce, so N ranks normalise as one process holding the
whole batch), not from the constructor. Nothing fills it in: the reference's and the old
policy's log-probs come as new records (`replace`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import distributed as D
from . import fsdp
from .advantages import AdvantageInputs, advantages, zero_spread
from .engines.base import Rollout, Sampling
from .logprobs import completion_logprobs
from .plan import Cut, cut, row_batches


class BatchStats(NamedTuple):
    """The global batch's counts and reward moments, 0-d fp32 tensors: what N ranks need to
    normalise as one process holding the whole batch."""
    num_rows: torch.Tensor  # rows of the global batch
    num_seqs: torch.Tensor  # sequences that carry loss (>= 1)
    num_tokens: torch.Tensor  # tokens that carry loss (>= 1)
    reward_mean: torch.Tensor
    reward_std: torch.Tensor  # population std of the batch's rewards
    centered_std: torch.Tensor  # rms of each reward less its group's mean


def global_stats(rewards: torch.Tensor, group_size: int, seqs: torch.Tensor,
                 tokens: torch.Tensor, reduce=D.all_reduce_sum) -> BatchStats:
    """BatchStats of this rank's `rewards` (B,) in groups of `group_size`, its loss-carrying
    `seqs` and `tokens` (0-d), summed over ranks by `reduce` in one collective."""
    # in float64: s2/n - mean^2 cancels, and in float32 rewards of 100 +- 0.1 had a batch
    # std of 0 (scale_rewards: batch then scaled their advantages ~350x)
    r64 = rewards.double().view(-1, group_size)
    c64 = r64 - r64.mean(dim=1, keepdim=True)  # each reward less its group's mean
    n, s1, s2, c2, seqs, tokens = reduce(torch.stack([
        torch.tensor(float(len(rewards)), dtype=torch.float64, device=rewards.device),
        r64.sum(), r64.square().sum(), c64.square().sum(), seqs.to(rewards.device).double(),
        tokens.to(rewards.device).double()]))
    std = (s2 / n - (s1 / n) ** 2).clamp(min=0).sqrt()
    return BatchStats(n.float(), seqs.float().clamp(min=1), tokens.float().clamp(min=1),
                      (s1 / n).float(), std.float(), (c2 / n).sqrt().float())


def local_stats(rewards: torch.Tensor, group_size: int, seqs: torch.Tensor,
                tokens: torch.Tensor) -> BatchStats:
    """BatchStats of this rank's rows alone (no collective): a single process's, or a test's."""
    return global_stats(rewards, group_size, seqs, tokens, reduce=lambda t: t)


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """Rows of a trajectory that go through the model together, each distinct prompt once, cut
    to the columns they need; cut from the record (Trajectory.micro_batches), never written
    back."""
    rows: torch.Tensor  # (b,) the trajectory's rows
    prompt_ids: torch.Tensor  # (U, P') the distinct prompts of these rows, left-padded
    prompt_mask: torch.Tensor  # (U, P') bool
    prompt_index: torch.Tensor  # (b,) each row's prompt in prompt_ids
    ids: torch.Tensor  # (b, n) completion tokens
    mask: torch.Tensor  # (b, n) bool, the completion's tokens (attended)
    loss_mask: torch.Tensor  # (b, n) bool, those that carry loss
    temperature: float  # the sampling temperature: log-probs are re-scored at it
    adv: torch.Tensor | None = None  # (b,)
    engine_logp: torch.Tensor | None = None  # (b, n) what the rollout engine sampled with
    ref_logp: torch.Tensor | None = None  # (b, n) the reference policy's; None: no reference
    old_logp: torch.Tensor | None = None  # (b, n) the policy's before this step's update

    def logprobs(self, model, entropy: bool = False):
        """logp (b, n) of the completion tokens under `model` at the sampling temperature
        (and entropy: see logprobs.completion_logprobs)."""
        return completion_logprobs(model, self.prompt_ids, self.prompt_mask, self.ids,
                                   self.mask, self.temperature, self.prompt_index,
                                   entropy=entropy)

    def positions(self) -> tuple[int, int]:
        """(token positions pushed through the model, padding included; the real ones)."""
        b, n = self.ids.shape
        real = self.prompt_mask.sum() + (self.mask.sum(1) - 1).clamp(min=0).sum()
        return self.prompt_ids.numel() + b * (n - 1), int(real)


@dataclass(frozen=True, eq=False)
class Trajectory:
    """A GRPO step's rows: B = prompts x group size, group-major; P prompt and N completion
    columns. Global (all ranks) figures are 0-d tensors."""
    prompt_ids: torch.Tensor  # (B, P) left-padded with the pad id
    prompt_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    completion_ids: torch.Tensor  # (B, N) pad id after each row's end
    completion_mask: torch.Tensor  # (B, N) bool, the completion's tokens (EOS included)
    loss_mask: torch.Tensor  # (B, N) bool, the tokens that carry loss: the completion mask
    # less the rows dynamic sampling (zero-spread groups) and mask_truncated leave out
    finished: torch.Tensor  # (B,) bool, the row ended with EOS
    sampling_logp: torch.Tensor  # (B, N) fp32, the engine's log-prob of each token, 0 masked
    nonfinite: torch.Tensor  # () bool, some logits were NaN/Inf while sampling
    sampling: Sampling  # how the rows were drawn
    group_size: int  # G: rows b*G .. b*G + G-1 share a prompt
    rewards: torch.Tensor  # (B,) fp32
    advantages: torch.Tensor  # (B,) fp32
    zero_spread: torch.Tensor  # (B / G,) bool, groups whose rewards are all equal
    num_rows: torch.Tensor  # () rows of the global batch
    num_seqs: torch.Tensor  # () sequences that carry loss, global (>= 1)
    num_tokens: torch.Tensor  # () tokens that carry loss, global (>= 1)
    reward_mean: torch.Tensor  # () of the global batch
    reward_std: torch.Tensor  # ()
    plan: tuple[Cut, ...]  # the micro-batches every pass goes through, in order
    pad: int  # passes with no loss that keep fsdp's ranks in step (the busiest's count)
    ref_logp: torch.Tensor | None = None  # (B, N) the reference policy's; None: no reference
    old_logp: torch.Tensor | None = None  # (B, N) the policy's before this step's update
    turn_counts: torch.Tensor | None = None  # (B, 5) multi-turn: turns.COUNTS
    # (Rollout.turn_counts)

    @classmethod
    def of(cls, r: Rollout, rewards: torch.Tensor, cfg, model=None,
           stats: Callable[..., BatchStats] = global_stats) -> Trajectory:
        """The record of rollout `r` with its `rewards` (B,): group advantages and the counts
        and reward moments of the global batch, which `stats` gives (global_stats: one
        all-reduce; local_stats: this rank's alone); the micro-batch plan of `cfg` (`model`:
        the policy, for fsdp's pad). With dynamic_sampling, zero-spread
        groups carry no loss; with mask_truncated, rows cut off at max_new_tokens carry none
        (their rewards still shape their group's advantages).

        With `beta` 0 the plan leaves out the rows of zero advantage (a zero-spread group's):
        their loss terms are 0 times the ratio, so they add exactly nothing to the loss or its
        gradient, and a pass over them is work for no update (in the LM job, 62% of the groups
        on average). They still count in the normalisers (`num_seqs`, `num_tokens`), so the
        gradient is the one of the whole batch; the pass's statistics (entropy, ratio, clip
        fractions) are of the rows it carried."""
        G = cfg.group_size
        zero = zero_spread(rewards, G)
        loss_mask = r.completion_mask & r.model_mask  # multi-turn: the model's own alone
        if cfg.dynamic_sampling:
            loss_mask = loss_mask & (~zero).repeat_interleave(G)[:, None]
        if cfg.mask_truncated:  # DAPO: cut-off rows teach nothing
            loss_mask = loss_mask & r.finished[:, None]
        n_seqs = loss_mask.any(1).sum() if cfg.dynamic_sampling or cfg.mask_truncated else \
            torch.tensor(len(rewards))
        g = stats(rewards, G, n_seqs, loss_mask.sum())
        adv = advantages(cfg.advantage_estimator, AdvantageInputs(
            rewards.float().view(-1, G), g.reward_mean, g.reward_std, g.centered_std,
            cfg.scale_rewards, 1e-4)).view(-1)
        live = loss_mask if cfg.beta else loss_mask & (adv != 0)[:, None]
        plan = tuple(cut(rows, live, r.prompt_mask, G) for rows in row_batches(
            r.prompt_mask, live, cfg.micro_batch_size, G, cfg.micro_batch_tokens))
        pad = 0 if model is None else fsdp.pad_passes(model, len(plan), rewards.device)
        return cls(prompt_ids=r.prompt_ids, prompt_mask=r.prompt_mask,
                   completion_ids=r.completion_ids, completion_mask=r.completion_mask,
                   loss_mask=loss_mask, finished=r.finished, sampling_logp=r.logprobs,
                   nonfinite=r.nonfinite, sampling=r.sampling, group_size=G, rewards=rewards,
                   advantages=adv, zero_spread=zero, num_rows=g.num_rows,
                   num_seqs=g.num_seqs, num_tokens=g.num_tokens, reward_mean=g.reward_mean,
                   reward_std=g.reward_std, plan=plan, pad=pad, turn_counts=r.turn_counts)

    def penalised(self, r: Rollout, penalty: torch.Tensor, cfg, model=None,
                  stats: Callable[..., BatchStats] = global_stats) -> Trajectory:
        """The record of the same rollout with advantages of its rewards less `penalty` (B,)
        (kl_in_reward); its rewards, their moments and zero-spread groups stay the task's,
        as the metrics report them, and so do the reference log-probs it holds."""
        t = Trajectory.of(r, self.rewards - penalty, cfg, model, stats)
        return t.replace(rewards=self.rewards, reward_mean=self.reward_mean,
                         reward_std=self.reward_std, zero_spread=self.zero_spread,
                         ref_logp=self.ref_logp)

    def replace(self, **changes) -> Trajectory:
        """A new record with `changes` (ref_logp, old_logp): this one stays as it is."""
        return dataclasses.replace(self, **changes)

    def micro_batches(self) -> list[MicroBatch]:
        """The plan's micro-batches, each its rows cut from the record (copies)."""
        return [self.micro_batch(c) for c in self.plan]

    def micro_batch(self, c: Cut) -> MicroBatch:
        rows, n = c.rows, c.width
        groups, index = torch.unique(rows // self.group_size, return_inverse=True)
        heads = groups * self.group_size  # one row of each group: its prompt

        def cols(t):
            return None if t is None else t[rows, :n]

        return MicroBatch(rows, self.prompt_ids[heads, c.first:],
                          self.prompt_mask[heads, c.first:], index, cols(self.completion_ids),
                          cols(self.completion_mask), cols(self.loss_mask),
                          self.sampling.temperature, self.advantages[rows],
                          cols(self.sampling_logp), cols(self.ref_logp), cols(self.old_logp))

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-micro-batch values (b, n), in plan order -> (B, N) fp32, 0 where none was."""
        out = torch.zeros(self.completion_ids.shape, dtype=torch.float32,
                          device=self.completion_ids.device)
        for c, part in zip(self.plan, parts):
            out[c.rows, :c.width] = part.float()
        return out
