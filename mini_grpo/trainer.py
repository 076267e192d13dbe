"""The GRPO loop, readable top to bottom, and the `train` job around it (SFT -> GRPO -> eval).

    python distributed_train.py --config default          # SFT warm start, GRPO, before/after
    python distributed_train.py --config tiny --mode=grpo  # GRPO alone from random weights

One GRPO step, per rank (DESIGN.md): take this rank's prompts -> sample G completions each
with the KV cache -> score -> group advantages -> reference log-probs -> num_iterations passes
in micro-batches with gradient accumulation -> clip, AdamW step -> metrics, eval, checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from . import distributed as D
from .checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import ConfigError, GRPOConfig
from .data import batch_indices, shard
from .evaluate import evaluate, format_table, trivial_baselines
from .grpo import group_advantages, grpo_loss, token_logprobs
from .guards import Guard, GuardError
from .logger import RunLogger
from .model import GPT, GPTConfig
from .optim import lr_at, make_optimizer, set_lr
from .precision import (
    amp_dtype,
    autocast,
    compile_with_fallback,
    grad_scaler,
    resolve_device,
    setup_backends,
)
from .reference import Reference
from .rft import generate_rft_data
from .rollout import sample
from .scoring import RewardScorer
from .sft import train_sft
from .tasks import build_task, load_jsonl
from .tokenizer import CharTokenizer


def build_model(cfg: GRPOConfig, vocab_size: int, device=None) -> GPT:
    """The policy from the config's model fields, on `device` (default: CPU)."""
    device = torch.device(device or "cpu")
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout))
    model.gradient_checkpointing = cfg.gradient_checkpointing
    impl = cfg.attn_impl
    if impl == "auto":
        cpu_bf16 = device.type == "cpu" and amp_dtype(cfg, device) == torch.bfloat16
        impl = "manual" if cpu_bf16 else "sdpa"
    model.attn_impl = impl
    return model.to(device)


def check_lengths(cfg: GRPOConfig, prompts: list[str]) -> None:
    """Every prompt (with BOS) plus max_new_tokens must fit in block_size; fail before work."""
    longest = max(len(p) for p in prompts) + 1
    if longest + cfg.max_new_tokens > cfg.block_size:
        raise ConfigError(f"block_size: {cfg.block_size} is too small for the longest prompt "
                          f"({longest} tokens) + max_new_tokens ({cfg.max_new_tokens})")


def plan_micro_batches(lengths: list[int], size: int) -> list[list[int]]:
    """Row indices sorted by length and cut into micro-batches of `size` rows (the last may
    be smaller), so each micro-batch holds rows of similar length and little padding.

    Cutting early where lengths jump would push a little less padding, but on the 2-core CPU
    it made the default step's policy update 1.4x slower (0.95 vs 0.65 s): every new
    micro-batch shape costs oneDNN a kernel set-up, and with fixed-size micro-batches only
    the length varies.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return [order[i:i + size] for i in range(0, len(order), size)]


def micro_batches(r, cmask: torch.Tensor, size: int, group: int) -> list[tuple]:
    """row_batches, each taken (`_take`) once for the reference and every policy pass:
    (rows, prompts, prompt mask, prompt index, completion ids, completion mask)."""
    return [(rows, *_take(r, cmask, rows, group))
            for rows in row_batches(r, cmask, size, group)]


def row_batches(r, cmask: torch.Tensor, size: int, group: int) -> list[torch.Tensor]:
    """The rows a training or reference pass pushes through the model, as index tensors of
    micro-batches; each micro-batch computes the prompts of its rows once (`_take`).

    Two plans, and the one that pushes fewer token positions wins: whole groups (`group`
    consecutive rows share a prompt) sorted by their longest completion, size // group groups
    each, so every prompt is computed once; or rows sorted by completion length, `size`
    each, which pads less where completions of one prompt differ widely (a random-init
    policy, reasoning traces) at the price of a prompt computed in more than one
    micro-batch. Rows with no token in `cmask` (left out by dynamic sampling) carry no loss
    and are skipped, but one is always kept so every rank runs a backward (DDP's all-reduce).
    """
    n = cmask.sum(1).tolist()
    p = r.prompt_mask.sum(1).tolist()
    live = [i for i, k in enumerate(n) if k] or [0]
    groups: dict[int, list[int]] = {}
    for i in live:
        groups.setdefault(i // group, []).append(i)
    members = list(groups.values())
    by_group = [[i for g in b for i in members[g]] for b in plan_micro_batches(
        [(max(n[i] for i in rows), p[rows[0]]) for rows in members], max(1, size // group))]
    by_row = [[live[j] for j in b]
              for b in plan_micro_batches([(n[i], i // group) for i in live], size)]

    def pushed(plan):
        return sum(len({i // group for i in b}) * max(p[i] for i in b)
                   + len(b) * (max(n[i] for i in b) - 1) for b in plan)

    best = min((by_group, by_row), key=pushed)  # ties: whole groups
    return [torch.tensor(b, device=cmask.device) for b in best]


def _take(r, cmask, rows, group):
    """One micro-batch: (its distinct prompts (U, P), their masks, each row's prompt (b,),
    completion ids (b, n), completion mask), cut to the columns that hold a real token."""
    cm = cmask[rows]
    n = max(1, int(cm.sum(1).max()))
    groups, index = torch.unique(rows // group, return_inverse=True)
    pids, pm = r.prompt_ids[groups * group], r.prompt_mask[groups * group]
    first = int(pm.any(0).int().argmax())  # prompts are left-padded
    return pids[:, first:], pm[:, first:], index, r.completion_ids[rows, :n], cm[:, :n]


def _policy_logprobs(net, pids, pm, index, cids, temperature):
    """Forward with each prompt computed once (GPT.forward_shared): (logp, entropy) of the
    completion tokens (b, n), and the token positions pushed."""
    logp, ent = token_logprobs(net(cids, prefix=(pids, pm, index)), cids, temperature)
    return logp, ent, pids.numel() + cids.size(0) * (cids.size(1) - 1)


def accumulate_gradients(net, r, cmask, adv, ref_lp, cfg, num_seqs, num_tokens,
                         world_size: int = 1, scaler=None, batches=None) -> torch.Tensor:
    """One pass over a rollout in micro-batches, accumulating the gradient of its GRPO loss.

    num_seqs / num_tokens are the global batch's (all-reduced under DDP), so the gradients
    summed over micro-batches and ranks are those of one process holding the whole batch; DDP
    averages over ranks, hence the factor world_size. All micro-batches but the last skip
    DDP's gradient all-reduce (no_sync). `batches` is micro_batches(...), computed here when
    not given. Returns the summed loss, token-weighted stats, the token positions pushed through
    the model (padding included) and the real ones among them (each prompt once per group):
    (loss, kl, clip_low, clip_high, ratio, entropy) x tokens, pushed, real; for the caller
    to reduce.
    """
    device = r.completion_ids.device
    G = cfg.group_size
    if batches is None:
        batches = micro_batches(r, cmask, cfg.micro_batch_size, G)
    acc = torch.zeros(8, device=device)
    for j, (rows, pids, pm, index, cids, cm) in enumerate(batches):
        n = cids.size(1)
        last = j == len(batches) - 1
        with net.no_sync() if not last and hasattr(net, "no_sync") else nullcontext():
            with autocast(cfg, device):
                logp, ent, pushed = _policy_logprobs(net, pids, pm, index, cids,
                                                     cfg.temperature)
            # one pass: old = current (ratio 1); more: old = the log-probs recorded at sampling
            old = logp.detach() if cfg.num_iterations == 1 else r.logprobs[rows, :n]
            loss, st = grpo_loss(logp, old, adv[rows], cm, ref_logp=ref_lp[rows, :n],
                                 beta=cfg.beta, eps_low=cfg.epsilon_low,
                                 eps_high=cfg.epsilon_high, agg=cfg.loss_agg,
                                 num_seqs=num_seqs, num_tokens=num_tokens,
                                 max_new_tokens=cfg.max_new_tokens, entropy=ent)
            scaled = loss * world_size
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        k = cm.sum()
        real = pm.sum() + (cm.sum(1) - 1).clamp(min=0).sum()
        acc += torch.stack([loss.detach(), st["kl"] * k, st["clip_low"] * k, st["clip_high"] * k,
                            st["ratio"] * k, st["entropy"] * k,
                            torch.tensor(float(pushed), device=device), real.float()])
    return acc


def _inject_fault(step: int, dist: D.DistInfo) -> None:
    """Test hook: MINI_GRPO_FAULT=crash:N (or raise:N) makes the last rank die abruptly (or
    raise) at GRPO step N, on the first attempt only, so an elastic restart can finish."""
    kind, _, at = os.environ.get("MINI_GRPO_FAULT", "").partition(":")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if kind and int(at) == step and dist.rank == dist.world_size - 1 and first_attempt:
        if kind == "crash":
            print(f"[fault] rank {dist.rank} exits abruptly at step {step}", flush=True)
            os._exit(13)
        raise RuntimeError(f"injected fault on rank {dist.rank} at step {step}")


def _nan_injected(step: int, dist: D.DistInfo) -> bool:
    """Test hook: MINI_GRPO_NAN_STEPS=3,4,5 poisons the last rank's loss at those steps."""
    steps = os.environ.get("MINI_GRPO_NAN_STEPS", "")
    return dist.rank == dist.world_size - 1 and str(step) in steps.split(",")


def train_grpo(cfg, task, tok, model, net, reference, scorer, device, dist: D.DistInfo,
               logger: RunLogger | None, resume_state=None, comm: D.CommTimer | None = None):
    """Runs GRPO steps until cfg.max_steps; the model is trained in place. Returns the
    per-step metrics (what was logged), for benchmark.py.

    `net` is the model as trained (DDP-wrapped under torchrun), `model` the bare module that
    generation, checkpoints and evaluation use; `comm` times DDP's gradient all-reduce.
    """
    history = []
    if comm:
        comm.pop()
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, fused=cfg.fused_optimizer)
    scaler = grad_scaler(cfg, device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1 + dist.rank)  # differs by rank
    G, W = cfg.group_size, dist.world_size
    start = 0
    if resume_state is not None:
        opt.load_state_dict(resume_state["optimizer"])
        scaler.load_state_dict(resume_state.get("scaler", {}))
        set_rng_state(resume_state["rng"][min(dist.rank, len(resume_state["rng"]) - 1)], gen)
        start = resume_state["step"]
    ckpt_dir = Path(cfg.out_dir) / "checkpoints"
    guard, lr_scale = Guard(cfg.guard_patience), 1.0
    if logger:
        logger.start_clock(start)

    for step in range(start + 1, cfg.max_steps + 1):
        _inject_fault(step, dist)
        t_step = time.perf_counter()
        times = {}
        # ---- prompts: this rank's share of the global batch; a group never spans ranks
        idx = batch_indices(len(task.train), cfg.prompts_per_step, step - 1, cfg.seed + 1)
        exs = [task.train[i] for i in shard(idx, dist.rank, W)]
        rows = [ex for ex in exs for _ in range(G)]  # group-major: (B * G,)

        # ---- rollout with the unwrapped policy (no DDP hooks)
        t0 = time.perf_counter()
        with autocast(cfg, device, generation=True):
            r = sample(model, tok, [ex.prompt for ex in rows], cfg.max_new_tokens,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                       generator=gen, use_cache=cfg.kv_cache)
        times["generate"] = time.perf_counter() - t0

        # ---- rewards and advantages
        t0 = time.perf_counter()
        res = scorer.score([ex.prompt for ex in rows], r.texts, [ex.target for ex in rows],
                           [ex.meta for ex in rows])
        rewards = torch.tensor(res.total, dtype=torch.float32, device=device)
        times["reward"] = time.perf_counter() - t0
        n_rows = torch.tensor(float(len(rows)), device=device)
        sums = D.all_reduce_sum(torch.stack([n_rows, rewards.sum(), rewards.square().sum()]))
        g_mean = sums[1] / sums[0]
        g_std = (sums[2] / sums[0] - g_mean ** 2).clamp(min=0).sqrt()
        adv, zero = group_advantages(rewards, G, cfg.scale_rewards, batch_std=g_std)
        cmask = r.completion_mask
        if cfg.dynamic_sampling:  # zero-spread groups carry no signal: leave them out
            keep = (~zero).repeat_interleave(G)
            cmask = cmask & keep[:, None]
        n_seqs_local = cmask.any(1).sum() if cfg.dynamic_sampling else n_rows
        counts = D.all_reduce_sum(torch.stack([n_seqs_local.float(), cmask.sum().float()]))
        num_seqs, num_tokens = counts[0].clamp(min=1), counts[1].clamp(min=1)

        # ---- reference log-probs (beta = 0 skips the reference entirely)
        t0 = time.perf_counter()
        batches = micro_batches(r, cmask, cfg.micro_batch_size, G)  # for both passes
        ref_lp = torch.zeros_like(r.logprobs)
        if cfg.beta != 0:
            for rows, pids, pm, index, cids, cm in batches:
                with autocast(cfg, device):
                    ref_lp[rows, :cids.size(1)] = reference.logprobs(pids, pm, cids, cm,
                                                                     cfg.temperature, index)
        times["reference"] = time.perf_counter() - t0

        # ---- policy update: num_iterations passes, gradient accumulation over micro-batches
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.max_steps) * lr_scale
        set_lr(opt, lr)
        model.train()
        # loss, kl, clip_low, clip_high, ratio, entropy (x tokens), tokens pushed, real
        acc = torch.zeros(8, device=device)
        t_opt = 0.0  # clipping + optimizer step, within the policy update
        for _ in range(cfg.num_iterations):
            part = accumulate_gradients(net, r, cmask, adv, ref_lp, cfg, num_seqs, num_tokens,
                                        W, scaler, batches)
            t1 = time.perf_counter()
            if _nan_injected(step, dist):  # test hook: poison this rank's loss and gradient
                part[0] = float("nan")
                next(model.parameters()).grad.fill_(float("nan"))
            acc += part
            scaler.unscale_(opt)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                   cfg.grad_clip or float("inf"))
            # with fp16 loss scaling, overflowing gradients are the scaler's to skip
            if guard.step_ok(part[0], gnorm if not scaler.is_enabled() else part[0]):
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                t_opt += time.perf_counter() - t1
                continue
            opt.zero_grad(set_to_none=True)  # skip the step, on every rank alike
            if scaler.is_enabled():
                scaler.update(scaler.get_scale() / 2)
            if logger:
                logger.event(step, f"non-finite loss or gradient: step skipped "
                                   f"({guard.consecutive} in a row, {guard.skipped} in all)")
            # every rank must see the checkpoint (shared storage) for "restore" to be agreed
            have = D.all_reduce_sum(torch.tensor([float(bool(list_checkpoints(ckpt_dir)))],
                                                 device=device)).item() == W
            rung, what = guard.rung(cfg.use_amp, have), None
            if rung == "amp_off":
                cfg.use_amp = False
                scaler = grad_scaler(cfg, device)
                what = "autocast turned off (fp32) for the rest of the run"
            elif rung == "halve_lr":
                lr_scale /= 2
                what = f"learning rate halved (x{lr_scale:g} of the schedule)"
            elif rung == "restore":
                path, state = latest_checkpoint(ckpt_dir)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                what = f"restored {path}"
            elif rung == "stop":
                raise GuardError(f"step {step}: loss or gradients stayed non-finite for "
                                 f"{cfg.guard_patience} steps after every fallback (AMP off, "
                                 f"learning rate halved, last checkpoint restored); see "
                                 f"{cfg.out_dir}/metrics.jsonl")
            if what and logger:
                logger.event(step, f"fallback after {cfg.guard_patience} skipped steps: {what}")
        times["policy"] = time.perf_counter() - t0  # forward + backward + optimizer
        times["optimizer"] = t_opt
        dt = time.perf_counter() - t_step

        # ---- metrics, reduced over ranks
        lengths = r.completion_mask.sum(1).float()
        red = D.all_reduce_sum(torch.cat([acc, torch.stack([
            lengths.sum(), zero.float().sum(), torch.tensor(float(len(exs)), device=device)])]))
        max_len = D.all_reduce_max(lengths.max().clone())
        iters = cfg.num_iterations
        tok_total = counts[1] * iters
        m = {"reward/mean": g_mean.item(), "reward/std": g_std.item(),
             "loss": red[0].item() / iters, "kl": (red[1] / tok_total).item(),
             "clip_low": (red[2] / tok_total).item(), "clip_high": (red[3] / tok_total).item(),
             "ratio": (red[4] / tok_total).item(), "entropy": (red[5] / tok_total).item(),
             "completion_len/mean": (red[8] / sums[0]).item(), "completion_len/max": max_len.item(),
             "zero_spread_frac": (red[9] / red[10]).item(), "grad_norm": gnorm.item(), "lr": lr,
             "tokens_per_s": (red[8] / dt).item(), "guard/skipped": guard.skipped,
             # per policy pass: token positions through the model (padding included), and
             # the real tokens among them (each prompt counted once per group)
             "tokens/processed": red[6].item() / iters, "tokens/unique": red[7].item() / iters,
             "guard/rungs_used": guard.next_rung}
        m.update({f"time/{k}": v for k, v in times.items()})
        m["time/step"] = dt
        m["time/comm"] = comm.pop() if comm else 0.0
        m["tokens/train"] = (counts[1] + D.all_reduce_sum(r.prompt_mask.sum().float())).item()
        history.append(m)
        # scorer health (this rank's): seconds and failed rows per plugin
        m.update({k: v for k, v in res.metrics.items() if k.endswith(("/seconds", "/failures"))})
        for k, v in res.columns.items():  # per plugin, over all ranks' rows
            s1, s2 = D.all_reduce_sum(torch.tensor([v.sum(), (v**2).sum()], device=device))
            mean = s1 / sums[0]
            m[f"reward/{k}/mean"] = mean.item()
            m[f"reward/{k}/std"] = (s2 / sums[0] - mean**2).clamp(min=0).sqrt().item()
        if logger and step % cfg.log_every == 0:
            logger.scalars(step, m)
            logger.progress(step, {"reward": m["reward/mean"], "kl": m["kl"],
                                   "len": m["completion_len/mean"], "tok/s": m["tokens_per_s"]})

        # ---- periodic evaluation and checkpoint
        if step % cfg.eval_every == 0 and step < cfg.max_steps and dist.is_main:
            ev = evaluate(model, tok, task.eval, scorer, cfg, device, greedy=True)
            logger.scalars(step, {k: v for k, v in ev.items() if k != "samples"}, "eval/")
            logger.text(step, "samples", "\n\n".join(
                f"`{s['prompt']}` -> `{s['completion']}` (target `{s['target']}`)"
                for s in ev["samples"]))
        # a checkpoint only from a step whose update went through: "restore" must go back
        # to a state from before the trouble, not to one saved during it
        if (step % cfg.save_every == 0 or step == cfg.max_steps) and guard.last_ok:
            states = D.all_gather_object(rng_state(gen))  # every rank's sampling RNG
            if dist.is_main:
                save_grpo_checkpoint(cfg, tok, model, opt, scaler, step, states, ckpt_dir)
            D.barrier()
    return history


def save_grpo_checkpoint(cfg, tok, model, opt, scaler, step, rng_states, ckpt_dir):
    """Writes a checkpoint only from finite parameters (a NaN must never reach the disk)."""
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        print(f"[mini-grpo] step {step}: parameters are not finite, checkpoint NOT written")
        return None
    state = {"kind": "grpo", "model": model.state_dict(), "optimizer": opt.state_dict(),
             "scaler": scaler.state_dict(),
             "step": step, "rng": rng_states, "config": cfg.to_dict(), "tokenizer": tok.chars}
    return save_checkpoint(state, ckpt_dir, step, keep=cfg.keep_checkpoints)


def load_policy(path: str, device) -> tuple[GPT, CharTokenizer, dict]:
    """A model and tokenizer from any mini-grpo checkpoint (SFT or GRPO)."""
    state = load_checkpoint(path)
    tok = CharTokenizer(state["tokenizer"])
    cfg = GRPOConfig(**state["config"])
    model = build_model(cfg, tok.vocab_size, device)
    model.load_state_dict(state["model"])
    return model.eval(), tok, state


def train(cfg: GRPOConfig) -> dict:
    """The whole job: SFT warm start, GRPO, before/after evaluation (rank 0 writes eval.json)."""
    dist = D.init(cfg.dist_timeout)
    device = resolve_device(cfg, dist.local_rank)
    threads = setup_backends(cfg, dist.local_world_size)
    task = build_task(cfg)
    tok = CharTokenizer(task.alphabet)
    check_lengths(cfg, [ex.prompt for ex in task.train + task.eval])
    scorer = RewardScorer.from_config(cfg, task)  # resolves plugins: bad names fail here
    out = Path(cfg.out_dir)
    resume_state = None
    if cfg.resume not in ("auto", "never"):
        resume_state = load_checkpoint(cfg.resume)
    elif cfg.resume == "auto":
        _, resume_state = latest_checkpoint(out / "checkpoints")
    if resume_state is not None and resume_state["tokenizer"] != tok.chars:
        raise CheckpointError("checkpoint tokenizer differs from this task's alphabet")

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg, tok.vocab_size, device)
    logger = None
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.yaml")
        tok.save(out / "tokenizer.json")
        logger = RunLogger(out, cfg.max_steps)
        print(f"[mini-grpo] task {task.name}: {len(task.train)} train / {len(task.eval)} "
              f"held-out prompts; model {model.num_params() / 1e6:.2f}M params; {_procs(dist)} "
              f"on {device}, {threads} threads; run directory {out}", flush=True)

    with scorer:
        if cfg.init_from:
            model.load_state_dict(load_checkpoint(cfg.init_from)["model"])
        # the training forward may be compiled; generation and checkpoints use `model` itself
        trained = compile_with_fallback(model, cfg.compile_mode) if cfg.compile_model else model
        net, comm = D.wrap_ddp(trained, device)  # (trained, None) in a single process
        stages = STAGES[cfg.mode]
        if "sft" in stages:
            train_sft(cfg, task, tok, model, device, dist, logger, ddp_model=net)
        result = {}
        if "rft" in stages:
            if dist.is_main:
                result["before"] = _eval_both(model, tok, task, scorer, cfg, device, logger, 0)
            run_rft(cfg, task, tok, model, net, scorer, device, dist, logger)
        if "grpo" in stages:
            reference = Reference(model, device, cfg.offload_reference) if cfg.beta else None
            if dist.is_main and resume_state is None:
                result["before"] = _eval_both(model, tok, task, scorer, cfg, device, logger, 0)
                (out / "eval.json").write_text(json.dumps(result, indent=2))
            elif dist.is_main and (out / "eval.json").is_file():  # resumed: keep "before"
                result = {k: v for k, v in json.loads((out / "eval.json").read_text()).items()
                          if k == "before"}
            if resume_state is not None:
                model.load_state_dict(resume_state["model"])
                if dist.is_main:
                    print(f"[mini-grpo] resuming GRPO from step {resume_state['step']}")
            train_grpo(cfg, task, tok, model, net, reference, scorer, device, dist, logger,
                       resume_state, comm)
        if dist.is_main:
            last = {"grpo": cfg.max_steps, "rft": cfg.rft_sft_steps}.get(stages[-1],
                                                                         cfg.sft_steps)
            result["after"] = _eval_both(model, tok, task, scorer, cfg, device, logger, last)
            table = {f"{k} {mode}": v[mode] for k, v in result.items()
                     for mode in ("greedy", "sampled")}
            result["baselines"] = trivial_baselines(task.eval, scorer, task.name)
            (out / "eval.json").write_text(json.dumps(result, indent=2))
            print("\n" + format_table(table), flush=True)
            print("trivial answers under the same reward: " + ", ".join(
                f"{k} {v:.4f}" for k, v in result["baselines"].items()), flush=True)
    if logger:
        logger.close()
    del net, trained  # DDP's reducer must not outlive the process group (abort at exit)
    D.cleanup()
    return result


STAGES = {"sft_grpo": ("sft", "grpo"), "sft": ("sft",), "grpo": ("grpo",), "rft": ("sft", "rft")}


def run_rft(cfg, task, tok, model, net, scorer, device, dist: D.DistInfo, logger) -> None:
    """Rejection sampling from the current model, then SFT on the accepted completions."""
    prompts = list(dict.fromkeys(ex.prompt for ex in task.train))
    keep = set(prompts[:cfg.rft_num_prompts] if cfg.rft_num_prompts else prompts)
    examples = [ex for ex in task.train if ex.prompt in keep]
    data = Path(cfg.out_dir) / "rft" / "data.jsonl"
    generate_rft_data(model, tok, examples, scorer, cfg, device, dist, data)
    try:
        accepted = load_jsonl(data)
    except ConfigError:  # nothing accepted: say which knob, not just "the file is empty"
        raise ConfigError(f"rft_min_reward: no completion of {len(keep)} prompts reached "
                          f"{cfg.rft_min_reward}; lower it or train the SFT stage longer"
                          ) from None
    train_sft(cfg, task, tok, model, device, dist, logger, ddp_model=net, examples=accepted,
              steps=cfg.rft_sft_steps, lr=cfg.rft_lr, directory=data.parent / "sft", tag="rft")


def _procs(dist: D.DistInfo) -> str:
    return f"{dist.world_size} process{'es' if dist.world_size > 1 else ''}"


def _eval_both(model, tok, task, scorer, cfg, device, logger, step) -> dict:
    out = {}
    for greedy in (True, False):
        name = "greedy" if greedy else "sampled"
        t0 = time.perf_counter()
        ev = evaluate(model, tok, task.eval, scorer, cfg, device, greedy=greedy, seed=cfg.seed)
        out[name] = ev
        if logger:
            logger.scalars(step, {k: v for k, v in ev.items() if k != "samples"},
                           f"eval_{name}/")
        print(f"[eval] step {step} {name}: reward {ev['reward']:.4f} ± {ev['reward_se']:.4f} "
              f"exact {ev['exact']:.3f} valid {ev.get('valid_fen', math.nan):.3f} "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return out
