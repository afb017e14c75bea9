"""The command line as a new user meets it: flags spelled as README and docs write them, and a resume
pointed at another script's run dir named as such."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
SCRIPTS = [
    "sft.py",
    "reward.py",
    "dpo.py",
    "ppo.py",
    "ppo_variants.py",
    "grpo.py",
    "grpo_variants.py",
]


def run(*args):
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_spells_flags_with_underscores(script, capsys):
    """README and docs write --micro_batch_size: --help prints the same spelling. In this process,
    through the parser each script's __main__ calls (parse_args); as a user runs it: the next."""
    module = importlib.import_module(script.removesuffix(".py"))
    with pytest.raises(SystemExit) as e:
        module.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert "--micro_batch_size" in out or "--num_minibatches" in out, out
    assert "--out-dir" not in out and "--out_dir" in out


def test_help_as_a_user_runs_it():
    p = run("grpo.py", "--help")
    assert p.returncode == 0, p.stderr
    assert "--micro_batch_size" in p.stdout and "--out_dir" in p.stdout, p.stdout


def test_resume_names_the_script_whose_run_it_is(tmp_path):
    """grpo.py --resume on a run dir that sft.py wrote: one line naming sft.py, not 'damaged'."""
    flags = "--total_steps 2 --eval_every 2 --eval_size 0 --batch_size 8 --micro_batch_size 8"
    p = run("sft.py", "--out_dir", str(tmp_path), *flags.split())
    assert p.returncode == 0, p.stderr[-2000:]
    p = run("grpo.py", "--resume", "--out_dir", str(tmp_path), "--model", "tiny")
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 1
    assert lines[-1] == f"error: '{tmp_path}' holds a run of sft.py: resume it with sft.py", lines
    assert "Traceback" not in p.stderr


# Rank 0 reaches the error a second after rank 1, as a loaded machine can make it; each ends as a
# script's __main__ ends a RunError (the plumbing's exit_on, the same in every script).
LATE_RANK_0 = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
import gpt2, sft
if os.environ["RANK"] == "0":
    time.sleep(1)
try:
    raise gpt2.RunError("the same problem on every rank")
except gpt2.RunError as e:
    sft.exit_on(e)
"""


def test_a_run_error_is_printed_by_rank_0_even_when_another_rank_gets_there_first(tmp_path):
    """torchrun stops the whole job when one rank fails: the other ranks must not exit before
    rank 0 has printed the line."""
    script = tmp_path / "fails.py"
    script.write_text(LATE_RANK_0)
    p = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script))
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0
    assert errors == ["error: the same problem on every rank"], p.stderr[-2000:]
