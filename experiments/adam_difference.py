"""The minimal Adam difference as a study: when does PyTorch's Adam make a larger first
PPO update than TF's?

Huang, Liu, von Werra 2023 ("The N Implementation Details of RLHF with PPO",
github.com/vwxyzjn/minimal-adam-difference) replayed lm-human-preferences' first PPO
minibatch of GPT-2 124M: approxkl 0.00237 after one step of torch.optim.Adam, 0.00037
after one of TF's Adam (6.4x). TF's first step is PyTorch's with eps / sqrt(1 - beta2) =
31.6 eps (adam_tf.py), which damps every parameter whose |g| is small next to that. This
measures, for each --eps, approxkl, clipfrac and mean |theta - theta_0| after one step of
each optimizer from the same policy and minibatch (median and range over --seeds), and the
distribution of |g|, which places a model on the sweep: d = (eps / sqrt(1 - beta2)) /
median |g|. Setup, policies and figures: docs/adam.md. Plots need matplotlib.

    python experiments/adam_difference.py --out /tmp/adam/sft.json  # tiny SFT, seeds 1 2 3
    python experiments/adam_difference.py --model random:gpt2 --reward random \\
        --batch_size 32 --eps 1e-6 1e-5 1e-4 1e-3 --out /tmp/adam/gpt2.json
    python experiments/adam_difference.py --seeds --overlay /tmp/adam/sft.json \\
        /tmp/adam/gpt2.json --plot docs/adam  # no new runs: tables and plots
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import tyro

# run from anywhere: gpt2, data and adam_tf live at the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import data  # noqa: E402
import gpt2  # noqa: E402
from adam_tf import AdamTF  # noqa: E402

# both optimizers' default beta2, and lm-human-preferences' eps
BETA2 = 0.999
LHP_EPS = 1e-5
# the eps sweep: 1e-9, 3e-9, ..., 1e-2
SWEEP = tuple(round(m * 10.0**e, 12) for e in range(-9, -1) for m in (1, 3))[:-1]
# the log10 |g| histogram that --overlay plots: low, high, bins
HIST = (-14.0, 2.0, 160)


@dataclass
class Args:
    model: str = "sft"  # `sft` (tiny, trained once), `random:PRESET`, `gpt2` (pretrained), a dir
    sft_dir: str = "/tmp/adam_sft"  # where --model sft trains its policy, reused when it has one
    sft_steps: int = 300  # sft.py --total_steps for --model sft
    data: str = "arithmetic"  # prompts (prompt_train) of this dataset: built-in name or a dir
    reward: Literal["verifier", "random"] = "verifier"  # the task's verifier (1 / 0), or N(0, 1)
    seeds: tuple[int, ...] = (1, 2, 3)  # one minibatch each; none: print and plot --overlay
    batch_size: int = 64  # rollouts in the minibatch (the replay's 64)
    response_length: int = 16  # tokens sampled per prompt
    temperature: float = 0.7  # sampling temperature, also of the training log-probs (ppo.py's)
    lr: float = 1e-5  # learning rate of both optimizers (ppo.py's and lm-human-preferences')
    eps: tuple[float, ...] = SWEEP  # epsilon of both optimizers, one measurement each
    cliprange: float = 0.2  # PPO clip range (for clipfrac)
    dtype: Literal["float32", "float64"] = "float64"  # float64 keeps TF's tiny steps above rounding
    label: str = ""  # name of this run in tables and plots (default: --model and --reward)
    out: str = ""  # also write the results to this JSON file (what --overlay reads)
    plot: str = ""  # write PREFIX_sweep.png and PREFIX_grads.png (needs matplotlib)
    overlay: tuple[str, ...] = ()  # JSON files of earlier runs (--out) drawn on the same plots


# ---- the first PPO update


def first_update_advantages(scores, mask, lam=0.95):
    """Advantages (B, T) of lm-human-preferences' first update: the score on the last
    response token and values 0, so GAE(gamma=1, lam) gives A_t = lam^(L-1-t) * score for
    a response of L tokens; whitened over the batch's tokens."""
    L = mask.sum(1, keepdim=True)  # (B, 1)
    t = torch.arange(mask.size(1))[None, :]  # (1, T)
    decay = lam ** (L - 1 - t).clamp(min=0).to(scores.dtype)
    adv = decay * scores[:, None] * mask
    mean = adv[mask].mean()
    var = adv[mask].var(unbiased=False)
    return (adv - mean) * torch.rsqrt(var + 1e-8) * mask


def policy_loss(new_logprobs, logprobs, advantages, cliprange):
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7) as a loss; all
    (B, T). Returns the losses, the ratios, and where the clipped term was the larger."""
    ratio = torch.exp(new_logprobs - logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.max(pg_losses, pg_losses2), ratio, pg_losses2 > pg_losses


def logprobs(model, b, temperature):
    """Log-probs (B, Tr) of the sampled response tokens under softmax(logits / T)."""
    keep_from = b["context_length"] - 1
    logits = model(b["query_response"], attention_mask=b["attention_mask"], keep_from=keep_from)
    logp = (logits[:, :-1] / temperature).log_softmax(-1)
    return logp.gather(-1, b["response"][..., None]).squeeze(-1)


def grad_stats(grads, sweep):
    """Percentiles of |g| over the nonzero gradient entries, the shares below
    lm-human-preferences' eps and below TF's first-step eps, for each eps of the sweep the
    share TF damps (|g| < eps / sqrt(1 - beta2)), and the log10 |g| histogram."""
    # float32: 4 bytes a parameter is plenty here
    a = torch.cat([g.abs().flatten().float() for g in grads])
    nonzero = a[a > 0]
    hist = torch.histc(nonzero.log10(), bins=HIST[2], min=HIST[0], max=HIST[1])

    def percentile(q):
        k = max(1, round(q / 100 * nonzero.numel()))
        return nonzero.kthvalue(k).values.item()

    def below(x):
        return (nonzero < x).double().mean().item()

    stats = dict(n=a.numel(), zero=int((a == 0).sum()))
    stats |= dict(p10=percentile(10), p50=percentile(50), p90=percentile(90))
    stats["median"] = stats["p50"]
    stats["below_eps"] = below(LHP_EPS)
    stats["below_tf_eps"] = below(LHP_EPS / math.sqrt(1 - BETA2))
    stats["hist"] = hist.tolist()
    stats["damped"] = [below(e / math.sqrt(1 - BETA2)) for e in sweep]
    return stats


# ---- one seed: rollouts, the gradient at theta_0, one step per (eps, optimizer)


def sft_policy(args):
    """--model sft: the tiny policy of `sft.py --total_steps N` in --sft_dir, trained once
    (again if the data or steps differ; after the dataset's contents change, delete
    --sft_dir)."""
    ckpt = os.path.join(args.sft_dir, "model.safetensors")
    run_args = os.path.join(args.sft_dir, "args.json")
    want = dict(data=args.data, total_steps=args.sft_steps)
    if os.path.isfile(ckpt) and os.path.isfile(run_args):
        with open(run_args) as f:
            have = json.load(f)
        if {k: have.get(k) for k in want} == want:
            return args.sft_dir
    flags = ["--data", args.data, "--total_steps", str(args.sft_steps)]
    flags += ["--out_dir", args.sft_dir, "--overwrite"]
    print(f"training the SFT policy: sft.py {' '.join(flags)}", flush=True)
    cmd = [sys.executable, os.path.join(ROOT, "sft.py"), *flags]
    if subprocess.run(cmd, capture_output=True, text=True).returncode:
        raise gpt2.RunError(f"sft.py failed: run `python sft.py {' '.join(flags)}` to see why")
    return args.sft_dir


def build_policy(args, meta, seed):
    if args.model.startswith("random:"):
        torch.manual_seed(seed)
        preset = gpt2.PRESETS[args.model.removeprefix("random:")]
        policy = gpt2.GPT(gpt2.GPTConfig(**preset, vocab_size=meta["vocab_size"]))
    else:
        path = sft_policy(args) if args.model == "sft" else args.model
        policy = gpt2.load(path, meta)
    # the head runs in the model's own dtype: float64 stays float64
    policy.fp32_head = False
    return policy.to(getattr(torch, args.dtype))


def score(args, meta, prompts, idx, response, gen):
    """One score per response: the task's verifier on the text before the stop token, or
    N(0, 1) with --reward random."""
    if args.reward == "random":
        return torch.randn(len(idx), generator=gen, dtype=torch.float64)
    eos = meta["eos_token_id"]
    enc = data.get_encoding(meta["tokenizer"])
    scores = []
    for row, truth in zip(response.tolist(), prompts["ground_truth"][idx]):
        text = enc.decode(row[: row.index(eos)] if eos in row else row)
        scores.append(data.verify(meta.get("task"), text, str(truth)))
    return torch.tensor(scores, dtype=torch.float64)


def rollouts(policy, args, meta, seed):
    """One minibatch: prompts, sampled responses, scores and first-update advantages; the
    old log-probs at theta_0."""
    pad = meta["pad_token_id"]
    prompts = data.load_split(args.data, "prompt_train")
    gen = torch.Generator().manual_seed(seed)
    order = np.random.default_rng([seed]).permutation(len(prompts["query"]))
    idx = order[: args.batch_size]
    noise = torch.rand(len(idx), args.response_length, generator=gen)
    query = torch.from_numpy(prompts["query"][idx]).long()
    eos, n = meta["eos_token_id"], args.response_length
    rollout = gpt2.generate(policy, query, pad, n, eos, args.temperature, noise)
    response, mask = rollout.response, rollout.mask  # (B, Tr) each
    scores = score(args, meta, prompts, idx, response, gen)
    if scores.std() == 0:
        fix = "pass --reward random or a larger --batch_size"
        raise gpt2.RunError(f"all {len(scores)} rewards are {scores[0]:g}: {fix}")
    accuracy = scores.mean().item() if args.reward == "verifier" else None
    # a normalised reward model's scores (mean 0, std 1)
    scores = (scores - scores.mean()) / scores.std()
    b = dict(response=response, mask=mask, context_length=query.size(1), accuracy=accuracy)
    b["query_response"] = torch.cat([rollout.query, response], 1)
    b["attention_mask"] = torch.cat([rollout.query != pad, mask], 1)
    advantages = first_update_advantages(scores, mask)
    b["advantages"] = advantages.to(policy.lm_head.weight.dtype)
    with torch.no_grad():
        b["logprobs"] = logprobs(policy, b, args.temperature)
    return b


def one_step(args, policy, b, theta0, grads, eps, optimizer):
    """From theta_0 with the first minibatch's gradient, one step of optimizer at eps;
    what the step did to the minibatch's log-probs and to the parameters."""
    params = list(policy.parameters())
    with torch.no_grad():
        for p, p0, g in zip(params, theta0, grads):
            p.copy_(p0)
            p.grad = g
    optimizer(params, lr=args.lr, betas=(0.9, BETA2), eps=eps).step()
    m = b["mask"]
    with torch.no_grad():
        new = logprobs(policy, b, args.temperature)
        _, ratio, clipped = policy_loss(new, b["logprobs"], b["advantages"], args.cliprange)
        moved = sum((p - p0).abs().sum().item() for p, p0 in zip(params, theta0))
    diff = (new - b["logprobs"])[m]
    # approxkl as lm-human-preferences and ppo.py log it
    return dict(
        approxkl=0.5 * (diff**2).mean().item(),
        clipfrac=clipped[m].double().mean().item(),
        ratio_max=ratio[m].max().item(),
        ratio_min=ratio[m].min().item(),
        dtheta=moved / sum(p.numel() for p in params),
    )


def one_seed(args, meta, seed):
    policy = build_policy(args, meta, seed)
    b = rollouts(policy, args, meta, seed)
    m = b["mask"]
    new = logprobs(policy, b, args.temperature)
    pg_losses, _, _ = policy_loss(new, b["logprobs"], b["advantages"], args.cliprange)
    # the first minibatch's gradient: the same for both optimizers
    ((pg_losses * m).sum() / m.sum()).backward()
    params = list(policy.parameters())
    theta0 = [p.detach().clone() for p in params]
    grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params]
    stats = grad_stats(grads, args.eps)
    out = dict(seed=seed, tokens=int(m.sum()), accuracy=b["accuracy"], grad=stats, sweep=[])
    for eps, damped in zip(args.eps, stats["damped"]):
        d = eps / math.sqrt(1 - BETA2) / stats["median"]
        row = dict(eps=eps, d=d, damped=damped)
        for name, optimizer in (("torch", torch.optim.Adam), ("tf", AdamTF)):
            result = one_step(args, policy, b, theta0, grads, eps, optimizer)
            for key, value in result.items():
                row[f"{key}_{name}"] = value
        out["sweep"].append(row)
    return out


# ---- tables and plots


def summary(values, fmt=".3g"):
    """median [min–max] over seeds; a ratio with a zero denominator (nan for 0/0, inf)
    stays out, counted as 'n/0'."""
    finite = [v for v in values if math.isfinite(v)]
    inf = f" ({len(values) - len(finite)}x n/0)" if len(finite) < len(values) else ""
    if not finite:
        return "–" + inf
    med = format(statistics.median(finite), fmt)
    if len(values) == 1:
        return med + inf
    return f"{med} [{min(finite):{fmt}}–{max(finite):{fmt}}]" + inf


def ratio(a, b):
    return a / b if b > 0 else (math.nan if a == 0 else math.inf)


def torch_over_tf(row, key):
    return ratio(row[f"{key}_torch"], row[f"{key}_tf"])


def sweep_cells(rows):
    """One line of the sweep table: the same eps over every seed."""
    cells = [format(rows[0]["eps"], "g")]
    cells.append(summary([r["d"] for r in rows], ".2g"))
    cells.append(summary([r["damped"] for r in rows], ".0%"))
    for key, fmt in (("approxkl", ".3g"), ("clipfrac", ".3f")):
        cells.append(summary([r[f"{key}_torch"] for r in rows], fmt))
        cells.append(summary([r[f"{key}_tf"] for r in rows], fmt))
        ratio_fmt = ".3g" if key == "approxkl" else ".2f"
        cells.append(summary([torch_over_tf(r, key) for r in rows], ratio_fmt))
    cells.append(summary([torch_over_tf(r, "dtheta") for r in rows]))
    return cells


SWEEP_HEADER = ["eps", "d = TF eps / median \\|g\\|", "\\|g\\| < TF eps"]
SWEEP_HEADER += ["approxkl torch", "approxkl TF", "approxkl torch/TF"]
SWEEP_HEADER += ["clipfrac torch", "clipfrac TF", "clipfrac torch/TF", "mean \\|Δθ\\| torch/TF"]


def print_tables(res):
    seeds, a = res["seeds"], res["args"]
    tokens = summary([s["tokens"] for s in seeds], ".0f")
    acc = ""
    if a["reward"] == "verifier":
        acc = f", verifier accuracy {summary([s['accuracy'] for s in seeds], '.3f')}"
    head = f"{res['label']}: {len(seeds)} seed(s), {a['batch_size']} rollouts"
    head += f" ({tokens} response tokens{acc}), lr {a['lr']:g}, {a['dtype']}"
    print(f"\n{head}; values are median [min–max] over seeds\n")
    zero = summary([s["grad"]["zero"] for s in seeds], ",.0f")
    tf_eps = LHP_EPS / math.sqrt(1 - BETA2)
    grad = f"gradient of the first minibatch, |g| over all {seeds[0]['grad']['n']:,} parameters"
    print(f"{grad} (zero: {zero}); eps = {LHP_EPS:g}, TF's first-step eps = {tf_eps:.3g}\n")
    print("| p10 | median | p90 | < eps | < TF's first-step eps |\n|---|---|---|---|---|")
    cells = []
    for key, fmt in (("p10", ".2g"), ("median", ".2g"), ("p90", ".2g")):
        cells.append(summary([s["grad"][key] for s in seeds], fmt))
    for key in ("below_eps", "below_tf_eps"):
        cells.append(summary([s["grad"][key] for s in seeds], ".1%"))
    print("| " + " | ".join(cells) + " |\n")
    print("| " + " | ".join(SWEEP_HEADER) + " |\n|" + "---|" * len(SWEEP_HEADER))
    for i in range(len(a["eps"])):
        print("| " + " | ".join(sweep_cells([s["sweep"][i] for s in seeds])) + " |")


def plot_sweep(plt, prefix, results):
    """Left: approxkl torch / TF, right: mean |Δθ| torch / TF, against d; a square marks
    eps 1e-5."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = ("approxkl", "dtheta")
    for res in results:
        seeds, eps = res["seeds"], res["args"]["eps"]
        x = [statistics.median(s["sweep"][i]["d"] for s in seeds) for i in range(len(eps))]
        at = [i for i, e in enumerate(eps) if abs(e - LHP_EPS) < 1e-12]
        for ax, key in zip(axes, keys):
            per_seed = [[torch_over_tf(s["sweep"][i], key) for s in seeds] for i in range(len(eps))]
            y = [statistics.median(r) for r in per_seed]
            style = dict(fmt="o-", ms=5) if len(eps) > 1 else dict(fmt="*", ms=14)
            line = ax.plot(x, y, style["fmt"], ms=style["ms"], label=res["label"])[0]
            spread = ([min(r) for r in per_seed], [max(r) for r in per_seed])
            ax.fill_between(x, spread[0], spread[1], color=line.get_color(), alpha=0.2)
            # a square at lm-human-preferences' eps
            marks = ([x[i] for i in at], [y[i] for i in at])
            ax.plot(marks[0], marks[1], "s", color=line.get_color(), ms=11, mfc="none")
    ylabels = ("approxkl after one step", "mean |θ - θ0| after one step")
    for ax, ylabel in zip(axes, ylabels):
        xlabel = "d = (eps / sqrt(1 - β2)) / median |g|"
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=f"{ylabel}: torch Adam / AdamTF")
        ax.axhline(1, color="gray", lw=0.5)
        ax.axvline(1, color="gray", lw=0.5, ls=":")
        ax.grid(True, which="major", alpha=0.3)
    replay = "Huang et al. replay, GPT-2 124M (6.4x)"
    axes[0].axhline(0.00237 / 0.00037, color="k", ls="--", lw=0.8, label=replay)
    axes[0].legend(fontsize=7, title="square: eps 1e-5", title_fontsize=7)
    bound = "bound 1 / sqrt(1 - β2) = 31.6"
    axes[1].axhline(1 / math.sqrt(1 - BETA2), color="k", ls="--", lw=0.8, label=bound)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix + "_sweep.png", dpi=110)


def plot_grads(plt, prefix, results):
    """The share of parameters per log10 |g| bin, averaged over seeds."""
    fig, ax = plt.subplots(figsize=(7, 4))
    low, high, bins = HIST
    centers = np.linspace(low, high, bins + 1)[:-1] + (high - low) / bins / 2
    for res in results:
        h = np.mean([s["grad"]["hist"] for s in res["seeds"]], axis=0)
        ax.plot(centers, h / h.sum(), label=res["label"])
    ax.axvline(math.log10(LHP_EPS), color="k", ls=":", lw=0.8, label="eps 1e-5")
    tf_eps = math.log10(LHP_EPS / math.sqrt(1 - BETA2))
    ax.axvline(tf_eps, color="k", ls="--", lw=0.8, label="TF's first-step eps")
    xlabel = "log10 |g| (first PPO minibatch, every parameter)"
    ax.set(xlabel=xlabel, ylabel="fraction of parameters", xlim=(-12, 0))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix + "_grads.png", dpi=110)


def plot(prefix, results):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plots: matplotlib is not installed (pip install -r requirements-plot.txt)")
        return
    plot_sweep(plt, prefix, results)
    plot_grads(plt, prefix, results)
    print(f"wrote {prefix}_sweep.png, {prefix}_grads.png")


def main(args: Args):
    overlays = []
    for path in args.overlay:
        if not os.path.isfile(path):
            raise gpt2.RunError(f"--overlay {path}: no such file (write it with --out)")
        with open(path) as f:
            overlays.append(json.load(f))
    if not args.seeds:
        # nothing to measure: print and plot earlier runs
        for res in overlays:
            print_tables(res)
        if args.plot:
            plot(args.plot, overlays)
        return
    meta = data.load_meta(args.data)
    if args.reward == "verifier" and meta.get("task") not in ("arithmetic", "gsm8k"):
        raise gpt2.RunError(f"--data {args.data} has no verifier: pass --reward random")
    label = args.label or f"{args.model} ({args.reward} reward)"
    res = dict(label=label, args=asdict(args), seeds=[])
    for seed in args.seeds:
        t = time.time()
        res["seeds"].append(one_seed(args, meta, seed))
        print(f"seed {seed}: {time.time() - t:.0f} s", flush=True)
    print_tables(res)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f)
        print(f"wrote {args.out}")
    if args.plot:
        plot(args.plot, overlays + [res])


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
