"""Top-k and top-p (nucleus) sampling (issue 41): gpt2.kept_tokens against hand-computed sets
(top-k, top-p, both chained, ties, off); the sampler's inverse CDF over the renormalised
distribution and its recorded log-prob by hand; generate's log-probs against gpt2.logprobs with
the same filter; the filtered log-probs' and entropy's hand-written gradients against autograd
of the plain formula. The decode step with the filter (no sync, no graph break, the CUDA graph):
tests/test_decode.py; grpo.py's --top_p: tests/test_grpo.py."""

import math

import pytest
import torch

import gpt2
from tests.test_gpt2 import PAD, V, batch, tiny_model

# Probabilities by token id: sorted, ids 1, 2, 3, 0 with 0.5, 0.25, 0.15, 0.1, so the mass
# before each in that order is 0, 0.5, 0.75, 0.9.
PROBS = [0.1, 0.5, 0.25, 0.15]


def kept(logits, top_k=0, top_p=1.0):
    """The ids kept_tokens keeps of one row of logits, as a set."""
    mask = gpt2.kept_tokens(torch.tensor([logits]), top_k, top_p)[0]
    return set(mask.nonzero().flatten().tolist())


@pytest.mark.parametrize(
    "top_k, top_p, expected",
    [
        (0, 1.0, {0, 1, 2, 3}),  # off
        (2, 1.0, {1, 2}),  # the 2 largest
        (9, 1.0, {0, 1, 2, 3}),  # k past the vocabulary: all
        (0, 0.45, {1}),  # 0.5 alone reaches 0.45
        (0, 0.6, {1, 2}),  # 0.5 does not reach 0.6; 0.75 does
        (0, 0.8, {1, 2, 3}),
        (0, 0.95, {0, 1, 2, 3}),
        (0, 1e-6, {1}),  # the likeliest token always stays
        # Chained as Hugging Face and vLLM chain them: top-p on the top-3's renormalised
        # probabilities 0.56, 0.28, 0.17 (mass before: 0, 0.56, 0.83): 0.8 keeps 2 tokens,
        # where top-p alone on the full distribution keeps 3 (above).
        (3, 0.8, {1, 2}),
        (3, 0.9, {1, 2, 3}),
    ],
)
def test_kept_tokens_by_hand(top_k, top_p, expected):
    logits = [math.log(p) for p in PROBS]
    assert kept(logits, top_k, top_p) == expected


def test_ties_are_ranked_by_token_id():
    """Equal logits: the lower id ranks first, for top-k and top-p alike, on every call."""
    logits = [0.0, 2.0, 2.0, 1.0]
    assert kept(logits, top_k=1) == {1}
    assert kept(logits, top_k=2) == {1, 2}
    # Each tied token has probability e^2 / (1 + 2 e^2 + e) = 0.40: 0.3 keeps one of them.
    assert kept(logits, top_p=0.3) == {1}
    assert kept(logits, top_p=0.5) == {1, 2}
    flat = torch.zeros(3, 8)
    assert gpt2.kept_tokens(flat, top_k=3)[:, :3].all() and gpt2.kept_tokens(flat, 3).sum() == 9


def test_sampling_logits_off_and_on():
    """top_k 0 and top_p 1: logits / T, the bits as they were; on: -inf off the kept set."""
    logits = 3 * torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gpt2.sampling_logits(logits, 0.7), logits.float() / 0.7)
    filtered = gpt2.sampling_logits(logits, 0.7, top_k=4, top_p=0.9)
    mask = gpt2.kept_tokens(logits / 0.7, 4, 0.9)
    assert (
        torch.equal(filtered[mask], (logits / 0.7)[mask]) and (filtered[~mask] == -math.inf).all()
    )
    assert (mask.sum(1) >= 1).all() and (mask.sum(1) <= 4).all()


def test_sample_token_inverts_the_renormalised_cdf_by_hand():
    """top_p 0.6 keeps ids 1 and 2, renormalised to 2/3 and 1/3: the cdf by id is 0, 2/3, 1, 1.
    u = 1 (a threshold at the cdf's end) takes the last kept id, 2, not the filtered 3."""
    logits = torch.tensor([[math.log(p) for p in PROBS]]).expand(5, -1)
    u = torch.tensor([0.0, 0.5, 0.66, 0.7, 1.0])
    assert gpt2.sample_token(logits, u, 1.0, top_p=0.6).tolist() == [1, 1, 1, 2, 2]
    # Off, the same u: the cdf by id is 0.1, 0.6, 0.85, 1 (and u = 1 is clamped to the last id).
    assert gpt2.sample_token(logits, u, 1.0).tolist() == [0, 1, 2, 2, 3]
    # Greedy: the argmax, which every filter keeps.
    assert gpt2.sample_token(logits, u, 0.0, top_k=1).tolist() == [1] * 5


def test_sample_token_off_is_the_formula_it_replaced():
    g = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(64, V, generator=g)
    u = torch.rand(64, generator=g)
    probs = (logits.float() / 0.7).softmax(-1)
    cdf = probs.cumsum(-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    assert torch.equal(gpt2.sample_token(logits, u, 0.7), expected.clamp(max=V - 1))


def test_sampled_frequencies_are_the_renormalised_probabilities():
    row = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])
    N = 200_000
    u = torch.rand(N, generator=torch.Generator().manual_seed(0))
    for top_k, top_p in [(3, 1.0), (0, 0.7), (4, 0.8)]:
        sampled = gpt2.sample_token(row.expand(N, -1), u, 2.0, top_k, top_p)
        freq = torch.bincount(sampled, minlength=5).float() / N
        scaled = row[0] / 2.0
        mask = gpt2.kept_tokens(scaled[None], top_k, top_p)[0]
        expected = scaled.masked_fill(~mask, -math.inf).softmax(-1)
        torch.testing.assert_close(freq, expected, atol=5e-3, rtol=0)
        assert (freq[~mask] == 0).all()


def test_sample_records_the_renormalised_log_prob():
    """One step of the decode state: token and log-prob under the kept set's distribution."""
    logits = torch.tensor([[math.log(p) for p in PROBS]]).expand(3, -1)
    noise = torch.tensor([[0.5], [0.7], [0.99]])
    s = gpt2.new_decoding(tiny_model(), noise, 4, PAD, None, 1.0, torch.long, top_p=0.6)
    s.noise.copy_(noise)
    gpt2.sample(s, logits)
    assert s.response[:, 0].tolist() == [1, 2, 2]
    expected = torch.tensor([math.log(2 / 3), math.log(1 / 3), math.log(1 / 3)])
    torch.testing.assert_close(s.logprobs[:, 0], expected, atol=1e-6, rtol=0)


FILTERS = [(0, 0.9), (5, 1.0), (20, 0.8)]


@torch.no_grad()
@pytest.mark.parametrize("top_k, top_p", FILTERS)
def test_generate_logprobs_equal_logprobs_with_the_filter(top_k, top_p):
    """The first token comes from the prefill, the same forward as logprobs': bit for bit.
    Later ones from the decode step, whose attention sums differ in rounding from the full
    forward's: to 1e-5, as unfiltered (test_gpt2). Left-padded prompts, rows that stop."""
    model = tiny_model()
    g = torch.Generator().manual_seed(4)
    query = torch.randint(0, PAD, (64, 6), generator=g)
    noise = torch.rand(64, 1, generator=g)
    first = gpt2.generate(model, query, PAD, 1, None, 0.7, noise, top_k=top_k, top_p=top_p)
    expected = gpt2.logprobs(model, query, first.response, 0.7, top_k=top_k, top_p=top_p)[0]
    assert torch.equal(first.logprobs, expected)
    # The filter is on: the full distribution's log-probs are lower (by the kept mass's log).
    full = gpt2.logprobs(model, query, first.response, 0.7)[0]
    assert (full < first.logprobs).any() and (full <= first.logprobs).all()

    query = batch()[1]
    noise = torch.rand(len(query), 10, generator=g)
    rollout = gpt2.generate(model, query, PAD, 10, None, 0.7, noise, top_k=top_k, top_p=top_p)
    eos = int(rollout.response[0, 3])
    model.config.eos_token_id = eos
    rollout = gpt2.generate(model, query, PAD, 10, eos, 0.7, noise, top_k=top_k, top_p=top_p)
    assert 0 < rollout.mask.sum() < rollout.mask.numel()
    expected = gpt2.logprobs(model, query, rollout.response, 0.7, top_k=top_k, top_p=top_p)[0]
    torch.testing.assert_close(rollout.logprobs, expected, atol=1e-5, rtol=0)
    # Packed (the scripts' default): the same, to rounding.
    model.packing = True
    packed = gpt2.logprobs(model, query, rollout.response, 0.7, top_k=top_k, top_p=top_p)[0]
    torch.testing.assert_close(rollout.logprobs, packed, atol=1e-5, rtol=0)


def plain_filtered(x, y, t, top_k, top_p):
    """The formula by autograd: log_softmax over the kept set (a selection from the detached
    logits, plus the target), and the entropy of that distribution."""
    scaled = x / t
    mask = gpt2.kept_tokens(scaled.detach(), top_k, top_p)
    mask[torch.arange(len(y)), y] = True
    logp = scaled.masked_fill(~mask, -math.inf).log_softmax(-1)
    token_logp = logp.gather(1, y[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp.masked_fill(~mask, 0)).sum(-1)
    return token_logp, entropy, mask


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), *FILTERS, (0, 0.3)])
def test_filtered_logprobs_entropy_and_gradients_equal_autograd(monkeypatch, top_k, top_p):
    """TokenLogProbs' chunked forward and hand-written backward, chunks of 3 rows: the plain
    formula's values and gradients; 0 gradient at every filtered token. The last target is the
    least likely token, outside any filter's set: it is kept, and its log-prob finite."""
    monkeypatch.setattr(gpt2.TokenLogProbs, "CHUNK", 3 * V)
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(8, V, generator=g)).requires_grad_(True)
    y = torch.randint(0, V, (8,), generator=g)
    y[-1] = x[-1].argmin()
    weights = torch.randn(2, 8, generator=g)
    got = gpt2.TokenLogProbs.apply(x.clone(), y, 0.7, True, top_k, top_p)
    (got[0] * weights[0] + got[1] * weights[1]).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    token_logp, entropy, mask = plain_filtered(x, y, 0.7, top_k, top_p)
    (token_logp * weights[0] + entropy * weights[1]).sum().backward()
    torch.testing.assert_close(got[0], token_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(got[1], entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, x.grad, atol=1e-6, rtol=1e-5)
    assert got[0].isfinite().all() and got[1].isfinite().all()
    assert (grad[~mask] == 0).all()
    if top_k or top_p < 1:
        assert (~mask).any()


def test_filtered_chunk_functions_compile_whole():
    """CUDA compiles the chunk functions: with the filter too, one graph each, no break."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, V, generator=g)
    y = torch.randint(0, V, (3,), generator=g)
    weights = torch.randn(3, 1, generator=g)
    for entropy in (None, weights):
        explain = torch._dynamo.explain(gpt2.chunk_grad)(x, y, 0.7, weights, entropy, 5, 0.8)
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        with_entropy = entropy is not None
        explain = torch._dynamo.explain(gpt2.chunk_logprobs)(x, y, 0.7, with_entropy, 5, 0.8)
        assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
