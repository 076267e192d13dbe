"""docs/results.md and README's result tables, generated from the bench/ JSON they come from,
so that a figure a reader sees is always the measured one:

    python bench/results.py            # write docs/results.md whole, and README's tables
    python bench/results.py --check    # exit 1 naming what differs (the test suite runs it)

docs/results.md is bench/results_page.md (its prose and section headings) with every table
filled: never edit the page, edit the template or the JSON (a new run) and run this script. A
table sits between `<!-- results: NAME -->` and `<!-- /results -->`, in the template and in
README.md alike: its lines are this script's; NAME is a TABLES entry, a function returning the
table's markdown from the JSON alone (a figure the JSON does not hold is not shown).

Means over seeds come with their standard error (sd / sqrt(seeds)); "SFT adds" and "GRPO adds"
are the per-seed differences of greedy accuracy on the same held-out questions (each run's
own seed draws them), averaged the same way. Peak RSS is GiB (2^30 bytes) wherever the scripts
recorded it as `peak_rss_gb` (wait4's ru_maxrss / 2^20).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCUMENTS = ("README.md",)  # tables filled in place between their markers
PAGE = "docs/results.md"  # written whole: TEMPLATE with its tables filled
TEMPLATE = BENCH / "results_page.md"
BLOCK = re.compile(r"(<!-- results: (\S+) -->\n)(.*?)(<!-- /results -->)", re.S)


@functools.cache
def load(name: str) -> dict | list:
    return json.loads((BENCH / name).read_text())


def runs(name: str) -> list[dict]:
    data = load(name)
    return data["runs"] if isinstance(data, dict) else data


def mean_se(values: list[float], scale: float = 100.0, signed: bool = False) -> str:
    """'63.7 ± 0.3' (x scale): the mean over seeds and its standard error; one value alone
    has none."""
    m = statistics.fmean(values) * scale
    text = f"{m:+.1f}" if signed else f"{m:.1f}"
    if len(values) > 1:
        text += f" ± {statistics.stdev(values) * scale / len(values) ** 0.5:.1f}"
    return text


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}"


def num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def table(header: list[str], rows: list[list], right: int = 0) -> str:
    """A markdown table; the last `right` columns right-aligned."""
    align = ["---"] * (len(header) - right) + ["---:"] * right
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |"
                     for line in (header, align, *rows))


# ---- what each job reaches ---------------------------------------------------------------

# the LM job's default as each CPU last ran it over seeds: (file, run name, the CPU in words)
LM_JOB = (("lm_job_seeds_zen4.json", "default_sft60_grpo_30min", "AMD EPYC Zen4 (AVX-512 BF16)"),
          ("lm_job_seeds_xeon.json", "default_xeon", "Intel Xeon (AMX)"),
          ("lm_job_seeds_zen3.json", "default_head_zen3", "AMD EPYC, AVX2 alone (fp32)"))


def named(file: str, name: str) -> list[dict]:
    return [r for r in runs(file) if r["name"] == name]


def lm_job() -> str:
    """The LM job's default, one row per CPU: greedy accuracy on the 500 held-out questions
    at each stage, what SFT and GRPO each added, time and peak memory."""
    rows = ["| CPU (2 cores) | seeds | greedy: base -> SFT -> end, % | SFT adds | GRPO adds "
            "| sampled end, % | minutes | peak RSS GiB | GRPO steps |",
            "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for file, name, cpu in LM_JOB:
        rs = named(file, name)
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


def lm_job_runs() -> str:
    """Every run of the LM job over seeds, file by file, in the order they ran."""
    rows = []
    for file, _, _ in LM_JOB:
        for r in runs(file):
            step_s = r.get("grpo_median_step_s")
            rows.append([
                file, r["name"], r["seed"], r.get("commit", "-"), f"{r['wall_min']:.1f}",
                f"{r['peak_rss_gb']:.2f}",
                f"{r.get('grpo_steps', '-')}" + (f" ({step_s:.1f})" if step_s else ""),
                f"{pct(r.get('greedy_before'))} -> {pct(r.get('greedy_sft'))} -> "
                f"{pct(r.get('greedy_after'))}", pct(r.get("sampled_after"))])
    return table(["file", "run", "seed", "commit", "minutes", "peak RSS GiB",
                  "GRPO steps (median s)", "greedy: first evaluation -> after SFT -> end, %",
                  "sampled end, %"], rows)


def calculator() -> str:
    """The calculator job: greedy accuracy on 600 held-out questions by kind, ± Agresti-Coull
    standard errors, and tool calls per question."""
    data = load("calculator_table_zen4.json")
    kinds = (("mul3", "3-digit products"), ("mixed", "mixed"), ("convert", "conversions"),
             ("all", "all"))
    rows = ["| model | " + " | ".join(label for _, label in kinds) + " | tool calls per question |",
            "| --- |" + " --- |" * (len(kinds) + 1)]
    for model, row in data["rows"].items():
        cells = [f"{row[k]['correct'] * 100:.1f}% ± {row[k]['se'] * 100:.1f}" for k, _ in kinds]
        rows.append(f"| {model} | " + " | ".join(cells) + f" | {row['tool_calls']:.2f} |")
    return "\n".join(rows)


def calculator_fresh() -> str:
    """The calculator job's model, without its tool and the base model on fresh questions."""
    data = load("calculator_fresh_eval_zen4.json")
    rows = [[model, f"{r['correct'] * 100:.1f} ± {r['se'] * 100:.1f}", num(r["tool_calls"]),
             f"{r['seconds']:.1f}"] for model, r in data["rows"].items()]
    return table(["model", f"greedy correct, % ({data['n']} questions, {data['cpu']})",
                  "tool calls per question", "seconds"], rows, right=2) + (
        f"\n\nThe tool's gain: {data['tool_gain_points']:.1f} points, "
        f"{data['tool_gain_se']:.0f} standard errors of the difference; peak RSS "
        f"{data['rss_peak_MiB'] / 1024:.2f} GiB.")


def screen(name: str):
    """A screen's table (bench/rl_screen.py's) of bench/NAME."""
    def make() -> str:
        sys.path.insert(0, str(BENCH))
        from rl_screen import table as screen_table

        return screen_table(load(name))
    return make


# ---- what it costs -----------------------------------------------------------------------

PHASES = (("eval_before", "base evaluation"), ("sft", "SFT"), ("grpo", "GRPO"),
          ("eval_after", "final evaluation"))


def lm_job_cost() -> str:
    """The default's minutes by phase (means over seeds), its GRPO step and its peak RSS as
    each phase ended (the highest over seeds), one row per CPU."""
    rows = []
    for file, name, cpu in LM_JOB:
        rs = named(file, name)
        minutes = [f"{statistics.fmean(r['phase_s'][k] for r in rs) / 60:.1f}" for k, _ in PHASES]
        peaks = [f"{max(r['peak_rss_gb_by_phase_end'][k] for r in rs):.2f}" for k, _ in PHASES]
        rows.append([f"{cpu}: `{rs[0]['cpu']}`", len(rs), *minutes,
                     f"{statistics.fmean(r['wall_min'] for r in rs):.1f}",
                     f"{statistics.fmean(r['grpo_median_step_s'] for r in rs):.2f}",
                     " / ".join(peaks)])
    return table(["CPU (2 cores): as the JSON names it", "seeds",
                  *(f"{label}, min" for _, label in PHASES), "whole job, min",
                  "median GRPO step, s", "peak RSS GiB at the end of each phase"], rows, right=7)


CALCULATOR_JOBS = ("calculator_job_zen4.json", "calculator_job_xeon.json",
                   "calculator_job_notools_zen4.json")


def calculator_cost() -> str:
    """The calculator job's time and peak on each CPU (the files' phases are not shown: they
    split the job differently from one file to the other)."""
    rows = []
    for file in CALCULATOR_JOBS:
        d, m = load(file), load(file)["grpo_median_s"]
        rows.append([file, f"`{d['cpu']}`", " ".join(d["args"]) or "-", f"{d['wall_min']:.1f}",
                     f"{d['peak_rss_gb']:.2f}", d["grpo_steps"],
                     f"{m['step']:.1f} ({m['generate']:.1f}, {m['policy']:.1f})",
                     pct(d["eval"]["after"]["greedy"]["correct"])])
    return table(["file", "CPU", "flags", "minutes", "peak RSS GiB", "GRPO steps",
                  "median GRPO step, s (generation, policy pass)", "greedy at the end, %"],
                 rows, right=5)


STEP_PROFILES = ("step_profile_zen4.json", "step_profile_xeon.json")


def step_cost() -> str:
    """A GRPO step of the LM job from its SFT weights: the phases' medians, the completions'
    length, the peak, and the minor page faults of each phase."""
    rows = []
    for file in STEP_PROFILES:
        d = load(file)
        s, f = d["median_s"], d["median_minor_faults"]
        rows.append([file, f"`{d['cpu']}`", d["threads"], d["init_from"],
                     f"{statistics.fmean(d['completion_len']):.1f}", f"{s['generate']:.2f}",
                     f"{s['policy']:.2f}", f"{s['optimizer']:.2f}", f"{d['peak_rss_gb']:.2f}",
                     f"{f['generate']} / {f['policy']}"])
    return table(["file", "CPU", "threads", "weights", "completion tokens", "generation, s",
                  "policy pass, s", "optimizer, s", "peak RSS GiB",
                  "minor page faults: generation / policy"], rows, right=6)


def step_kinds() -> str:
    """Where each phase of that step spends its profiled time, by kind of operator (%)."""
    kinds: list[str] = []
    for file in STEP_PROFILES:
        for phase in load(file)["phases"].values():
            kinds += [k for k in phase["kinds"] if k not in kinds]
    rows = [[f"`{load(file)['cpu']}`", name, f"{phase['profiled_s']:.2f}",
             *(pct(phase["kinds"].get(k, {}).get("share")) for k in kinds)]
            for file in STEP_PROFILES for name, phase in load(file)["phases"].items()]
    return table(["CPU", "phase", "profiled s", *kinds], rows, right=len(kinds) + 1)


def turns_overhead() -> str:
    """The multi-turn loop against the single-turn rollout, no tool called."""
    d = load("turns_overhead_zen4.json")
    m = d["median_s"]
    return table(["CPU (as recorded)", "rows", "new tokens at most", "repetitions",
                  "single-turn, median s", "multi-turn loop, median s", "ratio", "peak RSS GiB"],
                 [[f"`{d['cpu']}`", d["rows"], d["max_new_tokens"], d["reps"],
                   f"{m['single_turn']:.2f}", f"{m['turn_loop']:.2f}",
                   f"{d['ratio_turn_loop']:.3f}", f"{d['peak_rss_gb']:.2f}"]], right=7)


# ---- against TRL -------------------------------------------------------------------------

TRL_STEPS = ("trl_step_after_sft_zen4.json", "trl_step_after_sft_norm_product_zen4.json",
             "trl_step_after_sft_xeon.json", "trl_step_after_sft_cast_once_xeon.json",
             "trl_step_after_sft_once512_xeon.json", "trl_step_after_sft_skipzero_xeon.json",
             "trl_step_after_sft_skipzero_xeon_run2.json", "trl_step_after_sft_head_zen3.json",
             "trl_step_zen4.json", "trl_step_xeon.json", "trl_step_xeon_run2.json",
             "trl_step_gemma3_zen4.json")


def trl_seconds(d: dict, key: str) -> str:
    return "-" if d.get(key) is None else f"{d[key]['median_step_s']:.1f}"


def trl_peak(d: dict) -> str:
    ours = d["mini_grpo"].get("rss_peak_MiB")
    theirs = (d.get(d["baseline"]) or {}).get("rss_peak_MiB")
    if ours is None or theirs is None:
        return "-"
    return f"{ours / 1024:.2f} / {theirs / 1024:.2f} ({d['ratio_peak_rss']:.2f}x)"


def trl_step() -> str:
    """bench/trl_step.py: the same GRPO step by our trainer and by TRL's GRPOTrainer, each
    in its own processes; the ratios against the faster of TRL's two precisions (`baseline`)."""
    rows = []
    for file in TRL_STEPS:
        d = load(file)
        ours, w = d["mini_grpo"], d["work"]
        rows.append([
            file, f"`{d['cpu']}`", d.get("model", "-"),
            f"{w['prompts']} x {w['group']}, {w['new_tokens']}",
            f"{ours['median_step_s']:.1f} ({ours['phase_s']['generate']:.1f}, "
            f"{ours['phase_s']['policy']:.1f})",
            trl_seconds(d, "trl_bf16"), trl_seconds(d, "trl_fp32"),
            f"**{d['ratio_step']:.2f}x** ({d['baseline']})",
            f"{d['ratio_per_generated_token']:.2f}x", trl_peak(d)])
    return table(["file", "CPU", "weights", "prompts x completions, new tokens at most",
                  "ours, median s (generation, policy pass)", "TRL bf16, s", "TRL fp32, s",
                  "ours / TRL per step", "per generated token",
                  "peak RSS GiB ours / TRL"], rows)


def trl_tools() -> str:
    """bench/trl_tools_step.py: a GRPO step with the calculator tool, ours against TRL's."""
    d = load("trl_tools_step_zen4.json")
    ours, w, peak = d["mini_grpo"], d["work"], d["peak_rss"]
    calls = [statistics.fmean(x["tool_calls"]) for x in (ours, d["trl_bf16"], d["trl_fp32"])]
    return table(["CPU", "prompts x completions, new tokens, tool rounds at most",
                  "ours, median s (generation, policy pass)", "TRL bf16, s", "TRL fp32, s",
                  "ours / TRL per step", "tool calls per rollout: ours / TRL bf16 / fp32",
                  "peak RSS: ours GiB, the whole command's largest process GB"],
                 [[f"`{d['cpu']}`",
                   f"{w['prompts']} x {w['group']}, {w['new_tokens']}, {w['max_tool_rounds']}",
                   f"{ours['median_step_s']:.1f} ({ours['phase_s']['generate']:.1f}, "
                   f"{ours['phase_s']['policy']:.1f})", trl_seconds(d, "trl_bf16"),
                   trl_seconds(d, "trl_fp32"), f"**{d['ratio_step']:.2f}x** ({d['baseline']})",
                   " / ".join(f"{c:.2f}" for c in calls),
                   f"{peak['mini_grpo_MiB'] / 1024:.2f}, {peak['whole_command_GB']:.2f}"]])


# ---- behind the defaults -----------------------------------------------------------------

def seed_rows(jobs) -> str:
    """(label, runs, greedy key, sampled key, peak key) rows: means over their seeds."""
    rows = [[label, len(rs), mean_se([r[greedy] for r in rs]), mean_se([r[sampled] for r in rs]),
             f"{statistics.fmean(r['wall_min'] for r in rs):.1f}", f"{max(r[rss] for r in rs):.2f}"]
            for label, rs, greedy, sampled, rss in jobs]
    return table(["job", "seeds", "greedy, %", "sampled, %", "minutes", "peak RSS GiB"], rows,
                 right=2)


def lm_job_choices() -> str:
    """The jobs measured for the LM job's default, on the Zen4 over seeds."""
    sft60 = [r for r in runs("sft_working_only_zen4.json") if r.get("sft_steps") == 60]
    sft30 = [r for r in runs("sft_working_only_zen4.json") if r.get("sft_steps", 30) == 30]
    zen4 = "lm_job_seeds_zen4.json"
    return seed_rows([
        ("SFT 60 steps, then GRPO to 30 min (the default)",
         named(zen4, "default_sft60_grpo_30min"), "greedy_after", "sampled_after", "peak_rss_gb"),
        ("SFT alone, 60 steps (`--mode=sft`)", sft60, "greedy_correct", "sampled_correct",
         "peak_rss_gib"),
        ("SFT alone, 220 steps: the default's 30 minutes (`--mode=sft --sft_steps=220`)",
         named(zen4, "sft_alone_220"), "greedy_after", "sampled_after", "peak_rss_gb"),
        ("SFT alone, 30 steps", sft30, "greedy_correct", "sampled_correct", "peak_rss_gib"),
        ("GRPO alone, 30 min, 48-token cap + `numeric_concise`",
         named(zen4, "grpo_concise_30min"), "greedy_after", "sampled_after", "peak_rss_gb"),
        ("RFT then 90 GRPO steps (an earlier default)", named(zen4, "rft_grpo"), "greedy_after",
         "sampled_after", "peak_rss_gb")])


def rl_alone_models() -> str:
    """GRPO alone (the verifier, no demonstrations) from each real model, the LM job's 30
    minutes on the Zen4; the base model's own accuracy in the label."""
    jobs = [("SmolLM2-135M-Instruct", named("lm_job_seeds_zen4.json", "grpo_concise_30min")),
            ("Gemma 3 270M, the pretrained base model (no chat template: plain-text prompts)",
             named("gemma3_rl_alone_zen4.json", "gemma3_grpo_alone_30min"))]
    return seed_rows([
        (f"{model}; before GRPO: {mean_se([r['greedy_before'] for r in rs])} greedy", rs,
         "greedy_after", "sampled_after", "peak_rss_gb") for model, rs in jobs])


def lm_job_lora() -> str:
    """The default against LoRA under it (both learning rates 10x), on the Xeon over seeds."""
    xeon = "lm_job_seeds_xeon.json"
    return seed_rows([
        (f"{label} (`{name}`)", named(xeon, name), "greedy_after", "sampled_after", "peak_rss_gb")
        for label, name in (("full fine-tuning, the default", "default_xeon"),
                            ("LoRA r 16, `--lora_r=16 --sft_lr=1e-4 --lr=5e-5`",
                             "default_lora_r16_x10lr_xeon"))])


def sample_vs_hf() -> str:
    """bench/sample_vs_hf.py: `mini-grpo sample` against transformers' generate, whole
    processes, medians."""
    rows = []
    for file in ("sample_vs_hf_zen4.json", "sample_vs_hf_xeon.json",
                 "sample_vs_hf_gemma3_zen4.json"):
        d = load(file)
        w, c = d["median_wall_s"], d.get("median_cpu_s")
        model = d.get("model", "SmolLM2-135M's shape, random weights")  # the files before it
        rows.append([file, f"`{d['cpu']}`", model, d["work"], f"{w['mini_grpo_sample']:.2f}",
                     f"{w['mini_grpo_sample_fp32']:.2f}", f"{w['hf_generate']:.2f}",
                     f"**{d['ratio_ours_to_hf']:.2f}x**", f"{d['ratio_ours_fp32_to_hf']:.2f}x",
                     "-" if c is None else f"{d['cpu_ratio_ours_to_hf']:.2f}x"])
    return table(["file", "CPU", "model", "work", "ours (the probe's precision), s",
                  "ours fp32, s",
                  "transformers, s", "ours / transformers", "fp32 / transformers",
                  "CPU time: ours / transformers"], rows, right=6)


ENGINES = ("engines_smollm2_135m_xeon.json", "engines_smollm2_135m_fp32_xeon.json",
           "engines_qwen25_05b_xeon.json", "engines_rft_smollm2_numeric_zen4.json",
           "engines_rft_smollm2_numeric_zen4_run1.json")


def engines() -> str:
    """benchmark.py --only generation: one GRPO step's sampling by each engine, tokens/s in
    the precision each ran (native / vLLM / transformers), then a GRPO step with each."""
    rows = []
    for file in ENGINES:
        d = load(file)
        e = d["engines"]
        names = [n for n in ("native", "vllm", "transformers") if n in e["tokens_per_s"]]
        rows.append([
            file, f"`{d['cpu']}`", d["config"], e["rows"], e["max_new_tokens"],
            " / ".join(e["precision"][n] for n in names),
            " / ".join(f"{e['tokens_per_s'][n]:.0f}" for n in names),
            " / ".join(f"{e['step'][n]['step_s']['median']:.1f}" for n in ("native", "vllm")),
            " / ".join(f"{e['step'][n]['memory']['rss_peak_MiB'] / 1024:.2f}"
                       for n in ("native", "vllm")),
            " / ".join(f"{e['load_s'][n]:.1f}" for n in ("native", "vllm"))
            + f" + {e['load_s']['vllm_sync']:.2f} sync"])
    return table(["file", "CPU", "config", "rows", "new tokens at most",
                  "precision: native / vLLM / transformers", "tokens/s",
                  "GRPO step s: native / vLLM", "its peak RSS GiB", "load s: native / vLLM"], rows)


def engines_rft() -> str:
    """RFT's data generation (sampled, scored and written) by each engine."""
    rows = []
    for file in ENGINES:
        r = load(file)["engines"].get("rft")
        if r:
            c = r["completions_per_s"]
            rows.append([file, r["prompts"], r["oversample"], r["prompts_per_batch"],
                         f"{c['native']:.1f}", f"{c['vllm']:.1f}"])
    return table(["file", "prompts", "completions each", "prompts per pass",
                  "native, completions/s", "vLLM, completions/s"], rows, right=2)


def lora_vs_full() -> str:
    """benchmark.py --only lora: full fine-tuning against LoRA, a GRPO step each."""
    files = ("lora_vs_full_smollm2_135m_xeon.json", "lora_vs_full_qwen25_05b_xeon.json")
    sides = [(load(f), side) for f in files for side in ("full", "lora")]

    def line(label, get):
        return [label, *(get(d["lora"][s]) for d, s in sides)]
    head = [f"{d['config']} " + ("full" if s == "full" else f"LoRA r {d['lora']['lora_r']}")
            for d, s in sides]
    return table([f"`{sides[0][0]['cpu']}`", *head], [
        line("seconds per step", lambda x: f"{x['step_s']:.1f}"),
        line("of it: sampling", lambda x: f"{x['phase_s']['generate']:.1f}"),
        line("of it: policy update", lambda x: f"{x['phase_s']['policy']:.1f}"),
        line("peak RSS MiB", lambda x: f"{x['rss_peak_MiB']:.0f}"),
        *(line(f"{label} MiB", lambda x, k=k: f"{x['bytes_MiB'][k]:.1f}")
          for k, label in (("params", "trained parameters"), ("grads", "gradients"),
                           ("optimizer", "AdamW state"), ("frozen", "frozen base")))], right=4)


def logits_memory() -> str:
    """benchmark.py --only logits_memory: one log-prob pass at a large head, one-shot and
    chunked."""
    d = load("logits_memory_cpu_zen4.json")
    m = d["logits_memory"]
    return table(["CPU", "vocabulary", "width", "tokens", "fp32 logits MiB", "one-shot peak MiB",
                  "one-shot s", "chunked peak MiB", "chunked s", "chunk, tokens"],
                 [[f"`{d['cpu']}`", m["vocab"], m["width"], m["tokens"],
                   f"{m['logits_fp32_MiB']:.0f}", f"{m['full']['peak_MiB']:.0f}",
                   f"{m['full']['seconds']:.1f}", f"{m['chunked']['peak_MiB']:.0f}",
                   f"{m['chunked']['seconds']:.1f}", m["chunked"]["chunk_tokens"]]], right=9)


def where(d: dict) -> str:
    stage = f", `--stage {d['stage']}`" if "stage" in d else ""
    return f"\n\n`{d['cpu']}`, {d['steps']} steps a variant{stage}."


def variants(file: str):
    """bench/memory_steps.py's variants of bench/FILE, one process each: GRPO steps (median
    step, generation and policy pass, RSS after the last step, peak) or SFT's (tokens/s); the
    flags every variant had are said once, under the table."""
    def make() -> str:
        d = load(file)
        rs = d["results"]
        common = [a for a in rs[0]["args"] if all(a in r["args"] for r in rs)]

        def flags(r):
            return " ".join(a for a in r["args"] if a not in common) or "-"
        note = where(d) + (f" Every variant: `{' '.join(common)}`." if common else "")
        if "median_step_s" in rs[0]:
            return table(["variant", "flags", "median step s", "generation s", "policy pass s",
                          "RSS after the last step GiB", "peak RSS GiB"],
                         [[r["variant"], flags(r), f"{r['median_step_s']:.2f}",
                           num(r.get("median_generate_s")), num(r.get("median_policy_s")),
                           f"{r['rss_gb_per_step'][-1]:.2f}", f"{r['peak_rss_gb']:.2f}"]
                          for r in rs], right=5) + note
        return table(["variant", "flags", "SFT tokens/s", "peak RSS GiB"],
                     [[r["variant"], flags(r), r["sft_tokens_per_s"], f"{r['peak_rss_gb']:.2f}"]
                      for r in rs], right=2) + note
    return make


# the memory_steps files that back a setting (what each decides is in the template)
VARIANT_FILES = ("memory_steps_xeon", "memory_steps_mmap64_zen4", "memory_steps_keep128_zen4",
                 "memory_steps_tokens384_zen4", "memory_steps_checkpointing_zen4",
                 "memory_steps_onednn_caches_zen4", "memory_steps_thp_xeon",
                 "memory_sft_thp_xeon", "memory_sft_chunks_zen4", "memory_grpo_chunks_zen4",
                 "sft_head_targets_zen4")


def policy_plans() -> str:
    """bench/policy_plans.py: the micro-batch planner's pass cost against the time of a
    policy pass over the same batches."""
    d = load("policy_plans_xeon.json")
    rows = [[r["plan"], " / ".join(map(str, r["passes"])), " / ".join(map(str, r["positions"])),
             f"{r['median_s']:.2f}"] for r in d["results"]]
    return table(["plan", "passes per batch", "token positions per batch",
                  "policy pass, median s"], rows, right=1) + (
        f"\n\n`{d['cpu']}`; fitted: {d['fit_ms_per_pass']} ms a pass, "
        f"{d['fit_ms_per_position']} ms a token position, so a pass costs "
        f"{d['fit_pass_in_positions']} positions.")


def rewards() -> str:
    """benchmark.py --only rewards: completions scored per second by each executor."""
    d = load("rewards.json")
    r = d["rewards"]
    rows = [[name, *(f"{x[k]:,.0f}" for k in ("serial", "thread", "process"))]
            for name, x in r["rows"].items()]
    return table(["reward (config `default`)", "serial", "thread",
                  f"process ({r['workers']} workers)"], rows, right=3) + (
        f"\n\nCompletions scored per second, {r['n']} of them; {d['date']}, {d['threads']} "
        f"threads, on a machine the file names only `{d['machine']}`.")


def gguf() -> str:
    """bench/gguf_parity.py: our GGUF exports read back by transformers, their logits against
    the model directory's; and greedy text from a GGUF file, ours against transformers'."""
    rows = [[file, f"`{load(file)['cpu']}`", kind, f"{x['bytes']:,}", f"{x['max_abs_diff']:.2g}",
             f"{x['mean_abs_diff']:.2g}"]
            for file in ("gguf_parity_zen4.json", "gguf_export_lm_job_zen4.json")
            for kind, x in load(file)["exports_vs_directory_logits"].items()]
    d = load("gguf_parity_zen4.json")
    same = sum(r["equal"] for r in d["rows"])
    return table(["file", "CPU", "export", "bytes", "largest logit difference", "mean"], rows,
                 right=3) + (
        f"\n\nGreedy text ({d['max_new_tokens']} new tokens at most) from `{d['model']}`: ours "
        f"from the file and from the directory equal transformers' from the file on {same} of "
        f"{len(d['rows'])} prompts.")


def scaling() -> str:
    """benchmark.py --only scaling: one process, 2 x DDP, 2 x FSDP on the same global batch."""
    d = load("scaling_ddp_fsdp_zen4.json")
    s = d["scaling"]
    label = {"1": "1 process", "2": "2 x DDP", "2-fsdp": "2 x FSDP"}
    rows = [[label.get(k, k), r["precision"], f"{r['step_s']['median']:.2f}",
             pct(s["comm_share"][k]), f"{r['memory']['rss_peak_MiB']:.0f}"]
            for k, r in s["runs"].items()]
    return table(["run", "precision", "median step s", "in communication, %",
                  "peak RSS MiB (rank 0)"], rows, right=3) + (
        f"\n\n`{d['cpu']}`, config `{d['config']}` ({s['runs']['1']['params_M']}M parameters).")


TABLES = {"lm_job": lm_job, "lm_job_runs": lm_job_runs, "calculator": calculator,
          "calculator_fresh": calculator_fresh,
          "rl_screen": screen("rl_screen_zen4.json"),  # issue 70: RL after SFT
          "rl_alone_screen": screen("rl_alone_screen_zen4.json"),  # and from the base model
          "rl_alone_models": rl_alone_models,
          "rl_memorize": screen("rl_memorize_zen4.json"),  # a small pool, seen again
          "lm_job_cost": lm_job_cost, "calculator_cost": calculator_cost,
          "step_cost": step_cost, "step_kinds": step_kinds, "turns_overhead": turns_overhead,
          "trl_step": trl_step, "trl_tools": trl_tools,
          "lm_job_choices": lm_job_choices, "lm_job_lora": lm_job_lora,
          "sample_vs_hf": sample_vs_hf, "engines": engines, "engines_rft": engines_rft,
          "lora_vs_full": lora_vs_full, "logits_memory": logits_memory,
          **{f"variants_{stem}": variants(f"{stem}.json") for stem in VARIANT_FILES},
          "policy_plans": policy_plans, "rewards": rewards, "gguf": gguf, "scaling": scaling}


def rendered(text: str, where: str) -> str:
    """`text` with every table between markers made anew; an unknown NAME is an error."""
    def fill(m):
        if m.group(2) not in TABLES:
            raise SystemExit(f"{where}: <!-- results: {m.group(2)} -->: no such table "
                             f"(bench/results.py has {', '.join(TABLES)})")
        return m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(4)
    return BLOCK.sub(fill, text)


def page() -> str:
    """docs/results.md as it must be: the template with every table filled."""
    return rendered(TEMPLATE.read_text(), f"bench/{TEMPLATE.name}")


def differing(text: str, new: str) -> str:
    """What of `text` differs from `new`: its tables by name, its text outside them."""
    old_blocks = {m.group(2): m.group(0) for m in BLOCK.finditer(text)}
    names = [m.group(2) for m in BLOCK.finditer(new) if old_blocks.get(m.group(2)) != m.group(0)]
    if BLOCK.sub("", text) != BLOCK.sub("", new):
        names.append("the text outside the tables")
    return ", ".join(names)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 naming each document that differs")
    a = ap.parse_args(argv)
    stale = []
    made = {doc: rendered((ROOT / doc).read_text(), doc) for doc in DOCUMENTS}
    made[PAGE] = page()
    for doc, new in made.items():
        path = ROOT / doc
        text = path.read_text() if path.exists() else ""
        if new == text:
            continue
        if a.check:
            stale.append(f"{doc}: {differing(text, new)}")
        else:
            path.write_text(new)
            print(f"[results] {doc}: written")
    if stale:
        print("stale (run `python bench/results.py`):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
