"""sft.py end to end: a tiny run learns, 1 rank == 2 ranks (FSDP2, gloo), resume == uninterrupted, SIGTERM saves a
checkpoint, bad flags give one-line errors."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
SMALL = ["--batch_size", "16", "--micro_batch_size", "4", "--eval_size", "32", "--warmup_steps", "5", "--log_every", "1"]


def run(args, nproc=0, check=True):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    p = subprocess.run(launcher + ["sft.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def test_tiny_run_learns_and_saves(tmp_path):
    run(["--out_dir", str(tmp_path), "--total_steps", "40", "--eval_every", "40", *SMALL])
    m = metrics(tmp_path)
    assert m[-1]["train/loss"] < m[0]["train/loss"] - 1.0  # from ~5.5 (uniform over 257) down
    assert "eval/accuracy" in m[-1] and "eval/loss" in m[-1]
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    assert json.load(open(tmp_path / "args.json"))["total_steps"] == 40


def test_one_rank_equals_two_ranks(tmp_path):
    common = ["--total_steps", "8", "--eval_every", "8", *SMALL]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        assert abs(x["train/loss"] - y["train/loss"]) < 1e-4, (x, y)
    assert abs(a[-1]["eval/loss"] - b[-1]["eval/loss"]) < 1e-4


def test_resume_matches_uninterrupted(tmp_path):
    common = ["--total_steps", "12", "--eval_every", "6", "--keep_checkpoints", "5", *SMALL]
    run(["--out_dir", str(tmp_path / "full"), *common])
    # restart from the step-6 checkpoint of the same run in a fresh out_dir
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000006"
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    run(["--out_dir", str(tmp_path / "resumed"), "--resume", *common])
    full = {m["step"]: m["train/loss"] for m in metrics(tmp_path / "full")}
    resumed = {m["step"]: m["train/loss"] for m in metrics(tmp_path / "resumed")}
    assert min(resumed) == 7
    for step, loss in resumed.items():
        assert abs(loss - full[step]) < 1e-5, (step, loss, full[step])


def test_sigterm_saves_checkpoint_then_resume_finishes(tmp_path):
    args = ["--out_dir", str(tmp_path), "--total_steps", "3000", "--eval_every", "100000", *SMALL]
    p = subprocess.Popen([sys.executable, "sft.py", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 5):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0 and "SIGTERM" in out, out[-1000:]
    steps = sorted(os.listdir(tmp_path / "checkpoints"))
    assert steps and steps[-1].startswith("step_")
    stopped_at = int(steps[-1].split("_")[1])
    run(["--out_dir", str(tmp_path), "--resume", *args[:2], "--total_steps", str(stopped_at + 3), "--eval_every", "100000", *SMALL])
    assert metrics(tmp_path)[-1]["step"] == stopped_at + 3


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    """Fault injection: SIGKILL mid-run (no chance to save), then --resume from the last periodic checkpoint."""
    common = ["--total_steps", "40", "--eval_every", "4", *SMALL]
    run(["--out_dir", str(tmp_path / "full"), *common])
    out = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "sft.py", "--out_dir", str(out), *common], cwd=ROOT, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None and not (out / "checkpoints" / "step_00000008").exists():
        time.sleep(0.05)
    p.kill()
    assert p.wait() == -signal.SIGKILL  # still running when killed: the kill came mid-way
    run(["--out_dir", str(out), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = {m["step"]: m for m in metrics(out)}  # last row per step (steps after the checkpoint are logged twice)
    assert resumed.keys() == full.keys()
    for step, m in full.items():
        assert abs(resumed[step]["train/loss"] - m["train/loss"]) < 1e-5, (step, resumed[step], m)


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(tmp_path):
    common = ["--out_dir", str(tmp_path), "--eval_every", "2", "--keep_checkpoints", "1", *SMALL]
    run(["--total_steps", "2", *common])
    p = run(["--total_steps", "6", "--resume", "--lr", "1e12", *common], check=False)  # diverges right away
    assert p.returncode != 0 and "non-finite loss" in p.stderr and "at step 4" in p.stderr, p.stderr  # steps 3 ok, 4 diverged
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000002"]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--batch_size", "10", "--micro_batch_size", "4"], "micro_batch_size"),
        (["--data", "/nonexistent/dir"], "no dataset at"),
        (["--model", "gpt3"], "no checkpoint at"),
        (["--resume"], "no checkpoint in"),
        (["--micro_batch_size", "0"], "divisible"),
    ],
)
def test_bad_flags_give_one_line_errors(tmp_path, flags, expected):
    p = run(["--out_dir", str(tmp_path / "x"), "--total_steps", "2", *flags], check=False)
    assert p.returncode != 0
    assert expected in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_unwritable_out_dir(tmp_path):
    (tmp_path / "file").write_text("")  # a directory cannot be made under a file, even as root
    p = run(["--out_dir", str(tmp_path / "file" / "run"), "--total_steps", "2"], check=False)
    assert p.returncode != 0
    assert "not writable" in p.stderr or "cannot write to out_dir" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
