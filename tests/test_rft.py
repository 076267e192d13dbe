"""Rejection-sampling data generation: coverage, threshold, resume, torchrun sharding."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ranks_env

from mini_grpo.config import load_config
from mini_grpo.job import train
from mini_grpo.policy import checkpoint_config
from mini_grpo.rft import generate_rft_data
from mini_grpo.run import setup
from mini_grpo.tasks import load_jsonl

ROOT = Path(__file__).resolve().parent.parent
OPTS = {"rft_num_prompts": "12", "rft_oversample": "4", "rft_prompts_per_batch": "5",
        "reward_executor": "serial", "num_eval": "8"}


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    train(load_config("tiny", {"out_dir": str(out), "mode": "sft", "sft_steps": "20",
                               "sft_lr": "3e-3", **OPTS}, env={}))
    return out / "sft" / "step_0000020.pt"


def rft_run(ckpt, **over):
    """The run `mini-grpo rft-generate --checkpoint ckpt` builds, and its first 12 prompts."""
    state, cfg = checkpoint_config(str(ckpt), {**OPTS, **over})
    run = setup(cfg, checkpoint=state, log=False)
    prompts = list(dict.fromkeys(ex.prompt for ex in run.task.train))[:12]
    examples = [ex for ex in run.task.train if ex.prompt in set(prompts)]
    return run, examples, prompts


def test_covers_every_prompt_keeps_only_rows_above_the_threshold(sft_checkpoint, tmp_path):
    run, examples, prompts = rft_run(sft_checkpoint, rft_min_reward="0.05", rft_keep="all")
    out = tmp_path / "rft.jsonl"
    with run:
        summary = generate_rft_data(run, examples, out)
        tok = run.tok
    assert summary["prompts"] == 12 and summary["prompts_generated_now"] == 12
    assert summary["completions_generated_now"] == 12 * 4
    rows = [json.loads(line) for line in out.open()]
    assert rows and all(r["reward"] >= 0.05 for r in rows)
    assert {r["prompt"] for r in rows} <= set(prompts)
    # rows in prompt order, each prompt's completions distinct
    idx = [prompts.index(r["prompt"]) for r in rows]
    assert idx == sorted(idx)
    pairs = [(r["prompt"], r["completion"]) for r in rows]
    assert len(pairs) == len(set(pairs))
    for r in rows:  # the row's reward is the weighted sum of its columns (0.5 / 0.5)
        assert r["reward"] == pytest.approx(sum(0.5 * v for v in r["rewards"].values()))
    loaded = load_jsonl(out, tok)
    assert len(loaded) == len(rows) and loaded[0].meta["completion"] == rows[0]["completion"]
    assert json.loads((tmp_path / "rft.jsonl.summary.json").read_text())["rows"] == len(rows)
    assert not list(tmp_path.glob("rft.jsonl.rank*"))  # shards merged and removed


def test_resume_after_an_interrupted_run_loses_nothing_and_duplicates_nothing(
        sft_checkpoint, tmp_path):
    run, examples, prompts = rft_run(sft_checkpoint, rft_min_reward="0.0")
    out = tmp_path / "rft.jsonl"
    with run:
        scorer = run.scorer
        calls = {"n": 0}
        real = scorer.score

        def dies_on_the_second_batch(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt  # as if killed during the second batch
            return real(*a, **kw)

        scorer.score = dies_on_the_second_batch
        with pytest.raises(KeyboardInterrupt):
            generate_rft_data(run, examples, out)
        shard = Path(f"{out}.rank0")
        first = [json.loads(line) for line in shard.open()]
        assert len(first) == 5  # the first batch's prompts, all written
        with open(shard, "a") as f:
            f.write('{"prompt": "e2e4:", "targ')  # and a line torn by the kill
        scorer.score = real
        summary = generate_rft_data(run, examples, out)
    assert summary["prompts_generated_now"] == 12 - 5  # only what was missing
    rows = [json.loads(line) for line in out.open()]
    assert [r["prompt"] for r in rows] == prompts  # min_reward 0: one row per prompt, in order
    assert rows[:5] == first  # the finished prompts kept as they were
    assert not shard.exists()


def test_torchrun_two_processes_cover_the_same_prompts_as_one(sft_checkpoint, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("USE_AMP", "OUT_DIR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **ranks_env(2))  # 1 and 2 alike
    args = ["rft-generate", "--checkpoint", str(sft_checkpoint), "--rft_min_reward=0",
            *(f"--{k}={v}" for k, v in OPTS.items())]
    outs = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}.jsonl"
        launcher = [sys.executable] if n == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        r = subprocess.run([*launcher, "-m", "mini_grpo", *args, "--output", str(out)],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
        assert summary["prompts_generated_now"] == 12 and summary["completions_generated_now"] \
            == 12 * 4 and summary["world_size"] == n  # every prompt sampled, once
        outs[n] = [json.loads(line)["prompt"] for line in out.open()]
    # rows in the prompts' order whatever the shards (the ranks draw their own samples, and
    # a prompt none of whose completions ended by itself has no row)
    run, _, prompts = rft_run(sft_checkpoint)
    run.close()
    for n in (1, 2):
        assert len(outs[n]) >= 9 and set(outs[n]) <= set(prompts)
        assert outs[n] == sorted(outs[n], key=prompts.index)


def test_loader_skips_a_truncated_last_line_but_not_a_bad_middle_one(tmp_path, caplog):
    from mini_grpo.config import ConfigError

    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a:", "target": "b"}\n{"prompt": "c:", "tar')
    assert [ex.prompt for ex in load_jsonl(p)] == ["a:"]
    assert "truncated last line" in caplog.text
    p.write_text('{"prompt": "a:", "tar\n{"prompt": "c:", "target": "d"}\n')
    with pytest.raises(ConfigError, match=":1: malformed JSON"):
        load_jsonl(p)
    # a kill inside a character: its first byte of two, the last line's (a middle one is bad)
    cut = b'{"prompt": "a:", "target": "b"}\n{"prompt": "Z' + "\u00fc".encode()[:1]
    p.write_bytes(cut)
    assert [ex.prompt for ex in load_jsonl(p)] == ["a:"]
    p.write_bytes(cut + b"\n")
    with pytest.raises(ConfigError, match=":2: not valid UTF-8"):
        load_jsonl(p)


def test_rft_mode_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = train(load_config("tiny", {"out_dir": str(out), "mode": "rft", "sft_steps": "10",
                                        "rft_sft_steps": "5", "rft_min_reward": "0.0",
                                        **OPTS}, env={}))
    assert set(result) == {"before", "after", "baselines"}
    assert (out / "rft" / "data.jsonl").is_file()
    assert (out / "rft" / "sft" / "step_0000005.pt").is_file()
    with pytest.raises(Exception, match="rft_min_reward"):
        train(load_config("tiny", {"out_dir": str(tmp_path / "r2"), "mode": "rft",
                                   "sft_steps": "2", "rft_min_reward": "2.0", **OPTS}, env={}))


def test_rft_data_made_with_other_options_is_generated_again(tmp_path, capsys):
    base = {"out_dir": str(tmp_path), "mode": "rft", "sft_steps": "4", "rft_sft_steps": "2",
            "rft_min_reward": "0.0", **OPTS}
    train(load_config("tiny", base, env={}))
    capsys.readouterr()
    train(load_config("tiny", {**base, "rft_sft_steps": "3"}, env={}))  # the SFT on it only
    out = capsys.readouterr().out
    assert "not resuming" not in out and "12 already done" in out
    train(load_config("tiny", {**base, "temperature": "0.9"}, env={}))
    out = capsys.readouterr().out
    assert "not resuming" in out and "generated with other temperature" in out
    assert "0 of this rank's 12 already done" in out


def test_rft_grpo_mode_evaluates_before_after_rft_and_after_grpo_and_resumes(tmp_path, capsys):
    """mode rft_grpo: RFT from init_from's model (here one of our SFT checkpoints), then GRPO
    from the RFT model; eval.json keeps before / rft / after, reward.png is drawn; a second
    run with more steps resumes GRPO and keeps the first evaluations."""
    pytest.importorskip("matplotlib")
    warm = tmp_path / "warm"
    train(load_config("tiny", {"out_dir": str(warm), "mode": "sft", "sft_steps": "6", **OPTS},
                      env={}))
    opts = {"out_dir": str(tmp_path / "run"), "mode": "rft_grpo", "rft_sft_steps": "3",
            "rft_min_reward": "0.0", "init_from": str(warm / "sft" / "step_0000006.pt"),
            "max_steps": "2", "save_every": "2", **OPTS}
    result = train(load_config("tiny", opts, env={}))
    assert set(result) == {"before", "rft", "after", "baselines"}
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert saved["before"] == result["before"] and saved["rft"] == result["rft"]
    assert result["rft"]["greedy"] != result["before"]["greedy"]  # RFT's SFT moved the model
    assert (tmp_path / "run" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    again = train(load_config("tiny", {**opts, "max_steps": "3"}, env={}))
    out = capsys.readouterr().out
    assert "resuming GRPO from step 2" in out and "[eval] step 0" not in out
    assert again["before"] == result["before"] and again["rft"] == result["rft"]


def test_sft_of_a_trained_model_evaluates_it_first_and_resumes_keeping_it(
        sft_checkpoint, tmp_path, capsys):
    """SFT from init_from's model: the job evaluates that model first ("before"), then what
    SFT made of it ("sft", before GRPO), then the end ("after"); a resumed GRPO run keeps the
    first two without evaluating again. Mode sft alone: before and after."""
    opts = {"out_dir": str(tmp_path / "run"), "mode": "sft_grpo", "init_from":
            str(sft_checkpoint), "sft_steps": "3", "sft_lr": "3e-3", "max_steps": "2",
            "save_every": "2", **OPTS}
    result = train(load_config("tiny", opts, env={}))
    assert set(result) == {"before", "sft", "after", "baselines"}
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert saved["before"] == result["before"] and saved["sft"] == result["sft"]
    assert result["sft"]["greedy"] != result["before"]["greedy"]  # SFT moved the model
    capsys.readouterr()
    again = train(load_config("tiny", {**opts, "max_steps": "3"}, env={}))
    out = capsys.readouterr().out
    assert "resuming GRPO from step 2" in out and "[eval] step 0" not in out
    assert again["before"] == result["before"] and again["sft"] == result["sft"]
    alone = train(load_config("tiny", {**opts, "mode": "sft", "out_dir": str(tmp_path / "sft")},
                              env={}))
    assert set(alone) == {"before", "after", "baselines"}
    assert alone["before"] == result["before"]  # the same model, the same seed


def test_an_output_not_written_here_is_refused_untouched(sft_checkpoint, tmp_path):
    """A user's file at --output (notes, a data file with no trailing newline, chat rows,
    not JSON at all), or rows of other settings, is refused before anything is read, cut or
    written; an earlier output of the same settings is resumed."""
    from mini_grpo.config import ConfigError

    users = {"notes.txt": "my notes, not rows\n",
             "data.jsonl": '{"prompt": "a:", "target": "b"}\n{"prompt": "c:", "target": "d"}',
             "chat.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n',
             "bin.jsonl": "\x00\x01 not json"}
    run, examples, _ = rft_run(sft_checkpoint, rft_min_reward="0.0")
    with run:
        for name, text in users.items():
            (tmp_path / name).write_text(text)
            with pytest.raises(ConfigError, match=f"{name} exists and was not written by "
                                                  f"rft-generate"):
                generate_rft_data(run, examples, tmp_path / name)
            assert (tmp_path / name).read_text() == text
        out = tmp_path / "rft.jsonl"
        generate_rft_data(run, examples, out, source={"split": "train"})
        first = [json.loads(line) for line in out.open()]
        again = generate_rft_data(run, examples, out, source={"split": "train"})
        rows = out.read_text()  # resumed: only prompts with no row yet are sampled again
        assert again["prompts_generated_now"] == 12 - len({r["prompt"] for r in first})
        assert all(r in [json.loads(line) for line in rows.splitlines()] for r in first)
        with pytest.raises(ConfigError, match="generated with other split"):
            generate_rft_data(run, examples, out, source={"split": "eval"})
        assert out.read_text() == rows
    run, examples, _ = rft_run(sft_checkpoint, rft_min_reward="0.0", rft_oversample="2")
    with run:
        with pytest.raises(ConfigError, match="generated with other rft_oversample"):
            generate_rft_data(run, examples, out, source={"split": "train"})
        assert out.read_text() == rows
        # in a run's own directory (the job's rft/ stage) stale rows are regenerated instead
        summary = generate_rft_data(run, examples, out, source={"split": "train"},
                                    replace_stale=True)
    assert summary["prompts_generated_now"] == 12 and summary["oversample"] == 2
    r = subprocess.run([sys.executable, "-m", "mini_grpo", "rft-generate", "--checkpoint",
                        str(sft_checkpoint), "--output", str(tmp_path / "notes.txt")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "notes.txt exists" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "notes.txt").read_text() == users["notes.txt"]


def test_a_second_run_on_the_same_output_is_refused_while_the_first_lives(sft_checkpoint,
                                                                          tmp_path):
    """Two rft-generate on one --output appended to the same shards, and the first to end
    removed them under the other: the second is refused in one line naming the first's
    pid, touching nothing; once the first is gone (killed: its lock goes with it), the
    output is written and no lock file is left."""
    from mini_grpo.config import ConfigError

    out = tmp_path / "rft.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from mini_grpo.rft import lock; lock(Path(sys.argv[1])); print('held', flush=True); "
         "time.sleep(120)", str(out)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == "held\n"
        run, examples, _ = rft_run(sft_checkpoint, rft_min_reward="0.0")
        with run:
            with pytest.raises(ConfigError, match=rf"rft.jsonl: another rft-generate is "
                                                  rf"writing it \(.*pid {holder.pid} "):
                generate_rft_data(run, examples, out)
            assert os.listdir(tmp_path) == ["rft.jsonl.rft.lock"]  # the holder's alone
            holder.kill()
            holder.wait()
            summary = generate_rft_data(run, examples, out)
    finally:
        holder.kill()
    assert summary["prompts_generated_now"] == 12
    assert sorted(os.listdir(tmp_path)) == ["rft.jsonl", "rft.jsonl.rft.json",
                                            "rft.jsonl.summary.json"]
