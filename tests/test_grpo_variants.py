"""grpo_variants.py: each variant against its paper's formula by hand (the KL estimators with
k3_ratio, which gradients are unbiased; RLOO, the batch and no std; clip-higher, dual-clip, CISPO,
SAPO, GMPO, GSPO, the aggregations, REINFORCE++, KL in the reward, the overlong punishment,
adaptive entropy, dynamic sampling), pad != eos; end to end: 1 rank == 2 ranks with the
first-minibatch invariant for the DAPO flags, RSO with the KL in the reward, SAPO with REINFORCE++
and top-k/top-p; every option; resume == uninterrupted with an entropy controller; TR-DPO's refresh
of pi_ref (KL 0 at every step with a hard copy each step; 1 rank == 2 ranks and a bitwise resume);
one-line errors. That the file equals grpo.py at its defaults: tests/test_grpo.py. Distillation,
the sampler correction and reward functions: tests/test_distill.py, test_sampler_correction.py,
test_reward_fns.py."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
from safetensors.torch import load_file

import gpt2
import grpo_variants
from failed_run import why
from runs import error_line, in_process

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
EOS = 256  # the offline task's <|endoftext|>, also its pad
META = dict(vocab_size=257, eos_token_id=EOS, pad_token_id=EOS)
SMALL = (  # 3-token answers: longer ones miss the stop token, whose penalty gives groups variance
    "--num_prompts_per_step 8 --num_samples_per_prompt 4 --micro_batch_size 8 --eval_size 32 "
    "--response_length 4 --missing_eos_penalty 1 --log_every 1 --lr 3e-4 --num_minibatches 1"
).split()
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


def command(args, nproc=0, script="grpo_variants.py"):
    return [*TORCHRUN, str(nproc), script, *args] if nproc else [sys.executable, script, *args]


def run(args, nproc=0, check=True, cwd=ROOT, script="grpo_variants.py"):
    cmd = command(args, nproc, script)
    p = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 or not check, why(p)
    return p


def run_here(args):
    """A run as run() makes it, in this process (runs.in_process): for the tests whose subject is
    the run, not its process."""
    in_process(grpo_variants, args)


def metrics(out_dir):  # one dict per logged step
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def choices(flag):  # a Literal flag's choices, as --help lists them
    return get_args(grpo_variants.Args.__annotations__[flag])


# ---- KL estimators

NEW, REF, OLD = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5], [-1.2, -2.5, -0.4]


@pytest.mark.parametrize("est", choices("kl_estimator"))
def test_kl_estimator_values_and_gradients(est):
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    ref, old = torch.tensor(REF, dtype=torch.float64), torch.tensor(OLD, dtype=torch.float64)
    (value := grpo_variants.kl_penalty(new, ref, new - old, est)).sum().backward()
    for n, r, o, v, g in zip(NEW, REF, OLD, value.tolist(), new.grad.tolist()):
        x, w = n - r, math.exp(n - o)  # log(pi/pi_ref), importance weight pi/pi_old
        want = dict(k1=(x, 1), k2=(x * x / 2, x), k3=(math.exp(-x) - 1 + x, 1 - math.exp(-x)))
        want["k4"] = (w * x, w * (x + 1))
        want["k3_ratio"] = (w * (math.exp(-x) - 1 + x), w * x)  # w k3' + w' k3 = w x
        assert (v, g) == pytest.approx(want[est], abs=1e-12)


def expected_grad(est, theta, logq, theta_old):
    """E_{y ~ pi_old}[grad_theta est(y)] on a 5-outcome categorical, exactly: a sum over outcomes
    weighted by pi_old."""
    theta = theta.clone().requires_grad_(True)
    logp, logp_old = torch.log_softmax(theta, 0), torch.log_softmax(theta_old, 0)
    (logp_old.exp() * grpo_variants.kl_penalty(logp, logq, logp - logp_old, est)).sum().backward()
    return theta.grad


def test_which_kl_gradients_are_unbiased():
    g = torch.Generator().manual_seed(0)
    theta, theta_old, logq = torch.randn(3, 5, generator=g, dtype=torch.float64).log_softmax(-1)
    t = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(t, 0)
    kls = (logp.exp() * (logp - logq)).sum(), (logq.exp() * (logq - logp)).sum()
    true_kl, reverse = (torch.autograd.grad(kl, t, retain_graph=True)[0] for kl in kls)
    on = {k: expected_grad(k, theta, logq, theta.detach()) for k in choices("kl_estimator")}
    assert true_kl.abs().max() > 0.1 and (true_kl - reverse).abs().max() > 0.1
    assert torch.allclose(on["k2"], true_kl) and torch.allclose(on["k4"], true_kl)  # on-policy
    assert on["k1"].abs().max() < 1e-12  # E[grad log pi] = 0: k1 does not pull toward q
    assert torch.allclose(on["k3"], reverse)  # k3 descends the other KL direction, KL(q || pi)
    assert torch.allclose(on["k3_ratio"], true_kl)  # grad E_old[w k3] = grad E_pi[k3] = grad KL
    off = {k: expected_grad(k, theta, logq, theta_old) for k in ("k2", "k4", "k3_ratio")}
    assert torch.allclose(off["k4"], true_kl) and torch.allclose(off["k3_ratio"], true_kl)
    assert (off["k2"] - true_kl).abs().max() > 1e-3  # k2 is unbiased on-policy only


def test_extreme_log_ratios_are_clamped_so_loss_and_gradient_stay_finite():
    """|log pi - log pi_ref| = 200: unclamped, k3 = exp(200) is inf in fp32, and 0 * inf = NaN even
    at beta = 0."""
    new = torch.tensor([[-200.0, 0.0, -1.0]], requires_grad=True)
    ref, old, mask = torch.tensor([[0.0, -200.0, -1.0]]), new.detach().clone(), torch.ones(1, 3)
    assert torch.isinf(torch.expm1(-(new - ref))).any()  # what the clamp prevents
    for est in choices("kl_estimator"):
        for beta in (0.0, 0.1):
            new.grad = None
            kl = grpo_variants.kl_penalty(new, ref, new - old, est)
            loss = (
                grpo_variants.grpo_loss(new - old, torch.tensor([[1.0]]), mask, 0.2, 0.2)[0]
                + beta * kl
            )
            (loss * grpo_variants.loss_weights(mask, "token")).sum().backward()
            assert torch.isfinite(loss).all() and torch.isfinite(new.grad).all(), est
    clamp = grpo_variants.KL_CLAMP
    assert grpo_variants.kl_penalty(new, ref, new - old, "k1").tolist() == [[-clamp, clamp, 0.0]]


# ---- advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_rewards_are_zero(scale):
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 0.3, 0.3, 0.3, 0.3, 0, 0, 0, 0])
    adv = grpo_variants.group_advantages(scores, 4, "grpo", scale)
    assert torch.isfinite(adv).all() and (adv[:4] == 0).all() and (adv[8:] == 0).all()
    # the unbiased std, + eps: of the group [0, 1, 0, 1], or of all 16 rewards (sum 7.2, squares
    # 6.36: variance (6.36 - 7.2^2 / 16) / 15 = 0.208), or none (Dr. GRPO)
    std = dict(group=0.5 / math.sqrt(0.75), batch=math.sqrt(0.208), none=1)
    want = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / (std[scale] + (scale != "none") * 1e-4)
    assert torch.allclose(adv[4:8], want, atol=1e-6)


def test_rloo_baseline_leaves_each_sample_out():
    scores = torch.tensor([0.0, 1, 1, 3, 2, 2, 2, 2, 0.5, -1, 4, 0])
    adv = grpo_variants.group_advantages(scores, 4, "rloo", "group")  # never divides by the std
    for i, r in enumerate(scores.tolist()):
        group = scores[i // 4 * 4 : i // 4 * 4 + 4].tolist()
        others = group[: i % 4] + group[i % 4 + 1 :]
        assert float(adv[i]) == pytest.approx(r - sum(others) / 3, abs=1e-6)
    assert (adv[4:8] == 0).all()  # equal rewards: no signal, exactly 0
    dr_grpo = grpo_variants.group_advantages(scores, 4, "grpo", "none")
    assert torch.allclose(adv, dr_grpo * 4 / 3)  # G/(G-1) x Dr. GRPO's


# ---- the clipped surrogate and its aggregation


def surrogate_grad(ratio, advantages, clip_low, clip_high, level="token", mask=None):
    """d loss / d log pi per token for given ratios pi / pi_old (B, T); the ratio; the clip."""
    new = ratio.log().clone().requires_grad_(True)
    mask = torch.ones_like(ratio) if mask is None else mask
    logratio = grpo_variants.importance_log_ratio(torch.where(mask.bool(), new, 0.0), mask, level)
    loss, ratio, clipped = grpo_variants.grpo_loss(
        logratio, advantages[:, None], mask, clip_low, clip_high
    )
    (loss * mask).sum().backward()
    return new.grad, ratio.detach(), clipped


def test_clip_higher_widens_the_upper_clip_only():
    """DAPO: with clip_eps_high 0.28 a ratio of 1.25 with a positive advantage still gets a
    gradient (PPO's 0.2 clips it); ratio 0.75 with a negative advantage stays clipped at 0.8."""
    ratio, adv = torch.tensor([[1.25], [0.75]]), torch.tensor([1.0, -1.0])
    sym, _, clipped = surrogate_grad(ratio, adv, 0.2, 0.2)
    assert sym.abs().max() == 0 and clipped.tolist() == [[1.0], [1.0]]
    high, _, clipped = surrogate_grad(ratio, adv, 0.2, 0.28)
    assert float(high[0, 0]) == pytest.approx(-1.25) and float(high[1, 0]) == 0
    assert clipped.tolist() == [[0.0], [1.0]]


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """Ye et al. 2020 eq. 5 with c = 3: A = -1 at ratio 5 loses max(5, 0.8 x 1) = 5 under PPO,
    capped at -cA = 3 with no gradient; ratio 2 (loss 2 < 3) and A = +1 are left alone."""
    ratio, adv = torch.tensor([[5.0], [2.0], [5.0]]), torch.tensor([-1.0, -1.0, 1.0])
    for dual_clip, want_loss, want_grad in (
        (None, [5, 2, -1.2], [5, 2, 0]),
        (3.0, [3, 2, -1.2], [0, 2, 0]),
    ):
        log_ratio = ratio.log().requires_grad_(True)
        loss = grpo_variants.grpo_loss(
            log_ratio, adv[:, None], torch.ones(3, 1), 0.2, 0.2, dual_clip
        )[0]
        loss.sum().backward()
        assert loss.flatten().tolist() == pytest.approx(want_loss)
        assert log_ratio.grad.flatten().tolist() == pytest.approx(want_grad)  # d(-A rho)/d log rho


def test_cispo_caps_the_weight_not_the_gradient():
    """CISPO eq. 4 with clip_high 0.28 and A = 2: d loss / d log pi = -A min(rho, 1.28) at every
    token, where PPO's clipped surrogate gives ratios 1.5 and 3 no gradient at all."""
    rho = [0.5, 1.0, 1.5, 3.0]
    log_ratio = torch.tensor([rho]).log().requires_grad_(True)
    loss, ratio, capped = grpo_variants.cispo_loss(
        log_ratio, torch.tensor([[2.0]]), torch.ones(1, 4), 0.28
    )
    loss.sum().backward()
    weights = [0.5, 1.0, 1.28, 1.28]
    assert log_ratio.grad[0].tolist() == pytest.approx([-2 * w for w in weights])
    want = [-2 * w * math.log(r) for w, r in zip(weights, rho)]  # -A sg(w) log rho
    assert loss[0].tolist() == pytest.approx(want) and capped.tolist() == [[0, 0, 1, 1]]
    ppo = surrogate_grad(torch.tensor([rho]), torch.tensor([2.0]), 0.2, 0.28)[0]
    assert ppo[0].tolist() == pytest.approx([-1.0, -2.0, 0.0, 0.0])


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_soft_gate_by_hand():
    """SAPO: loss -A 4/tau sigmoid(tau (rho - 1)), d loss / d log rho = -A 4 s (1 - s) rho with
    s = sigmoid(tau (rho - 1)); tau_pos 1 where A = 2 > 0, tau_neg 1.05 where A = -1 and A = 0.
    At rho = 1 the gradient is PPO's unclipped -A, and nothing is gated."""
    rho = [0.5, 1.0, 1.5, 3.0]
    log_ratio = torch.tensor([rho, rho, rho]).log().requires_grad_(True)
    adv, mask = torch.tensor([[2.0], [-1.0], [0.0]]), torch.ones(3, 4)
    loss, ratio, gated = grpo_variants.sapo_loss(log_ratio, adv, mask, tau_pos=1.0, tau_neg=1.05)
    loss.sum().backward()
    for row, (a, tau) in enumerate([(2.0, 1.0), (-1.0, 1.05), (0.0, 1.05)]):
        s = [sigmoid(tau * (r - 1)) for r in rho]
        want_loss = [-a * 4 / tau * x for x in s]
        want_grad = [-a * 4 * x * (1 - x) * r for x, r in zip(s, rho)]
        assert loss[row].tolist() == pytest.approx(want_loss)
        assert log_ratio.grad[row].tolist() == pytest.approx(want_grad)
        assert gated[row].tolist() == pytest.approx([1 - 4 * x * (1 - x) for x in s])
    assert log_ratio.grad[0, 1] == -2 and log_ratio.grad[1, 1] == 1  # rho = 1: -A
    assert gated[:, 1].tolist() == [0, 0, 0] and ratio[0].tolist() == pytest.approx(rho)
    # rho = 3: a gradient below the unclipped -A rho = -6, where PPO's clip would give none
    assert 0 < -log_ratio.grad[0, 3] < 0.5 * 2 * 3


def test_gmpo_is_the_papers_geometric_mean_on_a_hand_example():
    """GMPO with clip (e^-0.4, e^0.4), responses of 3 and 2 tokens, A = +1 and -1. Row 0 (A > 0):
    log-ratios 0.5, -0.6, 0.1: only 0.5 is capped (at 0.4); row 1 (A < 0): 0.3, -0.7: only -0.7
    is raised (to -0.4). The paper's J = mean_i A_i (prod_t clip(rho_t))^(1/|y_i|); with
    --loss_aggregation sequence the summed per-token loss is -J, and so is its gradient."""
    logr = [[0.5, -0.6, 0.1, 0.0], [0.3, -0.7, 0.0, 0.0]]
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    log_ratio = torch.tensor(logr, dtype=torch.float64, requires_grad=True)
    loss, ratio, clipped = grpo_variants.gmpo_loss(
        log_ratio, adv, mask, clip_low=0.4, clip_high=0.4
    )
    weights = grpo_variants.loss_weights(mask, "sequence")
    total = (loss * weights).sum()
    total.backward()
    # the paper's formula in ratio space, by hand
    s0 = (math.exp(0.4) * math.exp(-0.6) * math.exp(0.1)) ** (1 / 3)
    s1 = (math.exp(0.3) * math.exp(-0.4)) ** (1 / 2)
    assert total.item() == pytest.approx(-(1 * s0 + -1 * s1) / 2)
    assert ratio[0, :3].tolist() == pytest.approx([s0] * 3) and ratio[1, 0].item() == pytest.approx(
        s1
    )
    assert clipped.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0]]
    # d(-J)/d log rho_t = -A_i s_i / |y_i| / 2 where not clipped, 0 where clipped or padded
    want = [[0, -s0 / 6, -s0 / 6, 0], [s1 / 4, 0, 0, 0]]
    assert log_ratio.grad.tolist() == [pytest.approx(row) for row in want]
    # token aggregation weighs response i by |y_i| / tokens instead: 3/5 and 2/5
    token = (loss * grpo_variants.loss_weights(mask, "token")).sum()
    assert token.item() == pytest.approx(-(3 * s0 - 2 * s1) / 5)


@pytest.mark.parametrize("loss_type", ["ppo", "cispo", "sapo", "gmpo"])
def test_a_responses_advantage_broadcast_to_its_tokens_changes_no_bit(loss_type):
    """Advantages are (B, T) inside the loss: a (B,) advantage expanded over its tokens gives the
    same loss and gradient, bit for bit, as the (B, 1) column the losses broadcast before."""
    g = torch.Generator().manual_seed(0)
    log_ratio = 0.3 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, 1, generator=g)
    mask = (torch.arange(5) < torch.tensor([[5], [3], [1], [4]])).float()
    params = dict(
        ppo=dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
        cispo=dict(clip_high=0.28),
        sapo=dict(tau_pos=1.0, tau_neg=1.05),
        gmpo=dict(clip_low=0.4, clip_high=0.4),
    )[loss_type]
    fn = dict(
        ppo=grpo_variants.grpo_loss, cispo=grpo_variants.cispo_loss, sapo=grpo_variants.sapo_loss
    )
    fn = fn.get(loss_type, grpo_variants.gmpo_loss)
    out = []
    for advantages in (adv, adv.expand(4, 5)):
        x = log_ratio.clone().requires_grad_(True)
        loss, ratio, clipped = fn(x, advantages, mask, **params)
        (loss * mask).sum().backward()
        out.append([loss, ratio, clipped, x.grad])
    for a, b in zip(*out):
        assert torch.equal(a, b)


def reinforce_plus_plus_loop(scores, logprobs, ref_logprobs, lengths, loss_lengths, beta):
    """REINFORCE++ one token at a time: rewards -beta k1 and the score at the last token, the
    return-to-go, then (G - mean) / sqrt(var + 1e-8) over the loss's tokens, var unbiased."""
    returns = []
    for i, n in enumerate(lengths):
        rewards = [-beta * (logprobs[i][t] - ref_logprobs[i][t]) for t in range(n)]
        rewards[n - 1] += scores[i]
        returns.append([sum(rewards[t:]) for t in range(n)])
    pool = [g for row, m in zip(returns, loss_lengths) for g in row[:m]]
    mean = sum(pool) / len(pool)
    var = sum((g - mean) ** 2 for g in pool) / (len(pool) - 1)
    return [[(g - mean) / math.sqrt(var + 1e-8) for g in row] for row in returns]


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_reinforce_plus_plus_advantages_match_a_loop(beta):
    """Responses of 4, 2, 1 and 3 tokens in T = 5, the third out of the loss (as a truncated one
    with --mask_truncated): its tokens leave the whitening's statistics. beta 0: every token of a
    response has its whitened score."""
    g = torch.Generator().manual_seed(0)
    lengths, loss_lengths = [4, 2, 1, 3], [4, 2, 0, 3]
    response_mask = (torch.arange(5) < torch.tensor(lengths)[:, None]).float()
    mask = (torch.arange(5) < torch.tensor(loss_lengths)[:, None]).float()
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    logprobs, ref_logprobs = -torch.rand(2, 4, 5, generator=g)
    advantages = grpo_variants.reinforce_plus_plus_advantages(
        scores, logprobs, ref_logprobs, response_mask, mask, beta
    )
    want = reinforce_plus_plus_loop(
        scores.tolist(), logprobs.tolist(), ref_logprobs.tolist(), lengths, loss_lengths, beta
    )
    for i, m in enumerate(loss_lengths):
        assert advantages[i, :m].tolist() == pytest.approx(want[i][:m], abs=1e-5)
        assert (advantages[i, m:] == 0).all()  # out of the loss: 0
    if beta == 0:  # no KL: a response's tokens share (score - token mean) / token std
        assert advantages[0, :4].tolist() == pytest.approx([advantages[0, 0].item()] * 4)
    if beta > 0:  # the KL makes them differ along the response
        assert advantages[0, 0] != pytest.approx(advantages[0, 3].item())
    no_reference = grpo_variants.reinforce_plus_plus_advantages(
        scores, logprobs, None, response_mask, mask, beta
    )
    zero_beta = grpo_variants.reinforce_plus_plus_advantages(
        scores, logprobs, ref_logprobs, response_mask, mask, 0.0
    )
    assert torch.equal(no_reference, zero_beta)


def test_gspo_clips_one_ratio_per_sequence():
    """GSPO: every token of a response shares ratio exp(mean token log-ratio), clipped once. Row 0:
    one token at ratio 1.5 (token-level: clipped) but a mean inside the clip range: no clip."""
    logr = torch.tensor([[0.4055, -0.1, -0.1, 30.0], [0.3, 0.3, 0.0, 0.0]])  # 30: masked
    mask, adv = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]]), torch.tensor([1.0, 1.0])
    tok_grad, _, tok_clipped = surrogate_grad(logr.exp(), adv, 0.2, 0.2, "token", mask)
    seq_grad, seq_ratio, seq_clipped = surrogate_grad(logr.exp(), adv, 0.2, 0.2, "sequence", mask)
    s0, s1 = math.exp((0.4055 - 0.2) / 3), math.exp(0.3)
    assert torch.allclose(seq_ratio[0, :3], torch.full((3,), s0))
    assert torch.allclose(seq_ratio[1, :2], torch.full((2,), s1))
    assert tok_clipped[0, 0] == 1 and (seq_clipped[0] * mask[0]).sum() == 0  # token, not sequence
    assert (seq_clipped[1, :2] == 1).all() and (seq_grad[1] == 0).all()  # exp(0.3) > 1.2: whole
    # d s0 / d log pi_t = s0 / |y|, and the loss summed over the |y| tokens holds |y| copies of
    # -A s0: -s0 each; none for the masked token
    assert torch.allclose(seq_grad[0], torch.tensor([-s0] * 3 + [0.0]), atol=1e-6)
    assert tok_grad[0, 0] == 0


def test_aggregation_weights_and_dr_grpo_constant_normaliser():
    """d loss / d per-token loss: token = 1 / tokens, sequence = 1 / (len_i * responses), dr_grpo =
    1 / (responses * response_length) for every token whatever the lengths (no length bias)."""
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    weights = {how: grpo_variants.loss_weights(mask, how) for how in choices("loss_aggregation")}
    assert torch.allclose(weights["token"], mask / 7)
    assert torch.allclose(weights["sequence"], mask / mask.sum(1, keepdim=True) / 3)
    assert torch.allclose(weights["dr_grpo"], mask / 12)


def test_kl_in_reward_subtracts_beta_times_the_summed_log_ratio():
    """r - beta sum_t (log pi_old - log pi_ref), beta 0.1: row 0 sums 0.5 - 1 + 0 = -0.5 -> 1.05;
    row 1 sums -0.2 + 0.3 = 0.1 -> -0.01 (its third token is past the stop: left out)."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.3, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.6, 7.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    scores = grpo_variants.kl_in_reward(torch.tensor([1.0, 0.0]), old, ref, mask, 0.1)
    assert scores.tolist() == pytest.approx([1.05, -0.01])


def test_overlong_penalty_is_dapo_eq_13():
    """L = 16, L_c = 4, penalty 0.5: 0 up to 12 tokens, (12 - |y|) / 4 x 0.5 up to 16, -0.5 beyond."""
    lengths = torch.tensor([10.0, 12, 13, 14, 16, 17])
    penalty = grpo_variants.overlong_penalty(lengths, 16, 4, 0.5)
    assert penalty.tolist() == pytest.approx([0, 0, -0.125, -0.25, -0.5, -0.5])


def test_adaptive_entropy_coef_steps_toward_the_target():
    """Skywork-OR1, target 0.2, delta 0.005: below it c rises and applies; above it c falls (not
    below 0) and no bonus applies."""
    assert grpo_variants.adaptive_entropy_coef(0.01, 0.1, 0.2, 0.005) == pytest.approx(
        (0.015, 0.015)
    )
    assert grpo_variants.adaptive_entropy_coef(0.01, 0.3, 0.2, 0.005) == pytest.approx((0.005, 0.0))
    assert grpo_variants.adaptive_entropy_coef(0.003, 0.3, 0.2, 0.005) == (0.0, 0.0)


def test_dynamic_sampling_keeps_groups_with_reward_variance_then_tops_up_masked():
    """G = 2: round 0 has one group with variance, round 1 two more: 2 are needed, so it stops
    there. Asked for 3 with one extra round at most, it tops the batch up with the first
    zero-variance group, masked out of the loss."""
    rounds = [[1.0, 1, 0, 1, 0, 0], [1.0, 0, 2, 2, 3, 4], [0.0, 1, 0, 1, 0, 1]]
    rollout = lambda r: dict(
        scores=torch.tensor(rounds[r]), mask=torch.ones(6, 2), row=r * 6 + torch.arange(6)
    )
    batch, sampled = grpo_variants.dynamic_sampling(rollout, 2, 2, 4, rank=0, world_size=1)
    assert batch["row"].tolist() == [2, 3, 6, 7] and batch["mask"].all()
    assert sampled["row"].tolist() == list(range(12))  # all of both rounds, for the metrics
    batch, sampled = grpo_variants.dynamic_sampling(rollout, 4, 2, 1, rank=0, world_size=1)
    assert batch["row"].tolist() == [2, 3, 6, 7, 10, 11, 0, 1]
    assert batch["mask"][:, 0].tolist() == [1] * 6 + [0] * 2 and len(sampled["row"]) == 12


# ---- real batches


def tiny(vocab=257, pad=EOS):
    """A random tiny model whose final LayerNorm bias adds ~3 to the stop token's logit: it stops
    within a few steps."""
    torch.manual_seed(0)
    model = gpt2.load("tiny", dict(vocab_size=vocab, eos_token_id=EOS, pad_token_id=pad)).eval()
    with torch.no_grad():
        w = model.transformer.wte.weight[EOS]
        model.transformer.ln_f.bias += 3.0 * w / w.square().sum()
    return model


def test_pad_other_than_eos_gives_the_same_logprobs_losses_and_rewards():
    """The same batch padded with the stop token (256) and with a distinct pad id (257): masks come
    from the first stop token and from query != pad, so log-probs, losses and rewards agree."""
    P = -1  # placeholder for the pad id
    query = [[P, P, 5, 6], [7, 8, 9, 10], [P, 3, 4, 5], [P, P, P, 2]]
    response = [[10, EOS, P, P], [11, 12, EOS, P], [13, 14, 15, 16], [EOS, P, P, P]]
    out = {}
    for pad in (EOS, 257):
        model = tiny(258, pad)
        meta = dict(vocab_size=258, eos_token_id=EOS, pad_token_id=pad)
        torch.manual_seed(1)
        rm = gpt2.load("tiny", meta, head="new").eval()
        q, r = (
            torch.tensor([[pad if t == P else t for t in row] for row in x])
            for x in (query, response)
        )
        mask = gpt2.response_mask(r, EOS).float()
        new, _ = gpt2.logprobs(model, q, r, 1.0)
        old, ref = (new - 0.1 * mask).detach(), (new + 0.2).detach()
        logratio = torch.where(mask.bool(), new - old, 0.0)
        advantages = torch.tensor([[1.0], [-1.0], [0.5], [2.0]])
        loss = grpo_variants.grpo_loss(logratio, advantages, mask, 0.2, 0.28)[0]
        loss = loss + 0.1 * grpo_variants.kl_penalty(new, ref, logratio, "k3")
        agg = [
            (loss * grpo_variants.loss_weights(mask, how)).sum()
            for how in choices("loss_aggregation")
        ]
        out[pad] = [new * mask, *agg, gpt2.get_reward(rm, q, r, pad, EOS)]
    for a, b in zip(out[EOS], out[257]):
        assert torch.allclose(a, b, atol=1e-5), (a, b)


# ---- end to end


RSO = (
    "--rejection_sampling_candidates 8 --scale_rewards batch --overlong_buffer 2 --loss_type cispo"
)


@pytest.mark.parametrize(
    "variant",
    [
        "--dynamic_sampling --mask_truncated --clip_eps_high 0.28",
        RSO + " --kl_in_reward",
        "--loss_type sapo --advantage reinforce_plus_plus",
    ],
)
def test_one_rank_equals_two_ranks_and_first_minibatch_ratio_is_one(tmp_path, sft_model, variant):
    common = ["--model", sft_model, "--total_episodes", "64", "--eval_every", "2", "--beta", "0.05"]
    common += [*SMALL, *variant.split()]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2]
    assert a[1]["objective/zero_std_frac"] < 1 and a[1]["train/grad_norm"] > 0  # some signal
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in (k for k in x if not k.startswith("perf/")):
            assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])
    for m in a[1:]:  # one minibatch, one epoch: each update is the first, pi_theta = pi_old
        assert abs(m["val/ratio"] - 1) < 1e-6 and abs(m["val/ratio_var"]) < 1e-10
        assert m["policy/approxkl_avg"] < 1e-10 and m["policy/clipfrac_avg"] == 0
    # the reference is the starting checkpoint: KL 0 at step 1 (to the sampler's rounding)
    assert a[1]["objective/kl"] < 1e-10 and a[2]["objective/kl"] > 1e-6
    assert (tmp_path / "r2" / "model.safetensors").exists()
    if "reinforce_plus_plus" in variant:  # the KL is in the reward: none in the loss
        assert all("loss/kl_avg" not in m for m in a[1:])
    if "rejection_sampling" in variant:  # 1 round at least, G = 4 at most; no KL in the loss
        assert all(1 <= m["objective/rso_rounds"] <= 4 and "loss/kl_avg" not in m for m in a[1:])
    if "dynamic" in variant:  # every trained group has reward variance; the others were dropped
        for m in a[1:]:
            dropped = m["objective/zero_std_frac"] * 8 * m["objective/sampling_rounds"]
            assert m["objective/dropped_groups"] == pytest.approx(dropped)
        assert any(m["objective/dropped_groups"] > 0 for m in a[1:])


def test_top_p_one_rank_equals_two_ranks_and_first_minibatch_ratio_is_one(tmp_path, sft_model):
    """--top_k 50 --top_p 0.9: 1 rank == 2 ranks and the first-minibatch invariant. The
    reference keeps the full distribution, so step 1's KL is the truncation's own, > 0."""
    common = ["--model", sft_model, "--total_episodes", "64", "--eval_every", "2", "--beta", "0.05"]
    common += [*SMALL, "--top_k", "50", "--top_p", "0.9"]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2]
    assert a[1]["train/grad_norm"] > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in (k for k in x if not k.startswith("perf/")):
            assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])
    for m in a[1:]:
        assert abs(m["val/ratio"] - 1) < 1e-6 and abs(m["val/ratio_var"]) < 1e-10
        assert m["policy/approxkl_avg"] < 1e-10 and m["policy/clipfrac_avg"] == 0
    assert a[1]["objective/kl"] > 1e-6


def test_top_p_sampler_log_probs_are_the_trainers(tmp_path, sft_model):
    """--lr 0 and 2 minibatches: the second minibatch's pi_old is the sampler's log-prob, its
    pi_theta the loss's forward of the same weights. Both over the kept tokens, renormalised,
    so the ratio is 1 to rounding; a trainer on the full vocabulary would read the kept mass
    (trl#6789)."""
    flags = ["--model", sft_model, "--total_episodes", "32", *SMALL, "--lr", "0"]
    flags += ["--num_minibatches", "2", "--top_p", "0.7", "--out_dir", str(tmp_path)]
    run_here(flags)
    m = metrics(tmp_path)[-1]
    assert m["step"] == 1 and abs(m["val/ratio"] - 1) < 1e-5, m
    assert m["policy/approxkl_avg"] < 1e-10 and m["train/grad_norm"] > 0, m


def test_hard_refresh_every_step_keeps_the_kl_at_zero(tmp_path, sft_model):
    """--ref_sync_every 1 --ref_sync_mix 1: after each step's update π_ref is a copy of π, so each
    step samples from its reference: KL(π_old || π_ref) is 0 at every step, not only the first."""
    common = ["--model", sft_model, "--total_episodes", "96", "--beta", "0.05", *SMALL]
    run_here(["--out_dir", str(tmp_path), *common, "--ref_sync_every", "1", "--ref_sync_mix", "1"])
    m = metrics(tmp_path)
    assert [r["step"] for r in m] == [0, 1, 2, 3]
    assert all(r["objective/kl"] < 1e-10 for r in m[1:]), [r["objective/kl"] for r in m[1:]]
    assert m[-1]["objective/scores"] != m[1]["objective/scores"]  # yet the policy moved


def test_refresh_one_rank_equals_two_ranks_and_resumes_bitwise(tmp_path, sft_model):
    """The soft update every 2 steps: 1 rank == 2 ranks, and a resume from the step-2 checkpoint
    (π_ref mixed at step 2: neither --model nor π) ends where the uninterrupted run ended, to the
    bit; the reference's weights are in the checkpoint."""
    common = ["--model", sft_model, "--total_episodes", "128", "--eval_every", "2"]
    common += ["--beta", "0.05", "--ref_sync_every", "2", "--ref_sync_mix", "0.5", *SMALL]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a, b):
        for k in (k for k in x if not k.startswith("perf/")):
            assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])
    ckpt = tmp_path / "r1" / "checkpoints" / "step_00000002"
    assert (ckpt / "reference" / "model.safetensors").exists()
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    run(["--out_dir", str(tmp_path / "resumed"), "--resume", *common], nproc=1)
    resumed = metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4] and resumed[0]["objective/kl"] > 0
    for x, y in zip(a[3:], resumed):
        assert {k: v for k, v in x.items() if not k.startswith("perf/")} == {
            k: v for k, v in y.items() if not k.startswith("perf/")
        }
    for name in ("model.safetensors", "checkpoints/step_00000004/reference/model.safetensors"):
        want = load_file(str(tmp_path / "r1" / name))
        got = load_file(str(tmp_path / "resumed" / name))
        assert all(torch.equal(want[k], got[k]) for k in want), name


def test_mask_truncated_leaves_responses_without_a_stop_token_out(tmp_path, sft_model):
    """One token per response: the SFT model's answers start with a digit, so none stops. With
    --mask_truncated no token is in the loss (the token means and the gradient are 0); without it
    every response's token is (ratio 1)."""
    common = ["--model", sft_model, "--total_episodes", "32", *SMALL, "--response_length", "1"]
    run_here(["--out_dir", str(tmp_path / "masked"), "--mask_truncated", *common])
    run_here(["--out_dir", str(tmp_path / "kept"), *common])
    masked, kept = metrics(tmp_path / "masked")[-1], metrics(tmp_path / "kept")[-1]
    assert masked["val/stop_frac"] == kept["val/stop_frac"] == 0
    assert masked["val/ratio"] == masked["train/grad_norm"] == masked["objective/entropy"] == 0
    assert kept["val/ratio"] == pytest.approx(1) and kept["objective/entropy"] > 0


def test_tiny_runs_with_every_option(tmp_path, sft_model):
    """A reward model with k4, GSPO, per-response mean, no std, batch whitening, dual-clip, adaptive entropy, sampled and preference evals, 2 minibatches x 2 epochs; then the
    verifier with DAPO's options, Dr. GRPO's normaliser, RLOO and RSO at beta 0 (no reference)."""
    rm = gpt2.load(sft_model, META, head="new")  # random head: continuous scores
    rm.reward_gain, rm.reward_bias = 2.0, -1.0
    gpt2.save(rm, str(tmp_path / "rm"))
    common = ["--model", sft_model, "--total_episodes", "96", "--eval_every", "3", *SMALL]
    flags = f"--reward_model {tmp_path / 'rm'} --num_minibatches 2 --num_epochs 2 "
    flags += "--micro_batch_size 4 --kl_estimator k4 --beta 0.1 --loss_aggregation sequence "
    flags += "--scale_rewards none --batch_norm_advantages --response_length 6 "
    flags += "--importance_level sequence --dual_clip 3 --eval_samples 2 "
    flags += "--entropy_target 100 --entropy_coef 0.01"  # always below: c rises by 0.005 a step
    run_here(["--out_dir", str(tmp_path / "a"), *common, *flags.split()])
    m = metrics(tmp_path / "a")
    assert [r["step"] for r in m] == [0, 1, 2, 3] and all(
        math.isfinite(v) for r in m for v in r.values()
    )
    assert m[1]["objective/zero_std_frac"] < 0.5 and "eval/accuracy" in m[-1]  # RM scores differ
    assert (
        m[-1]["policy/approxkl_avg"] > 0 and m[-1]["val/ratio_var"] > 0
    )  # later passes: off-policy
    assert gpt2.load(str(tmp_path / "a")).config.n_layer == 4
    # the bonus applied: none before a first entropy below the target, then c0 + delta, + delta
    assert [r["policy/entropy_coef"] for r in m[1:]] == pytest.approx([0.0, 0.015, 0.02])
    assert {"eval/pass@1", "eval/pass@2", "eval/mean@2"} <= m[0].keys()
    assert m[0]["eval/preference_accuracy"] == 0.5  # the policy is its reference: every r = 0
    flags = "--dynamic_sampling --max_sampling_rounds 2 --mask_truncated --clip_eps_high 0.28 "
    flags += "--loss_aggregation dr_grpo --scale_rewards none --advantage rloo "
    flags += "--rejection_sampling_candidates 6"
    run_here(["--out_dir", str(tmp_path / "b"), *common, *flags.split()])
    m = metrics(tmp_path / "b")
    assert [r["step"] for r in m] == [0, 1, 2, 3] and all(
        math.isfinite(v) for r in m for v in r.values()
    )
    assert not any("objective/kl" in r for r in m)
    assert all(r["objective/sampling_rounds"] in (1, 2, 3) for r in m[1:])
    assert all(1 <= r["objective/rso_rounds"] <= 4 for r in m[1:])


def test_tiny_runs_with_sapo_gmpo_and_reinforce_plus_plus(tmp_path, sft_model):
    """2 minibatches x 2 epochs, so later passes are off-policy: GMPO as its paper runs it (log
    clip 0.4, mean over responses) with a KL in the loss; SAPO with REINFORCE++ at beta 0 (no
    reference: each token's advantage is its response's whitened score)."""
    common = ["--model", sft_model, "--total_episodes", "64", "--eval_every", "2", *SMALL]
    common += ["--num_minibatches", "2", "--num_epochs", "2"]
    gmpo = "--loss_type gmpo --clip_eps_low 0.4 --clip_eps_high 0.4 --loss_aggregation sequence "
    gmpo += "--beta 0.05"
    sapo = "--loss_type sapo --sapo_tau_neg 2 --advantage reinforce_plus_plus"
    for name, flags in (("gmpo", gmpo), ("sapo", sapo)):
        run_here(["--out_dir", str(tmp_path / name), *common, *flags.split()])
        m = metrics(tmp_path / name)
        assert [r["step"] for r in m] == [0, 1, 2], name
        assert all(math.isfinite(v) for r in m for v in r.values()), name
        # off-policy passes: the ratio moved, and the clip (GMPO) or the gate (SAPO) acted
        assert all(r["policy/approxkl_avg"] > 0 and r["policy/clipfrac_avg"] > 0 for r in m[1:])
    assert "loss/kl_avg" in metrics(tmp_path / "gmpo")[1]
    assert not any("objective/kl" in r or "loss/kl_avg" in r for r in metrics(tmp_path / "sapo"))


def test_resume_matches_uninterrupted(tmp_path, sft_model):
    common = ["--model", sft_model, "--total_episodes", "128", "--eval_every", "2"]
    common += ["--keep_checkpoints", "5", "--beta", "0.05", *SMALL]
    common += ["--entropy_target", "100", "--entropy_coef", "0.01"]  # a coefficient to restore
    run_here(["--out_dir", str(tmp_path / "full"), *common])
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    run_here(["--out_dir", str(tmp_path / "resumed"), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    for m in resumed:  # the reference stays the starting model, not the checkpoint resumed from
        assert m["objective/kl"] > 0, m
        for k in (k for k in m if not k.startswith("perf/")):
            assert abs(m[k] - full[m["step"]][k]) < 1e-6, (k, m[k], full[m["step"]][k])


BAD = {  # flags: the error
    "--lr -1": "--lr -1.0: must be >= 0",
    "--num_prompts_per_step 0": "--num_prompts_per_step 0: must be at least 1",
    "--temperature nan": "--temperature nan: not a finite number",
    "--clip_eps_low inf": "--clip_eps_low inf: not a finite number",
    "--clip_eps_low 1": "--clip_eps_low 1.0: must be < 1",
    "--max_grad_norm 0": "--max_grad_norm 0.0: must be > 0",
    "--eval_size -1": "--eval_size -1: must be >= 0",
    "--num_minibatches 0": "--num_minibatches 0: must be at least 1",
    "--num_samples_per_prompt 1": "--num_samples_per_prompt 1: a group needs >= 2",
    "--num_minibatches 3": "4 does not divide by 3: change --num_minibatches",
    "--model /x": "no checkpoint at '/x'",
    "--total_episodes 8": "--total_episodes 8: less than one step's 32 responses",
    "--response_length 80": "exceed the model's context: lower --response_length",
    "--dual_clip 0.5": "--dual_clip 0.5: must be > 1",
    "--loss_type cispo --dual_clip 3": "with --loss_type ppo",
    "--rejection_sampling_candidates 2": "--rejection_sampling_candidates 2: fewer than",
    "--rso_temperature 0": "--rso_temperature 0.0: must be > 0",
    "--overlong_buffer 5": "--overlong_buffer 5: more than --response_length 4",
    "--top_k -1": "--top_k -1: must be >= 0",
    "--top_p 0": "--top_p 0.0: must be in (0, 1]",
    "--top_p 1.5": "--top_p 1.5: must be in (0, 1]",
    "--top_p nan": "--top_p nan: must be in (0, 1]",
    "--loss_type sapo --sapo_tau_pos 0": "--sapo_tau_pos 0.0: must be > 0",
    "--loss_type sapo --sapo_tau_neg -1": "--sapo_tau_neg -1.0: must be > 0",
    "--sapo_tau_neg inf": "--sapo_tau_neg inf: not a finite number",
    "--loss_type sapo --dual_clip 3": "with --loss_type ppo",
    "--loss_type gmpo --dual_clip 3": "with --loss_type ppo",
    "--advantage reinforce_plus_plus --kl_in_reward": "--kl_in_reward: REINFORCE++ has the KL",
    "--advantage reinforce_plus_plus --batch_norm_advantages": "--batch_norm_advantages: REINFORCE++",
    "--ref_sync_every -1": "--ref_sync_every -1: must be >= 0",
    "--ref_sync_every 2": "--ref_sync_every refreshes pi_ref: pass --beta > 0 (or --ref_model)",
    "--beta 0.1 --ref_sync_every 2 --ref_sync_mix 0": "--ref_sync_mix 0.0: α is in (0, 1]",
    "--beta 0.1 --ref_sync_mix 1.5": "--ref_sync_mix 1.5: α is in (0, 1]",
}


@pytest.mark.parametrize("flags, expected", BAD.items())
def test_bad_flags_give_one_line_errors(tmp_path, sft_model, flags, expected):
    """In process (as a user runs one: tests/test_grpo.py's): each is raised before the run dir
    is claimed."""
    args = ["--model", sft_model, "--out_dir", str(tmp_path / "x"), *SMALL, *flags.split()]
    line = error_line(grpo_variants, args)
    assert expected in line, line
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "flag, value",
    [("kl_estimator", "k5"), ("loss_aggregation", "x"), ("scale_rewards", "std")]
    + [("loss_type", "x"), ("advantage", "x"), ("importance_level", "x"), ("dtype", "fp16")],
)
def test_choice_flags_reject_other_values_listing_the_choices(capsys, flag, value):
    """Literal flags: tyro stops at parsing (exit status 2), naming the value and every choice."""
    with pytest.raises(SystemExit) as e:
        grpo_variants.tyro.cli(grpo_variants.Args, args=[f"--{flag}", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"'{value}'" in err, err
    assert all(choice in err for choice in choices(flag)), err
