"""The suite runs on CPU (gloo, fp32) whatever the machine has: GPUs are hidden from every test and
every subprocess it starts, so dtype `auto` stays fp32 and 2-rank tests never ask for cuda:1.
tests/test_cuda.py gives them back to its own subprocesses and skips without CUDA."""

import os

os.environ.setdefault(
    "RLHF_TEST_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "all")
)
os.environ["CUDA_VISIBLE_DEVICES"] = ""
