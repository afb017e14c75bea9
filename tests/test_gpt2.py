"""gpt2.py: left padding, KV-cache generation, sampling, save/load, parity with transformers, errors, checkpointing."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2  # noqa: E402

PAD, V = 256, 257


def tiny_model():
    """Random tiny fp32 GPT; LayerNorms and biases randomised too, so no mapping bug hides; wte x3: peakier logits."""
    torch.manual_seed(0)
    model = gpt2.load_model("tiny", vocab_size=V).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(3.0)
        for p in (p for name, p in model.named_parameters() if "ln_" in name or name.endswith("bias")):
            p.add_(0.1 * torch.randn_like(p))
    return model


def batch(lengths=(5, 9, 3, 7)):
    """Random prompts and the same prompts left-padded with PAD into one (B, T) tensor."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, PAD, (n,), generator=g) for n in lengths]
    return seqs, torch.stack([torch.cat([torch.full((max(lengths) - len(s),), PAD), s]) for s in seqs])


@torch.no_grad()
@pytest.mark.parametrize("return_hidden", [False, True])
def test_left_pad_invariance(return_hidden):
    model, (seqs, query) = tiny_model(), batch()
    out = model(query, attention_mask=(query != PAD).long(), return_hidden=return_hidden)
    assert out.shape == (*query.shape, 128 if return_hidden else V)
    for i, s in enumerate(seqs):
        ref = model(s[None], return_hidden=return_hidden)[0]
        torch.testing.assert_close(out[i, -len(s) :], ref, atol=1e-5, rtol=0)


@torch.no_grad()
def generate_no_cache(model, query, n, eos=None, noise=None, **kw):
    """Reference decoding: a full forward pass over the whole sequence at every step, no KV cache."""
    seq, done, out = query, torch.zeros(len(query), dtype=torch.bool), []
    for t in range(n):
        logits = model(seq, attention_mask=(torch.arange(seq.size(1)) >= query.size(1)) | (seq != PAD))[:, -1]
        token = gpt2.sample_token(logits, None if noise is None else noise[:, t], **kw)
        out.append(torch.where(done, PAD, token))
        done |= token == eos if eos is not None else False
        seq = torch.cat([seq, token[:, None]], 1)
    return torch.stack(out, 1)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(), dict(temperature=0.7, top_k=40, top_p=0.8)])
def test_generate_matches_no_cache_and_stops_at_eos(kw):
    model, n, query = tiny_model(), 12, batch()[1]
    kw = dict(kw, noise=torch.rand(len(query), n, generator=torch.Generator().manual_seed(3)))  # same uniforms for both
    full = gpt2.generate(model, query, PAD, n, **kw)
    assert torch.equal(full, generate_no_cache(model, query, n, **kw))
    assert kw.get("temperature") == 0 or len(set(full.flatten().tolist())) > 5  # really sampled, not one repeated token
    eos = int(full[0, 3])  # a token really emitted, so at least one row stops early
    stopped = gpt2.generate(model, query, PAD, n, eos_token_id=eos, **kw)
    assert torch.equal(stopped, generate_no_cache(model, query, n, eos=eos, **kw))
    for row, ref in zip(stopped, full):  # the same tokens up to and including the first eos, then only pad
        cut = next((i + 1 for i, token in enumerate(ref.tolist()) if token == eos), n)
        assert torch.equal(row[:cut], ref[:cut]) and (row[cut:] == PAD).all()


def test_sample_token():
    logits = 3 * torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    for u in torch.linspace(0, 0.999, 7):
        assert torch.equal(gpt2.sample_token(logits, u.expand(6), top_k=1), logits.argmax(-1))
        assert torch.equal(gpt2.sample_token(logits, u.expand(6), top_p=1e-6), logits.argmax(-1))
    assert torch.equal(gpt2.sample_token(logits, temperature=0.0), logits.argmax(-1))
    g, N, row = torch.Generator().manual_seed(0), 200_000, torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])
    p1, p2 = row.softmax(-1)[0], (row / 2).softmax(-1)[0]
    top2 = p1 * torch.tensor([1.0, 0, 0, 1, 0])  # top_k=2: renormalised over the two largest
    for kw, probs in [(dict(), p1), (dict(temperature=2.0), p2), (dict(top_k=2), top2)]:
        freq = torch.bincount(gpt2.sample_token(row.expand(N, -1), generator=g, **kw), minlength=5).float() / N
        torch.testing.assert_close(freq, probs / probs.sum(), atol=5e-3, rtol=0)


def test_save_load_round_trip(tmp_path):
    model, score = tiny_model(), torch.randn(1, 128)
    gpt2.save_model(model.state_dict(), model.config, str(tmp_path), {"score.weight": score}, {"task": "x"})
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    loaded, query = gpt2.load_model(str(tmp_path)).eval(), batch()[1]
    assert loaded.config == model.config
    with torch.no_grad():  # bitwise: the same fp32 weights must come back
        assert torch.equal(loaded(query, attention_mask=query != PAD), model(query, attention_mask=query != PAD))
    tensors, meta = gpt2.read_checkpoint(str(tmp_path))
    assert torch.equal(tensors["score.weight"], score) and meta["task"] == "x" and meta["n_head"] == 4


@torch.no_grad()
def test_parity_with_transformers(tmp_path):
    hft = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = hft.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=V, attn_implementation="eager")
    hf = hft.GPT2LMHeadModel(cfg).eval()
    for p in hf.parameters():
        p.add_(0.1 * torch.randn_like(p))  # LayerNorms and biases too, so a wrong mapping cannot hide
    query = batch()[1]
    mask, real = (query != PAD).long(), query != PAD
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    hf.save_pretrained(str(tmp_path / "hf"))
    ours = gpt2.load_model(str(tmp_path / "hf")).eval()
    ref = hf(query, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(ours(query, attention_mask=mask)[real], ref[real], atol=1e-5, rtol=0)
    model = tiny_model()  # and back: our checkpoint into transformers
    gpt2.save_model(model.state_dict(), model.config, str(tmp_path / "ours"))
    back = hft.GPT2LMHeadModel.from_pretrained(str(tmp_path / "ours"), attn_implementation="eager").eval()
    got = back(query, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(got[real], model(query, attention_mask=mask)[real], atol=1e-5, rtol=0)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^no checkpoint at 'nonexistent/path'[^\n]*$"):
        gpt2.load_model("nonexistent/path")
    model = tiny_model()
    gpt2.save_model(model.state_dict(), model.config, str(tmp_path))
    with pytest.raises(ValueError, match="has a 257-token vocabulary but the data's tokenizer has 258"):
        gpt2.load_model(str(tmp_path), vocab_size=V + 1)
    with pytest.raises(ValueError, match="257-token vocabulary but the data's tokenizer has 50"):  # GPT-2 on bytes
        gpt2.load_model(str(tmp_path), vocab_size=50)
    save_file({"foo": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a GPT-2 checkpoint"):
        gpt2.load_model(str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="65 tokens exceeds block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="exceed the context of 64"):
        gpt2.generate(model, torch.zeros(2, 60, dtype=torch.long), PAD, max_new_tokens=5)
    with pytest.raises(ValueError, match="tiny, gpt2, gpt2-medium"):
        gpt2.make_config("nope")


def test_activation_checkpointing_same_loss_and_grads():
    query, results = batch()[1], []
    mask = (query != PAD).long()
    for ckpt in (False, True):
        model = tiny_model().train()
        model.activation_checkpointing = ckpt
        logits = model(query, attention_mask=mask)
        loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), query[:, 1:], ignore_index=PAD)  # pad targets ignored
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1], results[0], atol=1e-6, rtol=1e-5)  # (loss, grads) with vs without


@torch.no_grad()
def test_padded_vocabulary_never_produces_ids_past_the_tokenizer(tmp_path):
    """A checkpoint whose embedding is padded past the tokenizer (GPT-2's 50257 → 50304 style) loads; its logits
    cover the tokenizer only, so sampling never returns an id the tokenizer cannot decode."""
    model = gpt2.GPT(gpt2.make_config("tiny", vocab_size=384))  # 257 rounded up to a multiple of 128
    with torch.no_grad():
        model.transformer.wte.weight[V:] = 50.0  # the padding rows would win every argmax if they were scored
    gpt2.save_model(model.state_dict(), model.config, str(tmp_path))
    loaded = gpt2.load_model(str(tmp_path), vocab_size=V).eval()
    query = batch()[1]
    assert loaded(query).shape[-1] == V
    for temperature in (0.0, 1.0):
        response = gpt2.generate(loaded, query, PAD, 8, temperature=temperature, generator=torch.Generator().manual_seed(0))
        assert int(response.max()) < V


@torch.no_grad()
def test_generation_logprobs_equal_a_separate_forward_pass():
    """return_logprobs gives the log-probs of the sampled tokens under logits / T, as one full forward pass would."""
    model, (_, query) = tiny_model(), batch()
    T, temperature = 6, 0.7
    response, logprobs = gpt2.generate(model, query, PAD, T, eos_token_id=None, temperature=temperature,
                                       generator=torch.Generator().manual_seed(0), return_logprobs=True)  # fmt: skip
    mask = torch.cat([query != PAD, torch.ones_like(response, dtype=torch.bool)], 1)
    logits = model(torch.cat([query, response], 1), attention_mask=mask, keep_from=query.size(1) - 1)[:, :-1]
    expected = (logits / temperature).log_softmax(-1).gather(-1, response[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("n_logits", [V, V - 1])
def test_onednn_gemms_equal_torch_gemms(monkeypatch, n_logits):
    """gpt2.matmul through oneDNN (the default on AMD CPUs) gives torch's own GEMM's logits, gradients and greedy
    generations, for the tied head in full and sliced (a padded vocabulary)."""
    seqs, query = batch()
    out = []
    for onednn in (False, True):
        monkeypatch.setattr(gpt2, "ONEDNN", onednn)
        monkeypatch.setattr(gpt2, "ONEDNN_MIN_WEIGHTS", 0)  # the tiny model's GEMMs too
        model = tiny_model().train()
        model.n_logits = n_logits
        logits = model(query, attention_mask=(query != PAD).long())
        (logits.float().log_softmax(-1)[..., 0].sum() + logits.square().mean()).backward()
        grads = {n: p.grad.to_dense() for n, p in model.named_parameters()}
        out.append((logits.detach(), grads, gpt2.generate(model.eval(), query, PAD, 8, temperature=0.0)))
    (l0, g0, r0), (l1, g1, r1) = out
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-5)
    assert g0.keys() == g1.keys() and all(g0[n].abs().max() > 0 for n in g0 if "wpe" not in n)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=n)
    assert torch.equal(r0, r1)


@pytest.mark.parametrize("with_grad", [False, True])
def test_shared_prefix_equals_running_every_row(monkeypatch, with_grad):
    """forward(shared_prefix=n) runs each distinct prefix once (checked by counting the tokens block 0 sees) and gives
    the logits and gradients of running every row in full; generate prefills a repeated prompt once, same tokens."""
    _, prompts = batch()  # 4 left-padded prompts, repeated 3 times (GRPO's groups), and one more prompt of its own
    extra = torch.full((1, prompts.size(1)), PAD)
    extra[0, -4:] = torch.arange(4)
    query = torch.cat([prompts.repeat_interleave(3, 0), extra])
    g = torch.Generator().manual_seed(2)
    response = torch.randint(0, PAD, (len(query), 5), generator=g)
    ids, mask = torch.cat([query, response], 1), torch.cat([query != PAD, torch.ones_like(response, dtype=torch.bool)], 1)
    n, out = query.size(1) - 1, []
    for shared in (0, n):
        model, tokens = tiny_model().train(), []
        seen = lambda m, a, o: tokens.extend(x.shape[0] * x.shape[1] for x in (a[0], *(a[4][:1] if len(a) > 4 else ())))  # noqa: E731
        model.transformer.h[0].register_forward_hook(seen)
        with torch.set_grad_enabled(with_grad):
            logits = model(ids, attention_mask=mask.long(), keep_from=n, shared_prefix=shared)
            if with_grad:
                (logits.log_softmax(-1)[..., 0].sum() + logits.square().mean()).backward()
        grads = {k: p.grad.to_dense() for k, p in model.named_parameters()} if with_grad else {}
        out.append((logits.detach(), grads, sum(tokens)))
    (l0, g0, t0), (l1, g1, t1) = out
    assert t0 == len(query) * ids.size(1) and t1 == 5 * n + len(query) * (ids.size(1) - n)  # 5 distinct prefixes
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-4, msg=k)
    with pytest.raises(ValueError, match="shared_prefix"):
        model(ids, attention_mask=mask.long(), keep_from=n - 1, shared_prefix=n)
    model, noise = tiny_model(), torch.rand(len(query), 6, generator=g)
    shared = gpt2.generate(model, query, PAD, 6, noise=noise, return_logprobs=True)
    monkeypatch.setattr(gpt2, "SHARE_PREFIX", False)
    unshared = gpt2.generate(model, query, PAD, 6, noise=noise, return_logprobs=True)
    assert torch.equal(shared[0], unshared[0])
    torch.testing.assert_close(shared[1], unshared[1], atol=1e-5, rtol=0)
