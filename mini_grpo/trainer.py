"""The GRPO loop: `train_grpo(run)`, one function read top to bottom.

    python distributed_train.py --config default          # SFT -> GRPO -> eval (job.py)
    python distributed_train.py --config tiny --mode=grpo  # GRPO alone from random weights

One step, per rank (docs/architecture.md): this rank's prompts -> G completions each, sampled
with the KV cache by the unwrapped policy -> rewards -> group advantages, with the normalisers
of the global batch (one all-reduce) -> reference log-probs -> num_iterations passes over the
rollout in micro-batches with gradient accumulation -> guard, clip, AdamW -> metrics (one
collective) -> evaluation and checkpoint every eval_every / save_every steps.

The first pass's own detached log-probs are the "old" ones (ratio exactly 1, whatever the
kernels or dropout), and later passes reuse them: no extra forward pass is spent on them.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import distributed as D
from . import faults, fsdp
from .data import batch_indices, shard
from .engines import Sampling
from .evaluate import evaluate
from .grpo import LossSettings, group_advantages, grpo_loss, zero_spread
from .precision import memory_gb
from .rollout import MicroBatch, Rollout, micro_batches, score
from .state import TrainState

if TYPE_CHECKING:
    from .run import Run


def train_grpo(run: Run, resume: dict | None = None, amp: bool = True) -> TrainState:
    """GRPO steps until cfg.max_steps; run.model is trained in place. `resume`: a loaded GRPO
    checkpoint to continue from (weights, optimizer, guard, step, RNG); `amp`: the autocast
    verdict of the stage before. Returns the final state (its guard's verdict included)."""
    cfg, dist, model, task = run.cfg, run.dist, run.model, run.task
    state = TrainState(run, cfg.lr, cfg.max_steps, cfg.warmup_steps, amp=amp,
                       directory=Path(cfg.out_dir) / "checkpoints", keep=cfg.keep_checkpoints,
                       seed=cfg.seed + 1 + dist.rank)  # sampling differs by rank
    if resume is not None:
        state.restore(resume)
    if run.logger:
        run.logger.start_clock(state.current_step)
    if run.comm:
        run.comm.pop()  # the collectives of SFT, RFT and the set-up are no step's
    engine, synced = run.sampler(), -1  # -1: the engine has never had this stage's weights
    sampling = Sampling.of(cfg)
    for step in range(state.current_step + 1, cfg.max_steps + 1):
        faults.step_start(step, dist)
        t_step, times = time.perf_counter(), {}
        # ---- prompts: this rank's share of the global batch; a group never spans ranks
        idx = batch_indices(len(task.train), cfg.prompts_per_step, step - 1, cfg.seed + 1)
        rows = [task.train[i] for i in shard(idx, dist.rank, dist.world_size)
                for _ in range(cfg.group_size)]  # group-major: (B * G,)

        # ---- rollout by the engine (native: the unwrapped policy, no DDP hooks), which
        # first gets the weights if an update, a restore or the stage before changed them
        t0 = time.perf_counter()
        if state.weight_version != synced:
            engine.sync(model)
            synced = state.weight_version
        times["sync"], t0 = time.perf_counter() - t0, time.perf_counter()
        r = engine.generate([ex.model_input for ex in rows], sampling, state.gen,
                            state.autocast(generation=True))
        times["generate"], t0 = time.perf_counter() - t0, time.perf_counter()

        # ---- rewards and advantages (normalisers of the global batch)
        res = score(run.scorer, rows, r.texts, r.lengths(), cfg.max_new_tokens)
        batch = advantages(torch.tensor(res.total, dtype=torch.float32, device=run.device),
                           r.completion_mask, cfg, r.finished)
        times["reward"], t0 = time.perf_counter() - t0, time.perf_counter()

        # ---- micro-batches for every pass; reference log-probs (beta = 0: no reference)
        traj = Trajectory.of(r, batch, cfg, model)
        if run.reference is not None:
            with state.autocast():
                run.reference.fill(traj.batches, cfg.temperature, traj.pad)
        times["reference"], t0 = time.perf_counter() - t0, time.perf_counter()

        # ---- policy update: num_iterations passes, gradient accumulation over micro-batches
        if run.comm:
            run.comm.mark()  # fsdp: the gathers so far were sampling's and the reference's
        state.begin(step)
        model.train()
        stats, t_opt = StepStats.zeros(run.device), 0.0
        for _ in range(cfg.num_iterations):
            part = policy_pass(run.net, traj, cfg, state)
            faults.after_backward(step, dist, part.loss, model)
            stats += part
            t1 = time.perf_counter()
            state.step(part.loss, ~r.nonfinite)
            t_opt += time.perf_counter() - t1
        times["policy"], times["optimizer"] = time.perf_counter() - t0, t_opt

        # ---- metrics: one collective; rank 0 logs
        m = step_metrics(r, res, batch, stats, cfg, times, time.perf_counter() - t_step)
        m.update(state.metrics(), **comm_times(run.comm))
        if run.logger and step % cfg.log_every == 0:
            run.logger.scalars(step, m)
            run.logger.progress(step, {"reward": m["reward/mean"], "kl": m["kl"],
                                       "len": m["completion_len/mean"],
                                       "tok/s": m["tokens_per_s"], "rss_gb": m["mem/rss_gb"]})

        # ---- periodic evaluation (rank 0; the others wait at the next collective)
        if step % cfg.eval_every == 0 and step < cfg.max_steps:
            evaluate_step(run, step, state.guard.amp)
            synced = state.weight_version  # the evaluation gave the engine these weights
        # a checkpoint only from a step whose update went through: "restore" must go back
        # to a state from before the trouble, not to one saved during it
        if (step % cfg.save_every == 0 or step == cfg.max_steps) and state.guard.last_ok:
            state.save(step)
    return state


def evaluate_step(run: Run, step: int, amp: bool) -> None:
    """The periodic greedy evaluation: the engine takes this step's weights and every rank
    gathers them, rank 0 evaluates and logs the metrics and samples."""
    run.sync_engine()
    with fsdp.full_params(run.model):
        if run.logger:
            ev = evaluate(run, greedy=True, amp=amp)
            run.logger.scalars(step, {k: v for k, v in ev.items() if k != "samples"}, "eval/")
            run.logger.text(step, "samples", "\n\n".join(
                f"`{s['prompt']}` -> `{s['completion']}` (target `{s['target']}`)"
                for s in ev["samples"]))
    if run.comm:
        run.comm.pop()  # the evaluation's gather is not the next step's


@dataclass
class Batch:
    """The rollout's advantages and the normalisers of the global batch (all ranks)."""
    adv: torch.Tensor  # (B,) per row
    cmask: torch.Tensor  # (B, N) completion mask, less groups left out by dynamic sampling
    zero: torch.Tensor  # (B/G,) bool: groups whose rewards are all equal
    rows: torch.Tensor  # global count of rows
    reward_mean: torch.Tensor
    reward_std: torch.Tensor
    num_seqs: torch.Tensor  # sequences that carry loss (>= 1)
    num_tokens: torch.Tensor  # completion tokens that carry loss (>= 1)


def advantages(rewards: torch.Tensor, cmask: torch.Tensor, cfg,
               finished: torch.Tensor | None = None) -> Batch:
    """Group advantages and, in one all-reduce, the counts and reward moments of the global
    batch, so N ranks normalise exactly as one process holding the whole batch would.
    `finished` (B,): rows that ended with EOS; with mask_truncated the others carry no loss
    (their rewards still shape their group's advantages)."""
    G = cfg.group_size
    zero = zero_spread(rewards, G)
    if cfg.dynamic_sampling:  # zero-spread groups carry no signal: leave them out
        cmask = cmask & (~zero).repeat_interleave(G)[:, None]
    if cfg.mask_truncated and finished is not None:  # DAPO: cut-off rows teach nothing
        cmask = cmask & finished[:, None]
    n_seqs = cmask.any(1).sum() if cfg.dynamic_sampling or cfg.mask_truncated else \
        torch.tensor(len(rewards))
    n, s1, s2, seqs, tokens = D.all_reduce_sum(torch.stack([
        torch.tensor(float(len(rewards)), device=rewards.device), rewards.sum(),
        rewards.square().sum(), n_seqs.to(rewards.device).float(), cmask.sum().float()]))
    mean = s1 / n
    std = (s2 / n - mean**2).clamp(min=0).sqrt()
    adv = group_advantages(rewards, G, cfg.scale_rewards, batch_std=std)
    return Batch(adv, cmask, zero, n, mean, std, seqs.clamp(min=1), tokens.clamp(min=1))


@dataclass
class StepStats:
    """A step's sums over micro-batches and passes (and, reduced, over ranks)."""
    loss: torch.Tensor  # the passes' losses (each the whole batch's, by its normalisers)
    kl: torch.Tensor  # the loss statistics times their micro-batch's tokens (token sums)
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    ratio: torch.Tensor
    entropy: torch.Tensor
    engine_diff: torch.Tensor
    engine_kl: torch.Tensor
    positions: torch.Tensor  # token positions pushed through the model, padding included
    real: torch.Tensor  # the real tokens among them (each prompt counted once)

    @classmethod
    def zeros(cls, device) -> StepStats:
        return cls(*torch.zeros(len(fields(cls)), device=device))

    def __iadd__(self, other: StepStats) -> StepStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


@dataclass
class Trajectory:
    """A step's rows as the policy passes take them: micro-batches that carry their own
    advantages and engine, reference and old log-probs (rollout.MicroBatch), the global
    batch's normalisers, and `pad`, the passes with no loss that keep fsdp's ranks in step."""
    batches: list[MicroBatch]
    num_seqs: torch.Tensor
    num_tokens: torch.Tensor
    pad: int = 0

    @classmethod
    def of(cls, r: Rollout, batch: Batch, cfg, model=None) -> Trajectory:
        """The rollout cut into micro-batches of `cfg`; `model`: the policy, for fsdp's pad."""
        batches = micro_batches(r, batch.cmask, cfg.micro_batch_size, cfg.group_size,
                                batch.adv, cfg.micro_batch_tokens)
        pad = 0 if model is None else fsdp.pad_passes(model, len(batches), batch.adv.device)
        return cls(batches, batch.num_seqs, batch.num_tokens, pad)


def policy_pass(net, traj: Trajectory, cfg, state: TrainState | None = None) -> StepStats:
    """One pass over the trajectory's micro-batches, accumulating the gradient of its GRPO
    loss (through `state`: its autocast and loss scaling; without one, fp32 and a plain
    backward).

    The first pass's own detached log-probs become each micro-batch's `old_logp` (ratio
    exactly 1); later passes (num_iterations) reuse them. The normalisers are the global
    batch's, so the gradients summed over micro-batches and ranks are those of one process
    holding the whole batch; DDP averages over ranks, hence the factor world size. The
    engine's log-probs are compared with the old ones (and under vllm corrected:
    grpo.engine_is_weight). All micro-batches but the last skip DDP's all-reduce (no_sync).
    `traj.pad` extra passes over the last micro-batch carry no loss: under fsdp they keep
    the ranks' collectives in step. Returns the pass's StepStats.
    """
    settings, world, batches = LossSettings.of(cfg), D.world_size(), traj.batches
    autocast = state.autocast if state is not None else nullcontext
    backward = state.backward if state is not None else torch.Tensor.backward
    stats = StepStats.zeros(traj.num_tokens.device)
    for j, mb in enumerate(batches):
        last = j == len(batches) - 1
        with net.no_sync() if not last and hasattr(net, "no_sync") else nullcontext():
            with autocast():
                logp, ent = mb.logprobs(net, cfg.temperature, entropy=True)
            if mb.old_logp is None:
                mb.old_logp = logp.detach()
            loss, st = grpo_loss(logp, mb.old_logp, mb.adv, mb.mask, settings,
                                 ref_logp=mb.ref_logp, entropy=ent, num_seqs=traj.num_seqs,
                                 num_tokens=traj.num_tokens, engine_logp=mb.engine_logp)
            backward(loss * world)
        k = mb.mask.sum()
        pushed, real = mb.positions()
        pushed, real = torch.tensor([pushed, real], dtype=torch.float32, device=k.device)
        stats += StepStats(loss=loss.detach(), positions=pushed, real=real,
                           **{name: v * k for name, v in st._asdict().items()})
    for _ in range(traj.pad):
        with autocast():
            nothing = batches[-1].logprobs(net, cfg.temperature).sum() * 0.0
        backward(nothing)
    return stats


def comm_times(comm) -> dict[str, float]:
    """The step's seconds in collectives: the policy update's (DDP's all-reduce, FSDP's
    gathers and reduce-scatters) and, under fsdp, sampling's and the reference's before it."""
    before, after = comm.pop() if comm else (0.0, 0.0)
    return {"time/comm_rollout": before, "time/comm": after}


def step_metrics(r: Rollout, res, batch: Batch, stats: StepStats, cfg, times: dict,
                 seconds: float) -> dict:
    """The step's metrics over all ranks, from one collective (D.reduce_named)."""
    lengths = r.completion_mask.sum(1).float()
    sums = {**{f"acc/{f.name}": getattr(stats, f.name) for f in fields(stats)},
            "len": lengths.sum(), "zero": batch.zero.float().sum(),
            "truncated": (~r.finished).float().sum(),
            "groups": float(batch.zero.numel()), "prompt_tokens": r.prompt_mask.sum().float()}
    for k, col in res.columns.items():  # per plugin, over all ranks' rows
        col = torch.as_tensor(col, dtype=torch.float64)
        sums[f"{k}/s1"], sums[f"{k}/s2"] = col.sum(), col.square().sum()
    mem = memory_gb(r.completion_mask.device)  # the most any rank holds
    red = D.reduce_named(sums, {"len_max": lengths.max(), **mem})
    acc = {f.name: red[f"acc/{f.name}"] for f in fields(stats)}
    iters = cfg.num_iterations
    tok = batch.num_tokens.item() * iters
    n = batch.rows.item()
    m = {"reward/mean": batch.reward_mean.item(), "reward/std": batch.reward_std.item(),
         "loss": acc["loss"] / iters, "kl": acc["kl"] / tok, "clip_low": acc["clip_low"] / tok,
         "clip_high": acc["clip_high"] / tok, "ratio": acc["ratio"] / tok,
         "entropy": acc["entropy"] / tok,
         # the rollout engine's log-probs against the trainer's (the first pass's, per token)
         "engine/logp_diff": acc["engine_diff"] / tok, "engine/kl": acc["engine_kl"] / tok,
         "completion_len/mean": red["len"] / n, "completion_len/max": red["len_max"],
         "zero_spread_frac": red["zero"] / red["groups"], "tokens_per_s": red["len"] / seconds,
         "truncated_frac": red["truncated"] / n,  # rows that hit max_new_tokens without EOS
         # per policy pass: token positions through the model (padding included), and
         # the real tokens among them (each prompt counted once per group)
         "tokens/processed": acc["positions"] / iters, "tokens/unique": acc["real"] / iters,
         "tokens/train": batch.num_tokens.item() + red["prompt_tokens"]}
    for k in res.columns:
        mean = red[f"{k}/s1"] / n
        m[f"reward/{k}/mean"] = mean
        m[f"reward/{k}/std"] = max(red[f"{k}/s2"] / n - mean**2, 0.0) ** 0.5
    m.update({f"time/{k}": v for k, v in times.items()})
    m["time/step"] = seconds
    m.update({k: red[k] for k in mem})
    # scorer health (this rank's): seconds and failed rows per plugin
    m.update(res.metrics)
    return m
