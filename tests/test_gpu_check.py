"""experiments/gpu_check.py without a GPU (tests/conftest.py hides them): --help, a bad --items in
one line, and the no-CUDA path, which says so in one line, runs the attention item's CPU sanity
check and exits 0. `--device cpu` dry-runs every item (minutes): not run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "experiments" / "gpu_check.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(*args):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=ROOT, env=ENV, capture_output=True, text=True
    )


def test_help():
    p = run("--help")
    assert p.returncode == 0 and "--items" in p.stdout


def test_unknown_item_is_one_line():
    p = run("--items", "smoke,nonsense")
    assert p.returncode == 1 and p.stderr.strip().startswith("error: --items: unknown"), p.stderr
    assert "Traceback" not in p.stderr


def test_without_cuda_it_says_so_and_runs_the_cpu_sanity_check(tmp_path):
    p = run("--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.splitlines()[0].startswith("no CUDA device")
    items = json.loads((tmp_path / "report.json").read_text())["items"]
    assert list(items) == ["attention"] and items["attention"]["status"] == "PASS", items
    assert (tmp_path / "report.md").is_file()
