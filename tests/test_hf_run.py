"""A run that starts from a Hugging Face directory and ends in one: init_from a tiny local
Qwen2-style model with a BPE tokenizer and a ChatML template (built with transformers, nothing
downloaded) -> SFT -> GRPO -> <out_dir>/hf, which transformers loads with our logits; the
CLI's sample / export / evaluate on such directories; bad directories named."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, clean_env, tiny, tiny_lm_dir

transformers = pytest.importorskip("transformers")

from mini_grpo.checkpoint import CheckpointError, list_checkpoints, load_checkpoint  # noqa: E402
from mini_grpo.job import train  # noqa: E402
from mini_grpo.models.hf import load_hf_model  # noqa: E402
from mini_grpo.policy import build_policy  # noqa: E402
from mini_grpo.tokenizer import HFTokenizer  # noqa: E402

PROMPT = "e2e4 e7e5 g1f3:"


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_lm_dir(tmp_path_factory.mktemp("models") / "qwen")


@pytest.fixture(scope="module")
def trained(lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train(tiny(out, init_from=str(lm), mode="sft_grpo", sft_steps=4, max_steps=2,
               block_size=256))
    return out


def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "mini_grpo", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=clean_env(),
                          timeout=300)


def logits_both(path, ids):
    """(transformers', ours) logits of ids for the model directory at `path`."""
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ours = load_hf_model(path).eval()
    with torch.no_grad():
        return theirs(ids).logits, ours(ids)


def test_prompts_go_through_the_chat_template(lm):
    tok = HFTokenizer.from_dir(lm)
    theirs = transformers.AutoTokenizer.from_pretrained(lm)
    user = {"role": "user", "content": PROMPT}
    for system in ("", "Answer in FEN."):  # a system prompt replaces the template's default
        tok.configure_chat("auto", system)
        messages = [{"role": "system", "content": system}, user] if system else [user]
        want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert want.startswith("<|im_start|>system\n" + (system or "You are"))
        assert tok.encode_prompt(PROMPT) == theirs(want, add_special_tokens=False).input_ids
    tok.configure_chat("off", "")
    assert tok.encode_prompt(PROMPT) == tok.encode(PROMPT, bos=True)
    with pytest.raises(ValueError, match="system_prompt: needs the chat template"):
        tok.configure_chat("off", "Answer in FEN.")


def test_a_run_from_a_hugging_face_directory_exports_what_transformers_loads(lm, trained):
    ckpt = load_checkpoint(list_checkpoints(trained / "checkpoints")[-1])
    assert ckpt["step"] == 2 and ckpt["model_spec"]["family"] == "llama"
    assert ckpt["model_spec"]["hf_config"]["model_type"] == "qwen2"
    assert ckpt["tokenizer"]["type"] == "hf"  # the checkpoint carries the BPE tokenizer
    start = load_hf_model(lm).state_dict()
    assert any(not torch.equal(start[k], v) for k, v in ckpt["model"].items()), "nothing moved"
    export = trained / "hf"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["dtype"] == "float32"
    again = load_hf_model(export).state_dict()
    for k, v in ckpt["model"].items():  # the final weights, exactly
        assert torch.equal(again[k], v), k
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    theirs, ours = logits_both(export, ids)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    # the tokenizer files round-trip: transformers reads what the run started with
    tok = transformers.AutoTokenizer.from_pretrained(export)
    first = transformers.AutoTokenizer.from_pretrained(lm)
    text = "e2e4 é ü: <|im_end|>"
    assert tok(text).input_ids == first(text).input_ids
    assert tok.chat_template == first.chat_template and tok.eos_token == "<|im_end|>"
    gen = json.loads((export / "generation_config.json").read_text())
    assert gen["eos_token_id"] == first.eos_token_id


def test_a_run_from_a_hugging_face_directory_resumes(lm, trained):
    cfg = tiny(trained, init_from=str(lm), mode="sft_grpo", sft_steps=4, max_steps=3,
               block_size=256)
    train(cfg)  # the stored BPE tokenizer equals this run's: no refusal
    assert load_checkpoint(list_checkpoints(trained / "checkpoints")[-1])["step"] == 3


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "gpt2", "gemma3_text"])
def test_sample_a_hugging_face_directory_as_json_equals_transformers_greedy(tmp_path, family):
    lm = tiny_lm_dir(tmp_path / family, family)
    # fp32 on both sides: a GPU samples under bf16 autocast by default, and on a random
    # model's close logits bf16 flips the argmax (the second GPU run's failure)
    r = cli("sample", "--checkpoint", lm, "--prompt", PROMPT, "--greedy", "--json",
            "--max_new_tokens", 6, "--generation_amp=off", "--use_tf32=false")
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    tok = transformers.AutoTokenizer.from_pretrained(lm)
    model = transformers.AutoModelForCausalLM.from_pretrained(lm).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert row == {"prompt": PROMPT, "completion": tok.decode(out[0, ids.size(1):],
                                                              skip_special_tokens=True)}


def test_the_main_jobs_character_tokenizer_exports_as_one_transformers_reads(tmp_path):
    from mini_grpo.tasks.chess_fen import ALPHABET
    from mini_grpo.tokenizer import CharTokenizer

    ours = CharTokenizer(ALPHABET)
    ours.save_pretrained(tmp_path / "tok")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "e2e4 e7e5: rnbqkbnr/pppp1ppp/8/4p3/4P3/8/PPPP1PPP/RNBQKBNR w KQkq - 0 2 ~"
    assert theirs(text).input_ids == ours.encode(text, bos=True)  # ~ is <unk> in both
    ids = ours.encode(text, eos=True)
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids).replace("?", "")
    assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_id, ours.pad_id)


def test_export_a_checkpoint_in_bfloat16(trained, tmp_path):
    ckpt = list_checkpoints(trained / "checkpoints")[-1]
    r = cli("export", "--checkpoint", ckpt, "--output", tmp_path / "bf16", "--dtype",
            "bfloat16")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_checkpoint(ckpt)["model"]
    again = load_hf_model(tmp_path / "bf16")
    for k, v in again.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, weights[k].bfloat16()), k


def test_bad_model_directories_are_named(lm, tmp_path):
    import shutil

    def refused(path, needle):
        with pytest.raises(CheckpointError, match=needle):
            build_policy(tiny(None, init_from=str(path), block_size=256), None)

    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "not a Hugging Face model directory \\(no config.json\\)")
    bad = shutil.copytree(lm, tmp_path / "bad")
    (bad / "tokenizer.json").write_text("{not json")
    refused(bad, "tokenizer.json: cannot load")
    (bad / "tokenizer.json").unlink()
    refused(bad, "no tokenizer.json")
    # and through the entry point: one line, exit 2
    r = cli("sample", "--checkpoint", tmp_path / "empty", "--prompt", "x")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'empty'}: not a Hugging Face model directory (no config.json)"]


def test_evaluate_a_hugging_face_directory(lm):
    r = cli("evaluate", "--checkpoint", lm, "--num_eval=4", "--task_args.num_train=64",
            "--max_new_tokens=8", "--block_size=256", "--reward_executor=serial")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"checkpoint {lm}" in r.stdout and "4 held-out prompts" in r.stdout


def test_messages_rows_render_through_the_chat_template_as_transformers_renders_them(
        lm, tmp_path):
    from mini_grpo.config import ConfigError, load_config
    from mini_grpo.limits import check_lengths
    from mini_grpo.tasks import build_task

    convs = [[{"role": "system", "content": "Answer in FEN."},
              {"role": "user", "content": "e2e4:"}],
             [{"role": "user", "content": "d2d4 d7d5:"}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Moves?"},
              {"role": "user", "content": "g1f3:"}]] * 2
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m, "target": "x", "id": i}) + "\n"
                            for i, m in enumerate(convs)))
    cfg = load_config(None, {"task": "jsonl", "data_path": str(data), "init_from": str(lm),
                             "block_size": "256", "num_eval": "2"}, env={})
    task = build_task(cfg)
    _, tok = build_policy(cfg, task)
    theirs = transformers.AutoTokenizer.from_pretrained(lm)
    for ex in task.train + task.eval:
        assert ex.prompt == ex.messages[-1]["content"] and "id" in ex.meta
        want = theirs.apply_chat_template(ex.messages, add_generation_prompt=True,
                                          tokenize=False)
        assert tok.encode_prompt(ex.model_input) == \
            theirs(want, add_special_tokens=False).input_ids
    # without a chat template, such rows are refused before any work
    _, char_tok = build_policy(tiny(None), build_task(tiny(None)))
    with pytest.raises(ConfigError, match="rows with messages need a Hugging Face tokenizer"):
        check_lengths(cfg, char_tok, [ex.model_input for ex in task.train])


@pytest.mark.parametrize("row, needle", [
    ({"messages": [], "target": "x"}, "must be a non-empty list"),
    ({"messages": [{"role": "user"}], "target": "x"}, "messages\\[0\\] must be an object"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "target": "x"}, "the last message is the assistant's"),
    ({"messages": [{"role": "user", "content": "a"}], "prompt": "a", "target": "x"},
     "not both"),
])
def test_bad_messages_rows_are_named(tmp_path, row, needle):
    from mini_grpo.config import ConfigError
    from mini_grpo.tasks import load_jsonl

    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "ok", "target": "x"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=f"bad.jsonl:2: .*{needle}"):
        load_jsonl(data)


def test_a_meta_policy_is_the_one_built_without_its_weights(lm, tmp_path):
    # what every fsdp rank but 0 builds (on GPUs): rank 0's weights arrive into its shards
    from mini_grpo.models import spec
    from mini_grpo.tasks import build_task

    for cfg, data in ((tiny(None, init_from=str(lm), block_size=256), None),
                      (tiny(None), build_task(tiny(None)))):
        model, tok = build_policy(cfg, data)
        meta, meta_tok = build_policy(cfg, data, meta=True)
        assert all(p.is_meta for p in meta.parameters())
        assert spec(meta) == spec(model) and meta_tok.state() == tok.state()
        assert meta.tied_head() == model.tied_head()
        assert {k: v.shape for k, v in meta.state_dict().items()} == \
            {k: v.shape for k, v in model.state_dict().items()}
    # one of our checkpoints is read by every rank: never meta
    ckpt = tmp_path / "run"
    train(tiny(ckpt, mode="sft", sft_steps=2))
    cfg = tiny(None, init_from=str(list_checkpoints(ckpt / "sft")[-1]))
    meta, _ = build_policy(cfg, build_task(cfg), meta=True)
    assert not any(p.is_meta for p in meta.parameters())
