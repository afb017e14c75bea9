"""A copied script behaves in someone else's code: grpo.py, gpt2.py and data/ alone in an empty
folder outside the repo run there, under torchrun, from the user's own driver. main() returns on
every rank, so code after it runs; a run without --wandb never calls into wandb, even when the
user's process has imported it; a RunError is an Exception, so `except Exception` catches it."""

import json
import shutil
import subprocess

from failed_run import why
from runs import ENV, ROOT, TORCHRUN

DRIVER = """
import os
import sys
import types

# The user's process has a wandb module of its own: every call into it is recorded.
calls = []
record = lambda *args, **kwargs: calls.append("called")
sys.modules["wandb"] = types.SimpleNamespace(init=record, log=record, finish=record)

import grpo

try:
    grpo.main(grpo.parse_args(["--advantage", "rloo"]))
except Exception as error:
    print(f"caught: {error}", flush=True)
grpo.main(grpo.parse_args(sys.argv[1:]))
print(f"rank {os.environ['RANK']} after main, wandb calls: {len(calls)}", flush=True)
# gloo's threads may abort the interpreter's own teardown (docs/faults.md).
os._exit(0)
"""


def test_a_copied_grpo_runs_in_an_empty_folder_and_main_returns_on_every_rank(tmp_path, sft_model):
    folder = tmp_path / "research"
    folder.mkdir()
    assert not folder.is_relative_to(ROOT)
    shutil.copy(ROOT / "grpo.py", folder)
    shutil.copy(ROOT / "gpt2.py", folder)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "data", folder / "data", ignore=ignore)
    (folder / "mine.py").write_text(DRIVER)
    flags = "--num_prompts_per_step 4 --num_samples_per_prompt 4 --micro_batch_size 8 "
    flags += "--response_length 4 --total_episodes 32 --eval_size 8 --log_every 1"
    command = [*TORCHRUN, "--nproc_per_node=2", "mine.py", "--model", sft_model, *flags.split()]
    # The copy is all there is: no PYTHONPATH into the repo.
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    p = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, why(p)
    assert "caught: --advantage lives in grpo_variants.py" in p.stdout, why(p)
    for rank in (0, 1):
        assert f"rank {rank} after main, wandb calls: 0" in p.stdout, why(p)
    # The run's dir and the link the next stage follows are the copy's own.
    run_dir = folder / "runs" / "grpo" / "latest"
    assert (run_dir / "model.safetensors").is_file()
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    # step 0 (the starting model's eval) and the 2 steps of 32 episodes
    assert [json.loads(row)["step"] for row in rows] == [0, 1, 2]
