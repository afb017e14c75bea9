"""ppo.py: GAE vs a scalar loop and vs the discount-matrix closed form, masked whitening, the KL
controller, the per-token rewards and the missing-stop penalty, PPO invariants, the inline AdamTF
vs adam_tf.py, pad != eos, a tiny end-to-end run (adaptive KL, the preference-pair eval,
checkpoints, resume == uninterrupted with AdamTF), the reference = the starting policy, 1 process
== 2 ranks (FSDP2, gloo) with the first minibatch's ratio exactly 1, a 2-rank checkpoint resumed
at 2 ranks and at 1, one-line errors. ppo_variants.py: dual-clip by hand, the adaptive entropy
bonus and dual-clip in the same tiny run, top-k/top-p's first minibatch, its one-line errors, and
at its defaults it is ppo.py bit for bit. Its sampler correction: tests/test_sampler_correction.py.
Log-probs at the temperature: tests/test_gpt2.py."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import adam_tf
import gpt2
import ppo
import ppo_variants
from failed_run import why
from runs import error_line, in_process

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
EOS = 256  # the bytes tokenizer's <|endoftext|>
TINY = gpt2.PRESETS["tiny"]


def random_mask(B=6, T=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    return torch.arange(T)[None, :] < lengths[:, None], gen


# ---- the math against loops and formulas


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 0.0)])
def test_gae_matches_python_loop(gamma, lam):
    mask, gen = random_mask()
    rewards, values = torch.randn(2, *mask.shape, generator=gen) * mask
    # junk values after the end must not leak
    adv, ret = ppo.compute_gae(rewards, values + 5 * ~mask, mask, gamma, lam)
    for b in range(mask.size(0)):  # lm-human-preferences' loop over the real tokens; terminal V 0
        n, last = int(mask[b].sum()), 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            last = delta + gamma * lam * last  # A_t
            assert adv[b, t].item() == pytest.approx(last, abs=1e-5)
            assert ret[b, t].item() == pytest.approx(last + values[b, t].item(), abs=1e-5)
        assert (adv[b, n:] == 0).all() and (ret[b, n:] == 0).all()


def gae_by_discount_matrix(rewards, values, mask, gamma, lam):
    """The closed form A_t = sum_{s >= t} (gamma lam)^(s - t) delta_s as one matmul with a
    (T, T) discount matrix, in float64: ppo.py's GAE before the loop, kept as a cross-check."""
    rewards, values = rewards.double(), values.double() * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    deltas = (rewards + gamma * next_values - values) * mask
    t = torch.arange(rewards.size(1))
    lag = (t[:, None] - t[None, :]).double()  # [s, t] = s - t
    discount = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0), 0.0)
    advantages = (deltas @ discount) * mask
    return advantages, (advantages + values) * mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (1.0, 0.0)])
def test_gae_loop_equals_discount_matrix(gamma, lam):
    mask, gen = random_mask(B=32, T=64, seed=3)
    rewards, values = torch.randn(2, *mask.shape, generator=gen) * mask
    adv, ret = ppo.compute_gae(rewards, values + 5 * ~mask, mask, gamma, lam)
    adv64, ret64 = gae_by_discount_matrix(rewards, values, mask, gamma, lam)
    # The loop runs in float32 against float64: each of its T steps rounds about five
    # operations (relative error <= eps each) on numbers no larger than the row's sum of
    # |r| + 2 |V|, and the factor gamma lam <= 1 carries an earlier error on without
    # growing it, so |A - A64| <= 6 T eps (sum of |r| + 2 |V|): a worst case, the typical
    # error is far smaller, and an indexing bug's error is of the order of |A| itself.
    bound = 6 * mask.size(1) * torch.finfo(torch.float32).eps
    scale = (rewards.abs() + 2 * values.abs()).sum(1, keepdim=True).double()
    assert ((adv - adv64).abs() <= bound * scale).all()
    assert ((ret - ret64).abs() <= bound * scale).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_masked_whiten():
    mask, gen = random_mask(8, 7, seed=1)
    x = torch.randn(mask.shape, generator=gen) * 3 + 2
    ref = (x[mask] - x[mask].mean()) / x[mask].var(unbiased=False).sqrt()
    out = ppo.masked_whiten(x, mask)
    torch.testing.assert_close(out[mask], ref, rtol=1e-5, atol=1e-5)
    assert (out[~mask] == 0).all()
    kept = ppo.masked_whiten(x, mask, shift_mean=False)[mask]  # scale only: the mean stays
    torch.testing.assert_close(kept, ref + x[mask].mean(), rtol=1e-5, atol=1e-5)


def test_adaptive_kl_controller_formula():
    # beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon), by hand
    clipped = ppo.adaptive_kl_coef(0.1, 0.45, 0.3, 64, 10000)
    assert clipped == pytest.approx(0.1 * (1 + 0.2 * 64 / 10000))
    assert ppo.adaptive_kl_coef(0.1, 0.27, 0.3, 64, 10000) == pytest.approx(
        0.1 * (1 - 0.1 * 64 / 10000)
    )
    assert ppo.adaptive_kl_coef(0.1, 0.0, 0.3, 500, 1000) == pytest.approx(0.1 * 0.9)
    assert ppo.adaptive_kl_coef(0.1, 0.3, 0.3, 64, 10000) == 0.1


def test_per_token_rewards_and_missing_stop_penalty():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-1.0] * 4])
    ref = torch.tensor([[-1.5, -1.0, -0.5, 7.0], [-2.0] * 4])
    rewards, non_score, kl = ppo.per_token_rewards(
        torch.tensor([3.0, -1.0]), logprobs, ref, mask, 0.1
    )
    torch.testing.assert_close(
        kl, torch.tensor([[0.5, -1.0, 0.0, 0.0], [1.0] * 4])
    )  # 0 after the end
    torch.testing.assert_close(non_score, -0.1 * kl)
    expected = torch.tensor([[-0.05, 0.1, 3.0, 0.0], [-0.1, -0.1, -0.1, -1.1]])
    torch.testing.assert_close(rewards, expected)
    response = torch.tensor([[5, EOS, EOS], [5, 6, 7]])  # the second never stops
    scores = torch.tensor([2.0, 2.0])
    assert ppo.penalised_scores(scores, response, EOS, -1.0).tolist() == [2.0, -1.0]
    assert ppo.penalised_scores(scores, response, EOS, None).tolist() == [2.0, 2.0]


def test_ppo_losses():
    mask, gen = random_mask()
    logprobs, adv = -torch.rand(mask.shape, generator=gen), torch.randn(mask.shape, generator=gen)
    # the first minibatch: nothing moved yet
    pg, ratio, clipped = ppo.policy_loss(logprobs.clone(), logprobs, adv, 0.2)
    assert (ratio == 1).all() and not clipped.any() and torch.equal(pg, -adv)
    pg, ratio, clipped = ppo.policy_loss(logprobs + 0.5, logprobs, adv, 0.2)  # ratio e^0.5 > 1.2
    torch.testing.assert_close(pg, torch.maximum(-adv * ratio, -adv * 1.2))
    assert torch.equal(clipped, adv > 0)  # above 1 + eps the gain is capped where A > 0
    vpred, values, returns = torch.tensor([1.0, 0.5]), torch.zeros(2), torch.tensor([0.0, 1.0])
    vf, vclip = ppo.value_loss(vpred, values, returns, 0.2)
    # max(unclipped, clipped at 0.2) squared error
    torch.testing.assert_close(vf, torch.tensor([0.5 * 1.0**2, 0.5 * 0.8**2]))
    assert vclip.tolist() == [False, True]


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """Ye et al. 2020 eq. 5 with c = 3: A = -1 at ratio 5 loses max(5, 1.2 x 1) = 5 under PPO,
    capped at -cA = 3 with no gradient; ratio 2 (loss 2 < 3) and A = +1 are left alone."""
    adv, old = torch.tensor([-1.0, -1.0, 1.0]), torch.zeros(3)
    for dual_clip, want_loss, want_grad in (
        (None, [5, 2, -1.2], [5, 2, 0]),
        (3.0, [3, 2, -1.2], [0, 2, 0]),
    ):
        new = torch.tensor([5.0, 2.0, 5.0]).log().requires_grad_(True)
        loss = ppo_variants.policy_loss(new, old, adv, 0.2, dual_clip)[0]
        loss.sum().backward()
        assert loss.tolist() == pytest.approx(want_loss)
        assert new.grad.tolist() == pytest.approx(want_grad)  # d(-A rho) / d log pi


def test_adaptive_entropy_coef_steps_toward_the_target():  # grpo_variants.py's: test_copies.py
    assert ppo_variants.adaptive_entropy_coef(0.01, 0.1, 0.2, 0.005) == pytest.approx(
        (0.015, 0.015)
    )
    assert ppo_variants.adaptive_entropy_coef(0.01, 0.3, 0.2, 0.005) == pytest.approx((0.005, 0.0))


def test_inline_adam_tf_steps_like_adam_tf_py():  # tests/test_copies.py checks the source
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    copies = [[p.detach().clone().requires_grad_() for p in params] for _ in range(2)]
    opts = [ppo.AdamTF(copies[0], lr=1e-2, eps=1e-5), adam_tf.AdamTF(copies[1], lr=1e-2, eps=1e-5)]
    for _ in range(3):
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        for ps, opt in zip(copies, opts):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for a, b, p in zip(*copies, params):
        assert torch.equal(a, b) and not torch.equal(a, p)


# ---- pad != eos: masks come from the first stop token, never from the pad id


def test_pad_other_than_eos_gives_the_same_rollout():
    """A batch padded with 257 (not the stop token) gives the same samples, log-probs, values and
    scores on the real tokens as the same batch padded with the stop token."""
    torch.manual_seed(0)
    cfg = gpt2.GPTConfig(**TINY, vocab_size=258)
    policy = gpt2.GPT(cfg).eval()
    value, reward = gpt2.ScalarModel(gpt2.GPT(cfg)).eval(), gpt2.ScalarModel(gpt2.GPT(cfg)).eval()
    prompts, noise = [[7, 8, 9], [10, 11], [12]], torch.rand(3, 5)
    responses = [[20, 21, EOS], [22, EOS], [23, 24, 25, 26, 27]]  # stop at 2, at 1, never

    def rollout(pad):
        query = torch.tensor([[pad] * (3 - len(p)) + p for p in prompts])
        response = torch.tensor([r + [pad] * (5 - len(r)) for r in responses])
        sampled = gpt2.generate(policy, query, pad, 5, EOS, 0.7, noise=noise)
        mask = gpt2.response_mask(response, EOS)
        policy.config.pad_token_id, policy.config.eos_token_id = pad, EOS
        logprobs = gpt2.logprobs(policy, query, response, 0.7)[0]
        values = ppo.forward_values(value, query, response, pad, EOS)
        scores = gpt2.get_reward(reward, query, response, pad, EOS)
        scores = ppo.penalised_scores(scores, response, EOS, -1.0)
        return sampled.response * sampled.mask, logprobs * mask, values * mask, scores

    with torch.no_grad():
        same, other = rollout(EOS), rollout(257)
    assert same[3][2] == -1.0 and same[3][0] != -1.0  # the one that never stops gets the penalty
    for a, b in zip(same, other):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- end to end


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random tiny policy and a random reward model (gain 2, bias -0.5), bytes vocabulary."""
    d = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    gpt2.save(gpt2.GPT(gpt2.GPTConfig(**TINY, vocab_size=257)), str(d / "sft"))
    reward = gpt2.ScalarModel(gpt2.GPT(gpt2.GPTConfig(**TINY, vocab_size=257)), 2.0, -0.5)
    gpt2.save(reward, str(d / "rm"))
    return d


def run(models, out, *flags, nproc=0, script="ppo.py"):
    """A run on the models, under torchrun with nproc ranks, or in this process (nproc 0, as one
    process runs it: runs.in_process)."""
    args = ["--model", str(models / "sft"), "--reward_model", str(models / "rm")]
    args += ["--out_dir", str(out), "--batch_size", "16", "--micro_batch_size", "4"]
    args += ["--response_length", "6", "--eval_size", "16", "--log_every", "1", *flags]
    if not nproc:
        in_process(importlib.import_module(script.removesuffix(".py")), args)
        return
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc_per_node={nproc}"]
    p = subprocess.run(
        launcher + [script, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, why(p)


def metrics(out):
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


# The tiny end-to-end run's flags: adaptive KL with a target it is far from, 2 minibatches, a
# checkpoint at step 2.
ADAPTIVE = ["--total_episodes", "48", "--num_minibatches", "2", "--eval_every", "2"]
ADAPTIVE += ["--target_kl", "0.01", "--kl_horizon", "100", "--kl_coef", "0.1"]
# ppo_variants.py's options in it: dual-clip, and an entropy target always above the entropy, so
# that the coefficient rises
VARIANTS = ["--dual_clip", "3", "--entropy_target", "100", "--entropy_coef", "0.01"]


@pytest.fixture(scope="module")
def adaptive_runs(models, tmp_path_factory):
    """The tiny run of ADAPTIVE by ppo.py, then by ppo_variants.py with its options, each resumed
    from its step-2 checkpoint in a fresh dir, made when first asked for: the end-to-end test reads
    both; the bit-equality test reads ppo.py's. -> {script: its dir}"""
    made = {}

    def runs(script):
        if script not in made:
            out = tmp_path_factory.mktemp(script.removesuffix(".py"))
            flags = ADAPTIVE + (VARIANTS if script == "ppo_variants.py" else [])
            run(models, out / "full", *flags, script=script)  # AdamTF, the default
            ckpt = out / "full" / "checkpoints" / "step_00000002"
            shutil.copytree(ckpt, out / "re" / "checkpoints" / ckpt.name)
            run(models, out / "re", *flags, "--resume", script=script)
            made[script] = out
        return made[script]

    return runs


@pytest.mark.parametrize("script", ["ppo.py", "ppo_variants.py"])
def test_tiny_run_adaptive_kl_checkpoints_and_resume(adaptive_runs, script):
    out = adaptive_runs(script)
    m = metrics(out / "full")
    assert [r["step"] for r in m] == [0, 1, 2, 3] and "eval/score" in m[0]
    assert m[0]["eval/preference_accuracy"] == 0.5  # the policy is its reference: every r = 0
    if script == "ppo_variants.py":
        # the bonus applied: none before a first entropy below the target, then c0 + delta,
        # + delta
        assert [r["policy/entropy_coef"] for r in m[1:]] == pytest.approx([0.0, 0.015, 0.02])
    assert "eval/accuracy" in m[-1] and "eval/score" in m[-1]
    assert m[1]["objective/kl"] == 0  # the reference is the starting policy
    for r in m[1:]:  # the logged objectives add up
        nonscore = -r["objective/kl_coef"] * r["objective/kl"]
        assert r["objective/non_score_reward"] == pytest.approx(nonscore, abs=1e-6)
        total = r["objective/scores"] + r["objective/non_score_reward"]
        assert r["objective/rlhf_reward"] == pytest.approx(total, abs=1e-6)
    for a, b in zip(m[1:], m[2:]):  # the controller step from the logged global KL
        coef = ppo.adaptive_kl_coef(a["objective/kl_coef"], a["objective/kl"], 0.01, 16, 100)
        assert b["objective/kl_coef"] == pytest.approx(coef)
    assert m[-1]["objective/kl"] != 0 and m[-1]["objective/kl_coef"] != 0.1  # the policy moved
    checkpoints = out / "full" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["step_00000002", "step_00000003"]
    assert sorted(os.listdir(checkpoints / "step_00000002")) == ["policy", "state.pt", "value"]
    assert gpt2.load(str(out / "full")).config.n_layer == 4
    value = gpt2.load(str(checkpoints / "step_00000003" / "value"), head="saved")
    assert value.reward_gain == 1.0 and value.reward_bias == 0.0  # the zero head: no RM gain
    assert value.score.weight.abs().sum() > 0  # trained away from zero
    # restarted from the step-2 checkpoint (policy, value, both AdamTF states, kl_coef, and the
    # entropy coefficient) in a fresh dir
    resumed = metrics(out / "re")
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0].keys() == m[-1].keys()
    for k, v in resumed[0].items():
        assert k.startswith("perf/") or abs(v - m[-1][k]) < 1e-5, (k, v, m[-1][k])


def test_ppo_variants_at_its_defaults_is_ppo_bit_for_bit(models, adaptive_runs, tmp_path):
    """ppo.py's tiny run (it learns: its KL and coefficient move) again by ppo_variants.py with no
    option of its own: every metric but the wall clock's, to the bit."""
    plain = metrics(adaptive_runs("ppo.py") / "full")
    run(models, tmp_path, *ADAPTIVE, script="ppo_variants.py")
    sibling = metrics(tmp_path)
    assert [r["step"] for r in plain] == [r["step"] for r in sibling] == [0, 1, 2, 3]
    assert plain[-1]["objective/kl"] > 0 and plain[-1]["policy/approxkl_avg"] > 0
    for x, y in zip(plain, sibling):
        assert {k: v for k, v in x.items() if not k.startswith("perf/")} == {
            k: v for k, v in y.items() if not k.startswith("perf/")
        }


def test_a_flag_of_ppo_variants_is_one_line_naming_it():
    with pytest.raises(gpt2.RunError) as e:
        ppo.parse_args(["--dual_clip", "3"])
    assert (
        str(e.value)
        == "--dual_clip lives in ppo_variants.py: run `python ppo_variants.py --dual_clip ...`"
    )
    assert set(ppo.MOVED) == set(ppo_variants.Args.__dataclass_fields__) - set(
        ppo.Args.__dataclass_fields__
    )


def test_tiny_run_learns_what_the_reward_model_prefers(models, tmp_path):
    """12 updates raise the greedy responses' reward-model score well above the start's."""
    flags = ["--total_episodes", "192", "--eval_every", "12", "--micro_batch_size", "8"]
    flags += [
        "--lr",
        "1e-3",
        "--kl_coef",
        "0.01",
        "--no_adaptive_kl",
        "--penalty_reward_value",
        "None",
    ]
    run(models, tmp_path, *flags)
    m = metrics(tmp_path)
    assert [r["step"] for r in m] == list(range(13))
    assert m[-1]["eval/score"] > m[0]["eval/score"] + 1.0, (m[0]["eval/score"], m[-1]["eval/score"])


def test_random_tiny_policy_is_its_own_reference(models, tmp_path):
    """`--model tiny` is a random init: the reference must be a copy of it, not a second draw.
    Also torch's Adam and the reward head as the value head's start."""
    flags = ["--total_episodes", "16", "--num_ppo_epochs", "1", "--num_minibatches", "1"]
    flags += ["--eval_size", "0", "--optimizer", "adam", "--value_head", "reward"]
    run(models, tmp_path, "--model", "tiny", *flags)
    (m,) = metrics(tmp_path)  # no eval: no step-0 row
    assert m["step"] == 1 and m["objective/kl"] == 0 and m["val/ratio"] == 1
    assert m["policy/approxkl_avg"] == 0 and m["policy/clipfrac_avg"] == 0
    assert "eval/score" not in m and "policy/entropy_avg" in m


def test_top_p_first_minibatch_ratio_is_one(models, tmp_path):
    """--top_k 20 --top_p 0.9: pi_old and pi_theta both over the kept tokens, from the same
    forward: ratio exactly 1. The reference keeps the full distribution: a KL > 0 at step 1."""
    flags = ["--total_episodes", "16", "--num_ppo_epochs", "1", "--num_minibatches", "1"]
    flags += ["--eval_size", "0", "--top_k", "20", "--top_p", "0.9"]
    run(models, tmp_path, "--model", "tiny", *flags, script="ppo_variants.py")
    (m,) = metrics(tmp_path)
    assert m["step"] == 1 and m["val/ratio"] == 1 and m["policy/approxkl_avg"] == 0
    assert m["objective/kl"] > 0


def test_one_rank_equals_two_ranks_and_first_minibatch_ratio_is_one(models, tmp_path):
    flags = ["--total_episodes", "48", "--num_minibatches", "1", "--num_ppo_epochs", "1"]
    flags += ["--eval_every", "2"]
    run(models, tmp_path / "r1", *flags)  # a plain process vs FSDP2 over 2 ranks
    run(models, tmp_path / "r2", *flags, nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if not k.startswith("perf/"):
                assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])
    for r in a[1:] + b[1:]:  # one epoch of one minibatch: the rollout's own policy, exactly
        assert r["policy/approxkl_avg"] < 1e-12 and abs(r["val/ratio"] - 1) < 1e-6
        assert r["policy/clipfrac_avg"] == 0 and r["val/ratio_var"] < 1e-12
    assert a[1]["objective/kl"] == 0 and a[2]["objective/kl"] != 0  # the update moved the policy
    # resume under FSDP2 (sharded AdamTF and value states) from step 2 in a fresh dir
    ckpt = tmp_path / "r2" / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt, tmp_path / "re" / "checkpoints" / ckpt.name)
    run(models, tmp_path / "re", *flags, "--resume", nproc=2)
    (resumed,) = metrics(tmp_path / "re")
    for k, v in resumed.items():
        assert k.startswith("perf/") or abs(v - b[-1][k]) < 1e-6, (k, v, b[-1][k])
    # and in one process: the checkpoint holds full, unsharded states
    shutil.copytree(ckpt, tmp_path / "re1" / "checkpoints" / ckpt.name)
    run(models, tmp_path / "re1", *flags, "--resume")
    (resumed,) = metrics(tmp_path / "re1")
    for k, v in resumed.items():
        assert k.startswith("perf/") or abs(v - b[-1][k]) < 1e-4, (k, v, b[-1][k])


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--reward_model", "SFT"], "no reward head"),
        (["--num_minibatches", "3"], "num_minibatches"),
        (["--response_length", "100"], "exceed"),
        (["--temperature", "0"], "--temperature"),
        (["--temperature", "nan"], "--temperature nan"),
        (["--lr", "-1"], "--lr -1"),
        (["--batch_size", "0"], "--batch_size 0"),
        (["--gamma", "1.5"], "--gamma 1.5"),
        (["--top_k", "-1"], "--top_k -1: must be at least 0"),
        (["--top_p", "0"], "--top_p 0.0: must be in (0, 1]"),
        (["--dual_clip", "0.5"], "--dual_clip 0.5: must be a finite number > 1"),
        (["--lr", "1e12"], "non-finite PPO statistics at update 1"),  # diverges at once
    ],
)
def test_bad_flags_give_one_line_errors(models, tmp_path, flags, expected):
    """In this process, with run()'s flags, by ppo.py (ppo_variants.py for its own flags); as a
    user runs one: the next test."""
    script = ppo_variants if flags[0] in ("--top_k", "--top_p", "--dual_clip") else ppo
    flags = [str(models / "sft") if f == "SFT" else f for f in flags]
    args = ["--model", str(models / "sft"), "--reward_model", str(models / "rm")]
    args += ["--out_dir", str(tmp_path / "x"), "--batch_size", "16", "--micro_batch_size", "4"]
    args += ["--response_length", "6", "--eval_size", "16", "--log_every", "1"]
    line = error_line(script, [*args, "--total_episodes", "16", *flags])
    assert expected in line, line
    # a flag or model problem leaves no run dir (one that needs --overwrite); the NaN comes later
    assert (tmp_path / "x").exists() == ("1e12" in flags)


def test_missing_default_models_say_what_to_run(models, tmp_path):
    cmd = [sys.executable, str(ROOT / "ppo.py")]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert p.returncode == 1 and "python sft.py" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    cmd += ["--model", str(models / "sft")]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert p.returncode == 1 and "python reward.py" in p.stderr, p.stderr
    assert not (tmp_path / "runs").exists()
