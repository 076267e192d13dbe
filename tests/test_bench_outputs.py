"""The bench scripts and benchmark.py write their results over no file they did not write: a
user's file (or an older result without the mark) is refused, naming it, before any work."""

import importlib
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env

sys.path.insert(0, str(ROOT / "bench"))

# each script with the least arguments that reach its output's check; the work itself (a job,
# a model, TRL) is never reached: the dummy paths below would fail it
SCRIPTS = [
    ("calculator_fresh_eval", ["--json"]),
    ("calculator_table", ["t", "n", "bt", "b", "--out"]),
    ("gemma3_parity", ["--json"]),
    ("gguf_parity", ["--out"]),
    ("kill_resume", ["--json"]),
    ("lm_job_cost", ["--out_dir", "runs/none", "--json"]),
    ("lm_job_seeds", ["--name", "x", "--seeds", "1", "--json"]),
    ("rl_screen", ["--sft", "none", "x:", "--json"]),
    ("lm_job_table", ["none", "--out"]),
    ("memory_steps", ["--variant", "a:none", "--json"]),
    ("pass_shapes", ["--json"]),
    ("policy_plans", ["--json"]),
    ("sample_vs_hf", ["--model_dir", "none", "--out"]),
    ("step_profile", ["--init_from", "none", "--json"]),
    ("trl_step", ["--model", "none", "--out"]),
    ("trl_tools_step", ["--model", "none", "--out"]),
    ("turns_overhead", ["--model", "none", "--json"]),
]


def test_every_bench_script_that_writes_json_is_checked_here():
    writers = {p.stem for p in (ROOT / "bench").glob("*.py")
               if "--json" in p.read_text() or "--out\"" in p.read_text()}
    assert writers - {"outfile", "rss_timeline"} <= {name for name, _ in SCRIPTS}


@pytest.mark.parametrize("name,args", SCRIPTS, ids=[n for n, _ in SCRIPTS])
def test_a_bench_script_refuses_a_users_file_before_any_work(name, args, tmp_path, monkeypatch,
                                                            capsys):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *args, str(notes)])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(name).main()
    assert "notes.json" in str(e.value) and "not written by" in str(e.value)
    assert notes.read_text() == '{"mine": 1}\n'
    assert capsys.readouterr().out == ""  # nothing started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json"]


def test_a_bench_script_replaces_its_own_result_and_marks_it(tmp_path, monkeypatch):
    from outfile import claim

    out = tmp_path / "r.json"
    claim(out, "bench/pass_shapes.py")({"a": 1}, indent=2)
    claim(out, "bench/pass_shapes.py")({"a": 2}, indent=2)  # its own: checked, replaced
    assert json.loads(out.read_text()) == {"written_by": "bench/pass_shapes.py", "a": 2}
    with pytest.raises(SystemExit, match="r.json: exists and was not written"):
        claim(out, "bench/memory_steps.py")  # another script's result
    save = claim(tmp_path / "late.json", "bench/x.py")
    (tmp_path / "late.json").write_text("a user's, made while the script ran")
    with pytest.raises(SystemExit, match="late.json: exists and was not written"):
        save({"a": 1})
    assert (tmp_path / "late.json").read_text() == "a user's, made while the script ran"


def test_benchmark_json_refuses_a_users_file_before_measuring(tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    r = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--config", "tiny",
                        "--only", "generation", "--json", str(notes)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path, env=clean_env())
    assert r.returncode == 2, r.stderr
    assert "notes.json: exists and was not written by this command" in r.stderr
    assert "[bench]" not in r.stderr  # no plan, no probe: refused first
    assert notes.read_text() == '{"mine": 1}\n'


def test_a_job_measurement_records_the_kernel_and_allocator_variables_it_ran_under(monkeypatch):
    from lm_job_cost import ENV_PREFIXES, run_env

    for k in [k for k in os.environ if k.startswith(ENV_PREFIXES)]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME_OF_NOTHING", "x")
    assert run_env() == {}  # none set: the row stays as it was
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    assert run_env() == {"env": {"MALLOC_ARENA_MAX": "1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}


def test_the_documents_result_tables_are_the_bench_json_s():
    """README's generated tables and the whole of docs/results.md equal what bench/results.py
    makes of the bench/ JSON now (a new run, or a hand edit, must be followed by
    `python bench/results.py`); a stale table is found, an unknown one refused."""
    import results

    assert results.main(["--check"]) == 0
    block = "<!-- results: lm_job -->\n| typed by hand |\n<!-- /results -->"
    fresh = results.rendered(block, "doc")
    assert "typed by hand" not in fresh and "| AMD EPYC Zen4" in fresh
    assert results.rendered(fresh, "doc") == fresh
    with pytest.raises(SystemExit, match="doc: <!-- results: nope -->: no such table"):
        results.rendered("<!-- results: nope -->\n<!-- /results -->", "doc")


def test_the_results_page_is_written_whole_and_any_changed_byte_is_stale(tmp_path, monkeypatch,
                                                                         capsys):
    """docs/results.md is the template with its tables filled, byte for byte: `--check` names
    the page and what differs (a table, the text outside them, one byte more) and changes
    nothing; a plain run writes it back."""
    import results

    page = results.page()
    assert page.startswith("# mini-grpo: results\n") and "**This page is generated**" in page
    assert "| AMD EPYC Zen4" in page and "<!-- results: trl_step -->" in page
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
    monkeypatch.setattr(results, "ROOT", tmp_path)
    out = tmp_path / "docs" / "results.md"
    table = page.index("| AMD EPYC Zen4")
    for stale, named in ((page[:table] + "| typed" + page[table + 1:], "docs/results.md: lm_job"),
                         (page.replace("**This page", "**The page", 1), "outside the tables"),
                         (page + "\n", "docs/results.md: the text outside the tables")):
        out.write_text(stale)
        assert results.main(["--check"]) == 1
        assert named in capsys.readouterr().out
        assert out.read_text() == stale
    out.unlink()
    assert results.main(["--check"]) == 1  # no page at all
    assert results.main([]) == 0 and out.read_text() == page
    assert results.main(["--check"]) == 0
