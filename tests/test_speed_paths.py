"""gpt2.py's speed paths for GPUs, checked on CPU: the mixed LM head, the log-prob chunks that
CUDA compiles, and padded rows rolled for the causal kernel; then the same on a GPU, if any."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import gpt2
from tests.test_gpt2 import PAD, V, batch, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mixed_head_is_its_formula_padded_and_sliced():
    """GPT2_HEAD=mixed's Function, with the CPU's fp32 stand-in for CUDA's mm(out_dtype=): logits
    within bf16 operand rounding of the fp32 head's, and exactly the product of the rounded
    operands; gradients those autograd gives for that product and a bf16 gradient, with the zero
    rows that pad the vocabulary (257 -> 384) sliced off."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 16, generator=g).requires_grad_()
    w = torch.randn(V, 16, generator=g).requires_grad_()
    logits = gpt2.MixedHead.apply(x.flatten(0, 1), w).view(6, 5, V)
    assert logits.dtype == torch.float32
    # Each operand is rounded to 8 significant bits: a relative error of at most 2^-8 each.
    bound = x.abs() @ w.abs().t() * 2**-7
    assert ((logits - x @ w.t()).abs() <= bound).all()
    x_bf16 = x.detach().bfloat16().float().requires_grad_()
    w_bf16 = w.detach().bfloat16().float().requires_grad_()
    expected = x_bf16 @ w_bf16.t()
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-6)
    grad = torch.randn(6, 5, V, generator=g).bfloat16().float()
    gx, gw = torch.autograd.grad(logits, (x, w), grad)
    ex, ew = torch.autograd.grad(expected, (x_bf16, w_bf16), grad)
    assert gx.shape == x.shape and gw.shape == w.shape
    torch.testing.assert_close(gx, ex, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(gw, ew, atol=1e-5, rtol=1e-6)
    # Only the input's gradient: no weight GEMM.
    (gx_only,) = torch.autograd.grad(gpt2.MixedHead.apply(x[0], w.detach()), x, grad[0])
    torch.testing.assert_close(gx_only[0], ex[0], atol=1e-5, rtol=1e-6)


def test_mixed_head_is_the_fp32_head_on_cpu():
    """The mixed head is for CUDA's bf16 autocast: on CPU, fp32 or autocast, the same bits."""
    model, query = tiny_model(), batch()[1]
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
            model.mixed_head = False
            fp32 = model(query, query != PAD)
            model.mixed_head = True
            assert torch.equal(model(query, query != PAD), fp32)


def test_head_env_vars(monkeypatch):
    """GPT2_HEAD picks the head when a model is built; GPT2_FP32_HEAD=0 is the earlier name of
    GPT2_HEAD=bf16; a bad name is one line there. Importing gpt2 reads no setting."""
    for key in ("GPT2_HEAD", "GPT2_FP32_HEAD"):
        monkeypatch.delenv(key, raising=False)
    cfg = gpt2.GPTConfig(**gpt2.PRESETS["tiny"], vocab_size=8)
    heads = []
    for env in ({}, {"GPT2_HEAD": "mixed"}, {"GPT2_FP32_HEAD": "0"}):
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            model = gpt2.GPT(cfg)
        scalar = gpt2.ScalarModel(model)
        assert scalar.fp32_head == model.fp32_head
        heads.append((model.fp32_head, model.mixed_head))
    assert heads == [(True, False), (True, True), (False, False)]
    monkeypatch.setenv("GPT2_HEAD", "tf32")
    with pytest.raises(gpt2.RunError) as error:
        gpt2.GPT(cfg)
    assert str(error.value) == "GPT2_HEAD=tf32: expected fp32, mixed or bf16"
    # A bad setting does not stop the import: only a model built under it.
    env = dict(os.environ, GPT2_HEAD="tf32", GPT2_ROLL_PADDING="x", GPT2_CPU_GEMM="x")
    script = "import gpt2; print('imported')"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.stdout.strip() == "imported", out.stderr


def test_log_prob_chunks_compile_whole():
    """The chunk functions CUDA compiles make one graph each, with no break."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, V, generator=g)
    y = torch.randint(0, V, (3,), generator=g)
    weights = torch.randn(3, 1, generator=g)
    for entropy in (None, weights):
        explain = torch._dynamo.explain(gpt2.chunk_grad)(x, y, 0.7, weights, entropy)
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        explain = torch._dynamo.explain(gpt2.chunk_logprobs)(x, y, 0.7, entropy is not None)
        assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_rolled_rows_give_the_masked_logits_and_gradients(monkeypatch):
    """Left-padded queries and responses padded after their stop, rolled so that every pad
    trails (roll_padding), on the causal kernel with no mask: the masked path's log-probs, real
    tokens' logits and gradients, up to rounding (attention sums the keys at other offsets, the
    weight gradients the rows in another order). A pad inside a query keeps the mask."""
    model, query = tiny_model().train(), torch.cat([torch.full((4, 2), PAD), batch()[1]], 1)
    response = torch.tensor([[7, PAD, 5, 5, 5], [1, 2, 3, PAD, 5], [4, 4, PAD, 5, 5]])
    response = torch.cat([response, torch.tensor([[9, 8, 7, 6, 5]])])  # no stop
    weights = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    masks = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, mask, **kw):
        masks.append(mask)
        return sdpa(q, k, v, mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    out = {}
    for devices in (["cuda"], ["cpu"]):
        model.roll_padding = devices
        masks.clear()
        logprobs, entropy = gpt2.logprobs(model, query, response, entropy=True)
        (logprobs * weights + entropy).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out[devices[0]] = (logprobs, entropy, grads, list(masks))
    (lp0, h0, g0, masked), (lp1, h1, g1, rolled) = out["cuda"], out["cpu"]
    assert all(m is not None for m in masked) and all(m is None for m in rolled)
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=0)
    for got, expected in zip(g1, g0):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    # forward itself, hidden states and logits from column 3 on: every real token's the same.
    attention_mask = query != PAD
    with torch.no_grad():
        for hidden in (False, True):
            model.roll_padding = ["cuda"]
            expected = model(query, attention_mask, hidden=hidden, keep_from=3, contiguous=True)
            model.roll_padding = ["cpu"]
            got = model(query, attention_mask, hidden=hidden, keep_from=3, contiguous=True)
            real = attention_mask[:, 3:]
            torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    # The rolled forward is one graph, as the masked one.
    explain = torch._dynamo.explain(model)(query, attention_mask, contiguous=True)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    # A query with a pad between its real tokens is not one run: the mask stays.
    query[1, -2] = PAD
    masks.clear()
    gpt2.logprobs(model, query, response)
    assert masks and all(m is not None for m in masks)


def test_cuda_mixed_head_rolled_rows_and_compiled_chunks():
    """On a GPU (skipped without): the mixed head is taken under bf16 autocast, near the fp32
    head, and a CUDA graph replays it bit for bit; rolled rows give the masked path's log-probs
    and gradients in fp32; the compiled chunk functions give the plain ones'."""
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
    assert "cuda speed paths ok" in p.stdout


CUDA_CHECK = """
import torch
import gpt2
from tests.test_gpt2 import PAD, V, batch, tiny_model

model = tiny_model().cuda().train()
query = torch.cat([torch.full((4, 2), PAD), batch()[1]], 1).cuda()
response = torch.tensor([[7, PAD, 5, 5, 5], [1, 2, 3, PAD, 5], [4, 4, PAD, 5, 5], [9, 8, 7, 6, 5]])
response = response.cuda()
bf16 = torch.autocast("cuda", dtype=torch.bfloat16)


def run(mixed, roll, autocast):
    model.mixed_head = mixed
    model.roll_padding = roll
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logprobs, entropy = gpt2.logprobs(model, query, response, entropy=True)
    (logprobs + entropy).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return logprobs, entropy, grads


# The mixed head: taken (other bits than the fp32 head's), near the fp32 head, finite gradients.
fp32 = run(False, ["none"], True)
mixed = run(True, ["none"], True)
assert not torch.equal(mixed[0], fp32[0])
torch.testing.assert_close(mixed[0], fp32[0], atol=0.05, rtol=0)
assert all(g.isfinite().all() for g in mixed[2])
# Rolled rows, in fp32: the masked path's log-probs and gradients.
masked = run(False, ["none"], False)
rolled = run(False, ["cuda"], False)
torch.testing.assert_close(rolled[0], masked[0], atol=1e-5, rtol=0)
torch.testing.assert_close(rolled[1], masked[1], atol=1e-5, rtol=0)
for got, expected in zip(rolled[2], masked[2]):
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
# The compiled chunk functions: the plain ones' values.
x = torch.randn(7, V, device="cuda")
y = torch.randint(0, V, (7,), device="cuda")
g = torch.randn(7, 1, device="cuda")
for fn, args in ((gpt2.chunk_logprobs, (x, y, 0.7, True)), (gpt2.chunk_grad, (x, y, 0.7, g, g))):
    for got, expected in zip(gpt2.compiled(fn)(*args), fn(*args)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
# A CUDA graph replays the mixed head's decode step bit for bit.
model.eval()
noise = torch.rand(4, 8, device="cuda")
with bf16:
    eager = gpt2.generate(model, query, PAD, 8, PAD, 0.7, noise, cuda_graph=False)
    graph = gpt2.generate(model, query, PAD, 8, PAD, 0.7, noise, cuda_graph=True)
assert all(torch.equal(a, b) for a, b in zip(eager, graph))
print("cuda speed paths ok")
"""
