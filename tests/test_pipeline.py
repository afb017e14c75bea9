"""pipeline.py chains the five scripts and leaves each stage where the next script's defaults look, so the design line
`torchrun --nproc_per_node=2 grpo.py --beta 0.03` works as typed after it; on a fresh clone that line fails in one
line naming the command to run first."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
GRPO_SMOKE = [
    "--total_episodes",
    "32",
    "--num_prompts_per_step",
    "4",
    "--num_samples_per_prompt",
    "4",
    "--num_minibatches",
    "1",
    "--eval_every",
    "2",
    "--eval_size",
    "16",
]


def torchrun(script, *args, cwd):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / script),
    ]
    return subprocess.run(
        [*cmd, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )


def test_design_line_on_a_fresh_clone_names_the_command_to_run_first(tmp_path):
    p = torchrun("grpo.py", "--beta", "0.03", cwd=tmp_path)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-2000:]  # once, by rank 0
    assert "runs/sft/latest" in errors[0] and "python sft.py" in errors[0]
    assert not (tmp_path / "runs").exists()


def test_pipeline_outputs_are_where_the_scripts_look_and_the_design_line_then_works(tmp_path):
    p = subprocess.run(
        [sys.executable, str(ROOT / "pipeline.py"), "--smoke"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for stage in ("sft", "reward", "dpo", "ppo", "grpo"):
        latest = tmp_path / "runs" / stage / "latest"
        assert (latest / "model.safetensors").exists(), stage
        assert os.readlink(latest).startswith("pipeline-"), stage
    assert "| grpo |" in p.stdout and (tmp_path / "runs" / "pipeline").is_dir()
    # the design line, as typed (smoke sizes added), from the pipeline's SFT model; twice: never overwrites
    for _ in range(2):
        p = torchrun("grpo.py", "--beta", "0.03", *GRPO_SMOKE, cwd=tmp_path)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    runs = [d for d in os.listdir(tmp_path / "runs" / "grpo") if d != "latest"]
    assert len(runs) == 3  # the pipeline's and two fresh ones
    args = json.load(open(tmp_path / "runs" / "grpo" / "latest" / "args.json"))
    assert args["model"] == "runs/sft/latest" and args["beta"] == 0.03
