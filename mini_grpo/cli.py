"""Command-line entry points (`mini-grpo ...` once installed, or `python -m mini_grpo ...`).

    mini-grpo train --config default [--key=value ...]     # = python distributed_train.py ...
    mini-grpo train --config tiny --print-config           # show the resolved config, exit
    mini-grpo evaluate --checkpoint runs/default/checkpoints/step_0000200.pt [--num_eval=1024]
    mini-grpo sample --checkpoint PATH --prompt "e2e4 e7e5 g1f3:" [--n 4] [--greedy] [--json]
                     [--generation_amp=off ...]                         # any config field
    mini-grpo rft-generate --checkpoint PATH --output rft.jsonl [--rft_oversample=16 ...]
    mini-grpo export --checkpoint PATH --output DIR [--dtype bfloat16]   # Hugging Face dir
    mini-grpo export --checkpoint PATH --output DIR --adapter   # a LoRA run's adapter alone
    mini-grpo export --checkpoint PATH --output X.gguf [--gguf_type f16|bf16|q8_0|f32]
    mini-grpo import-gguf MODEL.gguf DIR [--dtype float32]   # a GGUF file as a HF directory
    mini-grpo vllm-serve --model DIR|X.gguf [--port 8000]  # rollouts for vllm_mode: server

A checkpoint is one of ours (a .pt file), a local Hugging Face model directory or a GGUF file.

Bad input (config, data, plugin, checkpoint) is one line on stderr and exit code 2; config
errors are caught before the trainer (and torch's start-up cost) is even imported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
from typing import NoReturn

import yaml

from .config import ConfigError, load_config, parse_cli
from .fields import ArgParser


def _fail(e: Exception, code: int = 2) -> int:
    """One line on stderr: the message's first line (a plugin's traceback stays out of it;
    its last line is in the first already)."""
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    return code


def leave(code: int) -> NoReturn:
    """Exits with `code`. A rank under torchrun, its work done and written (the process group
    torn down), leaves without interpreter finalization: destroying what still refers to the
    process group there aborted finished ranks ("terminate called without an active
    exception", SIGABRT, no Python frame; distributed_train.py once, `python -m mini_grpo
    rft-generate` once), failing the whole launch."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _guarded(fn) -> int:
    """Runs fn(); bad input (config, data, plugin, checkpoint) is one line and exit 2, a run
    that cannot go on (non-finite training, a checkpoint that cannot be written) one line
    and exit 1."""
    from .checkpoint import CheckpointError, CheckpointWriteError
    from .distributed import PeerLost
    from .engines import EngineError
    from .guards import GuardError, NonFiniteError
    from .outputs import OutputWriteError
    from .scoring import RewardError

    try:
        fn()
    except (ConfigError, CheckpointError, RewardError) as e:
        return _fail(e)
    except (GuardError, NonFiniteError, CheckpointWriteError, OutputWriteError,
            EngineError, PeerLost) as e:
        return _fail(e, code=1)
    return 0


def train_main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        from .config_help import help_text

        print(help_text(), end="")
        return 0
    print_config = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    try:
        config, overrides = parse_cli(argv)
        cfg = load_config(config, overrides)
    except ConfigError as e:
        return _fail(e)
    if print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    try:
        check_gpt_size(cfg)
    except ConfigError as e:
        return _fail(e)
    from .job import train

    return _guarded(lambda: train(cfg))


def user_path(value: str) -> str:
    """A command's path argument with a leading `~` or `~user` expanded, as the config's path
    fields are (options.expand_paths): no shell expands it in quotes or after `--output=`."""
    path = os.path.expanduser(value)
    if path.startswith("~"):
        raise argparse.ArgumentTypeError(f"{value!r}: no user {value[1:].split('/')[0]!r} whose "
                                         f"home ~ could name (./{value} for a folder of that "
                                         f"name)")
    return path


def check_gpt_size(cfg) -> None:
    """A run from scratch: our GPT's size from the config's fields against memory, before the
    task's data is built (most of the start-up of the default task: generating its games),
    with its alphabet counted as empty; build_policy checks again with the alphabet."""
    if cfg.init_from:
        return
    from .models import check_size
    from .policy import gpt_spec

    try:
        check_size(gpt_spec(cfg, 0), "n_layer/n_embd/block_size")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _from_checkpoint(path: str, rest: list[str]):
    """(state, config) of a checkpoint, its stored config checked like a user's, under
    `--config FILE` and `--key=value` from `rest`; raises ConfigError / CheckpointError."""
    from .policy import checkpoint_config

    config, overrides = parse_cli(rest)
    return checkpoint_config(path, overrides, config)


# how the commands that take a checkpoint build their config
OVER_CHECKPOINT = "its stored config, then --config FILE over it, then any field as --key=value"


def evaluate_main(argv: list[str]) -> int:
    ap = ArgParser(prog="mini-grpo evaluate", description="held-out evaluation of a checkpoint "
                   "(" + OVER_CHECKPOINT + ")")
    ap.add_argument("--checkpoint", required=True, type=user_path)
    ap.add_argument("--json", help="also write the results here", type=user_path)
    args, rest = ap.parse_known_args(argv)

    def run_eval():
        from .evaluate import evaluate, format_table
        from .outputs import check_file, write_json, written_by
        from .run import setup

        if args.json:  # before the evaluation's minutes: never over a file of the user's
            check_file(args.json, written_by(EVAL_JSON))
        state, cfg = _from_checkpoint(args.checkpoint, rest)
        with setup(cfg, checkpoint=state, log=False, train=False) as run:
            run.sync_engine()
            result = {mode: evaluate(run, greedy=mode == "greedy", seed=cfg.seed)
                      for mode in ("greedy", "sampled")}
            what = "Hugging Face model" if state is None else \
                f"{state.get('kind')} step {state.get('step')}"
            print(f"checkpoint {args.checkpoint} ({what}), {len(run.task.eval)} held-out "
                  f"prompts")
        print(format_table(result))
        if args.json:
            write_json(args.json, result, EVAL_JSON, indent=2)

    return _guarded(run_eval)


EVAL_JSON = "mini-grpo evaluate"  # in the files `evaluate --json` writes: it may replace them


def sample_main(argv: list[str]) -> int:
    ap = ArgParser(prog="mini-grpo sample",
                 description="sample completions from a checkpoint (" + OVER_CHECKPOINT + ")")
    ap.add_argument("--checkpoint", required=True, type=user_path)
    ap.add_argument("--prompt", required=True, action="append",
                    help="prompt text (repeatable), e.g. 'e2e4 e7e5:'")
    ap.add_argument("--n", type=int, default=1, help="completions per prompt")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--temperature", type=float, help="default: the checkpoint's config")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_new_tokens", type=int, help="default: the checkpoint's config")
    ap.add_argument("--json", action="store_true",
                    help='one {"prompt": ..., "completion": ...} object per line')
    args, rest = ap.parse_known_args(argv)
    try:
        check_sample_args(args)
    except ConfigError as e:
        return _fail(e)

    def run_sample():
        import torch

        from .engines import Sampling
        from .run import setup

        # a few prompts: on the CPU and not compiled, unless the user's --key=value says so
        # (they came after these and lost: --device=cuda sampled on the CPU, silently)
        defaults = ["--device=cpu", "--compile_model=false"]
        overrides = ["--rewards=null"]
        if not args.greedy and args.temperature is not None:  # --greedy takes any
            overrides.append(f"--temperature={args.temperature}")
        if args.max_new_tokens:
            overrides.append(f"--max_new_tokens={args.max_new_tokens}")
        state, cfg = _from_checkpoint(args.checkpoint, [*defaults, *rest, *overrides])
        with setup(cfg, checkpoint=state, log=False, task=False, train=False) as run:
            run.sync_engine()
            for p in args.prompt:
                if run.tok.unknown_chars(p):
                    raise ConfigError(f"--prompt {p!r}: characters not in the model's "
                                      f"alphabet: {run.tok.unknown_chars(p)}")
            sampling = Sampling.of(cfg, greedy=args.greedy)
            n = sampling.max_new_tokens
            if max(len(run.tok.encode_prompt(p)) for p in args.prompt) + n > \
                    run.model.cfg.block_size:
                raise ConfigError(f"--max_new_tokens: {n} more tokens do not fit the model's "
                                  f"{run.model.cfg.block_size} positions")
            prompts = [p for p in args.prompt for _ in range(args.n)]
            gen = torch.Generator().manual_seed(args.seed)
            for i in range(0, len(prompts), SAMPLE_BATCH):  # printed as they come
                batch = prompts[i:i + SAMPLE_BATCH]
                r = run.sampler().generate(batch, sampling, gen,
                                           run.precision.autocast(generation=True))
                talks = r.conversations or [None] * len(batch)  # multi-turn (tools)
                for p, text, talk in zip(batch, r.texts, talks):
                    if args.json:
                        line = json.dumps({"prompt": p, "completion": text,
                                           **({"messages": talk} if talk else {})},
                                          ensure_ascii=False)
                    else:
                        line = f"{p} {text}" if talk is None else "\n".join(
                            [p, *(f"  [{m['role']}] {m['content']}" for m in talk)])
                    print(line, flush=True)

    return _guarded(run_sample)


SAMPLE_BATCH = 64  # rows sampled together by `sample`: its memory does not grow with --n


def check_sample_args(args) -> None:
    """sample's own flags, checked as the config's fields are: ConfigError naming the flag."""
    import math

    from .task_registry import MAX_GENERATED

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens: must be >= 1, got {args.max_new_tokens}")
    if args.n < 1:
        raise ConfigError(f"--n: must be >= 1, got {args.n}")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed: must be in 0..2**63 - 1, got {args.seed}")
    if args.n * len(args.prompt) > MAX_GENERATED:
        raise ConfigError(f"--n: {args.n:,} completions of {len(args.prompt)} prompt(s) are "
                          f"more than {MAX_GENERATED:,} rows")
    if not args.greedy and args.temperature is not None and not (
            math.isfinite(args.temperature) and args.temperature > 0):
        raise ConfigError(f"--temperature: must be a finite number > 0 (or --greedy), got "
                          f"{args.temperature}")


def rft_generate_main(argv: list[str]) -> int:
    ap = ArgParser(prog="mini-grpo rft-generate",
                 description="rejection-sampling data from a checkpoint (" + OVER_CHECKPOINT
                             + ")")
    ap.add_argument("--checkpoint", required=True, type=user_path)
    ap.add_argument("--output", required=True, type=user_path,
                    help="JSONL file to write; an earlier output of this command with the same "
                         "settings is resumed, any other file is refused")
    ap.add_argument("--split", choices=["train", "eval"], default="train")
    args, rest = ap.parse_known_args(argv)

    def run_rft():
        from .rft import first_prompts, generate_rft_data
        from .run import setup

        state, cfg = _from_checkpoint(args.checkpoint, rest)
        with setup(cfg, checkpoint=state, log=False, train=False) as run:
            run.sync_engine()
            examples = first_prompts(run.task.train, cfg.rft_num_prompts) \
                if args.split == "train" else run.task.eval
            generate_rft_data(run, examples, args.output, source={
                "checkpoint": os.path.abspath(args.checkpoint), "split": args.split})

    return _guarded(run_rft)


def export_main(argv: list[str]) -> int:
    ap = ArgParser(prog="mini-grpo export",
                 description="a checkpoint as a Hugging Face model directory, or as one GGUF "
                             "file (--output X.gguf)")
    ap.add_argument("--checkpoint", required=True, type=user_path,
                    help="one of our checkpoints, a Hugging Face directory or a GGUF file")
    ap.add_argument("--output", required=True, type=user_path,
                    help="directory to write (new, empty, or an earlier export: never one "
                         "holding other files), or FILE.gguf (a GGUF file that llama.cpp, "
                         "ollama and LM Studio run)")
    ap.add_argument("--gguf_type", default="f16",
                    choices=["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"],
                    help="the weights' type in a GGUF file (1-D tensors stay f32)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                        "float16"],
                    help="auto: the dtype of the Hugging Face model the run started from, "
                         "else float32")
    ap.add_argument("--adapter", action="store_true",
                    help="a LoRA checkpoint's adapter alone, in PEFT's format "
                         "(adapter_config.json + adapter_model.safetensors)")
    args = ap.parse_args(argv)

    def run_export():
        from .lora import ADAPTER_FILES, is_lora, merged_state_dict, save_adapter
        from .models.hf import WRITTEN, export_dtype, save_hf
        from .outputs import check_replaceable
        from .policy import build_policy

        gguf = args.output.lower().endswith(".gguf") and not args.adapter
        if gguf:
            _check_gguf_output(args.output)
        else:  # before any work: a run directory or a user's files are never replaced
            check_replaceable(args.output, ADAPTER_FILES if args.adapter else WRITTEN)
        # what it writes holds no rewards, tools or environment: none of them is imported
        state, cfg = _from_checkpoint(args.checkpoint,
                                      ["--rewards=null", "--tools=[]", "--environment="])
        model, tok = build_policy(cfg, None, state)
        if gguf:
            path = _write_gguf(model, tok, args.output, args.gguf_type,
                               merged_state_dict(model))
        elif args.adapter:
            if not is_lora(model):
                raise ConfigError(f"--adapter: {args.checkpoint} is not a LoRA checkpoint "
                                  f"(it holds full weights: export it without --adapter)")
            path = save_adapter(model, args.output, cfg.init_from)
        else:
            path = save_hf(model, args.output, export_dtype(model, args.dtype), tokenizer=tok,
                           state=merged_state_dict(model))
        print(f"wrote {path}")

    return _guarded(run_export)


def _write_gguf(model, tok, output: str, gguf_type: str, state: dict):
    """write_gguf into `output`, refusing to replace a file that is not a GGUF export of
    ours; its ValueErrors (what GGUF cannot say) as ConfigError."""
    from .models.gguf import write_gguf

    out = _check_gguf_output(output)
    try:
        return write_gguf(model, tok, out, gguf_type, state=state)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_gguf_output(output: str):
    from pathlib import Path

    from .models.gguf import is_our_gguf
    from .outputs import check_parent

    out = Path(output)
    if out.exists() and not is_our_gguf(out):
        raise ConfigError(f"--output {output}: exists and is not a GGUF file mini-grpo wrote; "
                          f"not overwritten (remove it, or choose another name)")
    check_parent(out)  # missing directories are made, as for a directory export
    return out


def import_gguf_main(argv: list[str]) -> int:
    ap = ArgParser(
        prog="mini-grpo import-gguf",
        description="a GGUF file (llama.cpp's format: Llama, Qwen2/3, SmolLM2) as a Hugging "
                    "Face model directory: weights dequantized, tokenizer and chat template")
    ap.add_argument("gguf", help="the .gguf file", type=user_path)
    ap.add_argument("output", type=user_path,
                    help="directory to write: new, empty, or an earlier import")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the weights' dtype in the directory (float32 keeps the dequantized "
                         "values exactly)")
    args = ap.parse_args(argv)

    def run_import():
        import torch

        from .models.gguf import load_gguf
        from .models.hf import WRITTEN, save_hf
        from .outputs import check_replaceable

        check_replaceable(args.output, WRITTEN)
        print(f"reading {args.gguf}", flush=True)
        model, tok = load_gguf(args.gguf, dtype=torch.float32)
        path = save_hf(model, args.output, getattr(torch, args.dtype), tokenizer=tok)
        print(f"wrote {path} ({model.num_params() / 1e6:.1f}M parameters, {args.dtype})")

    return _guarded(run_import)


def vllm_serve_main(argv: list[str]) -> int:
    from .engines.server import serve

    code = [0]

    def run():
        code[0] = serve(argv)
    return _guarded(run) or code[0]


def _terminated(signum, frame) -> NoReturn:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM (kill, a scheduler, torchrun stopping a launch) ends the command as an
    exception does, so that what it started or was writing is cleaned up: the reward worker
    processes stopped rather than left orphaned, a temporary export (hundreds of MB) removed
    rather than left for good. Exit code 143, as the signal's default gives."""
    signal.signal(signal.SIGTERM, _terminated)


COMMANDS = {"train": train_main, "evaluate": evaluate_main, "sample": sample_main,
            "rft-generate": rft_generate_main, "export": export_main,
            "vllm-serve": vllm_serve_main, "import-gguf": import_gguf_main}


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--help"], ["-h"]):  # asked for: stdout, exit 0
        print(__doc__.split("\n\n")[1])
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        code = COMMANDS[argv[0]](argv[1:])
        sys.stdout.flush()
    except BrokenPipeError:  # `mini-grpo sample ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    # the command is done with what it built: the interpreter's exit need not search it all
    # for reference cycles again (0.2 s of the 0.35 s it spends exiting after torch)
    gc.freeze()
    return code
