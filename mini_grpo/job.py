"""What a training run does around the GRPO loop: SFT -> GRPO -> evaluation, or RFT.

    python distributed_train.py --config default               # sft_grpo (the main job)
    python distributed_train.py --config default --mode=rft    # SFT -> RFT data -> SFT -> eval
    python distributed_train.py --config smollm2_numeric       # eval, SFT, eval, GRPO, eval

`train(cfg)` builds the run once (run.setup), decides where to resume from (comparing the
checkpoint's config with this one: what cannot work is refused, what changed is logged), runs
the stages of cfg.mode, evaluates before and after (rank 0 writes eval.json) and tears down.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import fsdp
from .checkpoint import (
    CheckpointError,
    check_base,
    clean_stale_temps,
    latest_checkpoint,
    load_checkpoint,
)
from .config import ConfigError, GRPOConfig, from_environment, load_config
from .evaluate import evaluate, format_table, trivial_baselines
from .lora import is_lora, merged_state_dict, save_adapter
from .models.hf import export_dtype, save_hf
from .options import keys_with
from .outputs import write_file
from .plot import plot_rewards
from .rft import first_prompts, generate_rft_data
from .run import Run, setup, start_afresh
from .sft import finished_stage, load_stage, sft_dir, stage_inputs, train_sft
from .state import check_train_state
from .tasks import load_jsonl
from .trainer import TimeLimit, train_grpo

STAGES = {"sft_grpo": ("sft", "grpo"), "sft": ("sft",), "grpo": ("grpo",), "rft": ("sft", "rft"),
          "rft_grpo": ("rft", "grpo")}

# a GRPO checkpoint cannot continue under another model, task or data (a LoRA one holds
# adapters alone: nor on another base)
RESUME_FIXED = keys_with(GRPOConfig, "resume")
RESUME_FIXED_LORA = keys_with(GRPOConfig, "resume_lora")


def train(cfg) -> dict:
    """The whole job; returns {"before", "after", "baselines"} evaluations (rank 0)."""
    stages = STAGES[cfg.mode]
    started = time.monotonic()  # max_minutes counts from here: loading the model included
    with setup(cfg) as run:
        resume, changed, where = find_resume(run) if "grpo" in stages else (None, [], None)
        if cfg.resume == "never" and run.dist.is_main:  # now that the run can go on
            start_afresh(Path(cfg.out_dir), run.logger.tb_file if run.logger else None)
        if run.logger:  # a killed run's rows past where this one continues are logged again
            run.logger.cut(logged_until(run, stages, resume, where))
            if changed:
                run.logger.event(resume["step"], "resumed with changed options: "
                                 + ", ".join(changed))
        applied = from_environment(cfg)
        if applied:
            run.print0("[mini-grpo] from the environment: " + ", ".join(applied))
        if cfg.max_minutes and "grpo" not in stages:
            run.print0(f"[mini-grpo] max_minutes {cfg.max_minutes:g}: only GRPO stops at the "
                       f"limit, and mode {cfg.mode} has no GRPO stage: its stages run to "
                       f"their end")
        if run.dist.is_main:
            cfg.save(Path(cfg.out_dir) / "config.yaml")
        amp = True  # autocast trusted; a stage whose guard cuts it hands fp32 on (state.py)
        result = {}
        if stages[0] == "sft" and cfg.init_from and "rft" not in stages:
            result = first_eval(run, resume, amp)  # the model SFT starts from: the table's base
        if resume is not None:  # GRPO goes on from its checkpoint: the stages before it
            amp = resumed_reference(run, resume, stages, amp)  # are not trained again
        elif "sft" in stages:
            amp = train_sft(run, amp=amp)
        if "rft" in stages:  # what SFT (or init_from) left: the evaluation's and RFT's
            result = first_eval(run, resume, amp)
            if resume is None:
                amp = run_rft(run, amp)
        last = None  # GRPO's last step, where max_minutes ends it before max_steps
        if "grpo" in stages:
            run.freeze_reference()  # the policy GRPO starts from, before resumed weights
            eval_s = None
            if resume is not None:  # its evaluations are in eval.json: nothing to sample
                result = {**result, **saved_evals(run)} if run.dist.is_main else {}
                run.print0(f"[mini-grpo] resuming GRPO from step {resume['step']}")
            else:
                with run.rank0_with_weights() as main:
                    if main:
                        t0 = time.monotonic()
                        result = before_grpo(run, amp, result)
                        eval_s = time.monotonic() - t0
            limit = time_limit(run, started, eval_s) if run.dist.is_main else None
            state = train_grpo(run, resume, amp, limit, source=str(where))
            amp, last = state.guard.amp, state.current_step
            # its optimizer (AdamW's moments: twice the weights) is of no more use: freed,
            # the final evaluation's caches take its place, not pages beside it
            del state
        weights = fsdp.model_state(run.model)  # for the export (a collective under fsdp)
        with run.rank0_with_weights() as main:  # the final evaluation: the final weights
            if main:
                finish(run, result, stages, weights, amp, last)
    return result


def time_limit(run: Run, started: float, eval_s: float | None) -> TimeLimit | None:
    """Rank 0's TimeLimit for cfg.max_minutes (None: no limit). The final evaluation is
    reserved at twice the one before GRPO: trained answers ran longer than the base model's
    (the LM job's final evaluation took 1.7x its first). A resumed run timed no evaluation here, so
    its limit covers the steps alone, and says so."""
    minutes = run.cfg.max_minutes
    if not minutes:
        return None
    if eval_s is None:
        run.print0(f"[mini-grpo] max_minutes {minutes:g}: no evaluation was timed in this "
                   f"process (a resumed run), so the final one comes after the limit")
    return TimeLimit(end=started + 60.0 * minutes, reserve=2.0 * (eval_s or 0.0))


def finish(run: Run, result: dict, stages: tuple, weights: dict, amp: bool,
           grpo_last: int | None = None) -> None:
    """Rank 0, after the last stage: the "after" evaluations (logged at the last step:
    GRPO's, which max_minutes may have ended early), eval.json, the table, export."""
    cfg = run.cfg
    last = {"grpo": grpo_last or cfg.max_steps, "rft": cfg.rft_sft_steps}.get(
        stages[-1], cfg.sft_steps)
    result["after"] = eval_both(run, last, amp)
    result["baselines"] = trivial_baselines(run.task, run.scorer)
    write_file(Path(cfg.out_dir) / "eval.json", json.dumps(result, indent=2))
    table = {f"{k} {mode}": v[mode] for k, v in result.items() if k != "baselines"
             for mode in ("greedy", "sampled")}
    print("\n" + format_table(table), flush=True)
    print("trivial answers under the same reward: " + ", ".join(
        f"{k} {v:.4f}" for k, v in result["baselines"].items()), flush=True)
    if "grpo" in stages and run.logger is not None:  # metrics.jsonl is flushed per row
        png = plot_rewards(cfg.out_dir)
        if png is not None:
            print(f"[mini-grpo] reward curve: {png}", flush=True)
    export(run, weights)


def export(run: Run, weights: dict) -> None:
    """The trained policy (its full `weights`) as a Hugging Face directory, <out_dir>/hf;
    with LoRA the adapters folded in, and beside it <out_dir>/adapter in PEFT's format."""
    dtype = export_dtype(run.model, run.cfg.export_dtype)
    out = Path(run.cfg.out_dir)
    path = save_hf(run.model, out / "hf", dtype, tokenizer=run.tok,
                   state=merged_state_dict(run.model, weights))
    print(f"[mini-grpo] exported {path} ({str(dtype).removeprefix('torch.')}): "
          f"transformers' AutoModelForCausalLM.from_pretrained loads it", flush=True)
    if is_lora(run.model):
        path = save_adapter(run.model, out / "adapter", run.cfg.init_from, state=weights)
        print(f"[mini-grpo] exported {path}: the LoRA adapter alone, in PEFT's format",
              flush=True)


def rft_dir(cfg) -> Path:
    return Path(cfg.out_dir) / "rft"


def logged_until(run: Run, stages: tuple, resume: dict | None,
                 where: Path | None = None) -> int | None:
    """How much of metrics.jsonl this job continues from: what the GRPO checkpoint it
    resumes (from `where`), or else the last finished stage it reuses, had logged when
    saved; 0 when every stage starts afresh (None: as it is: a checkpoint from before it was
    recorded, or one of another run directory, whose log is not this one)."""
    cfg = run.cfg
    if resume is not None:
        ours = where is not None and where.resolve().parent == \
            (Path(cfg.out_dir) / "checkpoints").resolve()
        return resume.get("logged") if ours else None
    reused = []
    if "sft" in stages:
        reused.append(finished_stage(cfg, sft_dir(cfg), cfg.sft_steps, "sft",
                                     inputs=stage_inputs(run, run.task.train)))
    data = rft_dir(cfg) / "data.jsonl"
    if "rft" in stages and data.is_file():
        try:
            rows = load_jsonl(data)
        except (ConfigError, OSError):  # made again by the stage (replace_stale)
            rows = None
        if rows is not None:
            reused.append(finished_stage(cfg, data.parent / "sft", cfg.rft_sft_steps, "rft",
                                         inputs=stage_inputs(run, rows, "rft")))
    reused = [found for found in reused if found is not None]
    return reused[-1][1].get("logged") if reused else 0


def resumed_reference(run: Run, resume: dict, stages: tuple, amp: bool) -> bool:
    """Where GRPO resumes after SFT or RFT, the model it started from is the KL reference
    (beta > 0): that stage's weights, as the checkpoint's run trained them, go into
    run.model (freeze_reference copies them; the checkpoint's weights come after). Neither
    stage is trained again: a stage of other options (an sft_lr changed on resume) had
    been, and GRPO went on against another reference. Returns the autocast verdict."""
    cfg = run.cfg
    tag = "rft" if "rft" in stages else "sft" if "sft" in stages else None
    if tag is None or not cfg.beta:
        return amp
    saved = load_config(None, env={}, base=resume["config"])  # checked by check_resume
    directory, steps = (rft_dir(cfg) / "sft", saved.rft_sft_steps) if tag == "rft" else \
        (sft_dir(cfg), saved.sft_steps)
    found = finished_stage(saved, directory, steps, tag)
    if found is None:
        raise ConfigError(f"resume: the {tag.upper()} stage this GRPO checkpoint started from "
                          f"({directory}, step {steps}) is gone or was trained again with "
                          f"other options, and with beta {cfg.beta:g} it is the KL reference; "
                          f"resume: never starts the run again")
    run.print0(f"[{tag}] the KL reference: the stage GRPO started from, {found[0]}")
    return amp and load_stage(run, found)


def find_resume(run: Run) -> tuple[dict | None, list[str], Path | None]:
    """The GRPO checkpoint to continue from (resume: auto | never | PATH), checked against
    this run's config, the options that changed since it (check_resume), and its path;
    stale temporary files of killed writes are removed first."""
    cfg = run.cfg
    ckpt_dir = Path(cfg.out_dir) / "checkpoints"
    if run.dist.is_main:
        clean_stale_temps(ckpt_dir)
    if cfg.resume == "never":
        return None, [], None
    if cfg.resume == "auto":
        path, state = latest_checkpoint(ckpt_dir)
        if state is None:
            return None, [], None
    else:
        path, state = Path(cfg.resume), load_checkpoint(cfg.resume)
    return state, check_resume(run, state, str(path)), path


def check_resume(run: Run, state: dict, path: str) -> list[str]:
    """Refuses a checkpoint this run cannot continue (exit 2 naming the keys); returns the
    options that changed and may ("lr 3e-05 -> 0.001", max_steps, ...)."""
    cfg, saved = run.cfg, state.get("config")
    if state.get("kind") != "grpo" or not ("optimizer" in state or state.get("sharded")) \
            or not isinstance(saved, dict):
        raise CheckpointError(f"{path}: a {state.get('kind', 'non-GRPO')} checkpoint cannot be "
                              f"resumed as GRPO; start from its weights with --init_from={path}")
    check_train_state(state, path)
    if state.get("tokenizer") != run.tok.state():
        raise CheckpointError(f"{path}: its tokenizer differs from this run's")
    try:  # resolved like a user's config: older checkpoints' keys migrate, bad ones fail
        saved = load_config(None, env={}, base=saved, base_where=f"{path}: ").to_dict()
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    now = cfg.to_dict()
    keys = RESUME_FIXED + (RESUME_FIXED_LORA if saved.get("lora_r") or saved.get("adapter")
                           else ())
    fixed = [k for k in keys if saved.get(k) != now.get(k)]
    if fixed:
        raise ConfigError(f"{path}: cannot resume with a different "
                          + ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in fixed)
                          + "; use another out_dir, or resume: never")
    if saved.get("lora_r") or saved.get("adapter"):
        check_base(state, run.lora.base if run.lora else None, cfg.init_from, path)
    if state["step"] > cfg.max_steps:
        raise ConfigError(f"max_steps: {cfg.max_steps} is below the step of the checkpoint "
                          f"to resume from ({state['step']}, {path})")
    return [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in now.items()
            if k not in ("resume", "out_dir") and saved.get(k) != v]


def first_eval(run: Run, resume: dict | None, amp: bool) -> dict:
    """The job's "before" evaluation, taken ahead of the stage that starts from init_from's
    model (SFT of a pretrained model, or RFT): a resumed GRPO run keeps eval.json's instead.
    Rank 0 evaluates; every rank returns (other ranks an empty dict)."""
    result = {}
    with run.rank0_with_weights() as main:
        if main:
            result = saved_evals(run) if resume is not None else {}
            if "before" not in result:
                result["before"] = eval_both(run, 0, amp)
                write_file(Path(run.cfg.out_dir) / "eval.json", json.dumps(result, indent=2))
    return result


def before_grpo(run: Run, amp: bool, result: dict) -> dict:
    """The evaluation a fresh GRPO stage starts from ("before"; named after the stage before
    GRPO, "sft" or "rft", when `result` holds an evaluation before that stage), written to
    eval.json at once. Rank 0."""
    stages = STAGES[run.cfg.mode]
    name = stages[stages.index("grpo") - 1] if "before" in result else "before"
    result = {**result, name: eval_both(run, 0, amp)}
    write_file(Path(run.cfg.out_dir) / "eval.json", json.dumps(result, indent=2))
    return result


def saved_evals(run: Run) -> dict:
    """The evaluations before GRPO that eval.json holds (a resumed run keeps them)."""
    out = Path(run.cfg.out_dir) / "eval.json"
    saved = json.loads(out.read_text()) if out.is_file() else {}
    return {k: v for k, v in saved.items() if k in ("before", "sft", "rft")}


def run_rft(run: Run, amp: bool) -> bool:
    """Rejection sampling from the current model, then SFT on the accepted completions;
    returns the SFT's autocast verdict."""
    cfg = run.cfg
    examples = first_prompts(run.task.train, cfg.rft_num_prompts)
    data = rft_dir(cfg) / "data.jsonl"
    run.sync_engine()  # the engine had these weights for the evaluation before: a no-op
    with fsdp.full_params(run.model):  # each rank samples alone
        # the run's own directory: data of other settings there is regenerated, not refused
        generate_rft_data(run, examples, data, amp, replace_stale=True)
    if data.stat().st_size == 0:  # nothing accepted: say which knob, not "the file is empty"
        raise ConfigError(f"rft_min_reward: no completion of "
                          f"{len({ex.prompt for ex in examples})} prompts reached "
                          f"{cfg.rft_min_reward}; lower it or train the SFT stage longer")
    accepted = load_jsonl(data)  # checked like any data file: a bad row names its line
    return train_sft(run, examples=accepted, steps=cfg.rft_sft_steps, lr=cfg.rft_lr,
                     directory=data.parent / "sft", tag="rft", amp=amp)


def eval_both(run: Run, step: int, amp: bool = True) -> dict:
    """Greedy and sampled held-out evaluations (under autocast if `amp` still trusts it),
    logged and printed."""
    out = {}
    for greedy in (True, False):
        name = "greedy" if greedy else "sampled"
        t0 = time.perf_counter()
        ev = evaluate(run, greedy=greedy, seed=run.cfg.seed, amp=amp)
        out[name] = ev
        if run.logger:
            run.logger.scalars(step, {k: v for k, v in ev.items() if k != "samples"},
                               f"eval_{name}/")
        extra = "".join(f" {k} {ev[k]:.3f}" for k in ev if "/" not in k and k not in (
            "reward", "reward_se", "length", "n", "samples"))
        print(f"[eval] step {step} {name}: reward {ev['reward']:.4f} ± {ev['reward_se']:.4f}"
              f"{extra} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return out
