"""Which KL estimator in the GRPO loss holds the policy near the reference? A grid of short
grpo.py runs.

For each --kl_estimator (k1..k4, see grpo.kl_penalty) and each beta, train from the same SFT
model and read back the KL reached (`objective/kl`: always the k3 estimate per token, averaged
over the last logged steps) and the final greedy eval accuracy. Expected (open-instruct issue
#534): with k2, k3 and k4 the KL falls as beta grows; k1's gradient is zero in expectation, so
k1 does not control the KL. beta = 0 runs once, shared by every estimator. The table goes to
OUT_DIR/results.md and, with matplotlib, a plot of KL against beta to OUT_DIR/kl_study.png.
Each run is `python grpo.py ... --out_dir OUT_DIR/<estimator>_beta<beta>`; a finished run
with the same flags is reused.

    python experiments/kl_study.py --grpo_args="--seed 2" --out_dir runs/kl_study_seed2
    python experiments/kl_study.py --estimators k1 k3 --betas 0 0.1 --total_episodes 512 \\
        --grpo_args="--eval_size 16" --out_dir /tmp/kl_smoke  # a smoke run: 2 steps each
"""

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

import tyro

# grpo.py lives at the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    model: str = "runs/sft/latest"  # policy (and reference) every run starts from
    out_dir: str = "runs/kl_study"  # one grpo.py run directory per (estimator, beta) below this
    overwrite: bool = False  # rerun every configuration, even a finished one
    estimators: tuple[str, ...] = ("k1", "k2", "k3", "k4")  # KL estimators to compare
    betas: tuple[float, ...] = (0.0, 0.03, 0.1, 0.3)  # KL coefficients to compare
    total_episodes: int = 25600  # episodes per run (100 steps of 256)
    last: int = 10  # final KL = mean of objective/kl over this many last logged steps
    grpo_args: str = ""  # extra grpo.py flags for every run: --grpo_args="--seed 2" (note the =)


def summarize(run_dir, last):
    """One run's final KL and scores (means over its last logged steps) and its first and
    last eval accuracy."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [row for row in rows if "objective/kl" in row][-last:]
    evals = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    kl = sum(row["objective/kl"] for row in train) / len(train)
    scores = sum(row["objective/scores"] for row in train) / len(train)
    return dict(kl=kl, scores=scores, acc0=evals[0], acc=evals[-1])


def grpo_flags(args, estimator, beta):
    # --ref_model: grpo.py builds no reference at beta 0 unless given one; objective/kl needs it
    flags = ["--model", args.model, "--ref_model", args.model, "--beta", str(beta)]
    flags += ["--kl_estimator", "k3" if estimator == "any" else estimator]
    flags += ["--total_episodes", str(args.total_episodes), "--eval_every", "1000000"]
    return flags + ["--log_every", "1", *shlex.split(args.grpo_args)]


def run_once(args, run_dir, flags):
    """Run grpo.py into run_dir unless a finished run there was made with the same
    flags."""
    marker = os.path.join(run_dir, "kl_study_flags.json")
    finished = os.path.isfile(os.path.join(run_dir, "model.safetensors"))
    if finished and os.path.isfile(marker) and not args.overwrite:
        with open(marker) as f:
            if json.load(f) == flags:
                return
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), *flags]
    cmd += ["--out_dir", run_dir, "--overwrite"]
    print("python grpo.py " + " ".join(cmd[2:]), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        sys.exit(f"error: run {run_dir} failed: {last}")
    with open(marker, "w") as f:
        json.dump(flags, f)


def plot(results, path):
    """Final KL against beta, a line per estimator, each from the shared beta = 0 run
    (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.5))
    base = [(beta, r["kl"]) for (est, beta), r in results.items() if est == "any"]
    for name in sorted({est for est, _ in results if est != "any"}):
        own = [(beta, r["kl"]) for (est, beta), r in results.items() if est == name]
        betas, kls = zip(*sorted(base + own))
        ax.plot(betas, kls, marker="o", label=name)
    ax.set_xlabel("beta")
    ax.set_ylabel("final objective/kl (k3, nats/token)")
    ax.set_title("KL reached vs beta, per estimator in the loss", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(args: Args):
    if not os.path.isfile(os.path.join(ROOT, "grpo.py")):
        sys.exit(f"error: no grpo.py in {ROOT}: run this file from its place in the repository")
    if not os.path.exists(args.model):
        sys.exit(f"error: no SFT model at '{args.model}': run `python sft.py`, or pass --model")
    results = {}
    for beta in args.betas:
        for est in args.estimators if beta > 0 else ["any"]:
            run_dir = os.path.join(args.out_dir, f"{est}_beta{beta:g}")
            run_once(args, run_dir, grpo_flags(args, est, beta))
            results[est, beta] = summarize(run_dir, args.last)
    acc0 = next(iter(results.values()))["acc0"]
    kl = f"final objective/kl (k3 per token, mean of the last {args.last} steps)"
    print(f"\n{kl} and greedy eval accuracy (start {acc0:.3f})\n")
    lines = ["| estimator | beta | objective/kl | objective/scores | eval/accuracy |"]
    lines.append("|---|---|---|---|---|")
    for (est, beta), r in results.items():
        cells = f"{r['kl']:.4f} | {r['scores']:.3f} | {r['acc']:.3f}"
        lines.append(f"| {est} | {beta:g} | {cells} |")
    print("\n".join(lines))
    command = f"`python experiments/kl_study.py {' '.join(sys.argv[1:])}`"
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(command + "\n\n" + "\n".join(lines) + "\n")
    if plot(results, os.path.join(args.out_dir, "kl_study.png")):
        print(f"wrote {args.out_dir}/results.md and kl_study.png")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
