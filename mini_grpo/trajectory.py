"""One GRPO step's data in one record, built once: the Trajectory (in the manner of torchtune's
GRPOTrajectory). The reference pass, every policy pass, the loss and the metrics read it.

    traj = Trajectory.of(rollout, rewards, cfg, model)     # advantages, normalisers, the plan
    traj = traj.replace(ref_logp=reference.logprobs_of(traj))    # a new record, (B, N)
    for mb in traj.micro_batches(): ...                     # its rows, cut from the record

It holds the rollout's tokens and masks (the completion mask says which tokens are attended,
the loss mask which of them carry loss: in a multi-turn rollout, the model's own tokens, not
its tools' results), the engine's log-probs and the `Sampling` they were
drawn with (re-scoring uses its temperature), the rewards and advantages, the global batch's
normalisers (one all-reduce: N ranks normalise as one process holding the whole batch), and
the micro-batch plan every pass follows. Nothing fills it in: the reference's and the old
policy's log-probs come as new records (`replace`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import distributed as D
from . import fsdp
from .advantages import AdvantageInputs, advantages, zero_spread
from .engines.base import Rollout, Sampling
from .logprobs import completion_logprobs


def plan_micro_batches(keys: list, size: int, cost=None, budget: int = 0) -> list[list[int]]:
    """Indices sorted by `keys` (a length first) and cut into micro-batches of at most `size`
    (the last may be smaller), so each micro-batch holds items of similar length and little
    padding. With a `budget`, a micro-batch is also cut before `cost(indices)` would exceed
    it (an item alone may: it has nowhere else to go).

    Cutting early where lengths jump would push a little less padding, but it made the
    default step's policy update slower on a CPU: every new micro-batch shape costs oneDNN a
    kernel set-up, and with fixed-size micro-batches only the length varies.
    """
    plan: list[list[int]] = [[]]
    for i in sorted(range(len(keys)), key=keys.__getitem__):
        cur = plan[-1]
        if cur and (len(cur) == size or (budget and cost(cur + [i]) > budget)):
            plan.append(cur := [])
        cur.append(i)
    return plan if plan[0] else []


class Cut(NamedTuple):
    """One micro-batch of the plan: its rows, the completion columns they use, and the first
    column of their prompts that holds a real token (prompts are left-padded)."""
    rows: torch.Tensor  # (b,)
    width: int
    first: int


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
    def of(cls, r: Rollout, rewards: torch.Tensor, cfg, model=None) -> Trajectory:
        """The record of rollout `r` with its `rewards` (B,): group advantages and, in one
        all-reduce, the counts and reward moments of the global batch; the micro-batch plan
        of `cfg` (`model`: the policy, for fsdp's pad). With dynamic_sampling, zero-spread
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
        # in float64: s2/n - mean^2 cancels, and in float32 rewards of 100 +- 0.1 had a batch
        # std of 0 (scale_rewards: batch then scaled their advantages ~350x)
        r64 = rewards.double().view(-1, G)
        c64 = r64 - r64.mean(dim=1, keepdim=True)  # each reward less its group's mean
        n, s1, s2, c2, seqs, tokens = D.all_reduce_sum(torch.stack([
            torch.tensor(float(len(rewards)), dtype=torch.float64, device=rewards.device),
            r64.sum(), r64.square().sum(), c64.square().sum(),
            n_seqs.to(rewards.device).double(), loss_mask.sum().double()]))
        std = (s2 / n - (s1 / n) ** 2).clamp(min=0).sqrt().float()
        n, mean, seqs, tokens = n.float(), (s1 / n).float(), seqs.float(), tokens.float()
        adv = advantages(cfg.advantage_estimator, AdvantageInputs(
            rewards.float().view(-1, G), mean, std, (c2 / n).sqrt().float(), cfg.scale_rewards,
            1e-4)).view(-1)
        live = loss_mask if cfg.beta else loss_mask & (adv != 0)[:, None]
        plan = tuple(cut(rows, live, r.prompt_mask, G) for rows in row_batches(
            r.prompt_mask, live, cfg.micro_batch_size, G, cfg.micro_batch_tokens))
        pad = 0 if model is None else fsdp.pad_passes(model, len(plan), rewards.device)
        return cls(prompt_ids=r.prompt_ids, prompt_mask=r.prompt_mask,
                   completion_ids=r.completion_ids, completion_mask=r.completion_mask,
                   loss_mask=loss_mask, finished=r.finished, sampling_logp=r.logprobs,
                   nonfinite=r.nonfinite, sampling=r.sampling, group_size=G, rewards=rewards,
                   advantages=adv, zero_spread=zero, num_rows=n, num_seqs=seqs.clamp(min=1),
                   num_tokens=tokens.clamp(min=1), reward_mean=mean, reward_std=std,
                   plan=plan, pad=pad, turn_counts=r.turn_counts)

    def penalised(self, r: Rollout, penalty: torch.Tensor, cfg, model=None) -> Trajectory:
        """The record of the same rollout with advantages of its rewards less `penalty` (B,)
        (kl_in_reward); its rewards, their moments and zero-spread groups stay the task's,
        as the metrics report them, and so do the reference log-probs it holds."""
        t = Trajectory.of(r, self.rewards - penalty, cfg, model)
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


def extent(mask: torch.Tensor) -> torch.Tensor:
    """(B,) each row's last True column + 1 (0: none): the columns a pass must hold to reach
    every token of the row that carries loss (the tokens after it change no loss)."""
    cols = torch.arange(1, mask.size(1) + 1, device=mask.device)
    return (mask.long() * cols).amax(1) if mask.size(1) else mask.sum(1)


def cut(rows: torch.Tensor, loss_mask: torch.Tensor, prompt_mask: torch.Tensor,
        group: int) -> Cut:
    """The Cut of `rows`: as many completion columns as reach their last token with loss (at
    least one: a row kept only so that every rank runs a backward costs one column), and
    their prompts from their first real column."""
    width = max(1, int(extent(loss_mask[rows]).max()))
    first = int(prompt_mask[(rows // group) * group].any(0).int().argmax())
    return Cut(rows, width, first)


# What one more micro-batch costs beside its token positions, in token positions: each pass
# pays the whole model's fixed costs again (autocast's weight casts, the tied embedding's
# dense gradient, the gradients' accumulation): a pass's fixed cost over a position's, as
# bench/policy_plans.py measures them on SmolLM2-135M under bf16 autocast (its JSONs).
PASS_COST = 96
MAX_SPLITS = 16  # thresholds row_batches tries: each an O(rows x size) programme


def row_batches(prompt_mask: torch.Tensor, cmask: torch.Tensor, size: int, group: int,
                budget: int = 0, pass_cost: int = PASS_COST) -> list[torch.Tensor]:
    """The rows a training or reference pass pushes through the model, as index tensors of
    micro-batches of at most `size` rows; each micro-batch computes the prompts of its rows
    once. `cmask` (B, N): the tokens that carry loss; `prompt_mask` (B, P): the prompts'
    real tokens; `group` consecutive rows share a prompt.

    A micro-batch pushes (its distinct prompts x their longest) + (its rows x their longest
    completion - 1) token positions, and costs `pass_cost` more. Orders of the rows are cut
    where that sum over the plan is least (_cuts), and the cheapest plan wins (ties: the
    first): each group's rows by length, the groups by their longest, with the rows longer
    than a threshold T moved to the end, by length, for T from the longest completion
    (whole groups, each prompt computed once) down (the long rows of several groups pushed
    together, their short ones not padded to them); and rows by length (little padding
    where completions of one prompt differ widely: a random-init policy, reasoning traces;
    a prompt then computed in more than one micro-batch). `budget` > 0: no micro-batch
    pushes more token positions than that (but a row alone), which bounds a pass's
    activation memory whatever the completions' lengths. Rows with no token in `cmask`
    (left out by dynamic sampling) carry no loss and are skipped, but one is always kept so
    every rank runs a backward (DDP's all-reduce).
    """
    n = extent(cmask).tolist()
    p = prompt_mask.sum(1).tolist()
    live = [i for i, k in enumerate(n) if k] or [0]

    by_row = sorted(live, key=lambda i: (n[i], i // group))

    def split(t: int) -> list[int]:
        groups: dict[int, list[int]] = {}
        for i in by_row:
            if n[i] <= t:
                groups.setdefault(i // group, []).append(i)
        short = sorted(groups.values(), key=lambda rows: (n[rows[-1]], p[rows[0]], rows[0]))
        return [i for rows in short for i in rows] + [i for i in by_row if n[i] > t]

    lengths = sorted({n[i] for i in live}, reverse=True)
    thresholds = lengths[::max(1, len(lengths) // MAX_SPLITS)]  # at most ~MAX_SPLITS orders
    orders = [split(t) for t in thresholds] + [by_row]
    best = min((_cuts(order, n, p, group, size, budget, pass_cost) for order in orders),
               key=lambda plan: plan[0])[1]
    return [torch.tensor(b, device=cmask.device) for b in best]


def _cuts(order: list[int], n: list[int], p: list[int], group: int, size: int, budget: int,
          pass_cost: int) -> tuple[int, list[list[int]]]:
    """(cost, plan): `order` cut into consecutive micro-batches of at most `size` rows and
    `budget` positions (a row alone may exceed it) whose positions pushed, plus `pass_cost`
    each, sum to the least (dynamic programming over the cut points: O(rows x size))."""
    m = len(order)
    best, start = [0] + [-1] * m, [0] * (m + 1)  # best[j]: least cost of order[:j]
    for j in range(1, m + 1):
        prompts, longest_p, longest_n = set(), 0, 0
        for i in range(j - 1, max(j - size, 0) - 1, -1):  # the last micro-batch: order[i:j]
            r = order[i]
            prompts.add(r // group)
            longest_p, longest_n = max(longest_p, p[r]), max(longest_n, n[r])
            pushed = len(prompts) * longest_p + (j - i) * (longest_n - 1)
            if budget and pushed > budget and i < j - 1:
                break  # it only grows as the micro-batch reaches further back
            cost = best[i] + pass_cost + pushed
            if best[j] < 0 or cost < best[j]:
                best[j], start[j] = cost, i
    plan, j = [], m
    while j:
        plan.append(order[start[j]:j])
        j = start[j]
    return best[m], plan[::-1]
