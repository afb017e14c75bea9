"""How the tests run the scripts: as a user does (a subprocess, plain or under torchrun), or in this
process (main() on the parsed flags); and what a run wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpt2
from failed_run import why

ROOT = Path(__file__).resolve().parents[1]
# One torch thread per process: the suite's runs share a few cores. Unbuffered, so that a killed
# run's last lines are kept.
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def command(script, args, nproc=0):
    """A script's command line: plain python, or torchrun with nproc ranks on this node."""
    if nproc:
        return [*TORCHRUN, f"--nproc_per_node={nproc}", str(script), *args]
    return [sys.executable, str(script), *args]


def run(script, args, nproc=0, check=True, cwd=ROOT, timeout=600):
    """A run as a user starts it; with check, it must succeed (else every rank's errors)."""
    p = subprocess.run(
        command(script, args, nproc),
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert p.returncode == 0, why(p)
    return p


def metrics(out_dir):
    """The rows a run logged, one dict per logged step."""
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def error_line(module, args):
    """The one line a script prints for a problem the user can fix, run in this process: its main()
    on the parsed flags must raise a RunError, which the script's __main__ prints as this line.
    That it does, with exit status 1, is checked once per script, as a user runs it (each test
    file's subprocess error test)."""
    with pytest.raises(gpt2.RunError) as e:
        module.main(module.tyro.cli(module.Args, args=args, use_underscores=True))
    line = f"error: {e.value}"
    assert "\n" not in line, line
    return line


def in_process(module, args):
    """A run of a script in this process, as `python script.py args` would run it but for the
    process: main() on the parsed flags. A script holds its run dir's lock until its process ends;
    here the lock is released when main() returns or raises, as the process's end would."""
    locks = run_dir_locks()
    try:
        module.main(module.parse_args([str(arg) for arg in args]))
    finally:
        for fd in run_dir_locks() - locks:
            os.close(fd)


def run_dir_locks():
    """This process's open descriptors of run-dir locks (`<run dir>/.lock`)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith("/.lock"):
            fds.add(int(fd))
    return fds
