"""The calculator job's models on fresh 3-digit products: questions the job never saw,
neither in training nor in its 600 held-out ones (the held-out split holds 290 products,
drawn 2:1:1 among the kinds), so that the tool's gain on products is measured on more than
300 rows.

    python bench/calculator_fresh_eval.py [--n 400] [--json bench/calculator_fresh_eval_<cpu>.json]

Evaluates greedily, as the job's evaluation does: the job's trained model with the tool
(runs/smollm2_calculator, its last checkpoint), the same job trained without it
(runs/smollm2_calculator_notools) and the base model with the tool. The questions: `--n`
distinct products drawn from another seed than the job's, none equal to a question of the
job's training or held-out set (rebuilt from its config)."""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from calculator_table import accuracy  # noqa: E402
from outfile import claim  # noqa: E402

RUNS = {"trained, with the tool": ("runs/smollm2_calculator", []),
        "trained without the tool": ("runs/smollm2_calculator_notools", []),
        "base, with the tool": ("models/smollm2-135m-instruct",
                                ["--task=calculator", "--tools=[calculator]",
                                 "--max_tool_calls=2", "--block_size=512",
                                 "--max_new_tokens=80"])}
SEED = 12345  # not the job's (its config's seed)


def checkpoint_of(path: Path) -> Path:
    ckpts = sorted((path / "checkpoints").glob("step_*.pt"))
    return ckpts[-1] if ckpts else path


def fresh_questions(cfg, n: int) -> list:
    from mini_grpo.tasks import calculator
    from mini_grpo.tasks.numeric import generate

    args = calculator.Args(**cfg.task_args)
    task = calculator.build(cfg, args)
    seen = {ex.prompt for ex in task.train} | {ex.prompt for ex in task.eval}
    mul3 = replace(args, kinds=["mul3"], weights=[1.0])
    got = generate(random.Random(SEED), n, mul3, seen, distinct=True,
                   example=calculator.calculator_example)
    if len(got) < n:
        raise SystemExit(f"only {len(got)} fresh products found")
    return task, got


def main() -> int:
    from mini_grpo.cli import _from_checkpoint
    from mini_grpo.dtype_probe import cpu_name
    from mini_grpo.evaluate import evaluate
    from mini_grpo.run import setup

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    save = claim(a.json, __file__)
    out = {"cpu": cpu_name(), "n": a.n, "seed": SEED, "rows": {}}
    for name, (path, extra) in RUNS.items():
        ckpt = checkpoint_of(ROOT / path)
        state, cfg = _from_checkpoint(str(ckpt), extra)
        task, fresh = fresh_questions(cfg, a.n)
        t0 = time.perf_counter()
        with setup(cfg, checkpoint=state, log=False, train=False,
                   task=replace(task, eval=fresh)) as run:
            run.sync_engine()
            ev = evaluate(run, greedy=True, seed=cfg.seed)
        p, se, n = accuracy(ev)
        out["rows"][name] = {"checkpoint": str(ckpt.relative_to(ROOT)), "correct": p,
                             "se": se, "n": n, "tool_calls": ev.get("tools/calls"),
                             "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{name:26s} {100 * p:5.1f}% +- {100 * se:.1f} on {n} fresh products "
              f"({ev.get('tools/calls', 0):.2f} calls each)", flush=True)
    rows = out["rows"]
    a_, b_ = rows["trained, with the tool"], rows["trained without the tool"]
    gap = a_["correct"] - b_["correct"]
    out["tool_gain_points"] = 100 * gap
    out["tool_gain_se"] = gap / (a_["se"] ** 2 + b_["se"] ** 2) ** 0.5
    out["rss_peak_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"the tool's gain: {out['tool_gain_points']:+.1f} points, "
          f"{out['tool_gain_se']:.0f} standard errors; peak RSS {out['rss_peak_MiB']:.0f} MiB")
    save(out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
