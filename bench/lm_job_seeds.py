"""The LM job over several seeds, one run after the other (nothing else heavy beside them), for
choosing its default by measurement (issue 38: RFT + GRPO against GRPO alone, full fine-tuning
against LoRA):

    .venv/bin/python bench/lm_job_seeds.py --name grpo --seeds 1 2 3 \\
        --json bench/lm_job_seeds_<cpu>.json -- --mode=grpo

Each run is bench/lm_job_cost.py's measurement (wall time, peak RSS by wait4, phases, eval.json)
with `--seed=S` (the seed draws the numeric task's training and held-out questions as well as
the sampling, so each seed is scored on its own 500 held-out questions) in
runs/lm_job_seeds/NAME_sS. The JSON gains each run as it ends (a cut session keeps what ran);
it holds runs of several names, and one of this script's files is the only one it writes to.
The table: per name, each seed's greedy and sampled held-out accuracy before and after, time
and peak, then their mean and the spread (sample standard deviation) over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_job_cost import measure  # noqa: E402

KIND = "mini-grpo bench/lm_job_seeds.py"


def row(name: str, seed: int, r: dict) -> dict:
    ev = r["eval"]

    def acc(stage, mode):
        return round(ev[stage][mode]["correct"], 4) if stage in ev else None
    return {"name": name, "seed": seed, "cpu": r["cpu"], "isa": r.get("isa"), "args": r["args"],
            "wall_min": r["wall_min"], "peak_rss_gb": r["peak_rss_gb"],
            "grpo_steps": r["grpo_steps"],  # fewer than max_steps where max_minutes ended it
            "grpo_median_step_s": r["grpo_median_s"]["step"], "phase_s": r["phase_s"],
            "peak_rss_gb_by_phase_end": r.get("peak_rss_gb_by_phase_end"),
            "n": ev["after"]["greedy"]["n"],
            "greedy_before": acc("before", "greedy"), "greedy_after": acc("after", "greedy"),
            "sampled_before": acc("before", "sampled"),
            "sampled_after": acc("after", "sampled"),
            # between them, where the job evaluates after its SFT or RFT stage too
            **{f"{mode}_{stage}": acc(stage, mode) for stage in ("sft", "rft") if stage in ev
               for mode in ("greedy", "sampled")},
            "length_after": round(ev["after"]["greedy"]["length"], 1),
            "grpo_reward": r.get("grpo_reward"),  # each GRPO step's mean reward: the curve
            **({"env": r["env"]} if "env" in r else {})}


def table(runs: list[dict]) -> str:
    lines = ["| name | seed | greedy before -> after | sampled after | minutes | peak GB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        for r in mine:
            lines.append(f"| {name} | {r['seed']} | {r['greedy_before']:.1%} -> "
                         f"{r['greedy_after']:.1%} | {r['sampled_after']:.1%} | "
                         f"{r['wall_min']} | {r['peak_rss_gb']} |")
        if len(mine) > 1:
            g = [r["greedy_after"] for r in mine]
            lines.append(f"| {name} | mean of {len(mine)} | {statistics.mean(g):.1%} "
                         f"(sd {statistics.stdev(g):.1%}) | "
                         f"{statistics.mean(r['sampled_after'] for r in mine):.1%} | "
                         f"{statistics.mean(r['wall_min'] for r in mine):.1f} | "
                         f"{max(r['peak_rss_gb'] for r in mine)} (max) |")
    return "\n".join(lines)


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not this script's JSON ({e}); choose another") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise SystemExit(f"{path}: not written by this script; it is left alone")
    return data["runs"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True, help="what these runs are (a table row's name)")
    ap.add_argument("--seeds", type=int, nargs="+", required=True)
    ap.add_argument("--config", default="smollm2_numeric")
    ap.add_argument("--json", required=True, help="runs land here (this script's file only)")
    ap.add_argument("extra", nargs="*", help="more options for distributed_train.py")
    a = ap.parse_args()
    path = Path(a.json)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip() or "unknown"  # the code each run ran
    runs = load(path)
    outs = [Path(f"runs/lm_job_seeds/{a.name}_s{seed}") for seed in a.seeds]
    for out in outs:  # a finished run there would resume and time nothing
        if out.exists():
            raise SystemExit(f"{out} exists: a run of this name and seed ran; remove it first")
    for seed, out in zip(a.seeds, outs):
        r = measure(str(out), a.config, [*a.extra, f"--seed={seed}"])
        runs = [x for x in runs if (x["name"], x["seed"]) != (a.name, seed)]
        runs.append({**row(a.name, seed, r), "commit": commit})
        path.write_text(json.dumps({"kind": KIND, "runs": runs}, indent=1) + "\n")
        print(table(runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
