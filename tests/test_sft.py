"""sft.py end to end: a tiny run learns, 1 rank == 2 ranks (FSDP2, gloo), resume == uninterrupted, SIGTERM saves a
checkpoint, bad flags give one-line errors."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import data
import gpt2
import sft
from failed_run import why
from runs import error_line, in_process

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
SMALL = [
    "--batch_size",
    "16",
    "--micro_batch_size",
    "4",
    "--eval_size",
    "32",
    "--warmup_steps",
    "5",
    "--log_every",
    "1",
]


def run(args, nproc=0, check=True):
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else [sys.executable]
    )
    p = subprocess.run(
        launcher + ["sft.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    if check:
        assert p.returncode == 0, why(p)
    return p


def run_here(args):
    """A run as run() makes it, in this process (runs.in_process): for the tests whose subject is
    the run, not its process."""
    in_process(sft, args)


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def test_tiny_run_learns_and_saves(tmp_path):
    run_here(["--out_dir", str(tmp_path), "--total_steps", "40", "--eval_every", "40", *SMALL])
    m = metrics(tmp_path)
    assert m[0]["step"] == 0 and m[0]["eval/loss"] == pytest.approx(m[1]["train/loss"], abs=0.2)
    # step 0: the policy is its own reference, every implicit reward 0, every pair a tie
    assert m[0]["eval/preference_accuracy"] == 0.5
    assert m[-1]["train/loss"] < m[1]["train/loss"] - 1.0  # from ~5.5 (uniform over 257) down
    assert "eval/accuracy" in m[-1] and m[-1]["eval/loss"] < m[0]["eval/loss"] - 1.0
    assert m[-1]["eval/preference_accuracy"] != 0.5
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    assert json.load(open(tmp_path / "args.json"))["total_steps"] == 40


def test_one_rank_equals_two_ranks(tmp_path):
    common = ["--total_steps", "8", "--eval_every", "8", *SMALL]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert len(a) == len(b) == 9  # step 0's eval, then 8 steps
    for x, y in zip(a[1:], b[1:]):
        assert abs(x["train/loss"] - y["train/loss"]) < 1e-4, (x, y)
    for key in ("eval/loss", "eval/preference_accuracy", "eval/accuracy"):
        assert abs(a[-1][key] - b[-1][key]) < 1e-4, key


def test_compile_matches_eager(tmp_path):
    """--compile trains the same model (the tied embedding's sparse gradient and the oneDNN GEMMs are eager-only)."""
    common = ["--total_steps", "4", "--eval_every", "4", *SMALL]
    run_here(["--out_dir", str(tmp_path / "eager"), *common])
    run(["--out_dir", str(tmp_path / "compiled"), "--compile", *common])
    a, b = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert len(a) == len(b) == 5  # step 0's eval, then 4 steps
    for x, y in zip(a[1:], b[1:]):
        assert abs(x["train/loss"] - y["train/loss"]) < 1e-3, (x, y)


def test_resume_matches_uninterrupted(tmp_path):
    common = ["--total_steps", "12", "--eval_every", "6", "--keep_checkpoints", "5", *SMALL]
    run_here(["--out_dir", str(tmp_path / "full"), *common])
    # restart from the step-6 checkpoint of the same run in a fresh out_dir
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000006"
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    run_here(["--out_dir", str(tmp_path / "resumed"), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = {m["step"]: m for m in metrics(tmp_path / "resumed")}
    assert min(resumed) == 7
    for step, m in resumed.items():
        assert abs(m["train/loss"] - full[step]["train/loss"]) < 1e-5, (step, m, full[step])
    # the reference is the starting model (--model), scored before the checkpoint is loaded
    assert resumed[12]["eval/preference_accuracy"] == full[12]["eval/preference_accuracy"] != 0.5


def test_sigterm_saves_checkpoint_then_resume_finishes(tmp_path):
    args = ["--out_dir", str(tmp_path), "--total_steps", "3000", "--eval_every", "100000", *SMALL]
    p = subprocess.Popen(
        [sys.executable, "sft.py", *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (
        (tmp_path / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 5
    ):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "SIGTERM: saved step" in err and "--resume --out_dir" in err, err[
        -1000:
    ]
    assert not (tmp_path / "model.safetensors").exists()  # an unfinished run has no final model
    steps = sorted(os.listdir(tmp_path / "checkpoints"))
    assert steps and steps[-1].startswith("step_")
    stopped_at = int(steps[-1].split("_")[1])
    run_here(
        [
            "--out_dir",
            str(tmp_path),
            "--resume",
            *args[:2],
            "--total_steps",
            str(stopped_at + 3),
            "--eval_every",
            "100000",
            *SMALL,
        ]
    )
    assert metrics(tmp_path)[-1]["step"] == stopped_at + 3


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    """Fault injection: SIGKILL mid-run (no chance to save), then --resume from the last periodic checkpoint."""
    common = ["--total_steps", "40", "--eval_every", "4", *SMALL]
    run_here(["--out_dir", str(tmp_path / "full"), *common])
    out = tmp_path / "killed"
    p = subprocess.Popen(
        [sys.executable, "sft.py", "--out_dir", str(out), *common],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while (
        time.time() < deadline
        and p.poll() is None
        and not (out / "checkpoints" / "step_00000008").exists()
    ):
        time.sleep(0.05)
    p.kill()
    assert p.wait() == -signal.SIGKILL  # still running when killed: the kill came mid-way
    run_here(["--out_dir", str(out), "--resume", *common])
    full = {m["step"]: m for m in metrics(tmp_path / "full")}
    resumed = {
        m["step"]: m for m in metrics(out)
    }  # last row per step (steps after the checkpoint are logged twice)
    assert resumed.keys() == full.keys()
    for step, m in list(full.items())[1:]:  # after step 0's eval
        assert abs(resumed[step]["train/loss"] - m["train/loss"]) < 1e-5, (step, resumed[step], m)


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(tmp_path):
    common = ["--out_dir", str(tmp_path), "--eval_every", "2", "--keep_checkpoints", "1", *SMALL]
    run_here(["--total_steps", "2", *common])
    # diverges right away: steps 3 ok, 4 diverged
    line = error_line(sft, ["--total_steps", "6", "--resume", "--lr", "1e12", *common])
    assert "non-finite loss" in line and "at step 4" in line, line
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000002"]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--batch_size", "10", "--micro_batch_size", "4"], "micro_batch_size"),
        (["--data", "/nonexistent/dir"], "no dataset at"),
        (["--model", "gpt3"], "no checkpoint at"),
        (["--resume"], "'{x}' is not one"),  # a mistyped run dir
        (["--resume", "--out_dir", ""], "--resume needs --out_dir"),
        (["--model", "runs/nonexistent"], "no checkpoint at"),
        (["--micro_batch_size", "0"], "--micro_batch_size 0: must be 1 or more"),
        (["--batch_size", "0"], "--batch_size 0: must be 1 or more"),
        (["--lr", "-1"], "--lr -1.0: must be 0 or more"),
        (["--min_lr_ratio", "nan"], "--min_lr_ratio nan: not a finite number"),
    ],
)
def test_bad_flags_give_one_line_errors(tmp_path, flags, expected):
    """In this process (a user's run of one is the next test): one line, and no run dir to
    --overwrite later."""
    line = error_line(sft, ["--total_steps", "2", "--out_dir", str(tmp_path / "x"), *flags])
    assert expected.format(x=tmp_path / "x") in line, line
    assert not (tmp_path / "x").exists()


def test_a_bad_flag_exits_1_with_one_line_as_a_user_runs_it(tmp_path):
    args = ["--total_steps", "2", "--out_dir", str(tmp_path / "x")]
    p = run([*args, "--batch_size", "10", "--micro_batch_size", "4"], check=False)
    assert p.returncode == 1 and not (tmp_path / "x").exists()
    assert p.stderr == "error: 10 does not divide by 4: change --micro_batch_size\n", p.stderr


def test_unwritable_out_dir(tmp_path):
    (tmp_path / "file").write_text("")  # a directory cannot be made under a file, even as root
    line = error_line(sft, ["--out_dir", str(tmp_path / "file" / "run"), "--total_steps", "2"])
    assert "cannot write to" in line and "another --out_dir" in line


# ---- run directories (a finished run is never overwritten or mixed) and checkpoint faults


def test_rerun_into_a_finished_run_needs_resume_or_overwrite(tmp_path):
    """In this process, run after run (runs.in_process: each releases the dir as a process's end
    would); as a user's process meets a held dir: test_a_second_run_into_a_locked_out_dir_stops."""
    common = ["--out_dir", str(tmp_path), "--total_steps", "4", "--eval_every", "4", *SMALL]
    run_here(common)
    line = error_line(sft, common)
    assert "holds a run" in line and "--resume" in line and "--overwrite" in line, line
    assert len(metrics(tmp_path)) == 5  # the old run is untouched
    for _ in range(3):  # the same command again and again: each replaces the last, never mixes
        run_here([*common, "--overwrite", "--seed", "2"])
        assert [m["step"] for m in metrics(tmp_path)] == [0, 1, 2, 3, 4]
    for _ in range(3):  # and --resume of a finished run is a no-op that keeps its files
        run_here([*common, "--resume"])
        assert [m["step"] for m in metrics(tmp_path)] == [0, 1, 2, 3, 4]


def test_overwrite_leaves_nothing_of_the_old_run_even_when_the_new_one_stops(tmp_path):
    common = ["--out_dir", str(tmp_path), "--total_steps", "2", "--eval_every", "2", *SMALL]
    run_here(common)
    line = error_line(sft, [*common, "--overwrite", "--lr", "1e12"])  # stops at its NaN loss
    assert "non-finite loss" in line, line
    # a later stage pointed at this dir must not load the old run's model under the new args
    assert sorted(f.name for f in tmp_path.iterdir()) == [".lock", "args.json", "metrics.jsonl"]


def test_default_run_dirs_are_fresh_and_latest_links_the_last_finished(tmp_path):
    sft = str(ROOT / "sft.py")
    common = ["--total_steps", "2", "--eval_every", "2", *SMALL]
    for seed in ("1", "1"):  # the same seed twice in one second still gets two dirs
        p = subprocess.run(
            [sys.executable, sft, *common, "--seed", seed],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-2000:]
    runs = sorted((d for d in os.listdir(tmp_path / "runs" / "sft") if d != "latest"), key=len)
    assert len(runs) == 2 and os.readlink(tmp_path / "runs" / "sft" / "latest") == max(
        runs, key=lambda d: (d[:15], len(d))
    )
    assert (tmp_path / "runs" / "sft" / "latest" / "model.safetensors").exists()
    with open(tmp_path / "runs" / "sft" / runs[-1] / ".lock") as lock:  # released at exit
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_stale_temp_dir_of_a_killed_save_is_cleaned_and_resume_continues(tmp_path):
    common = ["--out_dir", str(tmp_path), "--eval_every", "2", "--keep_checkpoints", "3", *SMALL]
    run_here(["--total_steps", "4", *common])
    # what a SIGKILL during the save of step 6 leaves: a half-written temp dir, never a step_ dir
    stale = tmp_path / "checkpoints" / ".tmp"
    shutil.copytree(tmp_path / "checkpoints" / "step_00000004", stale)
    (stale / "state.pt").write_bytes(b"truncated")
    run_here(["--total_steps", "6", "--resume", *common])
    assert not stale.exists() and sorted(os.listdir(tmp_path / "checkpoints")) == [
        "step_00000002",
        "step_00000004",
        "step_00000006",
    ]
    assert [m["step"] for m in metrics(tmp_path)] == [0, 1, 2, 3, 4, 5, 6]


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    common = ["--out_dir", str(tmp_path), "--eval_every", "2", "--keep_checkpoints", "3", *SMALL]
    run_here(["--total_steps", "4", *common])
    weights = tmp_path / "checkpoints" / "step_00000004" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    capsys.readouterr()
    run_here(["--total_steps", "6", "--resume", *common])
    out = capsys.readouterr().out
    assert "step_00000004 is damaged" in out and "resumed from" in out and "step_00000002" in out
    steps = [m["step"] for m in metrics(tmp_path)]
    assert steps == [0, 1, 2, 3, 4, 5, 6]  # the rows after step 2 were logged again
    for ckpt in (tmp_path / "checkpoints").iterdir():  # now every one damaged: a one-line error
        (ckpt / "state.pt").write_bytes(b"")
    line = error_line(sft, ["--total_steps", "8", "--resume", *common])
    assert "no complete checkpoint" in line, line


def test_keep_checkpoints_0_keeps_the_newest_one(tmp_path):
    common = ["--out_dir", str(tmp_path), "--eval_every", "2", *SMALL[:4]]
    run_here([*common, "--total_steps", "4"])
    run_here([*common, "--total_steps", "6", "--resume", "--keep_checkpoints", "0"])
    assert [c.name for c in (tmp_path / "checkpoints").iterdir()] == ["step_00000006"]


def test_another_ranks_sigterm_stops_this_rank_on_a_step_that_saves_anyway(tmp_path, monkeypatch):
    """The ranks' SIGTERM flags are summed every step, due or not: a rank that skipped the sum on a
    checkpoint step would train on while its peers stop, and hang at its next collective."""
    model = gpt2.load("tiny", dict(vocab_size=257, eos_token_id=256, pad_token_id=256))
    args = sft.Args(out_dir=str(tmp_path), keep_checkpoints=1)
    monkeypatch.setattr(sft, "all_reduce", lambda x: x + 1)  # another rank was sent SIGTERM
    with pytest.raises(gpt2.RunError, match="SIGTERM: saved step 4"):
        sft.checkpoint(args, 4, {"model": (model, None)}, torch.device("cpu"), due=True)
    assert (tmp_path / "checkpoints" / "step_00000004" / "model" / "model.safetensors").exists()


CLAIM = """import os, sys, time
sys.path.insert(0, sys.argv[1])
import sft
if os.environ["RANK"] != "0":  # a clock a second behind rank 0's
    time.strftime = lambda fmt: "19700101-000000"
sft.setup_distributed()
run_dir = sft.start_run(sft.Args(), "sft")
# One file per rank: two ranks printing to one pipe can interleave their words.
with open(f"rank{os.environ['RANK']}.txt", "w") as f:
    f.write(run_dir)
sft.dist.destroy_process_group()
os._exit(0)
"""


def test_every_rank_takes_rank_0s_run_dir(tmp_path):
    (tmp_path / "claim.py").write_text(CLAIM)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    p = subprocess.run(
        [*cmd, "claim.py", str(ROOT)], cwd=tmp_path, env=ENV, capture_output=True, text=True
    )
    assert p.returncode == 0, why(p)
    dirs = {(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)}
    assert len(dirs) == 1 and "19700101" not in dirs.pop(), p.stdout


def test_a_second_run_into_a_locked_out_dir_stops(tmp_path):
    """A live run holds an flock on its directory; the lock goes with the process, even a killed one."""
    with open(tmp_path / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running sft.py does
        line = error_line(sft, ["--out_dir", str(tmp_path), "--total_steps", "2"])
        assert "another run is writing to" in line, line
    run(["--out_dir", str(tmp_path), "--total_steps", "2", "--eval_every", "2", *SMALL])


def test_data_without_preference_pairs_skips_preference_accuracy(tmp_path):
    from data import arithmetic, write_dataset

    sizes = dict(sft_train=16, sft_test=8, prompt_test=8)
    write_dataset(str(tmp_path / "d"), arithmetic.META, arithmetic.build(sizes=sizes))
    common = ["--total_steps", "2", "--eval_every", "2", "--data", str(tmp_path / "d"), *SMALL]
    run_here(["--out_dir", str(tmp_path / "run"), *common])
    m = metrics(tmp_path / "run")
    assert "eval/accuracy" in m[-1] and not any("eval/preference_accuracy" in r for r in m)


def test_eval_size_0_means_no_eval(tmp_path):
    run_here(["--out_dir", str(tmp_path), "--total_steps", "4", *SMALL[:4], "--eval_size", "0"])
    assert not any(k.startswith("eval/") for m in metrics(tmp_path) for k in m)


def test_damaged_model_file_is_a_one_line_error(tmp_path):
    torch.manual_seed(0)
    gpt2.save(gpt2.load("tiny", data.load_meta("arithmetic")), str(tmp_path / "a"))
    weights = tmp_path / "a" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    args = ["--out_dir", str(tmp_path / "b"), "--model", str(tmp_path / "a"), "--total_steps", "2"]
    line = error_line(sft, args)
    assert f"cannot read '{weights}'" in line and "damaged" in line, line
