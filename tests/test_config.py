"""Config precedence and bad-input errors, through the real entry point as a subprocess."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mini_grpo.config import ConfigError, GRPOConfig, load_config, parse_cli
from mini_grpo.options import keys_with

ROOT = Path(__file__).resolve().parent.parent


def run_entry(*args, env=None, cwd=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("USE_AMP", "MAX_STEPS")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(ROOT / "distributed_train.py"), *args],
                          capture_output=True, text=True, env=full_env, cwd=cwd or ROOT,
                          timeout=120)


def test_precedence_defaults_yaml_env_cli(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lr: 0.001\nmax_steps: 7\nuse_amp: false\nseed: 5\n")
    r = run_entry("--config", str(cfg_file), "--seed=9", "--print-config",
                  env={"USE_AMP": "true", "MAX_STEPS": "11"})
    assert r.returncode == 0, r.stderr
    got = yaml.safe_load(r.stdout)
    assert got["lr"] == 0.001  # YAML over default
    assert got["use_amp"] is True  # env over YAML
    assert got["max_steps"] == 11  # env over YAML
    assert got["seed"] == 9  # CLI over YAML
    assert got["group_size"] == GRPOConfig().group_size  # untouched default
    r = run_entry("--config", str(cfg_file), "--max_steps", "3", "--print-config",
                  env={"MAX_STEPS": "11"})
    assert yaml.safe_load(r.stdout)["max_steps"] == 3  # CLI over env, space-separated form


def test_bare_name_is_looked_up_in_configs():
    for name in ("tiny", "tiny.yaml"):
        r = run_entry("--config", name, "--print-config")
        assert r.returncode == 0, r.stderr
        assert yaml.safe_load(r.stdout)["out_dir"] == "runs/tiny"


@pytest.mark.parametrize("yaml_text, args, env, expected", [
    ("lrr: 0.1\n", [], {}, ["lrr", "did you mean 'lr'", ":1:"]),
    ("seed: 1\nlr: fast\n", [], {}, ["lr", "fast", ":2:"]),
    ("lr: -0.1\n", [], {}, ["bad.yaml:1: lr: must be in [0, 1e6], got -0.1"]),
    # a range error says where the value was set: file and line, variable, command line
    ("seed: 1\ntask: countdown\ntask_args:\n  max_numbers: 9\n", [], {},
     ["bad.yaml:3: task_args.max_numbers: must be in 3..6, got 9"]),
    ("", [], {"MAX_STEPS": "-3"},
     ["environment variable MAX_STEPS: max_steps: must be in 1..10000000"]),
    ("max_steps: 4\n", ["--max_steps=-3"], {},
     ["command line: --max_steps: must be in 1..10000000"]),
    ("group_size: 1\n", [], {}, ["group_size", ">= 2"]),
    ("temperature: 0\n", [], {}, ["temperature: must be in (0, 100], got 0"]),
    ("seed: 1\nlr: [1, 2\n", [], {}, ["malformed YAML", ":3"]),
    ("", [], {"USE_AMP": "maybe"}, ["USE_AMP", "maybe"]),
    ("", ["--max_stepz=3"], {}, ["max_stepz", "did you mean 'max_steps'"]),
    ("", ["--group_size=x"], {}, ["group_size", "'x'"]),
    ("", ["--amp_dtype=int8"], {}, ["amp_dtype", "bfloat16"]),
    ("rewards: [{weight: 1}]\n", [], {}, ["rewards[0]", "name"]),
    # nested past YAML's own recursion limit, or past ours (100) with the key and line
    ("task_args: " + "[" * 3000 + "]" * 3000 + "\n", [], {}, ["bad.yaml", "nested deeper"]),
    ("seed: 1\nrewards: " + "[" * 150 + "]" * 150 + "\n", [], {},
     ["bad.yaml:2: rewards: nested deeper than 100 levels"]),
    ("", ["--task_args=" + "[" * 3000 + "]" * 3000], {},
     ["--task_args: nested deeper than 100 levels"]),
    ("task_args: &a {x: *a}\n", [], {}, ["bad.yaml:1: task_args: contains itself"]),
    ("seed: " + "1" * 100_000 + "\n", [], {}, ["bad.yaml", "integer longer than"]),
    # data generation is bounded
    ("", ["--task=countdown", "--task_args.num_train=1000000000000"], {},
     ["task_args.num_train: must be in 1..10,000,000"]),
    ("", ["--num_eval=1000000000000"], {}, ["num_eval: must be <= 10,000,000"]),
    # the rollout engine: refused at start, before any work, vllm installed or not
    ("", ["--rollout_engine=vllm"], {}, ["rollout_engine: vllm serves Hugging Face models",
                                         "init_from"]),
    ("", ["--vllm_gpu_memory_utilization=0"], {}, ["vllm_gpu_memory_utilization: must be in"]),
    ("", ["--vllm_is_cap=-1"], {}, ["vllm_is_cap: must be in [0, 1e6]"]),
    ("", ["--vllm_mode=nowhere"], {}, ["vllm_mode", "colocate", "server"]),
    ("", ["--vllm_tensor_parallel_size=0"], {}, ["vllm_tensor_parallel_size: must be in 1..1024"]),
    ("", ["--vllm_server_url=localhost:8000"], {}, ["vllm_server_url: must be an http:// or "
                                                    "https:// URL", "localhost:8000"]),
    ("", ["--vllm_server_url=http://[::1"], {}, ["vllm_server_url: 'http://[::1' is not a "
                                                 "valid URL"]),
    ("", ["--vllm_server_url=http://h:99999"], {}, ["vllm_server_url", "not a valid URL"]),
    ("", ["--group_size=1000000000"], {}, ["group_size: must be <= 10,000,000"]),
    ("", ["--seed=111111111111111111111111111111"], {}, ["seed: must be in 0..4294967295"]),
    ("", ["--seed=-1"], {}, ["seed: must be in 0..4294967295"]),
    ("", ["--prompts_per_step=2000000"], {}, ["prompts_per_step: 2,000,000 prompts x "
                                              "group_size 8 = 16,000,000 rows per step"]),
    ("", ["--micro_batch_size=1000000000"], {}, ["micro_batch_size: must be <= 10,000,000"]),
    # every number has a finite range: past it, one line naming the option and the range
    ("", ["--reward_timeout=1e308"], {}, ["reward_timeout: must be in (0, 86400], got 1e+308"]),
    ("", ["--num_threads=1000000"], {}, ["num_threads: must be in 0..4096, got 1000000"]),
    # refused at setup (limits.check_world: this machine's cores), before any work
    ("seed: 1\n", ["--num_threads=4000"], {},
     ["num_threads: 4000 threads on", "at most 4 x the cores"]),
    ("", ["--num_iterations=1000000000000"], {}, ["num_iterations: must be in 1..1000"]),
    ("", ["--lr=1e308"], {}, ["lr: must be in [0, 1e6], got 1e+308"]),
    ("", ["--dist_timeout=1e308"], {}, ["dist_timeout: must be in (0, 604800]"]),
    ("", ["--top_k=1000000000000"], {}, ["top_k: must be in 0..1048576"]),
    ("", ["--warmup_steps=1000000000000000000"], {}, ["warmup_steps: must be in 0..10000000"]),
    ("", ["--save_every=1000000000000000000"], {}, ["save_every: must be in 1..10000000"]),
    ("seed: 1\n", ["--rollout_engine=vllm", "--vllm_sleep=true", "--init_from=x",
                   "--device=cpu"], {},  # refused on the CPU, also on a machine with a GPU
     ["vllm_sleep: sleep mode gives GPU memory back", "needs a GPU"]),
])
def test_bad_input_exits_2_naming_the_culprit(tmp_path, yaml_text, args, env, expected):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text(yaml_text)
    r = run_entry("--config", str(cfg_file), *args, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for needle in expected:
        assert needle in lines[0], (needle, lines[0])
    assert r.stdout == ""  # failed before any work


def test_missing_config_file_exits_2():
    r = run_entry("--config", "no_such_config.yaml")
    assert r.returncode == 2
    assert "no_such_config.yaml" in r.stderr and "tiny" in r.stderr  # lists what exists


def test_load_config_in_process_and_saved_yaml_round_trips(tmp_path):
    cfg = load_config("tiny", {"lr": "3e-4", "use_amp": "on"}, env={})
    assert cfg.lr == 3e-4 and cfg.use_amp is True and cfg.n_layer == 2
    cfg.save(tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"), env={})
    assert again == cfg


def test_env_values_are_parsed_by_type():
    cfg = load_config(None, env={"USE_AMP": "Yes", "NUM_WORKERS": "3", "AMP_DTYPE": "float16",
                                 "USE_TF32": "0"})
    assert (cfg.use_amp, cfg.num_reward_workers, cfg.amp_dtype, cfg.use_tf32) == \
        (True, 3, "float16", False)
    with pytest.raises(ConfigError, match="NUM_WORKERS"):
        load_config(None, env={"NUM_WORKERS": "two"})
    with pytest.raises(ConfigError, match=r"num_reward_workers: must be in 1\.\.1024"):
        load_config(None, env={"NUM_WORKERS": "0"})


def test_parse_cli_forms():
    assert parse_cli(["--config", "x", "--lr=1", "--max-steps", "2"]) == \
        ("x", {"lr": "1", "max_steps": "2"})
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_cli(["lr=1"])
    with pytest.raises(ConfigError, match="--lr: missing value"):
        parse_cli(["--lr"])


def test_train_sh_help_lists_every_environment_variable():
    from mini_grpo.config import ENV_VARS

    r = subprocess.run(["bash", str(ROOT / "train.sh"), "--help"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0
    for var in ["NPROC", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CONFIG",
                *ENV_VARS]:
        assert f"{var}=" in r.stdout, var


def test_train_sh_reads_paths_from_where_it_runs_and_refuses_bad_input_in_one_line(tmp_path):
    """train.sh changed into the repository, so CONFIG=./mine.yaml was "not found" and
    --out_dir=x landed in the repository; and a bad value was a torchrun traceback per
    rank, MAX_RESTARTS times over."""
    (tmp_path / "mine.yaml").write_text("seed: 3\nbogus_key: 1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "MAX_RESTARTS")}
    run = lambda *args, **extra: subprocess.run(
        ["bash", str(ROOT / "train.sh"), *args], capture_output=True, text=True, timeout=60,
        cwd=tmp_path, env={**env, **extra})
    r = run(CONFIG="./mine.yaml", MAX_RESTARTS="3")
    assert r.returncode == 2 and r.stderr == "error: mine.yaml:2: bogus_key: unknown key\n"
    r = run("--lr=abc", CONFIG="tiny")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: command line: --lr: expected a number, got 'abc'"]


def test_every_shipped_config_loads_and_opens_with_its_launch_command():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(str(path), env={})
        assert cfg.out_dir.startswith("runs/"), path
        first = path.read_text().splitlines()[0]
        assert first.startswith("#") and path.stem in first, path


def test_shipped_configs_list_only_what_differs_from_the_defaults():
    defaults = GRPOConfig().to_dict()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        for key, value in (yaml.safe_load(path.read_text()) or {}).items():
            if key == "out_dir":
                continue
            if key == "task_args":
                default_args = load_config(None, env={}).task_args
                same = [k for k, v in value.items() if default_args.get(k) == v]
                assert not same, (path.name, same)
                continue
            assert defaults[key] != value, (path.name, key)


@pytest.mark.parametrize("args, needle", [
    (["--lr=nan"], "lr: must be a finite number"),
    (["--beta=inf"], "beta: must be a finite number"),
    (["--temperature=NaN"], "temperature: must be a finite number"),
    (["--dist_timeout=1e999"], "dist_timeout: must be a finite number"),
    (["--rewards=[{name: levenshtein, weight: .nan}]"], "rewards[0].weight: must be a finite"),
])
def test_non_finite_values_are_rejected_naming_the_key(args, needle):
    r = run_entry("--config", "tiny", *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_parallel_rewards_still_switches_the_executor():
    assert load_config(None, env={"PARALLEL_REWARDS": "false"}).reward_executor == "serial"
    assert load_config(None, {"parallel_rewards": "false"}, env={}).reward_executor == "serial"
    on = load_config(None, {"reward_executor": "serial", "parallel_rewards": "true"}, env={})
    assert on.reward_executor == "process"  # a pool again
    kept = load_config(None, {"reward_executor": "thread"}, env={"PARALLEL_REWARDS": "on"})
    assert kept.reward_executor == "thread"


def test_an_empty_config_file_says_so(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here yet\n")
    r = run_entry("--config", str(empty), "--print-config")
    assert r.returncode == 0 and "sets nothing: every key takes its default" in r.stderr


# ---- task_args belong to a task ----

def test_a_presets_task_args_are_not_applied_to_another_task(capsys):
    r = run_entry("--config", "tiny", "--task=jsonl", "--data_path=rows.jsonl", "--print-config")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["task_args"] == {}
    note = [line for line in r.stderr.splitlines() if "task_args" in line]
    assert len(note) == 1 and note[0].startswith("[mini-grpo] note: task_args from ")
    assert note[0].endswith("tiny.yaml were for chess_fen, not applied to jsonl"), note
    # the same from a checkpoint's stored config
    stored = load_config("tiny", env={}).to_dict()
    cfg = load_config(None, {"task": "countdown"}, env={}, base=stored, base_where="ck.pt: ")
    assert cfg.task_args["num_train"] == 20000  # countdown's default, not chess's 256
    assert capsys.readouterr().err == ("[mini-grpo] note: task_args from ck.pt were for "
                                       "chess_fen, not applied to countdown\n")


def test_task_args_on_the_command_line_merge_by_key_and_replace_as_a_mapping():
    assert load_config("tiny", env={}).task_args["num_train"] == 256  # the preset's
    merged = load_config("tiny", {"task_args.max_plies": "8"}, env={}).task_args
    assert (merged["num_train"], merged["max_plies"]) == (256, 8)
    cleared = load_config("tiny", {"task_args": "{}"}, env={}).task_args
    assert cleared["num_train"] == 50000  # chess_fen's default again
    again = load_config("tiny", {"task_args": "{}", "task_args.max_plies": "8"}, env={})
    assert (again.task_args["num_train"], again.task_args["max_plies"]) == (50000, 8)
    # a YAML layer's task_args apply when its task (its own or the one before) is the final
    kept = load_config("tiny", {"task": "chess_fen"}, env={})
    assert kept.task_args["num_train"] == 256
    lm = load_config("countdown_tiny_lm", env={})
    assert lm.task_args["num_train"] == 64 and lm.task_args["prompt_style"] == "instruct"


def test_a_wrong_task_arg_names_the_task_the_layer_and_the_tasks_own_options(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task: countdown\ntask_args: {num_trian: 5}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env={})
    assert str(e.value) == (
        f"{path}:2: task_args.num_trian: unknown key for task countdown (did you mean "
        f"'num_train'? its options: min_numbers, max_numbers, num_train, prompt_style, "
        f"answer_tag)")
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"task": "jsonl", "task_args.num_train": "5"}, env={})
    assert str(e.value) == ("command line: --task_args.num_train: unknown key: task jsonl "
                            "takes no options")
    with pytest.raises(ConfigError, match=r"c.yaml:2: task_args.num_train: expected an int"):
        path.write_text("task: countdown\ntask_args: {num_train: many}\n")
        load_config(str(path), env={})
    with pytest.raises(ConfigError, match="unknown task 'go' .available: calculator, "
                                          "chess_fen, countdown, jsonl, numeric"):
        load_config(None, {"task": "go"}, env={})


def test_vllm_asked_for_but_not_importable_says_how_to_install_it(monkeypatch):
    from mini_grpo.engines.vllm import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"needs the vllm package \(`make setup VLLM=1`"):
        import_vllm()


def test_help_lists_every_option_with_its_default(capsys):
    """`distributed_train.py --help` / `mini-grpo train --help` answer (they were a 'missing
    value' error), listing every field with its type, default and help comment."""
    import dataclasses

    from mini_grpo.cli import train_main
    from mini_grpo.config import GRPOConfig

    for flag in ("--help", "-h"):
        assert train_main(["--config", "tiny", flag]) == 0
        text = capsys.readouterr().out
        for f in dataclasses.fields(GRPOConfig):
            assert f"  --{f.name} (" in text, f.name
        assert "  --lr (float, default 3e-05; [0, 1e6])" in text
        assert "  --lora_r (int, default 0; 0..65536; env LORA_R)\n      adapters of this " \
            "rank" in text
        assert "  --seed (int, default 1337; 0..4294967295; env SEED)" in text


def test_every_option_has_a_help_text():
    """Every field has a comment beside or above its declaration, which `--help` prints; the
    check finds a field without one (24 of 93 had none, loss_agg and task among them)."""
    import inspect
    import re

    from mini_grpo.config import FIELDS
    from mini_grpo.config_help import _comments, missing_help

    assert missing_help() == []
    source = inspect.getsource(GRPOConfig)
    bare = re.sub(r"^ *#(?! ----).*\n|  # .*$", "", source, flags=re.M)  # every comment gone
    assert missing_help(bare) == list(FIELDS)

    # the lines above and the comment beside a declaration; a blank line ends their reach
    source = ("    # ---- run ----\n"
              "    # where the run writes\n"
              "    out_dir: str = opt('runs', 'run')  # and keeps\n"
              "    seed: int = opt(1, 'sft')  # every draw\n"
              "    # orphaned by the blank line below\n"
              "\n"
              "    device: str = opt('auto', 'run')\n")
    helps, sections = _comments(source)
    assert helps == {"out_dir": "where the run writes and keeps", "seed": "every draw",
                     "device": ""}
    assert set(sections.values()) == {"run"}
    assert missing_help(source)[0] == "device"


def test_help_names_what_loss_and_task_options_do(capsys):
    """The options that printed no help before (issue 39) print a definition under their
    line in the real `--help`."""
    from mini_grpo.cli import train_main

    assert train_main(["--config", "tiny", "--help"]) == 0
    helps, name = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  --"):
            name = line.split()[0][2:]
            helps[name] = ""
        elif name and line.startswith("      "):
            helps[name] = (helps[name] + " " + line.strip()).strip()
        else:
            name = None
    assert [name for name, text in helps.items() if not text] == []
    for name, words in [("loss_agg", ("grpo", "dapo", "dr_grpo")),
                        ("scale_rewards", ("group", "batch", "none")),
                        ("epsilon_low", ("1 - epsilon_low",)), ("task", ("countdown",))]:
        assert helps[name] and all(w in helps[name] for w in words), (name, helps[name])


def test_the_guide_s_env_table_is_generated_from_the_declarations():
    """docs/guide.md's table of environment variables is config_help.env_table(), verbatim:
    the variables, fields, values and defaults the fields declare (regenerate it with
    `python -m mini_grpo.config_help --env-table`)."""
    from conftest import ROOT

    from mini_grpo.config_help import env_table

    assert env_table() in (ROOT / "docs" / "guide.md").read_text()


def test_every_option_declares_its_roles():
    """Every field is declared with opt() and at least one role; a field added without one is
    found (the check that keeps stage, resume and loss keys complete)."""
    from mini_grpo.options import opt, undeclared

    assert undeclared(GRPOConfig) == []

    @dataclasses.dataclass
    class WithNewKnob(GRPOConfig):
        new_knob: int = 3

    @dataclasses.dataclass
    class WithRoles(GRPOConfig):
        new_knob: int = opt(3, "grpo")

    assert undeclared(WithNewKnob) == ["new_knob"]
    assert undeclared(WithRoles) == []
    with pytest.raises(TypeError, match="roles must name"):
        opt(3, "")
    with pytest.raises(TypeError, match="roles must name"):
        opt(3, "sft shapes")
    with pytest.raises(TypeError, match="a check is"):
        opt(3, "run", "positive")


def test_every_numeric_option_has_a_finite_range():
    """An int or float option without an upper bound reaches Python's limits (OverflowError,
    a million threads): every one declares a finite range, and one added without is found."""
    from mini_grpo.options import opt, unbounded

    assert unbounded(GRPOConfig) == []

    @dataclasses.dataclass
    class WithOpenKnob(GRPOConfig):
        open_knob: float = opt(1.0, "run", "> 0")
        open_count: int = opt(1, "run")
        closed: float = opt(1.0, "run", "(0, 2]")
        flag: bool = opt(False, "run")

    assert unbounded(WithOpenKnob) == ["open_knob", "open_count"]


def test_keys_derived_from_roles():
    """The stage, resume and loss keys are the fields of those roles, nested as the stages
    are (RFT's data depends on the SFT stage, RFT's SFT on both)."""
    from mini_grpo.grpo import LossSettings
    from mini_grpo.job import RESUME_FIXED, RESUME_FIXED_LORA
    from mini_grpo.sft import STAGE_KEYS

    sft, data, rft = (set(STAGE_KEYS[k]) for k in ("sft", "rft_data", "rft"))
    assert sft < data < rft
    assert {"seed", "sft_lr", "lora_r", "task_args"} <= sft
    assert {"temperature", "rft_oversample", "rewards"} <= data - sft
    assert rft - data == {"rft_sft_steps", "rft_lr"}
    assert {"n_layer", "task", "group_size"} <= set(RESUME_FIXED)
    assert set(RESUME_FIXED_LORA) == {"init_from", "adapter"}
    assert {f.name for f in dataclasses.fields(LossSettings)} == set(
        keys_with(GRPOConfig, "loss"))
    s = LossSettings.of(GRPOConfig(beta=0.5, loss_agg="grpo"))
    assert (s.beta, s.loss_agg, s.vllm_is_cap) == (0.5, "grpo", 0.0)  # native: no IS weight


def test_no_module_lists_config_keys_by_hand():
    """No list, tuple or set of three or more config keys is written out in mini_grpo's code
    outside the declarations: such lists are derived from the fields' roles."""
    import ast

    from conftest import ROOT

    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    found = []
    for path in sorted((ROOT / "mini_grpo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and len(node.elts) >= 3 and all(
                    isinstance(e, ast.Constant) and e.value in names for e in node.elts):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []




def test_yaml_s_bare_on_and_off_and_where_a_reward_s_weight_was_set(tmp_path, monkeypatch,
                                                                     capsys):
    """YAML reads a bare `off` as false: `generation_amp: off` was refused ("got False").
    A bad rewards[i].weight named no file or line. Environment variables with generic names
    (SEED, NUM_WORKERS) set a training run's fields without a word."""
    f = tmp_path / "c.yaml"
    f.write_text("generation_amp: off\nchat_template: on\n")
    cfg = load_config(str(f), env={})
    assert (cfg.generation_amp, cfg.chat_template) == ("off", "on")
    f.write_text("init_from: off\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:1: init_from: expected .* got False "
                                          r"\(YAML reads a bare on/off/yes/no"):
        load_config(str(f), env={})
    f.write_text("rewards:\n  - name: fen_valid\n    weight: abc\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:1: rewards\[0\]\.weight: must be a finite"):
        load_config(str(f), env={})
    from mini_grpo.config import from_environment

    env = {"SEED": "5", "USE_AMP": "true"}
    cfg = load_config("tiny", {"use_amp": "false"}, env=env)
    assert from_environment(cfg, env) == ["SEED='5' (seed)"]  # the command line's use_amp won


def test_a_key_set_twice_an_empty_config_and_help(tmp_path, capsys):
    from mini_grpo.cli import main

    f = tmp_path / "c.yaml"
    f.write_text("lr: 1\nseed: 2\nlr: 2\n")  # YAML's last one had won, silently
    with pytest.raises(ConfigError, match=r"c\.yaml:3: lr: set twice \(line 1 too\)"):
        load_config(str(f), env={})
    with pytest.raises(ConfigError, match="--config: empty"):  # had meant the defaults
        parse_cli(["--config="])
    with pytest.raises(ConfigError, match="command line: --bogus: unknown key"):
        load_config(None, {"bogus": "1"}, env={})
    capsys.readouterr()
    assert main(["--help"]) == 0 and "mini-grpo train" in capsys.readouterr().out


def test_a_config_is_bounded_before_it_is_parsed(tmp_path):
    """A config file's bytes (1 MiB) and any YAML text's nodes (10,000, an alias counted as
    what it stands for) are bounded before PyYAML builds anything: a 12 MB file took 74 s and
    2 GB, a list of 1M items 42 s; each refused in one line naming the file (or the key) and
    the bound, within a second or two."""
    import time

    from mini_grpo.fields import MAX_YAML_BYTES, MAX_YAML_NODES

    laughs = ["tools:", "  - &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    cases = {"big.yaml": ("# " + "x" * MAX_YAML_BYTES + "\n", "larger than 1048576 bytes "
                          "(1 MiB), the most a config file may be"),
             "list.yaml": ("tools: [" + "1, " * 300_000 + "1]\n", "more than 10000 YAML nodes"),
             "keys.yaml": ("task_args:\n" + "".join(f"  k{i}: 1\n" for i in range(20_000)),
                           "more than 10000 YAML nodes"),
             "laughs.yaml": ("\n".join(laughs) + "\n", "more than 10000 YAML nodes"),
             "deep.yaml": ("a: " + "[" * 5000 + "]" * 5000 + "\n",
                           "nested deeper than 100 levels")}
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_text(text)
        t0 = time.process_time()  # CPU-bound: the process's CPU time, not the wall clock
        with pytest.raises(ConfigError) as e:
            load_config(str(tmp_path / name), {}, env={})
        assert str(e.value).startswith(f"{tmp_path / name}: {needle}"), str(e.value)[:300]
        assert time.process_time() - t0 < 5, name
    with pytest.raises(ConfigError, match=f"--tools: more than {MAX_YAML_NODES} YAML nodes"):
        load_config(None, {"tools": "[" + "1," * MAX_YAML_NODES + "1]"}, env={})
    ok = tmp_path / "ok.yaml"  # just under the bound: read
    ok.write_text("report_to: [" + ", ".join(["tensorboard"] * (MAX_YAML_NODES - 3)) + "]\n")
    assert load_config(str(ok), {}, env={}).report_to[0] == "tensorboard"


def test_a_tilde_in_a_path_field_is_the_users_home(tmp_path, monkeypatch):
    """`--out_dir='~'`, `out_dir: ~/runs/x` in YAML: no shell expands the ~ there, and a run
    made a folder named `~`; the path fields expand it as a shell would, and a ~user that
    names no user is one line."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, {"out_dir": "~", "init_from": "~/model", "data_path": "~/d.jsonl",
                             "resume": "~/step_0000001.pt"}, env={"OUT_DIR": "~/ignored"})
    assert (cfg.out_dir, cfg.init_from, cfg.data_path, cfg.resume) == (
        str(tmp_path), str(tmp_path / "model"), str(tmp_path / "d.jsonl"),
        str(tmp_path / "step_0000001.pt"))
    (tmp_path / "c.yaml").write_text("out_dir: ~/runs/x\n")
    assert load_config(str(tmp_path / "c.yaml"), {}, env={}).out_dir == str(
        tmp_path / "runs" / "x")
    assert load_config(None, {"out_dir": "./~/x"}, env={}).out_dir == "./~/x"  # as written
    with pytest.raises(ConfigError, match=r"^command line: --out_dir: '~no-such-user-q/x': no "
                                          r"user 'no-such-user-q' whose home ~ could name"):
        load_config(None, {"out_dir": "~no-such-user-q/x"}, env={})
