"""benchmark.py end to end on the tiny config: its numbers are consistent, not its speed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(tmp_path, *args):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--config", "tiny",
                        "--json", str(out), *args], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r


def test_step_section_reports_consistent_phases_tokens_and_mfu(tmp_path):
    res, r = bench(tmp_path, "--only", "step", "--warmup", "1", "--steps", "2")
    s = res["step"]
    assert s["steps"] == 2 and s["params_M"] > 0
    shares = s["phase_share"]
    # the phases are disjoint parts of the step, except the two inside the policy update
    outer = shares["generate"] + shares["reward"] + shares["reference"] + shares["policy"]
    assert 0.5 < outer <= 1.0 + 1e-6
    assert s["phase_s"]["optimizer"] <= s["phase_s"]["policy"]
    assert s["tokens_pushed_over_real"] >= 1.0  # padding can only add
    # all rows' tokens count each prompt G times, the real ones computed once per group
    assert s["tokens_pushed_over_batch"] < s["tokens_pushed_over_real"]
    m = s["mfu"]
    assert m["peak_gflops_measured"] > 0 and 0 < m["mfu_policy"] <= 1 and 0 < m["mfu_step"] <= 1
    assert "GRPO step" in r.stdout and "MFU" in r.stdout


def test_gpu_sized_config_is_scaled_down_on_cpu_and_compare_reads_results(tmp_path):
    res, r = bench(tmp_path, "--only", "step", "--warmup", "1", "--steps", "1",
                   "--prompts_per_step=64", "--group_size=4")
    assert "scaled down" in r.stderr
    assert res["step"]["prompts_per_step"] == 16  # 64 sequences
    a = tmp_path / "a.json"
    a.write_text(json.dumps(res))
    c = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--compare", str(a),
                        str(a)], capture_output=True, text=True, timeout=120)
    assert c.returncode == 0 and "step.step_s.median" in c.stdout
    assert all(line.split()[-1] == "1.000" for line in c.stdout.splitlines()[1:])
