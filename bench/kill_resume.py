"""kill -9 at random moments of a tiny GRPO run, each time resumed: the run must end with the
weights and metrics of the same run left alone (fp32 and bf16 autocast on CPU).

    .venv/bin/python bench/kill_resume.py                 # 5 kills each, fp32 and bf16
    .venv/bin/python bench/kill_resume.py --kills 3 --dtypes fp32 --json out.json

For each precision: one uninterrupted run (`straight`), then the same run (`killed`) started
again and again, each start SIGKILLed after a random delay between just before the straight
run's first checkpoint and half-way through the rest of its span, until `--kills` kills have
landed; then it runs to its end. The final hf/model.safetensors must equal the straight run's
bit for bit, and metrics.jsonl must hold the same rows (every value but times and
throughputs, which differ by nature). Prints one line per kill and a
verdict; exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--config", "tiny", "--mode=grpo", "--reward_executor=serial", "--max_steps=40",
        "--save_every=1", "--eval_every=10", "--num_eval=8", "--report_to=[]"]
DTYPES = {"fp32": ["--use_amp=false"], "bf16": ["--use_amp=true", "--amp_dtype=bfloat16",
                                                "--generation_amp=on"]}
# what differs between two identical runs: wall-clock figures
TIMING = ("time/", "per_s", "seconds", "mem/")


def launch(out: Path, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(ROOT / "distributed_train.py"), *ARGS, *extra,
                             f"--out_dir={out}"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def rows(out: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMING)}
            for line in lines]


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "hf" / "model.safetensors")


def one(dtype: str, kills: int, work: Path, rng: random.Random) -> dict:
    extra = DTYPES[dtype]
    straight, killed = work / f"{dtype}_straight", work / f"{dtype}_killed"
    t0, first = time.perf_counter(), None
    p = launch(straight, extra)
    while p.poll() is None:  # when the first checkpoint appears: start-up is over by then
        if first is None and list((straight / "checkpoints").glob("step_*")):
            first = time.perf_counter() - t0
        time.sleep(0.05)
    span = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{dtype}: the straight run failed:\n{p.stderr.read()[-2000:]}")
    first = first or span
    landed, starts, moments = 0, 0, []
    while True:
        p = launch(killed, extra)
        starts += 1
        if landed < kills:
            # from just before the first step's save to half-way through what follows:
            # each start resumes further on, so most kills land inside training steps,
            # saves and evaluations, some in the start-up
            delay = rng.uniform(0.8 * first, first + (span - first) / 2)
            try:
                p.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
                landed += 1
                moments.append(round(delay, 2))
                done = sorted(killed.glob("checkpoints/step_*"))
                print(f"{dtype}: kill {landed} at {delay:.1f} s of {span:.1f} s "
                      f"(newest checkpoint: {done[-1].name if done else 'none'})", flush=True)
                continue
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"{dtype}: a resumed run failed:\n{err[-2000:]}")
        if landed >= kills:
            break
    a, b = weights(straight), weights(killed)
    same_weights = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    same_rows = rows(straight) == rows(killed)
    print(f"{dtype}: {landed} kills over {starts} starts; weights "
          f"{'identical' if same_weights else 'DIFFER'}, metrics rows "
          f"{'identical' if same_rows else 'DIFFER'} ({len(rows(killed))} rows)", flush=True)
    return {"dtype": dtype, "kills": landed, "starts": starts, "kill_moments_s": moments,
            "straight_run_s": round(span, 1), "first_checkpoint_s": round(first, 1),
            "same_weights": same_weights, "same_metrics": same_rows, "rows": len(rows(killed))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="", help="a new folder for the runs (default: a temp one)")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    import tempfile

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kill_resume_"))
    rng = random.Random(args.seed)
    results = [one(d, args.kills, work, rng) for d in args.dtypes]
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": _cpu(), "results": results}, indent=2)
                                   + "\n")
    return 0 if all(r["same_weights"] and r["same_metrics"] for r in results) else 1


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
