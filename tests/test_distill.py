"""On-policy distillation in grpo_variants.py (--teacher_model, --teacher_coef):
- the per-token advantage against a hand computation;
- a teacher that is the student gives no signal; another teacher does, alone or beside the verifier;
- the eval accuracy is logged with --no_verifier (the task still has its verifier);
- 1 rank = 2 ranks, a resumed run = the uninterrupted one, and one-line errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_variants
from failed_run import why
from runs import error_line, in_process

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
SMALL = (
    "--num_prompts_per_step 8 --num_samples_per_prompt 4 --micro_batch_size 8 --eval_size 16 "
    "--response_length 4 --log_every 1 --lr 3e-4 --num_minibatches 2 --eval_every 2"
).split()


def run(args, nproc=0, script="grpo_variants.py"):
    cmd = [*TORCHRUN, str(nproc), script, *args] if nproc else [sys.executable, script, *args]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, why(p)


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


@pytest.fixture
def models(sft_run):
    """A student (the short SFT's step-100 checkpoint) and a teacher (the same run at its end:
    150 more steps from the same start), tests/conftest.py's."""
    return dict(student=sft_run / "checkpoints" / "step_00000100" / "model", teacher=sft_run)


def test_advantages_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, 0.0]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-0.3, -0.2, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = grpo_variants.distillation_advantages(logprobs, teacher, mask, coef=2.0)
    # 2 (log pi_teacher - log pi), per token; 0 past the response
    expected = torch.tensor([[1.0, -2.0, 0.0], [0.0, 1.6, 0.0]])
    torch.testing.assert_close(advantages, expected)


def distill(out_dir, models, teacher, *flags):
    args = ["--model", str(models["student"]), "--out_dir", str(out_dir), *SMALL]
    args += ["--total_episodes", "64", "--teacher_model", str(models[teacher]), *flags]
    grpo_variants.main(grpo_variants.tyro.cli(grpo_variants.Args, args=args, use_underscores=True))
    return metrics(out_dir)


def test_the_student_as_its_own_teacher_gives_no_signal(tmp_path, models):
    rows = distill(tmp_path / "self", models, "student", "--no_verifier")
    # the sampler's log-probs against a full forward's: equal to rounding
    assert abs(rows[1]["objective/teacher_kl"]) < 1e-5
    assert rows[1]["train/grad_norm"] < 1e-3
    # the task keeps its verifier for the eval, though the reward has none
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2]
    assert rows[1]["objective/scores"] == 0


def test_a_teacher_is_a_signal_alone_and_beside_the_verifier(tmp_path, models):
    alone = distill(tmp_path / "alone", models, "teacher", "--no_verifier")
    assert alone[1]["objective/teacher_kl"] > 1e-3 and alone[1]["train/grad_norm"] > 1e-3
    off = distill(tmp_path / "off", models, "teacher", "--no_verifier", "--teacher_coef", "0")
    assert off[1]["train/grad_norm"] == 0
    both = distill(tmp_path / "both", models, "teacher")
    args = ["--model", str(models["student"]), "--out_dir", str(tmp_path / "verifier")]
    args += [*SMALL, "--total_episodes", "64"]
    grpo_variants.main(grpo_variants.tyro.cli(grpo_variants.Args, args=args, use_underscores=True))
    verifier = metrics(tmp_path / "verifier")
    # the same samples and rewards at step 1; the teacher's advantage changes the loss
    assert both[1]["objective/scores"] == verifier[1]["objective/scores"]
    assert both[1]["loss/policy_avg"] != verifier[1]["loss/policy_avg"]


def test_one_rank_equals_two_ranks(tmp_path, models):
    common = ["--model", str(models["student"]), "--teacher_model", str(models["teacher"])]
    common += [*SMALL, "--total_episodes", "64", "--beta", "0.05"]
    in_process(grpo_variants, ["--out_dir", str(tmp_path / "r1"), *common])
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in (k for k in x if not k.startswith("perf/")):
            assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])


def test_resume_matches_uninterrupted(tmp_path, models):
    common = ["--model", str(models["student"]), "--teacher_model", str(models["teacher"])]
    common += [*SMALL, "--total_episodes", "128", "--keep_checkpoints", "5", "--no_verifier"]
    in_process(grpo_variants, ["--out_dir", str(tmp_path / "full"), *common])
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    in_process(grpo_variants, ["--out_dir", str(tmp_path / "resumed"), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    for m in resumed:
        for k in (k for k in m if not k.startswith("perf/")):
            assert m[k] == full[m["step"]][k], (k, m[k], full[m["step"]][k])


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("--teacher_coef -1", "--teacher_coef -1.0: must be >= 0"),
        ("--teacher_coef nan", "--teacher_coef nan: not a finite number"),
        ("--teacher_model /x", "no checkpoint at '/x'"),
        ("--teacher_model STUDENT --no_verifier --dynamic_sampling", "--dynamic_sampling drops"),
    ],
)
def test_bad_values_give_one_line_errors(tmp_path, models, flags, expected):
    flags = flags.replace("STUDENT", str(models["student"]))
    args = ["--model", str(models["student"]), "--out_dir", str(tmp_path / "x"), *SMALL]
    line = error_line(grpo_variants, args + flags.split())
    assert expected in line, line
    assert not (tmp_path / "x").exists()
