"""The suite runs on CPU (gloo, fp32) whatever the machine has: GPUs are hidden from every test and
every subprocess it starts, so dtype `auto` stays fp32 and 2-rank tests never ask for cuda:1.
tests/test_cuda.py gives them back to its own subprocesses and skips without CUDA."""

import os

os.environ.setdefault(
    "RLHF_TEST_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "all")
)
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# One torch thread in this process, as in every process the tests start: a run made here
# (runs.in_process) rounds as the same run made in a subprocess does, and pytest-xdist's workers
# (a worker per core) do not oversubscribe the cores.
os.environ["OMP_NUM_THREADS"] = "1"


# ---- fixtures that many test files share, made once per test run

import fcntl  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

from runs import ROOT, run  # noqa: E402


def made_once(tmp_path_factory, name, make):
    """A folder `name` that make(folder) fills, made once per test run. Under pytest-xdist each
    worker has its own session, so the first worker makes it in the run's shared temp dir, under a
    lock, and the others wait for it and reuse it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp(name)
        make(out)
        return out
    shared = tmp_path_factory.getbasetemp().parent
    out = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / f"{name}.done").is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            make(out)
            (shared / f"{name}.done").touch()
    return out


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """A tiny model after a short SFT (250 steps): it answers with digits and a stop token, and its
    answers differ, so that GRPO's groups have reward variance. Its step-100 checkpoint
    (checkpoints/step_00000100/model) is a weaker model from the same start."""
    flags = "--total_steps 250 --eval_every 50 --keep_checkpoints 4 --batch_size 64 "
    flags += "--micro_batch_size 64 --warmup_steps 20 --eval_size 8 --log_every 250"

    def make(out):
        run(ROOT / "sft.py", ["--out_dir", str(out), *flags.split()])

    return made_once(tmp_path_factory, "sft", make)


@pytest.fixture(scope="session")
def sft_model(sft_run):
    """The short SFT's final model (a run dir)."""
    return str(sft_run)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """A small copy of the offline task (--data): reference passes over its pairs stay short."""
    import data
    from data import arithmetic

    sizes = dict(sft_train=64, sft_test=32, pref_train=256, pref_test=32)
    sizes |= dict(prompt_train=32, prompt_test=32)

    def make(out):
        data.write_dataset(str(out / "arith"), arithmetic.META, arithmetic.build(sizes=sizes))

    return ["--data", str(made_once(tmp_path_factory, "data", make) / "arith")]
