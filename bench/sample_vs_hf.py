"""`mini-grpo sample` against transformers' `generate` on the same work, each a whole process.

    python bench/sample_vs_hf.py [--model_dir /tmp/smollm2_135m_shape] [--reps 3] \
        [--out bench/sample_vs_hf_<cpu>.json]

The model is SmolLM2-135M's shape (a Llama: 30 layers, 576 wide, 9 heads of which 3 for keys
and values, 1536 MLP, 49,152-token vocabulary, tied head) with random weights, and a word-level
tokenizer of the same vocabulary with a ChatML template, built locally with transformers
(nothing is downloaded) the first time (mini_grpo/benchmarks/shapes.py). The work: one chat
prompt, 8 completions of 96 new tokens, sampled at temperature 1 on 2 threads. Each command is
timed from process start to exit (imports, model load, tokenizer, sampling), alternating,
`--reps` times each: ours as a user runs it (the sampling precision its probe picked, from the
cache a first, untimed-for- the-ratio run filled) and in fp32 (`--generation_amp=off`),
transformers' in fp32 (its default). The medians of wall and CPU seconds and their ratios are
printed and written as JSON. `--model_dir` may name a real model instead (`models/gemma3-270m`):
a base model without a chat template gets the prompt as plain text after its `<bos>`, in
both."""

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

from outfile import claim

from mini_grpo.benchmarks.shapes import build
from mini_grpo.dtype_probe import cpu_name

PROMPT = "e2e4 e7e5 g1f3 b8c6 f1b5 a7a6: write the FEN of the final position"
N, NEW = 8, 96

HF_SCRIPT = """
import sys, torch, transformers
d, prompt, n, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
tok = transformers.AutoTokenizer.from_pretrained(d)
model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
if tok.chat_template:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
else:  # a base model: its <bos> and the text, as `mini-grpo sample` gives it
    ids = tok(prompt, return_tensors="pt")["input_ids"]
with torch.no_grad():
    out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=new, num_return_sequences=n,
                         pad_token_id=tok.pad_token_id)
texts = tok.batch_decode(out[:, ids.size(1):], skip_special_tokens=True)
print(sum(len(t) for t in texts) > 0)
"""


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `cmd` as a whole process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed:\n{r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", default="/tmp/smollm2_135m_shape")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    save = claim(args.out, __file__)
    d = Path(args.model_dir)
    if not (d / "config.json").is_file():
        print(f"building {d} (SmolLM2-135M shape, random weights)", flush=True)
        build("smollm2-135m", d)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    ours = [sys.executable, "-m", "mini_grpo", "sample", "--checkpoint", str(d),
            "--prompt", PROMPT, "--n", str(N), "--max_new_tokens", str(NEW)]
    hf = [sys.executable, "-c", HF_SCRIPT, str(d), PROMPT, str(N), str(NEW)]
    with tempfile.TemporaryDirectory() as tmp:  # a probe cache of this benchmark's own
        env["MINI_GRPO_PROBE_CACHE"] = f"{tmp}/probe.json"
        first = timed(ours, env)  # probes the sampling precision, then caches the verdict
        print(f"first mini_grpo_sample (probes, caches): {first[0]:.1f} s wall", flush=True)
        commands = {"mini_grpo_sample": ours,  # as users run it: the cached verdict
                    "mini_grpo_sample_fp32": [*ours, "--generation_amp=off"],
                    "hf_generate": hf}
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in commands}
        for rep in range(args.reps):
            for name, cmd in commands.items():
                runs[name].append(timed(cmd, env))
                w, c = runs[name][-1]
                print(f"rep {rep + 1}/{args.reps} {name}: {w:.1f} s wall, {c:.1f} s CPU",
                      flush=True)
    med = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    result = {"work": f"1 prompt x {N} completions x {NEW} new tokens, 2 threads",
              "model": d.name,
              "cpu": cpu_name(), "first_run_with_probe_s": first, "runs": runs,
              "median_wall_s": med, "median_cpu_s": cpu,
              "ratio_ours_to_hf": med["mini_grpo_sample"] / med["hf_generate"],
              "ratio_ours_fp32_to_hf": med["mini_grpo_sample_fp32"] / med["hf_generate"],
              "cpu_ratio_ours_to_hf": cpu["mini_grpo_sample"] / cpu["hf_generate"],
              "cpu_ratio_ours_fp32_to_hf": cpu["mini_grpo_sample_fp32"] / cpu["hf_generate"]}
    print(json.dumps({k: result[k] for k in (
        "median_wall_s", "median_cpu_s", "ratio_ours_to_hf", "ratio_ours_fp32_to_hf",
        "cpu_ratio_ours_to_hf", "cpu_ratio_ours_fp32_to_hf")}, indent=1))
    save(result, indent=2)


if __name__ == "__main__":
    main()
