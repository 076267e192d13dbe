"""Measures a config: generation throughput, reward scoring, GRPO steps, 1 vs 2 processes.

    python benchmark.py --config production.yaml          # every section, within --budget_s
    python benchmark.py --config default --only generation --repeats 5 --json bench/gen.json
    python benchmark.py --config smollm2_135m --only generation   # native vs vLLM vs HF
    python benchmark.py --config default --only step --warmup 2 --steps 5
    torchrun --standalone --nproc_per_node=2 benchmark.py --config default --only step
    python benchmark.py --config default --only scaling   # the step section with 1 process,
                                                          # then 2 under torchrun
    python benchmark.py --config default --only ablations # each speed switch flipped alone
    python benchmark.py --only logits_memory               # chunked LM head: peak memory
    python benchmark.py --config smollm2_135m --only lora   # full fine-tuning vs LoRA r=16
    python benchmark.py --compare A.json B.json           # ratios of B over A

Every section builds its run with mini_grpo.run.setup from a copy of the config (overrides
never touch the caller's) and measures the GRPO loop through the metrics it logs.

Time budget (CPU; mini_grpo/benchmarks/budget.py): a short probe of this machine (a timed
forward and a few cached sampling steps of the config's model, seconds at most) feeds `plan()`,
which picks the sizes (generation batch and repeats, whether the full-recompute baseline runs
whole or for a few decode steps, extrapolated and labelled so, reward rows, prompts per GRPO
step, warm-up and timed steps) so that the whole command takes about --budget_s seconds (600 on
a CPU; none on a GPU unless given). The plan and its estimate per section are printed first;
whatever it shrinks or skips is said. Sizes given on the command line are kept as they are.
Progress goes to stderr: one updating line on a terminal, plain lines otherwise.

Generation with init_from a Hugging Face directory: the rollout engines side by side (native,
vLLM, transformers' generate; mini_grpo/benchmarks/engines.py). Otherwise `batch` held-out
prompts, exactly `new_tokens` new tokens each (EOS ignored, so
both paths do the same work), the config's model with random weights; tokens/s is the median
over `repeats` runs after one warm-up, the two paths interleaved so machine noise hits both.
Rewards: see mini_grpo/benchmarks/rewards.py. Step: real GRPO steps of the config from random
weights (or `--init_from=CKPT`); medians over the timed steps of seconds per step and per
phase, tokens/s, MFU, and the seconds in communication: DDP's gradient all-reduce, or FSDP's
all-gathers and reduce-scatters in the policy update (`time/comm`) and, under fsdp, in
sampling and the reference passes before it (`time/comm_rollout`).
Scaling: the same global batch with 1 process, 2 with DDP and 2 with FSDP; efficiency =
T1 / (2 x T2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

import torch

from mini_grpo import fsdp
from mini_grpo.benchmarks.budget import (
    SECTIONS,
    Plan,
    Probe,
    Progress,
    Shape,
    format_plan,
    overridden,
    plan,
    probe_machine,
    step_in_own_process,
)
from mini_grpo.benchmarks.engines import bench_engines, format_engines
from mini_grpo.benchmarks.lora_vs_full import bench_lora, format_lora
from mini_grpo.benchmarks.shapes import ensure as ensure_shape
from mini_grpo.config import ConfigError, load_config, parse_cli
from mini_grpo.dtype_probe import cpu_name
from mini_grpo.engines.native import generate
from mini_grpo.outputs import check_file, write_json, written_by
from mini_grpo.policy import is_model_dir

# ---- sections ----

def bench_generation(cfg, p: Plan, task) -> dict:
    from mini_grpo.run import setup

    examples = (task.eval * p.gen_batch)[:p.gen_batch]
    need = max(len(ex.prompt) for ex in examples) + 1 + p.new_tokens
    # learned positions: the model needs room for prompt + new_tokens
    with setup(overridden(cfg, block_size=max(cfg.block_size, need)), log=False,
               task=task) as run:
        tok, device, model = run.tok, run.device, run.model.eval()
        prompts = [tok.encode(ex.prompt, bos=True) for ex in examples]

        def timed_run(use_cache: bool) -> float:
            n = p.new_tokens if use_cache else p.recompute_steps
            g = torch.Generator(device=device).manual_seed(0)
            _sync(device)
            t0 = time.perf_counter()
            with run.precision.autocast(generation=True):
                r = generate(model, prompts, n, eos_id=-1, pad_id=tok.pad_id, generator=g,
                             use_cache=use_cache)
            _sync(device)
            assert r.completion_ids.shape == (p.gen_batch, n)
            seconds = time.perf_counter() - t0
            if n < p.new_tokens:  # recompute step t runs over P + t tokens: scale to all N
                P, N = max(map(len, prompts)), p.new_tokens
                seconds *= (N * P + N * (N - 1) / 2) / (n * P + n * (n - 1) / 2)
            return p.gen_batch * p.new_tokens / seconds

        prog = Progress("generation", 2 * (p.repeats + 1), p.estimate_s.get("generation"))
        rates = {"kv_cache": [], "recompute": []}
        for i in range(p.repeats + 1):  # run 0 warms up
            for j, (name, cached) in enumerate((("kv_cache", True), ("recompute", False))):
                prog.update(2 * i + j, f"{'warm-up' if i == 0 else f'run {i}'} {name}")
                rate = timed_run(cached)
                if i:
                    rates[name].append(rate)
        prog.update(2 * (p.repeats + 1), "done")
        prog.done()
        med = {k: statistics.median(v) for k, v in rates.items()}
        return {"batch": p.gen_batch, "new_tokens": p.new_tokens, "repeats": p.repeats,
                "recompute_steps": p.recompute_steps,
                "recompute_extrapolated": p.recompute_steps < p.new_tokens,
                "params_M": round(model.num_params() / 1e6, 3), "device": str(device),
                "precision": run.precision.describe(),
                "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
                "runs": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                "speedup_kv_vs_recompute": round(med["kv_cache"] / med["recompute"], 2)}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def format_generation(r: dict) -> str:
    t = r["tokens_per_s"]
    note = f" (over {r['recompute_steps']} decode steps, extrapolated to " \
        f"{r['new_tokens']})" if r["recompute_extrapolated"] else ""
    return "\n".join([
        f"generation: batch {r['batch']}, {r['new_tokens']} new tokens, {r['params_M']}M params, "
        f"{r['device']}, {r['precision']}, median of {r['repeats']}",
        f"  {'KV cache':<12} {t['kv_cache']:>10.0f} tok/s",
        f"  {'recompute':<12} {t['recompute']:>10.0f} tok/s{note}",
        f"  speed-up     {r['speedup_kv_vs_recompute']:>10.2f}x"])


def matmul_peak(device, dtype, n: int = 2048, repeats: int = 20) -> float:
    """Measured peak of this device: GFLOP/s of an n x n matmul in `dtype`, best of
    `repeats` runs into a preallocated output (noise on a shared machine only slows runs
    down, so the best run is the estimate of the peak)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, b, out=c)
        _sync(device)
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


def bench_step(cfg, warmup: int, steps: int, prompts_per_step: int | None = None,
               task=None, expected_s: float | None = None) -> dict:
    """Real GRPO steps through the trainer (alone, or as one rank under torchrun), measured
    from the metrics it writes to metrics.jsonl."""
    from mini_grpo.run import setup
    from mini_grpo.trainer import train_grpo

    with tempfile.TemporaryDirectory() as tmp:
        c = overridden(cfg, max_steps=warmup + steps, eval_every=10**9, save_every=10**9,
                       log_every=1, out_dir=tmp, resume="never", mode="grpo",
                       prompts_per_step=prompts_per_step or cfg.prompts_per_step)
        with setup(c, task=task if task is not None else True) as run:
            if run.logger:
                run.logger.console = sys.stderr
                run.logger.prefix = f"[bench] step section ({warmup} warm-up + {steps} timed" \
                    + (f", ~{expected_s:.0f}s planned" if expected_s else "") + "): "
            run.freeze_reference()
            train_grpo(run)
            model, device, dist, prec = run.model, run.device, run.dist, run.precision
            bytes_held = fsdp.memory_report(model)
            rows = [json.loads(line) for line in open(f"{tmp}/metrics.jsonl")] \
                if dist.is_main else []
    if not dist.is_main:
        return {"is_main": False}
    timed = [r for r in rows if "time/step" in r][warmup:]
    med = lambda key: statistics.median(h[key] for h in timed)
    step_s = [h["time/step"] for h in timed]
    phases = ("sync", "generate", "reward", "reference", "comm_rollout", "policy", "optimizer",
              "comm")
    out = {"world_size": dist.world_size, "warmup": warmup, "steps": steps,
           "prompts_per_step": c.prompts_per_step, "group_size": c.group_size,
           "params_M": round(model.num_params() / 1e6, 3), "precision": prec.describe(),
           "step_s": {"median": statistics.median(step_s), "min": min(step_s),
                      "max": max(step_s)},
           "per_step": {"step_s": step_s,
                        "completion_len": [h["completion_len/mean"] for h in timed],
                        **({"tool_calls": [h["tools/calls"] for h in timed]}
                           if timed and "tools/calls" in timed[0] else {})},
           "phase_s": {p: med(f"time/{p}") for p in phases},
           "generated_tokens_per_s": med("tokens_per_s"),
           "train_tokens_per_s": statistics.median(h["tokens/train"] / h["time/step"]
                                                   for h in timed),
           "is_main": True}
    out["phase_share"] = {p: v / out["step_s"]["median"] for p, v in out["phase_s"].items()}
    # MFU: model FLOPs (real tokens only) over the peak measured here in the dtype in use
    dtype = prec.dtype or torch.float32
    peak = matmul_peak(device, dtype)
    rows_per_step = c.prompts_per_step * c.group_size
    gen_tok = med("completion_len/mean") * rows_per_step
    # FLOPs are counted on the tokens computed (each prompt once per group), not on every
    # row's prompt + completion: the MFU of the work done, not of work skipped
    train_tok = med("tokens/unique")
    ctx = med("tokens/train") / rows_per_step / 2  # mean context
    flops = {"generate": model_flops(model, gen_tok, ctx),
             "reference": model_flops(model, train_tok, ctx) if c.beta else 0.0,
             "policy": model_flops(model, train_tok, ctx, backward=True) * c.num_iterations}
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
    out["bytes_MiB"] = {k: v / 2**20 for k, v in bytes_held.items()}  # rank 0's
    return out


# each switch flipped alone against the config's own value (kv_cache: off only)
ABLATIONS = ["use_amp", "use_tf32", "compile_model", "gradient_checkpointing",
             "fused_optimizer", "offload_reference", "reward_executor", "kv_cache"]


def _flipped(cfg, name: str):
    if name == "reward_executor":
        return "serial" if cfg.reward_executor != "serial" else "process"
    return not getattr(cfg, name)


def bench_ablations(cfg, warmup: int, steps: int) -> dict:
    """The step section for the config and for each switch flipped alone, in one process."""
    from mini_grpo.tasks import build_task

    task = build_task(cfg)
    names = ["base"] + [n for n in ABLATIONS if n != "kv_cache" or cfg.kv_cache] + \
        ["base (again)"]  # the base runs first and last: a process's first run ran slower
    prog = Progress("ablations", len(names))
    runs = {}
    for i, name in enumerate(names):
        c = cfg if name.startswith("base") else overridden(cfg, **{name: _flipped(cfg, name)})
        label = name if name.startswith("base") else f"{name}={getattr(c, name)}"
        prog.update(i, label)
        # full recompute is ~20x slower to generate: fewer steps tell the same story
        w, n = (1, 2) if name == "kv_cache" else (warmup, steps)
        runs[label] = bench_step(c, w, n, task=task)
    prog.update(len(names), "done")
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
             f"{r['group_size']}, {r['params_M']}M params, {r['precision']}, median of "
             f"{r['steps']} after {r['warmup']} warm-up",
             f"  seconds/step   {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f})",
             f"  generated      {r['generated_tokens_per_s']:.0f} tok/s",
             f"  trained        {r['train_tokens_per_s']:.0f} tok/s (prompt + completion)"]
    for p, v in r["phase_s"].items():
        label = {"policy": "policy update", "optimizer": "  of it: optim",
                 "comm": "  of it: comm", "comm_rollout": "comm before it"}.get(p, p)
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
    """The step section with 1 process here, then 2 under torchrun with DDP and with FSDP,
    same global batch."""
    import subprocess

    cmd = ["--config", args.config, "--only", "step", "--warmup", str(args.warmup or 2),
           "--steps", str(args.steps or 5), *rest]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, n, extra in (("1", 1, []), ("2", 2, ["--parallelism=ddp"]),
                               ("2-fsdp", 2, ["--parallelism=fsdp"])):
            out = f"{tmp}/step{name}.json"
            launcher = [sys.executable] if n == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={n}"]
            print(f"[bench] scaling: {name} process(es)", file=sys.stderr, flush=True)
            subprocess.run([*launcher, __file__, *cmd, *extra, "--json", out], check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            with open(out) as f:
                runs[name] = json.load(f)["step"]
    t1, t2, tf = (runs[k]["step_s"]["median"] for k in ("1", "2", "2-fsdp"))
    return {"runs": runs, "speedup": t1 / t2, "efficiency": t1 / (2 * t2),
            "comm_share": {k: comm_share(v) for k, v in runs.items()}, "fsdp_speedup": t1 / tf}


def comm_share(step: dict) -> float:
    """The share of a step spent in collectives (overlapped with computation or not)."""
    share = step["phase_share"]
    return share["comm"] + share.get("comm_rollout", 0.0)


def format_scaling(r: dict) -> str:
    a, b, c = (r["runs"][k] for k in ("1", "2", "2-fsdp"))
    mem = [x.get("memory", {}).get("rss_peak_MiB", float("nan")) for x in (a, b, c)]
    return "\n".join([
        "scaling, same global batch:   1 process  2 x DDP  2 x FSDP",
        f"  seconds/step              {a['step_s']['median']:>9.3f}"
        f"  {b['step_s']['median']:>7.3f}  {c['step_s']['median']:>8.3f}",
        f"  comm share of step        {100 * comm_share(a):>8.1f}%  "
        f"{100 * comm_share(b):>6.1f}%  {100 * comm_share(c):>7.1f}%",
        f"    of it in sampling, ref  {'':>9}  {'':>7}  "
        f"{100 * c['phase_share'].get('comm_rollout', 0.0):>7.1f}%",
        f"  peak RSS, MiB (rank 0)    {mem[0]:>9.0f}  {mem[1]:>7.0f}  {mem[2]:>8.0f}",
        f"  DDP speed-up {r['speedup']:.2f}x (efficiency {100 * r['efficiency']:.0f}%), "
        f"FSDP {r['fsdp_speedup']:.2f}x"])


def _result_file(path: str) -> dict:
    """A results file's JSON object; ConfigError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read a results file "
                          f"({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a results file (a JSON object)")
    return data


def compare(path_a: str, path_b: str) -> str:
    """Ratios B / A of every number the two result files share."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                yield f"{prefix}{k}", v
    a, b = (dict(flat(_result_file(p))) for p in (path_a, path_b))
    lines = [f"{'metric':<48} {'A':>12} {'B':>12} {'B/A':>8}"]
    for k in a:
        if k in b and a[k]:
            lines.append(f"{k:<48} {a[k]:>12.4g} {b[k]:>12.4g} {b[k] / a[k]:>8.3f}")
    return "\n".join(lines)


BENCH_JSON = "benchmark.py"  # in the files --json writes: it replaces those alone


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="default", help="a path or a name in configs/")
    ap.add_argument("--only", choices=[*SECTIONS, "scaling", "ablations", "logits_memory",
                                       "lora"])
    ap.add_argument("--rounds", type=int, default=2, help="--only lora: alternating rounds")
    ap.add_argument("--budget_s", type=float, default=None,
                    help="seconds the command should take (default 600 on a CPU, none on a "
                         "GPU); 0 = no budget, the full sizes")
    ap.add_argument("--batch", type=int, default=None, help="generation batch (default 64)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 72")
    ap.add_argument("--repeats", type=int, default=None, help="generation runs (default 5)")
    ap.add_argument("--reward-rows", type=int, default=None, help="default 4096")
    ap.add_argument("--warmup", type=int, default=None, help="untimed GRPO steps (default 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed GRPO steps (default 5)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
    args, rest = ap.parse_known_args(argv)
    if args.compare:
        try:
            print(compare(*args.compare))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        overrides = parse_cli(rest)[1]
        cfg = load_config(args.config, overrides)
        if args.json:  # before the minutes of measuring: never over a file of the user's
            check_file(args.json, written_by(BENCH_JSON))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.task == "chess_fen" and cfg.task_args["num_train"] > 20000 and not (
            cfg.data_path or cfg.task_args["pgn_path"]):
        # timing needs a few batches of prompts, not the 500k games a long run trains on
        # (generating those takes minutes): the prompts drawn differ, the work per step not
        cfg = overridden(cfg, task_args={**cfg.task_args, "num_train": 20000})
    on_cpu = not torch.cuda.is_available() or cfg.device == "cpu"
    if on_cpu and cfg.compile_model:
        cfg = overridden(cfg, compile_model=False)  # ~30 s cold start, slower on a CPU
        print("[bench] CPU: compile_model off (a ~30 s cold start per run, slower than "
              "eager on a CPU)", file=sys.stderr)
    ensure_shape(cfg.init_from)  # a known model shape's directory, built on first use
    budget = args.budget_s if args.budget_s is not None else (600.0 if on_cpu else None)
    budget = budget or None  # 0 = none
    sections = (args.only,) if args.only in SECTIONS else SECTIONS if args.only is None else ()
    fixed = {k: v for k, v in (("gen_batch", args.batch), ("new_tokens", args.new_tokens),
                               ("repeats", args.repeats), ("reward_rows", args.reward_rows),
                               ("warmup", args.warmup), ("steps", args.steps)) if v is not None}
    if "prompts_per_step" in overrides:
        fixed["prompts_per_step"] = cfg.prompts_per_step
    from mini_grpo.tasks import build_task

    task = build_task(cfg) if sections else None
    # on a Hugging Face directory the generation section compares the rollout engines, with
    # sizes of its own (the step's): the budget plans the other sections
    engines = "generation" in sections and bool(cfg.init_from) and is_model_dir(cfg.init_from)
    planned = tuple(x for x in sections if not (engines and x == "generation"))
    probe = None
    if planned and budget:
        probe, shape, cfg = probe_machine(cfg, task)
        # the probe's own time counts against the budget
        p = plan(probe, shape, budget - probe.seconds, planned, fixed, cfg.prompts_per_step)
    else:
        p = plan(Probe(0.0, 0.0, 0.0, 0.0), Shape(1, 1, cfg.group_size), None, planned, fixed,
                 cfg.prompts_per_step)
    if planned:
        print(format_plan(p, probe, budget), file=sys.stderr, flush=True)
    result = {"config": args.config, "cpu": cpu_name(), "machine": platform.machine(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "budget_s": budget, "plan": asdict(p), "probe": asdict(probe) if probe else None}
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    t_start = clock = time.perf_counter()
    result["section_s"] = {}

    def lap(section):  # wall seconds of each section, beside the plan's estimate
        nonlocal clock
        result["section_s"][section] = time.perf_counter() - clock
        clock = time.perf_counter()

    if engines:
        result["engines"] = bench_engines(cfg, task, args.repeats or 3, lambda name: (
            step_in_own_process(__file__, args.config, [*rest, f"--rollout_engine={name}"],
                                args.warmup or 1, args.steps or 2)))
        print(format_engines(result["engines"]))
        lap("generation")
    elif "generation" in sections:
        result["generation"] = bench_generation(cfg, p, task)
        print(format_generation(result["generation"]))
        lap("generation")
    if args.only == "ablations":
        result["ablations"] = bench_ablations(cfg, args.warmup or 1, args.steps or 4)
        print(format_ablations(result["ablations"]))
    if args.only == "scaling":
        result["scaling"] = bench_scaling(args, rest)
        print(format_scaling(result["scaling"]))
    if args.only == "lora":
        result["lora"] = bench_lora(__file__, args.config, rest, cfg.lora_r or 16,
                                    args.warmup or 1, args.steps or 3, args.rounds)
        print(format_lora(result["lora"]))
    if args.only == "logits_memory":
        from mini_grpo.benchmarks.logits import format_logits_memory, logits_memory
        result["logits_memory"] = logits_memory(device="cpu" if on_cpu else "cuda")
        print(format_logits_memory(result["logits_memory"]))
    if "rewards" in sections:
        from mini_grpo.benchmarks.rewards import format_reward_table, run_reward_benchmark
        result["rewards"] = run_reward_benchmark(n=p.reward_rows, seed=cfg.seed,
                                                 workers=cfg.num_reward_workers)
        print(format_reward_table(result["rewards"]))
        lap("rewards")
    if "step" in sections:
        result["step"] = bench_step(cfg, p.warmup, p.steps, p.prompts_per_step, task=task,
                                    expected_s=p.estimate_s.get("step"))
        if not result["step"]["is_main"]:
            return 0
        print(format_step(result["step"]))
        lap("step")
    result["seconds"] = time.perf_counter() - t_start + (probe.seconds if probe else 0.0)
    print(f"[bench] done in {result['seconds']:.0f}s (" + ", ".join(
        f"{k} {v:.0f}s" + (f" of ~{p.estimate_s[k]:.0f}" if k in p.estimate_s else "")
        for k, v in result["section_s"].items()) + (f", probe {probe.seconds:.0f}s" if probe
                                                    else "") + ")", file=sys.stderr)
    if args.json:
        try:
            write_json(args.json, result, BENCH_JSON, indent=2)
        except ConfigError as e:  # a file put there while this ran
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
