"""The minimal Adam difference as a study: when does PyTorch's Adam make a larger first PPO update
than TF's?

Huang, Liu, von Werra 2023, "The N Implementation Details of RLHF with PPO"
(github.com/vwxyzjn/minimal-adam-difference) replayed lm-human-preferences' first PPO minibatch of
GPT-2 124M at lr 1e-5, eps 1e-5: approxkl 0.00237 after one step of `torch.optim.Adam` against
0.00037 after one step of TensorFlow's Adam (6.4x). adam_tf.py explains why: on the first step TF's
Adam is PyTorch's with eps / sqrt(1 - beta2) = 31.6 eps, so a parameter whose |g| is small next to
that takes a damped step lr * g / (31.6 eps) instead of ~lr * sign(g). The gap therefore depends on
the per-parameter gradient sizes against eps, and only on their ratio: Adam is invariant to the loss
scale except through eps, so sweeping eps at fixed gradients is the same as sweeping the loss scale
at eps 1e-5. This script measures:

  (a) for each --eps: approxkl, clipfrac and mean |theta - theta_0| after one step with torch Adam
      and with AdamTF from the same policy on the same minibatch, and their ratios torch / TF
      (median and range over --seeds);
  (b) the distribution of |g| over all parameters for that minibatch (percentiles, fraction below
      eps and below TF's first-step eps), which places a model on the sweep: its x is d = (eps /
      sqrt(1 - beta2)) / median |g|.

One minibatch of --batch_size rollouts (the replay's 64; ppo.py's default minibatch), built here:
prompts of --data, responses sampled at --temperature, one score per response (the task's verifier,
or --reward random: N(0, 1), for policies that never solve the task), centred and scaled over the
batch, then lm-human-preferences' first-update advantages: the score on the last response token,
value 0 (its value head starts at zero; no KL yet as policy = reference), GAE(gamma 1, lam 0.95),
whitened over the batch's tokens. Loss: PPO's clipped surrogate, token mean. The policy (--model):
`sft` trains a tiny model with `python sft.py --total_steps 300` once into --sft_dir (an SFT-like
start, as lm-human-preferences'; a subprocess); `random:PRESET` is a random init of a gpt2.py preset
with the data's vocabulary, seeded per seed (`random:gpt2`: the GPT-2 124M shape, 86M parameters
with the byte vocabulary); `gpt2` is the pretrained GPT-2 124M (downloads its weights: offline it
cannot run; needs --data prepared with the GPT-2 tokenizer); or a checkpoint dir. Figures, hardware
and what they depend on: docs/adam.md. Plots need matplotlib (pip install -r requirements-plot.txt);
without it the tables still print.

    python experiments/adam_difference.py --out /tmp/adam/sft.json  # tiny SFT: eps x seeds 1 2 3
    python experiments/adam_difference.py --model random:tiny --reward random \\
        --out /tmp/adam/rand.json
    python experiments/adam_difference.py --model random:gpt2 --reward random --batch_size 32 \\
        --eps 1e-6 1e-5 1e-4 1e-3 --out /tmp/adam/gpt2.json  # the GPT-2 124M shape
    python experiments/adam_difference.py --seeds --overlay /tmp/adam/sft.json \\
        /tmp/adam/rand.json /tmp/adam/gpt2.json --plot docs/adam  # no new runs: tables and plots
    python -m data.arithmetic --tokenizer gpt2 --out /tmp/arith_gpt2
    python experiments/adam_difference.py --model gpt2 --data /tmp/arith_gpt2 --batch_size 32 \\
        --eps 1e-5  # pretrained GPT-2 (downloads its weights)
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from anywhere: gpt2, data and adam_tf live at the repository root

import data  # noqa: E402
import gpt2  # noqa: E402
from adam_tf import AdamTF  # noqa: E402

BETA2 = 0.999  # both optimizers' default, lm-human-preferences' too
LHP_EPS = 1e-5  # lm-human-preferences' eps: the thresholds of the gradient table
# 1e-9, 3e-9, ..., 1e-2
SWEEP = tuple(round(m * 10.0**e, 12) for e in range(-9, -1) for m in (1, 3))[:-1]
HIST = (-14.0, 2.0, 160)  # log10 |g| histogram: low, high, bins (saved for --overlay plots)


@dataclass
class Args:
    model: str = "sft"
    """`sft` (tiny, trained once by sft.py into --sft_dir), `random:PRESET` (random init), `gpt2`
    (pretrained), a dir"""
    sft_dir: str = "/tmp/adam_sft"
    """where --model sft trains its policy (`sft.py --out_dir`), reused when it holds a model"""
    sft_steps: int = 300
    """sft.py --total_steps for --model sft"""
    data: str = "arithmetic"
    """prompts (prompt_train) of this dataset: `arithmetic` (built in) or a prepared directory"""
    reward: Literal["verifier", "random"] = "verifier"
    """score per response: the task's verifier (1 / 0), or `random` N(0, 1) (for policies that solve
    nothing)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """one minibatch per seed (prompts, samples, random rewards, random init): medians and ranges
    over these; none (`--seeds` alone): measure nothing, print and --plot the --overlay files"""
    batch_size: int = 64
    """rollouts in the minibatch (the replay's 64)"""
    response_length: int = 16
    """tokens sampled per prompt"""
    temperature: float = 0.7
    """sampling temperature, also applied to the training log-probs (ppo.py's default)"""
    lr: float = 1e-5
    """learning rate of both optimizers (ppo.py's and lm-human-preferences' value)"""
    eps: tuple[float, ...] = SWEEP
    """epsilon of both optimizers, one measurement each: the sweep (lm-human-preferences: 1e-5)"""
    cliprange: float = 0.2
    """PPO clip range (for clipfrac)"""
    dtype: Literal["float32", "float64"] = "float64"
    """float64 keeps TF's first steps at large eps (lr * g / (31.6 eps), down to ~1e-12) above
    rounding"""
    label: str = ""
    """name of this run in tables and plots (default: --model and --reward)"""
    out: str = ""
    """also write the results to this JSON file (what --overlay reads)"""
    plot: str = ""
    """write PREFIX_sweep.png and PREFIX_grads.png (needs matplotlib)"""
    overlay: tuple[str, ...] = ()
    """JSON files of earlier runs (--out) drawn on the same plots"""


# ---- the first PPO update


def first_update_advantages(scores, mask, lam=0.95):
    """Advantages (B, T) of lm-human-preferences' first update: the score on the last real response
    token, values 0, GAE(gamma=1, lam) gives A_t = lam^(L-1-t) * score for a response of L tokens;
    whitened over the batch's tokens."""
    L = mask.sum(1, keepdim=True)  # (B, 1)
    t = torch.arange(mask.size(1))[None, :]  # (1, T)
    adv = lam ** (L - 1 - t).clamp(min=0).to(scores.dtype) * scores[:, None] * mask
    mean, var = adv[mask].mean(), adv[mask].var(unbiased=False)
    return (adv - mean) * torch.rsqrt(var + 1e-8) * mask


def policy_loss(new_logprobs, logprobs, advantages, cliprange):
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7) as a loss; all (B, T).
    Returns the losses, the ratios and where the clipped term was the larger loss (what `clipfrac`
    counts)."""
    ratio = torch.exp(new_logprobs - logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.max(pg_losses, pg_losses2), ratio, pg_losses2 > pg_losses


def logprobs(model, b, temperature):
    """Log-probs (B, Tr) of the sampled response tokens under softmax(logits / temperature)."""
    logits = model(
        b["query_response"], attention_mask=b["attention_mask"], keep_from=b["context_length"] - 1
    )[:, :-1]
    return (logits / temperature).log_softmax(-1).gather(-1, b["response"][..., None]).squeeze(-1)


def grad_stats(grads, sweep):
    """Percentiles of |g| over all nonzero gradient entries, the fractions below
    lm-human-preferences' eps and below its TF first-step eps, for each eps of the sweep the
    fraction TF damps (|g| < eps / sqrt(1 - beta2)), and the log10 |g| histogram (HIST) that
    --overlay plots."""
    # float32: 4 bytes a parameter is plenty here
    a = torch.cat([g.abs().flatten().float() for g in grads])
    nonzero = a[a > 0]
    hist = torch.histc(nonzero.log10(), bins=HIST[2], min=HIST[0], max=HIST[1])
    pct = {
        f"p{q}": nonzero.kthvalue(max(1, round(q / 100 * nonzero.numel()))).values.item()
        for q in (10, 50, 90)
    }
    below = lambda x: (nonzero < x).double().mean().item()  # noqa: E731
    return dict(
        n=a.numel(),
        zero=int((a == 0).sum()),
        **pct,
        median=pct["p50"],
        below_eps=below(LHP_EPS),
        below_tf_eps=below(LHP_EPS / math.sqrt(1 - BETA2)),
        hist=hist.tolist(),
        damped=[below(e / math.sqrt(1 - BETA2)) for e in sweep],
    )


# ---- one seed: rollouts, the gradient at theta_0, one step per (eps, optimizer)


def sft_policy(args: Args) -> str:
    """--model sft: the tiny policy of `sft.py --total_steps N` in --sft_dir, trained once (again if
    the data or steps differ; after the dataset's contents change, delete --sft_dir)."""
    ckpt, run_args = (os.path.join(args.sft_dir, f) for f in ("model.safetensors", "args.json"))
    want = dict(data=args.data, total_steps=args.sft_steps)
    if os.path.isfile(ckpt) and os.path.isfile(run_args):
        if {k: json.load(open(run_args)).get(k) for k in want} == want:
            return args.sft_dir
    flags = ["--data", args.data, "--total_steps", str(args.sft_steps), "--out_dir", args.sft_dir]
    cmd = [sys.executable, os.path.join(ROOT, "sft.py"), *flags, "--overwrite"]
    print(f"training the SFT policy: sft.py {' '.join(cmd[2:])}", flush=True)
    if subprocess.run(cmd, capture_output=True, text=True).returncode:
        raise gpt2.RunError(f"sft.py failed: run `python sft.py {' '.join(cmd[2:])}` to see why")
    return args.sft_dir


def build_policy(args: Args, meta: dict, seed: int):
    if args.model.startswith("random:"):
        torch.manual_seed(seed)
        preset = gpt2.PRESETS[args.model.removeprefix("random:")]
        policy = gpt2.GPT(gpt2.GPTConfig(**preset, vocab_size=meta["vocab_size"]))
    else:
        policy = gpt2.load(sft_policy(args) if args.model == "sft" else args.model, meta)
    policy.fp32_head = False  # the head runs in the model's own dtype: float64 stays float64
    return policy.to(getattr(torch, args.dtype))


def rollouts(policy, args: Args, meta: dict, seed: int) -> dict:
    """One minibatch: prompts, sampled responses, scores and first-update advantages; old log-probs
    at theta_0."""
    pad, eos, enc = meta["pad_token_id"], meta["eos_token_id"], data.get_encoding(meta["tokenizer"])
    prompts, gen = data.load_split(args.data, "prompt_train"), torch.Generator().manual_seed(seed)
    idx = np.random.default_rng([seed]).permutation(len(prompts["query"]))[: args.batch_size]
    noise = torch.rand(len(idx), args.response_length, generator=gen)
    query = torch.from_numpy(prompts["query"][idx]).long()
    rollout = gpt2.generate(policy, query, pad, args.response_length, eos, args.temperature, noise)
    query, response, mask = rollout.query, rollout.response, rollout.mask  # (B, Tq), (B, Tr) x 2
    if args.reward == "random":
        scores = torch.randn(len(idx), generator=gen, dtype=torch.float64)
    else:
        texts = [
            enc.decode(row[: row.index(eos)] if eos in row else row) for row in response.tolist()
        ]
        scores = torch.tensor(
            [
                data.verify(meta.get("task"), t, str(gt))
                for t, gt in zip(texts, prompts["ground_truth"][idx])
            ],
            dtype=torch.float64,
        )
    if scores.std() == 0:
        raise gpt2.RunError(
            f"all {len(scores)} rewards are {scores[0]:g}: pass --reward random or a larger "
            "--batch_size"
        )
    accuracy = scores.mean().item() if args.reward == "verifier" else None
    # a normalised reward model's scores (mean 0, std 1)
    scores = (scores - scores.mean()) / scores.std()
    b = dict(
        query_response=torch.cat([query, response], 1),
        attention_mask=torch.cat([query != pad, mask], 1),
        response=response,
        mask=mask,
        context_length=query.size(1),
        accuracy=accuracy,
    )
    b["advantages"] = first_update_advantages(scores, mask).to(policy.lm_head.weight.dtype)
    with torch.no_grad():
        b["logprobs"] = logprobs(policy, b, args.temperature)
    return b


def one_seed(args: Args, meta: dict, seed: int) -> dict:
    policy = build_policy(args, meta, seed)
    b = rollouts(policy, args, meta, seed)
    m = b["mask"]
    pg_losses, _, _ = policy_loss(
        logprobs(policy, b, args.temperature), b["logprobs"], b["advantages"], args.cliprange
    )
    # the first minibatch's gradient: the same for both optimizers
    ((pg_losses * m).sum() / m.sum()).backward()
    params = list(policy.parameters())
    theta0 = [p.detach().clone() for p in params]
    grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params]
    out = dict(
        seed=seed,
        tokens=int(m.sum()),
        accuracy=b["accuracy"],
        grad=grad_stats(grads, args.eps),
        sweep=[],
    )
    for eps, damped in zip(args.eps, out["grad"]["damped"]):
        row = dict(eps=eps, d=eps / math.sqrt(1 - BETA2) / out["grad"]["median"], damped=damped)
        for name, opt_cls in (("torch", torch.optim.Adam), ("tf", AdamTF)):
            with torch.no_grad():
                for p, p0, g in zip(params, theta0, grads):
                    p.copy_(p0)
                    p.grad = g
            opt_cls(params, lr=args.lr, betas=(0.9, BETA2), eps=eps).step()
            with torch.no_grad():
                new = logprobs(policy, b, args.temperature)
                _, new_ratio, clipped = policy_loss(
                    new, b["logprobs"], b["advantages"], args.cliprange
                )
                moved = sum((p - p0).abs().sum().item() for p, p0 in zip(params, theta0))
            diff = (new - b["logprobs"])[m]
            # approxkl as lm-human-preferences and ppo.py log it
            row[f"approxkl_{name}"] = 0.5 * (diff**2).mean().item()
            row[f"clipfrac_{name}"] = clipped[m].double().mean().item()
            row[f"ratio_max_{name}"] = new_ratio[m].max().item()
            row[f"ratio_min_{name}"] = new_ratio[m].min().item()
            row[f"dtheta_{name}"] = moved / sum(p.numel() for p in params)  # mean |theta - theta_0|
        out["sweep"].append(row)
    return out


# ---- tables and plots


def summary(values: list[float], fmt: str = ".3g") -> str:
    """median [min–max] over seeds; a ratio with a zero denominator (nan for 0/0, inf) stays out,
    counted as 'n/0'."""
    finite = [v for v in values if math.isfinite(v)]
    inf = f" ({len(values) - len(finite)}x n/0)" if len(finite) < len(values) else ""
    if not finite:
        return "–" + inf
    med = format(statistics.median(finite), fmt)
    return (med if len(values) == 1 else f"{med} [{min(finite):{fmt}}–{max(finite):{fmt}}]") + inf


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.nan if a == 0 else math.inf)


COLUMNS = (  # the sweep table: header, value of one seed's row, format
    ("eps", lambda r: r["eps"], "g"),
    ("d = TF eps / median \\|g\\|", lambda r: r["d"], ".2g"),
    ("\\|g\\| < TF eps", lambda r: r["damped"], ".0%"),
    ("approxkl torch", lambda r: r["approxkl_torch"], ".3g"),
    ("approxkl TF", lambda r: r["approxkl_tf"], ".3g"),
    ("approxkl torch/TF", lambda r: ratio(r["approxkl_torch"], r["approxkl_tf"]), ".3g"),
    ("clipfrac torch", lambda r: r["clipfrac_torch"], ".3f"),
    ("clipfrac TF", lambda r: r["clipfrac_tf"], ".3f"),
    ("clipfrac torch/TF", lambda r: ratio(r["clipfrac_torch"], r["clipfrac_tf"]), ".2f"),
    ("mean \\|Δθ\\| torch/TF", lambda r: ratio(r["dtheta_torch"], r["dtheta_tf"]), ".3g"),
)


def print_tables(res: dict):
    seeds, a = res["seeds"], res["args"]
    tokens = summary([s["tokens"] for s in seeds], ".0f")
    acc = (
        f", verifier accuracy {summary([s['accuracy'] for s in seeds], '.3f')}"
        if a["reward"] == "verifier"
        else ""
    )
    print(
        f"\n{res['label']}: {len(seeds)} seed(s), {a['batch_size']} rollouts "
        f"({tokens} response tokens{acc}), lr {a['lr']:g}, {a['dtype']}; values are median "
        "[min–max] over seeds\n"
    )
    print(
        f"gradient of the first minibatch, |g| over all {seeds[0]['grad']['n']:,} parameters "
        f"(zero: {summary([s['grad']['zero'] for s in seeds], ',.0f')}); eps = {LHP_EPS:g}, "
        f"TF's first-step eps = {LHP_EPS / math.sqrt(1 - BETA2):.3g}\n"
    )
    print("| p10 | median | p90 | < eps | < TF's first-step eps |\n|---|---|---|---|---|")
    g = lambda k, f=".2g": summary([s["grad"][k] for s in seeds], f)  # noqa: E731
    cells = [g("p10"), g("median"), g("p90"), g("below_eps", ".1%"), g("below_tf_eps", ".1%")]
    print("| " + " | ".join(cells) + " |\n")
    print("| " + " | ".join(h for h, _, _ in COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for i in range(len(a["eps"])):
        rows = [s["sweep"][i] for s in seeds]
        cells = [format(rows[0]["eps"], "g")] + [
            summary([f(r) for r in rows], fmt) for _, f, fmt in COLUMNS[1:]
        ]
        print("| " + " | ".join(cells) + " |")


def plot(prefix: str, results: list[dict]):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plots: matplotlib is not installed (pip install -r requirements-plot.txt)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = (
        ("approxkl", "approxkl after one step: torch Adam / AdamTF"),
        ("dtheta", "mean |θ - θ0| after one step: torch Adam / AdamTF"),
    )
    for res in results:
        n, seeds = len(res["args"]["eps"]), res["seeds"]
        x = [statistics.median(s["sweep"][i]["d"] for s in seeds) for i in range(n)]
        at = [
            i for i, e in enumerate(res["args"]["eps"]) if abs(e - LHP_EPS) < 1e-12
        ]  # lm-human-preferences' eps
        for ax, (key, _) in zip(axes, keys):
            per_seed = [
                [ratio(s["sweep"][i][f"{key}_torch"], s["sweep"][i][f"{key}_tf"]) for s in seeds]
                for i in range(n)
            ]
            y = [statistics.median(r) for r in per_seed]
            line = ax.plot(x, y, "o-" if n > 1 else "*", ms=5 if n > 1 else 14, label=res["label"])[
                0
            ]
            lo, hi = [min(r) for r in per_seed], [max(r) for r in per_seed]
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
            ax.plot(
                [x[i] for i in at],
                [y[i] for i in at],
                "s",
                color=line.get_color(),
                ms=11,
                mfc="none",
            )
    for ax, (_, ylabel) in zip(axes, keys):
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="d = (eps / sqrt(1 - β2)) / median |g|",
            ylabel=ylabel,
        )
        ax.axhline(1, color="gray", lw=0.5), ax.axvline(1, color="gray", lw=0.5, ls=":")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].axhline(
        0.00237 / 0.00037,
        color="k",
        ls="--",
        lw=0.8,
        label="Huang et al. replay, GPT-2 124M (6.4x)",
    )
    axes[0].legend(fontsize=7, title="square: eps 1e-5", title_fontsize=7)
    axes[1].axhline(
        1 / math.sqrt(1 - BETA2), color="k", ls="--", lw=0.8, label="bound 1 / sqrt(1 - β2) = 31.6"
    )
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix + "_sweep.png", dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4))
    centers = np.linspace(*HIST[:2], HIST[2] + 1)[:-1] + (HIST[1] - HIST[0]) / HIST[2] / 2
    for res in results:
        h = np.mean([s["grad"]["hist"] for s in res["seeds"]], axis=0)
        ax.plot(centers, h / h.sum(), label=res["label"])
    ax.axvline(math.log10(LHP_EPS), color="k", ls=":", lw=0.8, label="eps 1e-5")
    ax.axvline(
        math.log10(LHP_EPS / math.sqrt(1 - BETA2)),
        color="k",
        ls="--",
        lw=0.8,
        label="TF's first-step eps",
    )
    ax.set(
        xlabel="log10 |g| (first PPO minibatch, every parameter)",
        ylabel="fraction of parameters",
        xlim=(-12, 0),
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix + "_grads.png", dpi=110)
    print(f"wrote {prefix}_sweep.png, {prefix}_grads.png")


def main(args: Args):
    for path in args.overlay:  # fail before the work, not after it
        if not os.path.isfile(path):
            raise gpt2.RunError(f"--overlay {path}: no such file (write it with --out)")
    overlays = [json.load(open(p)) for p in args.overlay]
    if not args.seeds:  # nothing to measure: print and plot earlier runs
        for res in overlays:
            print_tables(res)
        return plot(args.plot, overlays) if args.plot else None
    if args.model.startswith("random:") and args.reward == "verifier":
        print(
            "note: a random init rarely solves the task: if all rewards are equal, pass "
            "--reward random"
        )
    meta = data.load_meta(args.data)
    if args.reward == "verifier" and meta.get("task") not in ("arithmetic", "gsm8k"):
        raise gpt2.RunError(f"--data {args.data} has no verifier: pass --reward random")
    res = dict(
        label=args.label or f"{args.model} ({args.reward} reward)", args=asdict(args), seeds=[]
    )
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
    main(tyro.cli(Args))
