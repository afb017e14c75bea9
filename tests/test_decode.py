"""gpt2.generate's fixed-shape decode step: bitwise equal to the generate it replaced (kept
below as a reference copy), no graph breaks, no host sync, no weight cast per step; and on a
GPU, the CUDA graph against eager (a subprocess: tests/conftest.py hides the GPUs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import gpt2
from tests.test_gpt2 import PAD, V, batch, tiny_model

ROOT = Path(__file__).resolve().parents[1]


# ---- The generate this step replaced (gpt2.py before issue 39), copied as it was
class LayerCache:
    """One layer's keys and values (2, B, H, max_len, hd), allocated in the compute dtype."""

    def __init__(self, max_len):
        self.max_len = max_len
        self.kv = None

    def update(self, k, v, pos):
        if self.kv is None:
            B, H, _, hd = k.shape
            self.kv = k.new_empty(2, B, H, self.max_len, hd)
        end = pos + k.size(2)
        self.kv[0, :, :, pos:end] = k
        self.kv[1, :, :, pos:end] = v
        return self.kv[0, :, :, :end], self.kv[1, :, :, :end]


def reference_linear(m, x):
    """Conv1D as it was: F.linear of the transposed weight."""
    return F.linear(x, m.weight.t(), m.bias)


def reference_block(block, x, attn_mask, kv_cache, pos):
    B, T, C = x.shape
    qkv = reference_linear(block.attn.c_attn, block.ln_1(x))
    q, k, v = qkv.split(C, dim=2)
    q = q.view(B, T, block.n_head, -1).transpose(1, 2)
    k = k.view(B, T, block.n_head, -1).transpose(1, 2)
    v = v.view(B, T, block.n_head, -1).transpose(1, 2)
    k, v = kv_cache.update(k, v, pos)
    with sdpa_kernel(gpt2.SDPA_BACKENDS):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=attn_mask is None)
    y = y.transpose(1, 2).reshape(B, T, C)
    x = x + reference_linear(block.attn.c_proj, y)
    h = F.gelu(reference_linear(block.mlp.c_fc, block.ln_2(x)), approximate="tanh")
    return x + reference_linear(block.mlp.c_proj, h)


def reference_forward(model, idx, attention_mask, kv_cache, keep_from):
    B, T = idx.shape
    pos = attention_mask.size(1) - T
    if pos == 0 and bool(attention_mask.all()):
        position_ids = torch.arange(T).expand(B, T)
        attn_mask = None
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        q_idx = torch.arange(pos, pos + T)[:, None]
        k_idx = torch.arange(pos + T)[None, :]
        real = attention_mask.bool()[:, None, None, :]
        attn_mask = ((k_idx <= q_idx) & real) | (k_idx == q_idx)
    x = model.transformer.wte(idx) + model.transformer.wpe(position_ids)
    for block, cache in zip(model.transformer.h, kv_cache):
        x = reference_block(block, x, attn_mask, cache, pos)
    x = model.transformer.ln_f(x[:, keep_from:].float())
    return F.linear(x, model.lm_head.weight[: model.n_logits])


@torch.no_grad()
def reference_generate(
    model, query, pad_token_id, max_new_tokens, eos_token_id, temperature, noise
):
    query = gpt2.trim_padding(query, None, pad_token_id)[0]
    B, Tq = query.shape
    total = Tq + max_new_tokens
    mask = F.pad(query != pad_token_id, (0, max_new_tokens), value=True)
    response = torch.full((B, max_new_tokens), pad_token_id, dtype=query.dtype)
    logprobs = torch.zeros(B, max_new_tokens)
    done = torch.zeros(B, dtype=torch.bool)
    kv_cache = [LayerCache(total) for _ in range(model.config.n_layer)]
    inputs = query
    for t in range(max_new_tokens):
        attention_mask = mask[:, : Tq + t]
        keep_from = inputs.size(1) - 1
        logits = reference_forward(model, inputs, attention_mask, kv_cache, keep_from)[:, -1]
        token = gpt2.sample_token(logits, noise[:, t], temperature)
        response[:, t] = torch.where(done, pad_token_id, token)
        logp = torch.log_softmax(logits.float() / (temperature or 1.0), -1)
        token_logp = logp.gather(-1, token[:, None]).squeeze(-1)
        logprobs[:, t] = token_logp.masked_fill(done, 0)
        if eos_token_id is not None:
            done |= token == eos_token_id
            if done.all():
                break
        inputs = token[:, None]
    stop = -1 if eos_token_id is None else eos_token_id
    mask = gpt2.response_mask(response, stop)
    return gpt2.Rollout(query=query, response=response, mask=mask, logprobs=logprobs)


# ---- Tests
def wide_model():
    """A 2-layer model with a 128-token context: caches of 64 and of 128 columns."""
    torch.manual_seed(1)
    cfg = gpt2.GPTConfig(block_size=128, vocab_size=V, n_layer=2, n_head=4, n_embd=64)
    model = gpt2.GPT(cfg).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(3.0)
    return model


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("shape", ["tiny", "wide"])
def test_generate_equals_the_replaced_generate_bitwise(shape, temperature):
    """fp32 CPU, left-padded prompts, a stop token that ends some rows mid-way: the same tokens,
    log-probs, masks and query, bit for bit, for the same uniforms."""
    model = tiny_model() if shape == "tiny" else wide_model()
    query = batch((5, 9, 3, 7, 1, 9))[1]
    n = 12 if shape == "tiny" else 60  # 9 + 60 = 69 columns: a cache of 128
    noise = torch.rand(len(query), n, generator=torch.Generator().manual_seed(3))
    free = reference_generate(model, query, PAD, n, None, temperature, noise)
    eos = int(free.response[0, 3])
    for stop in (None, eos):
        got = gpt2.generate(model, query, PAD, n, stop, temperature, noise)
        expected = reference_generate(model, query, PAD, n, stop, temperature, noise)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert got.response.dtype == expected.response.dtype
    assert 0 < got.mask.sum() < got.mask.numel()  # some rows stopped, some did not


def test_generate_equals_the_replaced_generate_at_the_benchmark_shape():
    """64 prompts of up to 16 tokens, 32 new ones (the speed figure's shape), unpadded too."""
    model = tiny_model()
    g = torch.Generator().manual_seed(4)
    query = torch.randint(0, PAD, (64, 16), generator=g)
    noise = torch.rand(64, 32, generator=g)
    for padded in (False, True):
        if padded:
            lengths = torch.randint(1, 17, (64, 1), generator=g)
            query = torch.where(torch.arange(16) >= 16 - lengths, query, PAD)
        got = gpt2.generate(model, query, PAD, 32, 7, 1.0, noise)
        expected = reference_generate(model, query, PAD, 32, 7, 1.0, noise)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("padded", [False, True])
def test_grouped_prefill_samples_what_the_ungrouped_one_does(padded):
    """Three prompts, four samples each: group_size=4 runs the prompt through the model for
    three rows, not twelve, and gives the same tokens and masks and the same log-probs to
    round-off (the GEMM's kernel may change with the row count)."""
    model = tiny_model()
    lengths = (5, 9, 3) if padded else (7, 7, 7)
    query = batch(lengths)[1].repeat_interleave(4, 0)  # (12, Tq)
    noise = torch.rand(12, 10, generator=torch.Generator().manual_seed(6))
    free = gpt2.generate(model, query, PAD, 10, None, 1.0, noise)
    eos = int(free.response[0, 3])
    rows = []
    hook = model.transformer.wte.register_forward_hook(lambda m, i, o: rows.append(len(i[0])))
    try:
        got = gpt2.generate(model, query, PAD, 10, eos, 1.0, noise, group_size=4)
    finally:
        hook.remove()
    expected = gpt2.generate(model, query, PAD, 10, eos, 1.0, noise)
    # The prefill, then the decode steps.
    assert rows[0] == 3 and set(rows[1:]) == {12}
    assert torch.equal(got.response, expected.response)
    assert torch.equal(got.mask, expected.mask)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=0, atol=1e-5)
    assert 0 < got.mask.sum() < got.mask.numel()  # some rows stopped, some did not


def test_grouped_prefill_refuses_rows_that_are_not_groups():
    model = tiny_model()
    query = batch((5, 9, 3))[1].repeat_interleave(2, 0)  # (6, Tq): groups of 2
    with pytest.raises(ValueError, match="group_size 3: the rows are not groups"):
        gpt2.generate(model, query, PAD, 4, group_size=3)
    with pytest.raises(ValueError, match="group_size 4: the rows are not groups"):
        gpt2.generate(model, query, PAD, 4, group_size=4)
    with pytest.raises(ValueError, match="group_size 0: must be >= 1"):
        gpt2.generate(model, query, PAD, 4, group_size=0)


def prefilled(model, query, n, temperature=1.0, top_k=0, top_p=1.0):
    """A Decoding after the prompt, as generate has it before the decode loop (full width)."""
    B, Tq = query.shape
    noise = torch.rand(B, n, generator=torch.Generator().manual_seed(5))
    s = gpt2.new_decoding(model, noise, 64, PAD, PAD, temperature, query.dtype, top_k, top_p)
    real = query != PAD
    s.real[:, :Tq] = real
    s.pos.copy_(real.sum(1, keepdim=True))
    s.col.fill_(Tq)
    s.noise.copy_(noise)
    with torch.no_grad():
        gpt2.sample(s, model(query, real, s.cache, keep_from=Tq - 1)[:, -1])
    s.cache.width = s.cache.size
    return s


def test_no_graph_breaks_in_the_training_forward_and_the_decode_step():
    """torch.compile(fullgraph=True) can take both: dynamo's explain finds one graph each;
    and the decode step with top-k and top-p too."""
    torch._dynamo.reset()
    model = tiny_model().train()
    query = batch()[1]
    explain = torch._dynamo.explain(model)(query, query != PAD)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    model.eval()
    for top_k, top_p in [(0, 1.0), (5, 0.8)]:
        s = prefilled(model, query, 8, top_k=top_k, top_p=top_p)
        with torch.no_grad():
            explain = torch._dynamo.explain(gpt2.decode_step)(model, s)
        assert explain.graph_break_count == 0, explain.break_reasons
        assert explain.graph_count == 1
    torch._dynamo.reset()


def test_sdpa_kernel_is_entered_once_per_forward(monkeypatch):
    """Each entry costs host time: once around the blocks, not once per block."""
    entries = []
    sdpa_kernel_of_torch = gpt2.sdpa_kernel

    def counted(backends):
        entries.append(backends)
        return sdpa_kernel_of_torch(backends)

    monkeypatch.setattr(gpt2, "sdpa_kernel", counted)
    model, query = tiny_model(), batch()[1]
    with torch.no_grad():
        model(query, query != PAD)
        assert len(entries) == 1
        gpt2.generate(model, query, PAD, 5, temperature=0.0)
    assert len(entries) == 1 + 5  # the prefill and 4 decode steps


class Ops(TorchDispatchMode):
    """The aten ops run, with the data pointers of _to_copy's inputs."""

    def __init__(self):
        super().__init__()
        self.names = []
        self.copied = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        if func.overloadpacket is torch.ops.aten._to_copy:
            self.copied.append(args[0].data_ptr())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 0.8)])
def test_the_decode_step_never_syncs_with_the_host(top_k, top_p):
    model, query = tiny_model(), batch()[1]
    s = prefilled(model, query, 8, top_k=top_k, top_p=top_p)
    with torch.no_grad(), Ops() as ops:
        for _ in range(4):
            gpt2.decode_step(model, s)
    syncs = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}
    assert not syncs & set(ops.names)
    assert s.t.item() == 5 and s.col.item() == query.size(1) + 4


@pytest.mark.parametrize("n", [2, 10])
def test_autocast_casts_each_weight_once_per_generate(n):
    """The weights enter the GEMMs as leaves, so CPU autocast casts each once per call, however
    many tokens are sampled (F.linear of w.t() cast every GEMM's weight at every step)."""
    model, query = tiny_model(), batch()[1]
    weights = {p.data_ptr() for p in model.parameters()}
    gemm_weights = [m.weight for m in model.modules() if isinstance(m, gpt2.Conv1D)]
    with torch.autocast("cpu", torch.bfloat16), Ops() as ops:
        gpt2.generate(model, query, PAD, n, temperature=0.0)
    weight_casts = [p for p in ops.copied if p in weights]
    assert len(weight_casts) == len(set(weight_casts))
    assert {w.data_ptr() for w in gemm_weights} <= set(weight_casts)


def test_cuda_graph_equals_eager_and_follows_optimizer_steps():
    """On a GPU (skipped without): the captured step replays eager's bits, with a stop token
    mid-way, from the cache at a second call, and after an optimizer step changed the weights;
    with top-k and top-p, from a capture of its own; with a grouped prefill."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    devices = os.environ.get("RLHF_TEST_CUDA_VISIBLE_DEVICES", "all")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if devices != "all":
        env["CUDA_VISIBLE_DEVICES"] = devices
    probe = "import torch; print(torch.cuda.is_available())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if out.stdout.strip() != "True":
        pytest.skip("no CUDA device")
    p = subprocess.run(
        [sys.executable, "-c", CUDA_CHECK], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "graph == eager" in p.stdout


CUDA_CHECK = """
import torch
import gpt2

PAD = 256
torch.manual_seed(0)
model = gpt2.load("tiny", dict(vocab_size=257, eos_token_id=PAD, pad_token_id=PAD)).cuda()
lengths = torch.randint(1, 17, (64, 1), device="cuda")
query = torch.randint(0, PAD, (64, 16), device="cuda")
query = torch.where(torch.arange(16, device="cuda") >= 16 - lengths, query, PAD)
noise = torch.rand(64, 32, device="cuda")


def both(eos, dtype, top_k=0, top_p=1.0, group_size=1):
    sampler = dict(top_k=top_k, top_p=top_p, group_size=group_size)
    # group_size > 1: every group_size-th prompt, repeated
    q = query[::group_size].repeat_interleave(group_size, 0)
    with torch.autocast("cuda", dtype, enabled=dtype is not None):
        eager = gpt2.generate(model, q, PAD, 32, eos, 0.7, noise, cuda_graph=False, **sampler)
        graph = gpt2.generate(model, q, PAD, 32, eos, 0.7, noise, cuda_graph=True, **sampler)
    for a, b in zip(eager, graph):
        assert torch.equal(a, b), (eos, dtype, top_k, top_p, group_size)
    return graph


for dtype in (None, torch.bfloat16):
    first = both(None, dtype)
    eos = int(first.response[0, 3])
    stopped = both(eos, dtype)
    assert 0 < stopped.mask.sum() < stopped.mask.numel()
    again = both(eos, dtype)
    assert torch.equal(again.response, stopped.response)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(query).float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    moved = both(eos, dtype)
    assert not torch.equal(moved.logprobs, stopped.logprobs)
    # top-k and top-p: a capture of their own (the settings are in its key), eager's bits, and
    # other samples than the unfiltered graph's.
    nucleus = both(eos, dtype, top_k=50, top_p=0.8)
    assert not torch.equal(nucleus.logprobs, moved.logprobs)
    assert torch.equal(both(eos, dtype).logprobs, moved.logprobs)
    # A grouped prefill copies its keys and values into the captured cache.
    both(eos, dtype, group_size=4)
graphs = gpt2.GRAPHS[model]
print(len(graphs), "captures")
print("graph == eager")
"""
