"""The result tables of README.md and docs/results.md, generated from the bench/ JSON they come
from, so that the figures a reader sees are the measured ones:

    python bench/results.py            # rewrite every table between its markers
    python bench/results.py --check    # exit 1 naming each table that differs (the suite runs it)

A generated table sits in a document between `<!-- results: NAME -->` and `<!-- /results -->`:
its lines are this script's, so change the JSON (a new run) or TABLES (what is shown), never
the lines. NAME is a TABLES entry, a function returning the table's markdown.

Means over seeds come with their standard error (sd / sqrt(seeds)); "SFT adds" and "GRPO adds"
are the per-seed differences of greedy accuracy on the same held-out questions (each run's
own seed draws them), averaged the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCUMENTS = ("README.md", "docs/results.md")
BLOCK = re.compile(r"(<!-- results: (\S+) -->\n)(.*?)(<!-- /results -->)", re.S)


def runs(name: str) -> list[dict]:
    data = json.loads((BENCH / name).read_text())
    return data["runs"] if isinstance(data, dict) else data


def mean_se(values: list[float], scale: float = 100.0, signed: bool = False) -> str:
    """'63.7 ± 0.3' (x scale): the mean over seeds and its standard error; one value alone
    has none."""
    m = statistics.fmean(values) * scale
    text = f"{m:+.1f}" if signed else f"{m:.1f}"
    if len(values) > 1:
        text += f" ± {statistics.stdev(values) * scale / len(values) ** 0.5:.1f}"
    return text


# the LM job's default as each CPU last ran it over seeds: (file, run name, the CPU in words)
LM_JOB = (("lm_job_seeds_zen4.json", "default_sft60_grpo_30min", "AMD EPYC Zen4 (AVX-512 BF16)"),
          ("lm_job_seeds_xeon.json", "default_xeon", "Intel Xeon (AMX)"),
          ("lm_job_seeds_zen3.json", "default_head_zen3", "AMD EPYC, AVX2 alone (fp32)"))


def lm_job() -> str:
    """The LM job's default, one row per CPU: greedy accuracy on the 500 held-out questions
    at each stage, what SFT and GRPO each added, time and peak memory."""
    rows = ["| CPU (2 cores) | seeds | greedy: base -> SFT -> end, % | SFT adds | GRPO adds "
            "| sampled end, % | minutes | peak RSS GiB | GRPO steps |",
            "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for file, name, cpu in LM_JOB:
        rs = [r for r in runs(file) if r["name"] == name]
        col = {k: [r[k] for r in rs] for k in ("greedy_before", "greedy_sft", "greedy_after",
                                              "sampled_after", "wall_min", "peak_rss_gb",
                                              "grpo_steps")}
        rows.append(
            f"| {cpu} | {', '.join(str(r['seed']) for r in rs)} | "
            f"{mean_se(col['greedy_before'])} -> {mean_se(col['greedy_sft'])} -> "
            f"**{mean_se(col['greedy_after'])}** | "
            f"{mean_se([r['greedy_sft'] - r['greedy_before'] for r in rs], signed=True)} | "
            f"{mean_se([r['greedy_after'] - r['greedy_sft'] for r in rs], signed=True)} | "
            f"{mean_se(col['sampled_after'])} | {statistics.fmean(col['wall_min']):.1f} | "
            f"{max(col['peak_rss_gb']):.2f} | {min(col['grpo_steps'])}-{max(col['grpo_steps'])} |")
    return "\n".join(rows)


def lm_job_choices() -> str:
    """The jobs measured for the LM job's default, on the Zen4 over seeds."""
    sft60 = [r for r in runs("sft_working_only_zen4.json") if r.get("sft_steps") == 60]
    sft30 = [r for r in runs("sft_working_only_zen4.json") if r.get("sft_steps", 30) == 30]
    zen4 = runs("lm_job_seeds_zen4.json")

    def named(n):
        return [r for r in zen4 if r["name"] == n]

    jobs = [("SFT 60 steps, then GRPO to 30 min (the default)", named("default_sft60_grpo_30min"),
             "greedy_after", "sampled_after", "peak_rss_gb"),
            ("SFT alone, 60 steps (`--mode=sft`)", sft60, "greedy_correct", "sampled_correct",
             "peak_rss_gib"),
            ("SFT alone, 30 steps", sft30, "greedy_correct", "sampled_correct", "peak_rss_gib"),
            ("GRPO alone, 30 min, 48-token cap + `numeric_concise`",
             named("grpo_concise_30min"), "greedy_after", "sampled_after", "peak_rss_gb"),
            ("RFT then 90 GRPO steps (an earlier default)", named("rft_grpo"), "greedy_after",
             "sampled_after", "peak_rss_gb")]
    rows = ["| job | seeds | greedy, % | sampled, % | minutes | peak RSS GiB |",
            "| --- | --- | --- | --- | ---: | ---: |"]
    for label, rs, greedy, sampled, rss in jobs:
        rows.append(f"| {label} | {len(rs)} | {mean_se([r[greedy] for r in rs])} | "
                    f"{mean_se([r[sampled] for r in rs])} | "
                    f"{statistics.fmean(r['wall_min'] for r in rs):.1f} | "
                    f"{max(r[rss] for r in rs):.2f} |")
    return "\n".join(rows)


def lm_job_runs() -> str:
    """Every run of the LM job over seeds, file by file, in the order they ran."""
    rows = ["| file | run | seed | commit | minutes | peak RSS GiB | GRPO steps (median s) "
            "| greedy: first evaluation -> after SFT -> end, % | sampled end, % |",
            "| --- | --- | ---: | --- | ---: | ---: | --- | --- | ---: |"]

    def pct(x):
        return "-" if x is None else f"{x * 100:.1f}"
    for file, _, _ in LM_JOB:
        for r in runs(file):
            step_s = r.get("grpo_median_step_s")
            rows.append(
                f"| {file} | {r['name']} | {r['seed']} | {r.get('commit', '-')} | "
                f"{r['wall_min']:.1f} | {r['peak_rss_gb']:.2f} | {r.get('grpo_steps', '-')}"
                + (f" ({step_s:.1f})" if step_s else "") + " | "
                f"{pct(r.get('greedy_before'))} -> {pct(r.get('greedy_sft'))} -> "
                f"{pct(r.get('greedy_after'))} | {pct(r.get('sampled_after'))} |")
    return "\n".join(rows)


def calculator() -> str:
    """The calculator job: greedy accuracy on 600 held-out questions by kind, ± Agresti-Coull
    standard errors, and tool calls per question."""
    data = json.loads((BENCH / "calculator_table_zen4.json").read_text())
    kinds = (("mul3", "3-digit products"), ("mixed", "mixed"), ("convert", "conversions"),
             ("all", "all"))
    rows = ["| model | " + " | ".join(label for _, label in kinds) + " | tool calls per question |",
            "| --- |" + " --- |" * (len(kinds) + 1)]
    for model, row in data["rows"].items():
        cells = [f"{row[k]['correct'] * 100:.1f}% ± {row[k]['se'] * 100:.1f}" for k, _ in kinds]
        rows.append(f"| {model} | " + " | ".join(cells) + f" | {row['tool_calls']:.2f} |")
    return "\n".join(rows)


def screen(name: str):
    """A screen's table (bench/rl_screen.py's) of bench/NAME."""
    def make() -> str:
        sys.path.insert(0, str(BENCH))
        from rl_screen import table

        return table(json.loads((BENCH / name).read_text()))
    return make


TABLES = {"lm_job": lm_job, "lm_job_choices": lm_job_choices, "lm_job_runs": lm_job_runs,
          "calculator": calculator,
          "rl_screen": screen("rl_screen_zen4.json"),  # issue 70: RL after SFT
          "rl_alone_screen": screen("rl_alone_screen_zen4.json")}  # and from the base model


def rendered(text: str, where: str) -> str:
    """`text` with every table between markers made anew; an unknown NAME is an error."""
    def fill(m):
        if m.group(2) not in TABLES:
            raise SystemExit(f"{where}: <!-- results: {m.group(2)} -->: no such table "
                             f"(bench/results.py has {', '.join(TABLES)})")
        return m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(4)
    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 naming each document whose tables differ")
    a = ap.parse_args(argv)
    stale = []
    for doc in DOCUMENTS:
        path = ROOT / doc
        text = path.read_text()
        new = rendered(text, doc)
        if new == text:
            continue
        if a.check:
            names = [m.group(2) for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(new))
                     if m.group(0) != n.group(0)]
            stale.append(f"{doc}: {', '.join(names)}")
        else:
            path.write_text(new)
            print(f"[results] {doc}: tables written")
    if stale:
        print("stale tables (run `python bench/results.py`):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
