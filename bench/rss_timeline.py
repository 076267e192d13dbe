"""Where in a job its resident memory peaks: runs the LM job (configs/smollm2_numeric, or
`--config`) as a child process, samples its RSS every 0.2 s beside the lines it prints, and
names the lines after which RSS was highest (nothing else heavy beside it):

    .venv/bin/python bench/rss_timeline.py --out_dir runs/rss_timeline -- \\
        --rft_num_prompts=64 --rft_sft_steps=6 --max_steps=12

Prints the 12 highest maxima, each with the last line the job printed before it (a phase's
closing line: the maximum came after it); `--timeline F` writes every sample and every line,
with their seconds since start, to F.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from lm_job_cost import proc_gib  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out_dir", required=True, help="the job's out_dir (new or its own)")
    ap.add_argument("--config", default="smollm2_numeric")
    ap.add_argument("--timeline", default="", help="write every sample and line here (new file)")
    ap.add_argument("extra", nargs="*", help="more options for distributed_train.py")
    a = ap.parse_args()
    if a.timeline and Path(a.timeline).exists():
        raise SystemExit(f"--timeline {a.timeline} exists; it is left alone (choose another)")
    args = [sys.executable, "-u", str(ROOT / "distributed_train.py"), "--config", a.config,
            "--report_to=[]", f"--out_dir={a.out_dir}", *a.extra]
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    t0, lines, samples = time.perf_counter(), [], []

    def read():
        for line in p.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))
            print(line, end="", flush=True)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while p.poll() is None:
        r = proc_gib(p.pid, "VmRSS")
        if r is not None:
            samples.append((time.perf_counter() - t0, r))
        time.sleep(0.2)
    reader.join()
    highest: dict[str, float] = {}
    i, before = 0, "(start)"
    for t, r in samples:  # each sample under the last line printed before it
        while i < len(lines) and lines[i][0] <= t:
            before = lines[i][1][:150]
            i += 1
        highest[before] = max(highest.get(before, 0.0), r)
    print(f"\nexit {p.returncode}; RSS maxima (GiB), each after the line it follows:")
    for line, r in sorted(highest.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{r:6.3f}  {line}")
    if a.timeline:
        Path(a.timeline).write_text("".join(f"{t:.1f} rss {r:.3f}\n" for t, r in samples)
                                    + "".join(f"{t:.1f} line {s}\n" for t, s in lines))
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
