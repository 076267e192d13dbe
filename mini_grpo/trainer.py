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
from dataclasses import dataclass
from pathlib import Path

import torch

from . import distributed as D
from . import fsdp
from .checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .data import batch_indices, shard
from .evaluate import evaluate
from .faults import inject_fault, poison_gradients
from .grpo import group_advantages, grpo_loss
from .guards import Guard, params_finite
from .logprobs import completion_logprobs
from .optim import lr_at, make_optimizer, set_lr
from .rollout import micro_batches, sample, scored_metas


def train_grpo(run, resume: dict | None = None) -> None:
    """GRPO steps until cfg.max_steps; run.model is trained in place. `resume` is a loaded
    GRPO checkpoint whose optimizer, guard, step and RNG states continue here (job.py has
    already put its weights into the model)."""
    cfg, dist, model, task, device = run.cfg, run.dist, run.model, run.task, run.device
    G, W = cfg.group_size, dist.world_size
    guard = Guard(cfg.guard_patience, amp=run.precision.dtype is not None
                  or run.precision.generation_dtype is not None)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, fused=cfg.fused_optimizer)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1 + dist.rank)  # differs by rank
    start = _continue_from(resume, guard, model, opt, gen, dist) if resume is not None else 0
    scaler = run.precision.scaler(guard.amp)
    if resume is not None and resume.get("scaler"):
        scaler.load_state_dict(resume["scaler"])
    ckpt_dir = Path(cfg.out_dir) / "checkpoints"

    def restore() -> str:  # the guard's "restore" rung
        path, state = latest_checkpoint(ckpt_dir)
        resume_weights(model, state, opt)
        return str(path)

    if run.logger:
        run.logger.start_clock(start)
    if run.comm:
        run.comm.pop()  # the collectives of SFT, RFT and the set-up are no step's
    for step in range(start + 1, cfg.max_steps + 1):
        inject_fault(step, dist)
        t_step, times = time.perf_counter(), {}
        # ---- prompts: this rank's share of the global batch; a group never spans ranks
        idx = batch_indices(len(task.train), cfg.prompts_per_step, step - 1, cfg.seed + 1)
        exs = [task.train[i] for i in shard(idx, dist.rank, W)]
        rows = [ex for ex in exs for _ in range(G)]  # group-major: (B * G,)

        # ---- rollout with the unwrapped policy (no DDP hooks)
        t0 = time.perf_counter()
        with fsdp.full_params(model), run.precision.autocast(generation=True, enabled=guard.amp):
            r = sample(model, run.tok, [ex.model_input for ex in rows], cfg.max_new_tokens,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                       generator=gen, use_cache=cfg.kv_cache)
        times["generate"] = time.perf_counter() - t0

        # ---- rewards and advantages (normalisers of the global batch)
        t0 = time.perf_counter()
        res = run.scorer.score([ex.prompt for ex in rows], r.texts, [ex.target for ex in rows],
                               scored_metas([ex.meta for ex in rows], r.lengths(),
                                            cfg.max_new_tokens))
        rewards = torch.tensor(res.total, dtype=torch.float32, device=device)
        times["reward"] = time.perf_counter() - t0
        batch = advantages(rewards, r.completion_mask, cfg, r.finished)

        # ---- reference log-probs (beta = 0 skips the reference entirely)
        t0 = time.perf_counter()
        batches = micro_batches(r, batch.cmask, cfg.micro_batch_size, G)  # for both passes
        # fsdp: every forward and backward is a collective, so ranks run as many as the
        # busiest one (extra passes carry no loss)
        pad = int(D.all_reduce_max(torch.tensor([len(batches)], device=device)).item()) \
            - len(batches) if run.sharded else 0
        ref_lp = torch.zeros_like(r.logprobs)
        if run.reference is not None:
            for rows_, pids, pm, index, cids, cm in batches:
                with run.precision.autocast(enabled=guard.amp):
                    ref_lp[rows_, :cids.size(1)] = run.reference.logprobs(
                        pids, pm, cids, cm, cfg.temperature, index)
            for _ in range(0 if cfg.offload_reference else pad):
                with run.precision.autocast(enabled=guard.amp):  # fsdp: as many as the others
                    run.reference.logprobs(pids, pm, cids, cm, cfg.temperature, index)
        times["reference"] = time.perf_counter() - t0

        # ---- policy update: num_iterations passes, gradient accumulation over micro-batches
        t0 = time.perf_counter()
        if run.comm:
            run.comm.mark()  # fsdp: the gathers so far were sampling's and the reference's
        lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.max_steps) * guard.lr_scale
        set_lr(opt, lr)
        model.train()
        acc, old, t_opt = torch.zeros(8, device=device), None, 0.0
        for _ in range(cfg.num_iterations):
            part, old = policy_pass(run.net, batches, batch, ref_lp, old, cfg, W, scaler,
                                    lambda: run.precision.autocast(enabled=guard.amp), pad)
            poison_gradients(step, dist, part[0], model)  # test hook, no-op unless asked
            acc += part
            t1 = time.perf_counter()
            scaler.unscale_(opt)
            gnorm = fsdp.clip_grad_norm(model.parameters(), cfg.grad_clip or float("inf"))
            # with fp16 loss scaling, overflowing gradients are the scaler's to skip
            if guard.check(part[0], part[0] if scaler.is_enabled() else gnorm, ~r.nonfinite,
                           params_finite(model.parameters())):
                scaler.step(opt)
                scaler.update()
            else:
                scaler = _skipped(run, guard, scaler, step, ckpt_dir, restore)
            opt.zero_grad(set_to_none=True)
            t_opt += time.perf_counter() - t1
        times["policy"] = time.perf_counter() - t0  # forward + backward + optimizer
        times["optimizer"] = t_opt

        # ---- metrics: one collective; rank 0 logs
        m = step_metrics(r, res, batch, acc, cfg, times, time.perf_counter() - t_step)
        m.update({"grad_norm": gnorm.item(), "lr": lr, "guard/skipped": guard.skipped,
                  "guard/rungs_used": guard.next_rung, "guard/amp": float(guard.amp),
                  "guard/lr_scale": guard.lr_scale,
                  **comm_times(run.comm)})
        if run.logger and step % cfg.log_every == 0:
            run.logger.scalars(step, m)
            run.logger.progress(step, {"reward": m["reward/mean"], "kl": m["kl"],
                                       "len": m["completion_len/mean"],
                                       "tok/s": m["tokens_per_s"]})

        # ---- periodic evaluation (rank 0; the others wait at the next collective)
        if step % cfg.eval_every == 0 and step < cfg.max_steps:
            evaluate_step(run, step, guard.amp)
        # a checkpoint only from a step whose update went through: "restore" must go back
        # to a state from before the trouble, not to one saved during it
        if (step % cfg.save_every == 0 or step == cfg.max_steps) and guard.last_ok:
            save_grpo_checkpoint(run, opt, scaler, guard, step, gen)
    run.amp = guard.amp  # the final evaluation runs without autocast if the guard turned it off


def evaluate_step(run, step: int, amp: bool) -> None:
    """The periodic greedy evaluation: every rank gathers the weights, rank 0 evaluates and
    logs the metrics and samples."""
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
    r = rewards.view(-1, G)
    zero = r.max(1).values == r.min(1).values
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
    adv, _ = group_advantages(rewards, G, cfg.scale_rewards, batch_std=std)
    return Batch(adv, cmask, zero, n, mean, std, seqs.clamp(min=1), tokens.clamp(min=1))


def policy_pass(net, batches, batch: Batch, ref_lp, old, cfg, world_size: int = 1, scaler=None,
                autocast=nullcontext, pad: int = 0):
    """One pass over the rollout's micro-batches, accumulating the gradient of its GRPO loss.

    `old` is None on the first pass, whose own detached log-probs then serve as the old ones
    (ratio exactly 1); later passes get back the list this returns. The normalisers are the
    global batch's, so the gradients summed over micro-batches and ranks are those of one
    process holding the whole batch; DDP averages over ranks, hence the factor world_size.
    All micro-batches but the last skip DDP's all-reduce (no_sync). `pad` extra passes over
    the last micro-batch carry no loss: under fsdp they keep the ranks' collectives in step.
    Returns (sums, old): sums = (loss, kl, clip_low, clip_high, ratio, entropy) x tokens,
    token positions pushed (padding included) and the real ones, for the caller to reduce.
    """
    device = batch.adv.device
    acc, olds = torch.zeros(8, device=device), []
    for j, (rows, pids, pm, index, cids, cm) in enumerate(batches):
        n = cids.size(1)
        last = j == len(batches) - 1
        with net.no_sync() if not last and hasattr(net, "no_sync") else nullcontext():
            with autocast():
                logp, ent = completion_logprobs(net, pids, pm, cids, cm, cfg.temperature,
                                                index, entropy=True)
            olds.append(logp.detach() if old is None else old[j])
            loss, st = grpo_loss(logp, olds[j], batch.adv[rows], cm, ref_logp=ref_lp[rows, :n],
                                 beta=cfg.beta, eps_low=cfg.epsilon_low,
                                 eps_high=cfg.epsilon_high, agg=cfg.loss_agg,
                                 num_seqs=batch.num_seqs, num_tokens=batch.num_tokens,
                                 max_new_tokens=cfg.max_new_tokens, entropy=ent)
            scaled = loss * world_size
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        k = cm.sum()
        pushed = pids.numel() + cids.size(0) * (n - 1)
        real = pm.sum() + (cm.sum(1) - 1).clamp(min=0).sum()
        acc += torch.stack([loss.detach(), st["kl"] * k, st["clip_low"] * k, st["clip_high"] * k,
                            st["ratio"] * k, st["entropy"] * k,
                            torch.tensor(float(pushed), device=device), real.float()])
    for _ in range(pad):
        _, pids, pm, index, cids, cm = batches[-1]
        with autocast():
            logp = completion_logprobs(net, pids, pm, cids, cm, cfg.temperature, index)
        nothing = logp.sum() * 0.0
        (scaler.scale(nothing) if scaler is not None else nothing).backward()
    return acc, olds


def comm_times(comm) -> dict[str, float]:
    """The step's seconds in collectives: the policy update's (DDP's all-reduce, FSDP's
    gathers and reduce-scatters) and, under fsdp, sampling's and the reference's before it."""
    before, after = comm.pop() if comm else (0.0, 0.0)
    return {"time/comm_rollout": before, "time/comm": after}


def step_metrics(r, res, batch: Batch, acc, cfg, times: dict, seconds: float) -> dict:
    """The step's metrics over all ranks, from one collective (D.reduce_named)."""
    lengths = r.completion_mask.sum(1).float()
    sums = {"acc": acc, "len": lengths.sum(), "zero": batch.zero.float().sum(),
            "truncated": (~r.finished).float().sum(),
            "groups": float(batch.zero.numel()), "prompt_tokens": r.prompt_mask.sum().float()}
    for k, col in res.columns.items():  # per plugin, over all ranks' rows
        col = torch.as_tensor(col, dtype=torch.float64)
        sums[f"{k}/s1"], sums[f"{k}/s2"] = col.sum(), col.square().sum()
    red = D.reduce_named(sums, {"len_max": lengths.max()})
    acc, iters = red["acc"], cfg.num_iterations
    tok = batch.num_tokens.item() * iters
    n = batch.rows.item()
    m = {"reward/mean": batch.reward_mean.item(), "reward/std": batch.reward_std.item(),
         "loss": acc[0] / iters, "kl": acc[1] / tok, "clip_low": acc[2] / tok,
         "clip_high": acc[3] / tok, "ratio": acc[4] / tok, "entropy": acc[5] / tok,
         "completion_len/mean": red["len"] / n, "completion_len/max": red["len_max"],
         "zero_spread_frac": red["zero"] / red["groups"], "tokens_per_s": red["len"] / seconds,
         "truncated_frac": red["truncated"] / n,  # rows that hit max_new_tokens without EOS
         # per policy pass: token positions through the model (padding included), and
         # the real tokens among them (each prompt counted once per group)
         "tokens/processed": acc[6] / iters, "tokens/unique": acc[7] / iters,
         "tokens/train": batch.num_tokens.item() + red["prompt_tokens"]}
    for k in res.columns:
        mean = red[f"{k}/s1"] / n
        m[f"reward/{k}/mean"] = mean
        m[f"reward/{k}/std"] = max(red[f"{k}/s2"] / n - mean**2, 0.0) ** 0.5
    m.update({f"time/{k}": v for k, v in times.items()})
    m["time/step"] = seconds
    # scorer health (this rank's): seconds and failed rows per plugin
    m.update(res.metrics)
    return m


def _skipped(run, guard: Guard, scaler, step: int, ckpt_dir: Path, restore):
    """A skipped step, on every rank alike: log it, walk the ladder; returns the scaler."""
    if scaler.is_enabled():
        scaler.update(scaler.get_scale() / 2)
    if run.logger:
        run.logger.event(step, f"non-finite loss, gradient, weights or logits: step skipped "
                               f"({guard.consecutive} in a row, {guard.skipped} in all)")
    # every rank must see the checkpoint (shared storage) for "restore" to be agreed
    have = D.all_reduce_sum(torch.tensor([float(bool(list_checkpoints(ckpt_dir)))],
                                         device=run.device)).item() == run.dist.world_size
    amp = guard.amp
    what = guard.fallback(have, restore, where=f"step {step}")
    if what and run.logger:
        run.logger.event(step, f"fallback after {guard.patience} skipped steps: {what}")
    return run.precision.scaler(guard.amp) if guard.amp != amp else scaler


def resume_weights(model, state: dict, opt=None) -> None:
    """A checkpoint's weights (and optimizer state) into `model`, however either is sharded."""
    if state.get("sharded"):
        fsdp.load_sharded(state["sharded"], model, opt)
        return
    fsdp.load_model_state(model, state["model"])  # under fsdp, each rank keeps its shards
    if opt is not None:
        fsdp.load_optimizer_state(model, opt, state["optimizer"])


def _continue_from(state: dict, guard: Guard, model, opt, gen, dist) -> int:
    """Optimizer, guard and this rank's RNG from a GRPO checkpoint; returns its step."""
    resume_weights(model, state, opt)
    guard.load_state_dict(state.get("guard", {}))
    set_rng_state(state["rng"][min(dist.rank, len(state["rng"]) - 1)], gen)
    return state["step"]


def save_grpo_checkpoint(run, opt, scaler, guard: Guard, step: int, gen) -> None:
    """A checkpoint of every rank's state (a collective), written only from finite parameters
    (a NaN must never reach the disk): under fsdp every rank writes its shards
    (fsdp.save_sharded), else rank 0 one file of the full state."""
    model, cfg = run.model, run.cfg
    states = D.all_gather_object(rng_state(gen))  # every rank's sampling RNG
    meta = {"kind": "grpo", "scaler": scaler.state_dict(), "guard": guard.state_dict(),
            "step": step, "rng": states, **run.identity()}
    bad = D.all_reduce_max((~params_finite(model.parameters())).float().reshape(1))
    if bad.item():
        run.print0(f"[mini-grpo] step {step}: parameters are not finite, checkpoint NOT written")
    elif run.sharded:
        fsdp.save_sharded(model, opt, meta, Path(cfg.out_dir) / "checkpoints", step,
                          cfg.keep_checkpoints)
    else:
        if run.dist.is_main:
            save_checkpoint({**meta, "model": model.state_dict(), "optimizer": opt.state_dict()},
                            Path(cfg.out_dir) / "checkpoints", step, keep=cfg.keep_checkpoints)
    D.barrier()
