"""grpo.py: KL estimators (values, gradients, which are unbiased, the clamp), advantages (GRPO, RLOO), each variant's
defining property (clip-higher, GSPO, Dr. GRPO's constant normaliser, truncation masking, dynamic sampling), the
sampler's log-probs, pad != eos; end to end: 1 rank == 2 ranks with the first-minibatch invariant, KL 0 at step 1,
every option, resume == uninterrupted (after SIGKILL too), a dead rank ends torchrun, one-line errors."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import gpt2  # noqa: E402
import grpo  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
EOS = 256  # the offline task's <|endoftext|>, also its pad
# 3 tokens: longer answers miss the stop token and get the penalty, so groups have reward variance from the start
SMALL = ["--num_prompts_per_step", "8", "--num_samples_per_prompt", "4", "--micro_batch_size", "8", "--eval_size", "32",
         "--response_length", "4", "--missing_eos_penalty", "1", "--log_every", "1", "--lr", "3e-4", "--num_minibatches", "1"]


def run(args, nproc=0, check=True, cwd=ROOT, script="grpo.py"):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    p = subprocess.run(launcher + [script, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 or not check, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def metrics(out_dir):  # one dict per logged step
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """A tiny model after a short SFT: it has learnt to answer with digits and a stop token."""
    out = tmp_path_factory.mktemp("sft")
    run(["--out_dir", str(out), "--total_steps", "250", "--eval_every", "250", "--batch_size", "64", "--micro_batch_size",
         "64", "--warmup_steps", "20", "--eval_size", "8", "--log_every", "250"], script="sft.py")  # fmt: skip
    return str(out)


# ---- KL estimators

NEW, REF, OLD = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5], [-1.2, -2.5, -0.4]


@pytest.mark.parametrize("est", grpo.KL_ESTIMATORS)
def test_kl_estimator_values_and_gradients(est):
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    ref, old = torch.tensor(REF, dtype=torch.float64), torch.tensor(OLD, dtype=torch.float64)
    (value := grpo.kl_penalty(new, ref, old, est)).sum().backward()
    for n, r, o, v, g in zip(NEW, REF, OLD, value.tolist(), new.grad.tolist()):
        x, w = n - r, math.exp(n - o)  # log(pi/pi_ref), importance weight pi/pi_old
        want = {"k1": (x, 1), "k2": (x * x / 2, x), "k3": (math.exp(-x) - 1 + x, 1 - math.exp(-x)), "k4": (w * x, w * (x + 1))}
        assert (v, g) == pytest.approx(want[est], abs=1e-12)


def expected_grad(est, theta, logq, theta_old):
    """E_{y ~ pi_old}[grad_theta est(y)] on a 5-outcome categorical, exactly: a sum over outcomes weighted by pi_old."""
    theta = theta.clone().requires_grad_(True)
    logp, logp_old = torch.log_softmax(theta, 0), torch.log_softmax(theta_old, 0)
    (logp_old.exp() * grpo.kl_penalty(logp, logq, logp_old, est)).sum().backward()
    return theta.grad


def test_which_kl_gradients_are_unbiased():
    g = torch.Generator().manual_seed(0)
    theta, theta_old, logq = torch.randn(3, 5, generator=g, dtype=torch.float64).log_softmax(-1)  # q: the reference
    t = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(t, 0)
    true_kl, reverse = (torch.autograd.grad(kl, t, retain_graph=True)[0] for kl in (
        (logp.exp() * (logp - logq)).sum(), (logq.exp() * (logq - logp)).sum()))  # KL(pi_theta || q), KL(q || pi_theta)
    on = {k: expected_grad(k, theta, logq, theta.detach()) for k in grpo.KL_ESTIMATORS}  # pi_old = pi_theta
    assert true_kl.abs().max() > 0.1 and (true_kl - reverse).abs().max() > 0.1
    assert torch.allclose(on["k2"], true_kl) and torch.allclose(on["k4"], true_kl)  # unbiased on-policy
    assert on["k1"].abs().max() < 1e-12  # E[grad log pi] = 0: k1 does not pull toward q
    assert torch.allclose(on["k3"], reverse)  # k3 descends the other KL direction, KL(q || pi)
    off = {k: expected_grad(k, theta, logq, theta_old) for k in ("k2", "k4")}  # later minibatches: pi_old != pi
    assert torch.allclose(off["k4"], true_kl)  # the importance weight keeps k4 unbiased off-policy
    assert (off["k2"] - true_kl).abs().max() > 1e-3  # k2 is unbiased on-policy only


def test_extreme_log_ratios_are_clamped_so_loss_and_gradient_stay_finite():
    """|log pi - log pi_ref| = 200: unclamped, k3 = exp(200) is inf in fp32, and 0 * inf = NaN even at beta = 0."""
    new = torch.tensor([[-200.0, 0.0, -1.0]], requires_grad=True)
    ref, old, mask = torch.tensor([[0.0, -200.0, -1.0]]), new.detach().clone(), torch.ones(1, 3)
    assert torch.isinf(torch.expm1(-(new - ref))).any()  # what the clamp prevents
    for est in grpo.KL_ESTIMATORS:
        for beta in (0.0, 0.1):
            new.grad = None
            loss, st = grpo.grpo_loss(new, old, ref, torch.tensor([1.0]), mask, 0.2, 0.2, beta, est)
            grpo.aggregate_loss(loss, mask, "token", 3, 1, 3).backward()
            assert torch.isfinite(loss).all() and torch.isfinite(st["kl"]).all() and torch.isfinite(new.grad).all(), est
    assert grpo.kl_penalty(new, ref, old, "k1").tolist() == [[-grpo.KL_CLAMP, grpo.KL_CLAMP, 0.0]]


# ---- advantages


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_equal_rewards_are_zero(scale):
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 0.3, 0.3, 0.3, 0.3, 0, 0, 0, 0])
    adv = grpo.group_advantages(scores, 4, "grpo", scale)
    assert torch.isfinite(adv).all() and (adv[:4] == 0).all() and (adv[8:] == 0).all()
    want = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / ((0.5 / math.sqrt(0.75) + 1e-4) if scale else 1.0)  # unbiased std
    assert torch.allclose(adv[4:8], want, atol=1e-6)


def test_rloo_baseline_leaves_each_sample_out():
    scores = torch.tensor([0.0, 1, 1, 3, 2, 2, 2, 2, 0.5, -1, 4, 0])
    adv = grpo.group_advantages(scores, 4, "rloo", scale_by_std=True)  # RLOO never divides by the std
    for i, r in enumerate(scores.tolist()):
        group = scores[i // 4 * 4 : i // 4 * 4 + 4].tolist()
        others = group[: i % 4] + group[i % 4 + 1 :]
        assert float(adv[i]) == pytest.approx(r - sum(others) / 3, abs=1e-6)
    assert (adv[4:8] == 0).all()  # equal rewards: no signal, exactly 0
    assert torch.allclose(adv, grpo.group_advantages(scores, 4, "grpo", False) * 4 / 3)  # G/(G-1) x Dr. GRPO's


# ---- the clipped surrogate and its aggregation


def surrogate_grad(ratio, advantages, clip_low, clip_high, level="token", mask=None):
    """d loss / d log pi per token for given ratios pi / pi_old (B, T)."""
    new = ratio.log().clone().requires_grad_(True)
    mask = torch.ones_like(ratio) if mask is None else mask
    loss, st = grpo.grpo_loss(new, torch.zeros_like(ratio), None, advantages, mask, clip_low, clip_high, 0.0, "k3", level)
    (loss * mask).sum().backward()
    return new.grad, st


def test_clip_higher_widens_the_upper_clip_only():
    """DAPO: with clip_eps_high 0.28 a ratio of 1.25 with a positive advantage still gets a gradient (PPO's 0.2 clips
    it); the lower side, ratio 0.75 with a negative advantage, stays clipped at 0.8."""
    ratio, adv = torch.tensor([[1.25], [0.75]]), torch.tensor([1.0, -1.0])
    sym, st = surrogate_grad(ratio, adv, 0.2, 0.2)
    assert sym.abs().max() == 0 and st["clipfrac"].tolist() == [[1.0], [1.0]]
    high, st = surrogate_grad(ratio, adv, 0.2, 0.28)
    assert float(high[0, 0]) == pytest.approx(-1.25) and float(high[1, 0]) == 0 and st["clipfrac"].tolist() == [[0.0], [1.0]]


def test_gspo_clips_one_ratio_per_sequence():
    """GSPO: every token of a response shares ratio exp(mean token log-ratio) over its tokens, clipped once. Row 0: one
    token at ratio 1.5 (token-level: clipped) but a sequence mean inside the clip range: no clipping at all."""
    logr = torch.tensor([[0.4055, -0.1, -0.1, 30.0], [0.3, 0.3, 0.0, 0.0]])  # 30: past the stop token, masked
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    tok_grad, tok = surrogate_grad(logr.exp(), torch.tensor([1.0, 1.0]), 0.2, 0.2, "token", mask)
    seq_grad, seq = surrogate_grad(logr.exp(), torch.tensor([1.0, 1.0]), 0.2, 0.2, "sequence", mask)
    s0, s1 = math.exp((0.4055 - 0.2) / 3), math.exp(0.3)
    assert torch.allclose(seq["ratio"][0, :3], torch.full((3,), s0)) and torch.allclose(seq["ratio"][1, :2], torch.full((2,), s1))
    assert tok["clipfrac"][0, 0] == 1 and (seq["clipfrac"][0] * mask[0]).sum() == 0  # token clipped, sequence not
    assert (seq["clipfrac"][1, :2] == 1).all() and (seq_grad[1] == 0).all()  # row 1: exp(0.3) > 1.2, clipped whole
    # d s0 / d log pi_t = s0 / |y|, and the loss summed over the |y| tokens holds |y| copies of -A s0: -s0 each; none
    # for the masked token
    assert torch.allclose(seq_grad[0], torch.tensor([-s0] * 3 + [0.0]), atol=1e-6) and tok_grad[0, 0] == 0


def test_aggregation_weights_and_dr_grpo_constant_normaliser():
    """d loss / d per-token loss: token = 1 / tokens, sequence = 1 / (len_i * responses), dr_grpo = 1 / (responses *
    response_length) for every token whatever the lengths (Dr. GRPO: no length bias)."""
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    weights = {}
    for how in ("token", "sequence", "dr_grpo"):
        per_token = torch.zeros(3, 4, requires_grad=True)
        grpo.aggregate_loss(per_token, mask, how, mask.sum(), 3, 3 * 4).backward()
        weights[how] = per_token.grad
    assert torch.allclose(weights["token"], mask / 7)
    assert torch.allclose(weights["sequence"], mask / mask.sum(1, keepdim=True) / 3)
    assert torch.allclose(weights["dr_grpo"], mask / 12)


def test_mask_truncated_leaves_responses_without_a_stop_token_out():
    response = torch.tensor([[5, EOS, 9, 9], [5, 6, 7, 8], [EOS, 9, 9, 9]])
    assert grpo.loss_mask(response, EOS, False).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert grpo.loss_mask(response, EOS, True).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_dynamic_sampling_keeps_groups_with_reward_variance_then_tops_up_masked():
    scores = torch.tensor([1.0, 1, 0, 1, 0, 0, 1, 0, 2, 2])  # G = 2: groups 1 and 3 have variance
    rows, in_loss = grpo.select_groups(scores, 2, 2)
    assert rows.tolist() == [2, 3, 6, 7] and in_loss.all()
    rows, in_loss = grpo.select_groups(scores, 2, 3)  # one group short: the first zero-variance one, masked out
    assert rows.tolist() == [2, 3, 6, 7, 0, 1] and in_loss.tolist() == [True] * 4 + [False] * 2


# ---- log-probs of real batches


def tiny(vocab=257):
    """A random tiny model whose final LayerNorm bias adds ~3 to the stop token's logit: it stops within a few steps."""
    torch.manual_seed(0)
    model = gpt2.load_model("tiny", vocab_size=vocab).eval()
    with torch.no_grad():
        w = model.transformer.wte.weight[EOS]
        model.transformer.ln_f.bias += 3.0 * w / w.square().sum()
    return model


@torch.no_grad()
def test_sampler_logprobs_equal_a_separate_forward_pass():
    """pi_old's log-probs come from generation (no second pass): they equal forward_logprobs (fp32) on every token in
    the loss, and forward_logprobs' logsumexp gather and entropy equal log_softmax's."""
    model, T = tiny(), 0.7
    query = torch.tensor([[EOS, EOS, 1, 2, 3], [4, 5, 6, 7, 8], [EOS, 9, 10, 11, 12]]).repeat_interleave(4, 0)
    response, logprobs = gpt2.generate(model, query, EOS, 8, EOS, T, generator=torch.Generator().manual_seed(0),
                                       return_logprobs=True)  # fmt: skip
    mask = grpo.response_mask(response, EOS)
    assert (response == EOS).any(1).sum() >= 2 and (~mask).any()  # stop tokens and padding after them
    recomputed = grpo.batch_logprobs(model, query, response, EOS, EOS, T, 5, nullcontext())
    torch.testing.assert_close(logprobs * mask, recomputed * mask, atol=1e-5, rtol=0)
    new, entropy = grpo.forward_logprobs(model, query, response, EOS, EOS, T, nullcontext(), with_entropy=True)
    attn = torch.cat([query != EOS, mask], 1)
    logp = (model(torch.cat([query, response], 1), attention_mask=attn, keep_from=4)[:, :-1] / T).log_softmax(-1)
    torch.testing.assert_close(new, logp.gather(-1, response[..., None]).squeeze(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)


def test_pad_other_than_eos_gives_the_same_logprobs_losses_and_rewards():
    """The same batch padded with the stop token (256) and with a distinct pad id (257): masks come from the first
    stop token and from query != pad, so log-probs, losses and reward-model scores do not change."""
    model = tiny(258)
    rm = grpo.ScalarModel(gpt2.load_model("tiny", vocab_size=258)).eval()
    P = -1  # placeholder for the pad id
    query = [[P, P, 5, 6], [7, 8, 9, 10], [P, 3, 4, 5], [P, P, P, 2]]
    response = [[10, EOS, P, P], [11, 12, EOS, P], [13, 14, 15, 16], [EOS, P, P, P]]
    out = {}
    for pad in (EOS, 257):
        q, r = (torch.tensor([[pad if t == P else t for t in row] for row in x]) for x in (query, response))
        mask = grpo.loss_mask(r, EOS, False).float()
        new, _ = grpo.forward_logprobs(model, q, r, pad, EOS, 1.0, nullcontext())
        with torch.no_grad():
            old, ref = new - 0.1 * mask, new + 0.2
        loss, _ = grpo.grpo_loss(new, old, ref, torch.tensor([1.0, -1.0, 0.5, 2.0]), mask, 0.2, 0.28, 0.1, "k3")
        agg = [grpo.aggregate_loss(loss, mask, h, mask.sum(), 4, 16) for h in ("token", "sequence", "dr_grpo")]
        meta = dict(pad_token_id=pad, eos_token_id=EOS)
        rewards = grpo.score_responses(rm, q, r, None, meta, False, 2, 1.0, nullcontext())
        out[pad] = [new * mask, *agg, rewards]
    for a, b in zip(out[EOS], out[257]):
        assert torch.allclose(a, b, atol=1e-5), (a, b)


# ---- end to end


@pytest.mark.parametrize("variant", [[], ["--dynamic_sampling", "--mask_truncated", "--clip_eps_high", "0.28"]])
def test_one_rank_equals_two_ranks_and_first_minibatch_ratio_is_one(tmp_path, sft_model, variant):
    common = ["--model", sft_model, "--total_episodes", "64", "--eval_every", "2", "--beta", "0.05", *SMALL, *variant]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2]
    assert a[1]["objective/zero_std_frac"] < 1 and a[1]["train/grad_norm"] > 0  # some groups carry signal
    for x, y in zip(a, b):
        for k in x:
            if not k.startswith("perf/"):
                assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])
    for m in a[1:]:  # one minibatch, one epoch: each update is the first minibatch, pi_theta = pi_old
        assert abs(m["val/ratio"] - 1) < 1e-6 and m["policy/approxkl_avg"] < 1e-6 and m["policy/clipfrac_avg"] == 0
    # the reference is the starting checkpoint: KL 0 at step 1 (to rounding: pi_old's log-probs are the sampler's)
    assert a[1]["objective/kl"] < 1e-10 and a[2]["objective/kl"] > 1e-6 and (tmp_path / "r2" / "model.safetensors").exists()
    if variant:  # every trained group has reward variance; the zero-variance ones sampled were dropped
        for m in a[1:]:
            assert m["objective/dropped_groups"] == pytest.approx(m["objective/zero_std_frac"] * 8 * m["objective/sampling_rounds"])
        assert any(m["objective/dropped_groups"] > 0 for m in a[1:])


def test_reference_of_a_random_tiny_model_is_its_copy(tmp_path):
    """--model tiny: the reference is a copy of the policy as loaded, not a second random init: KL 0 at step 1."""
    run(["--model", "tiny", "--out_dir", str(tmp_path), "--total_episodes", "32", "--beta", "0.1", *SMALL])
    m = metrics(tmp_path)
    assert m[-1]["step"] == 1 and m[-1]["objective/kl"] < 1e-10 and abs(m[-1]["loss/kl_avg"]) < 1e-10, m[-1]


def test_tiny_runs_with_every_option(tmp_path, sft_model):
    """A reward model with k4, GSPO, per-response mean, no std, batch whitening, recomputed pi_old, 2 minibatches x
    2 epochs; then the verifier with DAPO's options, Dr. GRPO's normaliser and RLOO at beta 0 (no reference)."""
    rm = grpo.ScalarModel(gpt2.load_model(sft_model), gain=2.0, bias=-1.0)  # random head: continuous scores
    gpt2.save_model(rm.state_dict(), rm.config, str(tmp_path / "rm"), extra_config={"reward_gain": 2.0, "reward_bias": -1.0})
    run(["--model", sft_model, "--out_dir", str(tmp_path / "a"), "--total_episodes", "96", "--eval_every", "3", *SMALL,
         "--reward_model", str(tmp_path / "rm"), "--num_minibatches", "2", "--num_epochs", "2", "--micro_batch_size",
         "4", "--kl_estimator", "k4", "--beta", "0.1", "--loss_aggregation", "sequence", "--no-scale_rewards_by_std",
         "--batch_norm_advantages", "--response_length", "6", "--importance_level", "sequence",
         "--recompute_old_logprobs"])  # fmt: skip
    m = metrics(tmp_path / "a")
    assert [r["step"] for r in m] == [0, 1, 2, 3] and all(math.isfinite(v) for r in m for v in r.values())
    assert m[1]["objective/zero_std_frac"] < 0.5 and "eval/accuracy" in m[-1]  # RM scores differ within most groups
    assert m[-1]["policy/approxkl_avg"] > 0 and m[-1]["val/ratio_var"] > 0  # later minibatches/epochs are off-policy
    assert gpt2.load_model(str(tmp_path / "a")).config.n_layer == 4
    run(["--model", sft_model, "--out_dir", str(tmp_path / "b"), "--total_episodes", "96", "--eval_every", "3", *SMALL,
         "--dynamic_sampling", "--max_sampling_rounds", "2", "--mask_truncated", "--clip_eps_high", "0.28",
         "--loss_aggregation", "dr_grpo", "--no-scale_rewards_by_std", "--advantage", "rloo"])  # fmt: skip
    m = metrics(tmp_path / "b")
    assert [r["step"] for r in m] == [0, 1, 2, 3] and all(math.isfinite(v) for r in m for v in r.values())
    assert not any("objective/kl" in r for r in m) and all(1 <= r["objective/sampling_rounds"] <= 3 for r in m[1:])


def test_resume_matches_uninterrupted(tmp_path, sft_model):
    common = ["--model", sft_model, "--total_episodes", "128", "--eval_every", "2", "--keep_checkpoints", "5",
              "--beta", "0.05", *SMALL]  # fmt: skip
    run(["--out_dir", str(tmp_path / "full"), *common])
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    run(["--out_dir", str(tmp_path / "resumed"), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    for m in resumed:  # the reference stays the starting model, not the checkpoint resumed from
        assert m["objective/kl"] > 0 and abs(m["objective/kl"] - full[m["step"]]["objective/kl"]) < 1e-6, m
        assert abs(m["loss/policy_avg"] - full[m["step"]]["loss/policy_avg"]) < 1e-6


def start(args, nproc=0):  # a run in the background, to be killed
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    return subprocess.Popen(launcher + ["grpo.py", *args], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(p, done, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None and not done():
        time.sleep(0.05)


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, sft_model):
    """Fault injection: SIGKILL mid-run (no chance to save), then --resume from the last periodic checkpoint."""
    common = ["--model", sft_model, "--total_episodes", str(32 * 24), "--eval_every", "3", "--beta", "0.05", *SMALL]
    run(["--out_dir", str(tmp_path / "full"), *common])
    p = start(["--out_dir", str(out := tmp_path / "killed"), *common])
    wait_for(p, lambda: (out / "checkpoints" / "step_00000006").exists())
    p.kill()
    assert p.wait() == -signal.SIGKILL  # still running when killed: the kill came mid-way
    run(["--out_dir", str(out), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = {m["step"]: m for m in metrics(out)}  # rows after the checkpoint were dropped and logged again
    assert resumed.keys() == full.keys() and full[24]["objective/kl"] > 0
    for step, m in full.items():
        for k in (k for k in m if not k.startswith("perf/")):
            assert abs(resumed[step][k] - m[k]) < 1e-5, (step, k, resumed[step][k], m[k])


def test_a_rank_that_dies_ends_the_whole_torchrun_run(tmp_path, sft_model):
    """One rank SIGKILLed mid-run: torchrun must end the other rank (blocked in a collective) and exit non-zero, not
    hang."""
    p = start(["--model", sft_model, "--out_dir", str(tmp_path), "--total_episodes", "1000000", *SMALL], nproc=2)
    wait_for(p, lambda: (tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 3)
    workers = descendants(p.pid)
    rank1 = [pid for pid in workers if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()]
    assert p.poll() is None and len(rank1) == 1, workers
    os.kill(rank1[0], signal.SIGKILL)
    err = p.communicate(timeout=120)[1]
    assert p.returncode != 0 and "grpo.py FAILED" in err, err[-2000:]
    time.sleep(1)
    assert not [pid for pid in workers if alive(pid)]  # no orphaned rank left running


def alive(pid: int) -> bool:  # a zombie (exited, not yet reaped) is not alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(pid: int) -> list[int]:
    kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    return kids + [d for k in kids for d in descendants(k)]


def test_the_design_line_on_a_fresh_clone_names_sft(tmp_path):
    """`torchrun --nproc_per_node=2 grpo.py --beta 0.03` with no runs/sft/latest: one line, printed once by rank 0,
    no traceback from the script (torchrun then prints its own ChildFailedError summary)."""
    p = run(["--beta", "0.03"], nproc=2, check=False, cwd=tmp_path, script=str(ROOT / "grpo.py"))
    assert p.returncode != 0 and p.stderr.count("error: no SFT model at 'runs/sft/latest'") == 1, p.stderr
    assert "`python sft.py`" in p.stderr and 'grpo.py", line' not in p.stderr and not (tmp_path / "runs").exists()


BAD = [(["--kl_estimator", "k5"], "unknown --kl_estimator 'k5'"), (["--loss_aggregation", "x"], "unknown --loss_aggregation"),
       (["--num_samples_per_prompt", "1"], "per_prompt >= 2"), (["--num_minibatches", "3"], "num_minibatches"),
       (["--model", "/x"], "no checkpoint at"), (["--resume"], "no checkpoint in"),
       (["--response_length", "80"], "exceed the model context 64: lower --response_length")]  # fmt: skip


@pytest.mark.parametrize("flags, expected", BAD)
def test_bad_flags_give_one_line_errors(tmp_path, sft_model, flags, expected, capsys):
    """In process (the subprocess path is the design-line test's): run() turns each into one line and exit code 1."""
    args = grpo.tyro.cli(grpo.Args, args=["--model", sft_model, "--out_dir", str(tmp_path / "x"), *SMALL, *flags])
    with pytest.raises(SystemExit) as e:
        grpo.run(grpo.main, args)
    err = capsys.readouterr().err
    assert e.value.code == 1 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()  # refused before the run dir is claimed
