"""AdamW with nanoGPT's weight-decay groups, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch.autograd.graph import increment_version

from .fields import show


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                   betas=(0.9, 0.99), fused: bool = True, eps: float = 1e-8) -> torch.optim.AdamW:
    """Decay matrices only (not biases, LayerNorm or embeddings' 1-D params).

    eps: AdamW's floor under each coordinate's gradient scale: a coordinate whose gradients
    are far below it moves far less than `lr` a step (an RL gradient is mostly noise on most
    coordinates, which the default 1e-8 moves as far as those that carry the signal).
    fused=True: the fused AdamW kernel (CUDA, and CPU in torch >= 2.4); False: the plain
    per-parameter loop (no foreach), the slow baseline benchmark.py compares against.

    Every step that goes through moves its parameters' version counters, as any in-place
    op does: the fused kernel alone does not (torch 2.13), and an engine that keeps a copy
    of the weights tells by them whether it has something to sync (engines.WeightsSeen). A
    step the fp16 GradScaler skipped inside the fused kernel (`found_inf`) moves none.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if fused:
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    else:
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
    opt.register_step_post_hook(_written)
    return opt


def _written(opt: torch.optim.Optimizer, args, kwargs) -> None:
    found_inf = getattr(opt, "found_inf", None)  # set by GradScaler for the fused kernel
    if found_inf is not None and bool(found_inf):
        return
    for g in opt.param_groups:
        for p in g["params"]:
            increment_version(p)  # one at a time: a list needs torch >= 2.5


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to min_ratio * base_lr at `total`.

    `step` counts from 1 (the step about to be taken).
    """
    if warmup > 0 and step <= warmup:
        return base_lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


# ---- what a step did

class UpdateProbe:
    """The update's relative size, ||delta theta|| / ||theta||, of each optimizer step: the
    entries of a fixed random sample of each trained weight (all of a small one's; 4096 plus
    1/64 of a large one's, weighted back to the whole) are read before the step and after, so
    it is what the step did, whatever the optimizer (a fused kernel, a skipped fp16 step).
    Its own generator: the run's random streams are untouched. A sharded weight is sampled in
    this rank's shard: the sums are this rank's, to be summed over ranks."""

    def __init__(self, params, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.parts = []  # (weight, sampled flat indices or None for all, weight of the sample)
        for p in params:
            n = _local(p).numel()
            k = min(n, 4096 + n // 64)
            idx = None if k == n else torch.randint(n, (k,), generator=gen).to(p.device)
            self.parts.append((p, idx, n / max(k, 1)))

    def read(self) -> list[torch.Tensor]:
        """The sampled entries now, in fp32."""
        with torch.no_grad():
            return [(f if idx is None else f[idx]).float().clone() for f, idx in
                    ((_local(p).detach().reshape(-1), idx) for p, idx, _ in self.parts)]

    def sums(self, before: list[torch.Tensor]) -> torch.Tensor:
        """[sum of delta^2, sum of theta^2] (fp64), estimated over the whole weights, from
        `before` (read()) to now."""
        out = torch.zeros(2, dtype=torch.float64)
        for x0, x1, (_, _, w) in zip(before, self.read(), self.parts):
            out[0] += w * (x1 - x0).double().square().sum().cpu()
            out[1] += w * x1.double().square().sum().cpu()
        return out


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


# ---- a saved state, read as untrusted input

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's per-parameter tensors
# flags a saved group keeps as this optimizer has them: amsgrad needs another moment,
# capturable and differentiable kernels one of ours may not have (CPU, fused)
FIXED_FLAGS = ("amsgrad", "capturable", "differentiable")
UNSET_FLAGS = ("foreach", "fused")  # None: torch picks
FLOAT32 = torch.finfo(torch.float32)  # what the kernels compute the groups' numbers in
# a group's numbers at most: the config's lr bound. lr / (1 - beta1**step) overflowed float32
# from lr = 6.5e37 (an exception in the step); an eps float32 holds as 0 made 0 / 0 = NaN
# of a moment no gradient wrote
MAX_GROUP_NUMBER = 1e6


def check_state(opt: torch.optim.Optimizer, state) -> None:
    """An optimizer state as `opt.state_dict()` writes it (by parameter index) or as DCP reads
    it (by name), checked against `opt` before any of it is loaded: torch checks none of it,
    and an `exp_avg` of another shape made the fused (and the foreach) AdamW kernel read out
    of bounds, a segfault on the next step. Every group's keys known and its values of the
    type `opt`'s have, finite; every entry of a parameter of this model, with its step and
    moments, each of the parameter's shape and dtype, finite. ValueError naming the entry."""
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
            and isinstance(state.get("param_groups"), list)):
        raise ValueError("optimizer: not an optimizer state torch writes (a dict of 'state' "
                         "and 'param_groups')")
    saved, now = state["param_groups"], opt.param_groups
    if len(saved) != len(now) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            and len(g["params"]) == len(h["params"]) for g, h in zip(saved, now)):
        raise ValueError(f"optimizer.param_groups: other parameter groups than this model's "
                         f"({[len(h['params']) for h in now]} parameters)")
    params: dict = {}  # saved key -> this model's parameter, paired in order as torch does
    for i, (g, h) in enumerate(zip(saved, now)):
        for key, value in g.items():
            if key != "params":  # a key of ours is a name; another is shown as it is
                _check_group_value(f"optimizer.param_groups[{i}]" + (
                    f".{key}" if isinstance(key, str) and key.isidentifier()
                    else f"[{show(key)}]"), value, h, key)
        # torch fills in a missing flag (an older torch's group), not a missing number
        missing = [k for k, v in h.items() if k not in g and not (v is None or
                                                                isinstance(v, bool))]
        if missing:
            raise ValueError(f"optimizer.param_groups[{i}]: has no {missing[0]!r}")
        for k, p in zip(g["params"], h["params"]):
            if not isinstance(k, int | str) or isinstance(k, bool) or k in params:
                raise ValueError(f"optimizer.param_groups[{i}].params: {show(k)} is not a "
                                 f"parameter's index (or name), once")
            params[k] = p
    amsgrad = any(h.get("amsgrad") for h in now)
    for k, entry in state["state"].items():
        where = f"optimizer.state[{show(k)}]"
        if k not in params or not isinstance(entry, dict):
            raise ValueError(f"{where}: not a dict of a parameter the groups list")
        p, want = params[k], {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"}
                                                                 if amsgrad else set())
        if set(entry) != want:
            raise ValueError(f"{where}: holds {show(sorted(map(str, entry)))}, AdamW's are "
                             f"{sorted(want)}")
        step = entry["step"]
        if isinstance(step, torch.Tensor):
            step = step.item() if step.numel() == 1 and step.is_floating_point() else None
        if not _number(step) or step < 0:
            raise ValueError(f"{where}.step: must be a finite number >= 0")
        for name in want - {"step"}:
            t = entry[name]
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                got = (f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"{where}.{name}: must be a {p.dtype} tensor of its "
                                 f"parameter's shape {list(p.shape)}, got {got}")
            local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this shard
            if not torch.isfinite(local).all() or (name != "exp_avg" and (local < 0).any()):
                raise ValueError(f"{where}.{name}: holds values that are not finite"
                                 + ("" if name == "exp_avg" else " and >= 0"))


def _number(x) -> bool:
    """A number float32 holds (a huge int too: compared, never converted)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and abs(x) <= FLOAT32.max


def _check_group_value(where: str, value, group: dict, key: str) -> None:
    """A saved param group's value against this optimizer's value of `key`: a flag stays a
    bool (or None, where torch picks: UNSET_FLAGS), one of FIXED_FLAGS ours; a number is in
    [0, MAX_GROUP_NUMBER] (eps a normal float32 > 0); a tuple (betas) is as long, of numbers
    in [0, 1)."""
    if key not in group:
        raise ValueError(f"{where}: not a key of this optimizer's groups")
    ours = group[key]
    if ours is None or isinstance(ours, bool):
        ok = (isinstance(value, bool) and (key not in FIXED_FLAGS or value == bool(ours))
              or value is None and key in UNSET_FLAGS)
    elif isinstance(ours, tuple):
        ok = isinstance(value, tuple | list) and len(value) == len(ours) and all(
            _number(x) and 0 <= x < 1 for x in value)
    elif _number(ours):
        ok = _number(value) and 0 <= value <= MAX_GROUP_NUMBER and (
            key != "eps" or value >= FLOAT32.tiny)
    else:  # a kind of value this check does not know: it must be the same
        ok = type(value) is type(ours) and value == ours
    if not ok:
        raise ValueError(f"{where}: {show(value)} is not a value it takes (this optimizer's: "
                         f"{ours!r})")
