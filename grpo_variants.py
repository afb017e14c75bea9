"""GRPO with the field's variants as flags: grpo.py, plus a branch or a named call per option.

grpo.py is DeepSeekMath's GRPO (Shao et al. 2024, arXiv 2402.03300, Sec. 4.1); this file is the
same algorithm, line for line where it can be, with the options the field has added since: at
its defaults it writes the metrics grpo.py writes, bit for bit (tests/test_grpo_variants.py).
Each option is one flag, a branch of a small function beside the plain formula
(docs/variants_grpo.md has every one with its paper and the library default it reproduces):
- advantages: RLOO, REINFORCE++, Dr. GRPO's and the batch's std, the KL in the reward;
- surrogates: DAPO's clip-higher, dual-clip, GSPO's sequence ratio, CISPO, SAPO, GMPO; the
  loss's mean per token, per sequence or Dr. GRPO's constant; k3_ratio's importance-weighted KL;
- sampling: DAPO's dynamic sampling, overlong filtering and punishment; top-k and top-p;
- the sampler-trainer correction (TIS, MIS) and its measurement;
- entropy bonuses (Skywork-OR1's adaptive one), TR-DPO's reference refresh;
- reward functions as plug-ins (--reward_fn FILE.py:NAME), on-policy distillation from a
  teacher (--teacher_model), pass@k evals.
pi_old is the trainer's, as in grpo.py; REINFORCE++, the KL in the reward and distillation
take it before the first update.

    python grpo_variants.py --clip_eps_high 0.28 --dynamic_sampling --overlong_buffer 4  # DAPO
    python grpo_variants.py --scale_rewards none --loss_aggregation dr_grpo  # Dr. GRPO
    python grpo_variants.py --advantage rloo --clip_eps_high 0.28  # RLOO with clip-higher
    python grpo_variants.py --loss_type cispo --clip_eps_high 4  # CISPO, weights capped at 5
    python grpo_variants.py --loss_type sapo --loss_aggregation sequence  # SAPO's soft gate
    python grpo_variants.py --advantage reinforce_plus_plus --beta 0.01  # KL in the reward
    python grpo_variants.py --sampler_correction sequence_mask --sampler_cap 3  # TRL's correction
    python grpo_variants.py --reward_fn experiments/reward_fns.py:closeness --reward_weights 0.5
    python grpo_variants.py --teacher_model runs/grpo/latest --no_verifier  # distillation
    python grpo_variants.py --beta 0.04 --ref_sync_every 10 --ref_sync_mix 0.6  # TR-DPO's refresh
    torchrun --nproc_per_node=2 grpo_variants.py --top_p 0.9 --beta 0.03  # nucleus sampling
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
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import tyro
from safetensors import safe_open
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import data
import data.rewards
import gpt2

# --sampler_correction's choices: off, or the gap measured (none) and corrected (TIS truncates
# pi_old / pi_sampler, MIS masks it); auto: none in fp32, token_truncate in bf16
Correction = Literal[
    "off", "auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]


@dataclass
class Args:
    model: str = "runs/sft/latest"  # policy to start: an SFT run dir, a preset, `tiny`
    ref_model: str = ""  # reference of the KL term; default the starting --model
    data: str = "arithmetic"  # `arithmetic` (built in) or `python -m data.prep`'s dir
    reward_model: str = ""  # a reward.py run dir; adds to the verifier's score
    verifier: bool = True  # score with the task's verifier (1 correct, 0 wrong)
    reward_fn: tyro.conf.UseAppendAction[tuple[str, ...]] = ()  # FILE.py:NAME, a reward function
    reward_weights: tuple[float, ...] = ()  # a weight per --reward_fn; none: 1 each
    teacher_model: str = ""  # on-policy distillation: its log-probs score every sampled token
    teacher_coef: float = 1.0  # weight of the teacher's per-token advantage log π_t - log π
    out_dir: str = ""  # run directory; default a fresh runs/grpo_variants/<time>-s<seed>
    overwrite: bool = False  # delete the run already in --out_dir and start afresh
    resume: bool = False  # continue the run in --out_dir from its last checkpoint
    seed: int = 1  # seed of prompt order, sampling and minibatches
    lr: float = 1e-5  # learning rate (constant; pretrained GPT-2: ~1e-6)
    max_grad_norm: float = 1.0  # gradient clipping threshold on the global gradient norm
    total_episodes: int = 51200  # responses sampled over the run
    num_prompts_per_step: int = 32  # prompts per step, over all ranks
    num_samples_per_prompt: int = 8  # group size G: responses per prompt (>= 2)
    num_minibatches: int = 4  # optimizer steps per epoch, each on a share of every group
    num_epochs: int = 1  # PPO epochs over each batch of samples (DeepSeekMath: 1)
    micro_batch_size: int = 64  # sequences per forward pass on one rank
    response_length: int = 16  # max new tokens per response
    temperature: float = 1.0  # sampling temperature; the loss's log-probs use it too
    top_k: int = 0  # sample among the k likeliest tokens; the loss's log-probs too (0: off)
    top_p: float = 1.0  # nucleus: the fewest likeliest tokens of this mass; as top_k (1: off)
    beta: float = 0.0  # KL coefficient (DeepSeekMath: 0.04; 0: no reference)
    kl_estimator: Literal["k1", "k2", "k3", "k4", "k3_ratio"] = "k3"  # k4, k3_ratio: x the ratio
    kl_in_reward: bool = False  # beta's KL (k1) in the reward, not the loss (RLOO, verl)
    ref_sync_every: int = 0  # τ: refresh π_ref every this many steps (TR-DPO; 0: never)
    ref_sync_mix: float = 0.6  # α: π_ref ← α π + (1 - α) π_ref at a refresh (1: a copy)
    loss_type: Literal["ppo", "cispo", "sapo", "gmpo"] = "ppo"  # the surrogate (variants_grpo.md)
    clip_eps_low: float = 0.2  # the ratio is clipped below at 1 - this (GMPO: log ratio at -this)
    clip_eps_high: float = 0.2  # and above at 1 + this (DAPO: 0.28; CISPO's cap; GMPO: log)
    dual_clip: float | None = None  # cap the loss at -this x A where A < 0 (verl: 3.0)
    importance_level: Literal["token", "sequence"] = "token"  # ratios per token or GSPO's
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature where A > 0 (TRL's and verl's 1.0)
    sapo_tau_neg: float = 1.05  # and where A <= 0 (TRL's and verl's 1.05)
    advantage: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo"  # group's, RLOO, REINFORCE++
    scale_rewards: Literal["group", "batch", "none"] = "group"  # r - mean over whose std
    batch_norm_advantages: bool = False  # whiten the advantages again over the batch
    loss_aggregation: Literal["token", "sequence", "dr_grpo"] = "token"  # the loss's mean
    mask_truncated: bool = False  # responses with no stop: out of the loss (DAPO)
    missing_eos_penalty: float | None = None  # subtracted from a score if no stop token
    overlong_buffer: int = 0  # DAPO's soft punishment of the last this many tokens
    overlong_penalty: float = 1.0  # --overlong_buffer's penalty at --response_length
    entropy_coef: float = 0.0  # the loss minus this x entropy, aggregated as the loss is
    entropy_target: float | None = None  # adapt --entropy_coef toward it (Skywork-OR1)
    entropy_coef_delta: float = 0.005  # --entropy_target's step of the coefficient
    dynamic_sampling: bool = False  # resample groups with equal rewards (DAPO)
    max_sampling_rounds: int = 4  # --dynamic_sampling's extra rounds per step at most
    rejection_sampling_candidates: int = 0  # RSO: sample this many, keep G (0: off)
    rso_temperature: float = 2.0  # RSO's beta: keep w.p. exp((r - r_max) / this)
    sampler_correction: Correction = "off"  # weigh by π_old/π_sampler, or measure the gap
    sampler_cap: float = 2.0  # C: the weight truncated at C, or masked outside [1/C, C]
    eval_every: int = 50  # steps between evals (greedy accuracy) and checkpoints
    eval_size: int = 500  # held-out prompts for the eval accuracy (0: no eval)
    eval_samples: int = 0  # samples per eval prompt for pass@k, mean@n, top-k/p too (0: off)
    log_every: int = 1  # steps between status lines and metrics rows
    keep_checkpoints: int = 2  # resumable checkpoints kept in out_dir/checkpoints (>= 1)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA
    compile: bool = False  # torch.compile the policy for the loss's forward passes
    activation_checkpointing: bool = False  # recompute activations in backward
    packing: bool = True  # the real tokens only, packed into one row: no compute on padding
    wandb: bool = False  # also log to Weights & Biases (imported only when set)


# The status line's few numbers; metrics.jsonl has every one.
SHOW = ("objective/scores", "objective/kl", "eval/accuracy", "perf/episodes_per_sec")
# Flags that live in a sibling script (parse_args): none, this file has every one of grpo.py's.
MOVED = {}


# ----------------------------------------------------------------------------------------------
# GRPO and its variants: KL estimators, advantages, RSO, the surrogates and their weights

# The cap of |log pi_theta - log pi_ref| (open-instruct's): exp(40) is finite in bf16.
KL_CLAMP = 40.0


def kl_penalty(new_logprobs, ref_logprobs, log_ratio, estimator):
    """Estimates (B, T) of KL(pi_theta || pi_ref) at tokens sampled from pi_old,
    differentiable in new_logprobs (Schulman's note "Approximating KL divergence";
    which gradients are unbiased: docs/variants_grpo.md). log_ratio: the surrogate's
    log pi_theta / pi_old, k4's and k3_ratio's weight w (per token, or GSPO's per
    sequence, as TRL's). logr = log pi_theta / pi_ref is clamped: past ~88, k3's
    exp(-logr) is inf in fp32."""
    logr = (new_logprobs - ref_logprobs).clamp(-KL_CLAMP, KL_CLAMP)
    if estimator == "k3":
        # DeepSeekMath eq. 4: pi_ref / pi - log(pi_ref / pi) - 1, never negative
        kl = torch.expm1(-logr) + logr
    elif estimator == "k1":
        # the log-ratio itself: unbiased in value, but no pull toward pi_ref
        kl = logr
    elif estimator == "k2":
        # half its square: on-policy, its expected gradient is the true KL's
        kl = 0.5 * logr.square()
    elif estimator == "k4":
        # w logr, w = pi_theta / pi_old: unbiased off-policy (open-instruct #534)
        kl = torch.exp(log_ratio) * logr
    elif estimator == "k3_ratio":
        # w k3: the importance-corrected k3 (DeepSeek-V3.2; TRL's default)
        kl = torch.exp(log_ratio) * (torch.expm1(-logr) + logr)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    return kl


def batch_std(r):
    """The unbiased std of every reward of the global batch, summed over ranks."""
    r = r.double()
    moments = torch.stack([r.new_tensor(r.numel()), r.sum(), (r * r).sum()])
    n, total, squares = all_reduce(moments)
    return ((squares - total**2 / n) / (n - 1)).clamp(min=0).sqrt().float()


def zero_std_groups(scores, group_size):
    """(P,) bool: the groups whose G rewards are all equal: no learning signal."""
    groups = scores.view(-1, group_size)
    return (groups == groups[:, :1]).all(1)


def group_advantages(scores, group_size, advantage="grpo", scale="group"):
    """(B,) scores of consecutive groups -> (B,) advantages (0 for equal rewards)."""
    rewards = scores.view(-1, group_size)
    # DeepSeekMath Sec. 4.1.2: a reward's distance from its group's mean, in its std
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True)
    advantages = (rewards - mean) / (std + 1e-4)
    if advantage == "rloo":
        # RLOO: minus the mean of the other G - 1, a baseline independent of r_i; no std
        others_mean = (rewards.sum(1, keepdim=True) - rewards) / (group_size - 1)
        advantages = rewards - others_mean
    elif scale == "batch":
        # the whole batch's std: TRL's "batch" (REINFORCE++-baseline, Lite PPO)
        advantages = (rewards - mean) / (batch_std(rewards) + 1e-4)
    elif scale == "none":
        # Dr. GRPO: no std, which weighs prompts too easy or too hard the most
        advantages = rewards - mean
    # a group of equal rewards has no signal: exactly 0
    no_signal = zero_std_groups(scores, group_size)
    return advantages.masked_fill(no_signal[:, None], 0.0).flatten()


def batch_normalise(advantages, batch_size):
    """(B,) advantages whitened over the global batch of batch_size responses: the TL;DR
    recipe's (REINFORCE++-baseline's) second normalisation, after the group's."""
    moments = torch.stack([advantages.sum(), advantages.square().sum()]).double()
    mean, mean_sq = all_reduce(moments) / batch_size
    std = (mean_sq - mean**2).sqrt()
    return ((advantages - mean) / (std + 1e-8)).float()


def kl_in_reward(scores, logprobs, ref_logprobs, mask, beta):
    """Scores (B,) - beta sum_t (log pi_old - log pi_ref): the KL (k1) as a reward."""
    return scores - beta * ((logprobs - ref_logprobs) * mask).sum(1)


def batch_whiten(values, mask):
    """(values - mean) / sqrt(var + 1e-8), the mean and the unbiased variance over the
    tokens of mask on every rank (verl's masked_whiten, over the global batch)."""
    values = values.double()
    moments = torch.stack([mask.sum(), (values * mask).sum(), (values.square() * mask).sum()])
    n, total, squares = all_reduce(moments.double())
    mean = total / n.clamp(min=1)
    var = (squares - total * mean) / (n - 1).clamp(min=1)
    return ((values - mean) / torch.sqrt(var.clamp(min=0) + 1e-8)).float()


def reinforce_plus_plus_advantages(scores, logprobs, ref_logprobs, response_mask, mask, beta):
    """REINFORCE++ (arXiv 2501.03262) as verl's reinforce_plus_plus: the per-token
    reward (B, T) is -beta (log pi_old - log pi_ref) (k1; none without a reference) plus
    the score at the response's last token; the advantage is its return-to-go (gamma 1),
    whitened over the loss's tokens of every rank. No group baseline."""
    rewards = torch.zeros_like(response_mask)
    if ref_logprobs is not None:
        rewards = -beta * (logprobs - ref_logprobs) * response_mask
    # the response mask is a prefix: its last token is at its length - 1
    last = response_mask.sum(1, True) - 1
    columns = torch.arange(response_mask.shape[1], device=scores.device)
    rewards = rewards + scores[:, None] * (columns == last)
    # sum_{s >= t} r_s: a cumulative sum from the end
    returns = rewards.flip(1).cumsum(1).flip(1)
    return batch_whiten(returns, mask) * mask


def distillation_advantages(logprobs, teacher_logprobs, response_mask, coef):
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): each
    sampled token's advantage (B, T) is coef x (log pi_teacher - log pi_old), the negative
    of the per-token reverse KL estimate. No return-to-go: each token is judged alone (the
    blog's discount 0), and no baseline."""
    return coef * (teacher_logprobs - logprobs) * response_mask


def overlong_penalty(lengths, max_length, buffer, penalty):
    """DAPO eq. 13 of (B,) lengths: 0 up to max_length - buffer, then linear down to
    -penalty at max_length."""
    return ((max_length - buffer - lengths) / buffer).clamp(-1.0, 0.0) * penalty


def rso_select(rewards, k, temperature, uniforms):
    """RSO (arXiv 2309.06657, Alg. 1): k of N candidates, rewards (P, N). Round j
    accepts each candidate left, in turn, with probability exp((r - r_max) / temperature)
    (against uniforms[:, j]), r_max the best left, until k are (the best always is).
    -> indices (P, k) in the order accepted, and the rounds each prompt took (P,)."""
    left = torch.ones_like(rewards, dtype=torch.bool)
    taken = rewards.new_zeros(len(rewards))
    # each candidate's place among the kept; inf: not accepted
    place = torch.full_like(rewards, float("inf"))
    rounds = torch.zeros_like(taken)
    for j in range(k):
        # a prompt with fewer than k accepted takes part in this round
        rounds = rounds + (taken < k)
        r_max = rewards.masked_fill(~left, -float("inf")).amax(1, keepdim=True)
        p_accept = torch.exp((rewards - r_max) / temperature)
        accept = left & (uniforms[:, j] < p_accept)
        # the place each would take among the kept
        order = taken[:, None] + accept.cumsum(1) - 1
        # Algorithm 1 stops the round once k are accepted
        accept &= order < k
        place = torch.where(accept, order, place)
        left = left & ~accept
        taken = taken + accept.sum(1)
    return place.argsort(1)[:, :k], rounds


def rso_rows(scores, k, temperature, uniforms):
    """rso_select's k kept of each prompt's N candidates, scores (P * N,) of consecutive
    prompts: as rows (P * k,) of scores, and the rounds each prompt took, per row (P * k,)."""
    candidates = scores.view(len(uniforms), -1)
    keep, rounds = rso_select(candidates, k, temperature, uniforms)
    first_candidate = candidates.size(1) * torch.arange(len(keep), device=scores.device)
    rows = (keep + first_candidate[:, None]).flatten()
    return rows, rounds.repeat_interleave(k)


def importance_log_ratio(log_ratio, mask, level):
    """The log-ratio log pi_theta / pi_old (B, T) the surrogate takes its ratio of."""
    if level == "token":
        # PPO, DeepSeekMath: each token its own ratio
        return log_ratio
    elif level == "sequence":
        # GSPO: every token of a response takes the response's mean log-ratio
        mean = log_ratio.sum(1, True) / mask.sum(1, True).clamp(min=1)
        return mean.expand_as(log_ratio)
    raise ValueError(f"unknown importance level {level!r}")


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


def corrected_loss(pg_loss, old_logprobs, sampler_logprobs, mask, mode, cap):
    """The surrogate pg_loss (B, T) weighed by the sampler-trainer correction; as it is with
    the correction off."""
    if mode == "off":
        return pg_loss
    is_weights, _ = sampler_correction(old_logprobs, sampler_logprobs, mask, mode, cap)
    return pg_loss * is_weights


def correction_mode(mode, bf16):
    """--sampler_correction's mode for this run: auto is none in fp32, where sampler and trainer
    give the same log-probs, and TIS in bf16."""
    if mode == "auto":
        return "token_truncate" if bf16 else "none"
    return mode


def grpo_loss(log_ratio, advantages, mask, clip_low, clip_high, dual_clip=None):
    """PPO's clipped surrogate (B, T) of log pi_theta / pi_old and advantages (B, T), the
    ratio in [1 - clip_low, 1 + clip_high], A < 0's loss capped at -dual_clip A. Like every
    surrogate here it takes the loss's mask (only GMPO's mean needs it) and also returns
    the ratio and where it was clipped."""
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.max(pg_losses, pg_losses2)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, loss.minimum(-dual_clip * advantages), loss)
    return loss, ratio, (pg_losses2 > pg_losses).float()


def cispo_loss(log_ratio, advantages, mask, clip_high):
    """CISPO (arXiv 2506.13585, eq. 4): -sg(min(rho, 1 + clip_high)) A log pi per token:
    its weight is capped, not its gradient. log rho stands for log pi: the same gradient
    (pi_old is fixed), and 0 on-policy. Also the ratio, and where its weight was capped."""
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=1.0 + clip_high).detach()
    loss = -advantages * weight * log_ratio
    return loss, ratio, (ratio > 1.0 + clip_high).float()


def sapo_loss(log_ratio, advantages, mask, tau_pos, tau_neg):
    """SAPO (arXiv 2511.20347): -f(rho) A per token, f(rho) = 4/tau
    sigmoid(tau (rho - 1)), tau = tau_pos where A > 0, else tau_neg: a soft gate for the
    clip. d f / d log rho = 4 sigmoid (1 - sigmoid) rho: PPO's unclipped gradient at
    rho = 1, fading smoothly away from it. Also the ratio, and the share of that gradient
    the gate removes, 1 - 4 sigmoid (1 - sigmoid): 0 on-policy."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -advantages * gate * (4.0 / tau)
    gated = 1.0 - 4.0 * gate * (1.0 - gate)
    return loss, ratio, gated.detach()


def gmpo_loss(log_ratio, advantages, mask, clip_low, clip_high):
    """GMPO (arXiv 2507.20673): -A s per response, s the geometric mean of its
    token ratios, each clipped in log space to [-clip_low, clip_high] on the side A's sign
    makes binding (PPO's min). A sequence objective: every token carries its response's
    loss, as GSPO's tokens do, so --loss_aggregation sequence gives the paper's mean over
    responses. A: the mean of the response's token advantages (verl's geo_mean). Also s
    per token, and where a log-ratio was clipped."""
    clamped = log_ratio.clamp(-clip_low, clip_high)
    # A > 0: a ratio above the range is capped; A < 0: one below it
    clipped = torch.where(advantages > 0, log_ratio.minimum(clamped), log_ratio.maximum(clamped))
    lengths = mask.sum(1, True).clamp(min=1)
    ratio = torch.exp((clipped * mask).sum(1, True) / lengths)  # (B, 1)
    advantage = (advantages * mask).sum(1, True) / lengths  # (B, 1)
    loss = -advantage * ratio
    return loss.expand_as(log_ratio), ratio.expand_as(log_ratio), (clipped != log_ratio).float()


def loss_weights(mask, aggregation):
    """The weight (B, T) of each token in a minibatch's loss, from its loss mask: the
    loss is sum(per-token loss x weight). Counts are over every rank's minibatch."""
    if aggregation == "token":
        # DAPO: every token of the minibatch weighs the same
        weights = mask
        count = mask.sum()
    elif aggregation == "sequence":
        # DeepSeekMath eq. 3: the mean of each response's tokens, then over the responses
        weights = mask / mask.sum(1, True).clamp(min=1)
        count = mask.any(1).sum()
    elif aggregation == "dr_grpo":
        # Dr. GRPO: a constant, responses x max length: no bias from the lengths
        weights = mask
        count = mask.new_tensor(mask.numel())
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}")
    return weights / all_reduce(count.float()).clamp(min=1)


def minibatch_rows(u, minibatch, share):
    """This rank's rows (local_prompts * share,) of one minibatch: a share of every group.
    u (local_prompts, G): the step's uniforms, which order each group's responses."""
    order = u.argsort(1)[:, minibatch * share :][:, :share]
    G = u.size(1)
    group_start = G * torch.arange(len(u), device=u.device)[:, None]
    return (order + group_start).flatten()


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


def entropy_control(entropy_coef, entropy_bonus, entropy_sum, mask, args):
    """With --entropy_target, the next step's coefficient and bonus (adaptive_entropy_coef)
    from the step's mean entropy over every rank's loss tokens; else both as they are."""
    if args.entropy_target is None:
        return entropy_coef, entropy_bonus
    totals = all_reduce(torch.stack([entropy_sum, mask.sum().double()]))
    mean_entropy = (totals[0] / totals[1].clamp(min=1)).item()
    return adaptive_entropy_coef(
        entropy_coef,
        mean_entropy,
        target=args.entropy_target,
        delta=args.entropy_coef_delta,
    )


def rows_of_every_rank(v, rank, world_size):
    """Every rank's rows of v, in rank order: an all-gather, as a sum of padded copies."""
    rows = len(v)
    padded = v.new_zeros((world_size * rows, *v.shape[1:]))
    padded[rank * rows : (rank + 1) * rows] = v
    return all_reduce(padded)


def dynamic_sampling(rollout, num_prompts, group_size, max_rounds, rank, world_size):
    """DAPO: rollout(round) until num_prompts groups (all ranks') have reward variance,
    max_rounds more at most. -> those, then zero-variance ones masked out, as one round;
    and this rank's rounds, all of them."""
    # this rank's rollouts, and every rank's
    rounds = []
    pool = []
    for round_ in range(1 + max_rounds):
        rounds.append(rollout(round_))
        gathered = {k: rows_of_every_rank(v, rank, world_size) for k, v in rounds[-1].items()}
        pool.append(gathered)
        scores = torch.cat([r["scores"] for r in pool])
        has_variance = ~zero_std_groups(scores, group_size)
        if has_variance.sum() >= num_prompts:
            break
    pool = {k: torch.cat([r[k] for r in pool]) for k in pool[0]}
    # the groups with variance first, in sampling order; rank r trains the r-th slice
    groups = torch.cat([has_variance.nonzero()[:, 0], (~has_variance).nonzero()[:, 0]])
    order = groups[:num_prompts].view(world_size, -1)[rank]
    batch = {}
    for k, v in pool.items():
        batch[k] = v.unflatten(0, (-1, group_size))[order].flatten(0, 1)
    # a zero-variance group, topping up the batch, is left out of the loss
    batch["mask"] *= has_variance[order].repeat_interleave(group_size)[:, None]
    sampled = {k: torch.cat([r[k] for r in rounds]) for k in rounds[0]}
    return batch, sampled


def sample_step(rollout_of, step, args, rank, world_size):
    """Steps 4.1-4.4 (rollout_of(step, round)): the step's batch, and every response sampled;
    DAPO's dynamic sampling repeats them and keeps the groups with reward variance."""
    if not args.dynamic_sampling:
        batch = rollout_of(step, 0)
        return batch, batch
    return dynamic_sampling(
        functools.partial(rollout_of, step),
        num_prompts=args.num_prompts_per_step,
        group_size=args.num_samples_per_prompt,
        max_rounds=args.max_sampling_rounds,
        rank=rank,
        world_size=world_size,
    )


@torch.no_grad()
def sync_reference(ref, policy, mix):
    """TR-DPO's refresh of π_ref, in place (Gorbatovski et al. 2024): π_ref ← mix π_θ +
    (1 - mix) π_ref, parameter by parameter; mix 1 is the hard update, a copy. Under FSDP2
    both models are sharded alike: each rank mixes its own shards, with no gather."""
    # A no-grad forward leaves an FSDP2 root gathered: its parameters are full tensors
    # until it is sharded again.
    for module in [*ref.modules(), *policy.modules()]:
        if isinstance(module, FSDPModule):
            module.reshard()
    for ref_param, param in zip(ref.parameters(), policy.parameters(), strict=True):
        # A DTensor's local shard is a view: writing it writes the parameter.
        if isinstance(ref_param, DTensor):
            ref_param = ref_param.to_local()
            param = param.to_local()
        if mix == 1:
            # The hard update, cast to π_ref's dtype (a frozen model's blocks are bf16 on CUDA).
            ref_param.copy_(param)
        else:
            # The soft update in fp32, rounded once to π_ref's dtype.
            ref_param.copy_(torch.lerp(ref_param.float(), param.float(), mix))


def kl_means(old_logprobs, ref_logprobs, teacher_logprobs, response_mask):
    """This rank's share of the per-token KLs over every response token, where there are the
    models: KL(pi_old || pi_ref) (k3, whatever the loss's estimator), and the student's reverse
    KL to the teacher (k1), what distillation lowers."""
    means = {}
    if ref_logprobs is not None:
        k3 = kl_penalty(old_logprobs, ref_logprobs, None, "k3")
        kl_sum = (k3 * response_mask).sum()
        means["objective/kl"] = kl_sum / all_reduce(response_mask.sum())
    if teacher_logprobs is not None:
        reverse_kl = ((old_logprobs - teacher_logprobs) * response_mask).sum()
        means["objective/teacher_kl"] = reverse_kl / all_reduce(response_mask.sum())
    return means


def variant_means(sampled, reward_fns, args, n_sampled):
    """This rank's share of the variants' own means over every response sampled: each reward
    function's score, RSO's rounds; and the groups dynamic sampling dropped (a count)."""
    means = {}
    for i, reward_fn in enumerate(reward_fns):
        fn_sum = sampled["reward_fn_scores"][:, i].sum()
        means[f"objective/reward_fn/{reward_fn.name}"] = fn_sum / n_sampled
    if "rso_rounds" in sampled:
        means["objective/rso_rounds"] = sampled["rso_rounds"].sum() / n_sampled
    if args.dynamic_sampling:
        zero_std = zero_std_groups(sampled["scores"], args.num_samples_per_prompt)
        means["objective/dropped_groups"] = zero_std.sum()
    return means


def make_surrogate(args):
    """--loss_type's surrogate, with its own parameters bound: each takes (log-ratio, advantages,
    mask) and returns the per-token loss, the ratio and where it was clipped (or gated)."""
    if args.loss_type == "ppo":
        return functools.partial(
            grpo_loss,
            clip_low=args.clip_eps_low,
            clip_high=args.clip_eps_high,
            dual_clip=args.dual_clip,
        )
    elif args.loss_type == "cispo":
        return functools.partial(cispo_loss, clip_high=args.clip_eps_high)
    elif args.loss_type == "sapo":
        return functools.partial(sapo_loss, tau_pos=args.sapo_tau_pos, tau_neg=args.sapo_tau_neg)
    elif args.loss_type == "gmpo":
        return functools.partial(
            gmpo_loss, clip_low=args.clip_eps_low, clip_high=args.clip_eps_high
        )
    raise ValueError(f"unknown loss type {args.loss_type!r}")


def token_advantages(
    scores, old_logprobs, ref_logprobs, teacher_logprobs, response_mask, mask, args, batch_size
):
    """The advantages (B, T) of --advantage: REINFORCE++'s returns, whitened over the batch; or a
    response's within its prompt's group (GRPO's or RLOO's, all on this rank), then, if asked,
    the batch's, on each of its tokens. With a teacher, plus its per-token judgement."""
    if args.advantage == "reinforce_plus_plus":
        advantages = reinforce_plus_plus_advantages(
            scores,
            logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            response_mask=response_mask,
            mask=mask,
            beta=args.beta,
        )
    else:
        G = args.num_samples_per_prompt
        advantages = group_advantages(scores, G, args.advantage, args.scale_rewards)
        if args.batch_norm_advantages:
            advantages = batch_normalise(advantages, batch_size)
        advantages = advantages[:, None].expand_as(mask)
    if teacher_logprobs is not None:
        # on-policy distillation: the teacher's per-token judgement, added to the reward's
        advantages = advantages + distillation_advantages(
            logprobs=old_logprobs,
            teacher_logprobs=teacher_logprobs,
            response_mask=response_mask,
            coef=args.teacher_coef,
        )
    return advantages


def sampled_means(scores, response, response_mask, eos, group_size, batch_size):
    """This rank's share (its sum / batch_size) of the means over every response sampled."""
    zero_std = zero_std_groups(scores, group_size).sum()
    return {
        "objective/scores": scores.sum() / batch_size,
        "objective/response_length": response_mask.sum() / batch_size,
        "val/stop_frac": (response == eos).any(1).sum() / batch_size,
        # the groups of equal rewards: no signal
        "objective/zero_std_frac": zero_std * group_size / batch_size,
    }


def clip_grad_norm(model, max_norm, step):
    """Clip the gradients' global norm (every rank's shards) to max_norm; the norm before
    clipping. A non-finite one stops the run, before the optimizer takes it."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # under FSDP2, a DTensor: the global norm is its full tensor
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if not torch.isfinite(norm):
        raise RunError(f"non-finite grad norm at step {step}: lower --lr (or --resume)")
    return norm


def check_args(args):
    """Every flag's problem, before any heavy work: one line naming the flag and the fix."""
    # whole numbers: sizes and intervals from 1, and from 0 where 0 means none or off
    at_least_1 = ["total_episodes", "num_prompts_per_step", "num_minibatches"]
    at_least_1 += ["num_epochs", "micro_batch_size", "response_length", "eval_every"]
    at_least_1 += ["log_every"]
    for flag in at_least_1:
        value = getattr(args, flag)
        if value < 1:
            raise RunError(f"--{flag} {value}: must be at least 1; pass a whole number")
    at_least_0 = ["seed", "overlong_buffer", "max_sampling_rounds", "keep_checkpoints"]
    at_least_0 += ["rejection_sampling_candidates", "eval_size", "eval_samples"]
    at_least_0 += ["ref_sync_every"]
    for flag in at_least_0:
        value = getattr(args, flag)
        if value < 0:
            raise RunError(f"--{flag} {value}: must be >= 0; pass a whole number")
    # real numbers: finite, then positive or >= 0 where the sign matters
    finite = ["lr", "max_grad_norm", "temperature", "beta", "clip_eps_low"]
    finite += ["clip_eps_high", "dual_clip", "missing_eos_penalty", "overlong_penalty"]
    finite += ["entropy_coef", "entropy_target", "entropy_coef_delta", "rso_temperature"]
    finite += ["sampler_cap", "teacher_coef"]
    finite += ["sapo_tau_pos", "sapo_tau_neg"]
    for flag in finite:
        value = getattr(args, flag)
        if value is not None and not math.isfinite(value):
            raise RunError(f"--{flag} {value}: not a finite number; pass one")
    for flag in ["max_grad_norm", "temperature", "rso_temperature", "sapo_tau_pos", "sapo_tau_neg"]:
        value = getattr(args, flag)
        if value <= 0:
            raise RunError(f"--{flag} {value}: must be > 0; pass a positive number")
    at_least_0 = ["lr", "beta", "clip_eps_low", "clip_eps_high", "overlong_penalty"]
    at_least_0 += ["teacher_coef"]
    at_least_0 += ["entropy_coef", "entropy_coef_delta"]
    for flag in at_least_0:
        value = getattr(args, flag)
        if value < 0:
            raise RunError(f"--{flag} {value}: must be >= 0; pass 0 or a positive number")
    if args.sampler_cap < 1:
        cap = args.sampler_cap
        raise RunError(f"--sampler_cap {cap}: must be >= 1 (it bounds pi_old / pi_sampler)")
    weights = args.reward_weights
    if weights and len(weights) != len(args.reward_fn):
        counts = f"{len(weights)} for {len(args.reward_fn)} --reward_fn"
        raise RunError(f"--reward_weights: {counts}; pass one per --reward_fn (or none: 1 each)")
    for weight in weights:
        if not math.isfinite(weight):
            raise RunError(f"--reward_weights {weight}: not a finite number; pass one")
    # GMPO clips log-ratios: its floor exp(-clip_eps_low) is positive for any value
    if args.clip_eps_low >= 1 and args.loss_type != "gmpo":
        eps = args.clip_eps_low
        raise RunError(f"--clip_eps_low {eps}: must be < 1 (1 - it is the ratio's floor)")
    if args.top_k < 0:
        raise RunError(f"--top_k {args.top_k}: must be >= 0 (0: off); pass a whole number")
    if not 0 < args.top_p <= 1:
        raise RunError(f"--top_p {args.top_p}: must be in (0, 1] (1: off); pass e.g. 0.9")
    # the flags that depend on each other
    G = args.num_samples_per_prompt
    if G < 2:
        raise RunError(f"--num_samples_per_prompt {G}: a group needs >= 2; pass 2 or more")
    candidates = args.rejection_sampling_candidates
    if 0 < candidates < G:
        flag = f"--rejection_sampling_candidates {candidates}"
        raise RunError(f"{flag}: fewer than --num_samples_per_prompt {G}; raise it")
    buffer = args.overlong_buffer
    if buffer > args.response_length:
        limit = f"--response_length {args.response_length}"
        raise RunError(f"--overlong_buffer {buffer}: more than {limit}; lower it")
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise RunError(f"--dual_clip {args.dual_clip}: must be > 1; pass e.g. 3")
    if args.dual_clip is not None and args.loss_type != "ppo":
        raise RunError("--dual_clip caps PPO's loss: pass it with --loss_type ppo")
    if args.advantage == "reinforce_plus_plus" and args.kl_in_reward:
        raise RunError("--kl_in_reward: REINFORCE++ has the KL in its reward already; drop it")
    if args.advantage == "reinforce_plus_plus" and args.batch_norm_advantages:
        why = "REINFORCE++ whitens its advantages over the batch already"
        raise RunError(f"--batch_norm_advantages: {why}; drop it")
    mix = args.ref_sync_mix
    if not 0 < mix <= 1:
        raise RunError(f"--ref_sync_mix {mix}: α is in (0, 1]; 1 copies pi into pi_ref")
    if args.ref_sync_every and not (args.beta > 0 or args.ref_model):
        raise RunError("--ref_sync_every refreshes pi_ref: pass --beta > 0 (or --ref_model)")
    step = args.num_prompts_per_step * G
    if args.total_episodes < step:
        why = f"less than one step's {step} responses"
        raise RunError(f"--total_episodes {args.total_episodes}: {why}; raise it")
    if args.model == Args.model and not os.path.isdir(args.model):
        raise RunError("no SFT model at 'runs/sft/latest': run `python sft.py` or pass --model DIR")


def check_rewards(args, has_verifier, n_train):
    """The reward's problems, once the data is known: one line naming the flag and the fix."""
    use_verifier = args.verifier and has_verifier
    if not (use_verifier or args.reward_model or args.reward_fn or args.teacher_model):
        why = "no reward: no verifier (for this task, or --no_verifier)"
        raise RunError(f"{why}: pass --reward_model, --reward_fn or --teacher_model")
    if args.dynamic_sampling and not (use_verifier or args.reward_model or args.reward_fn):
        why = "drops groups of equal rewards, and with no reward every group is one"
        raise RunError(f"--dynamic_sampling {why}: add a reward or drop the flag")
    if args.eval_samples and not has_verifier:
        raise RunError("--eval_samples scores with the task's verifier: this run has none")
    if n_train < args.num_prompts_per_step:
        raise RunError(f"prompt_train has {n_train} prompts: lower --num_prompts_per_step")


def check_reference(args, ref_policy, policy):
    """--ref_sync_every mixes pi into pi_ref: a --ref_model must have the policy's shapes."""
    if not (args.ref_sync_every and args.ref_model):
        return
    ref_shapes = [p.shape for p in ref_policy.parameters()]
    if ref_shapes != [p.shape for p in policy.parameters()]:
        raise RunError("--ref_sync_every mixes pi into pi_ref: pass a --ref_model of its size")


def load_frozen(args, meta, policy, shard_frozen):
    """The frozen models, each None unless asked for: the reference (for beta > 0 or
    --ref_model), the reward model and the teacher."""
    ref_policy = None
    reward_model = None
    teacher = None
    if args.beta > 0 or args.ref_model:
        # `--model tiny`: the policy's random init again
        torch.manual_seed(args.seed)
        ref_policy = gpt2.load(args.ref_model or args.model, meta, shard=shard_frozen)
        check_reference(args, ref_policy, policy)
    if args.reward_model:
        reward_model = gpt2.load(args.reward_model, meta, head="saved", shard=shard_frozen)
    if args.teacher_model:
        teacher = gpt2.load(args.teacher_model, meta, shard=shard_frozen)
    return ref_policy, reward_model, teacher


def frozen_logprobs(step_logprobs, model, query, response):
    """A frozen model's log-probs of the step's responses (step_logprobs), or None without it."""
    if model is None:
        return None
    return step_logprobs(model, query, response)


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


def local_rows(x, rank, rows, device):
    """This rank's rows of an array over every rank's prompts (its contiguous share), as a
    tensor on the device."""
    return torch.from_numpy(x[rank * rows :][:rows]).to(device)


def sample_responses(policy, query, noise, chunk, group_size, pad, eos, args, ctx):
    """Responses (B, L) to the queries (B, Tq), sampled by inverting the uniforms noise (B, L),
    chunk rows at a time: RSO's many candidates per prompt take no more memory than G. A chunk's
    rows come in runs of group_size equal queries, each prefilled once. Also the sampler's
    log-probs (B, L), for the sampler-trainer correction."""
    responses = []
    logprobs = []
    with ctx:
        for q, u in zip(query.split(chunk), noise.split(chunk)):
            rollout = gpt2.generate(
                policy,
                q,
                pad_token_id=pad,
                max_new_tokens=noise.size(1),
                eos_token_id=eos,
                temperature=args.temperature,
                noise=u,
                top_k=args.top_k,
                top_p=args.top_p,
                group_size=group_size,
            )
            responses.append(rollout.response)
            logprobs.append(rollout.logprobs)
    return torch.cat(responses), torch.cat(logprobs)


def no_grad_logprobs(
    model, query, response, micro_batch_size, temperature, ctx, top_k=0, top_p=1.0
):
    """model's log-probs (B, Tr) of the step's responses at the sampling temperature, by
    micro-batches, no gradients: pi_old's (the trainer's forward, on the sampler's top-k and
    top-p distribution), pi_ref's and the teacher's (the full one)."""
    parts = []
    with torch.no_grad(), ctx:
        for q, r in zip(query.split(micro_batch_size), response.split(micro_batch_size)):
            parts.append(gpt2.logprobs(model, q, r, temperature, top_k=top_k, top_p=top_p)[0])
    return torch.cat(parts)


def no_grad_rewards(reward_model, query, response, micro_batch_size, pad, eos, ctx):
    """The reward model's scores (B,) of the step's responses, by micro-batches, no gradients.
    Each micro-batch's queries lose the left padding they all share."""
    parts = []
    with torch.no_grad(), ctx:
        for q, r in zip(query.split(micro_batch_size), response.split(micro_batch_size)):
            q = gpt2.trim_padding(q, None, pad)[0]
            parts.append(gpt2.get_reward(reward_model, q, r, pad, eos))
    return torch.cat(parts)


def make_eval(policy, args, meta, batch_size, micro_batch_size, ctx):
    """The eval, a function of no arguments (as CleanRL's make_env returns a thunk): greedy
    accuracy on prompt_test where the task has a verifier, and preference accuracy on the
    held-out pairs where the data has them, against the policy as it is now (before any
    --resume): the pairs' log-probs under it are taken here. With --eval_samples, pass@k and
    mean@n of the training sampler too."""
    test = data.load_split(args.data, "prompt_test")
    pref = data.eval_split(args.data, "pref_test", args.eval_size)  # None where absent
    n_pairs = len(pref["query"]) if pref else 0
    ref_pair_logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)
    has_verifier = meta.get("task") in ("arithmetic", "gsm8k")

    def evaluate():
        metrics = {}
        if has_verifier and args.eval_size:
            metrics["eval/accuracy"] = data.greedy_accuracy(
                policy,
                test,
                meta,
                eval_size=args.eval_size,
                batch_size=batch_size,
                response_length=args.response_length,
                ctx=ctx,
            )
        if has_verifier and args.eval_size and args.eval_samples:
            metrics |= data.sampled_accuracy(
                policy,
                test,
                meta,
                eval_size=args.eval_size,
                batch_size=batch_size,
                response_length=args.response_length,
                ctx=ctx,
                samples=args.eval_samples,
                temperature=args.temperature,
                seed=args.seed,
                top_k=args.top_k,
                top_p=args.top_p,
            )
        if n_pairs:
            logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)
            accuracy = data.preference_accuracy(logps, ref_pair_logps)
            metrics["eval/preference_accuracy"] = accuracy
        return metrics

    return evaluate


def score(
    query,
    response,
    truth,
    reward_model,
    reward_fns,
    reward_weights,
    meta,
    args,
    micro_batch_size,
    ctx,
):
    """The scores (B,) of the step's responses: the verifier's, the reward model's and the
    reward functions' weighted sum (float64 on the CPU, TRL's reward_weights), minus the
    missing-stop penalty, plus DAPO's overlong punishment. Also each function's own scores
    (B, F), for their metrics, or None."""
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    scores = torch.zeros(len(query), device=query.device)
    if args.verifier and meta.get("task") in ("arithmetic", "gsm8k"):
        correct = data.verify_batch(meta, response.tolist(), truth)
        scores += torch.tensor(correct).to(query.device)
    if reward_model is not None:
        scores += no_grad_rewards(reward_model, query, response, micro_batch_size, pad, eos, ctx)
    fn_scores = None
    if reward_fns:
        fn_scores = data.rewards.reward_fn_scores(reward_fns, meta, query, response, truth)
        weighted = (fn_scores * reward_weights).sum(1)
        scores += weighted.to(query.device, torch.float32)
        fn_scores = fn_scores.to(query.device, torch.float32)
    if args.missing_eos_penalty is not None:
        stopped = (response == eos).any(1)
        scores -= args.missing_eos_penalty * (~stopped).float()
    if args.overlong_buffer:
        # DAPO's soft overlong punishment
        scores += overlong_penalty(
            lengths=gpt2.response_mask(response, eos).sum(1),
            max_length=args.response_length,
            buffer=args.overlong_buffer,
            penalty=args.overlong_penalty,
        )
    return scores, fn_scores


def rollout(
    step,
    round_,
    policy,
    train,
    meta,
    reward_model,
    reward_fns,
    reward_weights,
    args,
    rank,
    world_size,
    micro_batch_size,
    ctx,
):
    """Steps 4.1-4.4 of main: generate and score responses to this rank's share of a step's
    prompts, and RSO's selection. round_ > 0: dynamic sampling's later rounds, on other
    prompts. -> the batch: a dict of tensors with a row per response."""
    num_prompts = args.num_prompts_per_step
    local_prompts = num_prompts // world_size
    G = args.num_samples_per_prompt
    N = args.rejection_sampling_candidates or G
    local_batch_size = local_prompts * G
    n_train = len(train["query"])
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    device = next(policy.parameters()).device
    # 4.1 prompts: this rank's contiguous share of the step's slice of one permutation
    # per epoch, N copies of each; a later round: a fresh permutation
    order = data.batch_indices(args.seed, step, n_train, num_prompts)
    if round_ > 0:
        order = np.random.default_rng([args.seed, step, round_, 5]).permutation(n_train)
    prompt_idx = order[rank * local_prompts :][:local_prompts]
    query = torch.from_numpy(train["query"][prompt_idx]).to(device)
    query = query.repeat_interleave(N, 0)
    # 4.2 generate with the step's global uniforms: the same samples at any rank count
    rng = np.random.default_rng([args.seed, step, round_, 2])
    noise = rng.random((num_prompts, N, args.response_length), np.float32)
    noise = local_rows(noise, rank, local_prompts, device).flatten(0, 1)
    response, sampler_logprobs = sample_responses(
        policy,
        query,
        noise,
        chunk=local_batch_size,
        group_size=math.gcd(local_batch_size, N),
        pad=pad,
        eos=eos,
        args=args,
        ctx=ctx,
    )
    # 4.3 score, and the loss's tokens: every response token, stop included; with
    # DAPO's overlong filtering, none of a response that never stops
    truth = np.repeat(train["ground_truth"][prompt_idx], N)
    scores, fn_scores = score(
        query,
        response,
        truth,
        reward_model=reward_model,
        reward_fns=reward_fns,
        reward_weights=reward_weights,
        meta=meta,
        args=args,
        micro_batch_size=micro_batch_size,
        ctx=ctx,
    )
    response_mask = gpt2.response_mask(response, eos)
    mask = response_mask
    if args.mask_truncated:
        mask = response_mask & (response == eos).any(1)[:, None]
    batch = dict(
        query=query,
        response=response,
        mask=mask.float(),
        sampler_logprobs=sampler_logprobs,
        response_mask=response_mask.float(),
        scores=scores,
    )
    if fn_scores is not None:
        batch["reward_fn_scores"] = fn_scores  # (B, F)
    # 4.4 RSO: keep G of the N candidates, with uniforms keyed as the noise is
    if args.rejection_sampling_candidates:
        rng = np.random.default_rng([args.seed, step, round_, 4])
        uniforms = local_rows(rng.random((num_prompts, G, N)), rank, local_prompts, device)
        rows, rso_rounds = rso_rows(scores, G, args.rso_temperature, uniforms)
        batch = {k: v[rows] for k, v in batch.items()}
        batch["rso_rounds"] = rso_rounds
    return batch


def main(args: Args):
    # 1. sizes, distributed setup, seeds
    check_args(args)
    rank, world_size, device = setup_distributed()
    num_prompts = args.num_prompts_per_step
    G = args.num_samples_per_prompt
    local_prompts = data.exact_div(num_prompts, world_size, "--num_prompts_per_step or the ranks")
    # responses a step, over all ranks and on this one
    batch_size = num_prompts * G
    local_batch_size = local_prompts * G
    # a minibatch takes `share` responses of every group
    share = data.exact_div(G, args.num_minibatches, "--num_minibatches")
    micro_batch_size = min(args.micro_batch_size, local_prompts * share)
    data.exact_div(local_prompts * share, micro_batch_size, "--micro_batch_size")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    # when bf16 is off, autocast is a no-op
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    correction = correction_mode(args.sampler_correction, bf16)
    torch.manual_seed(args.seed)

    # 2. data, and its reward: the verifier, a reward model, reward functions, a teacher
    meta = data.load_meta(args.data)
    train = data.load_split(args.data, "prompt_train")
    eos = meta["eos_token_id"]
    n_train = len(train["query"])
    has_verifier = meta.get("task") in ("arithmetic", "gsm8k")
    check_rewards(args, has_verifier, n_train)
    reward_fns = data.rewards.load_reward_fns(args.reward_fn)
    weights = args.reward_weights or [1.0] * len(reward_fns)
    reward_weights = torch.tensor(weights, dtype=torch.float64)

    # 3. models, before the run dir (a bad --model leaves none). Frozen: the reference, the
    # reward model and the teacher.
    shard_trained = functools.partial(shard, device=device, bf16=bf16)
    shard_frozen = functools.partial(shard, device=device, bf16=bf16, frozen=True)
    policy = gpt2.load(args.model, meta, shard=shard_trained)
    data.check_context(train, policy.config.block_size, args.response_length)
    ref_policy, reward_model, teacher = load_frozen(args, meta, policy, shard_frozen)
    policy.activation_checkpointing = args.activation_checkpointing
    for model in (policy, ref_policy, reward_model, teacher):
        if model is not None:
            model.packing = args.packing
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    # the loss's forward passes
    fwd_policy = torch.compile(policy) if args.compile else policy
    args.out_dir = start_run(args, "grpo_variants")
    # the eval: its preference accuracy's reference is the policy as loaded
    evaluate = make_eval(policy, args, meta, local_batch_size, micro_batch_size, ctx)
    models = {"policy": (policy, optimizer)}
    if args.ref_sync_every:
        # a refreshed pi_ref is part of the run's state: the checkpoint holds it (no optimizer)
        models["reference"] = (ref_policy, None)
    state = {"step": 0}
    if args.resume:
        state = load_checkpoint(args.out_dir, models)
    start = state["step"]
    # The entropy bonus: Skywork-OR1's coefficient, and the one applied (with a target: none
    # until the entropy is below it).
    entropy_coef = state.get("entropy_coef", args.entropy_coef)
    bonus = args.entropy_coef * (args.entropy_target is None)
    entropy_bonus = state.get("entropy_bonus", bonus)
    if start == 0:
        # the starting point
        metrics = evaluate()
        if metrics:
            log_metrics(args, 0, metrics, SHOW)

    # 4. training loop: generate -> score -> advantages -> update -> log
    # steps 4.1-4.4 of a step and a round
    rollout_of = functools.partial(
        rollout,
        policy=policy,
        train=train,
        meta=meta,
        reward_model=reward_model,
        reward_fns=reward_fns,
        reward_weights=reward_weights,
        args=args,
        rank=rank,
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        ctx=ctx,
    )
    # the step's log-probs under a model, by micro-batches, no gradients
    step_logprobs = functools.partial(
        no_grad_logprobs, micro_batch_size=micro_batch_size, temperature=args.temperature, ctx=ctx
    )
    surrogate = make_surrogate(args)
    # REINFORCE++ and --kl_in_reward put the KL in the reward: none in the loss
    reinforce_plus_plus = args.advantage == "reinforce_plus_plus"
    kl_in_loss = not (args.kl_in_reward or reinforce_plus_plus)
    # pi_old before the first update: for more than one update, or for the advantages
    in_advantages = args.kl_in_reward or reinforce_plus_plus or args.teacher_model
    recompute_old = args.num_minibatches * args.num_epochs > 1 or in_advantages
    entropy_in_loss = args.entropy_coef > 0 or args.entropy_target is not None
    num_steps = args.total_episodes // batch_size
    t0 = time.time()
    t0_step = start
    for step in range(start, num_steps):
        done = step + 1
        eval_now = done % args.eval_every == 0 or done == num_steps
        log_now = done % args.log_every == 0 or step == start or eval_now

        # 4.1-4.4 prompts, generate, score, RSO: the batch, and every response sampled
        batch, sampled = sample_step(rollout_of, step, args, rank, world_size)
        query = batch["query"]
        response = batch["response"]
        # the loss's tokens; and every response token, stop included
        mask = batch["mask"]
        response_mask = batch["response_mask"]
        scores = batch["scores"]

        # 4.5 log-probs: pi_old's, the trainer's (not the sampler's), on the sampler's top-k and
        # top-p distribution: a no-grad forward pass now where the batch feeds more than one
        # update (TRL's rule) or the advantages need it, and the first minibatch's own forward
        # for its rows (in 4.7); pi_ref's and the teacher's on the full one
        old_logprobs = torch.zeros_like(response_mask)
        if recompute_old:
            old_logprobs = step_logprobs(
                fwd_policy, query, response, top_k=args.top_k, top_p=args.top_p
            )
        ref_logprobs = frozen_logprobs(step_logprobs, ref_policy, query, response)
        teacher_logprobs = frozen_logprobs(step_logprobs, teacher, query, response)
        if args.kl_in_reward and ref_logprobs is not None:
            scores = kl_in_reward(scores, old_logprobs, ref_logprobs, response_mask, args.beta)

        # 4.6 advantages (B, T), one per token; distillation adds the teacher's judgement
        advantages = token_advantages(
            scores,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            teacher_logprobs=teacher_logprobs,
            response_mask=response_mask,
            mask=mask,
            args=args,
            batch_size=batch_size,
        )

        # 4.7 update: num_epochs x num_minibatches optimizer steps, each on a share of every
        # group. The metrics sum over the loss's tokens: every epoch's (the entropy: the
        # first epoch's).
        sums = {}
        entropy_sum = 0
        grad_norms = []
        for epoch, minibatch in np.ndindex(args.num_epochs, args.num_minibatches):
            rng = np.random.default_rng([args.seed, step, epoch, 3])
            u = local_rows(rng.random((num_prompts, G)), rank, local_prompts, device)
            mb_idx = minibatch_rows(u, minibatch, share)
            mb_weights = loss_weights(mask[mb_idx], args.loss_aggregation)
            micro_idx = mb_idx.split(micro_batch_size)
            micro_weights = mb_weights.split(micro_batch_size)
            # the entropy: to log it, or for the bonus
            with_entropy = (log_now and epoch == 0) or entropy_in_loss
            for micro, idx in enumerate(micro_idx):
                if dist.is_initialized():
                    policy.set_requires_gradient_sync(micro == len(micro_idx) - 1)
                mb_mask = mask[idx]
                with ctx:
                    new_logprobs, entropy = gpt2.logprobs(
                        fwd_policy,
                        query[idx],
                        response[idx],
                        args.temperature,
                        entropy=with_entropy,
                        top_k=args.top_k,
                        top_p=args.top_p,
                    )
                # the first minibatch is on-policy: its pi_old is this forward's, detached
                if epoch == 0 and minibatch == 0:
                    old_logprobs[idx] = new_logprobs.detach()
                old = old_logprobs[idx]
                log_ratio = torch.where(mb_mask.bool(), new_logprobs - old, 0.0)
                # the loss: the surrogate (of GSPO's ratio, or the token's), weighed for the
                # sampler, plus beta x the KL, minus the entropy bonus
                is_log_ratio = importance_log_ratio(log_ratio, mb_mask, args.importance_level)
                pg_loss, ratio, clipped = surrogate(is_log_ratio, advantages[idx], mb_mask)
                pg_loss = corrected_loss(
                    pg_loss,
                    old_logprobs=old,
                    sampler_logprobs=batch["sampler_logprobs"][idx],
                    mask=mb_mask,
                    mode=correction,
                    cap=args.sampler_cap,
                )
                loss = pg_loss
                kl = None
                if ref_logprobs is not None and kl_in_loss:
                    mb_ref_logprobs = ref_logprobs[idx]
                    kl = kl_penalty(new_logprobs, mb_ref_logprobs, is_log_ratio, args.kl_estimator)
                    loss = loss + args.beta * kl
                if entropy_bonus:
                    loss = loss - entropy_bonus * entropy
                # FSDP2 averages the gradients over ranks: x world_size, their sum
                ((loss * micro_weights[micro]).sum() * world_size).backward()

                # then the metrics' sums over the loss's tokens
                with torch.no_grad():
                    per_token = {
                        "val/ratio": ratio,
                        "ratio_squared": ratio**2,
                        "loss/policy_avg": pg_loss,
                        "policy/approxkl_avg": 0.5 * log_ratio**2,
                        "policy/clipfrac_avg": clipped,
                    }
                    if kl is not None:
                        per_token["loss/kl_avg"] = kl
                    for name, value in per_token.items():
                        sums[name] = sums.get(name, 0) + (value.double() * mb_mask).sum()
                    if entropy is not None and epoch == 0:
                        entropy_sum = entropy_sum + (entropy.double() * mb_mask).sum()
            grad_norms.append(clip_grad_norm(policy, args.max_grad_norm, done))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # 4.8 log: means over the loss's tokens or every response sampled (every round's), of
        # all ranks: each rank's share of a mean, then the sum over ranks in one collective
        if log_now:
            loss_tokens = all_reduce(mask.sum().double()).clamp(min=1)
            divisor = loss_tokens * args.num_epochs
            local_means = {name: total / divisor for name, total in sums.items()}
            local_means["objective/entropy"] = entropy_sum / loss_tokens
            n_sampled = len(sampled["scores"]) * world_size
            local_means |= sampled_means(
                sampled["scores"],
                sampled["response"],
                sampled["response_mask"],
                eos,
                G,
                n_sampled,
            )
            local_means |= variant_means(sampled, reward_fns, args, n_sampled)
            local_means |= kl_means(old_logprobs, ref_logprobs, teacher_logprobs, response_mask)
            metrics = all_reduce_dict(local_means)
            metrics |= gap_metrics(
                old_logprobs, batch["sampler_logprobs"], mask, correction, args.sampler_cap
            )
            # Var[ratio] = E[ratio^2] - E[ratio]^2, which rounding can take a hair below 0
            ratio_squared = metrics.pop("ratio_squared")
            metrics["val/ratio_var"] = max(0.0, ratio_squared - metrics["val/ratio"] ** 2)
            metrics["train/grad_norm"] = torch.stack(grad_norms).mean().item()
            episodes = (done - t0_step) * batch_size
            metrics["perf/episodes_per_sec"] = episodes / (time.time() - t0)
            if args.dynamic_sampling:
                metrics["objective/sampling_rounds"] = n_sampled // batch_size
            if entropy_in_loss:
                metrics["policy/entropy_coef"] = entropy_bonus
            if eval_now:
                metrics |= evaluate()
            log_metrics(args, done, metrics, SHOW)

        # 4.9 Skywork-OR1's entropy controller, the reference's refresh, a checkpoint when due
        # or on SIGTERM
        entropy_coef, entropy_bonus = entropy_control(
            entropy_coef, entropy_bonus, entropy_sum, mask, args
        )
        # TR-DPO's refresh of pi_ref after this step's update (open-instruct's unit)
        if args.ref_sync_every and done % args.ref_sync_every == 0:
            sync_reference(ref_policy, policy, args.ref_sync_mix)
        extra = dict(entropy_coef=entropy_coef, entropy_bonus=entropy_bonus)
        checkpoint(args, done, models, device, due=eval_now, extra=extra)
        if log_now:
            # the rate leaves out eval and checkpoint time
            t0 = time.time()
            t0_step = done

    # 5. the final policy in the HF GPT-2 layout
    gpt2.save(policy, args.out_dir)
    finish_run(args, "grpo_variants")


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
