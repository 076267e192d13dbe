"""The LM job's GRPO step against TRL's GRPOTrainer doing the same work, side by side.

    python bench/trl_step.py [--model DIR] [--warmup 1] [--steps 4] [--out FILE.json]

Needs `make model` (models/smollm2-135m-instruct: SmolLM2-135M-Instruct, real weights) and
`pip install trl==1.16.*` (not a dependency of mini-grpo; it brings datasets and pandas).

The work, the LM job's GRPO stage (configs/smollm2_numeric.yaml, read at run time): 8
numeric-task training prompts through the model's chat template (a base model's, without one, as
plain text), 8 completions each (64 rows) of at most max_new_tokens (48) sampled at the config's
temperature (0.7), rewards numeric_format (0.1) + numeric_answer (0.9), then one policy pass
over the 64 rows in micro-batches of 16 (TRL: per_device_train_batch_size 16,
gradient_accumulation_steps 4, which makes its generation batch 64; ours: the rows whose loss
has a gradient, in micro-batches of at most 512 positions - with beta 0 the rows of a group
whose rewards are all equal have advantage 0 and add exactly nothing, so no pass carries them,
where TRL's passes carry every row), the DAPO loss with the config's clip (0.2/0.28), beta 0 (no
reference model), AdamW at the config's lr. Both on 2 threads, one process each. `--model` is
the weights both start from: the base model by default; the job's GRPO stage starts from its SFT
stage's weights, which a run exports as hf/ (`--model runs/<sft run>/hf`: the answers are then
the short worked ones the job's GRPO samples, not the base model's long ones).

Ours runs as `benchmark.py --config smollm2_numeric --only step --init_from=<model>` (the
trainer's own step, its precision from the dtype probe). TRL runs twice, in fp32 and with
`bf16=True` (autocast in training; its generation stays fp32), with gradient checkpointing off
(its default is on, which is slower on a model this small): its faster one is the baseline
(on a CPU without bf16 kernels, AVX2 alone, the bf16 run is left out: emulated, it took longer
than the rest together). Each step is timed end to end (TRL: between consecutive on_step_end
callbacks; ours: the trainer's time/step), after `--warmup` steps. The prompts differ (each
trainer draws its own from the same training set), so the mean completion length of each step
is recorded too, and time per generated token is reported beside time per step. Peak RSS is
each whole process's."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
JOB = "smollm2_numeric"  # the config whose GRPO step is timed


def job_work() -> dict:
    """The GRPO step's sizes and settings in the job's config, as both trainers get them."""
    from mini_grpo.config import load_config

    cfg = load_config(JOB)
    return dict(prompts=cfg.prompts_per_step, group=cfg.group_size,
                new_tokens=cfg.max_new_tokens, micro=min(16, cfg.micro_batch_size),
                temperature=cfg.temperature, lr=cfg.lr, epsilon=cfg.epsilon_low,
                epsilon_high=cfg.epsilon_high)


def run_trl(model: Path, precision: str, warmup: int, steps: int) -> dict:
    """TRL's GRPOTrainer on the job's work from `model`'s weights, in this process."""
    import torch

    from mini_grpo.config import GRPOConfig as OurConfig
    from mini_grpo.rewards.answers import numeric_answer, numeric_format
    from mini_grpo.tasks.numeric import Args, build

    torch.set_num_threads(2)
    torch.manual_seed(0)
    task = build(OurConfig(task="numeric", num_eval=500), Args())
    from transformers import AutoTokenizer

    # a chat model gets the prompt as a user's turn; a base model (no chat template: Gemma 3
    # 270M) the text as written, as ours gives it
    chat = AutoTokenizer.from_pretrained(model).chat_template is not None
    rows = [{"prompt": [{"role": "user", "content": ex.prompt}] if chat else ex.prompt,
             "target": ex.target} for ex in task.train[:2000]]

    def text(c):  # a conversational completion: [{"role": "assistant", "content": ...}]
        return c[0]["content"] if isinstance(c, list) else c

    def fmt(prompts, completions, target, **kw):
        return numeric_format(prompts, [text(c) for c in completions], target, [{}] * len(target))

    def answer(prompts, completions, target, **kw):
        return numeric_answer(prompts, [text(c) for c in completions], target,
                              [{}] * len(target))

    work = job_work()
    step_s, logged = timed_trl(model, rows, [fmt, answer], precision, warmup, steps, work)
    return summary(step_s, [g["completions/mean_length"] for g in logged],
                   work["prompts"] * work["group"], precision=precision,
                   trl=__import__("trl").__version__,
                   rss_peak_MiB=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def timed_trl(model, rows: list[dict], reward_funcs: list, precision: str, warmup: int,
              steps: int, work: dict, **extra) -> tuple[list[float], list[dict]]:
    """TRL's GRPOTrainer on `work` (prompts, group, new_tokens, micro, temperature, lr) with
    `extra` GRPOConfig options (tools' too: tools=[...] goes to the trainer) -> (each timed
    step's seconds, each timed step's logged metrics)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tools = extra.pop("tools", None)
    ends: list[float] = []
    logged: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                logged.append(logs)

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=warmup + steps, per_device_train_batch_size=work["micro"],
            gradient_accumulation_steps=work["prompts"] * work["group"] // work["micro"],
            num_generations=work["group"], max_completion_length=work["new_tokens"],
            temperature=work["temperature"], top_k=0, top_p=1.0, beta=0.0,
            epsilon=work.get("epsilon", 0.2), epsilon_high=work.get("epsilon_high", 0.28),
            loss_type="dapo", learning_rate=work["lr"],
            use_cpu=True, bf16=precision == "bf16", gradient_checkpointing=False,
            logging_steps=1, report_to=[], save_strategy="no", seed=0,
            reward_weights=[0.1, 0.9], dataloader_num_workers=0, disable_tqdm=True, **extra)
        tok = AutoTokenizer.from_pretrained(model)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        trainer = GRPOTrainer(model=policy, args=args, processing_class=tok,
                              reward_funcs=reward_funcs, train_dataset=Dataset.from_list(rows),
                              callbacks=[Clock()], **({"tools": tools} if tools else {}))
        trainer.train()
    return [b - a for a, b in zip(ends, ends[1:])][warmup:], logged[warmup:]


def summary(step_s: list[float], lens: list[float], rows: int, **extra) -> dict:
    """Per-step seconds and mean completion lengths (of `rows` completions a step) -> the
    medians per step and per generated token, beside `extra`."""
    per_tok = [s / (n * rows) for s, n in zip(step_s, lens)]
    return {**extra, "step_s": step_s, "completion_len": lens,
            "median_step_s": statistics.median(step_s),
            "median_s_per_generated_token": statistics.median(per_tok)}


def run_ours(model: Path, work: dict, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--config", JOB,
                        "--only", "step", "--warmup", str(warmup), "--steps", str(steps),
                        "--budget_s", "0", "--json", str(out), f"--init_from={model}"],
                       check=True, cwd=ROOT)
        r = json.loads(out.read_text())
    step = r["step"]
    return summary(step["per_step"]["step_s"], step["per_step"]["completion_len"],
                   work["prompts"] * work["group"],
                   precision=step["precision"], phase_s=step["phase_s"],
                   rss_peak_MiB=step.get("memory", {}).get("rss_peak_MiB"))


def trl_precisions(results: dict) -> tuple[str, ...]:
    """The precisions TRL runs in here: fp32, and bf16 where the device has bf16 kernels. A
    CPU with AVX2 alone (no AVX-512 BF16, no AMX) runs bf16 autocast emulated, many times
    slower than fp32 (5 steps ran over 20 minutes without finishing, where the fp32 run took
    ~5): never the baseline, so not run, and `results` says so."""
    import torch
    if torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ("fp32", "bf16")
    results["trl_bf16"] = None
    results["trl_bf16_skipped"] = "this CPU has no bf16 kernels (oneDNN): TRL's bf16 runs emulated"
    return ("fp32",)


def compare(results: dict) -> None:
    """The faster TRL run as the baseline, our ratios to it (into `results`), and a line per
    trainer (tool calls per rollout too, where the runs counted them)."""
    ran = [k for k in ("mini_grpo", "trl_fp32", "trl_bf16") if results.get(k)]
    best = min(ran[1:], key=lambda k: results[k]["median_step_s"])
    ours = results["mini_grpo"]
    results["baseline"] = best
    results["ratio_step"] = ours["median_step_s"] / results[best]["median_step_s"]
    results["ratio_per_generated_token"] = (ours["median_s_per_generated_token"]
                                            / results[best]["median_s_per_generated_token"])
    if ours.get("rss_peak_MiB") and results[best].get("rss_peak_MiB"):  # each whole process
        results["ratio_peak_rss"] = ours["rss_peak_MiB"] / results[best]["rss_peak_MiB"]
    for k in ran:
        r = results[k]
        calls = [c for c in r.get("tool_calls") or [] if c is not None]
        print(f"{k:10s} step {r['median_step_s']:6.1f} s  "
              f"({1e3 * r['median_s_per_generated_token']:.2f} ms per generated token, "
              f"mean completion {statistics.mean(r['completion_len']):.1f} tokens"
              + (f", {statistics.mean(calls):.2f} calls per rollout" if calls else "")
              + (f", peak RSS {r['rss_peak_MiB'] / 1024:.2f} GiB" if r.get("rss_peak_MiB")
                 else "") + ")")
    print(f"mini-grpo / TRL ({best}): {results['ratio_step']:.2f}x the time per step, "
          f"{results['ratio_per_generated_token']:.2f}x per generated token"
          + (f", {results['ratio_peak_rss']:.2f}x the peak RSS" if "ratio_peak_rss" in results
             else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL,
                    help="the Hugging Face directory both trainers start from (default: the "
                         "base model; the job's GRPO starts from its SFT run's hf/)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--trl", choices=["fp32", "bf16"], help=argparse.SUPPRESS)  # one child run
    a = ap.parse_args()
    if a.trl:
        print(json.dumps(run_trl(a.model, a.trl, a.warmup, a.steps)))
        return 0
    from outfile import claim  # here: TRL's processes import no more of mini_grpo than before

    save = claim(a.out, __file__)
    if not (a.model / "config.json").exists():
        sys.exit(f"{a.model}: no config.json: not a Hugging Face model directory"
                 + ("; run `make model` first" if a.model == MODEL else ""))
    a.model = a.model.resolve()
    from mini_grpo.dtype_probe import cpu_isa, cpu_name

    # the model by its path in the checkout (a machine's own paths stay out of the results)
    model = a.model.relative_to(ROOT) if a.model.is_relative_to(ROOT) else a.model.name
    work = job_work()
    results = {"cpu": cpu_name(), "isa": cpu_isa()["flags"], "model": str(model),
               "work": work, "warmup": a.warmup, "steps": a.steps}
    results["mini_grpo"] = run_ours(a.model, work, a.warmup, a.steps)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    for precision in trl_precisions(results):
        r = subprocess.run([sys.executable, __file__, "--trl", precision, "--model", str(a.model),
                            "--warmup", str(a.warmup), "--steps", str(a.steps)], cwd=ROOT, env=env,
                           check=True, stdout=subprocess.PIPE, text=True)
        results[f"trl_{precision}"] = json.loads(r.stdout.strip().splitlines()[-1])
    compare(results)
    save(results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
