"""pipeline.py chains the five scripts and leaves each stage where the next script's defaults look, so the design line
`torchrun --nproc_per_node=2 grpo.py --beta 0.03` works as typed after it; on a fresh clone that line fails in one
line naming the command to run first (tests/test_grpo.py). Its table shows a policy equal to its reference as preference accuracy 0.5,
and docs/results.md's TL;DR recipe runs as written on a sample in the download format."""

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


def test_results_table_shows_a_policy_equal_to_its_reference_as_one_half():
    """Step 0 of sft and dpo is a policy equal to its reference: every implicit reward 0, each pair
    a tie counted half, so the table's preference accuracy starts at 0.500 (the RM's: its own)."""
    import pipeline  # the repository root is on sys.path under pytest, as for tests/test_dpo.py

    start = {"step": 0, "eval/accuracy": 0.5, "eval/preference_accuracy": 0.5}
    runs = {
        1: {
            "sft": [start | {"eval/accuracy": 0.0}, {"step": 4, "eval/accuracy": 0.25}]
            + [{"step": 4, "eval/preference_accuracy": 0.625}],
            "reward": [{"step": 2, "eval/accuracy": 0.75}],
            "dpo": [start, {"step": 2, "eval/accuracy": 0.75, "eval/preference_accuracy": 0.875}],
        }
    }
    times = {1: {"sft": 60.0, "reward": 60.0, "dpo": 120.0}}
    lines = pipeline.results_table(runs, times).splitlines()
    assert lines[2] == "| sft | 0.000 → 0.250 | 0.500 → 0.625 | – | – | 1.000 min |"
    assert lines[3] == "| reward | – | 0.750 | – | – | 1.000 min |"
    assert lines[4] == "| dpo | 0.500 → 0.750 | 0.500 → 0.875 | – | – | 2.000 min |"


def test_tldr_recipe_in_docs_runs_on_a_sample_in_the_download_format(tmp_path):
    """docs/results.md's TL;DR block, as written, less the downloads: OpenAI's comparison and
    tldr_3_filtered records (a CNN/DM file beside them), the tiny model, short lengths, few steps."""
    doc = (ROOT / "docs" / "results.md").read_text()
    block = doc[doc.index("## The TL;DR recipe") :].split("```bash\n")[1].split("```")[0]
    post = lambda i: dict(subreddit="pets", title=f"cat {i}", post=f"My cat {i} sleeps all day.")
    records = [dict(id=f"t3_{i}", **post(i), summary=f" cat {i} sleeps") for i in range(48)]
    (tmp_path / "tldr_3_filtered").mkdir()
    (tmp_path / "tldr_3_filtered" / "train.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    (tmp_path / "comparisons").mkdir()
    for batch in ("batch3", "batch4"):
        summaries = [dict(text=" cat sleeps", policy="sup2"), dict(text=" dog", policy="ref")]
        comparisons = [
            dict(info=dict(id=f"{batch}_{i}", **post(i)), summaries=summaries, choice=i % 2)
            | dict(split="train", worker="w", batch=batch, extra={})
            for i in range(64)
        ]
        (tmp_path / "comparisons" / f"{batch}.json").write_text(
            "".join(json.dumps(r) + "\n" for r in comparisons)
        )
    cnndm = dict(info=dict(id="c", article="a", site="cnn"), summaries=[{}, {}], choice=0)
    (tmp_path / "comparisons" / "batch0_cnndm.json").write_text(json.dumps(cnndm) + "\n")
    small = {  # appended to each command: its later flags win
        "data.prep": "--max_query_len 40 --max_response_len 8",
        "sft.py": "--model tiny --lr 1e-3 --total_steps 4 --eval_every 4 --batch_size 8 "
        "--micro_batch_size 4 --warmup_steps 1 --eval_size 8",
        "reward.py": "--total_steps 2 --eval_every 2 --batch_size 8 --micro_batch_size 4 "
        "--norm_samples 8 --response_length 8 --eval_size 8",
        "dpo.py": "--total_steps 2 --eval_every 2 --batch_size 8 --micro_batch_size 4 --eval_size 8",
        "grpo.py": "--response_length 8 --rejection_sampling_candidates 8 --num_samples_per_prompt 4 "
        "--num_prompts_per_step 2 --total_episodes 16 --num_minibatches 1 --eval_every 2 "
        "--micro_batch_size 8 --eval_size 8",
    }
    lines = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.startswith(("azcopy", "mkdir")):
            continue
        line = line.replace("torchrun --nproc_per_node=8 ", f"python {ROOT}/")
        line = sys.executable + line.removeprefix("python") if line.startswith("python") else line
        lines.append(line + "".join(f" {v}" for k, v in small.items() if k in line))
    env = dict(ENV, PYTHONPATH=str(ROOT))
    p = subprocess.run(
        ["bash", "-ec", "\n".join(lines)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    first = {line.split()[0]: line.split()[1] for line in p.stdout.splitlines()[-4:]}
    assert list(first) == ["sft", "reward", "dpo", "grpo"], p.stdout[-2000:]
    assert first["sft"] == first["dpo"] == first["grpo"] == "0.5"  # each policy = its reference
