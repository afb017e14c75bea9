"""PPO from human feedback with the field's later options as flags: ppo.py, plus a branch or a
named call per option.

ppo.py is RLHF PPO as lm-human-preferences runs it (Ziegler et al. 2019; Stiennon et al. 2020;
Huang et al. 2023's details); this file is the same algorithm, line for line where it can be,
with the options the field has added since: at its defaults it writes the metrics ppo.py writes,
bit for bit (tests/test_ppo.py):
- --dual_clip (Ye et al. 2020, arXiv 1912.09729): the loss of A < 0 capped;
- an entropy bonus --entropy_coef, adaptive with --entropy_target (Skywork-OR1, arXiv
  2505.22312);
- --sampler_correction: the policy loss weighed by pi_old / pi_sampler, truncated (TIS) or
  masked (MIS), and the sampler-trainer gap measured (mismatch/*);
- --top_k and --top_p: the sampler's and the loss's distribution (trl#6789).

    python ppo_variants.py --dual_clip 3 --entropy_target 0.3 --entropy_coef 0.01
    python ppo_variants.py --sampler_correction token_truncate --sampler_cap 2  # TIS
    torchrun --nproc_per_node=2 ppo_variants.py --top_p 0.9
"""

import atexit
import datetime
import fcntl
import functools
import glob
import json
import math
import os
import shutil
import signal
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import tyro
from safetensors import safe_open
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import data
import gpt2

# --sampler_correction's choices: off, or the gap measured (none) and corrected (TIS truncates
# pi_old / pi_sampler, MIS masks it); auto: none in fp32, token_truncate in bf16
Correction = Literal[
    "off", "auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]


@dataclass
class Args:
    model: str = "runs/sft/latest"  # policy to start from; a frozen copy is the reference
    reward_model: str = "runs/reward/latest"  # from reward.py; a copy is the value model
    data: str = "arithmetic"  # `arithmetic` (built in) or a `python -m data.prep` dir
    out_dir: str = ""  # run directory; default a fresh runs/ppo/<time>-s<seed>
    overwrite: bool = False  # delete the run already in --out_dir and start afresh
    resume: bool = False  # continue the run in --out_dir from its last checkpoint
    seed: int = 1  # seed of the prompts, the samples and the shuffles (same on every rank)
    lr: float = 1e-5  # policy and value learning rate (lm-human-preferences: 5e-6)
    eps: float = 1e-5  # Adam epsilon (lm-human-preferences' 1e-5)
    optimizer: Literal["adam_tf", "adam"] = "adam_tf"  # TensorFlow's Adam or torch's
    anneal_lr: bool = True  # decay the learning rate linearly to 0 over the run
    total_episodes: int = 16384  # prompts to train on: total_episodes / batch_size updates
    batch_size: int = 128  # prompts per rollout and PPO update, over all ranks
    num_minibatches: int = 2  # minibatches (optimizer steps) per PPO epoch
    num_ppo_epochs: int = 4  # passes over each rollout batch
    micro_batch_size: int = 64  # sequences per forward pass on one rank
    response_length: int = 16  # max new tokens per response
    temperature: float = 0.7  # sampling temperature; training log-probs use it too
    top_k: int = 0  # sample among the k likeliest tokens; training log-probs too (0: off)
    top_p: float = 1.0  # nucleus: the fewest likeliest tokens of this mass; as top_k (1: off)
    kl_coef: float = 0.2  # initial coefficient of the per-token KL penalty
    adaptive_kl: bool = True  # adapt kl_coef towards --target_kl (Ziegler et al. 2019)
    target_kl: float = 0.3  # target KL to the reference, in nats per response
    kl_horizon: int = 1000  # the adaptive controller's horizon in episodes
    penalty_reward_value: float | None = -1.0  # score of a response with no stop token
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE lambda
    cliprange: float = 0.2  # PPO policy ratio clip
    sampler_correction: Correction = "off"  # weigh by π_old/π_sampler, or measure the gap
    sampler_cap: float = 2.0  # C: the weight truncated at C, or masked outside [1/C, C]
    dual_clip: float | None = None  # cap the loss at -this x A where A < 0 (verl: 3.0)
    cliprange_value: float = 0.2  # value prediction clip around the rollout's values
    vf_coef: float = 0.1  # weight of the value loss
    entropy_coef: float = 0.0  # an entropy bonus: the loss minus this x the mean entropy
    entropy_target: float | None = None  # adapt --entropy_coef toward it (Skywork-OR1)
    entropy_coef_delta: float = 0.005  # --entropy_target's coefficient step per update
    whiten_rewards: bool = True  # whiten (scale only) per-token rewards before GAE
    value_head: Literal["zero", "reward"] = "zero"  # zeros, or the reward model's head
    eval_every: int = 16  # updates between evals and checkpoints
    eval_size: int = 500  # held-out prompts for the greedy eval (0: no eval)
    log_every: int = 4  # updates between status lines and metrics rows
    keep_checkpoints: int = 2  # resumable checkpoints kept in out_dir/checkpoints
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA, else fp32
    compile: bool = False  # torch.compile the training forwards of policy and value
    activation_checkpointing: bool = False  # recompute activations in backward: less memory
    packing: bool = True  # the real tokens only, packed into one row: no compute on padding
    wandb: bool = False  # also log to Weights & Biases (imported only when set)


# The status line's few numbers; metrics.jsonl has every one.
SHOW = (
    "objective/scores",
    "objective/kl",
    "policy/approxkl_avg",
    "eval/accuracy",
    "perf/episodes_per_sec",
)
# Flags that live in a sibling script (parse_args): none, this file has every one of ppo.py's.
MOVED = {}


# ----------------------------------------------------------------------------------------------
# PPO: the math as pure tensor functions (tests/test_ppo.py checks them)


def compute_gae(rewards, values, mask, gamma, lam):
    """GAE (Schulman et al. 2016) as the reversed loop of lm-human-preferences and
    CleanRL: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1},
    with V = 0 after the last real token; the returns are A_t + V_t.
    rewards, values, mask (B, T) -> advantages, returns (B, T), 0 after the last token."""
    values = values * mask
    response_length = rewards.size(1)
    lastgaelam = torch.zeros_like(rewards[:, 0])
    advantages_reversed = []
    for t in reversed(range(response_length)):
        if t + 1 < response_length:
            next_values = values[:, t + 1]
        else:
            next_values = 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        # Padding adds nothing: A_t of the last real token is its own delta.
        delta = delta * mask[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], 1) * mask
    returns = advantages + values
    return advantages, returns


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the entries where mask is True, summed over ranks; 0
    elsewhere. shift_mean=False adds the mean back (lm-human-preferences' reward
    whitening)."""
    m = mask.double()
    x_sum = (x * m).sum()
    x_squared_sum = (x.double() ** 2 * m).sum()
    sums = all_reduce(torch.stack([x_sum, x_squared_sum, m.sum()]))
    count = sums[2]
    mean = sums[0] / count
    # The population variance, as tf.nn.moments.
    var = sums[1] / count - mean**2
    whitened = (x.double() - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * m).to(x.dtype)


def policy_loss(new_logprobs, logprobs, advantages, cliprange, dual_clip=None):
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7) as a loss, all
    (B, T). Returns the losses, the ratios and where the clipped term was the larger
    loss (clipfrac)."""
    ratio = torch.exp(new_logprobs - logprobs)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = torch.max(pg_losses, pg_losses_clipped)
    if dual_clip is not None:
        # Dual-clip (Ye et al. 2020, arXiv 1912.09729): where A < 0 the loss grows without
        # bound with the ratio; cap it at -dual_clip A.
        capped = loss.minimum(-dual_clip * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    clipped = pg_losses_clipped > pg_losses
    return loss, ratio, clipped


def value_loss(vpred, values, returns, cliprange_value):
    """Clipped value loss per token (lm-human-preferences): the prediction moves at
    most cliprange_value from the rollout's value; the larger error counts.
    -> losses, where clipped."""
    change = torch.clamp(vpred - values, -cliprange_value, cliprange_value)
    vpred_clipped = values + change
    vf_losses = (vpred - returns) ** 2
    vf_losses_clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * torch.max(vf_losses, vf_losses_clipped)
    clipped = vf_losses_clipped > vf_losses
    return loss, clipped


def per_token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef):
    """Ziegler et al. 2019 eq. 2: r_t = -kl_coef (log π(y_t) - log π_ref(y_t)), plus
    the score (B,) at the last real token. -> rewards, their KL part
    (non_score_reward), KL; all (B, T), 0 after the last token."""
    kl = (logprobs - ref_logprobs) * mask
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rows = torch.arange(len(scores), device=scores.device)
    last = mask.sum(1) - 1
    rewards[rows, last] += scores
    return rewards, non_score_reward, kl


def adaptive_entropy_coef(coef, entropy, target, delta):
    """Skywork-OR1 (arXiv 2505.22312) adaptive entropy control, after a step of token mean
    entropy `entropy`: the coefficient rises by delta below the target, falls by delta above
    it, and stays at least 0. Also the coefficient the next step applies: none while the
    entropy is above the target (the paper's indicator, TRL's gate)."""
    if entropy < target:
        coef = coef + delta
    else:
        coef = coef - delta
    coef = max(0.0, coef)
    applied = coef if entropy <= target else 0.0
    return coef, applied


def sampler_correction(old_logprobs, sampler_logprobs, mask, mode, cap):
    """The weight (B, T) of each token's policy loss for sampling from pi_sampler (generate's
    log-probs) where the loss's pi_old is the trainer's forward: w = pi_old / pi_sampler,
    truncated at cap or masked outside [1/cap, cap], per token or per response. Also the
    ratio (B, T) at that level, for the metrics. The same bits on both sides give w = 1 exactly."""
    log_ratio = torch.where(mask.bool(), old_logprobs - sampler_logprobs, 0.0)
    if mode.startswith("sequence"):
        # a response's ratio is the product of its tokens' (TRL's sequence modes)
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    if mode == "none":
        # no correction: the gap is only measured
        weights = torch.ones_like(ratio)
    elif mode in ("token_truncate", "sequence_truncate"):
        # TIS (Yao et al. 2025): min(w, C), which bounds the variance and keeps every token
        weights = ratio.clamp(max=cap)
    elif mode in ("token_mask", "sequence_mask"):
        # MIS / IcePop (Ring-1T, arXiv 2510.18855): out of the loss where w leaves [1/C, C]
        inside = (ratio >= 1.0 / cap) & (ratio <= cap)
        weights = ratio * inside
    else:
        raise ValueError(f"unknown sampler correction {mode!r}")
    return weights, ratio


def sampler_gap(old_logprobs, sampler_logprobs, ratio, mask, cap):
    """The sampler-trainer gap over the mask (B, T), for the metrics: sums of k3 of
    KL(pi_sampler || pi_old) per token, of the tokens whose ratio (B, T) at the correction's
    level leaves [1/cap, cap], and of the tokens; and the largest ratio and inverse ratio (2,)."""
    real = mask.bool()
    log_ratio = torch.where(real, old_logprobs - sampler_logprobs, 0.0)
    # w - 1 - log w, w = pi_old / pi_sampler: never negative
    k3 = torch.expm1(log_ratio) - log_ratio
    outside = (ratio < 1.0 / cap) | (ratio > cap)
    sums = {
        "k3": (k3.double() * real).sum(),
        "outside": (outside & real).double().sum(),
        "tokens": real.double().sum(),
    }
    ratio_max = ratio.masked_fill(~real, 0).max()
    inverse_max = (1 / ratio).masked_fill(~real, 0).max()
    return sums, torch.stack([ratio_max, inverse_max])


def correction_mode(mode, bf16):
    """--sampler_correction's mode for this run: auto is none in fp32, where sampler and trainer
    give the same log-probs, and TIS in bf16."""
    if mode == "auto":
        return "token_truncate" if bf16 else "none"
    return mode


def correction_weights(old_logprobs, sampler_logprobs, mask, mode, cap):
    """The sampler-trainer correction's weights (B, T) of the update's batch; None with the
    correction off."""
    if mode == "off":
        return None
    return sampler_correction(old_logprobs, sampler_logprobs, mask, mode, cap)[0]


def gap_metrics(old_logprobs, sampler_logprobs, mask, mode, cap):
    """The sampler-trainer gap of the step's batch over the loss's tokens mask (B, T), for the
    metrics: pi_old (the trainer's) against pi_sampler (generate's) per token, at the
    correction's level, over every rank. None with the correction off."""
    if mode == "off":
        return {}
    _, ratio = sampler_correction(old_logprobs, sampler_logprobs, mask, mode, cap)
    gap, extremes = sampler_gap(old_logprobs, sampler_logprobs, ratio, mask, cap)
    sums = all_reduce_dict(gap)
    if dist.is_initialized():
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    ratio_max, inverse_max = extremes.tolist()
    tokens = max(sums["tokens"], 1)
    return {
        "mismatch/k3_kl": sums["k3"] / tokens,
        "mismatch/outside_frac": sums["outside"] / tokens,
        "mismatch/ratio_max": ratio_max,
        # no loss token at all: no ratio either
        "mismatch/ratio_min": 1 / inverse_max if inverse_max > 0 else 0.0,
    }


def adaptive_kl_coef(kl_coef, kl, target, n_steps, horizon):
    """Ziegler et al. 2019 section 2.2: beta <- beta (1 + e n_steps / horizon), with
    e = clip(KL / target - 1, -0.2, 0.2), for a batch of n_steps episodes whose mean
    KL is `kl`."""
    error = float(np.clip(kl / target - 1, -0.2, 0.2))
    return kl_coef * (1 + error * n_steps / horizon)


def penalised_scores(scores, response, eos_token_id, penalty):
    """Scores (B,), with `penalty` instead for a response with no stop token
    (lm-human-preferences' penalty_reward_value: the reward model never saw a
    truncated response); None: no change."""
    if penalty is None:
        return scores
    stopped = (response == eos_token_id).any(1)
    return torch.where(stopped, scores, torch.full_like(scores, penalty))


def forward_values(model, query, response, pad_token_id, eos_token_id):
    """A value model's values (B, Tr) at the positions that predict each response
    token (as gpt2.logprobs' log-probs): the last token is only predicted, so it is no
    input."""
    query_mask = query != pad_token_id
    response_mask = gpt2.response_mask(response, eos_token_id)
    input_mask = torch.cat([query_mask, response_mask[:, :-1]], 1)
    inputs = torch.cat([query, response[:, :-1]], 1)
    # Packed where there is padding to skip (one host sync).
    if model.packing and not input_mask.all():
        # The real tokens only: values (n,) at the real response tokens, then (B, Tr), 0 after.
        keep = torch.cat([torch.zeros_like(query_mask[:, 1:]), response_mask], 1)
        packing = gpt2.pack(input_mask, keep)
        values = model(inputs, input_mask, packing=packing)
        return gpt2.unpack(values, response_mask)
    return model(inputs, input_mask, keep_from=query.size(1) - 1)


# ----------------------------------------------------------------------------------------------
# TensorFlow's Adam, lm-human-preferences' optimizer (adam_tf.py: the reference, its tests, and
# how it differs from torch's)


def adam_tf_step(p, g, m, v, beta1_power, beta2_power, lr, beta1, beta2, eps):
    """One TensorFlow Adam update, in place on p, m, v. The arguments are those
    of TF's `ApplyAdam`.

    beta1_power, beta2_power = beta1**t, beta2**t at step t = 1, 2, ... (passed
    in, not derived from t, so a caller can reproduce TF's own bookkeeping).
    Element-wise ops only, so it runs unchanged on FSDP2 DTensor shards. m and v
    may be fp32 for a bf16 p: the update is computed in m's dtype and rounded
    into p once.
    """
    g = g.to(m.dtype)
    # m_t = beta1 m + (1 - beta1) g
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    # v_t = beta2 v + (1 - beta2) g^2
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    # TF folds both bias corrections into the step size instead of correcting m and v.
    lr_t = lr * (1 - beta2_power) ** 0.5 / (1 - beta1_power)
    # eps goes on the *uncorrected* sqrt(v): the paper's eps_hat.
    p.sub_((m * lr_t) / (v.sqrt() + eps))


class AdamTF(torch.optim.Optimizer):
    """TensorFlow's Adam, adam_tf.py's copied (see there how it differs from torch's).
    State per parameter: `step`, `m`, `v` (fp32 for a bf16 parameter), made like the
    parameter: under FSDP2, its shard."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps)
        super().__init__(params, defaults)

    # torch.distributed.checkpoint calls step(closure=None).
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    low_precision = p.dtype in (torch.bfloat16, torch.float16)
                    dtype = torch.float32 if low_precision else p.dtype
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p, dtype=dtype)
                    state["v"] = torch.zeros_like(p, dtype=dtype)
                state["step"] += 1
                t = state["step"]
                adam_tf_step(
                    p,
                    p.grad,
                    state["m"],
                    state["v"],
                    beta1_power=beta1**t,
                    beta2_power=beta2**t,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                )


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
    """The flags' problems, found before any heavy work: one line naming the flag."""
    for stage, path in (("sft", args.model), ("reward", args.reward_model)):
        if path == f"runs/{stage}/latest" and not os.path.exists(path):
            raise RunError(f"no {stage} model at '{path}': run `python {stage}.py` first")

    def bad_flag(flag, problem):
        value = getattr(args, flag)
        default = getattr(Args, flag)
        return RunError(f"--{flag} {value}: {problem}; pass another, e.g. the default {default}")

    sizes = ["total_episodes", "batch_size", "num_minibatches", "num_ppo_epochs"]
    sizes += ["micro_batch_size", "response_length", "kl_horizon"]
    sizes += ["eval_every", "log_every"]
    for flag in sizes:
        if getattr(args, flag) < 1:
            raise bad_flag(flag, "must be at least 1")
    if args.seed < 0:
        raise bad_flag("seed", "must be at least 0")
    if args.eval_size < 0:
        raise bad_flag("eval_size", "must be at least 0 (0: no eval)")
    if args.keep_checkpoints < 0:
        raise bad_flag("keep_checkpoints", "must be at least 0 (0: the newest only)")
    # Coefficients and rates. `not value >= 0` is also true for NaN.
    for flag in ["lr", "kl_coef", "vf_coef", "entropy_coef", "entropy_coef_delta"]:
        value = getattr(args, flag)
        if not (math.isfinite(value) and value >= 0):
            raise bad_flag(flag, "must be a finite number >= 0")
    for flag in ["eps", "temperature", "target_kl", "cliprange", "cliprange_value"]:
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            raise bad_flag(flag, "must be a finite number > 0")
    for flag in ["gamma", "lam"]:
        if not 0 <= getattr(args, flag) <= 1:
            raise bad_flag(flag, "must be in [0, 1]")
    if args.top_k < 0:
        raise bad_flag("top_k", "must be at least 0 (0: off)")
    if not 0 < args.top_p <= 1:
        raise bad_flag("top_p", "must be in (0, 1] (1: off)")
    for flag in ["penalty_reward_value", "entropy_target"]:
        value = getattr(args, flag)
        if value is not None and not math.isfinite(value):
            raise bad_flag(flag, "must be a finite number or None")
    if not (math.isfinite(args.sampler_cap) and args.sampler_cap >= 1):
        raise bad_flag("sampler_cap", "must be a finite number >= 1 (it bounds π_old/π_sampler)")
    dual_clip = args.dual_clip
    if dual_clip is not None and not (math.isfinite(dual_clip) and dual_clip > 1):
        raise bad_flag("dual_clip", "must be a finite number > 1, or None (verl uses 3)")


def make_eval(policy, reward_model, args, meta, rank, world_size, micro_batch_size, ctx):
    """The eval, a function of no arguments (as CleanRL's make_env returns a thunk): the mean
    reward-model score of greedy responses to prompt_test (a strided share per rank), their
    accuracy where the task has a verifier, and preference accuracy on the held-out pairs
    where the data has them, against the policy as it is now (before any --resume): the pairs'
    log-probs under it are taken here."""
    test = data.load_split(args.data, "prompt_test")
    pref = data.eval_split(args.data, "pref_test", args.eval_size)  # None where absent
    n_pairs = len(pref["query"]) if pref else 0
    ref_pair_logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)
    device = next(policy.parameters()).device
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]

    def evaluate():
        n = min(args.eval_size, len(test["query"])) // world_size * world_size
        idx = np.arange(rank, n, world_size)
        sums = {}
        sums["score"] = torch.zeros((), device=device)
        sums["correct"] = torch.zeros((), device=device)
        for i in data.progress(range(0, len(idx), micro_batch_size), "eval", show=is_master()):
            j = idx[i : i + micro_batch_size]
            query = torch.from_numpy(test["query"][j]).to(device)
            with torch.no_grad(), ctx:
                rollout = gpt2.generate(policy, query, pad, args.response_length, eos, 0.0)
                response = rollout.response
                scores = gpt2.get_reward(reward_model, query, response, pad, eos)
            scores = penalised_scores(scores, response, eos, args.penalty_reward_value)
            sums["score"] += scores.sum()
            if meta.get("task"):
                answers = test["ground_truth"][j]
                correct = data.verify_batch(meta, response.tolist(), answers)
                sums["correct"] += sum(correct)
        totals = all_reduce_dict(sums)
        metrics = {"eval/score": totals["score"] / max(n, 1)}
        if meta.get("task"):
            metrics["eval/accuracy"] = totals["correct"] / max(n, 1)
        if n_pairs:
            logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)
            accuracy = data.preference_accuracy(logps, ref_pair_logps)
            metrics["eval/preference_accuracy"] = accuracy
        return metrics

    return evaluate


def update_metrics(totals, batch_size, kl_coef, lr):
    """An update's metrics from the global batch's sums (totals): per response, or per token of
    every epoch and minibatch; lm-human-preferences' and TRL's names (docs/metrics.md)."""
    tokens = totals["tokens"]
    mean_ratio = totals["ratio"] / tokens
    # Var[ratio] = E[ratio^2] - E[ratio]^2, which rounding can take a hair below 0
    ratio_var = max(0.0, totals["ratio_squared"] / tokens - mean_ratio**2)
    rlhf_reward = totals["scores"] + totals["non_score_reward"]
    return {
        "objective/kl": totals["kl"] / batch_size,
        "objective/entropy": totals["neg_logprob"] / batch_size,
        "objective/non_score_reward": totals["non_score_reward"] / batch_size,
        "objective/scores": totals["scores"] / batch_size,
        "objective/rlhf_reward": rlhf_reward / batch_size,
        "objective/kl_coef": kl_coef,
        "loss/policy_avg": totals["pg_loss"] / tokens,
        "loss/value_avg": totals["vf_loss"] / tokens,
        "policy/approxkl_avg": totals["approxkl"] / tokens,
        "policy/clipfrac_avg": totals["pg_clipfrac"] / tokens,
        "val/clipfrac_avg": totals["vf_clipfrac"] / tokens,
        "val/ratio": mean_ratio,
        "val/ratio_var": ratio_var,
        "val/stop_frac": totals["stopped"] / batch_size,
        "train/lr": lr,
    }


def make_optimizer(model, args):
    """TensorFlow's Adam, as lm-human-preferences trains with (--optimizer adam_tf); or torch's
    (adam_tf.py compares the two)."""
    if args.optimizer == "adam_tf":
        return AdamTF(model.parameters(), lr=args.lr, eps=args.eps)
    return torch.optim.Adam(model.parameters(), lr=args.lr, eps=args.eps, fused=True)


def zero_value_head(value_model):
    """lm-human-preferences' value head (--value_head zero): the first values are 0."""
    torch.nn.init.zeros_(value_model.score.weight)
    torch.nn.init.zeros_(value_model.score.bias)
    value_model.reward_gain = 1.0
    value_model.reward_bias = 0.0


def check_finite(totals, done, out_dir):
    """Stop on a non-finite statistic, before the update's checkpoint could save it."""
    if not all(math.isfinite(total) for total in totals.values()):
        raise RunError(
            f"non-finite PPO statistics at update {done}: lower --lr and continue with "
            f"--resume --out_dir {out_dir}"
        )


def next_entropy_coefs(entropy_coef, entropy_bonus, totals, args):
    """Skywork-OR1's controller with --entropy_target: the next update's coefficient and bonus,
    from this update's token mean entropy; unchanged without a target."""
    if args.entropy_target is None:
        return entropy_coef, entropy_bonus
    return adaptive_entropy_coef(
        coef=entropy_coef,
        entropy=totals["entropy"] / totals["tokens"],
        target=args.entropy_target,
        delta=args.entropy_coef_delta,
    )


def main(args: Args):
    # 1. sizes, distributed setup, seeds
    check_args(args)
    rank, world_size, device = setup_distributed()
    local_batch_size = data.exact_div(args.batch_size, world_size, "--batch_size or the ranks")
    local_mini_batch_size = data.exact_div(
        local_batch_size, args.num_minibatches, "--num_minibatches"
    )
    micro_batch_size = min(args.micro_batch_size, local_mini_batch_size)
    grad_accum = data.exact_div(local_mini_batch_size, micro_batch_size, "--micro_batch_size")
    num_updates = data.exact_div(args.total_episodes, args.batch_size, "--total_episodes")
    on_cuda = device.type == "cuda"
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and on_cuda)
    # With bf16 off, the autocast context is a no-op.
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    correction = correction_mode(args.sampler_correction, bf16)
    torch.manual_seed(args.seed)

    # 2. data
    meta = data.load_meta(args.data)
    prompts = data.load_split(args.data, "prompt_train")
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    n_prompts = len(prompts["query"])
    if n_prompts < args.batch_size:
        raise RunError(f"prompt_train has {n_prompts} prompts, fewer than --batch_size")

    # 3. models, then the run directory (a bad --model leaves none): the policy, the
    # reference (a copy: a random `tiny` is its own reference), the reward model, the
    # value model (its copy), each built once: rank 0 reads the weights, every rank's
    # shard gets them (gpt2.load).
    trained = functools.partial(shard, device=device, bf16=bf16)
    frozen = functools.partial(shard, device=device, bf16=bf16, frozen=True)
    policy = gpt2.load(args.model, meta, shard=trained)
    # `--model tiny` draws the policy's random init again: the reference is a copy of it.
    torch.manual_seed(args.seed)
    ref_policy = gpt2.load(args.model, meta, shard=frozen)
    reward_model = gpt2.load(args.reward_model, meta, head="saved", shard=frozen)
    value_model = gpt2.load(args.reward_model, meta, head="saved", shard=trained)
    context = min(policy.config.block_size, reward_model.config.block_size)
    data.check_context(prompts, context, args.response_length)
    args.out_dir = start_run(args, "ppo_variants")
    if args.value_head == "zero":
        zero_value_head(value_model)
    policy.activation_checkpointing = args.activation_checkpointing
    value_model.activation_checkpointing = args.activation_checkpointing
    for model in (policy, ref_policy, reward_model, value_model):
        model.packing = args.packing
    policy_opt = make_optimizer(policy, args)
    value_opt = make_optimizer(value_model, args)
    fwd_policy = torch.compile(policy) if args.compile else policy
    fwd_value = torch.compile(value_model) if args.compile else value_model
    models = {"policy": (policy, policy_opt), "value": (value_model, value_opt)}
    # the eval: its preference accuracy's reference is the policy as loaded
    evaluate = make_eval(policy, reward_model, args, meta, rank, world_size, micro_batch_size, ctx)
    state = {"step": 0}
    if args.resume:
        state = load_checkpoint(args.out_dir, models)
    start = state["step"]
    kl_coef = state.get("kl_coef", args.kl_coef)
    # The entropy bonus: Skywork-OR1's coefficient, and the one applied. Without a
    # target the bonus is --entropy_coef throughout; with one, none until the entropy
    # is below it.
    entropy_coef = state.get("entropy_coef", args.entropy_coef)
    first_bonus = args.entropy_coef if args.entropy_target is None else 0.0
    entropy_bonus = state.get("entropy_bonus", first_bonus)
    entropy_in_loss = args.entropy_coef > 0 or args.entropy_target is not None
    # The policy's log-probs (pi_old's and pi_theta's) on the distribution the sampler draws
    # from: top-k and top-p's tokens, renormalised (gpt2.logprobs: trl#6789).
    policy_logprobs = functools.partial(
        gpt2.logprobs,
        fwd_policy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    if start == 0 and args.eval_size > 0:
        # The starting policy's numbers, to compare against.
        log_metrics(args, 0, evaluate(), SHOW)

    # 4. training loop: one permutation of the prompts per pass over them, keyed by
    # (seed, pass); rank r takes its slice of each global batch, so any number of ranks
    # sees the same global batches
    micro_idx = torch.arange(local_batch_size, device=device).split(micro_batch_size)
    rank_rows = slice(rank * local_batch_size, (rank + 1) * local_batch_size)
    updates_per_pass = n_prompts // args.batch_size
    t0 = time.time()
    episodes = 0
    for update in range(start, num_updates):
        done = update + 1
        eval_now = done % args.eval_every == 0 or done == num_updates
        log_now = done % args.log_every == 0 or update == start or eval_now
        prompt_pass, k = divmod(update, updates_per_pass)
        order = np.random.default_rng([args.seed, prompt_pass, 1]).permutation(n_prompts)
        local_idx = order[k * args.batch_size :][rank_rows]
        # b_query (B, Tq): the prompts, left-padded
        b_query = torch.from_numpy(prompts["query"][local_idx]).to(device)
        b_query = gpt2.trim_padding(b_query, None, pad)[0]

        # 4.1 generate; the uniforms come from (seed, update): the same samples on 1 or
        # N ranks
        rng = np.random.default_rng([args.seed, update, 2])
        noise = rng.random((args.batch_size, args.response_length))
        noise = torch.from_numpy(noise[rank_rows]).float().to(device)
        responses = []
        sampler_logprobs = []
        with ctx:
            for i in micro_idx:
                rollout = gpt2.generate(
                    policy,
                    b_query[i],
                    pad_token_id=pad,
                    max_new_tokens=args.response_length,
                    eos_token_id=eos,
                    temperature=args.temperature,
                    noise=noise[i],
                    top_k=args.top_k,
                    top_p=args.top_p,
                )
                responses.append(rollout.response)
                sampler_logprobs.append(rollout.logprobs)
        b_response = torch.cat(responses)
        b_sampler_logprobs = torch.cat(sampler_logprobs)

        # 4.2 truncate at the first stop token (the mask keeps it); the columns past
        # every stop go
        b_query, b_response = gpt2.trim_padding(b_query, b_response, pad, eos)
        # b_mask (B, Tr): the response tokens up to and including the stop token
        b_mask = gpt2.response_mask(b_response, eos)
        b_sampler_logprobs = b_sampler_logprobs[:, : b_response.size(1)]

        # 4.3 score: log-probs under the policy (pi_old: the trainer's forward, so that the
        # first minibatch's ratio is exactly 1, whatever the sampler's rounding) and the
        # reference, values, the reward model's scores
        logprobs_parts = []
        ref_logprobs_parts = []
        values_parts = []
        scores_parts = []
        with torch.no_grad(), ctx:
            for i in micro_idx:
                query = b_query[i]
                response = b_response[i]
                logprobs = policy_logprobs(query, response)[0]
                # The reference on its full tempered distribution: a token of the policy's
                # nucleus may lie outside the reference's (-inf there); TRL and verl alike.
                ref_logprobs = gpt2.logprobs(ref_policy, query, response, args.temperature)[0]
                values = forward_values(fwd_value, query, response, pad, eos)
                scores = gpt2.get_reward(reward_model, query, response, pad, eos)
                logprobs_parts.append(logprobs)
                ref_logprobs_parts.append(ref_logprobs)
                values_parts.append(values * b_mask[i])
                scores_parts.append(scores)
        b_logprobs = torch.cat(logprobs_parts)
        b_ref_logprobs = torch.cat(ref_logprobs_parts)
        b_values = torch.cat(values_parts)
        b_scores = torch.cat(scores_parts)
        b_scores = penalised_scores(b_scores, b_response, eos, args.penalty_reward_value)
        # the sampler-trainer gap: pi_old (the training forward) / pi_sampler (generate's)
        b_is_weights = correction_weights(
            old_logprobs=b_logprobs,
            sampler_logprobs=b_sampler_logprobs,
            mask=b_mask,
            mode=correction,
            cap=args.sampler_cap,
        )

        # 4.4 per-token rewards: the KL penalty at every token, the score at the last one
        rewards, non_score_reward, kl = per_token_rewards(
            scores=b_scores,
            logprobs=b_logprobs,
            ref_logprobs=b_ref_logprobs,
            mask=b_mask,
            kl_coef=kl_coef,
        )
        if args.whiten_rewards:
            # Scale only: the sign of the summed reward is kept.
            rewards = masked_whiten(rewards, b_mask, shift_mean=False)

        # 4.5 GAE advantages and returns; advantages whitened over the global batch's
        # tokens
        b_advantages, b_returns = compute_gae(
            rewards, b_values, b_mask, gamma=args.gamma, lam=args.lam
        )
        b_advantages = masked_whiten(b_advantages, b_mask)

        # 4.6 PPO: K epochs over shuffled minibatches, one optimizer step per minibatch.
        # The loss is a sum over tokens / the global minibatch's token count, so any
        # micro-batch split or rank count agrees.
        lr = args.lr * (1 - update / num_updates) if args.anneal_lr else args.lr
        for group in policy_opt.param_groups + value_opt.param_groups:
            group["lr"] = lr
        # The entropy on logging updates, and for a bonus on every one.
        need_entropy = log_now or entropy_in_loss
        # Sums over the tokens of every epoch and minibatch, in float64.
        token_sums = defaultdict(float)
        shuffle = np.random.default_rng([args.seed, update, 3])
        for epoch in range(args.num_ppo_epochs):
            permutation = torch.from_numpy(shuffle.permutation(local_batch_size))
            for mb_idx in permutation.split(local_mini_batch_size):
                n_tokens = all_reduce(b_mask[mb_idx].sum().float())
                for micro, idx in enumerate(mb_idx.to(device).split(micro_batch_size)):
                    if dist.is_initialized():
                        # FSDP2 reduce-scatters on the minibatch's last micro-batch only.
                        sync = micro == grad_accum - 1
                        policy.set_requires_gradient_sync(sync)
                        value_model.set_requires_gradient_sync(sync)
                    query = b_query[idx]
                    response = b_response[idx]
                    mask = b_mask[idx]
                    with ctx:
                        new_logprobs, entropy = policy_logprobs(
                            query, response, entropy=need_entropy
                        )
                        vpred = forward_values(fwd_value, query, response, pad, eos)
                    pg_losses, ratio, pg_clipped = policy_loss(
                        new_logprobs=new_logprobs,
                        logprobs=b_logprobs[idx],
                        advantages=b_advantages[idx],
                        cliprange=args.cliprange,
                        dual_clip=args.dual_clip,
                    )
                    if b_is_weights is not None:
                        pg_losses = pg_losses * b_is_weights[idx]
                    vf_losses, vf_clipped = value_loss(
                        vpred=vpred,
                        values=b_values[idx],
                        returns=b_returns[idx],
                        cliprange_value=args.cliprange_value,
                    )
                    losses = pg_losses + args.vf_coef * vf_losses
                    if entropy_bonus:
                        # The bonus on the token mean entropy, a token mean as the loss.
                        losses = losses - entropy_bonus * entropy
                    loss = (losses * mask).sum()
                    # FSDP2 averages gradients over ranks: times world_size makes
                    # sum / global count.
                    (loss * world_size / n_tokens).backward()

                    with torch.no_grad():
                        stats = {
                            "pg_loss": pg_losses,
                            "vf_loss": vf_losses,
                            "approxkl": 0.5 * (new_logprobs - b_logprobs[idx]) ** 2,
                            "pg_clipfrac": pg_clipped,
                            "vf_clipfrac": vf_clipped,
                            "ratio": ratio,
                            "ratio_squared": ratio**2,
                        }
                        if entropy is not None:
                            stats["entropy"] = entropy
                        for name, x in stats.items():
                            token_sums[name] += (x * mask).sum().double()
                for optimizer in (policy_opt, value_opt):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

        # 4.7 statistics of the global batch in one all-reduce, the KL controller, log,
        # checkpoint
        sums = {
            "kl": kl.sum(),
            "neg_logprob": -(b_logprobs * b_mask).sum(),
            "non_score_reward": non_score_reward.sum(),
            "scores": b_scores.sum(),
            "stopped": (b_response == eos).any(1).sum(),
            "tokens": b_mask.sum() * args.num_ppo_epochs,
        }
        totals = all_reduce_dict(sums | token_sums)
        check_finite(totals, done, args.out_dir)
        metrics = update_metrics(totals, args.batch_size, kl_coef, lr)
        metrics |= gap_metrics(b_logprobs, b_sampler_logprobs, b_mask, correction, args.sampler_cap)
        if entropy_in_loss:
            metrics["policy/entropy_coef"] = entropy_bonus
        # the next update's coefficients, from this update's entropy
        entropy_coef, entropy_bonus = next_entropy_coefs(entropy_coef, entropy_bonus, totals, args)
        if args.adaptive_kl:
            kl_coef = adaptive_kl_coef(
                kl_coef=kl_coef,
                kl=metrics["objective/kl"],
                target=args.target_kl,
                n_steps=args.batch_size,
                horizon=args.kl_horizon,
            )
        episodes += args.batch_size
        if log_now:
            metrics["policy/entropy_avg"] = totals["entropy"] / totals["tokens"]
            metrics["perf/episodes_per_sec"] = episodes / (time.time() - t0)
            if eval_now and args.eval_size > 0:
                metrics |= evaluate()
            log_metrics(args, done, metrics, SHOW)
            t0 = time.time()
            episodes = 0
        extra = dict(kl_coef=kl_coef, entropy_coef=entropy_coef, entropy_bonus=entropy_bonus)
        checkpoint(args, done, models, device, due=eval_now, extra=extra)

    # 5. the final policy in the HF GPT-2 layout
    gpt2.save(policy, args.out_dir)
    finish_run(args, "ppo_variants")


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
