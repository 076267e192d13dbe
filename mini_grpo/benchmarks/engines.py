"""The rollout engines side by side on a Hugging Face model: `python benchmark.py --config
smollm2_135m --only generation` (any config whose init_from is a model directory).

The work is what one GRPO step samples: the config's prompts_per_step training prompts
through the chat template, group_size completions each, up to max_new_tokens at the config's
temperature, stopping at EOS. Engines, each timed `repeats` times after a warm-up,
alternating so that machine noise hits all alike:
- native: our batched KV-cached sampler (engines/native.py) on the policy as `run.setup`
  builds it, in the sampling precision the run would use;
- vllm: the colocated vLLM engine (engines/vllm.py), its weights sent from the policy
  (`sync`, timed apart); skipped, and said so, where vllm is not installed;
- transformers: `AutoModelForCausalLM.generate` on the same directory, fp32, the same token
  ids (left-padded), sampling with the same temperature.
Reported: load seconds apart from generation (native: the run's set-up; vllm: the engine's
start; transformers: from_pretrained), generated tokens per second (each engine's own
completions: random weights rarely stop early, but counted to EOS when they do), RFT's data
generation on each engine (completions per second: rft_prompts_per_batch x rft_oversample
rows per pass, scored and written, as `mode: rft` runs it), and then one GRPO step section
(benchmark.py's) per engine that the machine has.

On a CPU vLLM's gains over our loop are small: no CUDA graphs, no fused GPU kernels, and a
batch of 32 rows leaves little for continuous batching to win. On a GPU, measure with
`python benchmark.py --config qwen25_05b --only generation --prompts_per_step=32
--group_size=16 --max_new_tokens=1024 --block_size=1280`.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch

from .budget import overridden


def bench_engines(cfg, task, repeats: int, step_fn) -> dict:
    """`step_fn(engine name) -> dict`: benchmark.py's step section with that rollout engine
    (each in a process of its own, run before this one loads any model: a full fine-tuning
    step beside engines that have sampled would not fit where memory is tight)."""
    from ..engines import Sampling
    from ..engines.native import NativeEngine
    from ..run import setup

    has_vllm = importlib.util.find_spec("vllm") is not None
    if not has_vllm:
        print("[bench] engines: vllm is not installed (make setup VLLM=1): its rows are "
              "skipped", file=sys.stderr, flush=True)
    # the GRPO steps first, while this process holds nothing (each in a process of its own)
    steps = {name: step_fn(name) for name in (["native", "vllm"] if has_vllm else ["native"])}
    G = cfg.group_size
    examples = task.train[:cfg.prompts_per_step]
    s = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    load, rates, secs = {}, {}, {}
    t0 = time.perf_counter()
    with setup(overridden(cfg, rollout_engine="native"), log=False, task=task) as run:
        load["native"] = time.perf_counter() - t0
        prompts = [ex.model_input for ex in examples for _ in range(G)]
        engines = {"native": NativeEngine(run.model, run.tok)}
        dtype = run.precision.generation_dtype or torch.float32  # what the run samples in
        precision = {"native": str(dtype).removeprefix("torch.")}
        if has_vllm:
            from ..engines.vllm import VLLMEngine

            t0 = time.perf_counter()
            engines["vllm"] = VLLMEngine(cfg, run.model, run.tok, run.device, run.dist,
                                         cfg.block_size)
            load["vllm"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            engines["vllm"].sync(run.model)
            load["vllm_sync"] = time.perf_counter() - t0
            precision["vllm"] = str(engines["vllm"].dtype).removeprefix("torch.")
        hf, load["transformers"] = _transformers(cfg.init_from, run.device)
        precision["transformers"] = "float32"
        enc = [run.tok.encode_prompt(p) for p in prompts]
        try:
            for rep in range(repeats + 1):  # rep 0 warms up
                for name in [*engines, "transformers"]:
                    g = torch.Generator(device=run.device).manual_seed(rep)
                    t0 = time.perf_counter()
                    if name == "transformers":
                        n = _hf_generate(hf, enc, s, run.tok, g)
                    else:
                        r = engines[name].generate(prompts, s, g,
                                                   run.precision.autocast(generation=True))
                        n = int(r.completion_mask.sum())
                    sec = time.perf_counter() - t0
                    if rep:
                        rates.setdefault(name, []).append(n / sec)
                        secs.setdefault(name, []).append(sec)
                print(f"[bench] engines: {'warm-up' if rep == 0 else f'rep {rep}/{repeats}'}: "
                      + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()),
                      file=sys.stderr, flush=True)
            rft = _rft_rates(run, engines, task.train, repeats)
        finally:
            if "vllm" in engines:
                engines["vllm"].close()
    del hf
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"model": cfg.init_from, "rows": len(prompts), "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature, "repeats": repeats, "precision": precision,
            "load_s": load, "tokens_per_s": med, "seconds": {k: statistics.median(v)
                                                             for k, v in secs.items()},
            "runs_tokens_per_s": rates,
            "over_native": {k: v / med["native"] for k, v in med.items()},
            "rft": rft, "step": steps}


def _rft_rates(run, engines: dict, train: list, repeats: int) -> dict:
    """RFT's data generation (rft.generate_rft_data: sampling, scoring, writing) on each
    engine, on two of its batches of prompts (rft_prompts_per_batch x rft_oversample rows
    each), into a scratch directory: completions per second, median of `repeats` after a
    warm-up, the engines alternating."""
    import tempfile
    from pathlib import Path

    from ..rft import first_prompts, generate_rft_data

    cfg, own = run.cfg, run.engine
    examples = first_prompts(train, 2 * cfg.rft_prompts_per_batch)
    rates: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="mini_grpo_bench_rft_") as tmp:
            for rep in range(repeats + 1):
                for name, engine in engines.items():
                    run.engine = engine
                    out = generate_rft_data(run, examples, Path(tmp) / f"{name}{rep}.jsonl")
                    if rep:
                        rates.setdefault(name, []).append(out["completions_per_s"])
    finally:
        run.engine = own
    return {"prompts": len({ex.prompt for ex in examples}), "oversample": cfg.rft_oversample,
            "prompts_per_batch": cfg.rft_prompts_per_batch,
            "completions_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "runs_completions_per_s": rates}


def _transformers(path: str, device):
    """transformers' model for `path` in fp32, and the seconds it took to load."""
    import transformers

    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval(), time.perf_counter() - t0


@torch.no_grad()
def _hf_generate(model, enc: list[list[int]], s, tok, generator) -> int:
    """transformers' sampling on our token ids, left-padded; returns the generated tokens
    (up to and including each row's EOS)."""
    width = max(map(len, enc))
    ids = torch.tensor([[tok.pad_id] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=generator,
                                        device=generator.device)))
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                         do_sample=not s.greedy, temperature=s.temperature or None,
                         top_k=s.top_k or None, top_p=s.top_p,
                         max_new_tokens=s.max_new_tokens, pad_token_id=tok.pad_id,
                         eos_token_id=list(tok.eos_ids))[:, width:].cpu()
    eos = torch.isin(out, torch.tensor(list(tok.eos_ids)))
    ended = eos.cumsum(1) - eos.long()  # tokens after the first EOS are not generated
    return int((ended == 0).sum())


def format_engines(r: dict) -> str:
    lines = [f"rollout engines: {r['model']}, {r['rows']} rows x up to {r['max_new_tokens']} "
             f"new tokens, T={r['temperature']}, median of {r['repeats']}",
             f"  {'engine':<14} {'dtype':<10} {'load s':>8} {'tok/s':>8} {'x native':>9}"]
    for k, v in r["tokens_per_s"].items():
        lines.append(f"  {k:<14} {r['precision'][k]:<10} {r['load_s'][k]:>8.1f} "
                     f"{v:>8.1f} {r['over_native'][k]:>9.2f}")
    if "vllm_sync" in r["load_s"]:
        lines.append(f"  vllm weight sync (every weight from memory): "
                     f"{r['load_s']['vllm_sync']:.3f} s")
    rft = r["rft"]
    lines.append(f"  RFT data ({rft['prompts']} prompts x {rft['oversample']}, "
                 f"{rft['prompts_per_batch']} prompts per batch, scored and written): "
                 + ", ".join(f"{k} {v:.1f}" for k, v in rft["completions_per_s"].items())
                 + " completions/s")
    for k, st in r["step"].items():
        p = st["phase_s"]
        lines.append(f"  GRPO step with {k:<7} {st['step_s']['median']:.2f} s (generate "
                     f"{p['generate']:.2f}, reference {p['reference']:.2f}, policy "
                     f"{p['policy']:.2f})")
    return "\n".join(lines)
