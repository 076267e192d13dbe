"""Resident memory and time of GRPO steps on the LM job, per allocator setting, each a process
of its own run one after the other (never beside another heavy job):

    .venv/bin/python bench/memory_steps.py --steps 8 --json out.json \
        --variant keep:. --variant off:.:--cpu_malloc_cache=false

A variant is NAME:CHECKOUT[:EXTRA_ARGS,...]: distributed_train.py of that checkout (its own
mini_grpo and configs/smollm2_numeric.yaml) with `--mode=grpo` (no RFT stage, 8 held-out
questions), checkpoints off; an extra argument written KEY=VALUE, without the leading `--`, is
set in that run's environment instead (ONEDNN_PRIMITIVE_CACHE_CAPACITY=128). Reports per
variant: mem/rss_gb after each step (metrics.jsonl), the process's peak RSS (wait4), the
median step, generation and policy-pass times without the first step, and the wall time.
`--stage sft`: RFT's SFT stage instead (`--mode=rft` on 64 prompts, no SFT before it: the
model's own accepted completions, 32 rows a step in 1024-token micro-batches, as in the job),
reporting the peak RSS, the SFT's tokens/s and the wall time. `--stage job_sft`: the job's own
SFT stage (`--mode=sft`: the task's worked answers, the config's batch, lr and micro-batches),
reporting the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from outfile import claim  # noqa: E402

from mini_grpo.dtype_probe import cpu_name  # noqa: E402


def run(name: str, checkout: Path, extra: list[str], steps: int, work: Path,
        stage: str = "grpo") -> dict:
    out = work / name
    mode = {"grpo": ["--mode=grpo", f"--max_steps={steps}"],
            "sft": ["--mode=rft", "--sft_steps=0", "--rft_num_prompts=64",
                    f"--rft_sft_steps={steps}", "--log_every=1"],
            "job_sft": ["--mode=sft", f"--sft_steps={steps}", "--log_every=1"]}[stage]
    args = [sys.executable, str(checkout / "distributed_train.py"), "--config",
            str(checkout / "configs" / "smollm2_numeric.yaml"), *mode, "--num_eval=8",
            "--save_every=1000000", "--report_to=[]",
            f"--init_from={ROOT / 'models' / 'smollm2-135m-instruct'}", f"--out_dir={out}",
            *(x for x in extra if x.startswith("--"))]
    env = dict(x.split("=", 1) for x in extra if not x.startswith("--"))
    t0 = time.perf_counter()
    p = subprocess.Popen(args, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, **env, "PYTHONPATH": str(checkout)})
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed:\n{p.stderr.read().decode()[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if stage != "grpo":
        tag = "rft" if stage == "sft" else "sft"
        sft = [r for r in rows if f"{tag}/loss" in r]
        return {"variant": name, "args": extra, "peak_rss_gb": round(usage.ru_maxrss / 2**20, 3),
                "sft_tokens_per_s": round(sft[-1][f"{tag}/tokens_per_s"]),
                "loss": [round(r[f"{tag}/loss"], 4) for r in sft], "wall_s": round(wall, 1)}
    steps_ = [r for r in rows if "reward/mean" in r]
    times = [r["time/step"] for r in steps_]

    def median(key):  # without the first step
        return round(statistics.median(r[key] for r in steps_[1:] or steps_), 2)
    return {"variant": name, "args": extra, "rss_gb_per_step": [round(r["mem/rss_gb"], 3)
                                                              for r in steps_],
            "peak_rss_gb": round(usage.ru_maxrss / 2**20, 3),
            "median_step_s": median("time/step"),
            "median_generate_s": median("time/generate"), "median_policy_s": median("time/policy"),
            "step_s": [round(t, 2) for t in times], "wall_s": round(wall, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME:CHECKOUT[:ARGS]")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--stage", choices=["grpo", "sft", "job_sft"], default="grpo")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    save = claim(a.json, __file__)
    results = []
    with tempfile.TemporaryDirectory(prefix="memory_steps_") as work:  # each run's export:
        for v in a.variant:  # ~1.8 GB, gone with the directory
            name, checkout, *rest = v.split(":", 2)
            extra = rest[0].split(",") if rest and rest[0] else []
            r = run(name, Path(checkout).resolve(), extra, a.steps, Path(work), a.stage)
            if a.stage != "grpo":
                print(f"{name}: peak {r['peak_rss_gb']} GB, {r['sft_tokens_per_s']} tok/s, "
                      f"wall {r['wall_s']} s", flush=True)
                results.append(r)
                continue
            print(f"{name}: peak {r['peak_rss_gb']} GB, rss per step {r['rss_gb_per_step']}, "
                  f"median step {r['median_step_s']} s (generation {r['median_generate_s']}, "
                  f"policy {r['median_policy_s']}), wall {r['wall_s']} s", flush=True)
            results.append(r)
    save({"cpu": cpu_name(), "stage": a.stage, "steps": a.steps, "results": results}, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
