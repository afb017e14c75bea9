"""grpo.py: the KL estimators k1-k4 (values, gradients, which are unbiased, the clamp), the group
advantage, the clipped surrogate's clip range, RSO's rejection sampling by hand; end to end: 1 rank
== 2 ranks with the first-minibatch invariant and KL 0 at step 1 (with RSO too), the reference of
a random model, resume == uninterrupted (after SIGKILL too), a dead rank ends torchrun, one-line
errors, the flags that live in grpo_variants.py; and grpo_variants.py at its defaults = grpo.py,
bit for bit. The variants: tests/test_grpo_variants.py. SIGTERM to one rank and 1 = 8 ranks = 2
nodes: tests/test_world_sizes.py; the sampler's log-probs: tests/test_gpt2.py."""

import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import pytest
import torch

import grpo
from failed_run import why
from runs import error_line, in_process

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
SMALL = (  # 3-token answers: longer ones miss the stop token, whose penalty gives groups variance
    "--num_prompts_per_step 8 --num_samples_per_prompt 4 --micro_batch_size 8 --eval_size 32 "
    "--response_length 4 --missing_eos_penalty 1 --log_every 1 --lr 3e-4 --num_minibatches 1"
).split()
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


def command(args, nproc=0, script="grpo.py"):
    return [*TORCHRUN, str(nproc), script, *args] if nproc else [sys.executable, script, *args]


def run(args, nproc=0, check=True, cwd=ROOT, script="grpo.py"):
    cmd = command(args, nproc, script)
    p = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 or not check, why(p)
    return p


def run_here(args, script="grpo.py"):
    """A run as run() makes it, in this process (runs.in_process): for the tests whose subject is
    the run, not its process."""
    in_process(importlib.import_module(script.removesuffix(".py")), args)


def start(args, nproc=0):  # a run in the background, to be killed
    out = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen(command(args, nproc), cwd=ROOT, env=ENV, **out)


def metrics(out_dir):  # one dict per logged step
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def choices(flag):  # a Literal flag's choices, as --help lists them
    return get_args(grpo.Args.__annotations__[flag])


# ---- KL estimators

NEW, REF, OLD = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5], [-1.2, -2.5, -0.4]


@pytest.mark.parametrize("est", choices("kl_estimator"))
def test_kl_estimator_values_and_gradients(est):
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    ref, old = torch.tensor(REF, dtype=torch.float64), torch.tensor(OLD, dtype=torch.float64)
    (value := grpo.kl_penalty(new, ref, new - old, est)).sum().backward()
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
    (logp_old.exp() * grpo.kl_penalty(logp, logq, logp - logp_old, est)).sum().backward()
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
    off = {k: expected_grad(k, theta, logq, theta_old) for k in ("k2", "k4")}
    assert torch.allclose(off["k4"], true_kl)
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
            kl = grpo.kl_penalty(new, ref, new - old, est)
            loss = grpo.grpo_loss(new - old, torch.tensor([[1.0]]), 0.2, 0.2)[0] + beta * kl
            (loss * grpo.token_weights(mask)).sum().backward()
            assert torch.isfinite(loss).all() and torch.isfinite(new.grad).all(), est
    clamp = grpo.KL_CLAMP
    assert grpo.kl_penalty(new, ref, new - old, "k1").tolist() == [[-clamp, clamp, 0.0]]


# ---- advantages


def test_group_advantages_equal_rewards_are_zero():
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 0.3, 0.3, 0.3, 0.3, 0, 0, 0, 0])
    adv = grpo.group_advantages(scores, 4)
    assert torch.isfinite(adv).all() and (adv[:4] == 0).all() and (adv[8:] == 0).all()
    # the unbiased std of the group [0, 1, 0, 1], + eps
    want = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / (0.5 / math.sqrt(0.75) + 1e-4)
    assert torch.allclose(adv[4:8], want, atol=1e-6)


def test_batch_normalised_advantages_have_mean_0_and_std_1():
    """The TL;DR recipe's second normalisation: over the batch's responses, population std."""
    advantages = torch.tensor([1.0, -1.0, 0.5, 3.0, 0.0, -2.0])
    got = grpo.batch_normalise(advantages, batch_size=6)
    assert float(got.mean()) == pytest.approx(0, abs=1e-6)
    assert float(got.std(unbiased=False)) == pytest.approx(1, abs=1e-6)


# ---- the clipped surrogate and its weights


def surrogate_grad(ratio, advantages, clip_low, clip_high):
    """d loss / d log pi per token for given ratios pi / pi_old (B, T); the ratio; the clip."""
    new = ratio.log().clone().requires_grad_(True)
    loss, ratio, clipped = grpo.grpo_loss(new, advantages[:, None], clip_low, clip_high)
    loss.sum().backward()
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


def test_token_weights_are_one_over_the_minibatchs_tokens():
    """d loss / d per-token loss: 1 / tokens, every token alike (DAPO's token mean)."""
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    assert torch.allclose(grpo.token_weights(mask), mask / 7)


def test_rso_select_follows_algorithm_1():
    """RSO's Algorithm 1 with fixed uniforms, k = 2 of 4, beta 1. Prompt 0, r = [1, 0, 0.5, 1]:
    round 0 accepts with probabilities [1, e^-1 = 0.37, e^-0.5 = 0.61, 1]; uniforms 0.5, 0.3
    accept 0 and 1, and the round stops there (3 is never drawn). Prompt 1, r = [0, 2, 1, 0.5]:
    round 0 ([0.14, 1, 0.37, 0.22]) accepts 1 only; round 1's r_max is 1, so [0.37, -, 1, 0.61]:
    0.5 rejects 0, 0.9 accepts 2 (at 0.37 it would not have) and k is reached before 3."""
    rewards = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.0, 2.0, 1.0, 0.5]])
    uniforms = torch.tensor(
        [
            [[0.5, 0.3, 0.9, 0.99], [0.0, 0.0, 0.0, 0.0]],
            [[0.2, 0.7, 0.4, 0.3], [0.5, 0.0, 0.9, 0.6]],
        ]
    )
    keep, rounds = grpo.rso_select(rewards, 2, 1.0, uniforms)
    assert keep.tolist() == [[0, 1], [1, 2]] and rounds.tolist() == [1, 2]
    # a high temperature accepts everything in turn; a low one only the best left, round by round
    assert grpo.rso_select(rewards, 2, 1e6, uniforms)[0].tolist() == [[0, 1], [0, 1]]
    assert grpo.rso_select(rewards, 2, 1e-6, uniforms)[0].tolist() == [[0, 3], [1, 2]]
    # as rows of the prompts' consecutive candidates, and the rounds per kept row
    rows, rounds = grpo.rso_rows(rewards.flatten(), 2, 1.0, uniforms)
    assert rows.tolist() == [0, 1, 5, 6] and rounds.tolist() == [1, 1, 2, 2]


# ---- end to end


VARIANTS = ["", "--rejection_sampling_candidates 8 --batch_norm_advantages"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, sft_model):
    """grpo.py's 1-rank and 2-rank runs of a VARIANTS entry, made when first asked for: the 1 = 2
    ranks test and the bit-equality test with grpo_variants.py read the same runs. -> their
    directory (r1, r2) and flags."""
    made = {}

    def runs(variant):
        if variant not in made:
            out = tmp_path_factory.mktemp("pair")
            common = ["--model", sft_model, "--total_episodes", "64", "--eval_every", "2"]
            common += ["--beta", "0.05", *SMALL, *variant.split()]
            run(["--out_dir", str(out / "r1"), *common], nproc=1)
            run(["--out_dir", str(out / "r2"), *common], nproc=2)
            made[variant] = (out, common)
        return made[variant]

    return runs


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_rank_equals_two_ranks_and_first_minibatch_ratio_is_one(pair, variant):
    tmp_path, common = pair(variant)
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
    if "rejection_sampling" in variant:  # 1 round at least, G = 4 at most
        assert all(1 <= m["objective/rso_rounds"] <= 4 for m in a[1:])


def test_reference_of_a_random_tiny_model_is_its_copy(tmp_path):
    """--model tiny: the reference is a copy of the policy as loaded, not a second random init."""
    run_here(
        [
            "--model",
            "tiny",
            "--out_dir",
            str(tmp_path),
            "--total_episodes",
            "32",
            "--beta",
            "0.1",
            *SMALL,
        ]
    )
    m = metrics(tmp_path)[-1]
    assert m["step"] == 1 and m["objective/kl"] < 1e-10 and abs(m["loss/kl_avg"]) < 1e-10, m


def test_resume_matches_uninterrupted(tmp_path, sft_model):
    common = ["--model", sft_model, "--total_episodes", "128", "--eval_every", "2"]
    common += ["--keep_checkpoints", "5", "--beta", "0.05", *SMALL]
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


def wait_for(p, done, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None and not done():
        time.sleep(0.05)


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, sft_model):
    """Fault injection: SIGKILL mid-run (no chance to save), then --resume from the last periodic
    checkpoint."""
    common = ["--model", sft_model, "--total_episodes", str(32 * 24), "--eval_every", "3"]
    common += ["--beta", "0.05", *SMALL]
    run_here(["--out_dir", str(tmp_path / "full"), *common])
    p = start(["--out_dir", str(out := tmp_path / "killed"), *common])
    wait_for(p, lambda: (out / "checkpoints" / "step_00000006").exists())
    p.kill()
    assert p.wait() == -signal.SIGKILL  # still running when killed: the kill came mid-way
    run_here(["--out_dir", str(out), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = {m["step"]: m for m in metrics(out)}  # rows after the checkpoint: logged again
    assert resumed.keys() == full.keys() and full[24]["objective/kl"] > 0
    for step, m in full.items():
        for k in (k for k in m if not k.startswith("perf/")):
            assert abs(resumed[step][k] - m[k]) < 1e-5, (step, k, resumed[step][k], m[k])


def descendants(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    kids = [int(c) for t in tasks for c in (t / "children").read_text().split()]
    return kids + [d for k in kids for d in descendants(k)]


def rank1(workers):  # the one process of rank 1
    env = lambda pid: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (pid,) = [pid for pid in workers if b"RANK=1" in env(pid)]
    return pid


def test_a_rank_that_dies_ends_the_whole_torchrun_run(tmp_path, sft_model):
    """One rank SIGKILLed mid-run: torchrun must end the other rank (blocked in a collective) and
    exit non-zero, not hang."""
    args = ["--model", sft_model, "--out_dir", str(tmp_path), "--total_episodes", "1000000", *SMALL]
    p = start(args, nproc=2)
    wait_for(p, lambda: (tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 3)
    workers = descendants(p.pid)
    assert p.poll() is None
    os.kill(rank1(workers), signal.SIGKILL)
    err = p.communicate(timeout=120)[1]
    assert p.returncode != 0 and "grpo.py FAILED" in err, err[-2000:]
    time.sleep(1)
    assert not [pid for pid in workers if alive(pid)]  # no orphaned rank left running


def alive(pid: int) -> bool:  # a zombie (exited, not yet reaped) is not alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_design_line_on_a_fresh_clone_names_sft(tmp_path):
    """`torchrun --nproc_per_node=2 grpo.py --beta 0.03` with no runs/sft/latest: one line, printed
    once by rank 0, naming the command to run first; no traceback (torchrun then prints its own
    ChildFailedError summary)."""
    p = run(["--beta", "0.03"], nproc=2, check=False, cwd=tmp_path, script=str(ROOT / "grpo.py"))
    err = p.stderr
    assert p.returncode != 0 and err.count("error: no SFT model at 'runs/sft/latest'") == 1, err
    assert "`python sft.py`" in err and 'grpo.py", line' not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "runs/sft/latest" in errors[0] and "python sft.py" in errors[0]
    assert not (tmp_path / "runs").exists()


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
    "--rejection_sampling_candidates 2": "--rejection_sampling_candidates 2: fewer than",
    "--rso_temperature 0": "--rso_temperature 0.0: must be > 0",
    "--no_verifier": "no reward: no verifier (for this task, or --no_verifier)",
}


@pytest.mark.parametrize("flags, expected", BAD.items())
def test_bad_flags_give_one_line_errors(tmp_path, sft_model, flags, expected):
    """In process (as a user runs one: test_bad_numbers_exit_1_with_one_line): each is raised
    before the run dir is claimed."""
    args = ["--model", sft_model, "--out_dir", str(tmp_path / "x"), *SMALL, *flags.split()]
    line = error_line(grpo, args)
    assert expected in line, line
    assert not (tmp_path / "x").exists()


def test_resume_without_a_checkpoint_is_a_one_line_error(tmp_path, sft_model):
    line = error_line(grpo, ["--model", sft_model, "--out_dir", str(tmp_path), "--resume", *SMALL])
    want = f"error: --resume: no complete checkpoint in {tmp_path}/checkpoints: drop --resume"
    assert line == want, line


@pytest.mark.parametrize("flags", ["--lr -1"])
def test_bad_numbers_exit_1_with_one_line(tmp_path, flags):
    """As a user runs one (the others, in this process: test_bad_flags_give_one_line_errors):
    exit status 1, one line naming the flag, no traceback, no run dir."""
    args = ["--out_dir", str(tmp_path / "x"), *flags.split()]
    p = run(args, check=False, cwd=tmp_path, script=str(ROOT / "grpo.py"))
    assert p.returncode == 1 and p.stderr.startswith(f"error: {flags.split()[0]} "), p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "flag, value",
    [("kl_estimator", "k5"), ("kl_estimator", "k3_ratio"), ("dtype", "fp16")],
)
def test_choice_flags_reject_other_values_listing_the_choices(capsys, flag, value):
    """Literal flags: tyro stops at parsing (exit status 2), naming the value and every choice."""
    with pytest.raises(SystemExit) as e:
        grpo.tyro.cli(grpo.Args, args=[f"--{flag}", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"'{value}'" in err, err
    assert all(choice in err for choice in choices(flag)), err


# ---- the variants' flags, and grpo_variants.py at its defaults


@pytest.mark.parametrize(
    "flags, flag",
    [("--advantage rloo", "advantage"), ("--loss_type sapo", "loss_type")]
    + [("--top-p 0.9", "top_p"), ("--no_dynamic_sampling", "dynamic_sampling")]
    + [("--teacher_model=runs/grpo/latest", "teacher_model")],
)
def test_a_flag_of_grpo_variants_is_one_line_naming_it(flags, flag):
    """Spelled with dashes, as --no_ or with =, in this process; as a user runs one: the next."""
    with pytest.raises(grpo.RunError) as e:
        grpo.parse_args(flags.split())
    want = f"--{flag} lives in grpo_variants.py: run `python grpo_variants.py --{flag} ...`"
    assert str(e.value) == want


def test_a_flag_of_grpo_variants_exits_1_with_one_line(tmp_path):
    p = run(["--advantage", "rloo"], check=False, cwd=tmp_path, script=str(ROOT / "grpo.py"))
    want = "error: --advantage lives in grpo_variants.py: run `python grpo_variants.py --advantage ...`"
    assert p.returncode == 1 and p.stderr == want + "\n", p.stderr


def test_every_flag_grpo_leaves_out_is_grpo_variants_and_named_in_moved():
    """grpo_variants.py takes every flag of grpo.py, with its default; grpo.py names each of the
    others."""
    import grpo_variants

    plain = grpo.Args.__dataclass_fields__
    sibling = grpo_variants.Args.__dataclass_fields__
    for name, field in plain.items():
        assert sibling[name].default == field.default, name
    assert set(grpo.MOVED) == set(sibling) - set(plain)
    assert set(grpo.MOVED.values()) == {"grpo_variants.py"}


def test_grpo_variants_at_its_defaults_is_grpo_bit_for_bit(tmp_path, pair, sft_model):
    """Runs that learn (groups with reward variance, updates that move the policy), by grpo.py and
    by grpo_variants.py: every metric but the wall clock's, to the bit. The 1 = 2 ranks test's
    1-rank run (one update a step, KL in the loss); and the plain file's options with 2
    minibatches x 2 epochs, where pi_old is the recomputed one: RSO, batch-normalised advantages,
    k2."""
    out, common = pair("")
    run(["--out_dir", str(tmp_path / "sibling"), *common], nproc=1, script="grpo_variants.py")
    runs = [(metrics(out / "r1"), metrics(tmp_path / "sibling"))]
    common = ["--model", sft_model, "--total_episodes", "64", "--eval_every", "2", *SMALL]
    common += ["--beta", "0.05", "--kl_estimator", "k2", "--rejection_sampling_candidates", "8"]
    common += ["--batch_norm_advantages", "--num_minibatches", "2", "--num_epochs", "2"]
    for script in ("grpo.py", "grpo_variants.py"):
        run_here(["--out_dir", str(tmp_path / script), *common], script=script)
    runs.append((metrics(tmp_path / "grpo.py"), metrics(tmp_path / "grpo_variants.py")))
    for a, b in runs:
        assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2]
        assert a[1]["objective/zero_std_frac"] < 1 and a[1]["train/grad_norm"] > 0
        assert a[2]["objective/kl"] > 1e-6  # the policy moved
        for x, y in zip(a, b):
            assert {k: v for k, v in x.items() if not k.startswith("perf/")} == {
                k: v for k, v in y.items() if not k.startswith("perf/")
            }
    assert runs[1][0][1]["policy/approxkl_avg"] > 0  # later minibatches: off-policy


def test_the_step_profile_in_the_docs_runs():
    """experiments/profile_grpo.py, which docs/benchmarks.md quotes: a step's time, the rollout's
    share of it and the ops, in a short run."""
    script = str(ROOT / "experiments" / "profile_grpo.py")
    flags = ["--warmup", "1", "--active", "2", "--prompts", "4", "--samples", "2", "--top", "3"]
    p = subprocess.run(
        [sys.executable, script, *flags], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, why(p)
    lines = p.stdout.splitlines()
    assert "threads 1, 2 steps after 1" in lines and "aten::addmm" in p.stdout, p.stdout[-2000:]
    step = next(line for line in lines if line.startswith("step under the profiler:"))
    generate = next(line for line in lines if line.startswith("  gpt2.generate:"))
    assert 0 < float(generate.split()[1]) < float(step.split()[4]), (step, generate)
