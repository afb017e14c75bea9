"""On-policy distillation against GRPO on the offline task: what a teacher's per-token
judgement buys over the verifier's one reward per response.

Per seed, grpo_variants.py runs (grpo.py, at its defaults) start from the same SFT model,
with the same prompts, sizes and seed: `grpo` learns from the verifier (the pipeline's
GRPO), `distill` from a teacher alone (`--teacher_model`, `--no_verifier`), the GRPO model
the pipeline trained from that SFT model, and `both` from the two, their advantages added.
Each logs the greedy eval accuracy every --eval_every steps; the training seconds are summed
from perf/episodes_per_sec (eval excluded). The table gives, per eval step, the median and
range over seeds of the accuracy, and of the accuracy gained per step and per training
second. Runs go to OUT_DIR/<arm>-s<seed>; a finished one is reused.

    python experiments/distill_study.py --sft runs/sft/A runs/sft/B runs/sft/C \\
        --teachers runs/grpo/A runs/grpo/B runs/grpo/C --seeds 1 2 3
"""

import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tyro

# grpo_variants.py lives at the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    sft: tuple[str, ...]  # the students: one SFT run dir per seed
    teachers: tuple[str, ...]  # one GRPO run dir per seed, trained from that seed's SFT model
    seeds: tuple[int, ...] = (1, 2, 3)  # one per --sft
    out_dir: str = "runs/distill_study"  # one run dir per arm and seed below this
    total_episodes: int = 51200  # per run: the pipeline's GRPO (200 steps of 256)
    eval_every: int = 10  # steps between eval accuracies
    teacher_coef: float = 1.0  # --teacher_coef of the distill and both arms
    arms: tuple[str, ...] = ("grpo", "distill", "both")  # which runs per seed
    jobs: int = 2  # runs at once (each at OMP_NUM_THREADS=1)


def arm_flags(args, arm, sft, teacher, seed):
    flags = ["--model", sft, "--seed", str(seed), "--total_episodes", str(args.total_episodes)]
    flags += ["--eval_every", str(args.eval_every), "--log_every", "1"]
    if arm in ("distill", "both"):
        flags += ["--teacher_model", teacher, "--teacher_coef", str(args.teacher_coef)]
    if arm == "distill":
        flags += ["--no_verifier"]
    return flags


def run_once(run_dir, flags):
    """grpo_variants.py into run_dir, unless a finished run is there already."""
    if os.path.exists(os.path.join(run_dir, "model.safetensors")):
        return run_dir
    script = os.path.join(ROOT, "grpo_variants.py")
    cmd = [sys.executable, script, "--out_dir", run_dir, "--overwrite"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd + flags, capture_output=True, text=True, cwd=ROOT, env=env)
    if p.returncode != 0:
        sys.exit(f"{run_dir} failed:\n{p.stderr[-3000:]}")
    return run_dir


def curve(run_dir):
    """{step: (accuracy, training seconds up to that step)} at every eval step."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    args = json.load(open(os.path.join(run_dir, "args.json")))
    batch = args["num_prompts_per_step"] * args["num_samples_per_prompt"]
    seconds = 0.0
    out = {}
    for row in rows:
        if "perf/episodes_per_sec" in row:
            seconds += batch / row["perf/episodes_per_sec"]
        if "eval/accuracy" in row:
            out[row["step"]] = (row["eval/accuracy"], seconds)
    return out


def spread(values):
    return f"{statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def main(args: Args):
    if not len(args.sft) == len(args.teachers) == len(args.seeds):
        sys.exit("error: --sft, --teachers and --seeds need one entry each per seed")
    jobs = []
    for sft, teacher, seed in zip(args.sft, args.teachers, args.seeds):
        for arm in args.arms:
            run_dir = os.path.join(args.out_dir, f"{arm}-s{seed}")
            jobs.append((arm, seed, run_dir, arm_flags(args, arm, sft, teacher, seed)))
    # the arms of a seed side by side, so that both see the same load on the machine
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: run_once(job[2], job[3]), jobs))
    curves = {(arm, seed): curve(run_dir) for arm, seed, run_dir, _ in jobs}
    steps = sorted(curves[(args.arms[0], args.seeds[0])])
    lines = ["| step | arm | accuracy | gained per step | gained per second | seconds |"]
    lines.append("|---|---|---|---|---|---|")
    for step in steps[1:]:
        for arm in args.arms:
            accuracy, per_step, per_second, seconds = [], [], [], []
            for seed in args.seeds:
                start = curves[(arm, seed)][0][0]
                acc, secs = curves[(arm, seed)][step]
                accuracy.append(acc)
                per_step.append((acc - start) / step)
                per_second.append((acc - start) / secs)
                seconds.append(secs)
            cells = [spread(accuracy), spread(per_step), spread(per_second), spread(seconds)]
            lines.append(f"| {step} | {arm} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
