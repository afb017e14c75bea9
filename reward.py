"""Reward modelling: GPT-2 with a scalar head, trained on preference pairs (Bradley–Terry).

Ziegler et al. 2019 (lm-human-preferences), Stiennon et al. 2020 and InstructGPT start the
reward model from the SFT policy with a linear head read at the response's first stop token,
and train it with -log σ(r_chosen - r_rejected), averaged over the global batch of pairs (the
same step at any number of ranks), optionally with `--margin` and TRL's
`--center_rewards_coef`. As in Ziegler et al., the rewards are then normalised to mean 0, std 1
on the policy's samples at PPO's temperature (`--norm_temperature`; gain and bias in
config.json). Deviation: not also before training.

    python reward.py                          # from runs/sft/latest (python sft.py)
    torchrun --nproc_per_node=2 reward.py     # the same run, FSDP2 over 2 ranks
    python reward.py --resume --out_dir runs/reward/<run>  # continue from its last checkpoint

A run writes runs/reward/<time>-s<seed>/; runs/reward/latest links the last finished one.
"""

import atexit
import datetime
import fcntl
import glob
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from safetensors import safe_open
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import data
import gpt2


@dataclass
class Args:
    model: str = "runs/sft/latest"
    """the SFT model to start from; its samples set the normalisation"""
    data: str = "arithmetic"
    """`arithmetic` (built-in, offline) or a dir from `python -m data.prep`"""
    out_dir: str = ""
    """run directory; default a fresh runs/reward/<time>-s<seed>"""
    overwrite: bool = False
    """delete the run already in --out_dir and start afresh"""
    resume: bool = False
    """continue the run in --out_dir from its last complete checkpoint"""
    seed: int = 1
    """seed of the head init, the data order and the normalisation samples"""
    lr: float = 1e-3
    """peak learning rate (1e-3 suits the tiny model, ~5e-6 pretrained GPT-2)"""
    warmup_steps: int = 20
    """linear warmup steps, then cosine decay to lr * min_lr_ratio"""
    min_lr_ratio: float = 0.1
    """the final learning rate as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on biases and LayerNorms)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global gradient norm"""
    total_steps: int = 3000
    """optimizer steps (the tiny task's near misses are learnt late)"""
    batch_size: int = 64
    """preference pairs per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """pairs per forward pass on one rank (2x sequences)"""
    max_train_pairs: int = 0
    """train on the first N pref_train pairs only (0: all)"""
    margin: float = 0.0
    """constant margin m in -log σ(r_chosen - r_rejected - m)"""
    center_rewards_coef: float = 0.0
    """weight of (r_chosen + r_rejected)^2 in the loss (TRL: 0.01)"""
    norm_samples: int = 512
    """policy samples that set the normalisation (0: gain 1, bias 0)"""
    norm_temperature: float = 0.7
    """their sampling temperature: PPO's --temperature"""
    response_length: int = 16
    """their max new tokens: PPO's --response_length"""
    eval_every: int = 250
    """steps between evals and checkpoints"""
    eval_size: int = 500
    """held-out pref_test pairs for the eval loss and accuracy (0: no eval)"""
    log_every: int = 10
    """steps between status lines and metrics rows"""
    keep_checkpoints: int = 2
    """resumable checkpoints kept in out_dir/checkpoints (at least 1)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bf16 on CUDA, fp32 on CPU"""
    compile: bool = False
    """torch.compile the model"""
    activation_checkpointing: bool = False
    """recompute block activations in backward to save memory"""
    packing: bool = True
    """train on the real tokens only, packed into one row: no compute on padding"""
    wandb: bool = False
    """also log to Weights & Biases (imported only when set)"""


# Flags that live in a sibling script (parse_args): none.
MOVED = {}

# ----------------------------------------------------------------------------------------------
# The Bradley–Terry loss on pairs, and lm-human-preferences' normalisation


def preference_loss(r_chosen, r_rejected, margin=0.0, center_coef=0.0):
    """Per-pair loss (B,). Bradley–Terry: -log σ(r_chosen - r_rejected), the reward model
    loss of Stiennon et al. 2020 (eq. 1) and Ouyang et al. 2022 (eq. 1); two variants."""
    logits = r_chosen - r_rejected
    # Llama 2 (Touvron et al. 2023, eq. 2; there m depends on the rating): asks for a gap
    # wider than m between the two rewards.
    if margin:
        logits = logits - margin
    loss = -F.logsigmoid(logits)
    # TRL's center_rewards_coefficient (Eisenstein et al. 2023): pulls the rewards'
    # mean to 0, which the loss alone leaves free (it sees only differences).
    if center_coef:
        loss = loss + center_coef * (r_chosen + r_rejected) ** 2
    return loss


def pair_rewards(model, query, chosen, rejected, pad_token_id, eos_token_id, ctx):
    """Rewards (B,), (B,) of the chosen and rejected responses to queries (B, Tq), in one
    forward pass."""
    pad = pad_token_id
    eos = eos_token_id
    # Both responses in one batch: the shorter one padded to the longer one's width.
    width = max(chosen.size(1), rejected.size(1))
    chosen = F.pad(chosen, (0, width - chosen.size(1)), value=pad)
    rejected = F.pad(rejected, (0, width - rejected.size(1)), value=pad)
    response = torch.cat([chosen, rejected])
    query, response = gpt2.trim_padding(query.repeat(2, 1), response, pad, eos)  # (2B, T)
    with ctx:
        rewards = gpt2.get_reward(model, query, response, pad, eos)
    return rewards.float().chunk(2)


def normalization(scores):
    """(gain, bias) that give scores (N,) mean 0 and std 1."""
    mean, std = scores.double().mean(), scores.double().std(correction=0)
    if std > 1e-8:
        return 1.0 / std.item(), -(mean / std).item()
    raise RunError(f"the norm samples all score {mean:.4g}: train longer or pass --norm_samples 0")


def lr_at(step, args):
    """Linear warmup, then cosine to lr * min_lr_ratio."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    decay_steps = max(1, args.total_steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / decay_steps)
    # From 1 down to 0.
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


@torch.no_grad()
def normalize(model, queries, args, meta, bf16, ctx):
    """Set the model's gain and bias: mean 0, std 1 over its rewards of the --model policy's
    answers to --norm_samples queries (N, Tq) at --norm_temperature. The ranks share one
    seeded noise tensor."""
    rank, world_size = 0, 1
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    n = args.norm_samples
    local = n // world_size
    length = args.response_length
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    device = next(model.parameters()).device
    # A random stream of its own: the queries, and the sampling noise of all ranks.
    rng = np.random.default_rng([args.seed, *b"norm"])
    queries = queries[rng.choice(len(queries), n, replace=n > len(queries))]  # (N, Tq)
    noise = torch.from_numpy(rng.random((n, length), dtype=np.float32)).to(device)
    # With `--model tiny`, the init the reward model's backbone had.
    torch.manual_seed(args.seed)
    frozen_shard = partial(shard, device=device, bf16=bf16, frozen=True)
    policy = gpt2.load(args.model, meta, shard=frozen_shard)
    # Rank r fills its rows of the raw and normalised scores; all_reduce joins them.
    raw = torch.zeros(n, dtype=torch.float64, device=device)
    normed = torch.zeros(n, dtype=torch.float64, device=device)
    rollouts = []
    model.eval()
    temperature = args.norm_temperature
    starts = range(0, local, args.micro_batch_size)
    for i in data.progress(starts, "normalisation", show=is_master()):
        first = rank * local + i
        end = rank * local + min(i + args.micro_batch_size, local)
        rows = slice(first, end)
        query = torch.from_numpy(queries[rows]).to(device)
        with ctx:
            rollout = gpt2.generate(policy, query, pad, length, eos, temperature, noise[rows])
            rewards = gpt2.get_reward(model, rollout.query, rollout.response, pad, eos)
        raw[rows] = rewards.double()
        rollouts.append((rows, rollout.query, rollout.response))
    # The gain and bias from every rank's raw scores.
    model.reward_gain, model.reward_bias = normalization(all_reduce(raw))
    # Scored again: a check that the gain and bias apply.
    for rows, query, response in rollouts:
        with ctx:
            rewards = gpt2.get_reward(model, query, response, pad, eos)
        normed[rows] = rewards.double()
    all_reduce(normed)
    model.train()
    return {
        "norm/raw_mean": raw.mean().item(),
        "norm/raw_std": raw.std(correction=0).item(),
        "norm/gain": model.reward_gain,
        "norm/bias": model.reward_bias,
        "norm/mean": normed.mean().item(),
        "norm/std": normed.std(correction=0).item(),
    }


def all_reduce(x):
    """Sum over ranks, in place: the global batch's sums (a no-op in one process)."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def all_reduce_dict(sums):
    """{name: scalar tensor} summed over ranks in one collective -> {name: float}."""
    names = list(sums)
    total = all_reduce(torch.stack([sums[name].double() for name in names]))
    return dict(zip(names, total.tolist()))


def shard(model, device, bf16, frozen=False):
    """The model on its device; under torchrun, FSDP2: each block (bf16 params), then the root
    (tied wte and lm_head, fp32 for the fp32 head). Frozen (reference, reward): no gradients."""
    if frozen:
        model.eval().requires_grad_(False)
    if bf16 and frozen:
        # Stored as it is computed: FSDP2 casts whole blocks, autocast only the matmuls.
        for m in model.transformer.h.modules():
            if dist.is_initialized() or isinstance(m, gpt2.Conv1D):
                m.to(torch.bfloat16)
    if not dist.is_initialized():
        return model.to(device)
    # The policies shard over the default mesh: every rank.
    fp32 = MixedPrecisionPolicy(torch.float32, torch.float32)
    mp = fp32
    if bf16:
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp)
    root_mp = fp32 if model.fp32_head else mp
    return fully_shard(model, mp_policy=root_mp)


def check_args(args):
    """Every numeric flag's range, before any heavy work: a bad one stops the run with one
    line that names the flag and the fix, not a traceback (or a non-finite loss) later."""
    sizes = [
        "total_steps",
        "batch_size",
        "micro_batch_size",
        "response_length",
        "eval_every",
        "log_every",
    ]
    for name in sizes:
        value = getattr(args, name)
        fix = f"pass e.g. --{name} {getattr(Args, name)}"
        if value < 1:
            raise RunError(f"--{name} {value}: must be 1 or more; {fix}")
    # 0 means something for these: no warmup, all pairs, no normalisation, no eval,
    # the newest checkpoint only.
    counts = [
        "seed",
        "warmup_steps",
        "max_train_pairs",
        "norm_samples",
        "eval_size",
        "keep_checkpoints",
    ]
    for name in counts:
        value = getattr(args, name)
        fix = f"pass e.g. --{name} {getattr(Args, name)}"
        if value < 0:
            raise RunError(f"--{name} {value}: must be 0 or more; {fix}")
    # nan compares false with everything, so it would pass the range checks below.
    floats = [
        "lr",
        "min_lr_ratio",
        "weight_decay",
        "max_grad_norm",
        "margin",
        "center_rewards_coef",
        "norm_temperature",
    ]
    for name in floats:
        value = getattr(args, name)
        fix = f"pass e.g. --{name} {getattr(Args, name)}"
        if not math.isfinite(value):
            raise RunError(f"--{name} {value}: not a finite number; {fix}")
    if args.lr < 0:
        raise RunError(f"--lr {args.lr}: must be 0 or more; pass e.g. --lr {Args.lr}")
    if not 0 <= args.min_lr_ratio <= 1:
        ratio = args.min_lr_ratio
        raise RunError(f"--min_lr_ratio {ratio}: a fraction of --lr; pass 0 to 1, e.g. 0.1")
    if args.weight_decay < 0:
        decay = args.weight_decay
        raise RunError(f"--weight_decay {decay}: must be 0 or more; pass e.g. 0")
    if args.max_grad_norm <= 0:
        norm = args.max_grad_norm
        raise RunError(f"--max_grad_norm {norm}: clips every update to 0; pass e.g. 1")
    if args.center_rewards_coef < 0:
        coef = args.center_rewards_coef
        raise RunError(f"--center_rewards_coef {coef}: must be 0 or more; pass e.g. 0.01 (TRL's)")
    if args.norm_temperature <= 0:
        temp = args.norm_temperature
        raise RunError(f"--norm_temperature {temp}: must be more than 0; pass e.g. 0.7 (PPO's)")


def main(args: Args):
    # 1. flags, sizes, distributed setup, seeds
    check_args(args)
    if args.model == "runs/sft/latest" and not os.path.isdir(args.model):
        raise RunError("no SFT model at runs/sft/latest: run `python sft.py`, or pass --model")
    rank, world_size, device = setup_distributed()
    local_batch_size = data.exact_div(args.batch_size, world_size, "--batch_size or the ranks")
    micro_batch_size = min(args.micro_batch_size, local_batch_size)
    grad_accum = data.exact_div(local_batch_size, micro_batch_size, "--micro_batch_size")
    data.exact_div(args.norm_samples, world_size, "--norm_samples or the ranks")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    # With bf16 off, autocast is a no-op.
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    # The score head's init (and a `tiny` backbone's).
    torch.manual_seed(args.seed)

    # 2. data
    meta = data.load_meta(args.data)
    train = data.load_split(args.data, "pref_train")
    test = data.load_split(args.data, "pref_test")
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    n_train = len(train["query"])
    if args.max_train_pairs:
        n_train = min(args.max_train_pairs, n_train)
    if n_train < args.batch_size:
        raise RunError(f"{n_train} training pairs (--max_train_pairs) are fewer than --batch_size")
    # The length of each pair's two responses, for tokens/s.
    train_lengths = data.response_lengths(train, n_train, eos).to(device)  # (n_train, 2)

    # 3. the reward model (SFT backbone, fresh head), then the run directory, optimizer
    model_shard = partial(shard, device=device, bf16=bf16)
    model = gpt2.load(args.model, meta, head="new", shard=model_shard)
    data.check_context(train, model.config.block_size, args.response_length)
    # After the model: a bad --model leaves no run directory.
    args.out_dir = start_run(args, "reward")
    model.activation_checkpointing = args.activation_checkpointing
    model.packing = args.packing
    # Weight decay on matrices only, not on biases and LayerNorms.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay},
    ]
    optimizer = torch.optim.AdamW(
        groups,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0,
        fused=True,
    )
    forward_model = torch.compile(model) if args.compile else model
    # The gain and bias travel in the model's config.json.
    models = {"model": (model, optimizer)}
    start = 0
    if args.resume:
        start = load_checkpoint(args.out_dir, models)["step"]

    def pair_losses(model, split, idx):
        """Per-pair losses (B,) and rewards (B,), (B,) of the pairs `idx` of a split."""
        query, chosen, rejected = data.split_tensors(split, idx, device)
        r_chosen, r_rejected = pair_rewards(model, query, chosen, rejected, pad, eos, ctx)
        losses = preference_loss(
            r_chosen, r_rejected, margin=args.margin, center_coef=args.center_rewards_coef
        )
        return losses, r_chosen, r_rejected

    def evaluate():
        """Pair loss and accuracy (raw scores) of the first --eval_size test pairs."""
        # Equal shares: rank r takes every world_size-th pair.
        n = min(args.eval_size, len(test["query"])) // world_size * world_size
        idx = np.arange(rank, n, world_size)
        sums = {
            "loss": torch.zeros((), device=device),
            "correct": torch.zeros((), device=device),
        }
        model.eval()
        with torch.no_grad():
            starts = range(0, len(idx), micro_batch_size)
            for i in data.progress(starts, "eval", show=is_master()):
                mb_idx = idx[i : i + micro_batch_size]
                losses, r_chosen, r_rejected = pair_losses(model, test, mb_idx)
                sums["loss"] += losses.sum()
                sums["correct"] += (r_chosen > r_rejected).sum()
        model.train()
        totals = all_reduce_dict(sums)
        return {
            "eval/loss": totals["loss"] / max(n, 1),
            "eval/accuracy": totals["correct"] / max(n, 1),
        }

    # 4. training loop: rank r takes its slice of each step's global batch
    t0, tokens = time.time(), torch.zeros((), device=device)
    show = (
        "train/loss",
        "train/accuracy",
        "eval/accuracy",
        "norm/gain",
        "perf/tokens_per_sec",
    )
    for step in range(start, args.total_steps):
        batch_idx = data.batch_indices(args.seed, step, n_train, args.batch_size)
        local_idx = batch_idx[rank * local_batch_size :][:local_batch_size]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        # 4a. the loss over micro-batches; FSDP2 reduces the gradients on the last one
        names = ["loss", "correct", "chosen", "rejected"]
        sums = {name: torch.zeros((), device=device) for name in names}
        for micro, mb_idx in enumerate(np.split(local_idx, grad_accum)):
            if dist.is_initialized():
                model.set_requires_gradient_sync(micro == grad_accum - 1)
            losses, r_chosen, r_rejected = pair_losses(forward_model, train, mb_idx)
            loss_sum = losses.sum()
            # FSDP2 averages gradients over ranks: times world_size makes the global mean.
            (loss_sum * world_size / args.batch_size).backward()
            with torch.no_grad():
                sums["loss"] += loss_sum
                sums["correct"] += (r_chosen > r_rejected).sum()
                sums["chosen"] += r_chosen.sum()
                sums["rejected"] += r_rejected.sum()
        # Tokens read: both responses, and the query once with each.
        query_tokens = int((train["query"][local_idx] != pad).sum())
        tokens += train_lengths[local_idx].sum() + 2 * query_tokens
        # 4b. clip (the returned norm is the global one, before clipping) and step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        # Under FSDP2 the norm is a DTensor: its full value.
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        done = step + 1
        totals = all_reduce_dict(sums)
        loss = totals["loss"] / args.batch_size
        if not math.isfinite(loss) or not torch.isfinite(grad_norm):
            raise RunError(f"non-finite loss or grad norm at step {done}: lower --lr (or --resume)")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # 4c. log and evaluate (raw scores); after the last step, normalise the rewards
        # on the policy's samples
        eval_now = done % args.eval_every == 0 or done == args.total_steps
        if done % args.log_every == 0 or step == start or eval_now:
            chosen = totals["chosen"] / args.batch_size
            rejected = totals["rejected"] / args.batch_size
            elapsed = time.time() - t0
            metrics = {
                "train/loss": loss,
                "train/accuracy": totals["correct"] / args.batch_size,
                "rewards/chosen": chosen,
                "rewards/rejected": rejected,
                "rewards/margins": chosen - rejected,
                "train/grad_norm": grad_norm.item(),
                "train/lr": lr_at(step, args),
                "perf/tokens_per_sec": all_reduce(tokens).item() / elapsed,
            }
            if eval_now and args.eval_size > 0:
                metrics |= evaluate()
            if done == args.total_steps and args.norm_samples > 0:
                pool = train["query"][:n_train]
                metrics |= normalize(model, pool, args, meta, bf16, ctx)
            log_metrics(args, done, metrics, show)
            t0, tokens = time.time(), torch.zeros((), device=device)
        checkpoint(args, done, models, device, due=eval_now)

    # 5. the reward model, where ppo.py and grpo.py look (gain and bias in config.json)
    gpt2.save(model, args.out_dir)
    finish_run(args, "reward")


# ----------------------------------------------------------------------------------------------
# ---- plumbing: identical in every script (tests/test_copies.py)
# torchrun, the run directory, resumable checkpoints, metrics: not the algorithm. What a run does
# to the process that calls main() (a SIGTERM handler, the allocator's settings, the run dir and
# its `latest` link; the process's end under torchrun): docs/faults.md.
RunError = gpt2.RunError
# A cluster's preemption sends SIGTERM: every rank then saves at the same step
# (checkpoint).
SIGTERM = []
# Seconds the other ranks give rank 0 to print a RunError that every rank met.
RANK_EXIT_DELAY = 5


def is_master():
    """Rank 0, or the only process: the one that writes the run dir and prints."""
    return int(os.environ.get("RANK", "0")) == 0


def setup_distributed():
    """(rank, world_size, device); under torchrun, a process group: nccl on CUDA, gloo on CPU.
    The process keeps freed buffers (gpt2.keep_freed_memory) and takes SIGTERM as a request to
    save a checkpoint and stop."""
    gpt2.keep_freed_memory()
    SIGTERM.clear()
    signal.signal(signal.SIGTERM, lambda *_: SIGTERM.append(True))
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if "RANK" not in os.environ:
        return rank, world_size, device
    # Rank 0 may spend long on a save while the others wait at a barrier: a 2-hour
    # timeout.
    timeout = datetime.timedelta(hours=2)
    if cuda:
        # nccl bound to this GPU, or barrier() warns that it guesses one.
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout)
    # A run that stops on an exception still ends its process group.
    atexit.register(end_process_group)
    return rank, world_size, device


def end_process_group():
    """Destroy the process group, if one is left (at exit, after a run that stopped on an
    exception)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def start_run(args, algo):
    """Rank 0 claims the run dir: a fresh one, or --out_dir with --resume or --overwrite."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or f"runs/{algo}/{stamp}-s{args.seed}"
    claim = [None, None]
    if is_master():
        claim = [claim_run_dir(out_dir, args, algo), out_dir]
    # Every rank takes rank 0's name: their clocks may differ.
    if dist.is_initialized():
        dist.broadcast_object_list(claim, src=0)
    problem, out_dir = claim
    if problem:
        raise RunError(problem)
    if is_master() and args.wandb:
        # Imported only when asked for.
        wandb = __import__("wandb")
        name = os.path.basename(out_dir)
        wandb.init(config=asdict(args), dir=out_dir, name=name)
    return out_dir


def claim_run_dir(out_dir, args, algo):
    """None once this process holds out_dir (an flock, until it exits), or what stops it."""
    # No --out_dir, or a typo: stop before a dir is made.
    if args.resume and not os.path.isdir(args.out_dir):
        return f"--resume needs --out_dir DIR, a run's dir to continue: '{args.out_dir}' is not one"
    old_args = f"{out_dir}/args.json"
    if os.path.isfile(old_args) and not (args.resume or args.overwrite):
        return f"'{out_dir}' holds a run: pass --resume, --overwrite or another --out_dir"
    if args.resume and os.path.isfile(old_args):
        # Runs of older versions did not record their script.
        script = json.load(open(old_args)).get("script", f"{algo}.py")
        if script != f"{algo}.py":
            return f"'{out_dir}' holds a run of {script}: resume it with {script}"
    try:
        os.makedirs(out_dir, exist_ok=True)
        # NFS locks need write access. The descriptor is never closed: the OS releases
        # the lock when the process ends, even after a kill.
        lock = os.open(f"{out_dir}/.lock", os.O_CREAT | os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        why = "another run is writing to it"
        return f"cannot write to '{out_dir}' ({why}): pass another --out_dir"
    except OSError as e:
        return f"cannot write to '{out_dir}' ({e.strerror}): pass another --out_dir"
    if not args.resume:
        # A fresh run, or --overwrite: nothing of the old run is left. Its final model
        # goes too, so that a later stage cannot load it under the new run's args.
        shutil.rmtree(f"{out_dir}/checkpoints", ignore_errors=True)
        for name in ("model.safetensors", "config.json"):
            if os.path.isfile(f"{out_dir}/{name}"):
                os.remove(f"{out_dir}/{name}")
    open(f"{out_dir}/metrics.jsonl", "a" if args.resume else "w").close()
    with open(old_args, "w") as f:
        record = asdict(args) | {"out_dir": out_dir, "script": f"{algo}.py"}
        json.dump(record, f, indent=2)
    print(f"run dir {out_dir} (continue it with --resume --out_dir {out_dir})", flush=True)


def checkpoint(args, step, models, device, due, extra=None):
    """Every rank, every step: save checkpoints/step_N when due, or after a SIGTERM and stop."""
    # Any rank's SIGTERM stops every rank at this step.
    flags = all_reduce(torch.tensor([len(SIGTERM)], device=device))
    stop = flags.item() > 0
    if not (due or stop):
        return
    root = f"{args.out_dir}/checkpoints"
    final = f"{root}/step_{step:08d}"
    # Each model in the HF layout, with its optimizer.pt if it has an optimizer.
    for name, (model, optimizer) in models.items():
        gpt2.save(model, f"{root}/.tmp/{name}", optimizer)
    if is_master():
        torch.save(dict(step=step, **(extra or {})), f"{root}/.tmp/state.pt")
        # A save killed midway leaves .tmp, never a partial step_N. After a resume, a
        # step can be saved again.
        shutil.rmtree(final, ignore_errors=True)
        os.replace(f"{root}/.tmp", final)
        keep = max(1, args.keep_checkpoints)
        for old in sorted(glob.glob(f"{root}/step_*"))[:-keep]:
            shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()
    if stop:
        raise RunError(f"SIGTERM: saved step {step}; resume with --resume --out_dir {args.out_dir}")


def newest_complete_checkpoint(out_dir, models):
    """Rank 0: the newest checkpoint whose files open, by their headers, or None."""
    for path in sorted(glob.glob(f"{out_dir}/checkpoints/step_*"), reverse=True):
        # Headers and zip directories only: a truncated file fails there, in one of many
        # ways.
        try:
            for name, (model, optimizer) in models.items():
                safe_open(f"{path}/{name}/model.safetensors", "pt")
                # A frozen model in the run's state (a refreshed reference) has no optimizer.
                if optimizer:
                    torch.load(f"{path}/{name}/optimizer.pt", weights_only=True, mmap=True)
            torch.load(f"{path}/state.pt", weights_only=True)
            return path
        except Exception as e:
            why = e.__class__.__name__
            print(f"warning: checkpoint {path} is damaged ({why})", flush=True)
    return None


def load_checkpoint(out_dir, models):
    """--resume: rank 0 picks the checkpoint, and every rank loads it, at any world size."""
    box = [newest_complete_checkpoint(out_dir, models) if is_master() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    path = box[0]
    if path is None:
        raise RunError(f"--resume: no complete checkpoint in {out_dir}/checkpoints: drop --resume")
    state = torch.load(f"{path}/state.pt", weights_only=True)
    for name, (model, optimizer) in models.items():
        gpt2.load_weights(model, f"{path}/{name}", optimizer)
    if is_master():
        print(f"resumed from {path} at step {state['step']}", flush=True)
        # The rows a killed run logged after this checkpoint will be logged again: cut
        # them, in one call, so that a kill leaves either every row or these. The rows
        # are in step order.
        rows = open(f"{out_dir}/metrics.jsonl", "rb").readlines()
        kept = [row for row in rows if json.loads(row)["step"] <= state["step"]]
        os.truncate(f"{out_dir}/metrics.jsonl", sum(len(row) for row in kept))
    return state


def log_metrics(args, step, metrics, show):
    """Rank 0: one JSON row in metrics.jsonl (every metric), one status line (`show`), and
    with --wandb, the row to Weights & Biases."""
    if not is_master():
        return
    with open(f"{args.out_dir}/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    status = " | ".join(f"{k} {metrics[k]:.4g}" for k in show if k in metrics)
    print(f"step {step:5d} | {status}", flush=True)
    if args.wandb:
        sys.modules["wandb"].log(metrics, step=step)


def finish_run(args, algo):
    """After the final save: runs/<algo>/latest, where the next stage looks, links this run;
    the process group ends, and main() returns on every rank."""
    if is_master() and os.path.dirname(args.out_dir) == f"runs/{algo}":
        # A new link under this process's own name, renamed over the old one: no reader
        # ever finds no link, and no other run shares the temporary name.
        link = f"runs/{algo}/.latest.{os.getpid()}"
        os.symlink(os.path.basename(args.out_dir), link)
        os.replace(link, f"runs/{algo}/latest")
    if is_master() and args.wandb:
        sys.modules["wandb"].finish()
    if dist.is_initialized():
        # Every rank is done with its collectives before any tears down its connections.
        dist.barrier()
    end_process_group()


def parse_args(argv):
    """Args from the command line (tyro). A flag that lives in a sibling script (MOVED) is one
    line naming that script."""
    for arg in argv:
        flag = arg.split("=")[0].removeprefix("--").replace("-", "_")
        # a boolean's --no_ form is its flag too
        flag = flag if flag in MOVED else flag.removeprefix("no_")
        if arg.startswith("--") and flag in MOVED:
            sibling = MOVED[flag]
            raise RunError(f"--{flag} lives in {sibling}: run `python {sibling} --{flag} ...`")
    return tyro.cli(Args, args=argv, use_underscores=True)


def exit_on(error):
    """The end of a run stopped by a RunError: its one line on rank 0 and exit status 1 on
    every rank. The other ranks exit a moment later: torchrun stops every rank when one fails,
    and rank 0, a moment behind on a loaded machine, would be stopped before its line."""
    if is_master():
        sys.exit(f"error: {error}")
    time.sleep(RANK_EXIT_DELAY)
    sys.exit(1)


if __name__ == "__main__":
    try:
        main(parse_args(sys.argv[1:]))
    except RunError as e:
        exit_on(e)
    # Under torchrun, gloo's threads can abort the interpreter's teardown after main() has
    # returned (docs/faults.md): the process ends here instead.
    if "RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
