"""Group Relative Policy Optimization (GRPO): PPO without a value model.

Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), Sec. 4.1: sample G responses per
prompt, score them (the task's verifier and/or a reward.py model), and give every token of a
response the group-normalised reward (r - mean) / std as its advantage. The loss is PPO's
clipped surrogate plus beta * KL(pi_theta || pi_ref), the KL estimated per token (k1-k4).
With the knobs the project's studies use: RSO's rejection sampling (Liu et al. 2023) and
batch-whitened advantages, as the GPT-2 TL;DR recipe runs them, and epochs x minibatches.

pi_old is the trainer's, so that the sampler's rounding (a KV-cache decode, bf16 on a GPU)
never enters the ratio: the first minibatch takes its own forward's, and is exactly
on-policy; where a batch feeds more than one update (TRL's rule), one no-grad forward pass
over the step's batch before its first update gives the others theirs.
Deviations: the loss is the mean over the batch's tokens (DAPO's, TRL's default), not over
each response's tokens and then the responses (DeepSeekMath eq. 3); a minibatch takes an
equal share of every group, at any rank count. The field's variants (DAPO, Dr. GRPO, GSPO,
RLOO, REINFORCE++, CISPO, SAPO, GMPO, ...), reward functions and on-policy distillation are
grpo_variants.py: the same algorithm with them as flags, equal to this file at its defaults.

    python grpo.py                                   # from runs/sft/latest, arithmetic verifier
    torchrun --nproc_per_node=2 grpo.py --beta 0.03  # a KL penalty, FSDP2 over 2 ranks
    python grpo.py --beta 0.1 --kl_estimator k2      # another estimator of the KL
    python grpo.py --reward_model runs/reward/latest --no_verifier --data DIR  # a learned reward
    python grpo.py --rejection_sampling_candidates 64 --rso_temperature 2  # RSO: 8 kept of 64
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
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import data
import gpt2


@dataclass
class Args:
    model: str = "runs/sft/latest"  # policy to start: an SFT run dir, a preset, `tiny`
    ref_model: str = ""  # reference of the KL term; default the starting --model
    data: str = "arithmetic"  # `arithmetic` (built in) or `python -m data.prep`'s dir
    reward_model: str = ""  # a reward.py run dir; adds to the verifier's score
    verifier: bool = True  # score with the task's verifier (1 correct, 0 wrong)
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
    beta: float = 0.0  # KL coefficient (DeepSeekMath: 0.04; 0: no reference)
    kl_estimator: Literal["k1", "k2", "k3", "k4"] = "k3"  # the KL's per-token estimate
    clip_eps_low: float = 0.2  # the ratio is clipped below at 1 - this
    clip_eps_high: float = 0.2  # and above at 1 + this (DAPO's clip-higher: 0.28)
    missing_eos_penalty: float | None = None  # subtracted from a score if no stop token
    rejection_sampling_candidates: int = 0  # RSO: sample this many, keep G (0: off)
    rso_temperature: float = 2.0  # RSO's beta: keep w.p. exp((r - r_max) / this)
    batch_norm_advantages: bool = False  # whiten the advantages again over the batch
    eval_every: int = 50  # steps between evals (greedy accuracy) and checkpoints
    eval_size: int = 500  # held-out prompts for the eval accuracy (0: no eval)
    log_every: int = 1  # steps between status lines and metrics rows
    keep_checkpoints: int = 2  # resumable checkpoints kept in out_dir/checkpoints (>= 1)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA
    compile: bool = False  # torch.compile the policy for the loss's forward passes
    activation_checkpointing: bool = False  # recompute activations in backward
    packing: bool = True  # the real tokens only, packed into one row: no compute on padding
    wandb: bool = False  # also log to Weights & Biases (imported only when set)


# The status line's few numbers; metrics.jsonl has every one.
SHOW = ("objective/scores", "objective/kl", "eval/accuracy", "perf/episodes_per_sec")
# grpo_variants.py's flags, which this file leaves out: `python grpo.py --advantage rloo` is
# one line naming that file (parse_args).
MOVED = dict.fromkeys(
    "reward_fn reward_weights teacher_model teacher_coef top_k top_p kl_in_reward ref_sync_every "
    "ref_sync_mix loss_type dual_clip importance_level sapo_tau_pos sapo_tau_neg advantage "
    "scale_rewards loss_aggregation mask_truncated overlong_buffer overlong_penalty entropy_coef "
    "entropy_target entropy_coef_delta dynamic_sampling max_sampling_rounds sampler_correction "
    "sampler_cap eval_samples".split(),
    "grpo_variants.py",
)


# ----------------------------------------------------------------------------------------------
# GRPO: KL estimators, group advantages, RSO, the clipped surrogate and its weights

# The cap of |log pi_theta - log pi_ref| (open-instruct's): exp(40) is finite in bf16.
KL_CLAMP = 40.0


def kl_penalty(new_logprobs, ref_logprobs, log_ratio, estimator):
    """Estimates (B, T) of KL(pi_theta || pi_ref) at tokens sampled from pi_old,
    differentiable in new_logprobs (Schulman's note "Approximating KL divergence";
    which gradients are unbiased: docs/variants_grpo.md). log_ratio: the surrogate's
    log pi_theta / pi_old, k4's weight w. logr = log pi_theta / pi_ref is clamped: past
    ~88, k3's exp(-logr) is inf in fp32."""
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
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    return kl


def zero_std_groups(scores, group_size):
    """(P,) bool: the groups whose G rewards are all equal: no learning signal."""
    groups = scores.view(-1, group_size)
    return (groups == groups[:, :1]).all(1)


def group_advantages(scores, group_size):
    """(B,) scores of consecutive groups -> (B,) advantages (0 for equal rewards)."""
    rewards = scores.view(-1, group_size)
    # DeepSeekMath Sec. 4.1.2: a reward's distance from its group's mean, in its std
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True)
    advantages = (rewards - mean) / (std + 1e-4)
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


def grpo_loss(log_ratio, advantages, clip_low, clip_high):
    """PPO's clipped surrogate (B, T) of log pi_theta / pi_old and advantages (B, T), the
    ratio in [1 - clip_low, 1 + clip_high]; also the ratio and where it was clipped."""
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.max(pg_losses, pg_losses2)
    return loss, ratio, (pg_losses2 > pg_losses).float()


def token_weights(mask):
    """The weight (B, T) of each token in a minibatch's loss, from its loss mask: every token
    of the minibatch weighs the same (DAPO), counted over every rank's minibatch, so that the
    loss is sum(per-token loss x weight)."""
    return mask / all_reduce(mask.sum().float()).clamp(min=1)


def minibatch_rows(u, minibatch, share):
    """This rank's rows (local_prompts * share,) of one minibatch: a share of every group.
    u (local_prompts, G): the step's uniforms, which order each group's responses."""
    order = u.argsort(1)[:, minibatch * share :][:, :share]
    G = u.size(1)
    group_start = G * torch.arange(len(u), device=u.device)[:, None]
    return (order + group_start).flatten()


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
    at_least_0 = ["seed", "keep_checkpoints", "rejection_sampling_candidates", "eval_size"]
    for flag in at_least_0:
        value = getattr(args, flag)
        if value < 0:
            raise RunError(f"--{flag} {value}: must be >= 0; pass a whole number")
    # real numbers: finite, then positive or >= 0 where the sign matters
    finite = ["lr", "max_grad_norm", "temperature", "beta", "clip_eps_low"]
    finite += ["clip_eps_high", "missing_eos_penalty", "rso_temperature"]
    for flag in finite:
        value = getattr(args, flag)
        if value is not None and not math.isfinite(value):
            raise RunError(f"--{flag} {value}: not a finite number; pass one")
    for flag in ["max_grad_norm", "temperature", "rso_temperature"]:
        value = getattr(args, flag)
        if value <= 0:
            raise RunError(f"--{flag} {value}: must be > 0; pass a positive number")
    for flag in ["lr", "beta", "clip_eps_low", "clip_eps_high"]:
        value = getattr(args, flag)
        if value < 0:
            raise RunError(f"--{flag} {value}: must be >= 0; pass 0 or a positive number")
    if args.clip_eps_low >= 1:
        eps = args.clip_eps_low
        raise RunError(f"--clip_eps_low {eps}: must be < 1 (1 - it is the ratio's floor)")
    # the flags that depend on each other
    G = args.num_samples_per_prompt
    if G < 2:
        raise RunError(f"--num_samples_per_prompt {G}: a group needs >= 2; pass 2 or more")
    candidates = args.rejection_sampling_candidates
    if 0 < candidates < G:
        flag = f"--rejection_sampling_candidates {candidates}"
        raise RunError(f"{flag}: fewer than --num_samples_per_prompt {G}; raise it")
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


def local_rows(x, rank, rows, device):
    """This rank's rows of an array over every rank's prompts (its contiguous share), as a
    tensor on the device."""
    return torch.from_numpy(x[rank * rows :][:rows]).to(device)


def sample_responses(policy, query, noise, chunk, group_size, pad, eos, temperature, ctx):
    """Responses (B, L) to the queries (B, Tq), sampled by inverting the uniforms noise (B, L),
    chunk rows at a time: RSO's many candidates per prompt take no more memory than G. A chunk's
    rows come in runs of group_size equal queries, each prefilled once."""
    responses = []
    with ctx:
        for q, u in zip(query.split(chunk), noise.split(chunk)):
            rollout = gpt2.generate(
                policy,
                q,
                pad_token_id=pad,
                max_new_tokens=noise.size(1),
                eos_token_id=eos,
                temperature=temperature,
                noise=u,
                group_size=group_size,
            )
            responses.append(rollout.response)
    return torch.cat(responses)


def no_grad_logprobs(model, query, response, micro_batch_size, temperature, ctx):
    """model's log-probs (B, Tr) of the step's responses at the sampling temperature, by
    micro-batches, no gradients: pi_old's (the trainer's forward) and pi_ref's."""
    parts = []
    with torch.no_grad(), ctx:
        for q, r in zip(query.split(micro_batch_size), response.split(micro_batch_size)):
            parts.append(gpt2.logprobs(model, q, r, temperature)[0])
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
    --resume): the pairs' log-probs under it are taken here."""
    test = data.load_split(args.data, "prompt_test")
    pref = data.eval_split(args.data, "pref_test", args.eval_size)  # None where absent
    n_pairs = len(pref["query"]) if pref else 0
    ref_pair_logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)

    def evaluate():
        metrics = {}
        if meta.get("task") in ("arithmetic", "gsm8k") and args.eval_size:
            metrics["eval/accuracy"] = data.greedy_accuracy(
                policy,
                test,
                meta,
                eval_size=args.eval_size,
                batch_size=batch_size,
                response_length=args.response_length,
                ctx=ctx,
            )
        if n_pairs:
            logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)
            accuracy = data.preference_accuracy(logps, ref_pair_logps)
            metrics["eval/preference_accuracy"] = accuracy
        return metrics

    return evaluate


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
    torch.manual_seed(args.seed)

    # 2. data, and its reward: the task's verifier and/or a reward model
    meta = data.load_meta(args.data)
    train = data.load_split(args.data, "prompt_train")
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    n_train = len(train["query"])
    # the task's verifier: a reward unless --no_verifier (the eval's accuracy, always)
    use_verifier = args.verifier and meta.get("task") in ("arithmetic", "gsm8k")
    if not (use_verifier or args.reward_model):
        why = "no reward: no verifier (for this task, or --no_verifier)"
        raise RunError(f"{why}: pass --reward_model (grpo_variants.py: --reward_fn too)")
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
    if args.beta > 0 or args.ref_model:
        # `--model tiny`: the policy's random init again
        torch.manual_seed(args.seed)
        ref_policy = gpt2.load(args.ref_model or args.model, meta, shard=shard_frozen)
    if args.reward_model:
        reward_model = gpt2.load(args.reward_model, meta, head="saved", shard=shard_frozen)
    policy.activation_checkpointing = args.activation_checkpointing
    for model in (policy, ref_policy, reward_model):
        if model is not None:
            model.packing = args.packing
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    # the loss's forward passes
    fwd_policy = torch.compile(policy) if args.compile else policy
    args.out_dir = start_run(args, "grpo")
    # the eval: its preference accuracy's reference is the policy as loaded
    evaluate = make_eval(policy, args, meta, local_batch_size, micro_batch_size, ctx)
    models = {"policy": (policy, optimizer)}
    start = 0
    if args.resume:
        start = load_checkpoint(args.out_dir, models)["step"]

    if start == 0:
        # the starting point
        metrics = evaluate()
        if metrics:
            log_metrics(args, 0, metrics, SHOW)

    # 4. training loop: generate -> score -> advantages -> update -> log
    # the step's log-probs under a model, by micro-batches, no gradients
    step_logprobs = functools.partial(
        no_grad_logprobs, micro_batch_size=micro_batch_size, temperature=args.temperature, ctx=ctx
    )
    num_steps = args.total_episodes // batch_size
    t0 = time.time()
    t0_step = start
    for step in range(start, num_steps):
        done = step + 1
        eval_now = done % args.eval_every == 0 or done == num_steps
        log_now = done % args.log_every == 0 or step == start or eval_now

        # 4.1 prompts: this rank's contiguous share of the step's slice of one permutation
        # per epoch, N copies of each
        order = data.batch_indices(args.seed, step, n_train, num_prompts)
        prompt_idx = order[rank * local_prompts :][:local_prompts]
        query = torch.from_numpy(train["query"][prompt_idx]).to(device)
        query = query.repeat_interleave(N, 0)

        # 4.2 generate with the step's global uniforms: the same samples at any rank count
        rng = np.random.default_rng([args.seed, step, 0, 2])
        noise = rng.random((num_prompts, N, args.response_length), np.float32)
        noise = local_rows(noise, rank, local_prompts, device).flatten(0, 1)
        response = sample_responses(
            policy,
            query,
            noise,
            chunk=local_batch_size,
            group_size=math.gcd(local_batch_size, N),
            pad=pad,
            eos=eos,
            temperature=args.temperature,
            ctx=ctx,
        )
        # (B, Tr): every response token, stop included
        response_mask = gpt2.response_mask(response, eos).float()

        # 4.3 score: the verifier and/or the reward model, minus the missing-stop penalty
        scores = torch.zeros(len(query), device=device)
        if use_verifier:
            truth = np.repeat(train["ground_truth"][prompt_idx], N)
            correct = data.verify_batch(meta, response.tolist(), truth)
            scores += torch.tensor(correct).to(device)
        if reward_model is not None:
            scores += no_grad_rewards(
                reward_model, query, response, micro_batch_size, pad, eos, ctx
            )
        if args.missing_eos_penalty is not None:
            stopped = (response == eos).any(1)
            scores -= args.missing_eos_penalty * (~stopped).float()

        # 4.4 RSO: keep G of the N candidates, with uniforms keyed as the noise is
        rso_rounds = None
        if args.rejection_sampling_candidates:
            rng = np.random.default_rng([args.seed, step, 0, 4])
            uniforms = local_rows(rng.random((num_prompts, G, N)), rank, local_prompts, device)
            rows, rso_rounds = rso_rows(scores, G, args.rso_temperature, uniforms)
            query = query[rows]
            response = response[rows]
            response_mask = response_mask[rows]
            scores = scores[rows]

        # 4.5 log-probs: pi_old's, the trainer's (not the sampler's): a no-grad forward pass now
        # where the batch feeds more than one update (TRL's rule), and the first minibatch's own
        # forward for its rows (in 4.7); pi_ref's
        old_logprobs = torch.zeros_like(response_mask)
        if args.num_minibatches * args.num_epochs > 1:
            old_logprobs = step_logprobs(fwd_policy, query, response)
        ref_logprobs = None
        if ref_policy is not None:
            ref_logprobs = step_logprobs(ref_policy, query, response)

        # 4.6 advantages: a response's, within its prompt's group (all on this rank), then,
        # if asked, the batch's; on each of its tokens (B, T)
        advantages = group_advantages(scores, G)
        if args.batch_norm_advantages:
            advantages = batch_normalise(advantages, batch_size)
        advantages = advantages[:, None].expand_as(response_mask)

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
            mb_weights = token_weights(response_mask[mb_idx])
            micro_idx = mb_idx.split(micro_batch_size)
            micro_weights = mb_weights.split(micro_batch_size)
            for micro, idx in enumerate(micro_idx):
                if dist.is_initialized():
                    policy.set_requires_gradient_sync(micro == len(micro_idx) - 1)
                mb_mask = response_mask[idx]
                with ctx:
                    new_logprobs, entropy = gpt2.logprobs(
                        fwd_policy,
                        query[idx],
                        response[idx],
                        args.temperature,
                        entropy=log_now and epoch == 0,
                    )
                # the first minibatch is on-policy: its pi_old is this forward's, detached
                if epoch == 0 and minibatch == 0:
                    old_logprobs[idx] = new_logprobs.detach()
                old = old_logprobs[idx]
                log_ratio = torch.where(mb_mask.bool(), new_logprobs - old, 0.0)
                # the loss: the clipped surrogate plus beta x the KL to pi_ref
                pg_loss, ratio, clipped = grpo_loss(
                    log_ratio,
                    advantages[idx],
                    clip_low=args.clip_eps_low,
                    clip_high=args.clip_eps_high,
                )
                loss = pg_loss
                kl = None
                if ref_logprobs is not None:
                    kl = kl_penalty(new_logprobs, ref_logprobs[idx], log_ratio, args.kl_estimator)
                    loss = loss + args.beta * kl
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
                    if entropy is not None:
                        entropy_sum = entropy_sum + (entropy.double() * mb_mask).sum()
            grad_norms.append(clip_grad_norm(policy, args.max_grad_norm, done))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # 4.8 log: means over the loss's tokens or the responses, of all ranks: each rank's
        # share of a mean, then the sum over ranks in one collective
        if log_now:
            loss_tokens = all_reduce(response_mask.sum().double()).clamp(min=1)
            divisor = loss_tokens * args.num_epochs
            local_means = {name: total / divisor for name, total in sums.items()}
            local_means["objective/entropy"] = entropy_sum / loss_tokens
            local_means |= sampled_means(scores, response, response_mask, eos, G, batch_size)
            if rso_rounds is not None:
                local_means["objective/rso_rounds"] = rso_rounds.sum() / batch_size
            if ref_logprobs is not None:
                # KL(pi_old || pi_ref) per token: k3, whatever the loss's estimator
                k3 = kl_penalty(old_logprobs, ref_logprobs, None, "k3")
                kl_sum = (k3 * response_mask).sum()
                local_means["objective/kl"] = kl_sum / all_reduce(response_mask.sum())
            metrics = all_reduce_dict(local_means)
            # Var[ratio] = E[ratio^2] - E[ratio]^2, which rounding can take a hair below 0
            ratio_squared = metrics.pop("ratio_squared")
            metrics["val/ratio_var"] = max(0.0, ratio_squared - metrics["val/ratio"] ** 2)
            metrics["train/grad_norm"] = torch.stack(grad_norms).mean().item()
            episodes = (done - t0_step) * batch_size
            metrics["perf/episodes_per_sec"] = episodes / (time.time() - t0)
            if eval_now:
                metrics |= evaluate()
            log_metrics(args, done, metrics, SHOW)

        # 4.9 a checkpoint when due, or on SIGTERM
        checkpoint(args, done, models, device, due=eval_now)
        if log_now:
            # the rate leaves out eval and checkpoint time
            t0 = time.time()
            t0_step = done

    # 5. the final policy in the HF GPT-2 layout, where pipeline.py looks
    gpt2.save(policy, args.out_dir)
    finish_run(args, "grpo")


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
