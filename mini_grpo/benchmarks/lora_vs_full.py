"""Full fine-tuning against LoRA on the same GRPO steps, side by side in one command:
`python benchmark.py --config smollm2_135m --only lora [--lora_r=16] [--rounds 2]`.

Each side is benchmark.py's step section in a process of its own (peak RSS is a process's
high-water mark, so two in one process would share theirs), run alternately `rounds` times
(full, LoRA, full, LoRA, ...) so machine noise hits both: the config as given with lora_r 0,
then with lora_r R (the config's, else 16). Reported per side: seconds per step (the median
over rounds of each run's median) and per phase, peak RSS, and the bytes rank 0 holds for
the trained parameters, their gradients, AdamW's state and the frozen base
(fsdp.memory_report).
"""

from __future__ import annotations

import statistics
import sys

from .budget import step_in_own_process


def bench_lora(script: str, config: str, rest: list[str], lora_r: int, warmup: int,
               steps: int, rounds: int) -> dict:
    """`script` (benchmark.py) --only step under each side, alternately; `rest`: the
    command's own --key=value overrides (a --lora_r among them is replaced)."""
    rest = [a for a in rest if not a.startswith("--lora_r")]
    sides = {"full": ["--lora_r=0"], "lora": [f"--lora_r={lora_r}"]}
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for i in range(rounds):
        for name, extra in sides.items():
            print(f"[bench] lora: round {i + 1}/{rounds}, {name}", file=sys.stderr, flush=True)
            runs[name].append(step_in_own_process(script, config, [*rest, *extra], warmup,
                                                  steps))
    result = {"lora_r": lora_r, "rounds": rounds, "warmup": warmup, "steps": steps}
    for name, rs in runs.items():
        result[name] = {
            "step_s": statistics.median(r["step_s"]["median"] for r in rs),
            "phase_s": {p: statistics.median(r["phase_s"][p] for r in rs)
                        for p in ("generate", "reference", "policy", "optimizer")},
            "rss_peak_MiB": max(r["memory"]["rss_peak_MiB"] for r in rs),
            "bytes_MiB": rs[0]["bytes_MiB"], "params_M": rs[0]["params_M"],
            "precision": rs[0]["precision"], "runs": rs}
    result["step_ratio_lora_over_full"] = result["lora"]["step_s"] / result["full"]["step_s"]
    return result


def format_lora(r: dict) -> str:
    full, lora = r["full"], r["lora"]
    rows = [("seconds per step (median)", full["step_s"], lora["step_s"]),
            *((f"  {p}", full["phase_s"][p], lora["phase_s"][p]) for p in full["phase_s"]),
            ("peak RSS, MiB", full["rss_peak_MiB"], lora["rss_peak_MiB"]),
            *((f"{k} MiB", full["bytes_MiB"][k], lora["bytes_MiB"][k])
              for k in ("params", "grads", "optimizer", "frozen"))]
    lines = [f"full fine-tuning vs LoRA r={r['lora_r']} ({full['params_M']}M parameters, "
             f"{full['precision']}; {r['rounds']} alternating rounds of {r['warmup']} warm-up "
             f"+ {r['steps']} timed steps)",
             f"{'':<28} {'full':>10} {'LoRA':>10} {'LoRA/full':>10}"]
    for name, a, b in rows:
        lines.append(f"{name:<28} {a:>10.3f} {b:>10.3f} "
                     f"{b / a if a else float('nan'):>10.3f}")
    return "\n".join(lines)
