"""bf16 on CPU, as a GPU run computes it: in one process (autocast) and under torchrun (FSDP2's bf16
parameters, fp32 gradient reduction). The on-policy invariants hold exactly, and 1 and 2 ranks agree
within the tolerance that bf16 rounding of the parameters allows."""

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from failed_run import why
from runs import in_process

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


def run(script, args, nproc):
    """A bf16 run's metrics: under torchrun with nproc ranks, or in this process (nproc 0, as one
    process runs it: runs.in_process)."""
    args = [*args, "--dtype", "bfloat16"]
    if nproc:
        cmd = [*TORCHRUN, str(nproc), script, *args]
        p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
        assert p.returncode == 0, why(p)
    else:
        in_process(importlib.import_module(script.removesuffix(".py")), args)
    out_dir = Path(args[args.index("--out_dir") + 1])
    return [json.loads(line) for line in open(out_dir / "metrics.jsonl")]


@pytest.mark.parametrize("nproc", [0, 2])
def test_grpo_first_minibatch_is_exactly_on_policy(tmp_path, nproc):
    """One epoch, one minibatch: pi_old is the training forward's own log-probs, so the ratio is
    exactly 1 in bf16 too. The frozen reference, stored in bf16 as the policy computes, is the
    policy at step 1: the loss's KL to it (the trainer's log-probs on both sides) is exactly 0."""
    flags = "--model tiny --beta 0.05 --total_episodes 64 --num_prompts_per_step 8 "
    flags += "--num_samples_per_prompt 4 --num_minibatches 1 --micro_batch_size 8 --eval_size 0 "
    flags += "--response_length 4 --missing_eos_penalty 1 --lr 3e-4"
    rows = run("grpo.py", ["--out_dir", str(tmp_path), *flags.split()], nproc)
    for m in rows:
        assert m["val/ratio"] == 1.0 and m["val/ratio_var"] == 0.0, m
        assert m["policy/approxkl_avg"] == 0.0 and m["policy/clipfrac_avg"] == 0.0, m
    assert rows[0]["loss/kl_avg"] == 0.0 and rows[-1]["loss/kl_avg"] > 0
    # objective/kl sets the sampler's log-probs (the KV-cache decode) against the reference's full
    # forward. In bf16 the two paths round differently on some CPUs' kernels (the sampler-trainer
    # gap), so at step 1 it is round-off, not 0: a per-token k3 of 1e-5 is a log-prob gap of
    # ~4.5e-3, a few bf16 ulps, while a wrong reference (another init) gives a k3 far above 1e-2.
    assert 0.0 <= rows[0]["objective/kl"] < 1e-5 and rows[-1]["objective/kl"] > 1e-3


def test_dpo_starts_at_ln2_in_one_process(tmp_path):
    """autocast in one process: π_ref is scored through the same path as π, so the loss is ln 2."""
    flags = "--model tiny --total_steps 1 --max_train_pairs 16 --batch_size 8 --eval_size 16"
    first = run("dpo.py", ["--out_dir", str(tmp_path), *flags.split()], 0)[0]
    assert first["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_one_and_two_ranks_agree_in_bf16(tmp_path):
    """The same global batches on 1 and 2 ranks. Step 1's loss is the same forward, so equal, and its
    gradient norm differs only by the order of the fp32 gradient sums. After that, those last bits
    flip the bf16 rounding of a few parameters, and Adam (whose step does not shrink with the
    gradient) carries the flips on: the losses drift apart chaotically, by an amount that depends on
    the CPU's bf16 kernels. Any other reordering of the same sums drifts as far, so the bound is set
    by one: the same run on 1 rank with a micro-batch of 8 instead of 4. A real fault (a rank on the
    wrong rows, a lost gradient sync, a normaliser off by the rank count) shows at step 1."""
    flags = "--total_steps 10 --eval_every 10 --batch_size 16 --eval_size 32 "
    flags += "--warmup_steps 5 --log_every 1"
    runs = {}
    for name, nproc, micro in (("r1", 1, 4), ("r2", 2, 4), ("control", 1, 8)):
        args = ["--out_dir", str(tmp_path / name), "--micro_batch_size", str(micro)]
        runs[name] = [m for m in run("sft.py", args + flags.split(), nproc) if m["step"]]
    a, b, control = runs["r1"], runs["r2"], runs["control"]
    assert len(a) == len(b) == 10
    assert a[0]["train/loss"] == b[0]["train/loss"]
    assert a[0]["train/grad_norm"] == pytest.approx(b[0]["train/grad_norm"], rel=1e-5)
    drift = max(abs(x["train/loss"] - y["train/loss"]) / x["train/loss"] for x, y in zip(a, b))
    reorder = max(
        abs(x["train/loss"] - y["train/loss"]) / x["train/loss"] for x, y in zip(a, control)
    )
    assert drift <= 4 * max(reorder, 1e-4), (drift, reorder)
    assert a[-1]["train/loss"] < a[0]["train/loss"] - 1  # it trains: not two equal broken runs
