"""What the LM job costs on this machine: wall time, peak resident memory, and where the time
goes, from one run of configs/smollm2_numeric (or `--config smollm2_calculator`, the
calculator job; nothing else heavy beside it):

    .venv/bin/python bench/lm_job_cost.py --out_dir runs/smollm2_numeric_cost \\
        --json bench/lm_job_cost_<cpu>.json [-- extra options for distributed_train.py]

The job runs as a child process (its output passes through); the peak is the child's maximum
RSS (wait4), and each phase's end is the moment its closing line appeared: the base model's
evaluation, an SFT stage, RFT's generation, its SFT steps, the GRPO steps (with the
evaluation after RFT before them), the final evaluation; the child's peak RSS so far (VmHWM)
is read at each of those moments, so the phase that set the peak shows. GRPO's per-step
figures (median time, generation, policy pass; RSS after each step) come from metrics.jsonl,
the accuracies from eval.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from outfile import claim  # noqa: E402

# environment variables that change the job's kernels, allocator or threads: a run records those
# it ran under (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 on a Xeon runs the Zen4's kernel path)
ENV_PREFIXES = ("ONEDNN_", "DNNL_", "MKL_", "OMP_", "MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD")

# the line that closes each phase, in the order they run
PHASES = [("eval_before", re.compile(r"^\[eval\] step 0 sampled")),
          ("sft", re.compile(r"^\[sft\] done in")),
          ("rft_generation", re.compile(r"^\[rft\] \d+/\d+ prompts with an accepted")),
          ("rft_sft", re.compile(r"^\[rft\] done in")),
          # its last step, or the one max_minutes ended it at
          ("grpo", re.compile(r"^step (\d+)/\1 |^\[mini-grpo\] step \d+: max_minutes: GRPO stops")),
          ("eval_after", re.compile(r"^\[eval\] step [1-9]\d* sampled"))]


def proc_gib(pid: int, field: str) -> float | None:
    """A live process's memory figure `field` of /proc/PID/status (VmRSS: resident now,
    VmHWM: its peak so far) in GiB; None off Linux or once the process has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(x.split()[1]) for x in f if x.startswith(f"{field}:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib / 2**20


def measure(out_dir: str, config: str = "smollm2_numeric", extra: list[str] = ()) -> dict:
    """Runs the job once (its output passes through) and returns its figures."""
    env = run_env()  # the user's, before anything of ours runs here
    args = [sys.executable, str(ROOT / "distributed_train.py"), "--config", config,
            f"--out_dir={out_dir}", *extra]
    t0 = time.perf_counter()
    ends: dict[str, float] = {}
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, bufsize=1)
    hwm: dict[str, float] = {}  # the child's peak RSS (GiB) when each phase ended
    for line in p.stdout:
        sys.stdout.write(line)
        for name, pattern in PHASES:
            if name not in ends and pattern.search(line):
                ends[name] = round(time.perf_counter() - t0, 1)
                peak = proc_gib(p.pid, "VmHWM")
                hwm[name] = None if peak is None else round(peak, 2)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the job failed (exit {os.waitstatus_to_exitcode(status)})")
    out = Path(out_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]

    def median(key):  # GRPO steps, the first left out (its shapes are new to oneDNN)
        return round(statistics.median(r[key] for r in steps[1:] or steps), 2) if steps \
            else None  # mode sft: no GRPO step

    phases, start = {}, 0.0
    for name in sorted(ends, key=ends.get):  # in the order they ran (sft_grpo: SFT first)
        phases[name] = round(ends[name] - start, 1)
        start = ends[name]
    ev = json.loads((out / "eval.json").read_text())
    from mini_grpo.dtype_probe import cpu_isa, cpu_name
    # the name alone can be one generic "AMD EPYC" on a Zen4 (AVX-512 BF16) and on a CPU
    # with AVX2 alone: the instruction sets say which kernels ran
    return {"cpu": cpu_name(), "isa": cpu_isa()["flags"], "args": list(extra),
              "wall_s": round(wall, 1),
              "wall_min": round(wall / 60, 1), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
              "phase_s": phases, "peak_rss_gb_by_phase_end": hwm, "grpo_steps": len(steps),
              "grpo_median_s": {k: median(f"time/{k}")
                                for k in ("step", "generate", "reward", "policy", "optimizer")},
              "grpo_rss_gb": [round(r["mem/rss_gb"], 2) for r in steps],
              "grpo_reward": [round(r["reward/mean"], 3) for r in steps],  # the reward curve
              "eval": ev, **env}


def run_env() -> dict:
    """{"env": {...}} with the variables of ENV_PREFIXES set now, or {} where none is."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    return {"env": env} if env else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out_dir", required=True, help="the job's out_dir (new or its own)")
    ap.add_argument("--json", default="", help="write the figures here")
    ap.add_argument("--config", default="smollm2_numeric", help="the job's config")
    ap.add_argument("extra", nargs="*", help="more options for distributed_train.py")
    a = ap.parse_args()
    save = claim(a.json, __file__)  # before the job's minutes
    result = measure(a.out_dir, a.config, a.extra)
    print(json.dumps({k: v for k, v in result.items() if k != "eval"}, indent=1))
    save(result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
