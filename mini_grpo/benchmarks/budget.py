"""benchmark.py's time budget: a probe of this machine, a plan that fits --budget_s, progress.

On a CPU a benchmark of a GPU-sized config would otherwise run for an hour with no sign of
life. `probe_machine` times the config's model on this machine (a forward in each precision,
a cached decode step at two batch sizes; seconds at most), `plan` picks the sizes whose
estimate fits the budget and says what it shrank, and `Progress` reports every long phase on
stderr. The planner is a pure function of the probe's figures, tested for slow and fast
machines without timing anything.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field

import torch

from mini_grpo.engines.native import generate

SECTIONS = ("generation", "rewards", "step")


# ---- the time budget: probe, plan, progress ----

@dataclass
class Probe:
    """This machine's speed on the config's model: seconds per token position of a forward
    pass (training and sampling precision), and a cached decode step's seconds as a line in
    the rows decoded, fitted through two batch sizes: decode_step_s + decode_row_s x rows."""
    fwd_token_s: float
    fwd_token_gen_s: float
    decode_step_s: float
    decode_row_s: float
    setup_s: float = 0.0  # one run.setup (model, pools, dtype probe): paid by each section
    reward_workers: int = 2
    seconds: float = 0.0  # what the probe itself took

    def decode(self, rows: int) -> float:
        return self.decode_step_s + self.decode_row_s * rows


@dataclass
class Plan:
    gen_batch: int = 64
    new_tokens: int = 72
    repeats: int = 5
    recompute_steps: int = 72  # decode steps of the recompute baseline (< new_tokens: extrapolated)
    reward_rows: int = 4096
    prompts_per_step: int = 16
    warmup: int = 2
    steps: int = 5
    estimate_s: dict = field(default_factory=dict)  # section -> expected seconds
    notes: list = field(default_factory=list)  # what was shrunk or skipped, and why


@dataclass
class Shape:
    """What the plan needs to know of the config: prompt length, completion length, group
    size, passes, and whether a reference pass runs."""
    prompt_len: int
    max_new_tokens: int
    group_size: int
    num_iterations: int = 1
    reference: bool = True


def estimate(probe: Probe, shape: Shape, p: Plan) -> dict[str, float]:
    """Expected seconds per section under plan p (upper bounds where it guesses: a random-init
    policy's completions often run to max_new_tokens)."""
    decode = probe.decode
    P, N = shape.prompt_len, shape.max_new_tokens
    kv = p.gen_batch * P * probe.fwd_token_gen_s + p.new_tokens * decode(p.gen_batch)
    k = p.recompute_steps
    recompute = k * p.gen_batch * (P + k / 2) * probe.fwd_token_gen_s
    rows = p.prompts_per_step * shape.group_size
    passes = (1 if shape.reference else 0) + 3 * shape.num_iterations  # backward = 2 forwards
    step = N * decode(rows) + passes * rows * (P + N) * probe.fwd_token_s
    # rewards: 6 plugin sets x 3 executors, a process pool started for each (~1 s a worker:
    # spawn re-imports benchmark.py and torch; 8 workers took 51 s), 3 passes over the
    # rows at ~50k rows/s
    return {"generation": probe.setup_s + (1 + p.repeats) * (kv + recompute),
            "rewards": 6 * (0.5 + 1.0 * probe.reward_workers) + 18 * 3 * p.reward_rows / 5e4,
            "step": probe.setup_s + 2.0 + (p.warmup + p.steps) * step}  # + the matmul peak


def plan(probe: Probe, shape: Shape, budget_s: float | None, sections=SECTIONS,
         fixed: dict | None = None, prompts_per_step: int = 16) -> Plan:
    """Sizes whose estimate fits `budget_s` (None: the full defaults). Shrinks, in order:
    generation repeats, the recompute baseline (extrapolated from fewer decode steps), the
    generation batch, reward rows, the step's warm-up and timed steps, then its prompts per
    step; then grows back, in the reverse order, whatever still fits. Sizes in `fixed` (given
    by the user) are never changed."""
    fixed = fixed or {}
    p = Plan(prompts_per_step=prompts_per_step)
    for k, v in fixed.items():
        setattr(p, k, v)
    if "recompute_steps" not in fixed:
        p.recompute_steps = p.new_tokens
    if budget_s is None:
        p.estimate_s = {s: v for s, v in estimate(probe, shape, p).items() if s in sections}
        return p

    def total():
        return sum(v for s, v in estimate(probe, shape, p).items() if s in sections)

    moves = [("repeats", [5, 3, 2]), ("recompute_steps", [p.new_tokens, 32, 16, 8, 4]),
             ("gen_batch", [64, 32, 16, 8]), ("reward_rows", [4096, 2048, 1024]),
             ("warmup", [2, 1]), ("steps", [5, 3, 2]),
             ("prompts_per_step", sorted({max(1, prompts_per_step // d) for d in
                                          (1, 2, 4, 8, 16, 32, 64)}, reverse=True))]
    for name, values in moves:  # shrink, cheapest losses first, until the estimate fits
        if name in fixed:
            continue
        for v in values:
            if total() <= budget_s:
                break
            if v < getattr(p, name):
                setattr(p, name, v)
    for name, values in reversed(moves):  # then give back what still fits, the step first
        if name in fixed:
            continue
        for v in values:  # largest first
            if v <= getattr(p, name):
                break
            was = getattr(p, name)
            setattr(p, name, v)
            if total() <= budget_s:
                break
            setattr(p, name, was)
    p.estimate_s = {s: v for s, v in estimate(probe, shape, p).items() if s in sections}
    if p.recompute_steps < p.new_tokens and "generation" in sections:
        p.notes.append(f"recompute baseline measured over {p.recompute_steps} of "
                       f"{p.new_tokens} decode steps and extrapolated")
    if p.prompts_per_step < prompts_per_step and "step" in sections:
        p.notes.append(f"GRPO step cut from {prompts_per_step} to {p.prompts_per_step} prompts")
    if total() > budget_s:
        p.notes.append(f"even the smallest sizes need ~{total():.0f} s, over the "
                       f"{budget_s:.0f} s budget")
    return p


def format_plan(p: Plan, probe: Probe | None, budget_s: float | None) -> str:
    est = ", ".join(f"{s} ~{v:.0f}s" for s, v in p.estimate_s.items())
    head = (f"[bench] plan (budget {budget_s:.0f}s): " if budget_s else "[bench] plan: ") + est
    sizes = (f"[bench] sizes: generation batch {p.gen_batch} x {p.new_tokens} tokens, "
             f"{p.repeats} repeats, recompute {p.recompute_steps} steps; reward rows "
             f"{p.reward_rows}; step {p.prompts_per_step} prompts, {p.warmup} warm-up + "
             f"{p.steps} timed")
    lines = [head, sizes]
    if probe:
        lines.append(f"[bench] probe ({probe.seconds:.1f}s): forward {probe.fwd_token_s * 1e6:.1f} "
                     f"us/token (sampling precision {probe.fwd_token_gen_s * 1e6:.1f}), cached "
                     f"decode step {probe.decode_step_s * 1e3:.2f} ms + "
                     f"{probe.decode_row_s * 1e3:.3f} ms/row")
    lines += [f"[bench] note: {n}" for n in p.notes]
    return "\n".join(lines)


class Progress:
    """'[bench] section i/n label, elapsed, ETA' on stderr: one updating line on a terminal,
    plain lines otherwise (CI logs)."""

    def __init__(self, section: str, total: int, expected_s: float | None = None):
        self.section, self.total, self.expected = section, total, expected_s
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, i: int, label: str = "") -> None:
        el = time.perf_counter() - self.t0
        if i > 0:
            eta = f"ETA {el / i * (self.total - i):.0f}s"
        else:
            eta = f"ETA ~{self.expected:.0f}s" if self.expected else "ETA ?"
        text = f"[bench] {self.section} {i}/{self.total} {label} | {el:.0f}s elapsed, {eta}"
        print(("\r" + text + "\033[K") if self.tty else text, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def probe_machine(cfg, task, batch: int = 8):
    """Times the config's model (random weights): a forward over batch x 64 tokens in each
    precision, and the cached decode steps between 2 and 6 new tokens at batch and 4 x batch
    rows."""
    from mini_grpo.run import setup

    t_start = time.perf_counter()
    with setup(cfg, log=False, task=task) as run:
        setup_s = time.perf_counter() - t_start
        model, prec = run.model.eval(), run.precision
        prompt_len = max(len(ex.prompt) for ex in run.task.eval) + 1
        T = min(64, cfg.block_size)
        x = torch.randint(4, model.cfg.vocab_size, (batch, T), device=run.device)
        sync = torch.cuda.synchronize if run.device.type == "cuda" else lambda: None

        def timed(fn, reps=2):
            fn()  # warm-up
            best = float("inf")
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t0)
            return best

        def fwd(generation):
            with torch.no_grad(), prec.autocast(generation=generation):
                model(x, logits_from=T - 1)

        def decode_step(rows):  # seconds of one decode step: 6 new tokens less 2, over 4
            prompts = x[:, :8].tolist() * (rows // batch)

            def gen(n):
                with prec.autocast(generation=True):
                    generate(model, prompts, n, eos_id=-1, pad_id=0, greedy=True)
            return max(timed(lambda: gen(6)) - timed(lambda: gen(2)), 1e-7) / 4

        fwd_train = timed(lambda: fwd(False)) / (batch * T)
        fwd_gen = timed(lambda: fwd(True)) / (batch * T)
        small, large = decode_step(batch), decode_step(4 * batch)
        per_row = max((large - small) / (3 * batch), 0.0)
        shape = Shape(prompt_len, cfg.max_new_tokens, cfg.group_size, cfg.num_iterations,
                      cfg.beta != 0)
        pinned = pin_precision(cfg, prec)
    return Probe(fwd_train, fwd_gen, max(small - per_row * batch, 0.0), per_row, setup_s,
                 cfg.num_reward_workers, time.perf_counter() - t_start), shape, pinned


def pin_precision(cfg, prec):
    """cfg with the dtypes its `auto` resolved to written out, so the sections' own set-ups
    use them without probing again."""
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    amp_dtype = name.get(prec.dtype) or name.get(prec.generation_dtype) or cfg.amp_dtype
    return overridden(cfg, use_amp=prec.dtype is not None, amp_dtype=amp_dtype,
                      generation_amp="on" if prec.generation_dtype is not None else "off")


def step_in_own_process(script: str, config: str, args: list[str], warmup: int,
                        steps: int) -> dict:
    """benchmark.py's (`script`) step section of `config` with `args` in a process of its own
    (its peak RSS its own, its memory given back after), unplanned: `warmup` + `steps`."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, script, "--config", config, "--only", "step",
                        "--budget_s", "0", "--warmup", str(warmup), "--steps", str(steps),
                        *args, "--json", f"{tmp}/step.json"], check=True, env=os.environ.copy())
        with open(f"{tmp}/step.json") as f:
            return json.load(f)["step"]


def overridden(cfg, **changes):
    """A copy of cfg with `changes`: the caller's config is never mutated."""
    c = copy.deepcopy(cfg)
    for k, v in changes.items():
        setattr(c, k, v)
    return c
