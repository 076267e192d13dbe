"""The Llama family (Llama 3.x, Qwen2, Qwen3, Mistral) in our Llama class, against
transformers as the oracle: tiny random models saved locally with save_pretrained (nothing
downloaded), 1-D parameters (norm weights, biases) randomised too so that none is trivially
ones or zeros."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from mini_grpo.checkpoint import CheckpointError  # noqa: E402
from mini_grpo.engines.base import pad_left  # noqa: E402
from mini_grpo.engines.native import generate  # noqa: E402
from mini_grpo.logprobs import completion_logprobs, widen_prompts  # noqa: E402
from mini_grpo.models import Llama, LlamaConfig, attention_mask, positions  # noqa: E402
from mini_grpo.models.hf import load_hf_model, save_hf  # noqa: E402

V = 100  # vocabulary; token 0 is the pad
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, initializer_range=0.1,
              rms_norm_eps=1e-5)
# name -> (config class, model class, what the member differs by)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(num_key_value_heads=2, rope_theta=50000.0, rope_scaling=dict(LLAMA3),
                   tie_word_embeddings=False)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                        tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_key_value_heads=2, rope_theta=20000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False)),
}


def randomise_1d(model):
    """Norm weights ~ N(1, 0.1), biases ~ N(0, 0.1): not the ones/zeros of a fresh init."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                torch.nn.init.normal_(p, 1.0 if "norm" in name else 0.0, 0.1)


def make_hf(name, seed=0):
    cfg_cls, model_cls, kw = CONFIGS[name]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **kw)
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(cfg).eval()
    randomise_1d(hf)
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (transformers model, its save_pretrained directory), built once per module.
    Tests that edit a directory copy it first."""
    models = {}

    def get(name):
        if name not in models:
            hf = make_hf(name)
            path = tmp_path_factory.mktemp(name) / "hf"
            hf.save_pretrained(path)
            models[name] = hf, path
        return models[name]
    return get


def copy(path, tmp_path, name="copy"):
    return shutil.copytree(path, tmp_path / name)


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return config


def ragged(B=3, T=12, pads=(0, 3, 7), seed=1):
    """Left-padded ids (B, T) with rows of different pad counts, and valid (B, T) bool."""
    idx = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))
    valid = torch.ones(B, T, dtype=torch.bool)
    for i, n in enumerate(pads):
        valid[i, :n] = False
    return idx.masked_fill(~valid, 0), valid


def full_pass(model, idx, valid):
    return model(idx, positions(valid), attention_mask(valid, idx.size(1)))


def hf_logits(hf, idx, valid):
    return hf(input_ids=idx, attention_mask=valid.long(), position_ids=positions(valid)).logits


def shared_batch(seed=2):
    """Two left-padded prompts, three completions (two of prompt 0), some tokens masked."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (6, 3)]
    pids, pmask = pad_left(prompts, 0)
    index = torch.tensor([0, 0, 1])
    comp = torch.randint(1, V, (3, 7), generator=g)
    cmask = torch.ones(3, 7, dtype=torch.bool)
    cmask[1, 5:] = False
    cmask[2, 3:] = False
    comp = comp.masked_fill(~cmask, 0)
    return pids, pmask, index, comp, cmask


def full_logprobs(logits_fn, pids, pmask, index, comp, cmask):
    """The completion log-probs from one plain pass over prompt + completion per row."""
    P = pids.size(1)
    seq = torch.cat([pids[index], comp], 1)
    valid = torch.cat([pmask[index], torch.ones_like(cmask)], 1)
    logits = logits_fn(seq, valid)[:, P - 1:-1]
    logp = F.log_softmax(logits.float(), -1).gather(-1, comp[..., None]).squeeze(-1)
    return logp.masked_fill(~cmask, 0.0)


NAMES = list(CONFIGS)


# 1. logits ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_on_a_left_padded_batch(saved, name):
    hf, path = saved(name)
    ours = load_hf_model(path).eval()
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert (ours.cfg.n_kv_head, ours.cfg.head_dim) == (c.num_key_value_heads, head_dim)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == c.tie_word_embeddings
    idx, valid = ragged()
    with torch.no_grad():
        want = hf_logits(hf, idx, valid)
        got = full_pass(ours, idx, valid)
    assert torch.isfinite(got).all()
    assert want[valid].std() > 0.3  # logits far from flat: the comparison means something
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-4)
    with torch.no_grad():  # unpadded, no mask: plain causal
        torch.testing.assert_close(ours(idx[:1]), hf(idx[:1]).logits, rtol=0, atol=1e-4)


# 2. KV cache -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_decoding_equals_the_full_pass(saved, name):
    ours = load_hf_model(saved(name)[1]).eval()
    idx, valid = ragged()
    B, T = idx.shape
    pos = positions(valid)
    with torch.no_grad():
        full = full_pass(ours, idx, valid)
        cache = ours.new_cache(B, T)
        steps = [ours(idx[:, :4], pos[:, :4], attention_mask(valid[:, :4], 4), cache)]
        for t in range(4, T):
            steps.append(ours(idx[:, t:t + 1], pos[:, t:t + 1],
                              attention_mask(valid[:, :t + 1], 1), cache))
    assert cache.len == T
    inc = torch.cat(steps, 1)
    torch.testing.assert_close(inc[valid], full[valid], rtol=0, atol=1e-5)


# 3. shared-prompt pass ---------------------------------------------------------------------

def check_shared_pass(ours, hf, hf_atol: float):
    """The shared-prompt pass over shared_batch() against one full pass per row (log-probs and
    every parameter's gradient, within 1e-5) and against transformers' own pass over prompt +
    completion (within `hf_atol`) -> (the shared pass's log-probs, the batch)."""
    batch = shared_batch()
    pids, pmask, index, comp, cmask = batch
    w = torch.randn(cmask.shape, generator=torch.Generator().manual_seed(3))
    runs = []
    for shared in (True, False):
        ours.zero_grad(set_to_none=True)
        if shared:
            lp = completion_logprobs(ours, pids, pmask, comp, cmask, prompt_index=index)
        else:
            lp = full_logprobs(lambda s, v: full_pass(ours, s, v), *batch)
        (lp * w).sum().backward()
        runs.append((lp.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}))
    (lp_s, g_s), (lp_f, g_f) = runs
    torch.testing.assert_close(lp_s, lp_f, rtol=0, atol=1e-5)
    assert (lp_s[~cmask] == 0).all()
    assert g_s.keys() == g_f.keys() and len(g_s) == len(list(ours.parameters()))
    for n in g_s:
        assert g_s[n].abs().max() > 0, n  # every parameter, biases and norms too, gets one
        torch.testing.assert_close(g_s[n], g_f[n], rtol=0, atol=1e-5, msg=n)
    with torch.no_grad():  # and transformers' own pass over prompt + completion
        want = full_logprobs(lambda s, v: hf_logits(hf, s, v), *batch)
    torch.testing.assert_close(lp_s, want, rtol=0, atol=hf_atol)
    return lp_s, batch


@pytest.mark.parametrize("name", NAMES)
def test_shared_prompt_pass_equals_full_pass_values_and_gradients(saved, name):
    hf, path = saved(name)
    ours = load_hf_model(path).eval()
    lp_s, (pids, pmask, index, comp, cmask) = check_shared_pass(ours, hf, hf_atol=1e-4)
    # prompts widened with hidden pads (as a GPU pass aligns them for a compiled model)
    wide_ids, wide_mask = widen_prompts(pids, pmask, pids.size(1) + 5)
    assert wide_ids.size(1) > pids.size(1)
    with torch.no_grad():
        lp_w = completion_logprobs(ours, wide_ids, wide_mask, comp, cmask, prompt_index=index)
    torch.testing.assert_close(lp_w, lp_s, rtol=0, atol=1e-5)


class OpNames(TorchDispatchMode):
    """The names of the ops that run (backward's too), for the test below."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["qwen2", "llama"])  # a tied head, an untied one
def test_a_tied_embedding_adds_its_rows_into_the_heads_gradient(saved, name, monkeypatch):
    # on a CPU the tied embedding's backward brings sparse rows, which autograd adds into the
    # head's dense (V, C) gradient, instead of a zero-filled (V, C) buffer of its own a call;
    # the gradient (over two micro-batches, as a policy pass accumulates it) is the same
    ours = load_hf_model(saved(name)[1])
    tied = ours.lm_head.weight is ours.embed_tokens.weight
    batch = shared_batch()
    pids, pmask, index, comp, cmask = batch
    w = torch.randn(cmask.shape, generator=torch.Generator().manual_seed(3))

    def grads():
        ours.zero_grad(set_to_none=True)
        with OpNames() as ops:
            for rows in (slice(0, 2), slice(2, 3)):
                lp = completion_logprobs(ours, pids, pmask, comp[rows], cmask[rows],
                                         prompt_index=index[rows])
                (lp * w[rows]).sum().backward()
        g = ours.embed_tokens.weight.grad
        assert g.layout == torch.strided and g.shape == (V, 64)  # dense, for AdamW and DDP
        return ops.names, {n: p.grad.clone() for n, p in ours.named_parameters()}

    ops, got = grads()
    assert ("embedding_dense_backward" in ops) != tied
    assert ("_sparse_coo_tensor_with_dims_and_tensors" in ops) == tied  # the rows
    with monkeypatch.context() as m:  # the plain lookup everywhere: a dense backward
        m.setattr(type(ours), "lookup", lambda self, emb, idx: emb(idx))
        ops, want = grads()
    assert "embedding_dense_backward" in ops
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=n)
    with torch.no_grad(), OpNames() as ops:  # and nothing sparse without a backward
        completion_logprobs(ours, pids, pmask, comp, cmask, prompt_index=index)
    assert not any("sparse" in n for n in ops.names)


# 4. greedy generation ----------------------------------------------------------------------

def hf_greedy(hf, prompts, n):
    ids, mask = pad_left(prompts, 0)
    out = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=0,
                      return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[:, ids.size(1):]
    logp = torch.stack(out.logits, 1).float().log_softmax(-1)
    return tokens, logp.gather(-1, tokens[..., None]).squeeze(-1)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(saved, name):
    hf, path = saved(name)
    hf.generation_config.eos_token_id = None  # run the full length on both sides
    ours = load_hf_model(path).eval()
    n = 8
    a = [5, 17, 42, 8, 9, 23]
    # one unpadded prompt; a batch left-padded to 6 that repeats a prompt (a GRPO group: the
    # prefill computes it once and copies its keys/values)
    for prompts in ([a], [a, [77], a, [31, 4, 60]]):
        r = generate(ours, prompts, n, eos_id=-1, pad_id=0, greedy=True)
        with torch.no_grad():
            want, want_lp = hf_greedy(hf, prompts, n)
        assert r.completion_ids.shape == (len(prompts), n) and r.completion_mask.all()
        assert r.completion_ids.tolist() == want.tolist(), prompts
        torch.testing.assert_close(r.logprobs, want_lp, rtol=0, atol=1e-4)


# 5. gradient checkpointing, manual attention -----------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_gradient_checkpointing_and_manual_attention_change_nothing(saved, name):
    ours = load_hf_model(saved(name)[1])
    idx, valid = ragged()
    pids, pmask, index, comp, cmask = shared_batch()
    g = torch.Generator().manual_seed(4)
    r = torch.randn(*idx.shape, V, generator=g)
    w = torch.randn(cmask.shape, generator=g)

    def loss():
        lp = completion_logprobs(ours, pids, pmask, comp, cmask, prompt_index=index)
        return (full_pass(ours, idx, valid)[valid] * r[valid]).sum() + (lp * w).sum()

    ours.train()  # dropout is 0: train() only switches checkpointing on
    grads = []
    for ckpt in (False, True):
        ours.zero_grad(set_to_none=True)
        ours.gradient_checkpointing = ckpt
        loss().backward()
        grads.append({n: p.grad.clone() for n, p in ours.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-6, msg=n)

    ours.gradient_checkpointing = False
    ours.eval()
    outs = []
    for impl in ("sdpa", "manual"):
        ours.attn_impl = impl
        with torch.no_grad():
            outs.append((full_pass(ours, idx, valid)[valid], ours(idx),
                         ours(comp, prefix=(pids, pmask, index))))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    ours.train()  # and manual attention's gradients (up to rounding: they reach ~100 here)
    ours.zero_grad(set_to_none=True)
    loss().backward()
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[0][n], rtol=1e-5, atol=1e-4, msg=n)


def test_a_layer_keeps_each_activation_once_for_its_backward(monkeypatch):
    """What a layer keeps for its backward under bf16 autocast, counted by storage in a
    shared-prompt pass of a grouped-query model: each norm's fp32 input but not its fp32
    output (RMSNormFn normalises again); one bf16 copy of each norm's output (q, k and v read
    the same one, gate and up too) and o_proj's input; gate and up but neither silu(gate)
    (SiluMul computes it again) nor their product (down_proj's backward does, from gate and
    up); keys and values at their nkv heads, never repeated for the query heads. The values
    are autograd's, and the gradients too."""
    from mini_grpo.models import llama

    L, nh, C, inner = 2, 6, 48, 96
    torch.manual_seed(0)
    m = Llama(LlamaConfig(vocab_size=64, block_size=64, n_layer=L, n_head=nh, n_kv_head=2,
                          n_embd=C, head_dim=8, n_inner=inner))
    m.attn_impl = "manual"
    U, P, B, N = 2, 5, 4, 4
    pids, pmask = torch.randint(1, 64, (U, P)), torch.ones(U, P, dtype=torch.bool)
    comp, index = torch.randint(1, 64, (B, N)), torch.tensor([0, 0, 1, 1])
    kept, seen = [], set()

    def pack(t):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            kept.append((t.dtype, tuple(t.shape)))
        return t
    recompute = llama.recompute

    def counted(a, gate, up):  # down_proj's hooks stand in for ours: count what they keep
        inner_pack, unpack = recompute(a, gate, up)
        return (lambda t: pack(p) if isinstance(p := inner_pack(t), torch.Tensor) else p,
                unpack)
    monkeypatch.setattr(llama, "recompute", counted)
    monkeypatch.setattr(llama, "saved_tensors_hooked", lambda: False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16):
        m(comp, prefix=(pids, pmask, index), hidden=True)
    T = U * P + B * (N - 1)  # the pass's token positions
    assert kept.count((torch.float32, (T, C))) == 2 * L
    assert kept.count((torch.bfloat16, (T, C))) == 3 * L
    assert kept.count((torch.bfloat16, (T, inner))) == 2 * L
    assert not [s for d, s in kept if len(s) == 3 and s[0] in (U * nh, B * nh)], kept

    def grads(recomputed):  # the whole model's, with down_proj's input kept or computed again
        monkeypatch.setattr(llama, "saved_tensors_hooked", lambda: not recomputed)
        m.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            h = m(comp, prefix=(pids, pmask, index), hidden=True)
        h.float().square().mean().backward()
        return [p.grad.to_dense() for p in m.parameters() if p.grad is not None]
    assert all(map(torch.equal, grads(True), grads(False)))

    for dtype in (torch.float32, torch.bfloat16):
        gate, up, w = (torch.randn(5, 7, dtype=dtype, requires_grad=True) for _ in range(3))
        (F.silu(gate) * up * w).sum().backward()
        want = [gate.grad, up.grad]
        gate.grad = up.grad = None
        (llama.SiluMul.apply(gate, up) * w).sum().backward()
        assert torch.equal(gate.grad, want[0]) and torch.equal(up.grad, want[1])
    for dtype, cast in ((torch.float32, None), (torch.float32, torch.bfloat16),
                        (torch.bfloat16, None)):  # the norm's gradients: autograd's, bit for bit
        x = torch.randn(3, 4, C, dtype=dtype, requires_grad=True)
        w = torch.randn(C, requires_grad=True)
        g = torch.randn(3, 4, C)
        outs = (llama.rms_norm(x, w, 1e-5, cast)[0], llama.RMSNormFn.apply(x, w, 1e-5, cast))
        got = [torch.autograd.grad((y * g.to(y.dtype)).sum(), (x, w)) for y in outs]
        assert torch.equal(outs[0], outs[1]) and all(map(torch.equal, *got))


# 6. rope settings matter -------------------------------------------------------------------

def test_rope_scaling_and_theta_matter(saved, tmp_path):
    """Dropping the llama3 scaling (or the rope_theta) changes the logits clearly, and
    transformers agrees with us on the unscaled model too: the parity test above would catch
    a loader that ignored either."""
    hf, path = saved("llama")
    ours = load_hf_model(path).eval()
    assert ours.cfg.rope_scaling == LLAMA3 and ours.cfg.rope_theta == 50000.0
    idx, valid = ragged()
    with torch.no_grad():
        base = full_pass(ours, idx, valid)[valid]
    for name, rope in (("unscaled", {"rope_type": "default", "rope_theta": 50000.0}),
                       ("theta", {**LLAMA3, "rope_theta": 10000.0})):
        other = copy(path, tmp_path, name)
        edit_config(other, rope_parameters=rope)
        mine = load_hf_model(other).eval()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(other).eval()
        with torch.no_grad():
            got = full_pass(mine, idx, valid)[valid]
            torch.testing.assert_close(got, hf_logits(theirs, idx, valid)[valid],
                                       rtol=0, atol=1e-4)
        assert (got - base).abs().max() > 0.01, name  # 100x the parity tolerance


def test_linear_rope_scaling_and_hub_style_config_are_read(saved, tmp_path):
    """The linear scaling is read from rope_parameters, and the hub's older spelling
    (top-level rope_theta + rope_scaling) gives the same model as transformers 5's."""
    _, path = saved("llama-bias")
    assert load_hf_model(path).cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    _, path = saved("llama")
    old = copy(path, tmp_path)
    config = json.loads((old / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (old / "config.json").write_text(json.dumps(config))
    a, b = load_hf_model(path).cfg, load_hf_model(old).cfg
    assert a == b and b.rope_theta == 50000.0 and b.rope_scaling == LLAMA3


# 7. bad inputs -----------------------------------------------------------------------------

def test_bad_configs_are_named(saved, tmp_path):
    _, path = saved("llama")
    d = copy(path, tmp_path)
    config = edit_config(d, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'gpt_neox' "
                                              r"\(GPTNeoXForCausalLM\) is not supported"):
        load_hf_model(d)
    config = {**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    bad = [({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            r"config.json: rope type 'yarn' is not supported"),
           ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
            r"config.json: low_freq_factor must be a number"),
           ({"hidden_act": "gelu"}, r"config.json: hidden_act 'gelu' is not supported"),
           ({"rope_theta": 10**65, "rope_parameters": None},  # float() of it: OverflowError
            r"config.json: rope_theta must be a number in \(0.0, 1e\+15\), got an integer"),
           ({"rope_theta": 10**400, "rope_parameters": None}, r"rope_theta must be a number"),
           ({"num_key_value_heads": 3}, r"num_attention_heads 4 is not a multiple of "
                                        r"num_key_value_heads 3"),
           ({"num_hidden_layers": 10**9}, r"says num_hidden_layers 1000000000, its weights "
                                          r"hold 2"),
           ({"hidden_size": 128}, r"says hidden_size 128, its weights hold 64"),
           ({"intermediate_size": 128}, r"mismatched weights: layers.0.mlp.gate_proj.weight"),
           ({"model_type": "mistral", "sliding_window": 4096},
            r"config.json: sliding-window attention is not supported")]
    for change, message in bad:
        (d / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=message):
            load_hf_model(d)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_sliding_window_qwen_is_refused(saved, tmp_path, name):
    d = copy(saved(name)[1], tmp_path)
    edit_config(d, use_sliding_window=True, sliding_window=8)
    with pytest.raises(CheckpointError, match=r"config.json: sliding-window attention is not "
                                              r"supported"):
        load_hf_model(d)


def test_bad_weights_are_named(saved, tmp_path):
    _, path = saved("llama")
    d = copy(path, tmp_path)
    file = d / "model.safetensors"
    state = load_file(file)

    def write(st):
        save_file(st, file, metadata={"format": "pt"})

    write({**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(80, 64)})
    with pytest.raises(CheckpointError, match=r"mismatched weights: layers.0.mlp.up_proj.weight "
                                              r"\(80, 64\) \(expected \(96, 64\)\)"):
        load_hf_model(d)
    write({k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(CheckpointError, match=r"missing weights: layers.1.self_attn.k_proj."
                                              r"weight"):
        load_hf_model(d)
    write({k: v for k, v in state.items() if k != "lm_head.weight"})  # untied: needed
    with pytest.raises(CheckpointError, match=r"missing weights: lm_head.weight"):
        load_hf_model(d)
    write({**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected weights: layers.0.mlp.extra.weight"):
        load_hf_model(d)
    write(state)
    assert load_hf_model(d).cfg.n_layer == 2  # and the untouched file loads


def test_sharded_checkpoint_and_a_missing_shard(saved, tmp_path):
    hf, _ = saved("qwen3")
    d = tmp_path / "sharded"
    hf.save_pretrained(d, max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (d / "model.safetensors").exists()
    ours = load_hf_model(d).eval()
    idx, valid = ragged()
    with torch.no_grad():
        torch.testing.assert_close(full_pass(ours, idx, valid)[valid],
                                   hf_logits(hf, idx, valid)[valid], rtol=0, atol=1e-4)
    (d / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json: lists "
                                              rf"{shards[1]}, which is not in"):
        load_hf_model(d)
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_model(d)


# 8. round trip -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_loaded_model_saved_back_loads_in_transformers(saved, tmp_path, name):
    hf, path = saved(name)
    ours = load_hf_model(path).eval()
    idx, valid = ragged()
    with torch.no_grad():
        want = full_pass(ours, idx, valid)[valid]
    for shard_bytes, sharded in ((None, False), (30_000, True)):
        out = tmp_path / f"out{shard_bytes}"
        save_hf(ours, out, **({"shard_bytes": shard_bytes} if shard_bytes else {}))
        assert (out / "model.safetensors.index.json").is_file() == sharded
        assert (out / "model.safetensors").is_file() != sharded
        if sharded:
            assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(theirs) is type(hf)
        again = load_hf_model(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf_logits(theirs, idx, valid)[valid], want,
                                       rtol=0, atol=1e-4)
            torch.testing.assert_close(full_pass(again, idx, valid)[valid], want,
                                       rtol=0, atol=0)
        assert (again.lm_head.weight is again.embed_tokens.weight) == (name == "qwen2")


@pytest.mark.parametrize("flavour", [
    dict(n_kv_head=2, head_dim=16, rope_theta=50000.0, rope_scaling=LLAMA3),  # llama
    dict(n_kv_head=2, head_dim=16, qkv_bias=True, tie_word_embeddings=True),  # qwen2
    dict(n_kv_head=1, head_dim=32, qk_norm=True),  # qwen3
    dict(n_kv_head=4, head_dim=16, qkv_bias=True, o_bias=True, mlp_bias=True,
         rope_scaling={"rope_type": "linear", "factor": 2.0}),  # llama with biases
])
def test_our_llama_from_scratch_saved_loads_in_transformers(tmp_path, flavour):
    """No config.json to copy: save_hf writes one from our config."""
    torch.manual_seed(0)
    ours = Llama(LlamaConfig(vocab_size=V, block_size=128, n_layer=2, n_head=4, n_embd=64,
                             n_inner=96, rms_norm_eps=1e-5, **flavour)).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.1)  # norms ~1, biases ~1: non-trivial
    path = save_hf(ours, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    idx, valid = ragged()
    with torch.no_grad():
        want = full_pass(ours, idx, valid)[valid]
        torch.testing.assert_close(hf_logits(theirs, idx, valid)[valid], want,
                                   rtol=0, atol=1e-4)
    again = load_hf_model(path)
    assert again.cfg == ours.cfg
    for (k, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("flavour", [
    dict(qkv_bias=True, mlp_bias=True),  # qwen2 has no MLP bias
    dict(qk_norm=True, mlp_bias=True),  # nor qwen3
    dict(o_bias=True),  # llama: one attention_bias for q, k, v and o
    dict(qk_norm=True, qkv_bias=True),  # qwen3 likewise
])
def test_a_model_no_hugging_face_type_can_describe_is_not_exported(tmp_path, flavour):
    ours = Llama(LlamaConfig(vocab_size=V, block_size=128, n_layer=1, n_head=4, n_kv_head=2,
                             n_embd=64, head_dim=16, n_inner=96, **flavour))
    with pytest.raises(ValueError, match="no Hugging Face model_type"):
        save_hf(ours, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
