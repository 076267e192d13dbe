"""The LM job's table on the numeric task's held-out questions, from the eval.json of runs of
configs/smollm2_numeric on the same machine:

    python distributed_train.py --config smollm2_numeric                       # the job
    python distributed_train.py --config smollm2_numeric --mode=grpo \\
        --out_dir=runs/smollm2_numeric_grpo                                     # GRPO alone
    python distributed_train.py --config smollm2_numeric --mode=grpo --lora_r=16 --lr=5e-4 \\
        --out_dir=runs/smollm2_numeric_grpo_lora_5e-4                           # with LoRA
    python bench/lm_job_table.py runs/smollm2_numeric runs/smollm2_numeric_grpo \\
        --lora runs/smollm2_numeric_grpo_lora runs/smollm2_numeric_grpo_lora_5e-4 \\
        --out bench/lm_job_<cpu>.json

Rows: the base model (the job's "before"), after the job's SFT or RFT stage where GRPO
followed it ("sft", "rft"), after the whole job ("after", named by its mode), then the other
runs' "after" (GRPO alone, with LoRA); columns: greedy and sampled accuracy (`correct`) with
standard errors, and the gain over the base in points and in standard errors of the
difference. `--minutes`: the runs' wall times as measured (`time`), recorded beside."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from outfile import claim

from mini_grpo.dtype_probe import cpu_name


def accuracy(ev: dict) -> tuple[float, float]:
    p, n = ev["correct"], ev["n"]
    return p, math.sqrt(max(p * (1 - p), 0.0) / n)


def run_config(run: str) -> dict:
    """A run's resolved config.yaml."""
    import yaml

    return yaml.safe_load((Path(run) / "config.yaml").read_text())


def lr_of(run: str) -> float:
    return float(run_config(run)["lr"])


MODES = {"rft_grpo": "RFT+GRPO", "sft_grpo": "SFT+GRPO", "grpo": "GRPO", "sft": "SFT",
         "rft": "RFT"}


def step_median(run: str) -> float | None:
    """The median of a run's GRPO step times (metrics.jsonl): robust to a few steps slowed by
    other work on the machine; None for a run without GRPO steps."""
    with open(Path(run) / "metrics.jsonl") as f:
        steps = [json.loads(line)["time/step"] for line in f if '"time/step"' in line]
    return statistics.median(steps) if steps else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("job", help="run directory of the job (any mode)")
    ap.add_argument("grpo", nargs="?", help="run directory of mode grpo (optional)")
    ap.add_argument("--lora", nargs="*", default=[],
                    help="run directories of mode grpo with lora_r set (optional)")
    ap.add_argument("--minutes", nargs="*", type=float, default=[],
                    help="wall minutes of the runs, in the same order")
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args()
    save = claim(args.out, __file__)
    a = json.loads((Path(args.job) / "eval.json").read_text())
    mode = run_config(args.job)["mode"]
    rows = {"base": a["before"], "SFT": a.get("sft"), "RFT": a.get("rft")}
    if args.grpo:
        rows["GRPO"] = json.loads((Path(args.grpo) / "eval.json").read_text())["after"]
    for run in args.lora:
        rows[f"GRPO, LoRA lr {lr_of(run):g}"] = \
            json.loads((Path(run) / "eval.json").read_text())["after"]
    rows[MODES[mode]] = a["after"]
    base = {m: accuracy(rows["base"][m]) for m in ("greedy", "sampled")}
    table = {}
    print("| model | greedy accuracy | gain | sampled accuracy | gain |")
    print("| --- | --- | --- | --- | --- |")
    for name, ev in rows.items():
        if ev is None:
            continue
        cells, entry = [], {}
        for m in ("greedy", "sampled"):
            p, se = accuracy(ev[m])
            gain = p - base[m][0]
            z = gain / math.sqrt(se ** 2 + base[m][1] ** 2) if name != "base" else 0.0
            entry[m] = {"accuracy": p, "se": se, "gain_points": 100 * gain, "gain_se": z,
                        "n": ev[m]["n"]}
            cells += [f"{100 * p:.1f}% ± {100 * se:.1f}",
                      "" if name == "base" else f"{100 * gain:+.1f} points ({z:.1f} s.e.)"]
        table[name] = entry
        print(f"| {name} | " + " | ".join(cells) + " |")
    result = {"cpu": cpu_name(), "config": "smollm2_numeric", "rows": table,
              "mode": mode, "minutes": dict(zip([mode, "grpo"], args.minutes)),
              "grpo_step_s_median": {name: step_median(d) for name, d in (
                  (mode, args.job), ("grpo", args.grpo),
                  *((f"grpo_lora_lr_{lr_of(d):g}", d) for d in args.lora)) if d}}
    steps = {k: v for k, v in result["grpo_step_s_median"].items() if v is not None}
    if steps:
        print("median GRPO step (s): " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
    save(result, indent=2)


if __name__ == "__main__":
    main()
