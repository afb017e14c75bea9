"""Each script's CPU speed at two commits, paired and interleaved: its own throughput (perf/*, the
median over a short run's logged steps, so start-up and evals are left out), the ratio new/old
within each turn, then the median ratio and its range over the turns.

    OMP_NUM_THREADS=1 python experiments/speed_ab.py --old d5ba159 --turns 5
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import gpt2  # noqa: E402

# per script: a run of a few seconds at its default batch shape, and the metric it logs
RUNS = {
    "sft": ("--model tiny --total_steps 40", "perf/tokens_per_sec"),
    "reward": ("--model tiny --total_steps 30 --norm_samples 0", "perf/tokens_per_sec"),
    "dpo": ("--model tiny --total_steps 30 --max_train_pairs 256", "perf/tokens_per_sec"),
    "ppo": ("--model {sft} --reward_model {rm} --total_episodes 1024", "perf/episodes_per_sec"),
    "grpo": ("--model tiny --total_episodes 2560", "perf/episodes_per_sec"),
}


@dataclass
class Args:
    old: str  # the git ref to compare against (checked out into a temporary worktree)
    scripts: tuple[str, ...] = tuple(RUNS)  # which of RUNS
    turns: int = 5  # runs of each script at each commit, interleaved
    new_script: str = ""  # this tree's file for each, if another: e.g. grpo_variants


def throughput(tree, script, flags, metric, out):
    """The median of a run's logged `metric` after its first logged step."""
    cmd = [sys.executable, f"{tree}/{script}.py", *flags.split(), "--out_dir", out, "--overwrite"]
    cmd += ["--eval_size", "0", "--log_every", "1"]
    subprocess.run(cmd, cwd=tree, check=True, capture_output=True)
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    return statistics.median(row[metric] for row in rows[1:] if metric in row)


def main(args):
    tmp = tempfile.mkdtemp()
    old = f"{tmp}/old"
    subprocess.run(
        ["git", "worktree", "add", "-q", "--detach", old, args.old], cwd=ROOT, check=True
    )
    # ppo's models: a random tiny policy and reward model, the same files for both commits
    meta = dict(vocab_size=257, eos_token_id=256, pad_token_id=256)
    torch.manual_seed(0)
    gpt2.save(gpt2.load("tiny", meta), f"{tmp}/sft")
    gpt2.save(gpt2.load("tiny", meta, head="new"), f"{tmp}/rm")
    try:
        for script in args.scripts:
            flags, metric = RUNS[script]
            flags = flags.format(sft=f"{tmp}/sft", rm=f"{tmp}/rm")
            new_script = args.new_script or script
            ratios = []
            for turn in range(args.turns):
                # the order alternates, so that a drift of the machine's speed hits both alike
                if turn % 2 == 0:
                    a = throughput(old, script, flags, metric, f"{tmp}/a")
                    b = throughput(ROOT, new_script, flags, metric, f"{tmp}/b")
                else:
                    b = throughput(ROOT, new_script, flags, metric, f"{tmp}/b")
                    a = throughput(old, script, flags, metric, f"{tmp}/a")
                ratios.append(b / a)
                print(f"{script} turn {turn}: old {a:.0f}, new {b:.0f}, new/old {b / a:.3f}")
            low, high = min(ratios), max(ratios)
            median = statistics.median(ratios)
            print(f"{script}: new/old {median:.3f} [{low:.3f}, {high:.3f}] over {args.turns} turns")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", old], cwd=ROOT)


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
