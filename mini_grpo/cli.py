"""Command-line entry points (`mini-grpo ...` once installed, or `python -m mini_grpo ...`).

    mini-grpo train --config default [--key=value ...]     # = python distributed_train.py ...
    mini-grpo train --config tiny --print-config           # show the resolved config, exit
    mini-grpo evaluate --checkpoint runs/default/checkpoints/step_0000200.pt [--num_eval=1024]
    mini-grpo sample --checkpoint PATH --prompt "e2e4 e7e5 g1f3:" [--n 4] [--greedy]
    mini-grpo rft-generate --checkpoint PATH --output rft.jsonl [--rft_oversample=16 ...]

Bad input (config, data, plugin, checkpoint) is one line on stderr and exit code 2; config
errors are caught before the trainer (and torch's start-up cost) is even imported.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from .config import ConfigError, GRPOConfig, load_config, parse_cli


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def train_main(argv: list[str]) -> int:
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
    from .checkpoint import CheckpointError
    from .guards import GuardError
    from .trainer import train

    try:
        train(cfg)
    except (ConfigError, CheckpointError) as e:
        return _fail(e)
    except GuardError as e:  # the fallback ladder ran out: a clear line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _checkpoint_config(path: str, overrides: list[str]):
    """The checkpoint's saved config with command-line overrides applied."""
    from .checkpoint import load_checkpoint

    state = load_checkpoint(path)
    base = GRPOConfig(**state["config"]).to_dict()
    base.update(parse_cli(overrides)[1])
    return state, load_config(None, base, env={})


def evaluate_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mini-grpo evaluate",
                                 description="held-out evaluation of a checkpoint")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--json", help="also write the results here")
    args, rest = ap.parse_known_args(argv)
    from .checkpoint import CheckpointError

    try:
        state, cfg = _checkpoint_config(args.checkpoint, rest)
        from .evaluate import evaluate, format_table
        from .precision import resolve_device, setup_backends
        from .scoring import RewardScorer
        from .tasks import build_task
        from .trainer import load_policy

        setup_backends(cfg)
        device = resolve_device(cfg)
        model, tok, _ = load_policy(args.checkpoint, device)
        task = build_task(cfg)
        with RewardScorer.from_config(cfg, task) as scorer:
            result = {mode: evaluate(model, tok, task.eval, scorer, cfg, device,
                                     greedy=mode == "greedy", seed=cfg.seed)
                      for mode in ("greedy", "sampled")}
    except (ConfigError, CheckpointError) as e:
        return _fail(e)
    print(f"checkpoint {args.checkpoint} ({state.get('kind')} step {state.get('step')}), "
          f"{len(task.eval)} held-out prompts")
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def sample_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mini-grpo sample",
                                 description="sample completions from a checkpoint")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompt", required=True, action="append",
                    help="prompt text (repeatable), e.g. 'e2e4 e7e5:'")
    ap.add_argument("--n", type=int, default=1, help="completions per prompt")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch

    from .checkpoint import CheckpointError
    from .rollout import sample
    from .trainer import load_policy

    try:
        model, tok, state = load_policy(args.checkpoint, "cpu")
    except CheckpointError as e:
        return _fail(e)
    for p in args.prompt:
        if tok.unknown_chars(p):
            return _fail(ConfigError(f"--prompt {p!r}: characters not in the model's "
                                     f"alphabet: {tok.unknown_chars(p)}"))
    max_new = state["config"]["max_new_tokens"]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    r = sample(model, tok, prompts, max_new, greedy=args.greedy,
               temperature=args.temperature,
               generator=torch.Generator().manual_seed(args.seed))
    for p, text in zip(prompts, r.texts):
        print(f"{p} {text}")
    return 0


def rft_generate_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mini-grpo rft-generate",
                                 description="rejection-sampling data from a checkpoint "
                                             "(any config field as --key=value)")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--output", required=True, help="JSONL file to write (resumed if present)")
    ap.add_argument("--split", choices=["train", "eval"], default="train")
    args, rest = ap.parse_known_args(argv)
    from .checkpoint import CheckpointError

    try:
        _, cfg = _checkpoint_config(args.checkpoint, rest)
        from . import distributed as D
        from .precision import resolve_device, setup_backends
        from .rft import generate_rft_data
        from .scoring import RewardScorer
        from .tasks import build_task
        from .trainer import load_policy

        dist = D.init(cfg.dist_timeout)
        setup_backends(cfg, dist.local_world_size)
        device = resolve_device(cfg, dist.local_rank)
        model, tok, _ = load_policy(args.checkpoint, device)
        task = build_task(cfg)
        examples = task.train if args.split == "train" else task.eval
        if args.split == "train" and cfg.rft_num_prompts:
            keep = set(list(dict.fromkeys(ex.prompt for ex in examples))[:cfg.rft_num_prompts])
            examples = [ex for ex in examples if ex.prompt in keep]
        with RewardScorer.from_config(cfg, task) as scorer:
            generate_rft_data(model, tok, examples, scorer, cfg, device, dist, args.output)
        D.cleanup()
    except (ConfigError, CheckpointError) as e:
        return _fail(e)
    return 0


COMMANDS = {"train": train_main, "evaluate": evaluate_main, "sample": sample_main,
            "rft-generate": rft_generate_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
