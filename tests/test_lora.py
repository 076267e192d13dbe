"""LoRA (mini_grpo/lora.py) on tiny models: exact at init, only adapters train, the base
with adapters off, merge, PEFT-format files in and out, bad input named."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, clean_env, entry, tiny, tiny_gpt, tiny_lm_dir, torchrun

from mini_grpo.checkpoint import FORMAT, VERSION, list_checkpoints, load_checkpoint
from mini_grpo.job import train
from mini_grpo.lora import (
    DEFAULT_TARGETS,
    LoRAFacts,
    adapter_keys,
    adapters_disabled,
    apply_lora,
    load_adapter,
    lora_modules,
    merged_state_dict,
    save_adapter,
    store_base_in,
)
from mini_grpo.models import Llama, LlamaConfig
from mini_grpo.models.hf import load_hf_model, save_hf
from mini_grpo.optim import make_optimizer

IDS = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 9, 10, 11, 3, 4]])


def tiny_llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                             n_embd=64, n_inner=96, head_dim=16, qkv_bias=True))


MODELS = {"llama": tiny_llama, "gpt": lambda: tiny_gpt(vocab_size=32)}


def logits(m):
    with torch.no_grad():
        return m(IDS)


def train_step(m, lr=1e-2):
    opt = make_optimizer(m, lr)
    loss = m(IDS).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", MODELS)
def test_lora_is_exact_at_init_and_trains_only_its_adapters(family):
    base = MODELS[family]()
    m = copy.deepcopy(base)
    names = apply_lora(m, r=4, alpha=8)
    assert names and all(n.rsplit(".", 1)[-1] in
                         {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj", "c_attn", "c_proj", "c_fc"} for n in names)
    assert torch.equal(logits(m), logits(base))  # B = 0: the base model exactly
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    train_step(m)
    after = m.state_dict()
    for k, v in before.items():
        if ".lora_" not in k:
            assert torch.equal(after[k], v), k  # every base weight bit-identical
    assert any(not torch.equal(after[k], before[k]) for k in adapter_keys(m.state_dict()))
    assert not torch.allclose(logits(m), logits(base))
    with adapters_disabled(m):  # the reference policy: the base, after training too
        assert torch.equal(logits(m), logits(base))
    assert not torch.allclose(logits(m), logits(base))  # on again on exit


@pytest.mark.parametrize("family", MODELS)
def test_merged_weights_load_into_a_plain_model(family):
    m = MODELS[family]()
    apply_lora(m, r=4, alpha=8)
    train_step(m)
    live = {k: v.clone() for k, v in m.state_dict().items()}
    plain = MODELS[family]()
    plain.load_state_dict(merged_state_dict(m))
    torch.testing.assert_close(logits(plain), logits(m), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in live.items())  # unchanged


@pytest.mark.parametrize("family", MODELS)
def test_a_saved_adapter_loads_onto_its_base_in_peft_format(family, tmp_path):
    base = MODELS[family]()
    m = copy.deepcopy(base)
    apply_lora(m, r=4, alpha=8)
    train_step(m)
    save_adapter(m, tmp_path / "adapter", base_model="some/base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == \
        ("LORA", 4, 8.0, "CAUSAL_LM")
    assert config["fan_in_fan_out"] == (family == "gpt")
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    if family == "llama":
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
        assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    else:
        assert "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" in keys
        assert "base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight" in keys
    fresh = copy.deepcopy(base)
    load_adapter(fresh, tmp_path / "adapter")
    assert torch.equal(logits(fresh), logits(m))


def test_bad_options_and_adapters_for_another_base_are_named(tmp_path):
    with pytest.raises(ValueError, match="lora_target_modules: no module named 'qkv'"):
        apply_lora(tiny_llama(), r=4, alpha=8, targets=["qkv"])
    with pytest.raises(ValueError, match="lora_r: 65 is larger than"):
        apply_lora(tiny_llama(), r=65, alpha=8)
    with pytest.raises(ValueError, match="lora_r: must be a positive integer"):
        apply_lora(tiny_llama(), r=0, alpha=8)
    m = tiny_llama()
    apply_lora(m, r=4, alpha=8)
    save_adapter(m, tmp_path / "a")
    wider = Llama(LlamaConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                              n_embd=128, n_inner=96, head_dim=32, qkv_bias=True))
    with pytest.raises(ValueError, match="q_proj.lora_A.weight has shape"):
        load_adapter(wider, tmp_path / "a")
    deeper = Llama(LlamaConfig(vocab_size=32, block_size=64, n_layer=3, n_head=4, n_kv_head=2,
                               n_embd=64, n_inner=96, head_dim=16, qkv_bias=True))
    with pytest.raises(ValueError, match="missing base_model.model.model.layers.2"):
        load_adapter(deeper, tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text('{"r": -1}')
    with pytest.raises(ValueError, match="adapter_config.json: r must be a positive integer"):
        load_adapter(tiny_llama(), tmp_path / "a")


def test_a_base_kept_in_bf16_changes_nothing_under_bf16_autocast():
    m = tiny_llama()
    apply_lora(m, r=4, alpha=8)
    train_step(m)  # B != 0
    half = copy.deepcopy(m)
    store_base_in(half, torch.bfloat16)
    assert {x.weight.dtype for x in lora_modules(half).values()} == {torch.bfloat16}
    outs, grads = [], []
    for model in (m, half):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(IDS).float()
        out.logsumexp(-1).mean().backward()
        outs.append(out.detach())
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    assert torch.equal(outs[0], outs[1])  # autocast rounds the fp32 base the same way
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    torch.testing.assert_close(logits(half), logits(m), atol=2e-2, rtol=0)  # fp32, no autocast
    w = merged_state_dict(half)["layers.0.self_attn.q_proj.weight"]
    assert w.dtype == torch.float32  # the merge keeps the adapters' precision


# ---- against peft (the oracle), on Hugging Face models built here ----

@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    return {t: tiny_lm_dir(root / t, model_type=t) for t in ("qwen2", "llama", "gpt2",
                                                              "gemma3_text")}


# per family: a layer the merged export holds, and a subset of layers for peft's own adapter
LAYERS = {"qwen2": ("model.layers.1.mlp.down_proj.weight", ["down_proj", "q_proj", "v_proj"]),
          "llama": ("model.layers.1.mlp.down_proj.weight", ["down_proj", "q_proj", "v_proj"]),
          "gpt2": ("transformer.h.1.mlp.c_fc.weight", ["c_attn", "c_fc"]),
          "gemma3_text": ("model.layers.1.mlp.down_proj.weight", ["down_proj", "o_proj", "q_proj"])}


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "gpt2", "gemma3_text"])
def test_peft_reads_our_adapter_merges_as_we_do_and_we_read_its(lm_dirs, model_type, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    d = lm_dirs[model_type]

    def theirs():
        return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

    ours = load_hf_model(d).eval()
    apply_lora(ours, r=4, alpha=8)
    train_step(ours)  # B != 0: the adapters change the logits
    save_adapter(ours, tmp_path / "ours", base_model=str(d))
    pm = peft.PeftModel.from_pretrained(theirs(), tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(IDS).logits, logits(ours), atol=1e-4, rtol=0)
    # our merged export: the weights of peft's merge_and_unload
    save_hf(ours, tmp_path / "hf", state=merged_state_dict(ours))
    merged = load_file(str(tmp_path / "hf" / "model.safetensors"))
    unloaded = pm.merge_and_unload().state_dict()
    layer, targets = LAYERS[model_type]
    assert layer in merged
    for k, v in merged.items():  # GPT-2's Conv1D weights: both (in, out)
        torch.testing.assert_close(v, unloaded[k], atol=1e-6, rtol=0, msg=k)
    # an adapter peft made (random A and B, some of the layers) loads onto our model
    made = peft.get_peft_model(theirs(), peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False,
        fan_in_fan_out=model_type == "gpt2")).eval()
    made.save_pretrained(tmp_path / "theirs")
    mine = load_hf_model(d).eval()
    load_adapter(mine, tmp_path / "theirs")
    assert sorted({n.rsplit(".", 1)[-1] for n in lora_modules(mine)}) == targets
    with torch.no_grad():
        torch.testing.assert_close(logits(mine), made(IDS).logits, atol=1e-4, rtol=0)
        assert not torch.allclose(logits(mine), theirs()(IDS).logits, atol=1e-3)


def test_the_reference_is_the_base_with_its_adapters_off():
    from ddp_grad_worker import make_batch

    from mini_grpo.config import load_config
    from mini_grpo.reference import AdaptersOff, Reference
    from mini_grpo.trajectory import Trajectory

    base = tiny_llama()
    m = copy.deepcopy(base)
    apply_lora(m, r=4, alpha=8, dropout=0.1)
    train_step(m)
    m.train()  # the reference pass runs without dropout whatever the policy's mode
    r, rewards, _ = make_batch(seed=0)
    cfg = load_config(None, {"group_size": 4, "micro_batch_size": 8, "temperature": 1.0},
                      env={})
    for mb in Trajectory.of(r, rewards, cfg).micro_batches():
        ref = AdaptersOff(m).logprobs(mb)
        assert torch.equal(ref, Reference(base, torch.device("cpu")).logprobs(mb))
        assert not torch.allclose(ref, mb.logprobs(m.eval()))  # the policy differs
        m.train()
    assert m.training


# ---- in training: GRPO (and SFT) with lora_r ----

def lora_run(out, lm, **kw):
    return tiny(out, init_from=str(lm), lora_r=4, lora_alpha=8, lr=1e-2, max_steps=3,
                save_every=1, block_size=256, max_new_tokens=16, eval_every=100, **kw)


def test_grpo_with_lora_saves_adapters_alone_resumes_exactly_and_exports_both(
        lm_dirs, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    lm = lm_dirs["qwen2"]
    straight = lora_run(tmp_path / "a", lm, mode="sft_grpo", sft_steps=2)
    train(straight)
    assert "MiB frozen: LoRA's base" in capsys.readouterr().out
    resumed = lora_run(tmp_path / "b", lm, mode="sft_grpo", sft_steps=2)
    train(resumed)
    ckpts = list_checkpoints(tmp_path / "b" / "checkpoints")
    ckpts[-1].unlink()  # as if killed after step 2's checkpoint
    train(resumed)  # the SFT stage is reused, GRPO resumes at step 3
    a, b = (load_checkpoint(tmp_path / x / "checkpoints" / "step_0000003.pt") for x in "ab")
    assert a["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0,
                         "targets": DEFAULT_TARGETS["llama"]}
    assert a["model"] and all(".lora_" in k for k in a["model"])  # the adapters alone
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(x["exp_avg"], y["exp_avg"])
    # hf/ is the merged model, adapter/ what peft loads onto the base: the same logits
    out = tmp_path / "a"
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(lm).eval()
    with torch.no_grad():
        want = merged(IDS).logits
        assert not torch.allclose(want, base(IDS).logits, atol=1e-3)  # it trained
        pm = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
        torch.testing.assert_close(pm(IDS).logits, want, atol=1e-4, rtol=0)
    # the base itself never moved: every weight no adapter touches is the base's exactly
    untouched = [k for k in merged.state_dict() if not k.endswith(
        tuple(f"{t}.weight" for t in DEFAULT_TARGETS["llama"]))]
    assert "model.norm.weight" in untouched
    plain = transformers.AutoModelForCausalLM.from_pretrained(lm).state_dict()  # peft took base
    for k in untouched:
        assert torch.equal(merged.state_dict()[k], plain[k]), k
    # mini-grpo export --adapter: the checkpoint's adapter alone, as the run wrote it
    r = subprocess.run([sys.executable, "-m", "mini_grpo", "export", "--checkpoint",
                        str(out / "checkpoints" / "step_0000003.pt"), "--output",
                        str(tmp_path / "exported"), "--adapter"], capture_output=True,
                       text=True, cwd=ROOT, env=clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    ours, again = (load_file(str(p / "adapter_model.safetensors"))
                   for p in (out / "adapter", tmp_path / "exported"))
    assert ours.keys() == again.keys() and all(torch.equal(ours[k], again[k]) for k in ours)


def test_a_lora_checkpoint_refuses_a_base_whose_weights_changed(lm_dirs, tmp_path):
    """The adapters alone are saved: resume, sample, evaluate and export read the base from
    init_from again, and refuse it once its weights are not those the adapters learnt on."""
    import shutil

    from mini_grpo.checkpoint import CheckpointError
    from mini_grpo.policy import build_policy, checkpoint_config

    lm = tmp_path / "base"
    shutil.copytree(lm_dirs["llama"], lm)
    cfg = lora_run(tmp_path / "run", lm, mode="grpo")
    cfg.max_steps = 1
    train(cfg)
    ckpt = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    state, saved = checkpoint_config(str(ckpt), {})
    assert isinstance(state["base"], str)
    build_policy(saved, None, checkpoint=state)  # the same base: fine
    from safetensors.torch import load_file, save_file
    weights = load_file(str(lm / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"] *= 1.01  # the same shapes, trained further
    save_file(weights, str(lm / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"another base than what init_from {lm}"):
        build_policy(saved, None, checkpoint=state)
    with pytest.raises(CheckpointError, match="another base"):
        train(lora_run(tmp_path / "run", lm, mode="grpo"))  # resumes from step 1


def test_a_run_continues_from_an_adapter(lm_dirs, tmp_path):
    lm = lm_dirs["qwen2"]
    m = load_hf_model(lm)
    apply_lora(m, r=4, alpha=8)
    train_step(m)
    save_adapter(m, tmp_path / "adapter")
    from mini_grpo.policy import build_policy
    cfg = tiny(tmp_path / "run", init_from=str(lm), adapter=str(tmp_path / "adapter"),
               block_size=256)
    model, _ = build_policy(cfg, None)
    assert LoRAFacts.of(model).r == 4 and torch.equal(logits(model), logits(m))


def test_bad_lora_options_are_one_line_and_exit_2(lm_dirs, tmp_path):
    from mini_grpo.config import ConfigError
    from mini_grpo.policy import build_policy

    lm = lm_dirs["llama"]
    r = entry("--config", "tiny", "--mode=grpo", f"--init_from={lm}", "--lora_r=4",
              "--block_size=256", "--lora_target_modules=[q_proj, qkv]",
              f"--out_dir={tmp_path / 'x'}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "lora_target_modules: no module named 'qkv' in this llama model" in r.stderr

    def policy(**kw):
        return build_policy(tiny(tmp_path / "y", init_from=str(lm), block_size=256, **kw), None)
    with pytest.raises(ConfigError, match="lora_r: 97 is larger than"):
        policy(lora_r=97)  # the MLP's 96 is the smallest side
    with pytest.raises(ConfigError, match="lora_target_modules: the LM head"):
        policy(lora_r=4, lora_target_modules="[lm_head]")
    with pytest.raises(ConfigError, match="lora_r: LoRA adapts a pretrained model"):
        tiny(tmp_path / "z", lora_r=4)
    wider = Llama(LlamaConfig(vocab_size=300, block_size=512, n_layer=2, n_head=4,
                              n_kv_head=2, n_embd=128, n_inner=96, head_dim=32))
    apply_lora(wider, r=4, alpha=8)  # an adapter for a wider base, under the same names
    save_adapter(wider, tmp_path / "other")
    with pytest.raises(ConfigError, match="adapter_model.safetensors: .*lora_A.weight has "
                                          "shape"):
        policy(adapter=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="lora_r: 8, but the adapter"):
        policy(adapter=str(tmp_path / "other"), lora_r=8)


def test_lora_under_fsdp_saves_adapter_shards_that_resume_in_one_process(lm_dirs, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    args = ["distributed_train.py", "--config", "tiny", "--mode=grpo", "--use_amp=false",
            "--reward_executor=serial", "--parallelism=fsdp", f"--init_from={lm_dirs['llama']}",
            "--lora_r=4", "--lr=1e-2", "--block_size=256", "--max_new_tokens=16",
            "--save_every=1", f"--out_dir={out}"]
    r = torchrun(*args, "--max_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MiB frozen: LoRA's base" in r.stdout
    ckpt = out / "checkpoints" / "step_0000002.dcp"
    from mini_grpo.dcp_index import sharded_shapes
    assert all(".lora_" in k for k in sharded_shapes(ckpt))  # the adapters' shards alone
    r = subprocess.run([sys.executable, *args, "--max_steps=3"], cwd=ROOT, capture_output=True,
                       text=True, env=clean_env(), timeout=300)  # 2 ranks -> 1 process
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming GRPO from step 2" in r.stdout
    if torch.cuda.is_available():  # the 2 ranks ran on the CPU (more ranks than GPUs)
        assert "the sampling generator (written on cpu, resumed on cuda)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mini_grpo", "export", "--checkpoint", str(ckpt),
                        "--output", str(tmp_path / "a2"), "--adapter"], cwd=ROOT,
                       capture_output=True, text=True, env=clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    step2 = load_file(str(tmp_path / "a2" / "adapter_model.safetensors"))
    final = load_file(str(out / "adapter" / "adapter_model.safetensors"))  # after step 3
    assert step2.keys() == final.keys()
    assert any(not torch.equal(step2[k], final[k]) for k in final)  # step 3 trained on


@pytest.mark.parametrize("key, value", [
    ("use_rslora", True), ("use_dora", True), ("alpha_pattern", {"q_proj": 64}),
    ("rank_pattern", {"q_proj": 8}), ("layers_to_transform", [0]),
    ("modules_to_save", ["lm_head"]), ("bias", "all"), ("lora_bias", True),
    ("layer_replication", [[0, 1]]), ("target_parameters", ["mlp.experts.gate_up_proj"]),
    ("fan_in_fan_out", True)])
def test_adapter_options_we_do_not_implement_are_refused_naming_the_key(tmp_path, key, value):
    """peft computes something else under each (rsLoRA's alpha / sqrt(r), DoRA's magnitude,
    per-module ranks and alphas, bias terms ...): loading it as plain LoRA would give other
    logits without a word. Values that leave plain LoRA (peft writes them all) load."""
    m = tiny_llama()
    apply_lora(m, r=4, alpha=8)
    save_adapter(m, tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "use_rslora": False, "alpha_pattern": {},
                                "modules_to_save": None, "bias": "none"}))
    load_adapter(tiny_llama(), tmp_path / "a")
    path.write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=f"adapter_config.json: {key} .* is not supported"
                       if key != "fan_in_fan_out" else "fan_in_fan_out True does not fit"):
        load_adapter(tiny_llama(), tmp_path / "a")


def test_policy_source_and_lora_facts(lm_dirs, tmp_path):
    """Where the weights come from is one value (PolicySource), and a LoRA policy's facts
    are read off its layers (LoRAFacts), not stored on the model."""
    from conftest import tiny

    from mini_grpo.checkpoint import CheckpointError
    from mini_grpo.policy import PolicySource, build_policy
    from mini_grpo.tasks import build_task

    lm = str(lm_dirs["qwen2"])
    scratch = PolicySource.of(tiny(None))
    assert (scratch.kind, scratch.state, scratch.adapters) == ("scratch", None, None)
    hf = PolicySource.of(tiny(None, init_from=lm, block_size=256))
    assert (hf.kind, hf.path) == ("hf", lm) and hf.from_rank0
    assert PolicySource.of(tiny(None, init_from=str(tmp_path / "m.gguf"))).kind == "gguf"
    ours = {"model": {}, "config": {}}
    given = PolicySource.of(tiny(None), ours)  # a command's checkpoint: its own weights
    assert given.kind == "checkpoint" and given.state is ours and not given.from_rank0
    adapters = {"model": {}, "lora": {"r": 4}}  # a LoRA checkpoint: on init_from's base
    on_base = PolicySource.of(tiny(None, init_from=lm, block_size=256), adapters)
    assert on_base.kind == "hf" and on_base.adapters is adapters and on_base.state is None
    torch.save({"lora": {"r": 4}, "model": {}, "format": FORMAT, "version": VERSION},
               tmp_path / "lora.pt")
    with pytest.raises(CheckpointError, match="holds its adapters alone"):
        PolicySource.of(tiny(None, init_from=str(tmp_path / "lora.pt")))

    cfg = tiny(None, init_from=lm, block_size=256, lora_r=4, lora_alpha=8,
               lora_target_modules=["v_proj", "q_proj"])
    model, _ = build_policy(cfg, None)
    assert not hasattr(model, "lora") and not hasattr(model, "lora_base")
    facts = LoRAFacts.of(model)
    assert (facts.r, facts.alpha, facts.targets) == (4, 8.0, ("q_proj", "v_proj"))
    assert facts.same_options({"r": 4, "alpha": 8.0, "dropout": 0.0,
                               "targets": ["v_proj", "q_proj"]})  # as the config listed them
    assert not facts.same_options({"r": 8, "alpha": 8.0, "dropout": 0.0,
                                   "targets": ["q_proj", "v_proj"]})
    plain, _ = build_policy(tiny(None), build_task(tiny(None)))
    assert LoRAFacts.of(plain) is None
