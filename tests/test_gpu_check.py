"""experiments/gpu_check.py without a GPU (tests/conftest.py hides them): --help, a bad --parts in
one line, no CUDA without --device cpu in one line, and the `--device cpu` dry run, in which every
part of the acceptance command runs at tiny sizes or says why it was skipped."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "experiments" / "gpu_check.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
sys.path.insert(0, str(ROOT / "experiments"))

from gpu_check import PARTS  # noqa: E402


def run(*args):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=ROOT, env=ENV, capture_output=True, text=True
    )


def test_help():
    p = run("--help")
    assert p.returncode == 0 and "--parts" in p.stdout


def test_unknown_part_is_one_line():
    p = run("--device", "cpu", "--parts", "calibrate,nonsense")
    assert p.returncode == 1 and p.stderr.strip().startswith("error: --parts: unknown"), p.stderr
    assert "Traceback" not in p.stderr


def test_without_cuda_it_says_to_use_the_dry_run():
    p = run()
    assert p.returncode == 1 and "--device cpu" in p.stderr and "Traceback" not in p.stderr


def test_the_dry_run_reports_every_part(tmp_path):
    # aot_eager: dynamo and AOT autograd as on the GPU, without inductor's minutes of C++ builds;
    # one quick test file stands in for the suite (the whole suite would run this test again)
    flags = ["--compile_backend", "aot_eager", "--suite", "tests/test_copies.py", "--turns", "2"]
    p = run("--device", "cpu", "--out", str(tmp_path), *flags)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    parts = report["parts"]
    assert list(parts) == list(PARTS)
    # every part ran, or says why not (the memory of each script at gpt2-large is not in it)
    ran = {name for name, part in parts.items() if part["status"] == "ran"}
    assert ran == set(PARTS) - {"script_memory"}, {k: v["status"] for k, v in parts.items()}
    assert parts["script_memory"]["lines"][0]
    assert "kernel inside a CUDA graph: skipped, no CUDA device" in parts["calibrate"]["lines"]
    for part in ("train_124M", "train_large"):
        variants = parts[part]["values"]["variants"]
        assert {"fp32, eager", "fp32, compiled", "bf16, eager", "bf16, compiled"} <= set(variants)
        skipped = parts[part]["values"]["skipped"]
        # the head modes: each timed, or skipped with why (mixed, until gpt2.py has it)
        assert set(variants) | set(skipped) >= {f"{m}, eager" for m in ("fp32", "bf16")}
        assert "mixed" in skipped or "mixed, eager" in variants
    for part in ("sample_64", "sample_256"):
        assert {"graph", "eager", "HF"} <= set(parts[part]["values"])
    assert parts["greedy"]["values"] == {"graph": 8, "eager": 8}
    assert parts["graph"]["values"]["same"] and parts["graph"]["values"]["same_after_step"]
    assert {"fp32", "bf16"} <= set(parts["logprob_gap"]["values"])
    outcomes = parts["suite"]["values"]["outcomes"]
    assert outcomes and set(outcomes.values()) == {"PASSED"}, outcomes
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# gpu_check: CPU (a dry run); torch") and "commit" in md
