"""Which KL estimator in the GRPO loss actually holds the policy near the reference? A grid of short
grpo.py runs.

For each --kl_estimator (k1..k4, see grpo.kl_penalty) and each beta, train from the same SFT model
and read back the KL reached (`objective/kl`, always the k3 estimate of KL(pi_theta || pi_ref) per
token, whatever was optimised, averaged over the last few logged steps because one batch's estimate
is noisy) and the final greedy eval accuracy. Expected (open-instruct issue #534): with k2, k3 and
k4 the KL falls as beta grows; k1's gradient is zero in expectation, so k1 in the loss does not
control the KL. beta = 0 has no KL term, so it is run once and shared by every estimator. The table
is also written to OUT_DIR/results.md and, with matplotlib (requirements-plot.txt), plotted (KL
against beta, a line per estimator) to OUT_DIR/kl_study.png.

Each run is `python grpo.py ... --out_dir OUT_DIR/<estimator>_beta<beta>` (a subprocess: nothing is
imported from grpo.py). A finished run made with the same flags is reused; a run that was
interrupted or made with other flags is rerun with grpo.py's --overwrite (--overwrite here reruns
every one). --grpo_args takes its value after `=`: a value starting with -- is otherwise read as a
flag.

    python experiments/kl_study.py  # from runs/sft/latest (what `python sft.py` links)
    python experiments/kl_study.py --model runs/sft/latest --betas 0 0.1 0.3 --total_episodes 20480
    python experiments/kl_study.py --grpo_args="--seed 2" --out_dir runs/kl_study_seed2
    python experiments/kl_study.py --estimators k1 k3 --betas 0 0.1 --total_episodes 512 \\
        --grpo_args="--eval_size 16" --out_dir /tmp/kl_smoke  # a smoke run: 2 steps per config
"""

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))
)  # grpo.py lives at the repository root


@dataclass
class Args:
    model: str = "runs/sft/latest"
    """policy (and reference) every run starts from"""
    out_dir: str = "runs/kl_study"
    """one grpo.py run directory per (estimator, beta) below this"""
    overwrite: bool = False
    """rerun every configuration, even those whose finished run would be reused"""
    estimators: tuple[str, ...] = ("k1", "k2", "k3", "k4")
    """KL estimators to compare"""
    betas: tuple[float, ...] = (0.0, 0.03, 0.1, 0.3)
    """KL coefficients to compare"""
    total_episodes: int = 25600
    """episodes per run (100 steps of 256)"""
    last: int = 10
    """final KL = mean of objective/kl over this many last logged steps"""
    grpo_args: str = ""
    """extra grpo.py flags for every run, as one string: --grpo_args="--seed 2" (note the =)"""


def summarize(run_dir: str, last: int) -> dict:
    """Final KL (mean of the last logged steps), scores and the first and last eval accuracy of one
    run's metrics."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in rows if "objective/kl" in r][-last:]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    mean = lambda k: sum(r[k] for r in train) / len(train)
    kl, scores = mean("objective/kl"), mean("objective/scores")
    return dict(kl=kl, scores=scores, acc0=evals[0], acc=evals[-1])


def main(args: Args):
    if not os.path.isfile(os.path.join(ROOT, "grpo.py")):
        sys.exit(f"error: no grpo.py in {ROOT}: run this file from its place in the repository")
    if not os.path.exists(args.model):
        sys.exit(
            f"error: no SFT model at '{args.model}': run `python sft.py` first, or pass --model DIR"
        )
    results = {}
    for beta in args.betas:
        for est in args.estimators if beta > 0 else ["any"]:
            run_dir = os.path.join(args.out_dir, f"{est}_beta{beta:g}")
            # --ref_model: grpo.py builds no reference at beta 0 unless given one, and objective/kl
            # needs it
            flags = ["--model", args.model, "--ref_model", args.model, "--beta", str(beta)]
            flags += ["--kl_estimator", "k3" if est == "any" else est]
            flags += ["--total_episodes", str(args.total_episodes), "--eval_every", "1000000"]
            flags += ["--log_every", "1", *shlex.split(args.grpo_args)]
            # the flags of the run in run_dir, written once it finished
            marker = os.path.join(run_dir, "kl_study_flags.json")
            done = os.path.isfile(os.path.join(run_dir, "model.safetensors"))
            done = done and os.path.isfile(marker)
            if args.overwrite or not done or json.load(open(marker)) != flags:
                grpo = [sys.executable, os.path.join(ROOT, "grpo.py")]
                cmd = [*grpo, *flags, "--out_dir", run_dir, "--overwrite"]
                print("python grpo.py " + " ".join(cmd[2:]), flush=True)
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    last = (p.stderr.strip().splitlines() or ["?"])[-1]
                    sys.exit(f"error: run {run_dir} failed: {last}")
                with open(marker, "w") as f:
                    json.dump(flags, f)
            results[est, beta] = summarize(run_dir, args.last)

    print(
        f"\nfinal objective/kl (k3 per token, mean of the last {args.last} steps) and greedy eval "
        f"accuracy (start {next(iter(results.values()))['acc0']:.3f})\n"
    )
    lines = [
        "| estimator | beta | objective/kl | objective/scores | eval/accuracy |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {est} | {beta:g} | {r['kl']:.4f} | {r['scores']:.3f} | {r['acc']:.3f} |"
        for (est, beta), r in results.items()
    ]
    print("\n".join(lines))
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        command = f"`python experiments/kl_study.py {' '.join(sys.argv[1:])}`"
        f.write(command + "\n\n" + "\n".join(lines) + "\n")
    if plot(results, os.path.join(args.out_dir, "kl_study.png")):
        print(f"wrote {args.out_dir}/results.md and kl_study.png")


def plot(results: dict, path: str) -> bool:
    """Final KL against beta, one line per estimator, all starting from the shared beta = 0 run
    (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.5))
    base = [(b, r["kl"]) for (e, b), r in results.items() if e == "any"]
    for est in sorted({e for e, _ in results if e != "any"}):
        pts = sorted(base + [(b, r["kl"]) for (e, b), r in results.items() if e == est])
        ax.plot(*zip(*pts), marker="o", label=est)
    ax.set_xlabel("beta")
    ax.set_ylabel("final objective/kl (k3, nats/token)")
    ax.set_title("KL reached vs beta, per estimator in the loss", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


if __name__ == "__main__":
    main(tyro.cli(Args))
