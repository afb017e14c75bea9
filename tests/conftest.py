"""The suite runs on CPU (gloo, fp32) whatever the machine has: GPUs are hidden from every test and
every subprocess it starts, so dtype `auto` stays fp32 and 2-rank tests never ask for cuda:1.
tests/test_cuda.py gives them back to its own subprocesses and skips without CUDA."""

import os

os.environ.setdefault(
    "RLHF_TEST_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "all")
)
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Under pytest-xdist (`-n auto`: a worker per core) each worker's torch takes one thread, as the
# scripts run by the tests already do, so that the workers do not oversubscribe the cores.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
