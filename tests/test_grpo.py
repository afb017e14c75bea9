"""grpo.py: KL estimators (values, gradients, which ones are unbiased), group advantages, 1 rank == 2 ranks with the
first-minibatch invariant, a tiny run with every option and a reward model, resume == uninterrupted, one-line errors."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import gpt2  # noqa: E402
import grpo  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
# 3 tokens: longer answers miss the stop token and get the penalty, so groups have reward variance from the start
SMALL = ["--num_prompts_per_step", "8", "--num_samples_per_prompt", "4", "--micro_batch_size", "8", "--eval_size", "32",
         "--response_length", "3", "--missing_eos_penalty", "1", "--log_every", "1", "--lr", "3e-4", "--num_minibatches", "1"]


def run(script, args, nproc=0, check=True):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    p = subprocess.run(launcher + [script, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 or not check, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def metrics(out_dir):  # one dict per logged step
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """A tiny model after a short SFT: it has learnt to answer with digits and a stop token."""
    out = tmp_path_factory.mktemp("sft")
    run("sft.py", ["--out_dir", str(out), "--total_steps", "60", "--eval_every", "60", "--batch_size", "32",
                   "--micro_batch_size", "32", "--warmup_steps", "5", "--eval_size", "8", "--log_every", "60"])  # fmt: skip
    return str(out)


# ---- pure helpers

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


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_equal_rewards_are_zero(scale):
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 0.3, 0.3, 0.3, 0.3, 0, 0, 0, 0])
    adv = grpo.group_advantages(scores, 4, scale)
    assert torch.isfinite(adv).all() and (adv[:4] == 0).all() and (adv[8:] == 0).all()
    want = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / ((0.5 / math.sqrt(0.75) + 1e-4) if scale else 1.0)  # unbiased std
    assert torch.allclose(adv[4:8], want, atol=1e-6)


# ---- end to end


def test_one_rank_equals_two_ranks_and_first_minibatch_ratio_is_one(tmp_path, sft_model):
    common = ["--model", sft_model, "--total_episodes", "64", "--eval_every", "2", "--beta", "0.05", *SMALL]
    run("grpo.py", ["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run("grpo.py", ["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2]
    assert a[1]["objective/zero_std_frac"] < 1 and a[1]["train/grad_norm"] > 0  # some groups carry signal
    for x, y in zip(a, b):
        for k in x:
            if not k.startswith("perf/"):
                assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])
    for m in a[1:]:  # one minibatch, one epoch: each update is the first minibatch, pi_theta = pi_old
        assert abs(m["val/ratio"] - 1) < 1e-6 and m["policy/approxkl_avg"] < 1e-6 and m["policy/clipfrac_avg"] == 0
    assert a[1]["objective/kl"] == 0 and a[2]["objective/kl"] > 0 and (tmp_path / "r2" / "model.safetensors").exists()


def test_tiny_run_with_every_option_and_a_reward_model(tmp_path, sft_model):
    rm = grpo.ScalarModel(gpt2.load_model(sft_model), gain=2.0, bias=-1.0)  # random head: continuous scores
    gpt2.save_model(rm.state_dict(), rm.config, str(tmp_path / "rm"), extra_config={"reward_gain": 2.0, "reward_bias": -1.0})
    run("grpo.py", ["--model", sft_model, "--out_dir", str(tmp_path), "--total_episodes", "96", "--eval_every", "3",
                    *SMALL, "--reward_model", str(tmp_path / "rm"), "--num_minibatches", "2", "--num_epochs", "2",
                    "--micro_batch_size", "4", "--kl_estimator", "k4", "--beta", "0.1", "--loss_aggregation", "sequence",
                    "--no-scale_rewards_by_std", "--batch_norm_advantages", "--response_length", "6"])  # fmt: skip
    m = metrics(tmp_path)
    assert [r["step"] for r in m] == [0, 1, 2, 3] and all(math.isfinite(v) for r in m for v in r.values())
    assert m[1]["objective/zero_std_frac"] == 0 and "eval/accuracy" in m[-1]  # RM scores differ within each group
    assert m[-1]["policy/approxkl_avg"] > 0 and m[-1]["val/ratio_var"] > 0  # later minibatches/epochs are off-policy
    assert gpt2.load_model(str(tmp_path)).config.n_layer == 4


def test_resume_matches_uninterrupted(tmp_path, sft_model):
    common = ["--model", sft_model, "--total_episodes", "128", "--eval_every", "2", "--keep_checkpoints", "5", *SMALL]
    run("grpo.py", ["--out_dir", str(tmp_path / "full"), *common])
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    run("grpo.py", ["--out_dir", str(tmp_path / "resumed"), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    for m in resumed:
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
    common = ["--model", sft_model, "--total_episodes", str(32 * 24), "--eval_every", "3", *SMALL]
    run("grpo.py", ["--out_dir", str(tmp_path / "full"), *common])
    p = start(["--out_dir", str(out := tmp_path / "killed"), *common])
    wait_for(p, lambda: (out / "checkpoints" / "step_00000006").exists())
    p.kill()
    assert p.wait() == -signal.SIGKILL  # still running when killed: the kill came mid-way
    run("grpo.py", ["--out_dir", str(out), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = {m["step"]: m for m in metrics(out)}  # last row per step (steps after the checkpoint are logged twice)
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


BAD = [(["--kl_estimator", "k5"], "unknown --kl_estimator"), (["--num_samples_per_prompt", "1"], "per_prompt >= 2"),
       (["--num_minibatches", "3"], "num_minibatches"), (["--model", "/x"], "no checkpoint at"), (["--resume"], "no checkpoint in")]


@pytest.mark.parametrize("flags, expected", BAD)
def test_bad_flags_give_one_line_errors(tmp_path, sft_model, flags, expected):
    assert (p := run("grpo.py", ["--model", sft_model, "--out_dir", str(tmp_path / "x"), *SMALL, *flags], check=False)).returncode
    assert expected in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
