"""Group Relative Policy Optimization (GRPO): PPO without a value model.

Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), Sec. 4.1: sample G responses per
prompt, score them (the task's verifier, a reward.py model and/or --reward_fn), and give
every token of a response the group-normalised reward (r - mean) / std as its advantage.
The loss is PPO's clipped surrogate plus beta * KL(pi_theta || pi_ref), not a KL reward
as in PPO-RLHF. Later findings (KL estimators, DAPO, Dr. GRPO, GSPO, RLOO, CISPO, SAPO,
GMPO, REINFORCE++, dual-clip, entropy bonuses, RSO, batch std) are flags, each a branch of
a small function (docs/variants_grpo.md). Deviations: pi_old's log-probs are the sampler's
(the full tempered distribution), corrected for the sampler-trainer gap in bf16 (TIS); a
minibatch takes an equal share of each group, at any rank count.

    python grpo.py                                   # from runs/sft/latest, arithmetic verifier
    torchrun --nproc_per_node=2 grpo.py --beta 0.03  # a KL penalty, FSDP2 over 2 ranks
    python grpo.py --clip_eps_high 0.28 --dynamic_sampling --overlong_buffer 4  # DAPO
    python grpo.py --scale_rewards none --loss_aggregation dr_grpo             # Dr. GRPO
    python grpo.py --loss_type cispo --clip_eps_high 4  # CISPO, weights capped at 5 (ScaleRL's)
    python grpo.py --loss_type sapo --loss_aggregation sequence  # SAPO's soft gate
    python grpo.py --advantage reinforce_plus_plus --beta 0.01  # REINFORCE++: KL in the reward
    python grpo.py --reward_model runs/reward/latest --no_verifier --data DIR  # a learned reward
    python grpo.py --sampler_correction sequence_mask --sampler_cap 3  # TRL's correction
    python grpo.py --reward_fn experiments/reward_fns.py:closeness --reward_weights 0.5  # plug-in
    python grpo.py --rejection_sampling_candidates 64 --rso_temperature 2  # RSO: 8 kept of 64
    python grpo.py --beta 0.04 --ref_sync_every 10 --ref_sync_mix 0.6  # refresh pi_ref (TR-DPO)
    python grpo.py --resume --out_dir runs/grpo/<run>  # continue a run from its last checkpoint
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

# --sampler_correction's choices: TIS truncates pi_old / pi_sampler, MIS masks it
Correction = Literal[
    "auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
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
    out_dir: str = ""  # run directory; default a fresh runs/grpo/<time>-s<seed>
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
    recompute_old_logprobs: bool = False  # π_old from a forward pass, not the sampler's
    sampler_correction: Correction = "auto"  # weigh by π_old/π_sampler (auto: TIS in bf16)
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


# ----------------------------------------------------------------------------------------------
# GRPO: KL estimators, group advantages, the clipped surrogate and its aggregation

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
    # responses sampled per prompt: G, or RSO's N candidates of which G are kept
    N = args.rejection_sampling_candidates or G
    # a minibatch takes `share` responses of every group
    share = data.exact_div(G, args.num_minibatches, "--num_minibatches")
    micro_batch_size = min(args.micro_batch_size, local_prompts * share)
    data.exact_div(local_prompts * share, micro_batch_size, "--micro_batch_size")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    # when bf16 is off, autocast is a no-op
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    # The sampler-trainer correction: off in fp32, where both give the same log-probs.
    correction = args.sampler_correction
    if correction == "auto":
        correction = "token_truncate" if bf16 else "none"
    # It needs the trainer's pi_old for every minibatch: a step of several recomputes it.
    one_update = args.num_minibatches == 1 and args.num_epochs == 1
    recompute = args.recompute_old_logprobs or (correction != "none" and not one_update)
    torch.manual_seed(args.seed)

    # 2. data, and its reward: the task's verifier and/or a reward model
    meta = data.load_meta(args.data)
    train = data.load_split(args.data, "prompt_train")
    test = data.load_split(args.data, "prompt_test")
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    n_train = len(train["query"])
    # the task's verifier: a reward unless --no_verifier, and the eval's accuracy
    has_verifier = meta.get("task") in ("arithmetic", "gsm8k")
    use_verifier = args.verifier and has_verifier
    if not (use_verifier or args.reward_model or args.reward_fn or args.teacher_model):
        why = "no reward: no verifier (for this task, or --no_verifier)"
        raise RunError(f"{why}: pass --reward_model, --reward_fn or --teacher_model")
    if args.dynamic_sampling and not (use_verifier or args.reward_model or args.reward_fn):
        why = "drops groups of equal rewards, and with no reward every group is one"
        raise RunError(f"--dynamic_sampling {why}: add a reward or drop the flag")
    reward_fns = data.rewards.load_reward_fns(args.reward_fn)
    # the functions' scores add up weighted, in float64 on the CPU (TRL's reward_weights)
    weights = args.reward_weights or [1.0] * len(reward_fns)
    reward_weights = torch.tensor(weights, dtype=torch.float64)
    if args.eval_samples and not has_verifier:
        raise RunError("--eval_samples scores with the task's verifier: this run has none")
    if n_train < num_prompts:
        raise RunError(f"prompt_train has {n_train} prompts: lower --num_prompts_per_step")

    # 3. models, before the run dir (a bad --model leaves none). Frozen: the reference and
    # the reward model.
    shard_trained = functools.partial(shard, device=device, bf16=bf16)
    shard_frozen = functools.partial(shard, device=device, bf16=bf16, frozen=True)
    policy = gpt2.load(args.model, meta, shard=shard_trained)
    data.check_context(train, policy.config.block_size, args.response_length)
    ref_policy = None
    reward_model = None
    teacher = None
    if args.beta > 0 or args.ref_model:
        # `--model tiny`: the policy's random init again
        torch.manual_seed(args.seed)
        ref_policy = gpt2.load(args.ref_model or args.model, meta, shard=shard_frozen)
    if args.ref_sync_every and args.ref_model:
        ref_shapes = [p.shape for p in ref_policy.parameters()]
        if ref_shapes != [p.shape for p in policy.parameters()]:
            raise RunError("--ref_sync_every mixes pi into pi_ref: pass a --ref_model of its size")
    if args.reward_model:
        reward_model = gpt2.load(args.reward_model, meta, head="saved", shard=shard_frozen)
    if args.teacher_model:
        teacher = gpt2.load(args.teacher_model, meta, shard=shard_frozen)
    policy.activation_checkpointing = args.activation_checkpointing
    for model in (policy, ref_policy, reward_model, teacher):
        if model is not None:
            model.packing = args.packing
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    # the loss's forward passes
    fwd_policy = torch.compile(policy) if args.compile else policy
    # pi_theta's log-probs, on the distribution the sampler draws from: top-k and top-p's
    # tokens, renormalised, as pi_old's (gpt2.logprobs: trl#6789).
    forward = functools.partial(
        gpt2.logprobs,
        fwd_policy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    args.out_dir = start_run(args, "grpo")
    # eval/preference_accuracy's reference: the policy as loaded, before any --resume
    pref = data.eval_split(args.data, "pref_test", args.eval_size)  # None where absent
    n_pairs = len(pref["query"]) if pref else 0
    ref_pair_logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)
    models = {"policy": (policy, optimizer)}
    if args.ref_sync_every:
        # a refreshed pi_ref is part of the run's state: the checkpoint holds it (no optimizer)
        models["reference"] = (ref_policy, None)
    state = {"step": 0}
    if args.resume:
        state = load_checkpoint(args.out_dir, models)
    start = state["step"]
    # The entropy bonus: Skywork-OR1's coefficient, and the one applied (with a target:
    # none until the entropy is below it).
    entropy_coef = state.get("entropy_coef", args.entropy_coef)
    bonus = args.entropy_coef * (args.entropy_target is None)
    entropy_bonus = state.get("entropy_bonus", bonus)

    def local(x):
        """This rank's rows of an array over every rank's prompts, on the device."""
        return torch.from_numpy(x[rank * local_prompts :][:local_prompts]).to(device)

    def in_micro_batches(fn, query, response):
        """fn(query, response) by micro-batches, no gradients: rewards or log-probs."""
        outs = []
        queries = query.split(micro_batch_size)
        responses = response.split(micro_batch_size)
        with torch.no_grad(), ctx:
            for q, r in zip(queries, responses):
                q = gpt2.trim_padding(q, None, pad)[0]
                outs.append(fn(q, r))
        return torch.cat(outs)

    def reward_of(query, response):
        return gpt2.get_reward(reward_model, query, response, pad, eos)

    def ref_logprobs_of(query, response):
        # The reference's full tempered distribution, with no top-k or top-p: a token from the
        # policy's nucleus may lie outside the reference's, where a filtered log-prob would be
        # -inf; on the full one KL(pi_theta's nucleus || pi_ref) is finite (TRL, verl alike).
        return gpt2.logprobs(ref_policy, query, response, args.temperature)[0]

    def teacher_logprobs_of(query, response):
        # the teacher's full tempered distribution, as the reference's
        return gpt2.logprobs(teacher, query, response, args.temperature)[0]

    def old_logprobs_of(query, response):
        return forward(query, response)[0]

    def rollout(step, round_):
        """Generate and score responses to this rank's share of a step's prompts.
        round_ > 0: dynamic sampling's later rounds, on other prompts."""
        # the step's slice of one permutation per epoch; a later round: a fresh one
        order = data.batch_indices(args.seed, step, n_train, num_prompts)
        if round_ > 0:
            rng = np.random.default_rng([args.seed, step, round_, 5])
            order = rng.permutation(n_train)
        # rank r's contiguous share
        prompt_idx = order[rank * local_prompts :][:local_prompts]
        query = torch.from_numpy(train["query"][prompt_idx]).to(device)
        query = query.repeat_interleave(N, 0)

        # Generate with the step's global uniforms: the same samples at any rank count.
        # The sampler's log-probs are pi_old's. local_batch_size rows at a time: RSO's
        # N candidates take no more memory. A chunk's rows come in runs of equal queries,
        # `group` long (chunks and prompts both start at its multiples): one prefill per run.
        group = math.gcd(local_batch_size, N)
        rng = np.random.default_rng([args.seed, step, round_, 2])
        noise = local(rng.random((num_prompts, N, args.response_length), np.float32))
        noise = noise.flatten(0, 1)
        chunks = []
        with ctx:
            for q, u in zip(query.split(local_batch_size), noise.split(local_batch_size)):
                chunk = gpt2.generate(
                    policy,
                    q,
                    pad_token_id=pad,
                    max_new_tokens=args.response_length,
                    eos_token_id=eos,
                    temperature=args.temperature,
                    noise=u,
                    top_k=args.top_k,
                    top_p=args.top_p,
                    group_size=group,
                )
                chunks.append(chunk)
        # each chunk trimmed its own queries' padding: the queries are kept whole
        response = torch.cat([chunk.response for chunk in chunks])
        response_mask = torch.cat([chunk.mask for chunk in chunks])
        logprobs = torch.cat([chunk.logprobs for chunk in chunks])

        # score: the verifier, the reward model and/or the reward functions' weighted sum,
        # minus the missing-stop penalty
        stopped = (response == eos).any(1)
        scores = torch.zeros(len(query), device=device)
        truth = np.repeat(train["ground_truth"][prompt_idx], N)
        if use_verifier:
            correct = data.verify_batch(meta, response.tolist(), truth)
            scores += torch.tensor(correct).to(device)
        if reward_model is not None:
            scores += in_micro_batches(reward_of, query, response)
        if reward_fns:
            fn_scores = data.rewards.reward_fn_scores(reward_fns, meta, query, response, truth)
            weighted = (fn_scores * reward_weights).sum(1)
            scores += weighted.to(device, torch.float32)
        if args.missing_eos_penalty is not None:
            scores -= args.missing_eos_penalty * (~stopped).float()
        if args.overlong_buffer:
            # DAPO's soft overlong punishment
            scores += overlong_penalty(
                lengths=response_mask.sum(1),
                max_length=args.response_length,
                buffer=args.overlong_buffer,
                penalty=args.overlong_penalty,
            )
        # DAPO's overlong filtering: a response that never stops is out of the loss
        mask = response_mask
        if args.mask_truncated:
            mask = response_mask & stopped[:, None]
        batch = dict(
            query=query,
            response=response,
            mask=mask.float(),
            logprobs=logprobs,
            response_mask=response_mask.float(),
            scores=scores,
        )
        if reward_fns:
            # each function's own scores, for its metric
            batch["reward_fn_scores"] = fn_scores.to(device, torch.float32)  # (B, F)
        if args.rejection_sampling_candidates:
            # RSO: keep G of the N candidates, with uniforms keyed as the noise is
            rng = np.random.default_rng([args.seed, step, round_, 4])
            uniforms = local(rng.random((num_prompts, G, N)))
            candidates = scores.view(-1, N)
            keep, rounds = rso_select(candidates, G, args.rso_temperature, uniforms)
            # per response, for the metrics
            batch["rso_rounds"] = rounds.repeat_interleave(N)
            first_candidate = N * torch.arange(local_prompts, device=device)[:, None]
            rows = (keep + first_candidate).flatten()
            batch = {k: v[rows] for k, v in batch.items()}
        return batch

    def evaluate():
        """Greedy and sampled accuracy on prompt_test, and on the preference pairs."""
        metrics = {}
        if has_verifier and args.eval_size:
            metrics["eval/accuracy"] = data.greedy_accuracy(
                policy,
                test,
                meta,
                eval_size=args.eval_size,
                batch_size=local_batch_size,
                response_length=args.response_length,
                ctx=ctx,
            )
        if has_verifier and args.eval_size and args.eval_samples:
            metrics |= data.sampled_accuracy(
                policy,
                test,
                meta,
                eval_size=args.eval_size,
                batch_size=local_batch_size,
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

    # the status line's few numbers; metrics.jsonl has every one
    show = (
        "objective/scores",
        "objective/kl",
        "objective/teacher_kl",
        "eval/accuracy",
        "perf/episodes_per_sec",
    )
    if start == 0:
        # the starting point
        metrics = evaluate()
        if metrics:
            log_metrics(args.out_dir, 0, metrics, show)

    # 4. training loop: generate -> score -> advantages -> update -> log
    # the surrogate, with its own parameters: each takes (log-ratio, advantages, mask)
    if args.loss_type == "ppo":
        surrogate = functools.partial(
            grpo_loss,
            clip_low=args.clip_eps_low,
            clip_high=args.clip_eps_high,
            dual_clip=args.dual_clip,
        )
    elif args.loss_type == "cispo":
        surrogate = functools.partial(cispo_loss, clip_high=args.clip_eps_high)
    elif args.loss_type == "sapo":
        surrogate = functools.partial(
            sapo_loss, tau_pos=args.sapo_tau_pos, tau_neg=args.sapo_tau_neg
        )
    elif args.loss_type == "gmpo":
        surrogate = functools.partial(
            gmpo_loss, clip_low=args.clip_eps_low, clip_high=args.clip_eps_high
        )
    # REINFORCE++ and --kl_in_reward put the KL in the reward: none in the loss
    reinforce_plus_plus = args.advantage == "reinforce_plus_plus"
    kl_in_loss = not (args.kl_in_reward or reinforce_plus_plus)
    entropy_in_loss = args.entropy_coef > 0 or args.entropy_target is not None
    num_steps = args.total_episodes // batch_size
    t0 = time.time()
    t0_step = start
    for step in range(start, num_steps):
        done = step + 1
        eval_now = done % args.eval_every == 0 or done == num_steps
        log_now = done % args.log_every == 0 or step == start or eval_now

        # 4a. generate and score; DAPO's dynamic sampling repeats it and selects groups
        if args.dynamic_sampling:
            batch, sampled = dynamic_sampling(
                functools.partial(rollout, step),
                num_prompts=num_prompts,
                group_size=G,
                max_rounds=args.max_sampling_rounds,
                rank=rank,
                world_size=world_size,
            )
        else:
            batch = rollout(step, 0)
            sampled = batch
        query = batch["query"]
        response = batch["response"]
        # the loss's tokens; and every response token, stop included
        mask = batch["mask"]
        response_mask = batch["response_mask"]

        # 4b. the sampled tokens' log-probs: the sampler's; pi_old's once more if asked or
        # for the sampler correction; under pi_ref and the teacher, when there are ones
        sampler_logprobs = batch["logprobs"]
        old_logprobs = sampler_logprobs
        if recompute:
            old_logprobs = in_micro_batches(old_logprobs_of, query, response)
        ref_logprobs = None
        if ref_policy is not None:
            ref_logprobs = in_micro_batches(ref_logprobs_of, query, response)
        teacher_logprobs = None
        if teacher is not None:
            teacher_logprobs = in_micro_batches(teacher_logprobs_of, query, response)
        scores = batch["scores"]
        if args.kl_in_reward and ref_logprobs is not None:
            scores = kl_in_reward(scores, old_logprobs, ref_logprobs, response_mask, args.beta)

        # 4c. advantages (B, T), one per token: REINFORCE++'s returns, whitened over the
        # batch; or a response's, within its prompt's group (all on this rank), then the
        # batch's, on each of its tokens
        if reinforce_plus_plus:
            advantages = reinforce_plus_plus_advantages(
                scores,
                logprobs=old_logprobs,
                ref_logprobs=ref_logprobs,
                response_mask=response_mask,
                mask=mask,
                beta=args.beta,
            )
        else:
            advantages = group_advantages(scores, G, args.advantage, args.scale_rewards)
            if args.batch_norm_advantages:
                moments = torch.stack([advantages.sum(), advantages.square().sum()]).double()
                mean, mean_sq = all_reduce(moments) / batch_size
                std = (mean_sq - mean**2).sqrt()
                advantages = ((advantages - mean) / (std + 1e-8)).float()
            advantages = advantages[:, None].expand_as(mask)
        if teacher is not None:
            # on-policy distillation: the teacher's per-token judgement, added to the reward's
            advantages = advantages + distillation_advantages(
                logprobs=old_logprobs,
                teacher_logprobs=teacher_logprobs,
                response_mask=response_mask,
                coef=args.teacher_coef,
            )

        # 4d. update: num_epochs x num_minibatches optimizer steps, each on a share of
        # every group. The metrics sum over the loss's tokens: every epoch's (the
        # entropy: the first epoch's).
        sums = {}
        entropy_sum = 0
        grad_norms = []
        # the sampler-trainer gap, on the tokens whose pi_old is the trainer's
        gap_sums = {}
        gap_max = torch.zeros(2, device=device)
        for epoch, minibatch in np.ndindex(args.num_epochs, args.num_minibatches):
            rng = np.random.default_rng([args.seed, step, epoch, 3])
            u = local(rng.random((num_prompts, G)))
            # a share of each group
            order = u.argsort(1)[:, minibatch * share :][:, :share]
            group_start = G * torch.arange(local_prompts, device=device)[:, None]
            mb_idx = (order + group_start).flatten()
            mb_weights = loss_weights(mask[mb_idx], args.loss_aggregation)
            micro_idx = mb_idx.split(micro_batch_size)
            micro_weights = mb_weights.split(micro_batch_size)
            # the entropy: to log it, or for the bonus
            with_entropy = (log_now and epoch == 0) or entropy_in_loss
            for micro, idx in enumerate(micro_idx):
                if dist.is_initialized():
                    policy.set_requires_gradient_sync(micro == len(micro_idx) - 1)
                mb_query = query[idx]
                mb_response = response[idx]
                mb_mask = mask[idx]
                with ctx:
                    new_logprobs, entropy = forward(mb_query, mb_response, entropy=with_entropy)
                # the first minibatch is on-policy: its pi_old is this forward's, detached
                if epoch == 0 and minibatch == 0:
                    old = new_logprobs.detach()
                else:
                    old = old_logprobs[idx]
                log_ratio = torch.where(mb_mask.bool(), new_logprobs - old, 0.0)
                # pi_old / pi_sampler: the trainer's pi_old on the first minibatch, or when
                # recomputed; elsewhere pi_old is the sampler's (and the correction none)
                mb_sampler_logprobs = sampler_logprobs[idx]
                is_weights, is_ratio = sampler_correction(
                    old_logprobs=old,
                    sampler_logprobs=mb_sampler_logprobs,
                    mask=mb_mask,
                    mode=correction,
                    cap=args.sampler_cap,
                )

                # the loss: the surrogate, weighed for the sampler, plus beta x the KL, minus
                # the entropy bonus
                is_log_ratio = importance_log_ratio(log_ratio, mb_mask, args.importance_level)
                pg_loss, ratio, clipped = surrogate(is_log_ratio, advantages[idx], mb_mask)
                pg_loss = pg_loss * is_weights
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
                    if epoch == 0 and (minibatch == 0 or recompute):
                        gap, extremes = sampler_gap(
                            old_logprobs=old,
                            sampler_logprobs=mb_sampler_logprobs,
                            ratio=is_ratio,
                            mask=mb_mask,
                            cap=args.sampler_cap,
                        )
                        for name, total in gap.items():
                            gap_sums[name] = gap_sums.get(name, 0) + total
                        gap_max = torch.maximum(gap_max, extremes)
            params = policy.parameters()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            if not torch.isfinite(grad_norm):
                raise RunError(f"non-finite grad norm at step {done}: lower --lr (or --resume)")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # the global norm, before clipping
            grad_norms.append(grad_norm)

        # 4e. log: means over the loss's tokens or every response sampled, of all ranks
        if log_now:
            # each rank's share of a mean, then the sum over ranks in one collective
            local_means = {}
            loss_tokens = all_reduce(mask.sum().double()).clamp(min=1)
            for name, total in sums.items():
                local_means[name] = total / (loss_tokens * args.num_epochs)
            local_means["objective/entropy"] = entropy_sum / loss_tokens
            # every round's responses
            n_sampled = len(sampled["scores"]) * world_size
            local_means["objective/scores"] = sampled["scores"].sum() / n_sampled
            for i, reward_fn in enumerate(reward_fns):
                fn_sum = sampled["reward_fn_scores"][:, i].sum()
                local_means[f"objective/reward_fn/{reward_fn.name}"] = fn_sum / n_sampled
            lengths = sampled["response_mask"].sum()
            local_means["objective/response_length"] = lengths / n_sampled
            stops = (sampled["response"] == eos).any(1).sum()
            local_means["val/stop_frac"] = stops / n_sampled
            # the groups of equal rewards, which dynamic sampling drops
            zero_std = zero_std_groups(sampled["scores"], G).sum()
            local_means["objective/zero_std_frac"] = zero_std * G / n_sampled
            if args.dynamic_sampling:
                local_means["objective/dropped_groups"] = zero_std
            if "rso_rounds" in sampled:
                rso_rounds = sampled["rso_rounds"].sum()
                local_means["objective/rso_rounds"] = rso_rounds / n_sampled
            if ref_logprobs is not None:
                # KL(pi_old || pi_ref) per token: k3, whatever the loss's estimator
                k3 = kl_penalty(old_logprobs, ref_logprobs, None, "k3")
                kl_sum = (k3 * response_mask).sum()
                local_means["objective/kl"] = kl_sum / all_reduce(response_mask.sum())
            if teacher_logprobs is not None:
                # the student's reverse KL to the teacher per token (k1), what distillation lowers
                reverse_kl = ((old_logprobs - teacher_logprobs) * response_mask).sum()
                local_means["objective/teacher_kl"] = reverse_kl / all_reduce(response_mask.sum())
            gap_tokens = all_reduce(gap_sums["tokens"]).clamp(min=1)
            local_means["mismatch/k3_kl"] = gap_sums["k3"] / gap_tokens
            local_means["mismatch/outside_frac"] = gap_sums["outside"] / gap_tokens
            metrics = all_reduce_dict(local_means)
            if dist.is_initialized():
                dist.all_reduce(gap_max, op=dist.ReduceOp.MAX)
            ratio_max, inverse_max = gap_max.tolist()
            metrics["mismatch/ratio_max"] = ratio_max
            # no loss token at all: no ratio either
            metrics["mismatch/ratio_min"] = 1 / inverse_max if inverse_max > 0 else 0.0
            # Var[ratio] = E[ratio^2] - E[ratio]^2, which rounding can take a hair below 0
            ratio_squared = metrics.pop("ratio_squared")
            ratio_var = ratio_squared - metrics["val/ratio"] ** 2
            metrics["val/ratio_var"] = max(0.0, ratio_var)
            metrics["train/grad_norm"] = torch.stack(grad_norms).mean().item()
            episodes = (done - t0_step) * batch_size
            metrics["perf/episodes_per_sec"] = episodes / (time.time() - t0)
            if args.dynamic_sampling:
                metrics["objective/sampling_rounds"] = n_sampled // batch_size
            if entropy_in_loss:
                metrics["policy/entropy_coef"] = entropy_bonus
            if eval_now:
                metrics |= evaluate()
            log_metrics(args.out_dir, done, metrics, show)
        if args.entropy_target is not None:
            # the next step's coefficient, from this step's mean entropy (Skywork-OR1)
            totals = all_reduce(torch.stack([entropy_sum, mask.sum().double()]))
            mean_entropy = (totals[0] / totals[1].clamp(min=1)).item()
            entropy_coef, entropy_bonus = adaptive_entropy_coef(
                entropy_coef,
                mean_entropy,
                target=args.entropy_target,
                delta=args.entropy_coef_delta,
            )
        # TR-DPO's refresh of pi_ref after this step's update (open-instruct's unit)
        if args.ref_sync_every and done % args.ref_sync_every == 0:
            sync_reference(ref_policy, policy, args.ref_sync_mix)
        # a checkpoint when due, or on SIGTERM
        extra = dict(entropy_coef=entropy_coef, entropy_bonus=entropy_bonus)
        checkpoint(args, done, models, device, due=eval_now, extra=extra)
        if log_now:
            # the rate leaves out eval and checkpoint time
            t0 = time.time()
            t0_step = done

    # 5. the final policy in the HF GPT-2 layout, where pipeline.py looks
    gpt2.save(policy, args.out_dir)
    finish_run(args, "grpo")


# ----------------------------------------------------------------------------------------------
# ---- plumbing: identical in every script (tests/test_copies.py)
# torchrun, the run directory, resumable checkpoints, metrics: not the algorithm.
RunError = gpt2.RunError
MASTER = os.environ.get("RANK", "0") == "0"
# A cluster's preemption sends SIGTERM: every rank then saves at the same step
# (checkpoint).
SIGTERM = []


def setup_distributed():
    """(rank, world_size, device); under torchrun, a process group: nccl on CUDA, gloo on CPU."""
    gpt2.keep_freed_memory()
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
    atexit.register(dist.destroy_process_group)
    return rank, world_size, device


def start_run(args, algo):
    """Rank 0 claims the run dir: a fresh one, or --out_dir with --resume or --overwrite."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or f"runs/{algo}/{stamp}-s{args.seed}"
    claim = [None, None]
    if MASTER:
        claim = [claim_run_dir(out_dir, args, algo), out_dir]
    # Every rank takes rank 0's name: their clocks may differ.
    if dist.is_initialized():
        dist.broadcast_object_list(claim, src=0)
    problem, out_dir = claim
    if problem:
        raise RunError(problem)
    if MASTER and args.wandb:
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
    if MASTER:
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
    box = [newest_complete_checkpoint(out_dir, models) if MASTER else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    path = box[0]
    if path is None:
        raise RunError(f"--resume: no complete checkpoint in {out_dir}/checkpoints: drop --resume")
    state = torch.load(f"{path}/state.pt", weights_only=True)
    for name, (model, optimizer) in models.items():
        gpt2.load_weights(model, f"{path}/{name}", optimizer)
    if MASTER:
        print(f"resumed from {path} at step {state['step']}", flush=True)
        # The rows a killed run logged after this checkpoint will be logged again: cut
        # them, in one call, so that a kill leaves either every row or these. The rows
        # are in step order.
        rows = open(f"{out_dir}/metrics.jsonl", "rb").readlines()
        kept = [row for row in rows if json.loads(row)["step"] <= state["step"]]
        os.truncate(f"{out_dir}/metrics.jsonl", sum(len(row) for row in kept))
    return state


def log_metrics(out_dir, step, metrics, show):
    """Rank 0: one JSON row in metrics.jsonl (every metric) and one status line (`show`)."""
    if not MASTER:
        return
    with open(f"{out_dir}/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    status = " | ".join(f"{k} {metrics[k]:.4g}" for k in show if k in metrics)
    print(f"step {step:5d} | {status}", flush=True)
    if "wandb" in sys.modules:
        sys.modules["wandb"].log(metrics, step=step)


def finish_run(args, algo):
    """After the final save: runs/<algo>/latest, where the next stage looks, links this run."""
    if MASTER and os.path.dirname(args.out_dir) == f"runs/{algo}":
        # A new link under this process's own name, renamed over the old one: no reader
        # ever finds no link, and no other run shares the temporary name.
        link = f"runs/{algo}/.latest.{os.getpid()}"
        os.symlink(os.path.basename(args.out_dir), link)
        os.replace(link, f"runs/{algo}/latest")
    if MASTER and "wandb" in sys.modules:
        sys.modules["wandb"].finish()
    if dist.is_initialized():
        # gloo's threads can abort the interpreter's teardown: skip it.
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
