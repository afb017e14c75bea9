"""The whole RLHF pipeline on the offline default in one command: SFT → reward → DPO → PPO → GRPO.

Each stage is its own script run as a subprocess (the scripts are the product; this file
only chains them). Stage S of seed N writes `runs/S/pipeline-<time>-sN/`, and
`runs/S/latest` then links to it, so after `python pipeline.py` every script's defaults
find the pipeline's models: `torchrun --nproc_per_node=2 grpo.py --beta 0.03` starts from
its SFT model. Nothing is overwritten: each call makes new run dirs. At the end one
results table (eval accuracy, preference accuracy, reward, KL to the reference, wall time
per stage) is printed and written, with learning curves when matplotlib is installed, to
`runs/pipeline/<time>/`.

    python pipeline.py                    # seed 1, one process per stage
    python pipeline.py --seeds 1 2 3      # three seeds: the table shows median [min, max]
    python pipeline.py --nproc 2          # every stage under torchrun --nproc_per_node=2 (FSDP2)
    python pipeline.py --stages ppo grpo  # a subset: earlier stages come from runs/<stage>/latest
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import tyro

import data
import gpt2

ROOT = os.path.dirname(os.path.abspath(__file__))
STAGES = ("sft", "reward", "dpo", "ppo", "grpo")


@dataclass
class Args:
    seeds: tuple[int, ...] = (1,)
    """seeds to run the whole pipeline with; with several, the table shows the median and range"""
    data: str = "arithmetic"
    """dataset for every stage (the built-in offline task by default)"""
    nproc: int = 1
    """ranks per stage: 1 runs plain python, >1 runs torchrun --nproc_per_node"""
    stages: tuple[str, ...] = STAGES
    """stages to run, in order; a stage that is not run is read from runs/<stage>/latest"""
    temperature: float = 0.7
    """sampling temperature of PPO, and so of the reward model's normalisation
    (lm-human-preferences normalises the reward at the policy's own sampling temperature)"""
    smoke: bool = False
    """a few steps per stage (seconds): checks the wiring, not the results"""


# The per-stage flags of --smoke: each stage's schedule, then its batch and eval sizes.
SMOKE = {
    "sft": "--total_steps 4 --eval_every 4 "
    "--eval_size 16 --batch_size 16 --micro_batch_size 8 --warmup_steps 1",
    "reward": "--total_steps 2 --eval_every 2 "
    "--eval_size 16 --batch_size 8 --micro_batch_size 8 --norm_samples 16",
    "dpo": "--total_steps 2 --eval_every 2 "
    "--eval_size 16 --batch_size 8 --micro_batch_size 8 --max_train_pairs 16",
    "ppo": "--total_episodes 16 --batch_size 8 --micro_batch_size 8 --num_minibatches 1 "
    "--eval_every 1 --eval_size 16",
    "grpo": "--total_episodes 32 --num_prompts_per_step 4 --num_samples_per_prompt 4 "
    "--num_minibatches 1 --eval_every 2 --eval_size 16",
}


def model_dir(stage: str, name: str, ran: set[str]) -> str:
    """Where a stage's model is: this call's run `name` if it ran, else
    runs/<stage>/latest."""
    if stage in ran:
        return os.path.join("runs", stage, name)
    return os.path.join("runs", stage, "latest")


def stage_commands(args: Args, seed: int, sft: str, reward: str) -> dict[str, list[str]]:
    """The command of each stage; sft and reward are the directories of those stages'
    models."""
    common = ["--data", args.data, "--seed", str(seed)]
    temperature = str(args.temperature)
    return {
        "sft": ["sft.py", *common],
        "reward": ["reward.py", "--model", sft, "--norm_temperature", temperature, *common],
        # RPO (DPO + the chosen answer's NLL, Pang et al. 2024), because plain DPO lowers
        # the chosen answers' likelihood along with the rejected ones' (docs/results.md).
        "dpo": ["dpo.py", "--model", sft, "--rpo_alpha", "1.0", *common],
        "ppo": [
            "ppo.py",
            "--model",
            sft,
            "--reward_model",
            reward,
            "--temperature",
            temperature,
            *common,
        ],
        # --ref_model at β 0 adds no KL to the loss but makes grpo.py log objective/kl
        # (curves.png).
        "grpo": ["grpo.py", "--model", sft, "--ref_model", sft, *common],
    }


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


# (header, metric): each stage's first (its starting policy, step 0) and last logged value.
COLUMNS = [
    # Greedy answers to held-out prompts, checked by the task's verifier.
    ("eval accuracy", "eval/accuracy"),
    # Held-out chosen/rejected pairs ranked right by the implicit reward log π/π_ref
    # against the stage's starting policy, ties half (0.5 at the start); the reward
    # model's by its score.
    ("preference accuracy", "eval/preference_accuracy"),
    # The normalised RM score of greedy answers (ppo.py, the stage with an RM).
    ("reward-model score", "eval/score"),
    # KL(pi || pi_ref) of the final policy on held-out prompts, nats per response.
    ("KL to reference", "eval/kl"),
]

# What the table's cells mean, printed and written below it.
LEGEND = (
    "a → b: the stage's starting policy (the SFT model; for sft its initial model) → "
    "its final policy, greedy decoding on the same held-out prompts. "
    "Preference accuracy: held-out pairs ranked right by log π/π_ref against the "
    "starting policy, ties counted half (a policy equal to its reference: 0.5); "
    "for the reward model, by its score. "
    "KL to reference: the final policy's KL(π‖π_SFT) in nats per response on held-out "
    "prompts.\n"
)


@torch.no_grad()
def kl_to_reference(
    policy_dir: str, ref_dir: str, data_name: str, n: int = 500, length: int = 16, seed: int = 0
) -> float:
    """KL(π‖π_ref) of a final policy, measured the same way for every stage: sample one
    response per held-out prompt at temperature 1 and average Σ_t log π − log π_ref over
    the response tokens (to and including the stop token); an unbiased estimate of the
    sequence-level KL in nats per response."""
    meta = data.load_meta(data_name)
    prompts = data.load_split(data_name, "prompt_test")
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    policy = gpt2.load(policy_dir, meta).eval()
    ref = gpt2.load(ref_dir, meta).eval()
    query = torch.from_numpy(prompts["query"][:n]).long()
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand(len(query), length, generator=generator)
    total = 0.0
    for i in range(0, len(query), 100):
        batch = slice(i, i + 100)
        rollout = gpt2.generate(
            policy,
            query[batch],
            pad_token_id=pad,
            max_new_tokens=length,
            eos_token_id=eos,
            temperature=1.0,
            noise=noise[batch],
        )
        q = rollout.query
        response = rollout.response
        # The response tokens up to and including the stop token.
        mask = rollout.mask
        attn = torch.cat([q != pad, mask], 1)
        query_response = torch.cat([q, response], 1)
        ref_logits = ref(query_response, attn, keep_from=q.size(1) - 1)[:, :-1]
        ref_logp = ref_logits.float().log_softmax(-1)
        ref_logprobs = ref_logp.gather(-1, response.long()[..., None]).squeeze(-1)
        kl = (rollout.logprobs - ref_logprobs) * mask
        total += kl.sum().item()
    return total / len(query)


def first_last(rows: list[dict], metric: str):
    """A metric's value at step 0 (None if not logged then) and its last logged value."""
    values = [(r["step"], r[metric]) for r in rows if metric in r]
    if not values:
        return None, None
    first_step, first_value = values[0]
    last_value = values[-1][1]
    if first_step != 0:
        return None, last_value
    return first_value, last_value


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def results_table(runs: dict, times: dict) -> str:
    """runs[seed][stage] = metrics rows; one line per stage, 'start → end' where the stage
    evaluated its start."""
    headers = [header for header, _ in COLUMNS]
    lines = [
        "| stage | " + " | ".join(headers) + " | wall time |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for stage in STAGES:
        seeds = [s for s in runs if stage in runs[s]]
        if not seeds:
            continue
        cells = []
        for _, metric in COLUMNS:
            # The RM's eval/accuracy is its accuracy on held-out pairs: the table shows it
            # as the RM's preference accuracy, and not as an eval accuracy.
            logged_as = metric
            if stage == "reward" and metric == "eval/preference_accuracy":
                logged_as = "eval/accuracy"
            pairs = [first_last(runs[s][stage], logged_as) for s in seeds]
            starts = [a for a, _ in pairs if a is not None]
            ends = [b for _, b in pairs if b is not None]
            if stage == "reward" and metric == "eval/accuracy":
                ends = []
            if not ends:
                cells.append("–")
                continue
            start = ""
            if len(starts) == len(ends):
                start = fmt(starts) + " → "
            cells.append(start + fmt(ends))
        minutes = [times[s][stage] / 60 for s in seeds if stage in times[s]]
        lines.append(f"| {stage} | " + " | ".join(cells) + f" | {fmt(minutes)} min |")
    return "\n".join(lines)


def plot_curves(runs: dict, path: str) -> bool:
    """Eval accuracy and KL over steps, one panel per stage (needs matplotlib; False
    without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    stages = [s for s in ("dpo", "ppo", "grpo") if any(s in r for r in runs.values())]
    panels = [("eval/accuracy", "eval accuracy"), ("objective/kl", "KL (train batch)")]
    kl_units = {"ppo": ", nats/response (k1)", "grpo": ", nats/token (k3)"}
    figsize = (4 * len(stages), 6)
    fig, axes = plt.subplots(2, len(stages), figsize=figsize, squeeze=False)
    for col, stage in enumerate(stages):
        for row, (metric, label) in enumerate(panels):
            ax = axes[row][col]
            for seed, r in runs.items():
                rows = [m for m in r.get(stage, []) if metric in m]
                if not rows:
                    continue
                steps = [m["step"] for m in rows]
                values = [m[metric] for m in rows]
                marker = "." if row == 0 else None
                ax.plot(steps, values, label=f"seed {seed}", marker=marker)
            # DPO samples nothing while it trains, so its KL is the table's, measured at
            # the end.
            if not ax.lines:
                note = "not logged while training:\nsee the table's KL"
                ax.text(0.5, 0.5, note, ha="center", transform=ax.transAxes)
            unit = kl_units.get(stage, "") if row else ""
            ax.set_title(f"{stage}: {label}{unit}", fontsize=10)
            ax.set_xlabel("step")
            if ax.lines:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(args: Args):
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        raise gpt2.RunError(f"unknown stage(s) {unknown}: choose from {list(STAGES)}")
    launcher = [sys.executable]
    if args.nproc != 1:
        torchrun = ["-m", "torch.distributed.run", "--standalone"]
        launcher += [*torchrun, f"--nproc_per_node={args.nproc}"]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = {}
    times = {}
    for seed in args.seeds:
        name = f"pipeline-{stamp}-s{seed}"
        ran = set()
        runs[seed] = {}
        times[seed] = {}
        for stage in args.stages:
            out_dir = os.path.join("runs", stage, name)
            sft = model_dir("sft", name, ran)
            reward = model_dir("reward", name, ran)
            script, *flags = stage_commands(args, seed, sft, reward)[stage]
            cmd = [*launcher, os.path.join(ROOT, script), *flags, "--out_dir", out_dir]
            if args.smoke:
                cmd += SMOKE[stage].split()
            shown = " ".join(cmd[len(launcher) :])
            print(f"\n==== seed {seed}, {stage}: {shown}", flush=True)
            t0 = time.time()
            if subprocess.run(cmd).returncode != 0:
                rest = " ".join(args.stages[args.stages.index(stage) :])
                raise gpt2.RunError(
                    f"stage '{stage}' (seed {seed}) failed (see its output above); "
                    f"fix it and rerun with --stages {rest}"
                )
            times[seed][stage] = time.time() - t0
            ran.add(stage)
            metrics = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
            runs[seed][stage] = metrics
            # Every policy's final KL to the SFT model, measured alike so the stages compare.
            if stage in ("dpo", "ppo", "grpo"):
                n = 16 if args.smoke else 500
                kl = kl_to_reference(out_dir, sft, args.data, n=n)
                metrics.append({"step": metrics[-1]["step"], "eval/kl": kl})
    out = os.path.join("runs", "pipeline", stamp)
    os.makedirs(out, exist_ok=True)
    table = results_table(runs, times)
    seeds = ", ".join(map(str, args.seeds))
    command = " ".join(sys.argv)
    header = f"Pipeline results (seeds {seeds}; {os.cpu_count()} CPUs; `{command}`)"
    text = f"{header}\n\n{table}\n\n{LEGEND}"
    if len(args.seeds) > 1:
        text += "Several seeds: median [min, max] over the seeds.\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump({str(s): r for s, r in runs.items()}, f)
    curves = plot_curves(runs, os.path.join(out, "curves.png"))
    written = f"written to {out}/results.md"
    if curves:
        written += " and curves.png"
    print("\n" + text + "\n" + written)


if __name__ == "__main__":
    try:
        main(tyro.cli(Args, use_underscores=True))
    except gpt2.RunError as e:
        # a problem the user can fix: one line, no traceback
        sys.exit(f"error: {e}")
