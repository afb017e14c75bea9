"""The CUDA path (nccl, bf16): skipped without a GPU. tests/conftest.py hides the GPUs from the
rest of the suite; these tests give them back to their own subprocesses."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEVICES = os.environ.get("RLHF_TEST_CUDA_VISIBLE_DEVICES", "all")
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4")
if DEVICES == "all":
    ENV.pop("CUDA_VISIBLE_DEVICES", None)
else:
    ENV["CUDA_VISIBLE_DEVICES"] = DEVICES


def cuda_count():
    probe = "import torch; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", probe], env=ENV, capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


GPUS = cuda_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA device")


def run(script, args, nproc=0):
    """plain python (nproc 0: autocast, no process group) or torchrun (nccl, FSDP2)."""
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    p = subprocess.run(
        launcher + [f"{script}.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    # a normal run prints no warnings (torchrun x1 printed barrier()'s device_id one, docs/gpu.md)
    assert "Warning" not in p.stderr, p.stderr[-3000:]
    return p


def rows(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    run("sft", ["--out_dir", str(out), "--total_steps", "20", "--eval_size", "16"])
    return str(out)


@pytest.mark.parametrize("nproc", sorted({0, 1, min(2, GPUS)}))
def test_dpo_starts_at_ln2_in_bf16(sft_model, tmp_path, nproc):
    args = ["--model", sft_model, "--out_dir", str(tmp_path), "--total_steps", "1"]
    run("dpo", [*args, "--eval_size", "0", "--batch_size", "8", "--micro_batch_size", "4"], nproc)
    assert abs(rows(tmp_path)[0]["train/loss"] - math.log(2)) < 1e-6


@pytest.mark.parametrize("nproc", sorted({0, 1, min(2, GPUS)}))
def test_grpo_first_minibatch_is_exactly_on_policy_in_bf16(sft_model, tmp_path, nproc):
    args = ["--model", sft_model, "--out_dir", str(tmp_path), "--total_episodes", "64"]
    args += ["--num_prompts_per_step", "8", "--num_samples_per_prompt", "8", "--eval_size", "0"]
    run("grpo", [*args, "--num_minibatches", "1", "--num_epochs", "1", "--beta", "0.05"], nproc)
    first = rows(tmp_path)[0]
    assert first["val/ratio_var"] == 0 and first["policy/approxkl_avg"] == 0, first


def test_a_gpu_checkpoint_resumes_on_cpu(sft_model, tmp_path):
    """A checkpoint written on a GPU resumes on the CPU: it holds CPU tensors only."""
    common = ["--model", sft_model, "--total_steps", "4", "--eval_every", "2", "--eval_size", "0"]
    run("dpo", ["--out_dir", str(tmp_path), *common, "--total_steps", "2"])
    step2 = tmp_path / "checkpoints" / "step_00000002"
    state = torch.load(step2 / "policy" / "optimizer.pt", weights_only=True)
    tensors = [v for group in state["state"].values() for v in group.values()]
    assert tensors and all(t.device.type == "cpu" for t in tensors if torch.is_tensor(t))
    cpu = dict(ENV, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [sys.executable, "dpo.py", "--out_dir", str(tmp_path), "--resume", *common],
        cwd=ROOT,
        env=cpu,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr[-3000:]
