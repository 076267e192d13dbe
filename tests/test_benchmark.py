"""benchmark.py: its planner against a slow and a fast machine, and the command end to end on
the tiny config. Its numbers are checked for consistency, never its speed."""

import json
import subprocess
import sys

from conftest import ROOT, clean_env, tiny_lm_dir

from mini_grpo.benchmarks.budget import SECTIONS, Probe, Shape, estimate, plan

# the production model's shape on the chess task: 70-token prompts, 80 new tokens, G = 16
SHAPE = Shape(prompt_len=70, max_new_tokens=80, group_size=16)
FAST = Probe(fwd_token_s=2e-6, fwd_token_gen_s=2e-6, decode_step_s=2e-3, decode_row_s=1e-6)
SLOW = Probe(fwd_token_s=4e-4, fwd_token_gen_s=1.2e-3, decode_step_s=0.05, decode_row_s=0.012)


def test_planner_fits_the_budget_on_a_slow_and_a_fast_machine():
    fast = plan(FAST, SHAPE, 600, SECTIONS, prompts_per_step=64)
    # a fast machine gets every default size, and its estimate is under the budget
    assert (fast.gen_batch, fast.repeats, fast.recompute_steps, fast.steps, fast.warmup,
            fast.prompts_per_step) == (64, 5, 72, 5, 2, 64)
    assert sum(fast.estimate_s.values()) <= 600 and not fast.notes
    slow = plan(SLOW, SHAPE, 600, SECTIONS, prompts_per_step=64)
    assert sum(estimate(SLOW, SHAPE, slow).values()) <= 600
    assert sum(slow.estimate_s.values()) == sum(estimate(SLOW, SHAPE, slow).values())
    # it shrank, and said what it extrapolates and cut
    assert slow.recompute_steps < slow.new_tokens and slow.prompts_per_step < 64
    assert any("extrapolated" in n for n in slow.notes)
    assert any("prompts" in n for n in slow.notes)
    # the full defaults on the slow machine would have taken far longer
    full = plan(SLOW, SHAPE, None, SECTIONS, prompts_per_step=64)
    assert sum(full.estimate_s.values()) > 10 * 600


def test_planner_keeps_given_sizes_and_plans_only_the_asked_sections():
    p = plan(SLOW, SHAPE, 60, ("generation",), fixed={"repeats": 4, "gen_batch": 32})
    assert (p.repeats, p.gen_batch) == (4, 32) and set(p.estimate_s) == {"generation"}
    tiny_budget = plan(SLOW, SHAPE, 1, SECTIONS, prompts_per_step=64)
    assert any("over the 1 s budget" in n for n in tiny_budget.notes)  # says it cannot fit


def bench(tmp_path, *args):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--config", "tiny",
                        "--json", str(out), *args], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path, env=clean_env())
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r


def test_budgeted_run_prints_its_plan_and_progress_and_records_the_sizes(tmp_path):
    res, r = bench(tmp_path, "--budget_s", "30", "--only", "generation")
    err = r.stderr.splitlines()
    assert any(line.startswith("[bench] plan (budget 30s): generation ~") for line in err)
    assert err.index(next(x for x in err if x.startswith("[bench] plan"))) < \
        err.index(next(x for x in err if x.startswith("[bench] generation 0/")))  # plan first
    progress = [x for x in err if x.startswith("[bench] generation ")]
    assert len(progress) >= 4 and "\r" not in r.stderr  # plain lines: stderr is no terminal
    assert all("elapsed" in x and "ETA" in x for x in progress)
    g, p = res["generation"], res["plan"]
    assert (g["batch"], g["repeats"], g["new_tokens"]) == (p["gen_batch"], p["repeats"],
                                                           p["new_tokens"])
    assert res["probe"]["fwd_token_s"] > 0 and res["cpu"]
    assert res["written_by"] == "benchmark.py"  # marked: a later --json may replace it


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
    assert "[bench] step section (1 warm-up + 2 timed" in r.stderr  # the loop's progress
    a = tmp_path / "a.json"
    a.write_text(json.dumps(res))
    c = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--compare", str(a),
                        str(a)], capture_output=True, text=True, timeout=120)
    assert c.returncode == 0 and "step.step_s.median" in c.stdout
    assert all(line.split()[-1] == "1.000" for line in c.stdout.splitlines()[1:])


def test_full_fine_tuning_against_lora_side_by_side(tmp_path):
    lm = tiny_lm_dir(tmp_path / "lm")
    res, r = bench(tmp_path, "--only", "lora", "--rounds", "1", "--warmup", "1", "--steps",
                   "1", f"--init_from={lm}", "--block_size=256", "--max_new_tokens=8",
                   "--lora_r=4")
    lo = res["lora"]
    full, lora = lo["full"], lo["lora"]
    assert lo["lora_r"] == 4 and len(full["runs"]) == len(lora["runs"]) == 1
    assert full["bytes_MiB"]["frozen"] == 0 and lora["bytes_MiB"]["frozen"] > 0
    # the adapters are a fraction of the model: so are their gradients and AdamW state
    for k in ("params", "grads", "optimizer"):
        assert lora["bytes_MiB"][k] < 0.5 * full["bytes_MiB"][k], k
    assert lora["step_s"] > 0 and full["rss_peak_MiB"] > 0
    assert "full fine-tuning vs LoRA r=4" in r.stdout and "frozen MiB" in r.stdout


def test_the_rollout_engines_side_by_side_on_a_hugging_face_model(tmp_path):
    lm = tiny_lm_dir(tmp_path / "lm", heads=2)  # head_dim 32: vLLM's CPU attention takes it
    res, r = bench(tmp_path, "--only", "generation", "--repeats", "1", "--warmup", "1",
                   "--steps", "1", "--budget_s", "0", f"--init_from={lm}", "--mode=grpo",
                   "--block_size=256", "--max_new_tokens=8")
    e = res["engines"]
    engines = {"native", "transformers"} | ({"vllm"} if "vllm" in e["load_s"] else set())
    assert set(e["tokens_per_s"]) == engines and e["over_native"]["native"] == 1.0
    assert all(v > 0 for v in e["tokens_per_s"].values())
    assert set(e["step"]) == engines - {"transformers"}
    assert "rollout engines:" in r.stdout and "GRPO step with native" in r.stdout
    # RFT's data generation on each engine that samples for us (not transformers)
    rft = e["rft"]
    assert set(rft["completions_per_s"]) == engines - {"transformers"}
    assert all(v > 0 for v in rft["completions_per_s"].values())
    assert "RFT data (" in r.stdout and "completions/s" in r.stdout


def test_compare_names_a_file_it_cannot_read(tmp_path):
    """A missing file was a FileNotFoundError traceback, a JSON list an AttributeError."""
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "a.json").write_text(json.dumps({"step": {"seconds": 2.0}}))
    (tmp_path / "b.json").write_text(json.dumps({"step": {"seconds": 1.0}}))
    run = lambda *files: subprocess.run([sys.executable, "benchmark.py", "--compare", *files],
                                        cwd=ROOT, capture_output=True, text=True,
                                        env=clean_env(), timeout=120)
    for files, why in [((tmp_path / "none.json", tmp_path / "a.json"), "No such file"),
                       ((tmp_path / "list.json", tmp_path / "a.json"), "not a results file")]:
        r = run(*map(str, files))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    r = run(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert r.returncode == 0 and "step.seconds" in r.stdout and "0.500" in r.stdout
