"""The policy pass of the LM job's GRPO step under different micro-batch plans, on the same
rollouts: which plan's pass is fastest, and what one more micro-batch costs.

    .venv/bin/python bench/policy_plans.py --steps 3 --reps 2 --json bench/policy_plans_<cpu>.json

It builds the job's policy (configs/smollm2_numeric.yaml, `--mode=grpo`: the base model, the
job's autocast, micro_batch_size and micro_batch_tokens), samples `--steps` GRPO batches from
it (8 prompts x 8 completions each, scored by the task's rewards), and then times
trainer.policy_pass over each batch under each plan, the plans interleaved `--reps` times:

    before   the planner of 933baed (whole groups or rows by length, cut greedily)
    cost=C   plan.row_batches with pass_cost C (cuts chosen by dynamic programming)

No optimizer step is taken, so every pass computes the same gradient from the same weights;
the script checks that the plans' gradients agree: in fp32 (`-- --use_amp=false`) within
1e-5 in norm (0.00% seen); under bf16 autocast, which rounds differently in other shapes and
whose policy gradient is a sum that mostly cancels, within 15% (5% seen). Reported per plan:
micro-batches and token positions per pass, the median pass time over batches and
repetitions, and the process's peak RSS (GiB) once all have run. A line fitted through
(positions, passes) -> seconds over every timed pass gives the seconds per position and per
micro-batch.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from outfile import claim  # noqa: E402

from mini_grpo.config import load_config  # noqa: E402
from mini_grpo.dtype_probe import cpu_name  # noqa: E402
from mini_grpo.engines import Sampling  # noqa: E402
from mini_grpo.plan import cut, extent, plan_micro_batches, row_batches  # noqa: E402
from mini_grpo.run import setup  # noqa: E402
from mini_grpo.scoring import score  # noqa: E402
from mini_grpo.state import TrainState  # noqa: E402
from mini_grpo.trainer import policy_pass  # noqa: E402
from mini_grpo.trajectory import Trajectory  # noqa: E402


def before(prompt_mask, cmask, size, group, budget=0):
    """plan.row_batches as of 933baed, for comparison."""
    n = extent(cmask).tolist()
    p = prompt_mask.sum(1).tolist()
    live = [i for i, k in enumerate(n) if k] or [0]
    groups: dict[int, list[int]] = {}
    for i in live:
        groups.setdefault(i // group, []).append(i)
    members = list(groups.values())

    def pushed(rows):
        return (len({i // group for i in rows}) * max(p[i] for i in rows)
                + len(rows) * (max(n[i] for i in rows) - 1))

    def rows_of(gs):
        return [i for g in gs for i in members[g]]

    by_group = [rows_of(b) for b in plan_micro_batches(
        [(max(n[i] for i in rows), p[rows[0]]) for rows in members], max(1, size // group),
        lambda gs: pushed(rows_of(gs)), budget)]
    by_row = [[live[j] for j in b] for b in plan_micro_batches(
        [(n[i], i // group) for i in live], size, lambda js: pushed([live[j] for j in js]),
        budget)]
    plans = [by_group, by_row] if not budget or all(
        pushed(b) <= budget for b in by_group) else [by_row]
    best = min(plans, key=lambda plan: sum(map(pushed, plan)))
    return [torch.tensor(b) for b in best]


def planner(name: str):
    if name == "before":
        return before
    cost = int(name.split("=")[1])
    return lambda *a: row_batches(*a, pass_cost=cost)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="GRPO batches sampled")
    ap.add_argument("--reps", type=int, default=2, help="timed passes per plan and batch")
    ap.add_argument("--plans", default="before,cost=0,cost=48,cost=96,cost=192")
    ap.add_argument("--json", default="")
    ap.add_argument("extra", nargs="*", help="config overrides, --key=value")
    a = ap.parse_args()
    names = a.plans.split(",")
    save = claim(a.json, __file__)  # a new file, or one this script wrote: before any work
    with tempfile.TemporaryDirectory(prefix="policy_plans_") as work:
        cfg = load_config("smollm2_numeric", dict(
            [("mode", "grpo"), ("num_eval", 8), ("report_to", []), ("out_dir", work),
             ("init_from", str(ROOT / "models" / "smollm2-135m-instruct")),
             *(x.lstrip("-").split("=", 1) for x in a.extra)]))
        with setup(cfg) as run:
            state = TrainState(run, cfg.lr, cfg.max_steps, 0, seed=cfg.seed + 1)
            engine, sampling = run.sampler(), Sampling.of(cfg)
            trajs = []
            for step in range(a.steps):
                rows = [run.task.train[(step * cfg.prompts_per_step + k) % len(run.task.train)]
                        for k in range(cfg.prompts_per_step) for _ in range(cfg.group_size)]
                t0 = time.perf_counter()
                r = engine.generate([ex.model_input for ex in rows], sampling, state.gen,
                                    state.autocast(generation=True))
                res = score(run.scorer, rows, r.texts, r.lengths(), cfg.max_new_tokens)
                trajs.append(Trajectory.of(r, torch.tensor(res.total, dtype=torch.float32),
                                           cfg, run.model))
                print(f"batch {step}: sampled in {time.perf_counter() - t0:.1f} s, completion "
                      f"lengths mean {sum(r.lengths()) / len(rows):.1f} max {max(r.lengths())}",
                      flush=True)
            variants = {}  # (plan, batch) -> trajectory with that plan
            for name in names:
                for b, t in enumerate(trajs):
                    rows = planner(name)(t.prompt_mask, t.loss_mask, cfg.micro_batch_size,
                                         t.group_size, cfg.micro_batch_tokens)
                    variants[name, b] = t.replace(plan=tuple(
                        cut(x, t.loss_mask, t.prompt_mask, t.group_size) for x in rows))
            run.model.train()
            times: dict = {k: [] for k in variants}
            grads: dict = {}
            worst = 0.0  # the largest relative difference of a plan's gradient from the first's
            stats: dict = {}
            for rep in range(a.reps):
                for b in range(len(trajs)):
                    for name in names:
                        run.model.zero_grad(set_to_none=True)
                        t0 = time.perf_counter()
                        st, _ = policy_pass(run.net, variants[name, b], cfg, state)
                        times[name, b].append(time.perf_counter() - t0)
                        stats[name, b] = (len(variants[name, b].plan), int(st.positions))
                        if rep == 0:
                            g = torch.cat([p.grad.flatten().float() for p in
                                           run.model.parameters() if p.grad is not None])
                            if b in grads:  # bf16 rounds differently in other shapes
                                diff = ((g - grads[b]).norm() / grads[b].norm()).item()
                                worst = max(worst, diff)
                                if diff > (0.15 if state.precision.dtype else 1e-5):
                                    raise SystemExit(f"plan {name}, batch {b}: gradient "
                                                     f"differs by {diff:.1%} (norm)")
                            else:
                                grads[b] = g
                    print(f"rep {rep} batch {b}: " + ", ".join(
                        f"{n} {times[n, b][-1]:.2f} s ({stats[n, b][0]} passes, "
                        f"{stats[n, b][1]} positions)" for n in names), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    # seconds = a + b x positions + c x passes, least squares over every timed pass
    xs = [(1.0, stats[k][1], stats[k][0]) for k in variants for _ in times[k]]
    ys = [t for k in variants for t in times[k]]
    coef = torch.linalg.lstsq(torch.tensor(xs, dtype=torch.float64),
                              torch.tensor(ys, dtype=torch.float64)[:, None]).solution.flatten()
    per_pos, per_pass = coef[1].item(), coef[2].item()
    results = [{"plan": n, "passes": [stats[n, b][0] for b in range(len(trajs))],
                "positions": [stats[n, b][1] for b in range(len(trajs))],
                "median_s": round(statistics.median(t for b in range(len(trajs))
                                                    for t in times[n, b]), 2),
                "seconds": [[round(t, 2) for t in times[n, b]] for b in range(len(trajs))]}
               for n in names]
    for r in results:
        print(f"{r['plan']}: median {r['median_s']} s, passes {r['passes']}, "
              f"positions {r['positions']}")
    print(f"fit: {per_pos * 1e3:.2f} ms a position, {per_pass * 1e3:.0f} ms a micro-batch "
          f"(= {per_pass / per_pos:.0f} positions); peak RSS {peak:.2f} GiB; gradients "
          f"within {worst:.2%} of the first plan's (norm)")
    save({"cpu": cpu_name(), "command": " ".join(sys.argv), "batches": a.steps,
          "reps": a.reps, "results": results, "fit_ms_per_position": round(per_pos * 1e3, 3),
          "fit_ms_per_pass": round(per_pass * 1e3, 1),
          "fit_pass_in_positions": round(per_pass / per_pos), "peak_rss_gb": round(peak, 3),
          "gradient_difference": round(worst, 5),
          "units": "seconds per policy pass; peak_rss_gb: GiB (2^30 bytes), the process's"},
         indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
