"""Short GRPO runs from one saved SFT checkpoint, one variant after the other, for screening
the levers of issue 70 (learning rate, losses, estimators, group size, ...) before any gets the
full budget and 3 seeds:

    python distributed_train.py --config smollm2_numeric --mode=sft --num_val=200 \\
        --out_dir=runs/screen_sft          # the SFT stage once, its validation prompts apart
    .venv/bin/python bench/rl_screen.py --sft runs/screen_sft/sft/step_0000060.pt --steps 25 \\
        --json bench/rl_screen_<cpu>.json base: lr_2e-5:--lr=2e-5 rloo:--advantage_estimator=rloo

Each variant is `NAME:FLAGS` (FLAGS split on spaces, added to the LM job's config with
--mode=grpo from the checkpoint). The screen chooses on the training reward (its mean over the last
third of the steps against the first third) and on a validation split of the training
questions (`--num_val`, default 200, set apart by the config's `num_val`; the SFT checkpoint
must be trained with the same), never on the held-out set a result is reported on, which these
runs do not evaluate. Also recorded:
the diagnostics of a flat reward (zero_spread_frac, update_size, grad_norm, entropy, clip
fractions), the median step time and the peak RSS (wait4). The JSON gains each run as it ends;
`bench/rl_screen.py --table FILE` prints its runs as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from outfile import claim  # noqa: E402

from mini_grpo.dtype_probe import cpu_name  # noqa: E402

DIAGNOSTICS = ("reward/mean", "zero_spread_frac", "update_size", "grad_norm", "entropy",
               "clip_low", "clip_high", "completion_len/mean")


def run_variant(name: str, flags: list[str], a) -> dict:
    out = ROOT / "runs" / "rl_screen" / name
    argv = [sys.executable, str(ROOT / "distributed_train.py"), "--config", "smollm2_numeric",
            "--mode=grpo", f"--init_from={a.sft}", f"--max_steps={a.steps}", "--max_minutes=0",
            f"--num_val={a.num_val}", f"--out_dir={out}", f"--seed={a.seed}",
            "--resume=never", "--save_every=100000", "--report_to=[]", *flags]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(("[eval]", "[mini-grpo] step", "step ", "[sft] step")) \
                or "error" in line.lower():
            print(f"  {name}: {line.rstrip()}", flush=True)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name}: exit {os.waitstatus_to_exitcode(status)}\n"
                         + "".join(lines[-20:]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    steps = [r for r in rows if "reward/mean" in r and "step" in r]
    third = max(1, len(steps) // 3)
    ev = json.loads((out / "eval.json").read_text())

    def mean(key, part):
        vals = [r[key] for r in part if key in r]
        return round(statistics.fmean(vals), 6) if vals else None

    return {"name": name, "flags": flags, "seed": a.seed, "steps": len(steps),
            "reward_first_third": mean("reward/mean", steps[:third]),
            "reward_last_third": mean("reward/mean", steps[-third:]),
            "diagnostics_mean": {k: mean(k, steps) for k in DIAGNOSTICS},
            # a variant of another mode (--mode=rft: RFT on the model's own samples) has no
            # GRPO steps: its reward and step figures are None, its validation says it all
            "median_step_s": round(statistics.median(r["time/step"] for r in steps), 2)
            if steps else None,
            "wall_min": round((time.monotonic() - t0) / 60, 2),
            "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
            # training questions set apart (num_val), never the held-out set
            "validation": {stage: {mode: ev[stage][mode].get("correct") for mode in ev[stage]}
                         for stage in ev if isinstance(ev[stage], dict)
                         and "greedy" in ev[stage]}}


def table(result: dict) -> str:
    """The runs of a screen's JSON as a markdown table, the SFT checkpoint's row first."""
    rows = ["| variant | flags | steps | train reward, first -> last third | validation greedy "
            "| validation sampled | zero-spread | update size | step s | peak RSS GB |",
            "| --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in result["runs"]:
        v, d = r["validation"], r["diagnostics_mean"]
        reward = "-" if r["reward_first_third"] is None else \
            f"{r['reward_first_third']:.3f} -> {r['reward_last_third']:.3f}"
        after = v.get("after", {})
        rows.append(
            f"| {r['name']} | `{' '.join(r['flags'])}` | {r['steps']} | {reward} | "
            f"{v['before']['greedy']:.3f} -> {after.get('greedy', float('nan')):.3f} | "
            f"{v['before']['sampled']:.3f} -> {after.get('sampled', float('nan')):.3f} | "
            + " | ".join("-" if x is None else f"{x:.3g}" for x in (
                d["zero_spread_frac"], d["update_size"], r["median_step_s"], r["peak_rss_gb"]))
            + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if sys.argv[1:2] == ["--table"]:  # bench/rl_screen.py --table FILE: print, run nothing
        print(table(json.loads(Path(sys.argv[2]).read_text())))
        return
    ap.add_argument("--sft", required=True, help="the SFT stage's checkpoint to start from")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--num_val", type=int, default=200,
                    help="training questions set apart for validation (the SFT run's own)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--json", help="add each run to this file (one this script wrote)")
    ap.add_argument("variants", nargs="+", help="NAME:FLAGS ('base:' for the job's own)")
    a = ap.parse_args()
    save = claim(a.json, __file__)
    result = json.loads(Path(a.json).read_text()) if a.json and Path(a.json).is_file() else {}
    for stale in ("steps", "seed"):  # each run's own now (earlier files held one for all)
        result.pop(stale, None)
    result.update({"cpu": cpu_name(), "sft": a.sft})
    result.setdefault("runs", [])
    for spec in a.variants:
        name, _, flags = spec.partition(":")
        print(f"[screen] {name}: {flags or '(the job as it is)'}", flush=True)
        r = run_variant(name, flags.split(), a)
        print(f"[screen] {name}: train reward {r['reward_first_third']} -> "
              f"{r['reward_last_third']}, update_size {r['diagnostics_mean']['update_size']}, "
              f"validation {r['validation']}", flush=True)
        result["runs"] = [x for x in result["runs"] if x["name"] != name] + [r]
        save(result, indent=2)


if __name__ == "__main__":
    main()
