"""Rejection-sampling fine-tuning (RFT) data: oversample completions, keep the ones that score.

    mini-grpo rft-generate --checkpoint runs/default/sft/step_0001200.pt --output rft.jsonl \
        [--rft_oversample=16] [--rft_prompts_per_batch=64] [--rft_min_reward=0.9] [--rft_keep=best]
    torchrun --standalone --nproc_per_node=2 -m mini_grpo rft-generate ...   # sharded
    python distributed_train.py --config default --mode=rft   # SFT -> generate -> SFT -> eval

For every distinct prompt of the split, `rft_oversample` completions are sampled in batched
passes of `rft_prompts_per_batch` prompts through the run's engine (`rollout_engine`: our
KV-cached sampler, or vLLM, with the weights of its last sync), scored with the run's
rewards, and the best one is kept when it reaches `rft_min_reward` (`rft_keep: all` keeps
every distinct one that does) and ended by itself: a completion cut off at `max_new_tokens`
is never kept (SFT would teach the model to stop mid-sentence). Rows are `{prompt, target,
completion, reward, rewards: {plugin: value}}`: the JSONL task loader reads them (completion,
reward and rewards become metadata) and SFT trains on `completion`. With tools or an
environment a rollout is a conversation: its reward is the one GRPO would give it (the
environment's reward parts included, as the `env` column), its row also holds
`conversation` (the messages after the prompt: the model's turns and what answered them;
`completion` is its last turn), and SFT trains on that, the answers' tokens masked.

Each rank appends whole lines to its own shard (`<output>.rank<R>`, flushed per batch) and
lists the prompts it has finished in `<output>.rank<R>.done`, so a re-run skips them; rank 0
then merges everything into `<output>` in prompt order (written to a temporary file and renamed)
and saves `<output>.summary.json`.

Those files are this command's alone: beside them `<output>.rft.json` says so and holds the
settings the rows were generated with. A re-run resumes only where that file is there and its
settings match; an output without it (a user's notes, their data) or with other settings is
refused with one line naming it, and nothing is read, cut or written. While a command writes
them it holds `<output>.rft.lock` (flock, rank 0): a second one on the same output is refused
in one line naming the first's pid, instead of appending to the same shards.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import distributed as D
from .data import shard
from .engines import Sampling
from .fields import ConfigError
from .jsonio import read_json_object
from .outputs import LineFile, check_parent, open_in_place, write_file
from .precision import release_freed_memory
from .scoring import score
from .sft import stage_changes

if TYPE_CHECKING:
    from .run import Run

WRITTEN_BY = "mini-grpo rft-generate"
_PART = re.compile(r"\.rank\d+(\.done)?")


def first_prompts(examples: list, n: int) -> list:
    """The examples of the first `n` distinct prompts (in split order); all when n is 0."""
    prompts = list(dict.fromkeys(ex.prompt for ex in examples))
    keep = set(prompts[:n] if n else prompts)
    return [ex for ex in examples if ex.prompt in keep]


def _read_rows(path: Path) -> list[dict]:
    """Whole rows of a JSONL file; a last line cut short by a kill is skipped (LineFile cuts it
    off before anything is appended after it)."""
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        return [json.loads(raw) for raw in f if raw.endswith(b"\n")]


def _prompt(row: dict) -> str:
    """A written row's prompt text (a chat row's: its last message)."""
    return row["prompt"] if "prompt" in row else row["messages"][-1]["content"]


def _read_done(path: Path) -> set[str]:
    return {r["prompt"] for r in _read_rows(path)}


def sidecar(output: Path) -> Path:
    return output.with_name(output.name + ".rft.json")


def written_files(output: Path) -> list[Path]:
    """Every file generate_rft_data writes for `output` that is there, the sidecar last."""
    parts = sorted(p for p in output.parent.glob(glob.escape(output.name) + ".rank*")
                   if _PART.fullmatch(p.name[len(output.name):]))
    files = [output, Path(f"{output}.summary.json"), *parts, sidecar(output)]
    return [p for p in files if p.is_file() or p.is_symlink()]


def stale_reason(output: Path, cfg, source: dict) -> str | None:
    """Why the files at `output` may not be resumed by this run (None: nothing there, or
    ours with these settings): not written here, or written with other settings."""
    files = written_files(output)
    if not files:
        return None
    try:  # bounded like any JSON file (jsonio): a sidecar is untrusted too
        stamp = read_json_object(sidecar(output))
    except ConfigError:
        stamp = None
    if not (isinstance(stamp, dict) and stamp.get("written_by") == WRITTEN_BY
            and isinstance(stamp.get("config"), dict)):
        return f"{files[0]} exists and was not written by rft-generate " \
               f"(no {sidecar(output).name} of its own beside it)"
    changed = stage_changes(stamp["config"], cfg, "rft_data") + [
        k for k in sorted(set(source) | set(stamp.get("source", {})))
        if source.get(k) != stamp.get("source", {}).get(k)]
    return f"{output} was generated with other {', '.join(changed)}" if changed else None


def claim(run: Run, output: Path, source: dict, replace_stale: bool) -> int | None:
    """Makes `output` this run's to write, on every rank: locked (rank 0, `lock`), then
    resumed where it holds our rows of these settings; else refused (ConfigError, nothing
    touched), or with `replace_stale` (a run's own directory) our files there removed. Then
    the sidecar, by rank 0. Returns the lock (rank 0's; None elsewhere): `unlock` it."""
    if output.exists() and not output.is_file():
        raise ConfigError(f"--output {output}: is a directory, not a file for rows")
    check_parent(output)
    held, refused = None, None
    if run.dist.is_main:
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            held = lock(output)
        except ConfigError as e:
            refused = str(e)
    refused = D.all_gather_object(refused)[0]  # every rank stops where rank 0 was refused
    if refused:
        raise ConfigError(refused)
    try:
        reason = stale_reason(output, run.cfg, source)  # every rank sees the same files
        D.barrier()
        if reason and not replace_stale:
            raise ConfigError(f"--output {output}: {reason}; not overwritten or resumed "
                              f"(choose another file, or the same settings)")
        if run.dist.is_main:
            if reason:
                run.print0(f"[rft] not resuming: {reason}")
                for f in written_files(output):
                    f.unlink()
            write_file(sidecar(output), json.dumps({"written_by": WRITTEN_BY,
                                                    "source": source,
                                                    "config": run.cfg.to_dict()}))
        D.barrier()
    except BaseException:
        unlock(output, held)
        raise
    return held


def lock_file(output: Path) -> Path:
    return output.with_name(output.name + ".rft.lock")


def lock(output: Path) -> int | None:
    """`<output>.rft.lock`, made if missing, locked (flock) and naming this process, as
    outputs.claim_run_dir locks a run's directory: a second rft-generate on `output` is
    refused in one line naming the holder while it lives (the kernel drops the lock when it
    dies, however). A file of that name that no rft-generate wrote is refused as a user's.
    Returns its descriptor (None where there is no flock)."""
    try:
        import fcntl  # POSIX; elsewhere an output is not locked
    except ImportError:
        return None
    path = lock_file(output)
    for _ in range(10):  # the holder removes the file as it ends: then lock the new one
        try:
            fd = open_in_place(path)  # no link: its holder line is written in place
        except OSError as e:
            raise ConfigError(f"--output {output}: cannot write {path} ({e.strerror or e})") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EWOULDBLOCK: another live process holds it
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"--output {output}: another rft-generate is writing it "
                              f"({holder}); wait for it to end, or choose another file") \
                from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)
    else:
        raise ConfigError(f"--output {output}: {path} keeps changing; not written")
    text = os.read(fd, 200)
    if text and not text.startswith(WRITTEN_BY.encode()):
        os.close(fd)
        raise ConfigError(f"--output {output}: {path} exists and was not written by "
                          f"rft-generate; not overwritten (choose another file)")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{WRITTEN_BY}, pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def unlock(output: Path, fd: int | None) -> None:
    """Lets `lock`'s file go, removed first: a process that opened it meanwhile then finds
    it gone, and makes and locks a new one (lock), never a second lock on this one."""
    if fd is not None:
        lock_file(output).unlink(missing_ok=True)
        os.close(fd)


def _record(ex, r, res, k: int) -> dict:
    """Row `k` of rollout `r` (scored `res`), a completion of example `ex`, as written; a
    multi-turn row with its whole conversation."""
    ask = {"messages": ex.messages} if ex.messages else {"prompt": ex.prompt}
    row = {**ask, "target": ex.target, "completion": r.texts[k],
           "reward": float(res.total[k]),
           "rewards": {n: float(c[k]) for n, c in res.columns.items()}}
    if r.conversations is not None:
        row["conversation"] = r.conversations[k]
    return row


@torch.no_grad()
def generate_rft_data(run: Run, examples, output: str | Path, amp: bool = True,
                      source: dict | None = None, replace_stale: bool = False) -> dict:
    """Writes the accepted completions of `examples` to `output`; returns the summary.
    `amp`: sampling autocast still trusted (the verdict of the stage before). `source`: what
    else the rows depend on (the checkpoint, the split), compared on resume like the config.
    `replace_stale`: `output` is in the run's own directory, and files there that may not be
    resumed are removed instead of refused (claim)."""
    cfg, device = run.cfg, run.device
    # each rank generates its own prompts, as many batches as it has: an engine that needs
    # its group in every generate (tensor-parallel vLLM) hands over to our native sampler
    engine, sampling = run.sampler(alone=True), Sampling.of(cfg)
    release_freed_memory(device)  # a training stage's blocks, not this sampling's
    output = Path(output)
    held = claim(run, output, source or {}, replace_stale)
    try:  # held to the end: the merge and the shards' removal are this command's too
        return _generate(run, examples, output, amp, engine, sampling)
    finally:
        unlock(output, held)


def _generate(run: Run, examples, output: Path, amp: bool, engine, sampling) -> dict:
    """generate_rft_data's work, `output` claimed."""
    scorer, cfg, device, dist = run.scorer, run.cfg, run.device, run.dist
    prompts = list(dict.fromkeys(ex.prompt for ex in examples))  # distinct, in split order
    first = {}
    for ex in examples:
        first.setdefault(ex.prompt, ex)
    order = {p: i for i, p in enumerate(prompts)}
    mine = shard(prompts, dist.rank, dist.world_size)
    shard_path = Path(f"{output}.rank{dist.rank}")
    done_path = Path(f"{shard_path}.done")
    done = _read_done(done_path) | {_prompt(r) for r in _read_rows(shard_path)} \
        | {_prompt(r) for r in _read_rows(output)}
    todo = [p for p in mine if p not in done]
    K, B = cfg.rft_oversample, cfg.rft_prompts_per_batch
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 7 + dist.rank)
    done_now = {"prompts": 0, "completions": 0}  # this rank's, generated by this call
    t0 = time.perf_counter()
    if dist.is_main:
        print(f"[rft] {len(prompts)} prompts x {K} completions, {B} prompts per batch on the "
              f"{engine.name} engine; "
              f"{len(mine) - len(todo)} of this rank's {len(mine)} already done", flush=True)
    with LineFile(shard_path) as out, LineFile(done_path) as done_f:
        for i in range(0, len(todo), B):
            batch = todo[i:i + B]
            rows = [p for p in batch for _ in range(K)]
            r = engine.generate([first[p].model_input for p in rows], sampling, gen,
                                run.precision.autocast(generation=True, enabled=amp))
            exs = [first[p] for p in rows]
            res = score(scorer, exs, r.texts, r.lengths(), sampling.max_new_tokens,
                        r.conversations, r.env_rewards)
            lines = [json.dumps(_record(first[p], r, res, k)) + "\n"
                     for j, p in enumerate(batch) for k in _accepted(cfg, r, res, j * K, K)]
            out.append("".join(lines))  # whole lines, then the prompts they finish
            done_f.append("".join(json.dumps({"prompt": p}) + "\n" for p in batch))
            done_now["prompts"] += len(batch)
            done_now["completions"] += len(rows)
            if dist.is_main:
                dt = time.perf_counter() - t0
                rate = done_now["completions"] / dt
                eta = (len(todo) - i - len(batch)) * K / rate
                print(f"[rft] prompts {done_now['prompts']}/{len(todo)} (this rank), "
                      f"{rate:.0f} completions/s, ETA {eta / 60:.1f}m", flush=True)
    dt = time.perf_counter() - t0
    total = D.reduce_named(done_now)  # over ranks
    D.barrier()
    summary = _merge(output, prompts, order, total, dt, cfg, dist, engine.name) \
        if dist.is_main else {}
    D.wait_for_main()  # rank 0's merge, alone
    return summary


def _accepted(cfg, r, res, start: int, K: int) -> list[int]:
    """The rows kept of one prompt's K completions (rows start .. start + K - 1): whole
    answers (ended by EOS) at or above rft_min_reward, each distinct text (conversation)
    once, best first; with rft_keep best, the best alone."""
    cand = {}  # distinct completions (conversations) of this prompt -> row index
    for k in range(start, start + K):
        if res.total[k] >= cfg.rft_min_reward and r.finished[k]:
            cand.setdefault(r.texts[k] if r.conversations is None
                            else json.dumps(r.conversations[k]), k)
    picked = sorted(cand.values(), key=lambda k: -res.total[k])
    return picked[:1] if cfg.rft_keep == "best" else picked


def _merge(output: Path, prompts: list, order: dict, total: dict, dt: float, cfg, dist,
           engine: str) -> dict:
    """Rank 0: every rank's rows (and an earlier call's) into `output` in split order, the
    ranks' files removed, and the summary (written beside it) -> the summary."""
    K, B = cfg.rft_oversample, cfg.rft_prompts_per_batch
    merged: dict[str, list[dict]] = {}
    for path in [output, *(Path(f"{output}.rank{k}") for k in range(dist.world_size))]:
        for r in _read_rows(path):
            merged.setdefault(_prompt(r), []).append(r)
    rows = [r for p in sorted(merged, key=lambda p: order.get(p, len(order)))
            for r in merged[p]]
    write_file(output, "".join(json.dumps(r) + "\n" for r in rows))
    for rank in range(dist.world_size):
        Path(f"{output}.rank{rank}").unlink(missing_ok=True)
        Path(f"{output}.rank{rank}.done").unlink(missing_ok=True)
    covered = len({_prompt(r) for r in rows})
    summary = {
        "prompts": len(prompts), "prompts_generated_now": int(total["prompts"]),
        "completions_generated_now": int(total["completions"]), "rows": len(rows),
        "prompts_with_accepted_row": covered, "acceptance_rate": covered / len(prompts),
        "mean_kept_reward": sum(r["reward"] for r in rows) / max(1, len(rows)),
        "seconds": dt, "completions_per_s": total["completions"] / dt if dt > 0 else 0.0,
        "oversample": K, "prompts_per_batch": B, "min_reward": cfg.rft_min_reward,
        "keep": cfg.rft_keep, "world_size": dist.world_size, "engine": engine}
    write_file(Path(f"{output}.summary.json"), json.dumps(summary, indent=2))
    print(f"[rft] {covered}/{len(prompts)} prompts with an accepted completion "
          f"({100 * summary['acceptance_rate']:.1f}%), mean kept reward "
          f"{summary['mean_kept_reward']:.3f}, {summary['completions_per_s']:.0f} "
          f"completions/s, {dt:.1f}s -> {output}", flush=True)
    return summary
