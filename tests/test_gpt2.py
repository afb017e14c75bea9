"""gpt2.py: left padding, KV-cache generation, sampling, load/save, parity with transformers."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import gpt2

PAD, V = 256, 257
META = dict(vocab_size=V, eos_token_id=PAD, pad_token_id=PAD)


def tiny_model():
    """A random tiny fp32 GPT with randomised LayerNorms and biases (no mapping bug can hide) and
    a 3x embedding (peakier logits)."""
    torch.manual_seed(0)
    model = gpt2.load("tiny", META).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(3.0)
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(lengths=(5, 9, 3, 7)):
    """Random prompts, and the same prompts left-padded with PAD into one (B, T) tensor."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, PAD, (n,), generator=g) for n in lengths]
    pad = [torch.full((max(lengths) - len(s),), PAD) for s in seqs]
    return seqs, torch.stack([torch.cat([p, s]) for p, s in zip(pad, seqs)])


@torch.no_grad()
@pytest.mark.parametrize("hidden", [False, True])
def test_left_pad_invariance(hidden):
    model, (seqs, query) = tiny_model(), batch()
    out = model(query, (query != PAD).long(), hidden=hidden)
    assert out.shape == (*query.shape, 128 if hidden else V)
    for i, s in enumerate(seqs):
        ref = model(s[None], hidden=hidden)[0]
        torch.testing.assert_close(out[i, -len(s) :], ref, atol=1e-5, rtol=0)


@torch.no_grad()
def generate_no_cache(model, query, n, eos=None, noise=None, temperature=1.0):
    """Reference decoding: a full forward pass over the whole sequence at every step."""
    seq = query
    done = torch.zeros(len(query), dtype=torch.bool)
    out = []
    for t in range(n):
        mask = (torch.arange(seq.size(1)) >= query.size(1)) | (seq != PAD)
        token = gpt2.sample_token(model(seq, mask)[:, -1], noise[:, t], temperature)
        out.append(torch.where(done, PAD, token))
        done |= token == eos if eos is not None else False
        seq = torch.cat([seq, token[:, None]], 1)
    return torch.stack(out, 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_generate_matches_no_cache_and_stops_at_eos(temperature):
    model = tiny_model()
    n = 12
    query = batch()[1]
    noise = torch.rand(len(query), n, generator=torch.Generator().manual_seed(3))
    full = gpt2.generate(model, query, PAD, n, None, temperature, noise)
    assert torch.equal(full.response, generate_no_cache(model, query, n, None, noise, temperature))
    assert temperature == 0 or len(set(full.response.flatten().tolist())) > 5  # really sampled
    assert full.mask.all() and torch.equal(full.query, query)  # no stop token; nothing to trim
    eos = int(full.response[0, 3])  # a token really emitted: at least one row stops early
    stopped = gpt2.generate(model, query, PAD, n, eos, temperature, noise)
    assert torch.equal(
        stopped.response, generate_no_cache(model, query, n, eos, noise, temperature)
    )
    for row, mask, ref in zip(stopped.response, stopped.mask, full.response):
        cut = next((i + 1 for i, token in enumerate(ref.tolist()) if token == eos), n)
        assert torch.equal(row[:cut], ref[:cut]) and (row[cut:] == PAD).all()  # pad after eos
        assert mask.sum() == cut and mask[:cut].all()


def test_generate_returns_the_trimmed_query():
    model, query = tiny_model(), batch()[1]
    wide = torch.cat([torch.full((len(query), 5), PAD), query], 1)  # 5 columns of padding in all
    rollout = gpt2.generate(model, wide, PAD, 4, temperature=0.0)
    assert torch.equal(rollout.query, query)
    assert torch.equal(rollout.response, gpt2.generate(model, query, PAD, 4, temperature=0.0)[1])


def test_sample_token():
    logits = 3 * torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gpt2.sample_token(logits, None, temperature=0.0), logits.argmax(-1))
    assert gpt2.sample_token(logits, torch.zeros(6)).tolist() == [0] * 6  # u = 0: the first id
    g = torch.Generator().manual_seed(0)
    N = 200_000
    row = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    for temperature in (1.0, 2.0):
        sampled = gpt2.sample_token(row.expand(N, -1), torch.rand(N, generator=g), temperature)
        freq = torch.bincount(sampled, minlength=4).float() / N
        torch.testing.assert_close(freq, (row[0] / temperature).softmax(-1), atol=5e-3, rtol=0)


def test_masks_and_trim():
    response = torch.tensor([[5, 9, 7, 7], [9, 1, 2, 3], [1, 2, 3, 9]])
    assert gpt2.response_mask(response, 8).all()  # no stop token: every token
    assert gpt2.response_mask(response, 9).sum(1).tolist() == [2, 1, 4]
    query = torch.tensor([[PAD, PAD, 1], [PAD, 2, 3]])
    q, r = gpt2.trim_padding(query, response, PAD, 9)
    assert q.tolist() == [[PAD, 1], [2, 3]] and torch.equal(r, response)
    q, r = gpt2.trim_padding(query, torch.tensor([[9, 7, 7, 7], [4, 9, 7, 7]]), PAD, 9)
    assert r.tolist() == [[9, 7], [4, 9]]


def test_save_load_round_trip_with_tokenizer_ids(tmp_path):
    model, query = tiny_model(), batch()[1]
    gpt2.save(model, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    config = json.load(open(tmp_path / "config.json"))
    assert config["eos_token_id"] == config["bos_token_id"] == config["pad_token_id"] == PAD
    loaded = gpt2.load(str(tmp_path)).eval()
    assert loaded.config == model.config
    with torch.no_grad():  # bitwise: the same fp32 weights must come back
        assert torch.equal(loaded(query, query != PAD), model(query, query != PAD))
    into = gpt2.load("tiny", META, shard=lambda m: m.requires_grad_(False))  # in one process too
    assert not any(p.requires_grad for p in into.parameters())
    gpt2.load_weights(into, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(into.parameters(), model.parameters()))


def test_scalar_head_save_load(tmp_path):
    model = gpt2.ScalarModel(tiny_model(), gain=2.0, bias=-1.0)
    query, response = batch()[1], torch.tensor([[1, PAD, 3], [4, 5, 6], [PAD, 7, 7], [8, 9, PAD]])
    gpt2.save(model, str(tmp_path))
    reward = gpt2.load(str(tmp_path), META, head="saved")
    assert (reward.reward_gain, reward.reward_bias) == (2.0, -1.0)
    with torch.no_grad():
        expected = gpt2.get_reward(model, query, response, PAD, PAD)
        torch.testing.assert_close(gpt2.get_reward(reward, query, response, PAD, PAD), expected)
        # the score at the stop token: what follows it changes nothing
        padded = torch.where(gpt2.response_mask(response, PAD), response, 11)
        torch.testing.assert_close(gpt2.get_reward(model, query, padded, PAD, PAD), expected)
    fresh = gpt2.load(str(tmp_path), META, head="new")
    assert (fresh.reward_gain, fresh.reward_bias) == (2.0, -1.0)
    assert not torch.equal(fresh.score.weight, reward.score.weight)
    gpt2.save(tiny_model(), str(tmp_path / "lm"))
    with pytest.raises(gpt2.RunError, match="has no reward head"):
        gpt2.load(str(tmp_path / "lm"), META, head="saved")


@torch.no_grad()
def test_parity_with_transformers(tmp_path):
    hft = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = hft.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=V, attn_implementation="eager"
    )
    hf = hft.GPT2LMHeadModel(cfg).eval()
    for p in hf.parameters():
        p.add_(0.1 * torch.randn_like(p))  # LayerNorms and biases too: no wrong mapping can hide
    query = batch()[1]
    mask, real = (query != PAD).long(), query != PAD
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    hf.save_pretrained(str(tmp_path / "hf"))
    ours = gpt2.load(str(tmp_path / "hf")).eval()
    ref = hf(query, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(ours(query, mask)[real], ref[real], atol=1e-5, rtol=0)
    model = tiny_model()  # and back: our checkpoint into transformers, stop and pad ids in range
    gpt2.save(model, str(tmp_path / "ours"))
    back = hft.GPT2LMHeadModel.from_pretrained(str(tmp_path / "ours"), attn_implementation="eager")
    got = back.eval()(query, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(got[real], model(query, mask)[real], atol=1e-5, rtol=0)
    assert back.generation_config.eos_token_id == PAD < back.config.vocab_size


def test_errors(tmp_path):
    with pytest.raises(gpt2.RunError, match=r"^no checkpoint at 'nonexistent/path'[^\n]*$"):
        gpt2.load("nonexistent/path")
    model = tiny_model()
    gpt2.save(model, str(tmp_path))
    with pytest.raises(gpt2.RunError, match="has a 257-token vocabulary, the data's tokenizer 258"):
        gpt2.load(str(tmp_path), dict(META, vocab_size=V + 1))
    with pytest.raises(gpt2.RunError, match="257-token vocabulary, the data's tokenizer 50"):
        gpt2.load(str(tmp_path), dict(META, vocab_size=50))
    save_file({"foo": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(gpt2.RunError, match="not a GPT-2 checkpoint"):
        gpt2.load(str(tmp_path / "other.safetensors"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated file: one line naming it
    with pytest.raises(gpt2.RunError, match=f"cannot read '{weights}'.*damaged"):
        gpt2.load(str(tmp_path))
    with pytest.raises(ValueError, match="65 tokens exceed block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="65 tokens exceed the context of 64"):
        gpt2.generate(model, torch.zeros(2, 60, dtype=torch.long), PAD, max_new_tokens=5)


def test_activation_checkpointing_same_loss_and_grads():
    query, results = batch()[1], []
    for checkpointing in (False, True):
        model = tiny_model().train()
        model.activation_checkpointing = checkpointing
        logits = model(query, (query != PAD).long())
        loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), query[:, 1:], ignore_index=PAD)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1], results[0], atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_padded_vocabulary_never_produces_ids_past_the_tokenizer(tmp_path):
    """A checkpoint whose embedding is padded past the tokenizer (50257 → 50304 style) loads; its
    logits cover the tokenizer only, so sampling never returns an id it cannot decode."""
    model = gpt2.load("tiny", dict(META, vocab_size=384))  # 257 rounded up to a multiple of 128
    model.transformer.wte.weight[V:] = 50.0  # padding rows would win every argmax if scored
    gpt2.save(model, str(tmp_path))
    loaded = gpt2.load(str(tmp_path), META).eval()
    query = batch()[1]
    assert loaded(query).shape[-1] == V
    for temperature in (0.0, 1.0):
        response = gpt2.generate(loaded, query, PAD, 8, temperature=temperature).response
        assert int(response.max()) < V


@torch.no_grad()
def test_generation_logprobs_equal_a_separate_forward_pass():
    """The rollout's log-probs of the sampled tokens under logits / T equal gpt2.logprobs's."""
    model, (_, query) = tiny_model(), batch()
    temperature, noise = 0.7, torch.rand(4, 8, generator=torch.Generator().manual_seed(2))
    eos = int(gpt2.generate(model, query, PAD, 8, None, temperature, noise).response[0, 3])
    model.config.eos_token_id = eos  # rows stop at different lengths
    rollout = gpt2.generate(model, query, PAD, 8, eos, temperature, noise)
    assert 0 < rollout.mask.sum() < rollout.mask.numel()
    expected = gpt2.logprobs(model, query, rollout.response, temperature)[0]
    torch.testing.assert_close(rollout.logprobs, expected, atol=1e-5, rtol=0)


def plain_logprobs(model, query, response, temperature):
    """The formula gpt2.logprobs computes in chunks, on the whole (B, Tr, V) at once."""
    mask = gpt2.response_mask(response, PAD)
    inputs = torch.cat([query, response[:, :-1]], 1)
    attention_mask = torch.cat([query != PAD, mask[:, :-1]], 1)
    logits = model(inputs, attention_mask, keep_from=query.size(1) - 1)
    logp = logits.float().div(temperature).log_softmax(-1)
    logprobs = logp.gather(-1, response[..., None]).squeeze(-1)
    return logprobs * mask, -(logp.exp() * logp).sum(-1) * mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_plain_formula(monkeypatch, temperature):
    """Left-padded queries, rows that stop at different lengths, chunks of 3 rows: the plain
    formula's log-probs, entropy and gradients, on the columns trim_padding keeps; 0 after."""
    monkeypatch.setattr(gpt2.TokenLogProbs, "CHUNK", 3 * V)
    model, query = tiny_model().train(), torch.cat([torch.full((4, 2), PAD), batch()[1]], 1)
    response = torch.tensor([[7, PAD, 5, 5, 5], [1, 2, 3, PAD, 5], [4, 4, PAD, 5, 5]])
    response = torch.cat([response, torch.tensor([[9, 8, 7, PAD, PAD]])])  # stops at 4, last
    weights = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    logprobs, entropy = gpt2.logprobs(model, query, response, temperature, entropy=True)
    (logprobs * weights[0] + entropy * weights[1]).sum().backward()  # an entropy bonus's too
    grads = [p.grad.to_dense() for p in model.parameters()]
    model.zero_grad()
    assert entropy.shape == logprobs.shape == (4, 5)
    assert (logprobs[:, 4:] == 0).all() and (entropy[:, 4:] == 0).all()
    expected = plain_logprobs(model, query[:, 2:], response[:, :4], temperature)
    torch.testing.assert_close(logprobs[:, :4], expected[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy[:, :4], expected[1], atol=1e-6, rtol=0)
    (expected[0] * weights[0, :, :4] + expected[1] * weights[1, :, :4]).sum().backward()
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad.to_dense(), atol=1e-5, rtol=1e-4)
    assert gpt2.logprobs(model, query, response, temperature)[1] is None
    model.zero_grad()  # an entropy only logged: the gradient is the log-probs' alone
    (gpt2.logprobs(model, query, response, temperature, True)[0] * weights[0]).sum().backward()
    only_logprobs = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (gpt2.logprobs(model, query, response, temperature)[0] * weights[0]).sum().backward()
    for got, p in zip(only_logprobs, model.parameters()):
        torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=1e-5)


def test_collision_entropy_is_minus_log_sum_of_squared_probabilities(monkeypatch):
    """entropy="collision" (WPO's weight alignment): -log sum_v p_v^2 of the same pass, in chunks,
    0 past each stop; the log-probs and their gradient are unchanged; it has no gradient."""
    monkeypatch.setattr(gpt2.TokenLogProbs, "CHUNK", 3 * V)
    model, query = tiny_model().train(), torch.cat([torch.full((4, 2), PAD), batch()[1]], 1)
    response = torch.tensor([[7, PAD, 5, 5], [1, 2, 3, PAD], [4, 4, PAD, 5], [9, 8, 7, 6]])
    logprobs, collision = gpt2.logprobs(model, query, response, 0.7, entropy="collision")
    plain, _ = gpt2.logprobs(model, query, response, 0.7)
    assert torch.equal(logprobs, plain)
    mask = gpt2.response_mask(response, PAD)
    inputs = torch.cat([query[:, 2:], response[:, :-1]], 1)
    attention_mask = torch.cat([query[:, 2:] != PAD, mask[:, :-1]], 1)
    logits = model(inputs, attention_mask, keep_from=query.size(1) - 3)
    logp = logits.float().div(0.7).log_softmax(-1)
    expected = -torch.log((logp.exp() ** 2).sum(-1)) * mask
    torch.testing.assert_close(collision, expected.detach(), atol=1e-5, rtol=0)
    # p_v^2 summed is at most max p: the collision entropy is at least -log max p, at most log V
    assert ((collision <= math.log(V) + 1e-5) | ~mask).all() and (collision >= 0).all()
    with pytest.raises(RuntimeError, match="no gradient"):
        collision.sum().backward()


def test_trim_padding_equals_the_two_sync_version():
    def two_syncs(query, response, pad_token_id, eos_token_id=None):  # the earlier code
        query = query[:, int((query != pad_token_id).any(0).int().argmax()) :]
        if eos_token_id is None:
            return query, response
        return query, response[:, : int(gpt2.response_mask(response, eos_token_id).sum(1).max())]

    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 7, (4, 1), generator=g)
        query = torch.where(torch.arange(6) >= 6 - lengths, 5, PAD)  # 0 to 6 real tokens
        response = torch.randint(0, 5, (4, 6), generator=g)  # stop token 4, or none
        for eos in (None, 4):
            got = gpt2.trim_padding(query, response, PAD, eos)
            expected = two_syncs(query, response, PAD, eos)
            assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("n_logits", [V, V - 1])
def test_onednn_gemms_equal_torch_gemms(monkeypatch, n_logits):
    """The GEMMs routed through oneDNN (GPT2_CPU_GEMM=onednn, the default on AMD CPUs) give torch's
    own GEMM's logits, gradients and greedy generations, for the tied head in full and sliced (a
    padded vocabulary)."""
    query = batch()[1]
    out = []
    monkeypatch.setattr(gpt2, "ONEDNN_MIN_WEIGHTS", 0)  # the tiny model's GEMMs too
    for gemm in ("mkl", "onednn"):
        # Read when the model is built: its Conv1Ds and LM head are bound to the routing.
        monkeypatch.setenv("GPT2_CPU_GEMM", gemm)
        model = tiny_model().train()
        routed = gpt2.cpu_matmul if gemm == "onednn" else gpt2.matmul
        gemms = [m.gemm for m in model.modules() if isinstance(m, (gpt2.Conv1D, gpt2.GPT))]
        assert len(gemms) == 1 + 4 * model.config.n_layer and all(g is routed for g in gemms)
        model.n_logits = n_logits
        logits = model(query, (query != PAD).long())
        assert not logits._is_view()  # FSDP2 warns when a module returns a view
        (logits.float().log_softmax(-1)[..., 0].sum() + logits.square().mean()).backward()
        grads = {n: p.grad.to_dense() for n, p in model.named_parameters()}
        greedy = gpt2.generate(model.eval(), query, PAD, 8, temperature=0.0).response
        out.append((logits.detach(), grads, greedy))
    (l0, g0, r0), (l1, g1, r1) = out
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-5)
    assert g0.keys() == g1.keys() and all(g0[n].abs().max() > 0 for n in g0 if "wpe" not in n)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=n)
    assert torch.equal(r0, r1)


@torch.no_grad()
def test_generate_calls_the_blocks_without_hooks():
    """Under FSDP2 a hook runs around every block at every token, which makes decoding bound by the
    CPU: generate gathers the weights once (`unsharded`) and calls the blocks directly."""
    model = tiny_model()
    query = batch()[1]
    calls = []
    model.transformer.h[0].register_forward_pre_hook(lambda *args: calls.append(1))
    gpt2.generate(model, query, PAD, 5, temperature=0.0)
    assert calls == [] and model.hooks  # and back to normal afterwards
    model(query)
    assert calls == [1]


def test_no_padding_takes_the_causal_kernel_with_no_mask(monkeypatch):
    """Whether every token is real is decided by the callers that sync anyway (_trim), not in
    forward: logprobs and generate of unpadded rows make the unmasked causal call (FlashAttention
    on GPU; no mask for cuDNN's NaN case), padded twins the masked one, with the same results."""
    model, idx = tiny_model(), batch((6, 6, 6))[1]  # equal lengths: no pad
    response = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    masks = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, mask, **kw):
        masks.append(mask)
        return sdpa(q, k, v, mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    full = gpt2.logprobs(model, idx, response)[0]
    prefill = gpt2.generate(model, idx, PAD, 1, temperature=0.0).response
    assert len(masks) == 2 * len(model.transformer.h) and all(m is None for m in masks)
    padded = torch.cat([torch.full((len(idx), 2), PAD), idx], 1)
    padded[0, 2] = PAD  # one row shorter: the pad column is not trimmed off
    masks.clear()
    short = gpt2.logprobs(model, padded, response)[0]
    assert masks and all(m is not None for m in masks)
    torch.testing.assert_close(short[1:], full[1:], atol=1e-5, rtol=0)
    assert torch.equal(
        gpt2.generate(model, padded[1:], PAD, 1, temperature=0.0).response, prefill[1:]
    )
    # A mask is used as given, even with every token real; on CPU it gives the causal bits.
    with torch.no_grad():
        masks.clear()
        masked = model(idx, torch.ones_like(idx, dtype=torch.bool))
        assert all(m is not None for m in masks)
        assert torch.equal(masked, model(idx))
