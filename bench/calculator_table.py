"""The calculator job's table: the base model and the trained one, each with and without the
calculator tool, on the held-out questions, from two runs of configs/smollm2_calculator and
two evaluations of the base model, on the same machine (the same seed: the same 600
questions):

    python bench/lm_job_cost.py --config smollm2_calculator --out_dir runs/smollm2_calculator \
        --json bench/calculator_job_<cpu>.json                                   # with the tool
    python bench/lm_job_cost.py --config smollm2_calculator \
        --out_dir runs/smollm2_calculator_notools --json bench/calculator_job_notools_<cpu>.json \
        -- --tools=[]                                                             # without
    mini-grpo evaluate --checkpoint models/smollm2-135m-instruct --task=calculator \
        --num_eval=600 --block_size=512 --max_new_tokens=80 --max_tool_calls=2 \
        --tools=[calculator] --json runs/calculator_base_tools.json   # and --tools=[] for
                                                                      # runs/calculator_base.json
    python bench/calculator_table.py runs/smollm2_calculator runs/smollm2_calculator_notools \
        runs/calculator_base_tools.json runs/calculator_base.json \
        --out bench/calculator_table_<cpu>.json

Rows: the base model without and with tools; after SFT (the runs' "before": SFT on the
demonstrations, or on the bare answers without tools); trained (SFT, then GRPO: the runs'
"after", the same steps). Columns: greedy accuracy (`correct`) with its standard error on
3-digit products, on the other kinds and on all, and tool calls per question. Then the
trained model's gain from the tool on 3-digit products and on all questions, in points and
in standard errors of the difference (Agresti-Coull's: see `accuracy`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from outfile import claim

from mini_grpo.dtype_probe import cpu_name

KINDS = ("mul3", "mixed", "convert")


def accuracy(ev: dict, kind: str = "") -> tuple[float, float, int]:
    """(correct, its standard error, n) of a greedy evaluation, over one kind or all. The
    standard error is Agresti-Coull's (two successes and two failures added): a count of 0 or
    of n has none of its own, and the plain one would call it certain."""
    key = f"{kind}/" if kind else ""
    p, n = ev[f"{key}correct"], int(ev[f"{key}n"])
    q = (p * n + 2) / (n + 4)
    return p, math.sqrt(q * (1 - q) / (n + 4)), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tools", help="run directory of the job with the calculator")
    ap.add_argument("notools", help="run directory of the same job with tools=[]")
    ap.add_argument("base_tools", help="`mini-grpo evaluate --json` of the base, with tools")
    ap.add_argument("base", help="the same without tools")
    ap.add_argument("--out", help="JSON file to write")
    a = ap.parse_args()
    save = claim(a.out, __file__)

    def read(path):
        return json.loads(Path(path).read_text())

    with_tools, without = read(Path(a.tools) / "eval.json"), read(Path(a.notools) / "eval.json")
    rows = {"base, no tools": read(a.base)["greedy"],
            "base, with tools": read(a.base_tools)["greedy"],
            "after SFT, no tools": without["before"]["greedy"],
            "after SFT, with tools": with_tools["before"]["greedy"],
            "trained, no tools": without["after"]["greedy"],
            "trained, with tools": with_tools["after"]["greedy"]}
    table = {}
    lines = ["| model | 3-digit products | mixed | conversions | all | tool calls per question |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, ev in rows.items():
        cells = {k: accuracy(ev, k) for k in (*KINDS, "")}
        table[name] = {k or "all": {"correct": p, "se": se, "n": n}
                       for k, (p, se, n) in cells.items()}
        table[name]["tool_calls"] = ev.get("tools/calls", 0.0)
        lines.append(f"| {name} | " + " | ".join(
            f"{100 * p:.1f}% ± {100 * se:.1f} (n={n})" for p, se, n in cells.values()) +
            f" | {ev.get('tools/calls', 0.0):.2f} |")
    gain = {}
    for kind in ("mul3", ""):
        (p1, se1, n), (p0, se0, _) = (accuracy(rows["trained, with tools"], kind),
                                      accuracy(rows["trained, no tools"], kind))
        gain[kind or "all"] = {"points": 100 * (p1 - p0), "n": n,
                               "standard_errors": (p1 - p0) / math.hypot(se1, se0)}
        lines.append(f"The tool's gain, trained, on {'3-digit products' if kind else 'all'} "
                     f"(n={n}): {100 * (p1 - p0):+.1f} points, "
                     f"{gain[kind or 'all']['standard_errors']:.1f} standard errors of the "
                     f"difference.")
    print("\n".join(lines))
    save({"cpu": cpu_name(), "rows": table, "gain": gain,
          "runs": [a.tools, a.notools, a.base_tools, a.base]}, indent=2)


if __name__ == "__main__":
    main()
