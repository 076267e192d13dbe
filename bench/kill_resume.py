"""kill -9 at random moments of a tiny GRPO run, each time resumed: the run must end with the
weights and metrics of the same run left alone (fp32 and bf16 autocast on CPU).

    .venv/bin/python bench/kill_resume.py                 # 5 kills each, fp32 and bf16
    .venv/bin/python bench/kill_resume.py --kills 3 --dtypes fp32 --json out.json
    .venv/bin/python bench/kill_resume.py --multiturn --dtypes fp32   # with an environment

For each precision: one uninterrupted run (`straight`), then the same run (`killed`) started
again and again: each start is SIGKILLed at a random moment within 1.5 steps after it saved a
randomly chosen step (a kill in a step, a save or an evaluation), `--kills` times; then it
runs to its end. The final hf/model.safetensors must equal the straight run's
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
sys.path.insert(0, str(ROOT / "bench"))
from outfile import claim  # noqa: E402

from mini_grpo.dtype_probe import cpu_name  # noqa: E402

ARGS = ["--config", "tiny", "--mode=grpo", "--reward_executor=serial", "--max_steps=40",
        "--save_every=1", "--eval_every=10", "--num_eval=8", "--report_to=[]"]
# --multiturn: the guess-the-number environment (examples/) on a tiny Hugging Face model that
# the script builds (tests/conftest.py's tiny_lm_dir): rollouts of several rounds
MULTITURN = ["--task=jsonl", "--data_path=examples/guess_number.jsonl",
             "--environment=examples.guess_number:GuessNumber",
             '--rewards=[{"name": "examples.guess_number:guesses", "weight": 1.0}]',
             "--max_steps=60", "--max_new_tokens=160", "--block_size=512", "--temperature=1.5",
             "--prompts_per_step=2", "--group_size=4", "--device=cpu"]
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


def one(dtype: str, kills: int, work: Path, rng: random.Random, setup: list[str]) -> dict:
    extra = DTYPES[dtype] + setup
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
    steps = int([a for a in ARGS + extra if a.startswith("--max_steps=")][-1].split("=")[1])
    per_step = (span - first) / steps
    # each kill aims at a training step: once the start has saved step t (save_every=1), it
    # dies at a random moment within the next 1.5 steps (a step, its save, an evaluation)
    targets = sorted(rng.sample(range(1, steps - 1), kills))
    landed, starts, moments = 0, 0, []
    for t in targets:
        p = launch(killed, extra)
        starts += 1
        mark = killed / "checkpoints" / f"step_{t:07d}.pt"
        while p.poll() is None and not mark.exists():
            time.sleep(0.01)
        if p.poll() is not None:  # already past t: this start resumed beyond the target
            _, err = p.communicate()
            if p.returncode != 0:
                raise SystemExit(f"{dtype}: a resumed run failed:\n{err[-2000:]}")
            continue
        delay = rng.uniform(0, 1.5 * per_step)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        landed += 1
        done = sorted(killed.glob("checkpoints/step_*"))
        moments.append({"after_step": t, "delay_s": round(delay, 3),
                        "newest_checkpoint": done[-1].name if done else None})
        print(f"{dtype}: kill {landed} {delay:.2f} s after step {t}'s save "
              f"(newest checkpoint: {done[-1].name if done else 'none'})", flush=True)
    p = launch(killed, extra)  # and to the end
    starts += 1
    _, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"{dtype}: a resumed run failed:\n{err[-2000:]}")
    a, b = weights(straight), weights(killed)
    same_weights = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    same_rows = rows(straight) == rows(killed)
    print(f"{dtype}: {landed} kills over {starts} starts; weights "
          f"{'identical' if same_weights else 'DIFFER'}, metrics rows "
          f"{'identical' if same_rows else 'DIFFER'} ({len(rows(killed))} rows)", flush=True)
    return {"dtype": dtype, "kills": landed, "starts": starts, "kill_moments": moments,
            "straight_run_s": round(span, 1), "first_checkpoint_s": round(first, 1),
            "same_weights": same_weights, "same_metrics": same_rows, "rows": len(rows(killed))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="", help="a new folder for the runs (default: a temp one)")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--multiturn", action="store_true",
                    help="a multi-turn run: an environment answers each turn")
    args = ap.parse_args()
    save = claim(args.json, __file__)
    import tempfile

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kill_resume_"))
    rng = random.Random(args.seed)
    setup = []
    if args.multiturn:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import tiny_lm_dir

        setup = [*MULTITURN, f"--init_from={tiny_lm_dir(work / 'lm')}"]
    results = [one(d, args.kills, work, rng, setup) for d in args.dtypes]
    for r in results:
        r["rounds_per_rollout"] = _rounds(work / f"{r['dtype']}_killed")
    shown = [*ARGS, *setup[:-1], "--init_from=(a tiny model: tests/conftest.py tiny_lm_dir)"] \
        if setup else ARGS
    save({"cpu": cpu_name(), "args": shown, "results": results}, indent=2)
    return 0 if all(r["same_weights"] and r["same_metrics"] for r in results) else 1


def _rounds(out: Path) -> float | None:
    """Tool or environment rounds per rollout over the run's steps (None: single-turn)."""
    got = [r["tools/rounds"] for r in rows(out) if "tools/rounds" in r]
    return round(sum(got) / len(got), 3) if got else None


if __name__ == "__main__":
    sys.exit(main())
