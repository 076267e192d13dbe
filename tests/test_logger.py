"""The run logger: metrics.jsonl always, TensorBoard and Weights & Biases (offline) on request."""

import math
import time

import pytest
from conftest import metrics, tiny

from mini_grpo.config import ConfigError
from mini_grpo.job import train


def test_report_to_names_known_trackers_only():
    with pytest.raises(ConfigError, match="report_to: must list only tensorboard, wandb"):
        tiny(None, report_to="[tensorboard, mlflow]")


def test_wandb_offline_gets_the_same_metric_names(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(tiny(out, mode="sft_grpo", sft_steps=2, max_steps=2, report_to="[wandb]"))
    assert not (out / "tb").exists()  # only what was asked for
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    logged = {k for row in metrics(out) for k in row if k not in ("step", "event")}
    assert {"reward/mean", "loss", "kl", "sft/loss", "eval_greedy/reward"} <= logged
    # the offline run's records (protobuf) hold each metric's name as UTF-8 text; wandb's
    # service may still be writing them when finish() returns (a CI run once read the file
    # before most names were in it), so the file is read until it holds them all, or 60 s
    deadline, missing = time.monotonic() + 60, logged
    while missing and time.monotonic() < deadline:
        records = b"".join(wandb_records(f) for f in runs[0].glob("*.wandb"))
        missing = [k for k in logged if k.encode() not in records]
        time.sleep(0.5 if missing else 0)
    assert not missing, (sorted(missing)[:5], len(missing), len(logged))
    assert b"sft/step" in records and b"mlflow" not in records


def wandb_records(path) -> bytes:
    """The records of a .wandb file joined: LevelDB's log format (a 7-byte file header, then
    32 KiB blocks of chunks, each with a 7-byte header: crc, length, type), so that a record
    split across two blocks reads whole."""
    data, out, pos = path.read_bytes(), [], 7
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        n = int.from_bytes(data[pos + 4:pos + 6], "little")
        out.append(data[pos + 7:pos + 7 + n])
        pos += 7 + n
    return b"".join(out)


def test_a_full_disk_is_one_line_and_leaves_whole_lines(tmp_path, monkeypatch):
    """metrics.jsonl takes whole lines or none: a write that fails half-way (ENOSPC) is cut
    back and is an OutputWriteError of one line; a partial line a kill left is cut at open."""
    import errno
    import json

    from mini_grpo.logger import RunLogger
    from mini_grpo.outputs import OutputWriteError

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "rew')  # killed mid-line
    log = RunLogger(tmp_path, 10, report_to=())
    log.scalars(3, {"reward": 0.5})

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):  # the first half lands, then the disk is full
            if len(data) > 4:
                return self.f.write(data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.f.close()

    log.jsonl.f = Full(log.jsonl.f)
    with pytest.raises(OutputWriteError, match="metrics.jsonl: disk full"):
        log.scalars(4, {"reward": 0.25})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3]


def test_tensorboard_write_errors_are_one_line(tmp_path, monkeypatch):
    import errno

    pytest.importorskip("tensorboard")
    from mini_grpo.logger import RunLogger
    from mini_grpo.outputs import OutputWriteError

    log = RunLogger(tmp_path, 10, report_to=("tensorboard",))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log.tb, "add_summary", full)
    with pytest.raises(OutputWriteError, match="tb: disk full"):
        log.scalars(1, {"reward": 0.5})
    log.close()


def test_no_file_under_another_name_is_written_by_the_logger(tmp_path, monkeypatch):
    """A hard link (`cp -al` of a run, a user's `ln`) as metrics.jsonl is refused in one line
    naming it, its partial last line not cut; TensorBoard's event file gets a name no one
    could have put a link at beforehand (its "wb" emptied a file planted at the name made of
    the time, host, pid and count)."""
    import os
    import types

    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import event_file_writer as efw

    from mini_grpo.logger import RunLogger

    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes\nno line end")
    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    os.link(notes, run / "metrics.jsonl")
    with pytest.raises(ConfigError, match="metrics.jsonl: is a hard link") as e:
        RunLogger(run, 10, report_to=())
    assert "\n" not in str(e.value)
    (run / "metrics.jsonl").unlink()
    monkeypatch.setattr(efw, "time", types.SimpleNamespace(time=lambda: 1.7e9))
    monkeypatch.setattr(efw, "socket", types.SimpleNamespace(gethostname=lambda: "host"))
    name = f"events.out.tfevents.1700000000.host.{os.getpid()}.{efw._global_uid._value}"
    os.link(notes, run / "tb" / name)
    log = RunLogger(run, 10, report_to=("tensorboard",))
    log.scalars(1, {"reward": 0.5})
    log.close()
    assert notes.read_text() == "the user's notes\nno line end"
    assert log.tb_file.parent == run / "tb" and log.tb_file.name != name


def test_a_steps_scalars_are_one_tensorboard_event_with_every_value(tmp_path):
    """One event a logged step (an event a scalar made protobuf's runtime call malloc_trim
    every ~45 GRPO steps, undoing cpu_malloc_cache); TensorBoard reads each scalar at its
    step, prefixed, non-finite values included."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from mini_grpo.logger import RunLogger

    log = RunLogger(tmp_path, 10, report_to=("tensorboard",))
    log.scalars(1, {"reward": 0.5, "kl": 0.25})
    log.scalars(2, {"reward": 0.75, "kl": float("nan")})
    log.scalars(2, {"loss": 1.5}, prefix="sft/")
    log.event(3, "max_minutes: GRPO stops here")  # text, beside the console and the JSONL
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"),
                           size_guidance={"scalars": 0, "tensors": 0}).Reload()
    [text] = acc.Tensors("events/text_summary")
    assert text.step == 3 and text.tensor_proto.string_val == [b"max_minutes: GRPO stops here"]
    assert sorted(acc.Tags()["scalars"]) == ["kl", "reward", "sft/loss"]
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.5), (2, 0.75)]
    kl = acc.Scalars("kl")
    assert [e.step for e in kl] == [1, 2] and kl[0].value == 0.25 and math.isnan(kl[1].value)
    assert [(e.step, e.value) for e in acc.Scalars("sft/loss")] == [(2, 1.5)]
    [path] = (tmp_path / "tb").glob("events.out.tfevents.*")
    summaries = [e for e in EventFileLoader(str(path)).Load() if e.HasField("summary")]
    assert [len(e.summary.value) for e in summaries] == [2, 2, 1, 1]
