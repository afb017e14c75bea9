"""The sampler-trainer correction (grpo_variants.py and ppo_variants.py, --sampler_correction, --sampler_cap):
- each mode's weights against a hand computation, and exactly 1 when the two sides agree bitwise;
- end to end, with the sampler's log-probs shifted on purpose (gpt2.generate wrapped in process):
  truncation doubles the policy loss at C = 2, masking drops it, the mismatch metrics see the gap,
  and no correction ("none") leaves the run as it was;
- "auto" in fp32 is "none", bit for bit, and the default "off" the same run less its mismatch
  metrics; 1 rank = 2 ranks with a correction on;
- a cap below 1 is a one-line error in both scripts."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpt2
import grpo_variants
import ppo_variants
from failed_run import why
from runs import error_line

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SMALL = (
    "--num_prompts_per_step 8 --num_samples_per_prompt 4 --micro_batch_size 8 --eval_size 0 "
    "--response_length 4 --missing_eos_penalty 1 --log_every 1 --lr 3e-4 --total_episodes 64"
).split()


def run(args, nproc=0, script="grpo_variants.py"):
    cmd = [*TORCHRUN, str(nproc), script, *args] if nproc else [sys.executable, script, *args]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, why(p)


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


@pytest.fixture
def sft_model(sft_run):
    """A tiny model after a short SFT (tests/conftest.py's at step 150): its answers differ, so
    that groups have reward variance, and one step at --lr 1e-5 moves its ratios little."""
    return str(sft_run / "checkpoints" / "step_00000150" / "model")


# ---- the weights by hand

# two responses of 3 tokens; the second has 2, then padding (a gap there must count nowhere)
OLD = [[-1.0, -2.0, -0.5], [-0.3, -1.0, 0.0]]
SAMPLER = [[-1.5, -1.0, -0.5], [-0.1, -0.2, 7.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_weights_by_hand(mode):
    old = torch.tensor(OLD)
    sampler = torch.tensor(SAMPLER)
    mask = torch.tensor(MASK)
    cap = 2.0
    weights, ratio = grpo_variants.sampler_correction(old, sampler, mask, mode, cap)
    # token ratios pi_old / pi_sampler: e^0.5, e^-1, 1 | e^-0.2, e^-0.8, (padding) 1
    token = [[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(-0.2), math.exp(-0.8), 1.0]]
    if mode.startswith("sequence"):
        # the product over each response's real tokens: e^-0.5 and e^-1.0
        token = [[math.exp(-0.5)] * 3, [math.exp(-1.0)] * 3]
    expected = torch.tensor(token)
    torch.testing.assert_close(ratio, expected)
    if mode == "none":
        expected = torch.ones(2, 3)
    elif mode.endswith("truncate"):
        expected = expected.clamp(max=cap)
    elif mode.endswith("mask"):
        # e^-1 = 0.37 and e^-0.8 = 0.45 are below 1/2, and so is the second response's e^-1
        expected = torch.where((expected < 0.5) | (expected > cap), 0.0, expected)
    torch.testing.assert_close(weights, expected)


def test_mask_modes_drop_ratios_on_either_side_of_the_band():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    # ratios 4, 1.5, 1/1.5 and 1/4 against C = 2: the first and last leave [1/2, 2]
    sampler = -torch.tensor([[math.log(4), math.log(1.5), -math.log(1.5), -math.log(4)]])
    mask = torch.ones(1, 4)
    weights, _ = grpo_variants.sampler_correction(old, sampler, mask, "token_mask", 2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.5, 1 / 1.5, 0.0]]))
    weights, _ = grpo_variants.sampler_correction(old, sampler, mask, "token_truncate", 2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.5, 1 / 1.5, 0.25]]))


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_equal_log_probs_give_weights_of_exactly_one(mode):
    """Where the sampler and the trainer agree bitwise, every mode is an exact no-op."""
    torch.manual_seed(0)
    logprobs = -torch.rand(8, 5) * 3
    mask = (torch.rand(8, 5) > 0.2).float()
    weights, ratio = grpo_variants.sampler_correction(logprobs, logprobs.clone(), mask, mode, 2.0)
    assert torch.equal(weights, torch.ones(8, 5)) and torch.equal(ratio, torch.ones(8, 5))


def test_ppo_copy_is_grpo_s():
    """tests/test_copies.py checks the sources; this checks that ppo_variants.py's copy runs."""
    args = (torch.tensor(OLD), torch.tensor(SAMPLER), torch.tensor(MASK), "sequence_mask", 3.0)
    for a, b in zip(
        grpo_variants.sampler_correction(*args), ppo_variants.sampler_correction(*args)
    ):
        assert torch.equal(a, b)


# ---- end to end: a sampler made to disagree


def shifted_generate(shift):
    """gpt2.generate, with the sampler's log-probs lowered by shift on every response token."""
    generate = gpt2.generate

    def wrapped(*args, **kwargs):
        rollout = generate(*args, **kwargs)
        logprobs = rollout.logprobs - shift * rollout.mask
        return rollout._replace(logprobs=logprobs)

    return wrapped


def grpo_run(out_dir, sft_model, flags):
    args = ["--model", sft_model, "--out_dir", str(out_dir), *SMALL, *flags]
    grpo_variants.main(grpo_variants.tyro.cli(grpo_variants.Args, args=args, use_underscores=True))
    return metrics(out_dir)


def test_a_shifted_sampler_is_truncated_or_masked(tmp_path, sft_model, monkeypatch):
    # pi_old / pi_sampler = e on every token: above C = 2. The first step: one minibatch, whose
    # pi_old is its own forward
    monkeypatch.setattr(gpt2, "generate", shifted_generate(1.0))
    runs = {}
    for mode in ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]:
        flags = ["--num_minibatches", "1", "--sampler_correction", mode, "--sampler_cap", "2"]
        runs[mode] = grpo_run(tmp_path / mode, sft_model, flags)
    base = runs["none"][0]
    assert base["train/grad_norm"] > 0
    for mode, rows in runs.items():
        m = rows[0]
        # the gap is measured whatever the mode: k3 of ratio e, every token outside [1/2, 2]
        assert m["mismatch/k3_kl"] == pytest.approx(math.e - 2, rel=1e-4)
        assert m["mismatch/outside_frac"] == 1.0
        if mode.startswith("sequence"):
            # a response's ratio is e to its length: at least e
            assert m["mismatch/ratio_min"] >= math.e * 0.9999
        else:
            assert m["mismatch/ratio_min"] == pytest.approx(math.e, rel=1e-4)
            assert m["mismatch/ratio_max"] == pytest.approx(math.e, rel=1e-4)
        if mode.endswith("truncate"):
            # every weight is C = 2: twice the loss and the gradient of no correction
            assert m["loss/policy_avg"] == pytest.approx(2 * base["loss/policy_avg"], rel=1e-6)
            assert m["train/grad_norm"] == pytest.approx(2 * base["train/grad_norm"], rel=1e-4)
        elif mode.endswith("mask"):
            # every token is out of the loss
            assert m["loss/policy_avg"] == 0 and m["train/grad_norm"] == 0


def test_pi_old_is_the_trainers_for_later_minibatches_whatever_the_correction(
    tmp_path, sft_model, monkeypatch
):
    """With two minibatches the second's pi_old is a forward pass, never the shifted sampler's:
    its ratio stays near 1 with a correction, with none and with the default (off), and the
    mismatch is measured over every token. (A sampler's pi_old would give it a ratio of e.)"""
    monkeypatch.setattr(gpt2, "generate", shifted_generate(1.0))
    for mode in ("token_truncate", "none", "off"):
        flags = ["--num_minibatches", "2", "--sampler_correction", mode, "--lr", "1e-5"]
        m = grpo_run(tmp_path / mode, sft_model, flags)[0]
        assert abs(m["val/ratio"] - 1) < 1e-3 and m["policy/clipfrac_avg"] == 0, mode
        assert mode == "off" or m["mismatch/outside_frac"] == 1.0


def test_fp32_auto_is_no_correction_and_off_the_same_run_bit_for_bit(tmp_path, sft_model):
    """In fp32, auto is none: the same run, bit for bit. The default, off, is that run too, less
    the mismatch metrics it does not measure."""
    flags = ["--num_minibatches", "2", "--beta", "0.05"]
    a = grpo_run(tmp_path / "auto", sft_model, [*flags, "--sampler_correction", "auto"])
    b = grpo_run(tmp_path / "none", sft_model, [*flags, "--sampler_correction", "none"])
    off = grpo_run(tmp_path / "off", sft_model, flags)
    for x, y, z in zip(a, b, off):
        assert {k: v for k, v in x.items() if not k.startswith("perf/")} == {
            k: v for k, v in y.items() if not k.startswith("perf/")
        }
        assert {k: v for k, v in x.items() if not k.startswith(("perf/", "mismatch/"))} == {
            k: v for k, v in z.items() if not k.startswith("perf/")
        }
    # the trainer and the sampler agree to rounding in fp32
    assert a[0]["mismatch/k3_kl"] < 1e-9 and abs(a[0]["mismatch/ratio_max"] - 1) < 1e-4


def test_one_rank_equals_two_ranks_with_a_correction(tmp_path, sft_model):
    common = ["--model", sft_model, "--eval_every", "2", "--beta", "0.05", *SMALL]
    common += ["--num_minibatches", "2", "--sampler_correction", "sequence_mask"]
    run(["--out_dir", str(tmp_path / "r1"), *common])
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in (k for k in x if not k.startswith("perf/")):
            assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])


def test_ppo_measures_and_corrects_a_shifted_sampler(tmp_path, monkeypatch):
    torch.manual_seed(0)
    tiny = dict(**gpt2.PRESETS["tiny"], vocab_size=257)
    gpt2.save(gpt2.GPT(gpt2.GPTConfig(**tiny)), str(tmp_path / "sft"))
    reward = gpt2.ScalarModel(gpt2.GPT(gpt2.GPTConfig(**tiny)), 2.0, -0.5)
    gpt2.save(reward, str(tmp_path / "rm"))
    monkeypatch.setattr(gpt2, "generate", shifted_generate(1.0))
    rows = {}
    for mode in ["none", "token_mask"]:
        args = ["--model", str(tmp_path / "sft"), "--reward_model", str(tmp_path / "rm")]
        args += ["--out_dir", str(tmp_path / mode), "--batch_size", "16", "--micro_batch_size", "4"]
        args += ["--response_length", "6", "--eval_size", "0", "--total_episodes", "16"]
        args += ["--sampler_correction", mode]
        ppo_variants.main(ppo_variants.tyro.cli(ppo_variants.Args, args=args, use_underscores=True))
        rows[mode] = metrics(tmp_path / mode)[-1]
    for m in rows.values():
        assert m["mismatch/ratio_max"] == pytest.approx(math.e, rel=1e-4)
        assert m["mismatch/outside_frac"] == 1.0
    assert rows["none"]["loss/policy_avg"] != 0 and rows["token_mask"]["loss/policy_avg"] == 0


@pytest.mark.parametrize("script", [grpo_variants, ppo_variants])
def test_a_cap_below_one_is_a_one_line_error(tmp_path, script):
    args = ["--out_dir", str(tmp_path / "x"), "--sampler_cap", "0.5", "--model", "tiny"]
    if script is ppo_variants:
        args += ["--reward_model", "tiny"]
    line = error_line(script, args)
    assert "--sampler_cap 0.5" in line, line
