"""The reward curve of a run as a picture: <out_dir>/reward.png, from its metrics.jsonl.

    python -m mini_grpo.plot runs/smollm2_numeric        # also written at the end of each run

GRPO's mean training reward per step (light) and its moving average (dark), and the held-out
evaluations' rewards (greedy and sampled) at the steps they ran, with their standard errors;
in a multi-turn run, the tool calls per rollout on a second axis.
SFT and RFT stages log under their own prefixes and are not drawn. matplotlib draws it; a run
without matplotlib says so once and goes on (TensorBoard has the same curves).

An existing reward.png is replaced only where mini-grpo wrote it: in a run's own directory
(outputs.RUN_MARKER), or a PNG carrying our mark (PNG's "Software" text, MARK); anything else
is refused naming it, before anything is drawn.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from .fields import ConfigError
from .outputs import RUN_MARKER, OutputWriteError, check_file, write_atomic

SMOOTH = 10  # steps in the moving average
MARK = "mini-grpo plot"  # the PNG "Software" text of every reward.png written here
_PNG = b"\x89PNG\r\n\x1a\n"


def read_metrics(path: Path, calls: dict | None = None) -> tuple[dict, dict]:
    """({step: train reward}, {"greedy"/"sampled": {step: (reward, se)}}) of metrics.jsonl;
    a resumed run's later rows replace earlier ones of the same step. `calls`, if given, is
    filled with {step: tool calls per rollout} (multi-turn runs)."""
    train, evals = {}, {"greedy": {}, "sampled": {}}
    calls = {} if calls is None else calls
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            step = row.get("step")
            if not isinstance(step, int):
                continue
            if isinstance(row.get("reward/mean"), float):
                train[step] = row["reward/mean"]
            if isinstance(row.get("tools/calls"), float):
                calls[step] = row["tools/calls"]
            for mode in evals:
                r, se = row.get(f"eval_{mode}/reward"), row.get(f"eval_{mode}/reward_se")
                if isinstance(r, float):
                    evals[mode][step] = (r, se if isinstance(se, float) else 0.0)
    return train, evals


def plot_rewards(out_dir: str | Path) -> Path | None:
    """Writes <out_dir>/reward.png; returns its path, or None without matplotlib or data."""
    out_dir = Path(out_dir)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[mini-grpo] no reward.png: matplotlib is not installed (pip install "
              "matplotlib); TensorBoard has the curves", flush=True)
        return None
    metrics = out_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    calls: dict = {}
    train, evals = read_metrics(metrics, calls)
    if not train and not any(evals.values()):
        return None
    path = check_file(out_dir / "reward.png", ours)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if train:
        steps = sorted(train)
        values = [train[s] for s in steps]
        windows = [values[max(0, i - SMOOTH + 1):i + 1] for i in range(len(values))]
        smooth = [sum(w) / len(w) for w in windows]
        ax.plot(steps, values, color="tab:blue", alpha=0.25, linewidth=1)
        ax.plot(steps, smooth, color="tab:blue", linewidth=2,
                label=f"training reward ({SMOOTH}-step mean)")
    for mode, color in (("greedy", "tab:red"), ("sampled", "tab:orange")):
        if evals[mode]:
            steps = sorted(evals[mode])
            ax.errorbar(steps, [evals[mode][s][0] for s in steps],
                        yerr=[evals[mode][s][1] for s in steps], color=color, marker="o",
                        capsize=3, label=f"held-out, {mode}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_title(out_dir.name)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if calls:  # multi-turn: tool calls per rollout, on an axis of their own
        right = ax.twinx()
        steps = sorted(calls)
        right.plot(steps, [calls[s] for s in steps], color="tab:green", linewidth=1.5,
                   label="tool calls per rollout")
        right.set_ylabel("tool calls per rollout")
        right.set_ylim(bottom=0)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="lower right")
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, format="png",
                                                   metadata={"Software": MARK}))
    finally:
        plt.close(fig)
    return path


def ours(path: Path) -> bool:
    """May `path` (an existing reward.png) be replaced: a plain file in a run's directory
    (a run claims the names it writes there), or a PNG this module wrote, whatever the
    directory. A symlink is the user's: replacing it would drop their link."""
    if path.is_symlink() or not path.is_file():
        return False
    return (path.parent / RUN_MARKER).is_file() or png_software(path) == MARK


def png_software(path: Path) -> str | None:
    """The "Software" text of a PNG file, read from the chunks before its image data (where
    matplotlib writes it); None for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)  # the header and text chunks: a few hundred bytes
    except OSError:
        return None
    if not head.startswith(_PNG):
        return None
    at = len(_PNG)
    while at + 8 <= len(head):
        size, kind = struct.unpack(">I4s", head[at:at + 8])
        data = head[at + 8:at + 8 + size]
        if kind in (b"IDAT", b"IEND") or len(data) < size:
            return None
        if kind == b"tEXt":
            key, _, text = data.partition(b"\0")
            if key == b"Software":
                return text.decode("latin-1")
        at += 12 + size  # length, type, data, CRC
    return None


def main(argv: list[str]) -> int:
    """`python -m mini_grpo.plot RUN_DIR`: a refusal (a reward.png of someone else's) is one
    line and exit 2, a failed write one line and exit 1, as every command's (cli._fail)."""
    if len(argv) != 1:
        print("usage: python -m mini_grpo.plot RUN_DIR", file=sys.stderr)
        return 2
    try:
        written = plot_rewards(argv[0])
    except (ConfigError, OutputWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    print(f"wrote {written}" if written else "nothing to plot")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
