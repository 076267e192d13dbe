"""Command-line entry: resolve the config, then run the job.

    python distributed_train.py --config default [--key=value ...]
    python distributed_train.py --config tiny --print-config   # show the resolved config

Bad input (config, data, plugin, checkpoint) is one line on stderr and exit code 2; config
errors are caught before the trainer (and torch's start-up cost) is even imported.
"""

from __future__ import annotations

import sys

import yaml

from .config import ConfigError, load_config, parse_cli


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
    from .trainer import train

    try:
        train(cfg)
    except (ConfigError, CheckpointError) as e:
        return _fail(e)
    return 0
