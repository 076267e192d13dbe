"""Measures a config: generation throughput, reward scoring, GRPO steps, 1 vs 2 processes.

    python benchmark.py --config default                  # generation, rewards, step
    python benchmark.py --config default --only generation --repeats 5 --json bench/gen.json
    python benchmark.py --config default --only step --warmup 2 --steps 5
    torchrun --standalone --nproc_per_node=2 benchmark.py --config default --only step
    python benchmark.py --config default --only scaling   # runs the step section with 1
                                                          # process, then 2 under torchrun
    python benchmark.py --config default --only ablations # each speed switch flipped alone
    python benchmark.py --compare A.json B.json           # ratios of B over A

Generation: `--batch` prompts (held-out prompts of the config's task) and exactly
`--new-tokens` new tokens each (EOS is ignored so both paths do the same work), with a randomly
initialised model of the config's size; tokens/s is the median over `--repeats` runs after one
warm-up, with the two paths interleaved so machine noise hits both alike.
Rewards: see mini_grpo/rewards/bench.py.
Step: real GRPO steps (generate, score, reference, policy update) of the config with a
randomly initialised policy (or `--init_from=CKPT`); medians over the timed steps of seconds per
step and per phase, generated and training tokens/s, and the seconds in DDP's gradient
all-reduce (`comm`, measured by a communication hook).
Scaling: the same global batch with 1 and 2 processes; scaling efficiency = T1 / (2 x T2).
On a 2-core CPU both runs share the cores, so the communication share per step is the figure
that carries over to GPUs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from mini_grpo.config import ConfigError, load_config, parse_cli
from mini_grpo.precision import amp_dtype, autocast, resolve_device, setup_backends
from mini_grpo.rollout import generate
from mini_grpo.tasks import build_task
from mini_grpo.tokenizer import CharTokenizer
from mini_grpo.trainer import build_model


def bench_generation(cfg, batch: int, new_tokens: int, repeats: int) -> dict:
    device = resolve_device(cfg)
    task = build_task(cfg)
    tok = CharTokenizer(task.alphabet)
    prompts = [tok.encode(ex.prompt, bos=True) for ex in (task.eval * batch)[:batch]]
    cfg.block_size = max(cfg.block_size, max(map(len, prompts)) + new_tokens)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tok.vocab_size, device).eval()

    def run(use_cache: bool) -> float:
        g = torch.Generator(device=device).manual_seed(0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast(cfg, device, generation=True):
            r = generate(model, prompts, new_tokens, eos_id=-1, pad_id=tok.pad_id,
                         generator=g, use_cache=use_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert r.completion_ids.shape == (batch, new_tokens)
        return batch * new_tokens / (time.perf_counter() - t0)

    run(True), run(False)  # warm-up
    rates = {"kv_cache": [], "recompute": []}
    for i in range(repeats):
        print(f"\r[bench] generation run {i + 1}/{repeats}", end="", file=sys.stderr, flush=True)
        rates["kv_cache"].append(run(True))
        rates["recompute"].append(run(False))
    print(file=sys.stderr)
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"batch": batch, "new_tokens": new_tokens, "repeats": repeats,
            "params_M": round(model.num_params() / 1e6, 3), "device": str(device),
            "amp": cfg.use_amp, "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
            "runs": {k: [round(x, 1) for x in v] for k, v in rates.items()},
            "speedup_kv_vs_recompute": round(med["kv_cache"] / med["recompute"], 2)}


def format_generation(r: dict) -> str:
    t = r["tokens_per_s"]
    return "\n".join([
        f"generation: batch {r['batch']}, {r['new_tokens']} new tokens, {r['params_M']}M params, "
        f"{r['device']}, amp={r['amp']}, median of {r['repeats']}",
        f"  {'KV cache':<12} {t['kv_cache']:>10.0f} tok/s",
        f"  {'recompute':<12} {t['recompute']:>10.0f} tok/s",
        f"  speed-up     {r['speedup_kv_vs_recompute']:>10.2f}x"])


def matmul_peak(device, dtype, n: int = 2048, repeats: int = 20) -> float:
    """Measured peak of this device: GFLOP/s of an n x n matmul in `dtype`, best of
    `repeats` runs into a preallocated output (noise on a shared machine only slows runs
    down, so the best run is the estimate of the peak; the median moved by 1.3-2.2 TFLOP/s
    between runs here)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.matmul(a, b, out=c)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times[2:]) / 1e9


# bf16 dense peaks (TFLOP/s, no sparsity) of GPUs we know, for MFU against the datasheet
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0,
                         "A10G": 70.0, "L4": 121.0, "4090": 165.0}


def model_flops(model, tokens: float, ctx: float, backward: bool = False) -> float:
    """FLOPs of a forward (x3 with backward) over `tokens` tokens at mean context `ctx`.

    Per token: 2 x (12 n_layer n_embd^2) for the block matmuls, 2 x n_embd x vocab for the LM
    head, and 4 x n_layer x ctx x n_embd for attention (QK^T and AV); backward costs twice the
    forward. Embedding lookups, norms and softmax are left out, as in the usual 6N count.
    """
    c = model.cfg
    per_token = 2 * 12 * c.n_layer * c.n_embd**2 + 2 * c.n_embd * c.vocab_size \
        + 4 * c.n_layer * ctx * c.n_embd
    return per_token * tokens * (3 if backward else 1)


def peak_memory(device) -> dict:
    import resource

    out = {"rss_peak_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        out["cuda_allocated_peak_MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
        out["cuda_reserved_peak_MiB"] = torch.cuda.max_memory_reserved(device) / 2**20
    return out


def bench_step(cfg, warmup: int, steps: int, task=None) -> dict:
    """Real GRPO steps through the trainer; works alone or as one rank under torchrun."""
    import tempfile

    from mini_grpo import distributed as D
    from mini_grpo.precision import compile_with_fallback
    from mini_grpo.reference import Reference
    from mini_grpo.scoring import RewardScorer
    from mini_grpo.trainer import train_grpo

    dist = D.init(cfg.dist_timeout)
    device = resolve_device(cfg, dist.local_rank)
    setup_backends(cfg, dist.local_world_size)
    task = task or build_task(cfg)
    tok = CharTokenizer(task.alphabet)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tok.vocab_size, device)
    if cfg.init_from:
        from mini_grpo.checkpoint import load_checkpoint
        model.load_state_dict(load_checkpoint(cfg.init_from)["model"])
    trained = compile_with_fallback(model, cfg.compile_mode) if cfg.compile_model else model
    net, comm = D.wrap_ddp(trained, device)
    reference = Reference(model, device, cfg.offload_reference) if cfg.beta else None
    cfg.max_steps, cfg.eval_every, cfg.save_every = warmup + steps, 10**9, 10**9
    with tempfile.TemporaryDirectory() as tmp, RewardScorer.from_config(cfg, task) as scorer:
        cfg.out_dir = tmp
        history = train_grpo(cfg, task, tok, model, net, reference, scorer, device, dist,
                             None, comm=comm)
    del net, trained  # DDP's reducer must not outlive the process group (abort at exit)
    D.cleanup()
    timed = history[warmup:]
    med = lambda key: statistics.median(h[key] for h in timed)
    step_s = [h["time/step"] for h in timed]
    phases = ("generate", "reward", "reference", "policy", "optimizer", "comm")
    out = {"world_size": dist.world_size, "warmup": warmup, "steps": steps,
           "prompts_per_step": cfg.prompts_per_step, "group_size": cfg.group_size,
           "params_M": round(model.num_params() / 1e6, 3), "amp": cfg.use_amp,
           "step_s": {"median": statistics.median(step_s), "min": min(step_s),
                      "max": max(step_s)},
           "phase_s": {p: med(f"time/{p}") for p in phases},
           "generated_tokens_per_s": med("tokens_per_s"),
           "train_tokens_per_s": statistics.median(h["tokens/train"] / h["time/step"]
                                                   for h in timed),
           "is_main": dist.is_main}
    out["phase_share"] = {p: v / out["step_s"]["median"] for p, v in out["phase_s"].items()}
    # MFU: model FLOPs (real tokens only) over the peak measured here in the dtype in use
    dtype = amp_dtype(cfg, device) or torch.float32
    peak = matmul_peak(device, dtype)
    gen_tok = med("completion_len/mean") * cfg.prompts_per_step * cfg.group_size
    # FLOPs are counted on the tokens computed (each prompt once per group), not on every
    # row's prompt + completion: the MFU of the work done, not of work skipped
    train_tok = med("tokens/unique")
    ctx = med("tokens/train") / (cfg.prompts_per_step * cfg.group_size) / 2  # mean context
    flops = {"generate": model_flops(model, gen_tok, ctx),
             "reference": model_flops(model, train_tok, ctx) if cfg.beta else 0.0,
             "policy": model_flops(model, train_tok, ctx, backward=True) * cfg.num_iterations}
    # the policy's forward+backward alone: its phase less the optimizer (and clipping) and
    # the gradient all-reduce that runs inside the last backward
    secs = dict(out["phase_s"], policy=out["phase_s"]["policy"] - out["phase_s"]["optimizer"]
                - out["phase_s"]["comm"])
    achieved = {k: v / secs[k] / 1e9 if secs[k] > 0 else 0.0 for k, v in flops.items()}
    out["mfu"] = {"peak_gflops_measured": peak, "dtype": str(dtype).replace("torch.", ""),
                  "achieved_gflops": achieved,
                  "mfu_policy": achieved["policy"] / peak,
                  "mfu_step": sum(flops.values()) / out["step_s"]["median"] / 1e9 / peak}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)
        if sheet:
            out["mfu"]["mfu_step_vs_datasheet_bf16"] = \
                sum(flops.values()) / out["step_s"]["median"] / 1e12 / sheet
    # padding: token positions pushed through the policy over the real tokens among them;
    # and over every row's prompt + completion (below 1: prompts computed once per group)
    out["tokens_pushed_over_real"] = med("tokens/processed") / train_tok
    out["tokens_pushed_over_batch"] = med("tokens/processed") / med("tokens/train")
    out["memory"] = peak_memory(device)
    return out


# each switch toggled alone against the config's own value (kv_cache: off only)
ABLATIONS = ["use_amp", "use_tf32", "compile_model", "gradient_checkpointing",
             "fused_optimizer", "offload_reference", "parallel_rewards", "kv_cache"]


def bench_ablations(cfg, warmup: int, steps: int) -> dict:
    """The step section for the config and for each switch flipped alone, in one process."""
    import copy

    task = build_task(cfg)
    runs = {}
    # the base runs first and last: the first run of a process was measured slower here
    for name in ["base"] + ABLATIONS + ["base (again)"]:
        c = copy.deepcopy(cfg)
        if not name.startswith("base"):
            setattr(c, name, not getattr(cfg, name))
        if name == "kv_cache" and not cfg.kv_cache:
            continue
        label = name if name.startswith("base") else f"{name}={getattr(c, name)}"
        print(f"[bench] ablation {label}", file=sys.stderr, flush=True)
        # full recompute is ~20x slower to generate: fewer steps tell the same story
        w, n = (1, 2) if name == "kv_cache" else (warmup, steps)
        runs[label] = bench_step(c, w, n, task=task)
    base = (runs["base"]["step_s"]["median"] + runs["base (again)"]["step_s"]["median"]) / 2
    for r in runs.values():
        r["step_ratio_vs_base"] = r["step_s"]["median"] / base
    return runs


def format_ablations(runs: dict) -> str:
    lines = [f"{'ablation (one switch flipped)':<34} {'s/step':>8} {'vs base':>8} "
             f"{'generate':>9} {'reference':>9} {'policy':>8}"]
    for label, r in runs.items():
        p = r["phase_s"]
        lines.append(f"{label:<34} {r['step_s']['median']:>8.3f} "
                     f"{r['step_ratio_vs_base']:>7.2f}x {p['generate']:>9.3f} "
                     f"{p['reference']:>9.3f} {p['policy']:>8.3f}")
    return "\n".join(lines)


def format_step(r: dict) -> str:
    s = r["step_s"]
    lines = [f"GRPO step: {r['world_size']} process(es), {r['prompts_per_step']} prompts x "
             f"{r['group_size']}, {r['params_M']}M params, amp={r['amp']}, median of "
             f"{r['steps']} after {r['warmup']} warm-up",
             f"  seconds/step   {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f})",
             f"  generated      {r['generated_tokens_per_s']:.0f} tok/s",
             f"  trained        {r['train_tokens_per_s']:.0f} tok/s (prompt + completion)"]
    for p, v in r["phase_s"].items():
        label = {"policy": "policy update", "optimizer": "  of it: optim",
                 "comm": "  of it: comm"}.get(p, p)
        lines.append(f"  {label:<14} {v:.3f}s  {100 * r['phase_share'][p]:5.1f}%")
    m = r["mfu"]
    lines += [f"  matmul peak    {m['peak_gflops_measured']:.0f} GFLOP/s ({m['dtype']}, "
              f"measured now)",
              f"  MFU            policy fwd+bwd {100 * m['mfu_policy']:.1f}%, whole step "
              f"{100 * m['mfu_step']:.1f}% (achieved GFLOP/s: " + ", ".join(
                  f"{k} {v:.0f}" for k, v in m["achieved_gflops"].items()) + ")",
              f"  tokens pushed through the policy / real tokens: "
              f"{r['tokens_pushed_over_real']:.2f} (padding); / all rows' prompt + completion "
              f"tokens: {r['tokens_pushed_over_batch']:.2f} (prompts once per group)",
              "  memory         " + ", ".join(f"{k} {v:.0f}" for k, v in r["memory"].items())]
    return "\n".join(lines)


def bench_scaling(args, rest) -> dict:
    """The step section with 1 process here, then 2 under torchrun, same global batch."""
    import os
    import subprocess
    import tempfile

    cmd = ["--config", args.config, "--only", "step", "--warmup", str(args.warmup),
           "--steps", str(args.steps), *rest]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2):
            out = f"{tmp}/step{n}.json"
            launcher = [sys.executable] if n == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={n}"]
            print(f"[bench] scaling: {n} process(es)", file=sys.stderr, flush=True)
            subprocess.run([*launcher, __file__, *cmd, "--json", out], check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            with open(out) as f:
                runs[n] = json.load(f)["step"]
    t1, t2 = runs[1]["step_s"]["median"], runs[2]["step_s"]["median"]
    return {"runs": runs, "speedup": t1 / t2, "efficiency": t1 / (2 * t2),
            "comm_share_2proc": runs[2]["phase_share"]["comm"]}


def format_scaling(r: dict) -> str:
    a, b = r["runs"][1], r["runs"][2]
    return "\n".join([
        "scaling, same global batch:   1 process  2 processes",
        f"  seconds/step              {a['step_s']['median']:>9.3f}"
        f"  {b['step_s']['median']:>11.3f}",
        f"  comm seconds/step         {a['phase_s']['comm']:>9.3f}  {b['phase_s']['comm']:>11.3f}",
        f"  comm share of step        {100 * a['phase_share']['comm']:>8.1f}%  "
        f"{100 * b['phase_share']['comm']:>10.1f}%",
        f"  speed-up {r['speedup']:.2f}x, scaling efficiency {100 * r['efficiency']:.0f}%"])


def compare(path_a: str, path_b: str) -> str:
    """Ratios B / A of every number the two result files share."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                yield f"{prefix}{k}", v
    a, b = (dict(flat(json.load(open(p)))) for p in (path_a, path_b))
    lines = [f"{'metric':<48} {'A':>12} {'B':>12} {'B/A':>8}"]
    for k in a:
        if k in b and a[k]:
            lines.append(f"{k:<48} {a[k]:>12.4g} {b[k]:>12.4g} {b[k] / a[k]:>8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="default", help="a path or a name in configs/")
    ap.add_argument("--only",
                    choices=["generation", "rewards", "step", "scaling", "ablations"])
    ap.add_argument("--batch", type=int, default=None,
                    help="generation batch (default 64; 16 for a GPU config on a CPU)")
    ap.add_argument("--new-tokens", type=int, default=72)
    ap.add_argument("--repeats", type=int, default=None,
                    help="generation runs (default 5; 2 for a GPU config on a CPU)")
    ap.add_argument("--reward-rows", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2, help="untimed GRPO steps")
    ap.add_argument("--steps", type=int, default=5, help="timed GRPO steps")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
    args, rest = ap.parse_known_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    try:
        cfg = load_config(args.config, parse_cli(rest)[1])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = setup_backends(cfg)
    if cfg.num_train > 20000 and not (cfg.data_path or cfg.pgn_path):
        # timing needs a few batches of prompts, not the 500k games a long run trains on
        # (generating those takes minutes): the prompts drawn differ, the work per step not
        cfg.num_train = 20000
    if resolve_device(cfg).type == "cpu" and cfg.prompts_per_step * cfg.group_size > 128:
        # a GPU-sized batch would take minutes per step here: keep the model, cut the batch
        cfg.prompts_per_step = max(1, 64 // cfg.group_size)
        cfg.compile_model = False
        # full recompute of a large model takes ~1 minute per batch-64 run here
        args.batch, args.repeats = args.batch or 16, args.repeats or 2
        print(f"[bench] CPU: {args.config} assumes GPUs; running it scaled down to "
              f"{cfg.prompts_per_step} prompts x {cfg.group_size} completions per step, "
              f"compile off, generation batch {args.batch} x {args.repeats} runs (the model "
              f"size is kept)", file=sys.stderr, flush=True)
    args.batch, args.repeats = args.batch or 64, args.repeats or 5
    result = {"config": args.config, "machine": platform.processor() or platform.machine(),
              "threads": threads, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    if args.only in (None, "generation"):
        result["generation"] = bench_generation(cfg, args.batch, args.new_tokens, args.repeats)
        print(format_generation(result["generation"]))
    if args.only == "ablations":
        result["ablations"] = bench_ablations(cfg, args.warmup, args.steps)
        print(format_ablations(result["ablations"]))
    if args.only == "scaling":
        result["scaling"] = bench_scaling(args, rest)
        print(format_scaling(result["scaling"]))
    if args.only in (None, "rewards"):
        from mini_grpo.rewards.bench import format_reward_table, run_reward_benchmark
        result["rewards"] = run_reward_benchmark(n=args.reward_rows, seed=cfg.seed,
                                                 workers=cfg.num_reward_workers)
        print(format_reward_table(result["rewards"]))
    if args.only in (None, "step"):
        result["step"] = bench_step(cfg, args.warmup, args.steps)
        if not result["step"]["is_main"]:
            return 0
        print(format_step(result["step"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
