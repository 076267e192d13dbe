"""The micro-batch planner: which rows go through the model together, and the columns they
need. GRPO's passes (`row_batches`, `cut`: whole groups, each prompt once, under a token
budget) and SFT's steps (`plan_micro_batches`: by length) follow its plans; the Trajectory
holds GRPO's (trajectory.py), a record of what to compute, not how it is cut.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
