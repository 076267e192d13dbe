"""The GRPO loop: `train_grpo(run)`, one function read top to bottom.

    python distributed_train.py --config default          # SFT -> GRPO -> eval (job.py)
    python distributed_train.py --config tiny --mode=grpo  # GRPO alone from random weights

One step, per rank (docs/architecture.md): this rank's prompts -> G completions each, sampled
by the engine -> rewards -> the step's Trajectory (trajectory.py: group advantages, the
normalisers of the global batch in one all-reduce, the micro-batch plan) -> reference
log-probs -> num_iterations passes over it in micro-batches with gradient accumulation ->
guard, clip, AdamW -> metrics (one collective) -> evaluation and checkpoint every eval_every /
save_every steps.

The first pass's own detached log-probs are the "old" ones (ratio exactly 1, whatever the
kernels or dropout), and later passes reuse them: no extra forward pass is spent on them.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import distributed as D
from . import faults
from .advantages import signal_first, zero_spread
from .data import batch_indices, shard
from .engines import Sampling
from .engines.turns import COUNTS
from .evaluate import evaluate
from .grpo import LossSettings, grpo_loss, kl_reward_penalty
from .precision import memory_gb, release_freed_memory
from .progress import Laps
from .scoring import score
from .state import TrainState
from .trajectory import Trajectory

if TYPE_CHECKING:
    from .run import Run


def train_grpo(run: Run, resume: dict | None = None, amp: bool = True,
               limit: TimeLimit | None = None, source: str = "checkpoint") -> TrainState:
    """GRPO steps until cfg.max_steps, or until rank 0's `limit` (cfg.max_minutes) leaves
    no room for another; run.model is trained in place. `resume`: a loaded GRPO checkpoint
    to continue from (weights, optimizer, guard, step, RNG), read from `source` (its path,
    which its errors name); `amp`: the autocast verdict of the stage before. Returns the
    final state (its guard's verdict, its last step)."""
    cfg, dist, model, task = run.cfg, run.dist, run.model, run.task
    state = TrainState(run, cfg.lr, cfg.max_steps, cfg.warmup_steps, amp=amp,
                       directory=Path(cfg.out_dir) / "checkpoints", keep=cfg.keep_checkpoints,
                       seed=cfg.seed + 1 + dist.rank)  # sampling differs by rank
    if resume is not None:
        state.restore(resume, source)
    if run.logger:
        run.logger.start_clock(state.current_step)
    if run.comm:
        run.comm.pop()  # the collectives of SFT, RFT and the set-up are no step's
    engine, sampling = run.sampler(), Sampling.of(cfg)
    release_freed_memory(run.device)  # the stages before: their blocks, not this one's
    for step in range(state.current_step + 1, cfg.max_steps + 1):
        faults.step_start(step, dist)
        t_step, lap = time.perf_counter(), Laps()
        rows = step_rows(task.train, cfg, dist, step)  # this rank's prompts, G rows each

        # ---- rollout by the engine (native: the unwrapped policy, no DDP hooks), which
        # first gets the weights if an update, a restore or the stage before changed them
        lap.start()
        run.sync_engine()
        lap("sync")
        r = engine.generate([ex.model_input for ex in rows], sampling, state.gen,
                            state.autocast(generation=True))
        lap("generate")

        # ---- rewards; the step's record: advantages, global normalisers, micro-batch plan
        res = score(run.scorer, rows, r.texts, r.lengths(), cfg.max_new_tokens,
                    r.conversations, r.env_rewards)
        rows, r, res, sampled = keep_signal(rows, r, res, cfg, dist)
        traj = Trajectory.of(r, torch.tensor(res.total, dtype=torch.float32,
                                             device=run.device), cfg, model)
        lap("reward")

        # ---- reference log-probs (beta = 0: no reference)
        traj = with_reference(run, traj, r, state)
        lap("reference")

        # ---- policy update: num_iterations passes, gradient accumulation over micro-batches
        traj, stats, lap.times["optimizer"] = update(run, traj, state, step)
        lap("policy")

        # ---- metrics: one collective, which also brings rank 0's verdict on the time limit
        seconds = time.perf_counter() - t_step
        late = None if not cfg.max_minutes else \
            limit is not None and step < cfg.max_steps and not limit.next_fits(seconds)
        m = step_metrics(traj, res, stats, cfg, lap.times, seconds, late, sampled)
        last = step == cfg.max_steps or bool(m.get("time/limit_reached"))
        m.update(state.metrics(), **comm_times(run.comm))
        # the last step is logged whatever log_every: the row the final checkpoint and the
        # time limit's verdict (time/limit_reached) belong to
        if run.logger and (step % cfg.log_every == 0 or last):
            run.logger.scalars(step, m)
            run.logger.progress(step, {"reward": m["reward/mean"], "kl": m["kl"],
                                       "len": m["completion_len/mean"],
                                       "tok/s": m["tokens_per_s"], "rss_gb": m["mem/rss_gb"]},
                                  limit.left() if limit is not None else None)

        # ---- periodic evaluation (rank 0; the others wait at the next collective)
        if step % cfg.eval_every == 0 and not last:
            evaluate_step(run, step, state.guard.amp)
        # a checkpoint only from a step whose update went through: "restore" must go back
        # to a state from before the trouble, not to one saved during it
        if (step % cfg.save_every == 0 or last) and state.guard.last_ok:
            state.save(step)
        if last and step < cfg.max_steps:  # rank 0's limit ended it: rank 0 says why
            if run.logger and limit is not None:
                run.logger.event(step, limit.why())
            break
    return state


def step_rows(train: list, cfg, dist, step: int) -> list:
    """This rank's share of step `step`'s prompts (a group never spans ranks), each
    group_size times, group-major: (B * G,); dynamic_sampling_factor k draws k times as
    many (keep_signal then chooses)."""
    idx = batch_indices(len(train), cfg.prompts_per_step * cfg.dynamic_sampling_factor,
                        step - 1, cfg.seed + 1)
    return [train[i] for i in shard(idx, dist.rank, dist.world_size)
            for _ in range(cfg.group_size)]


def with_reference(run: Run, traj: Trajectory, r, state: TrainState) -> Trajectory:
    """`traj` with the reference's log-probs (none with beta 0), and with kl_in_reward the
    advantages of its rewards less beta x each row's KL (rollout `r`'s)."""
    if run.reference is None:
        return traj
    cfg = run.cfg
    with state.autocast():
        traj = traj.replace(ref_logp=run.reference.logprobs_of(traj))
    if cfg.kl_in_reward:
        traj = traj.penalised(r, kl_reward_penalty(
            traj.sampling_logp, traj.ref_logp, traj.completion_mask, cfg.beta,
            cfg.kl_estimator), cfg, run.model)
    return traj


def update(run: Run, traj: Trajectory, state: TrainState, step: int):
    """num_iterations policy passes over `traj`, each followed by the guarded optimizer step
    -> (the trajectory with the first pass's log-probs as the old ones, the passes' summed
    StepStats, the seconds in the optimizer)."""
    if run.comm:
        run.comm.mark()  # fsdp: the gathers so far were sampling's and the reference's
    state.begin(step)
    run.model.train()
    stats, t_opt = StepStats.zeros(run.device), 0.0
    for _ in range(run.cfg.num_iterations):
        part, old = policy_pass(run.net, traj, run.cfg, state)
        traj = traj.replace(old_logp=old)  # the later passes' ratios are against it
        faults.after_backward(step, run.dist, part.loss, run.model)
        stats += part
        t1 = time.perf_counter()
        state.step(part.loss, ~traj.nonfinite)
        t_opt += time.perf_counter() - t1
    return traj, stats, t_opt


def keep_signal(rows: list, r, res, cfg, dist):
    """dynamic_sampling_factor k > 1: of this rank's k x its share of groups, its share, those
    whose rewards differ first (advantages.signal_first) -> (rows, rollout, scores, the sums
    over all it sampled for the metrics); k = 1: all as they are, and no sums."""
    if cfg.dynamic_sampling_factor == 1:
        return rows, r, res, None
    total = torch.as_tensor(res.total, dtype=torch.float32)
    G = cfg.group_size
    keep = signal_first(total, G, len(shard(range(cfg.prompts_per_step), dist.rank,
                                            dist.world_size)))
    sampled = {"sampled/reward": total.sum().double(), "sampled/rows": float(len(total)),
               "sampled/zero": zero_spread(total, G).sum().double(),
               "sampled/groups": float(len(total) // G)}
    return [rows[i] for i in keep], r.take(keep), res.take(keep), sampled


@dataclass
class TimeLimit:
    """cfg.max_minutes on rank 0: the run must be over by `end` (time.monotonic()), and
    `reserve` seconds of it are kept for what follows GRPO (the final evaluation, the
    export). A step is taken only if one as long as the slowest of the last few still ends
    in time: answers, and with them steps, grow as GRPO trains."""
    end: float
    reserve: float
    recent: list = field(default_factory=list)  # the last steps' seconds

    def next_fits(self, seconds: float) -> bool:
        """After a step of `seconds`: does one more fit?"""
        self.recent = [*self.recent, seconds][-3:]
        return max(self.recent) <= self.left()

    def left(self) -> float:
        """Seconds GRPO has left before what follows it must start."""
        return self.end - self.reserve - time.monotonic()

    def why(self) -> str:
        left = self.end - time.monotonic()
        return (f"max_minutes: GRPO stops here, {left / 60:.1f} min before the limit: another "
                f"step (~{max(self.recent):.0f} s) and the final evaluation ({self.reserve:.0f} s "
                f"kept for it) would not fit")


def evaluate_step(run: Run, step: int, amp: bool) -> None:
    """The periodic greedy evaluation: the engine takes this step's weights and every rank
    gathers them, rank 0 evaluates and logs the metrics and samples."""
    with run.rank0_with_weights() as main:
        if main and run.logger:
            ev = evaluate(run, greedy=True, amp=amp)
            run.logger.scalars(step, {k: v for k, v in ev.items() if k != "samples"}, "eval/")
            run.logger.text(step, "samples", "\n\n".join(
                f"`{s['prompt']}` -> `{s['completion']}` (target `{s['target']}`)"
                for s in ev["samples"]))
    if run.comm:
        run.comm.pop()  # the evaluation's gather is not the next step's


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
    tokens: torch.Tensor  # the tokens with loss the passes carried (the statistics' divisor)
    positions: torch.Tensor  # token positions pushed through the model, padding included
    real: torch.Tensor  # the real tokens among them (each prompt counted once)

    @classmethod
    def zeros(cls, device) -> StepStats:
        return cls(*torch.zeros(len(fields(cls)), device=device))

    def __iadd__(self, other: StepStats) -> StepStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


def policy_pass(net, traj: Trajectory, cfg,
                state: TrainState | None = None) -> tuple[StepStats, torch.Tensor]:
    """One pass over the trajectory's micro-batches, accumulating the gradient of its GRPO
    loss (through `state`: its autocast and loss scaling; without one, fp32 and a plain
    backward). Returns the pass's StepStats and the old log-probs (B, N) it used.

    Without the trajectory's `old_logp`, the pass's own detached log-probs are the old ones
    (ratio exactly 1), and the caller hands them to later passes (num_iterations). The
    normalisers are the global batch's, so the gradients summed over micro-batches and ranks
    are those of one process holding the whole batch; DDP averages over ranks, hence the
    factor world size. The engine's log-probs are compared with the old ones (and under vllm
    corrected: grpo.engine_is_weight). All micro-batches but the last skip DDP's all-reduce
    (no_sync).
    `traj.pad` extra passes over the last micro-batch carry no loss: under fsdp they keep
    the ranks' collectives in step.
    """
    settings, world, batches = LossSettings.of(cfg), D.world_size(), traj.micro_batches()
    autocast = state.autocast if state is not None else nullcontext
    backward = state.backward if state is not None else torch.Tensor.backward
    stats, olds = StepStats.zeros(traj.num_tokens.device), []
    with state.cast_once(net) if state is not None else nullcontext():
        for j, mb in enumerate(batches):
            last = j == len(batches) - 1
            with net.no_sync() if not last and hasattr(net, "no_sync") else nullcontext():
                with autocast():
                    logp, ent = mb.logprobs(net, entropy=True)
                old = logp.detach() if mb.old_logp is None else mb.old_logp
                olds.append(old)
                loss, st = grpo_loss(logp, old, mb.adv, mb.loss_mask, settings,
                                     ref_logp=mb.ref_logp, entropy=ent, num_seqs=traj.num_seqs,
                                     num_tokens=traj.num_tokens, num_rows=traj.num_rows,
                                     engine_logp=mb.engine_logp)
                backward(loss * world)
            k = mb.loss_mask.sum()
            pushed, real = mb.positions()
            pushed, real = torch.tensor([pushed, real], dtype=torch.float32, device=k.device)
            stats += StepStats(loss=loss.detach(), tokens=k.float(), positions=pushed,
                               real=real, **{name: v * k for name, v in st._asdict().items()})
        for _ in range(traj.pad):
            with autocast():
                nothing = batches[-1].logprobs(net).sum() * 0.0
            backward(nothing)
    return stats, traj.old_logp if traj.old_logp is not None else traj.assemble(olds)


def comm_times(comm) -> dict[str, float]:
    """The step's seconds in collectives: the policy update's (DDP's all-reduce, FSDP's
    gathers and reduce-scatters) and, under fsdp, sampling's and the reference's before it."""
    before, after = comm.pop() if comm else (0.0, 0.0)
    return {"time/comm_rollout": before, "time/comm": after}


def step_metrics(traj: Trajectory, res, stats: StepStats, cfg, times: dict,
                 seconds: float, late: bool | None = None, sampled: dict | None = None) -> dict:
    """The step's metrics over all ranks, from one collective (D.reduce_named). `late`:
    whether this rank finds no room for another step (None: no time limit); any rank's
    verdict ends GRPO on all of them (time/limit_reached). `sampled`: keep_signal's sums over
    all it drew (the kept rows' reward is biased toward groups with signal)."""
    lengths = traj.completion_mask.sum(1).float()
    sums = {**{f"acc/{f.name}": getattr(stats, f.name) for f in fields(stats)},
            "len": lengths.sum(), "zero": traj.zero_spread.float().sum(),
            "truncated": (~traj.finished).float().sum(),
            "groups": float(traj.zero_spread.numel()),
            "prompt_tokens": traj.prompt_mask.sum().float(), **(sampled or {})}
    if traj.turn_counts is not None:  # multi-turn: the same on every rank (the config's)
        for k, col in zip(COUNTS, traj.turn_counts.T):
            sums[f"turns/{k}"] = col.sum()
    for k, col in res.columns.items():  # per plugin, over all ranks' rows
        col = torch.as_tensor(col, dtype=torch.float64)
        sums[f"{k}/s1"], sums[f"{k}/s2"] = col.sum(), col.square().sum()
    mem = memory_gb(traj.completion_mask.device)  # the most any rank holds
    late_ = {} if late is None else {"late": float(late)}
    red = D.reduce_named(sums, {"len_max": lengths.max(), **mem, **late_})
    acc = {f.name: red[f"acc/{f.name}"] for f in fields(stats)}
    iters = cfg.num_iterations
    tok = max(acc["tokens"], 1.0)  # those the passes carried (Trajectory.of's plan)
    n = traj.num_rows.item()
    m = {"reward/mean": traj.reward_mean.item(), "reward/std": traj.reward_std.item(),
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
         "tokens/train": traj.num_tokens.item() + red["prompt_tokens"]}
    if traj.turn_counts is not None:  # per row: tool calls, rounds; shares of rows
        m.update({"tools/calls": red["turns/calls"] / n, "tools/rounds": red["turns/rounds"] / n,
                  "tools/failed_frac": red["turns/failed"] / max(red["turns/calls"], 1.0),
                  "tools/capped_frac": red["turns/capped"] / n,
                  "tools/broken_frac": red["turns/broken"] / n})
    for k in res.columns:
        mean = red[f"{k}/s1"] / n
        m[f"reward/{k}/mean"] = mean
        m[f"reward/{k}/std"] = max(red[f"{k}/s2"] / n - mean**2, 0.0) ** 0.5
    if sampled:  # all the groups drawn, before keep_signal chose among them
        m["reward/sampled_mean"] = red["sampled/reward"] / red["sampled/rows"]
        m["zero_spread_frac/sampled"] = red["sampled/zero"] / red["sampled/groups"]
    m.update({f"time/{k}": v for k, v in times.items()})
    m["time/step"] = seconds
    if late is not None:
        m["time/limit_reached"] = red["late"]
    m.update({k: red[k] for k in mem})
    # scorer health (this rank's): seconds and failed rows per plugin
    m.update(res.metrics)
    return m
