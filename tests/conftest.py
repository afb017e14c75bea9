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


# ---- fixtures that many test files share, made once per test run

import pytest  # noqa: E402

from runs import ROOT, run  # noqa: E402


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """A tiny model after a short SFT (250 steps): it answers with digits and a stop token, and its
    answers differ, so that GRPO's groups have reward variance. Its step-100 checkpoint
    (checkpoints/step_00000100/model) is a weaker model from the same start."""
    out = tmp_path_factory.mktemp("sft")
    flags = "--total_steps 250 --eval_every 50 --keep_checkpoints 4 --batch_size 64 "
    flags += "--micro_batch_size 64 --warmup_steps 20 --eval_size 8 --log_every 250"
    run(ROOT / "sft.py", ["--out_dir", str(out), *flags.split()])
    return out


@pytest.fixture(scope="session")
def sft_model(sft_run):
    """The short SFT's final model (a run dir)."""
    return str(sft_run)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """A small copy of the offline task (--data): reference passes over its pairs stay short."""
    import data
    from data import arithmetic

    out = str(tmp_path_factory.mktemp("data") / "arith")
    sizes = dict(sft_train=64, sft_test=32, pref_train=256, pref_test=32)
    sizes |= dict(prompt_train=32, prompt_test=32)
    data.write_dataset(out, arithmetic.META, arithmetic.build(sizes=sizes))
    return ["--data", out]
