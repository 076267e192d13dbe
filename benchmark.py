"""Measures a config: generation throughput (KV cache vs full recompute) and reward scoring.

    python benchmark.py --config default                  # all sections
    python benchmark.py --config default --only generation --repeats 5 --json bench/gen.json

Generation: `--batch` prompts (held-out prompts of the config's task) and exactly
`--new-tokens` new tokens each (EOS is ignored so both paths do the same work), with a randomly
initialised model of the config's size; tokens/s is the median over `--repeats` runs after one
warm-up, with the two paths interleaved so machine noise hits both alike.
Rewards: see mini_grpo/rewards/bench.py.
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
from mini_grpo.precision import autocast, resolve_device, setup_backends
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
    model = build_model(cfg, tok.vocab_size).to(device).eval()

    def run(use_cache: bool) -> float:
        g = torch.Generator(device=device).manual_seed(0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast(cfg, device):
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="default", help="a path or a name in configs/")
    ap.add_argument("--only", choices=["generation", "rewards"], default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=72)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reward-rows", type=int, default=4096)
    ap.add_argument("--json", default=None, help="write the results here")
    args, rest = ap.parse_known_args(argv)
    try:
        cfg = load_config(args.config, parse_cli(rest)[1])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = setup_backends(cfg)
    result = {"config": args.config, "machine": platform.processor() or platform.machine(),
              "threads": threads, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    if args.only in (None, "generation"):
        result["generation"] = bench_generation(cfg, args.batch, args.new_tokens, args.repeats)
        print(format_generation(result["generation"]))
    if args.only in (None, "rewards"):
        from mini_grpo.rewards.bench import format_reward_table, run_reward_benchmark
        result["rewards"] = run_reward_benchmark(n=args.reward_rows, seed=cfg.seed,
                                                 workers=cfg.num_reward_workers)
        print(format_reward_table(result["rewards"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
