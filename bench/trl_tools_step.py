"""A multi-turn GRPO step with the calculator tool against TRL's GRPOTrainer doing the same
work, side by side (issue 40).

    PYTHONPATH=<trl's site> python bench/trl_tools_step.py [--model DIR] [--warmup 1]
        [--steps 3] [--out bench/trl_tools_step_<cpu>.json]

Needs `pip install trl==1.16.*` (not a dependency of mini-grpo; with datasets, pandas and
pyarrow) and a model that calls the tool: by default the calculator job's
(runs/smollm2_calculator/hf: SmolLM2-135M-Instruct after its SFT and GRPO with the tool,
`make calculator-job`). TRL reads tool calls only through the chat templates it knows, so
both trainers get the model with TRL's own Qwen2.5 template (trl/chat_templates/
qwen2_5.jinja: tools listed in the system message, Hermes <tool_call> JSON calls, results as
<tool_response> blocks), copied into a temporary directory.

The work: 8 calculator-task training prompts (our task's, as user messages), 8 completions
each (64 rows) of at most 80 tokens in all (the model's turns and the tool's results; TRL's
max_completion_length means the same), sampled at temperature 0.7, at most 2 tool rounds
(TRL: max_tool_calling_iterations), rewards numeric_format (0.1) + numeric_answer (0.9) on the
last turn, one policy pass over the 64 rows in micro-batches of 16 (TRL: batch 16 x 4
accumulation steps), the DAPO loss, clip 0.2/0.28, beta 0, AdamW at lr 1e-5. Every group is
trained on (our dynamic_sampling off). Both on 2 threads, one process each. TRL runs in fp32
and with bf16=True; its faster one is the baseline. Each step is timed end to end (TRL:
between on_step_end callbacks; ours: the trainer's time/step) after `--warmup` steps, with
the completion length and the tool calls per rollout beside it (the prompts differ: each
trainer draws its own from the same training set)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from trl_step import compare, summary, timed_trl, trl_precisions  # noqa: E402

MODEL = ROOT / "runs" / "smollm2_calculator" / "hf"
WORK = dict(prompts=8, group=8, new_tokens=80, micro=16, temperature=0.7, lr=1e-5,
            max_tool_rounds=2)


def with_template(model: Path, out: Path) -> Path:
    """A copy of `model` whose tokenizer carries TRL's Qwen2.5 chat template."""
    from importlib.resources import files

    from transformers import AutoTokenizer

    template = (files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.name not in ("tokenizer_config.json", "chat_template.jinja", "tokenizer.json"):
            shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = template
    tok.save_pretrained(out)
    return out


def last_turn(completion) -> str:
    """The text a reward reads: a conversational completion's last message of the model's."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")


def run_trl(model: Path, precision: str, warmup: int, steps: int) -> dict:
    """TRL's GRPOTrainer on the work, in this process."""
    import torch

    from mini_grpo.config import GRPOConfig as OurConfig
    from mini_grpo.rewards.answers import numeric_answer, numeric_format
    from mini_grpo.tasks.calculator import Args, build
    from mini_grpo.tools import calculator

    torch.set_num_threads(2)
    torch.manual_seed(0)
    task = build(OurConfig(task="calculator", num_eval=600), Args())
    rows = [{"prompt": [{"role": "user", "content": ex.prompt}], "target": ex.target}
            for ex in task.train[:2000]]

    def fmt(prompts, completions, target, **kw):
        return numeric_format(prompts, [last_turn(c) for c in completions], target,
                              [{}] * len(target))

    def answer(prompts, completions, target, **kw):
        return numeric_answer(prompts, [last_turn(c) for c in completions], target,
                              [{}] * len(target))

    step_s, logged = timed_trl(model, rows, [fmt, answer], precision, warmup, steps, WORK,
                               max_tool_calling_iterations=WORK["max_tool_rounds"],
                               tools=[calculator])
    out = summary(step_s, [g["completions/mean_length"] for g in logged],
                  WORK["prompts"] * WORK["group"], precision=precision,
                  trl=__import__("trl").__version__)
    out["tool_calls"] = [g.get("tools/call_frequency") for g in logged]
    out["reward"] = [g.get("reward") for g in logged]
    out["rss_peak_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_ours(model: Path, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--config",
                        "smollm2_calculator", "--only", "step", "--warmup", str(warmup),
                        "--steps", str(steps), "--budget_s", "0", "--json", str(out),
                        f"--init_from={model}", "--dynamic_sampling=false",
                        f"--prompts_per_step={WORK['prompts']}", f"--group_size={WORK['group']}",
                        f"--max_new_tokens={WORK['new_tokens']}",
                        f"--micro_batch_size={WORK['micro']}",
                        f"--temperature={WORK['temperature']}", f"--lr={WORK['lr']}",
                        f"--max_tool_calls={WORK['max_tool_rounds']}", "--loss_agg=dapo",
                        "--beta=0"], check=True, cwd=ROOT)
        r = json.loads(out.read_text())
    step = r["step"]
    got = summary(step["per_step"]["step_s"], step["per_step"]["completion_len"],
                  WORK["prompts"] * WORK["group"], precision=step["precision"],
                  phase_s=step["phase_s"])
    got["tool_calls"] = step["per_step"].get("tool_calls")
    got["rss_peak_MiB"] = step.get("memory", {}).get("rss_peak_MiB")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--trl", choices=["fp32", "bf16"], help=argparse.SUPPRESS)  # one child run
    a = ap.parse_args()
    if a.trl:
        print(json.dumps(run_trl(Path(a.model), a.trl, a.warmup, a.steps)))
        return 0
    from outfile import claim  # here: TRL's processes import no more of mini_grpo than before

    save = claim(a.out, __file__)
    if not (Path(a.model) / "config.json").exists():
        sys.exit(f"{a.model}: not found; run `make calculator-job` first (or pass --model)")
    from mini_grpo.dtype_probe import cpu_isa, cpu_name

    results = {"cpu": cpu_name(), "isa": cpu_isa()["flags"], "work": WORK, "warmup": a.warmup,
               "steps": a.steps,
               "model": "the calculator job's (SmolLM2-135M-Instruct after SFT and GRPO with "
                        "the tool), with TRL's Qwen2.5 chat template"}
    with tempfile.TemporaryDirectory() as tmp:
        model = with_template(Path(a.model), Path(tmp) / "model")
        results["mini_grpo"] = run_ours(model, a.warmup, a.steps)
        env = dict(os.environ, OMP_NUM_THREADS="2")
        for precision in trl_precisions(results):
            r = subprocess.run([sys.executable, __file__, "--trl", precision, "--model",
                                str(model), "--warmup", str(a.warmup), "--steps", str(a.steps)],
                               cwd=ROOT, env=env, check=True, stdout=subprocess.PIPE, text=True)
            results[f"trl_{precision}"] = json.loads(r.stdout.strip().splitlines()[-1])
    compare(results)
    save(results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
