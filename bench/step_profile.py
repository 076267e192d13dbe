"""Where a GRPO step of the LM job spends its time, by kind of operation, on this CPU: the
rollout, the policy pass and the optimizer under torch.profiler, the operators grouped into
kinds (matmuls, casts and copies, elementwise, reductions, attention, embedding and indexing,
allocation, the optimizer's), so that two CPUs can be compared kind by kind.

    .venv/bin/python bench/step_profile.py --init_from runs/sft60_working_only_s1337/hf \\
        --json bench/step_profile_<cpu>.json

It builds the job's policy as the job's GRPO stage does (configs/smollm2_numeric.yaml,
`--mode=grpo`, its autocast and micro-batch plan) from `--init_from` (default: the base model;
the job's GRPO starts from its SFT stage: `mini-grpo export --checkpoint
<run>/sft/step_0000060.pt --output DIR` makes one), and runs the job's steps 1, 2, ... (the
same prompts on every machine): `--warmup` steps first (the heap grows to what a step needs:
the first steps fault fresh pages in), then `--steps` steps timed without the
profiler (the phases' medians, the figures to compare, and the minor page faults each phase
took: fresh memory written), then `--steps` under it (where the time goes, as shares: the
profiler adds its own cost to every operator, most to the rollout's many small ones). Self CPU
time of each operator, summed by phase and kind, per step; the largest operators of each phase
listed. Nothing else heavy should run beside it.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from outfile import claim  # noqa: E402

from mini_grpo.config import load_config  # noqa: E402
from mini_grpo.data import batch_indices  # noqa: E402
from mini_grpo.dtype_probe import cpu_name  # noqa: E402
from mini_grpo.engines import Sampling  # noqa: E402
from mini_grpo.run import setup  # noqa: E402
from mini_grpo.scoring import score  # noqa: E402
from mini_grpo.state import TrainState  # noqa: E402
from mini_grpo.trainer import policy_pass  # noqa: E402
from mini_grpo.trajectory import Trajectory  # noqa: E402

# an operator's kind, by its name without the namespace (aten::mm -> mm), the first that fits
KINDS = [
    ("matmul", lambda b, op: b in {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
     or "mkldnn" in op or "onednn" in op or b.endswith("_mm")),
    ("attention", lambda b, op: "scaled_dot_product" in b or "attention" in b),
    ("optimizer", lambda b, op: "adam" in b or b.startswith("_foreach")),
    ("cast_copy", lambda b, op: b in {"copy_", "_to_copy", "to", "clone", "contiguous",
                                      "_copy_from", "_copy_from_and_resize", "type_as"}),
    ("reduction_softmax", lambda b, op: "softmax" in b or "logsumexp" in b or b.rstrip("_") in {
        "sum", "mean", "max", "min", "amax", "amin", "argmax", "topk", "sort", "multinomial",
        "cumsum", "norm", "linalg_vector_norm", "var", "std", "prod", "any", "all"}),
    ("embedding_index", lambda b, op: any(k in b for k in ("embedding", "index", "gather",
                                                           "scatter", "masked", "sparse"))
     or b in {"nonzero", "where", "cat", "stack", "take", "select_backward",
              "slice_backward", "narrow_copy"}),
    ("allocation", lambda b, op: b in {"empty", "empty_like", "empty_strided", "zeros",
                                       "zeros_like", "ones", "ones_like", "zero_", "fill_",
                                       "full", "full_like", "resize_", "new_empty",
                                       "new_zeros", "new_empty_strided", "arange"}),
    ("view", lambda b, op: b in {"view", "reshape", "expand", "transpose", "permute", "t",
                                 "unsqueeze", "squeeze", "as_strided", "detach", "alias",
                                 "_unsafe_view", "select", "slice", "narrow", "split",
                                 "chunk", "unbind", "flatten", "expand_as", "view_as",
                                 "_reshape_alias", "lift_fresh", "unflatten", "movedim"}),
    ("autograd", lambda b, op: "Backward" in op or "autograd" in op or "AccumulateGrad" in op),
]


def kind_of(op: str) -> str:
    base = op.split("::")[-1]
    return next((kind for kind, fits in KINDS if fits(base, op)), "elementwise_other")


def huge_pages_gb() -> float | None:
    """GiB of this process's anonymous memory on transparent huge pages (Linux), None if
    unknown: whether THP_MEM_ALLOC_ENABLE took."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return round(int(line.split()[1]) / 2**20, 3)
    except (OSError, ValueError, IndexError):
        pass
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init_from", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--warmup", type=int, default=3, help="steps first, not counted")
    ap.add_argument("--steps", type=int, default=3, help="timed steps, and profiled steps")
    ap.add_argument("--top", type=int, default=12, help="operators listed per phase")
    ap.add_argument("--json", default="")
    ap.add_argument("extra", nargs="*", help="config overrides, --key=value")
    a = ap.parse_args()
    save = claim(a.json, __file__)  # before any work
    if not (Path(a.init_from) / "config.json").is_file() and not Path(a.init_from).is_file():
        raise SystemExit(f"--init_from {a.init_from}: no model there (`make model` makes the "
                         f"base model)")
    plain: dict[str, list[float]] = defaultdict(list)
    faults: dict[str, list[int]] = defaultdict(list)  # minor page faults (fresh pages)
    ops: dict[str, dict[str, float]] = {p: defaultdict(float) for p in
                                        ("generate", "policy", "optimizer")}
    lengths: list[float] = []
    with tempfile.TemporaryDirectory(prefix="step_profile_") as work:
        cfg = load_config("smollm2_numeric", dict(
            [("mode", "grpo"), ("num_eval", 8), ("report_to", []), ("out_dir", work),
             ("init_from", str(Path(a.init_from).resolve())),
             *(x.lstrip("-").split("=", 1) for x in a.extra)]))
        with setup(cfg) as run:
            state = TrainState(run, cfg.lr, cfg.max_steps, cfg.warmup_steps,
                               seed=cfg.seed + 1)
            engine, sampling, task = run.sampler(), Sampling.of(cfg), run.task

            def phase(name, fn, prof: bool):
                if not prof:
                    t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                    out = fn()
                    plain[name].append(time.perf_counter() - t0)
                    faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                                        - f0.ru_minflt)
                    return out
                with profile(activities=[ProfilerActivity.CPU]) as p:
                    out = fn()
                for e in p.key_averages():
                    ops[name][e.key] += e.self_cpu_time_total / 1e6
                return out

            def step(k: int, prof: bool) -> None:
                idx = batch_indices(len(task.train), cfg.prompts_per_step, k - 1, cfg.seed + 1)
                rows = [task.train[i] for i in idx for _ in range(cfg.group_size)]
                run.sync_engine()
                r = phase("generate", lambda: engine.generate(
                    [ex.model_input for ex in rows], sampling, state.gen,
                    state.autocast(generation=True)), prof)
                res = score(run.scorer, rows, r.texts, r.lengths(), cfg.max_new_tokens,
                            r.conversations, r.env_rewards)
                traj = Trajectory.of(r, torch.tensor(res.total, dtype=torch.float32),
                                     cfg, run.model)
                state.begin(k)
                run.model.train()
                part, _ = phase("policy", lambda: policy_pass(run.net, traj, cfg, state), prof)
                phase("optimizer", lambda: state.step(part.loss, ~traj.nonfinite), prof)
                lengths.append(sum(r.lengths()) / len(rows))
                print(f"step {k}{' (profiled)' if prof else ''}: completions "
                      f"{lengths[-1]:.1f} tokens on average, {len(traj.plan)} micro-batches",
                      flush=True)

            for k in range(1, 1 + a.warmup):  # the heap grows to what a step needs
                step(k, False)
            plain.clear()
            faults.clear()
            first = 1 + a.warmup
            for k in range(first, first + a.steps):
                step(k, False)
            huge = huge_pages_gb()  # as the timed steps left the process, before the profiler
            for k in range(first + a.steps, first + 2 * a.steps):
                step(k, True)
    median = {p: round(statistics.median(v), 3) for p, v in plain.items()}
    median_faults = {p: int(statistics.median(v)) for p, v in faults.items()}
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "init_from": Path(a.init_from).name, "warmup": a.warmup, "steps": a.steps,
              "extra": a.extra,
              "completion_len": [round(x, 1) for x in lengths],
              "median_s": median, "median_minor_faults": median_faults,
              "anon_huge_pages_gb": huge, "phases": {},
              "units": "seconds per step; peak_rss_gb: GiB (2^30 bytes), the process's, the "
              "profiler's records included",
              "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    print(f"\nmedians of {a.steps} steps without the profiler: " +
          ", ".join(f"{p} {s:.2f} s ({median_faults[p]} minor page faults)"
                    for p, s in median.items()) +
          f"; completions {statistics.mean(lengths):.1f} tokens; peak RSS "
          f"{result['peak_rss_gb']:.2f} GiB")
    for name, table in ops.items():
        total = sum(table.values())
        by_kind: dict[str, float] = defaultdict(float)
        for op, s in table.items():
            by_kind[kind_of(op)] += s
        kinds = {k: {"s": round(s / a.steps, 3), "share": round(s / total, 3)}
                 for k, s in sorted(by_kind.items(), key=lambda kv: -kv[1])}
        top = [{"op": op, "s": round(s / a.steps, 3), "kind": kind_of(op)}
               for op, s in sorted(table.items(), key=lambda kv: -kv[1])[:a.top]]
        result["phases"][name] = {"profiled_s": round(total / a.steps, 3), "kinds": kinds,
                                  "top": top}
        print(f"\n{name}: {total / a.steps:.2f} s a step under the profiler")
        for k, v in kinds.items():
            print(f"  {k:18s} {v['s']:7.3f} s  {100 * v['share']:5.1f}%")
        for t in top:
            print(f"    {t['op']:44s} {t['s']:7.3f} s  ({t['kind']})")
    save(result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
