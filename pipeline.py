"""The whole RLHF pipeline on the offline default, in one command: SFT → reward model → DPO → PPO → GRPO.

Each stage is its own script run as a subprocess (the scripts are the product; this file only chains them), writing
into `out_dir/<stage>`. At the end one results table (eval accuracy, preference accuracy, reward, KL, wall time per
stage) is printed and written to `out_dir/results.md`. About 5 minutes on 2 CPU cores.

    python pipeline.py                              # single process per stage
    python pipeline.py --nproc 2                    # every stage under torchrun --nproc_per_node=2 (FSDP2)
    python pipeline.py --stages sft reward          # a subset (later stages read earlier stages' out_dirs)
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tyro


@dataclass
class Args:
    out_dir: str = "runs/pipeline"
    """one subdirectory per stage, plus results.md"""
    data: str = "arithmetic"
    """dataset for every stage (the built-in offline task by default)"""
    nproc: int = 1
    """ranks per stage: 1 runs plain python, >1 runs torchrun --nproc_per_node"""
    stages: list[str] = field(default_factory=lambda: ["sft", "reward", "dpo", "ppo", "grpo"])
    """stages to run, in order"""
    seed: int = 1
    """seed passed to every stage"""


def stage_commands(args: Args) -> dict[str, list[str]]:
    d = lambda s: os.path.join(args.out_dir, s)  # noqa: E731
    common = ["--data", args.data, "--seed", str(args.seed)]
    return {
        "sft": ["sft.py", "--out_dir", d("sft"), *common],
        "reward": ["reward.py", "--model", d("sft"), "--out_dir", d("reward"), *common],
        # plain DPO lowers the chosen likelihood along with the rejected one and barely moves greedy accuracy (beta 1.0:
        # 0.182 -> 0.190 / 0.202 over two seeds); the RPO term (chosen answer's NLL, Pang et al. 2024) raises it (0.288)
        "dpo": ["dpo.py", "--model", d("sft"), "--out_dir", d("dpo"), "--rpo_alpha", "1.0", *common],
        "ppo": ["ppo.py", "--model", d("sft"), "--reward_model", d("reward"), "--out_dir", d("ppo"), *common],
        "grpo": ["grpo.py", "--model", d("sft"), "--out_dir", d("grpo"), *common],
    }


def first_and_last_values(metrics_path: str) -> tuple[dict, dict]:
    """The step-0 row of a run (its starting policy's eval, written by dpo/ppo/grpo) and the last logged value of
    every metric."""
    first, last = {}, {}
    if os.path.isfile(metrics_path):
        for line in open(metrics_path):
            row = json.loads(line)
            last.update(row)
            if row["step"] == 0:
                first.update(row)
    return first, last


COLUMNS = [  # (header, metric): the last logged value of each stage's run
    ("eval accuracy", "eval/accuracy"),  # greedy answers to held-out prompts, checked by the task's verifier
    ("preference accuracy", "eval/preference_accuracy"),  # held-out chosen/rejected pairs ranked right
    ("reward-model score", "eval/score"),  # normalised RM score of greedy answers (ppo.py, the stage with an RM)
    ("KL to reference", "objective/kl"),  # ppo.py: nats per response (sum over tokens); grpo.py: k3 nats per token
]


def results_table(args: Args, times: dict) -> str:
    rows = ["| stage | " + " | ".join(h for h, _ in COLUMNS) + " | wall time |", "|---" * (len(COLUMNS) + 2) + "|"]
    for stage, seconds in times.items():
        first, m = first_and_last_values(os.path.join(args.out_dir, stage, "metrics.jsonl"))
        if stage == "reward":  # the reward model's eval/accuracy is its preference accuracy on held-out pairs
            first, m = {}, {"eval/preference_accuracy": m.get("eval/accuracy")}
        # "start → end" where the stage evaluated its starting policy (the SFT model) first
        cells = ["–" if m.get(name) is None else f"{first[name]:.3f} → {m[name]:.3f}" if name in first else f"{m[name]:.3f}"
                 for _, name in COLUMNS]  # fmt: skip
        rows.append(f"| {stage} | " + " | ".join(cells) + f" | {seconds / 60:.1f} min |")
    note = "KL to reference: ppo.py logs nats per response (k1, summed over tokens), grpo.py nats per token (k3)."
    return "\n".join(rows) + "\n\n" + note


def main(args: Args):
    commands = stage_commands(args)
    unknown = [s for s in args.stages if s not in commands]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}: choose from {list(commands)}")
    launcher = [sys.executable] if args.nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                          "--standalone", f"--nproc_per_node={args.nproc}"]  # fmt: skip
    times = {}
    for stage in args.stages:
        cmd = launcher + commands[stage]
        print(f"\n==== {stage}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"error: stage '{stage}' failed (see its output above); fix it and rerun with "
                             f"--stages {' '.join(args.stages[args.stages.index(stage):])}")  # fmt: skip
        times[stage] = time.time() - t0
    table = results_table(args, times)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    text = f"Pipeline results ({stamp}, {os.cpu_count()} CPUs, `{' '.join(sys.argv)}`)\n\n{table}\n"
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(text)
    print("\n" + text)


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:
        main(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
