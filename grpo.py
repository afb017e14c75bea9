"""Group Relative Policy Optimization (GRPO): PPO without a value model, advantages from groups.

Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), Sec. 4.1: sample G responses per prompt,
score them (the task's verifier and/or a reward model from reward.py), give every token of a
response the group-normalised reward (r - mean) / std as its advantage; the loss is PPO's clipped
surrogate plus beta * KL(pi_theta || pi_ref), not a KL reward as in PPO-RLHF. Later findings (KL
estimators, DAPO, Dr. GRPO, GSPO, RLOO, CISPO, dual-clip, entropy bonuses, RSO, batch std) are
flags picking small functions (docs/variants_grpo.md). Deviations: pi_old's log-probs are the
sampler's (full tempered distribution); minibatches: equal shares of each group, any rank count.

    python grpo.py                                   # from runs/sft/latest, arithmetic verifier
    torchrun --nproc_per_node=2 grpo.py --beta 0.03  # a KL penalty, FSDP2 over 2 ranks
    python grpo.py --clip_eps_high 0.28 --dynamic_sampling --overlong_buffer 4  # DAPO
    python grpo.py --scale_rewards none --loss_aggregation dr_grpo             # Dr. GRPO
    python grpo.py --loss_type cispo --clip_eps_high 4  # CISPO, weights capped at 5 (ScaleRL's)
    python grpo.py --reward_model runs/reward/latest --no-verifier --data DIR  # a learned reward
    python grpo.py --rejection_sampling_candidates 64 --rso_temperature 2  # RSO: 8 kept of 64
    python grpo.py --resume --out_dir runs/grpo/<run>  # continue a run from its last checkpoint
"""

import atexit
import datetime
import fcntl
import functools
import glob
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass

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
    model: str = "runs/sft/latest"  # policy to start from: an SFT run dir, a preset or `tiny`
    ref_model: str = ""  # reference of the KL term; default the starting --model
    data: str = "arithmetic"  # `arithmetic` (built-in, offline) or a dir from `python -m data.prep`
    reward_model: str = ""  # reward model dir from reward.py; adds to the verifier's score
    verifier: bool = True  # score with the task's verifier (1 correct, 0 wrong)
    out_dir: str = ""  # run directory; default a fresh runs/grpo/<time>-s<seed>
    overwrite: bool = False  # delete the run already in --out_dir and start afresh
    resume: bool = False  # continue the run in --out_dir from its last complete checkpoint
    seed: int = 1  # seed of prompt order, sampling and minibatches
    lr: float = 1e-5  # learning rate (constant; pretrained GPT-2: ~1e-6)
    max_grad_norm: float = 1.0  # gradient clipping threshold on the global gradient norm
    total_episodes: int = 51200  # responses sampled over the run
    num_prompts_per_step: int = 32  # prompts per step, over all ranks
    num_samples_per_prompt: int = 8  # group size G: responses per prompt (>= 2)
    num_minibatches: int = 4  # optimizer steps per epoch (each takes a share of every group)
    num_epochs: int = 1  # PPO epochs over each batch of samples (DeepSeekMath: 1)
    micro_batch_size: int = 64  # sequences per forward pass on one rank
    response_length: int = 16  # max new tokens per response
    temperature: float = 1.0  # sampling temperature; the loss's log-probs use it too
    beta: float = 0.0  # KL coefficient (DeepSeekMath: 0.04; 0: no reference)
    kl_estimator: str = "k3"  # per-token KL estimate: k1, k2, k3 (DeepSeekMath), k4 or k3_ratio
    kl_in_reward: bool = False  # beta's KL (k1) in the reward, not in the loss (RLOO, verl)
    loss_type: str = "ppo"  # `ppo` (the clipped surrogate) or `cispo` (MiniMax-M1)
    clip_eps_low: float = 0.2  # the ratio is clipped below at 1 - clip_eps_low (PPO: 0.2)
    clip_eps_high: float = 0.2  # ratio clipped above at 1 + this (DAPO: 0.28; CISPO's cap)
    dual_clip: float | None = None  # cap a token's loss at -this x A where A < 0 (verl: 3.0)
    importance_level: str = "token"  # `token` ratios or `sequence` (GSPO)
    advantage: str = "grpo"  # `grpo` (r - group mean [/ std]) or `rloo` (leave one out)
    scale_rewards: str = "group"  # divide r - group mean by the `group`'s std, `batch`'s or `none`
    batch_norm_advantages: bool = False  # whiten the advantages once more over the global batch
    loss_aggregation: str = "token"  # `token` (DAPO), `sequence` (DeepSeekMath) or `dr_grpo`
    mask_truncated: bool = False  # leave responses with no stop token out of the loss (DAPO)
    missing_eos_penalty: float | None = None  # subtracted from the score of a response with no stop
    overlong_buffer: int = 0  # DAPO's soft overlong punishment over the last this many tokens
    overlong_penalty: float = 1.0  # --overlong_buffer's penalty at --response_length
    entropy_coef: float = 0.0  # the loss minus this x the token mean entropy (an entropy bonus)
    entropy_target: float | None = None  # adapt --entropy_coef toward this entropy (Skywork-OR1)
    entropy_coef_delta: float = 0.005  # --entropy_target's step of the coefficient per step
    dynamic_sampling: bool = False  # resample groups with equal rewards (DAPO)
    max_sampling_rounds: int = 4  # --dynamic_sampling's extra rounds per step at most
    rejection_sampling_candidates: int = 0  # RSO: sample this many per prompt, keep G (0: off)
    rso_temperature: float = 2.0  # RSO's beta: a candidate is kept w.p. exp((r - r_max) / this)
    recompute_old_logprobs: bool = False  # π_old from a forward pass, not the sampler's
    eval_every: int = 50  # steps between evals (greedy accuracy on prompt_test) and checkpoints
    eval_size: int = 500  # held-out prompts for the eval accuracy (0: no eval)
    eval_samples: int = 0  # also sampled pass@k and mean@n, n samples per eval prompt (0: off)
    log_every: int = 1  # steps between status lines and metrics rows
    keep_checkpoints: int = 2  # resumable checkpoints kept in out_dir/checkpoints (at least 1)
    dtype: str = "auto"  # `auto` (bf16 on CUDA, fp32 on CPU), `float32` or `bfloat16`
    compile: bool = False  # torch.compile the policy for the loss's forward passes
    activation_checkpointing: bool = False  # recompute block activations in backward to save memory
    wandb: bool = False  # also log to Weights & Biases (imported only when set)


# ----------------------------------------------------------------------------------------------
# GRPO: KL estimators, group advantages, the clipped surrogate and its aggregation

KL_CLAMP = 40.0  # |log pi_theta - log pi_ref| cap (open-instruct): exp(40) is finite in bf16
KL_ESTIMATORS = {  # per token, of logr = log pi_theta / pi_ref and log_w = log pi_theta / pi_old
    "k1": lambda logr, log_w: logr,
    "k2": lambda logr, log_w: 0.5 * logr.square(),
    "k3": lambda logr, log_w: torch.expm1(-logr) + logr,
    "k4": lambda logr, log_w: torch.exp(log_w) * logr,
    "k3_ratio": lambda logr, log_w: torch.exp(log_w) * (torch.expm1(-logr) + logr),  # TRL's default
}


def kl_penalty(new_logprobs, ref_logprobs, old_logprobs, estimator):
    """(B, T) KL(pi_theta || pi_ref) estimates at tokens from pi_old, differentiable in new_logprobs
    (their gradients: docs/variants_grpo.md); logr clamped: past ~88, k3's exp(-logr) is inf."""
    logr = (new_logprobs - ref_logprobs).clamp(-KL_CLAMP, KL_CLAMP)
    return KL_ESTIMATORS[estimator](logr, new_logprobs - old_logprobs)


def batch_std(r):
    """The unbiased std of every reward of the global batch, summed over ranks."""
    r = r.double()
    n, total, squares = all_reduce(torch.stack([r.new_tensor(r.numel()), r.sum(), (r * r).sum()]))
    return ((squares - total**2 / n) / (n - 1)).clamp(min=0).sqrt().float()


REWARD_SCALES = {  # rewards (P, G) -> what divides r - group mean (TRL's scale_rewards)
    "group": lambda r: r.std(1, keepdim=True) + 1e-4,  # DeepSeekMath Sec. 4.1.2
    "batch": lambda r: batch_std(r) + 1e-4,  # TRL's "batch": REINFORCE++-baseline, Lite PPO
    "none": lambda r: 1.0,  # Dr. GRPO
}
ADVANTAGES = {  # rewards (P, G) of each prompt's group, a REWARD_SCALES entry -> advantages
    "grpo": lambda r, scale: (r - r.mean(1, True)) / scale(r),
    # RLOO: r_i - the mean of the other G - 1, a baseline independent of r_i (no std division)
    "rloo": lambda r, scale: r - (r.sum(1, True) - r) / (r.size(1) - 1),
}


def zero_std_groups(scores, group_size):
    """(P,) bool: the groups whose G rewards are all equal: advantage 0, no learning signal."""
    groups = scores.view(-1, group_size)
    return (groups == groups[:, :1]).all(1)


def group_advantages(scores, group_size, advantage="grpo", scale="group"):
    """(B,) scores of consecutive groups -> (B,) advantages, exactly 0 for equal rewards."""
    advantages = ADVANTAGES[advantage](scores.view(-1, group_size), REWARD_SCALES[scale])
    return advantages.masked_fill(zero_std_groups(scores, group_size)[:, None], 0.0).flatten()


def kl_in_reward(scores, logprobs, ref_logprobs, mask, beta):
    """Scores (B,) - beta sum_t (log pi_old - log pi_ref) of a response: the KL (k1) as a reward."""
    return scores - beta * ((logprobs - ref_logprobs) * mask).sum(1)


def overlong_penalty(lengths, max_length, buffer, penalty):
    """DAPO eq. 13 of (B,) lengths: 0 to max_length - buffer, linear to -penalty from max_length."""
    return ((max_length - buffer - lengths) / buffer).clamp(-1.0, 0.0) * penalty


def rso_select(rewards, k, temperature, uniforms):
    """RSO (arXiv 2309.06657, Alg. 1): k of N candidates, rewards (P, N); round j accepts each one
    left in turn w.p. exp((r - r_max) / temperature) (uniforms[:, j]), r_max the best left, until k
    are (the best always is). -> indices (P, k) in the order accepted, the rounds each took (P,)."""
    left, taken = torch.ones_like(rewards, dtype=torch.bool), rewards.new_zeros(len(rewards))
    place, rounds = torch.full_like(rewards, float("inf")), torch.zeros_like(taken)
    for j in range(k):
        r_max = rewards.masked_fill(~left, -float("inf")).amax(1, keepdim=True)
        accept = left & (uniforms[:, j] < torch.exp((rewards - r_max) / temperature))
        order = taken[:, None] + accept.cumsum(1) - 1  # the place each would take among the kept
        accept &= order < k  # Algorithm 1 stops the round once k are accepted
        place, left = torch.where(accept, order, place), left & ~accept
        rounds, taken = rounds + (taken < k), taken + accept.sum(1)
    return place.argsort(1)[:, :k], rounds


IMPORTANCE_LEVELS = {  # log pi_theta / pi_old (B, T) per token, or GSPO's: its response's mean
    "token": lambda log_ratio, mask: log_ratio,
    "sequence": lambda x, mask: (x.sum(1, True) / mask.sum(1, True).clamp(min=1)).expand_as(x),
}


def grpo_loss(log_ratio, advantages, clip_low, clip_high, dual_clip=None):
    """PPO's clipped surrogate (B, T) of log pi_theta / pi_old (B, T), advantages (B,), the ratio
    in [1 - clip_low, 1 + clip_high], A < 0's loss capped at -dual_clip A. Also ratio, clipped."""
    ratio, advantages = torch.exp(log_ratio), advantages[:, None]
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.max(pg_losses, pg_losses2)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, loss.minimum(-dual_clip * advantages), loss)
    return loss, ratio, (pg_losses2 > pg_losses).float()


def cispo_loss(log_ratio, advantages, clip_low, clip_high, dual_clip=None):
    """CISPO (arXiv 2506.13585, eq. 4): -sg(min(rho, 1 + clip_high)) A log pi per token, its weight
    capped, not its gradient; log rho for log pi: the same gradient (pi_old fixed), 0 on-policy."""
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=1.0 + clip_high).detach()
    return -advantages[:, None] * weight * log_ratio, ratio, (ratio > 1.0 + clip_high).float()


LOSS_TYPES = {"ppo": grpo_loss, "cispo": cispo_loss}
AGGREGATIONS = {  # a minibatch's loss mask (B, T) -> per-token weights, and the count dividing them
    "token": lambda mask: (mask, mask.sum()),  # DAPO: every token weighs the same
    # DeepSeekMath: the mean of each response's tokens, then over responses
    "sequence": lambda mask: (mask / mask.sum(1, True).clamp(min=1), mask.any(1).sum()),
    "dr_grpo": lambda mask: (mask, mask.new_tensor(mask.numel())),  # Dr. GRPO: N x length
}


def adaptive_entropy_coef(coef, entropy, target, delta):
    """Skywork-OR1 (arXiv 2505.22312) adaptive entropy control after a step of token mean entropy
    `entropy`: coef + delta below the target, coef - delta above, at least 0. Also the coefficient
    the next step applies: none while above the target (the paper's indicator, TRL's gate)."""
    coef = max(0.0, coef + delta if entropy < target else coef - delta)
    return coef, coef if entropy <= target else 0.0


def dynamic_sampling(rollout, num_prompts, group_size, max_rounds, rank, world_size):
    """DAPO: rollout(round) until num_prompts groups (all ranks') have reward variance, max_rounds
    more at most. -> those, then zero-variance ones masked out, as one round; this rank's rounds."""
    # every rank's rows in rank order: each pads its own with zeros to the global size, then a sum
    spread = lambda v: [0, 0] * (v.dim() - 1) + [rank * len(v), (world_size - rank - 1) * len(v)]
    rounds, pool = [], []  # this rank's rollouts; every rank's
    for round_ in range(1 + max_rounds):
        rounds.append(rollout(round_))
        pool.append({k: all_reduce(F.pad(v, spread(v))) for k, v in rounds[-1].items()})
        signal = ~zero_std_groups(torch.cat([r["scores"] for r in pool]), group_size)
        if signal.sum() >= num_prompts:
            break
    pool = {k: torch.cat([r[k] for r in pool]) for k in pool[0]}
    order = torch.cat([signal.nonzero()[:, 0], (~signal).nonzero()[:, 0]])[:num_prompts]
    order = order.view(world_size, -1)[rank]  # rank r trains the r-th slice
    batch = {k: v.unflatten(0, (-1, group_size))[order].flatten(0, 1) for k, v in pool.items()}
    batch["mask"] *= signal[order].repeat_interleave(group_size)[:, None]
    return batch, {k: torch.cat([r[k] for r in rounds]) for k in rounds[0]}


def check_args(args):
    if args.model == Args.model and not os.path.isdir(args.model):
        raise RunError("no SFT model at 'runs/sft/latest': run `python sft.py` or pass --model DIR")
    tables = dict(kl_estimator=KL_ESTIMATORS, advantage=ADVANTAGES, loss_aggregation=AGGREGATIONS)
    tables |= dict(importance_level=IMPORTANCE_LEVELS, loss_type=LOSS_TYPES)
    for flag, table in (tables | dict(scale_rewards=REWARD_SCALES)).items():
        if getattr(args, flag) not in table:
            raise RunError(f"unknown --{flag} '{getattr(args, flag)}': use {', '.join(table)}")
    if args.num_samples_per_prompt < 2 or args.temperature <= 0:
        raise RunError("GRPO needs --num_samples_per_prompt >= 2 and --temperature > 0")
    if 0 < args.rejection_sampling_candidates < args.num_samples_per_prompt:
        raise RunError("--rejection_sampling_candidates must be >= --num_samples_per_prompt")
    if args.rso_temperature <= 0 or not 0 <= args.overlong_buffer <= args.response_length:
        raise RunError("--rso_temperature must be > 0, --overlong_buffer in [0, --response_length]")
    if args.dual_clip is not None and (args.dual_clip <= 1 or args.loss_type != "ppo"):
        raise RunError("--dual_clip must be > 1, with --loss_type ppo")
    if args.total_episodes < args.num_prompts_per_step * args.num_samples_per_prompt:
        raise RunError("--total_episodes is less than one step's responses")


def all_reduce(x):
    """Sum over ranks, in place: the global batch's sums (a no-op in one process)."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


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
    num_prompts, G = args.num_prompts_per_step, args.num_samples_per_prompt
    local_prompts = data.exact_div(num_prompts, world_size, "--num_prompts_per_step or the ranks")
    batch_size, local_batch_size = num_prompts * G, local_prompts * G  # responses a step, a rank's
    N = args.rejection_sampling_candidates or G  # responses sampled per prompt (RSO: N, kept G)
    share = data.exact_div(G, args.num_minibatches, "--num_minibatches")  # a minibatch's, per group
    micro_batch_size = min(args.micro_batch_size, local_prompts * share)
    data.exact_div(local_prompts * share, micro_batch_size, "--micro_batch_size")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)  # off: a no-op
    torch.manual_seed(args.seed)

    # 2. data, and its reward: the task's verifier and/or a reward model
    meta = data.load_meta(args.data)
    train, test = (data.load_split(args.data, f"prompt_{split}") for split in ("train", "test"))
    pad, eos, n_train = meta["pad_token_id"], meta["eos_token_id"], len(train["query"])
    use_verifier = args.verifier and meta.get("task") in ("arithmetic", "gsm8k")
    if not (use_verifier or args.reward_model):
        raise RunError("no reward: no verifier (for this task, or --no-verifier): --reward_model")
    if args.eval_samples and not use_verifier:
        raise RunError("--eval_samples scores with the task's verifier: this run has none")
    if n_train < num_prompts:
        raise RunError(f"prompt_train has {n_train} prompts: lower --num_prompts_per_step")

    # 3. models, before the run dir (a bad --model leaves none); frozen: the reference, the reward
    policy = gpt2.load(args.model, meta, shard=lambda m: shard(m, device, bf16))
    data.check_context(train, policy.config.block_size, args.response_length)
    frozen = lambda m: shard(m, device, bf16, frozen=True)
    ref_policy = reward_model = None
    if args.beta > 0 or args.ref_model:
        torch.manual_seed(args.seed)  # `--model tiny`: the policy's random init again
        ref_policy = gpt2.load(args.ref_model or args.model, meta, shard=frozen)
    if args.reward_model:
        reward_model = gpt2.load(args.reward_model, meta, head="saved", shard=frozen)
    policy.activation_checkpointing = args.activation_checkpointing
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    fwd_policy = torch.compile(policy) if args.compile else policy  # the loss's forward passes
    forward = functools.partial(gpt2.logprobs, fwd_policy, temperature=args.temperature)
    args.out_dir = start_run(args, "grpo")
    # eval/preference_accuracy's reference: the policy as loaded, before any --resume
    pref = data.eval_split(args.data, "pref_test", args.eval_size)  # None where absent
    n_pairs = len(pref["query"]) if pref else 0
    ref_pair_logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)
    models = {"policy": (policy, optimizer)}
    state = load_checkpoint(args.out_dir, models) if args.resume else {"step": 0}
    # the entropy bonus: Skywork-OR1's coefficient, and the one applied (none until below target)
    start, entropy_coef = state["step"], state.get("entropy_coef", args.entropy_coef)
    entropy_bonus = state.get("entropy_bonus", args.entropy_coef * (args.entropy_target is None))
    logprobs_of = lambda model: lambda q, r: gpt2.logprobs(model, q, r, args.temperature)[0]
    sampling = (pad, args.response_length, eos, args.temperature)  # gpt2.generate's, after query
    local = lambda x: torch.from_numpy(x[rank * local_prompts :][:local_prompts]).to(device)

    def in_micro_batches(fn, query, response):  # rewards (B,) or log-probs (B, Tr), no gradients
        pairs = zip(query.split(micro_batch_size), response.split(micro_batch_size))
        with torch.no_grad(), ctx:
            return torch.cat([fn(gpt2.trim_padding(q, None, pad)[0], r) for q, r in pairs])

    def rollout(step, round_):  # plain GRPO's steps 1-3 on this rank's share of a sampling round
        # 1. prompts: the step's slice of one permutation per epoch (later rounds: a fresh one)
        order = data.batch_indices(args.seed, step, n_train, num_prompts)
        if round_ > 0:
            order = np.random.default_rng([args.seed, step, round_, 5]).permutation(n_train)
        prompt_idx = order[rank * local_prompts :][:local_prompts]  # rank r's contiguous share
        query = torch.from_numpy(train["query"][prompt_idx]).to(device).repeat_interleave(N, 0)
        # 2. generate with global uniforms (any rank count alike); its log-probs are pi_old's
        rng = np.random.default_rng([args.seed, step, round_, 2])
        noise = local(rng.random((num_prompts, N, args.response_length), np.float32))
        chunks = zip(query.split(local_batch_size), noise.flatten(0, 1).split(local_batch_size))
        with ctx:  # local_batch_size rows at a time: RSO's N candidates take no more memory
            outs = [gpt2.generate(policy, q, *sampling, u) for q, u in chunks]
        out = gpt2.Rollout(query, *(torch.cat(x) for x in list(zip(*outs))[1:]))
        # 3. score: the verifier and/or the reward model, minus the missing-stop penalty
        stopped, scores = (out.response == eos).any(1), torch.zeros(len(query), device=device)
        if use_verifier:
            truth = np.repeat(train["ground_truth"][prompt_idx], N)
            scores += torch.tensor(data.verify_batch(meta, out.response.tolist(), truth)).to(device)
        if reward_model is not None:
            reward = lambda q, r: gpt2.get_reward(reward_model, q, r, pad, eos)
            scores += in_micro_batches(reward, query, out.response)
        if args.missing_eos_penalty is not None:
            scores -= args.missing_eos_penalty * (~stopped).float()
        if args.overlong_buffer:  # DAPO's soft overlong punishment
            overlong = (args.response_length, args.overlong_buffer, args.overlong_penalty)
            scores += overlong_penalty(out.mask.sum(1), *overlong)
        # DAPO's overlong filtering: a response that never stops is out of the loss
        mask = (out.mask & stopped[:, None] if args.mask_truncated else out.mask).float()
        batch = dict(out._asdict(), response_mask=out.mask.float(), mask=mask, scores=scores)
        if args.rejection_sampling_candidates:  # RSO: keep G of the N, uniforms keyed as noise
            rng = np.random.default_rng([args.seed, step, round_, 4])
            u = local(rng.random((num_prompts, G, N)))
            keep, rounds = rso_select(scores.view(-1, N), G, args.rso_temperature, u)
            batch["rso_rounds"] = rounds.repeat_interleave(N)  # per response, for the metrics
            rows = (keep + N * torch.arange(local_prompts, device=device)[:, None]).flatten()
            batch = {k: v[rows] for k, v in batch.items()}
        return batch

    def evaluate():  # greedy and sampled accuracy on prompt_test, and the preference pairs'
        metrics, size = {}, (args.eval_size, local_batch_size, args.response_length, ctx)
        if use_verifier and args.eval_size:
            metrics["eval/accuracy"] = data.greedy_accuracy(policy, test, meta, *size)
        if use_verifier and args.eval_size and args.eval_samples:
            samples = (args.eval_samples, args.temperature, args.seed)
            metrics |= data.sampled_accuracy(policy, test, meta, *size, *samples)
        if n_pairs:
            logps = data.split_logprobs(policy, pref, n_pairs, micro_batch_size, ctx)
            metrics["eval/preference_accuracy"] = data.preference_accuracy(logps, ref_pair_logps)
        return metrics

    show = ("objective/scores", "objective/kl", "eval/accuracy", "perf/episodes_per_sec")
    if start == 0 and (metrics := evaluate()):  # the starting point
        log_metrics(args.out_dir, 0, metrics, show)

    # 4. training loop
    importance = IMPORTANCE_LEVELS[args.importance_level]
    clip = dict(clip_low=args.clip_eps_low, clip_high=args.clip_eps_high, dual_clip=args.dual_clip)
    surrogate = functools.partial(LOSS_TYPES[args.loss_type], **clip)
    entropy_in_loss = args.entropy_coef > 0 or args.entropy_target is not None
    num_steps, t0, t0_step = args.total_episodes // batch_size, time.time(), start
    for step in range(start, num_steps):
        done = step + 1
        eval_now = done % args.eval_every == 0 or done == num_steps
        log_now = done % args.log_every == 0 or step == start or eval_now
        # 4a. rollout (steps 1-3); DAPO's dynamic sampling repeats it and selects groups
        if args.dynamic_sampling:
            sizes = (num_prompts, G, args.max_sampling_rounds, rank, world_size)
            batch, sampled = dynamic_sampling(functools.partial(rollout, step), *sizes)
        else:
            batch = sampled = rollout(step, 0)
        query, response, mask = batch["query"], batch["response"], batch["mask"]
        response_mask = batch["response_mask"]  # every response token, stop included

        # 4b. log-probs under pi_ref (when there is one) and, if asked, pi_old's once more
        ref_logprobs, old_logprobs, scores = None, batch["logprobs"], batch["scores"]
        if ref_policy is not None:
            ref_logprobs = in_micro_batches(logprobs_of(ref_policy), query, response)
        if args.recompute_old_logprobs:
            old_logprobs = in_micro_batches(logprobs_of(fwd_policy), query, response)
        if args.kl_in_reward and ref_logprobs is not None:
            scores = kl_in_reward(scores, old_logprobs, ref_logprobs, response_mask, args.beta)

        # 4c. advantages: within each prompt's group (all of it on this rank), then the batch's
        advantages = group_advantages(scores, G, args.advantage, args.scale_rewards)
        if args.batch_norm_advantages:
            moments = torch.stack([advantages.sum(), advantages.square().sum()]).double()
            mean, mean_sq = all_reduce(moments) / batch_size
            advantages = ((advantages - mean) / ((mean_sq - mean**2).sqrt() + 1e-8)).float()

        # 4d. update: num_epochs x num_minibatches optimizer steps, each on a share of every group
        sums, grad_norms = {}, []
        for epoch, minibatch in np.ndindex(args.num_epochs, args.num_minibatches):
            u = local(np.random.default_rng([args.seed, step, epoch, 3]).random((num_prompts, G)))
            order = u.argsort(1)[:, minibatch * share :][:, :share]  # a share of each group
            mb_idx = (order + G * torch.arange(local_prompts, device=device)[:, None]).flatten()
            weights, count = AGGREGATIONS[args.loss_aggregation](mask[mb_idx])
            weights = weights / all_reduce(count.float()).clamp(min=1)  # counted over all ranks
            micros = list(zip(mb_idx.split(micro_batch_size), weights.split(micro_batch_size)))
            with_entropy = (log_now and epoch == 0) or entropy_in_loss  # to log, or for a bonus
            for micro, (idx, mb_weights) in enumerate(micros):
                if dist.is_initialized():
                    policy.set_requires_gradient_sync(micro == len(micros) - 1)
                with ctx:
                    new_logprobs, entropy = forward(query[idx], response[idx], entropy=with_entropy)
                mb_mask = mask[idx]
                # the first minibatch is exactly on-policy: its pi_old is this forward's, detached
                old = new_logprobs.detach() if epoch == minibatch == 0 else old_logprobs[idx]
                logratio = torch.where(mb_mask.bool(), new_logprobs - old, 0.0)
                pg_loss, ratio, clipped = surrogate(importance(logratio, mb_mask), advantages[idx])
                stats = {"val/ratio": ratio, "val/ratio_var": ratio**2, "loss/policy_avg": pg_loss}
                stats |= {"policy/approxkl_avg": 0.5 * logratio**2, "policy/clipfrac_avg": clipped}
                loss = pg_loss
                if ref_logprobs is not None and not args.kl_in_reward:
                    kl = kl_penalty(new_logprobs, ref_logprobs[idx], old, args.kl_estimator)
                    loss, stats["loss/kl_avg"] = loss + args.beta * kl, kl
                if entropy is not None and epoch == 0:  # x num_epochs: its token mean
                    stats["objective/entropy"] = entropy * args.num_epochs
                if entropy_bonus:  # aggregated as the loss is
                    loss = loss - entropy_bonus * entropy
                ((loss * mb_weights).sum() * world_size).backward()  # FSDP2 averages over ranks
                for name, value in stats.items():
                    sums[name] = sums.get(name, 0) + (value.detach().double() * mb_mask).sum()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            if not torch.isfinite(grad_norm):
                raise RunError(f"non-finite grad norm at step {done}: lower --lr (or --resume)")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm)  # the global norm, before clipping

        # 4e. log means over the loss's tokens or every response sampled, of all ranks at once
        if log_now:
            tokens = all_reduce(mask.sum().double()).clamp(min=1) * args.num_epochs
            metrics = {name: value / tokens for name, value in sums.items()}
            n_sampled = len(sampled["scores"]) * world_size  # every round's responses
            metrics["objective/scores"] = sampled["scores"].sum() / n_sampled
            metrics["objective/response_length"] = sampled["response_mask"].sum() / n_sampled
            metrics["val/stop_frac"] = (sampled["response"] == eos).any(1).sum() / n_sampled
            zero_std = zero_std_groups(sampled["scores"], G).sum()  # dynamic sampling drops these
            metrics["objective/zero_std_frac"] = zero_std * G / n_sampled
            metrics |= {"objective/dropped_groups": zero_std} if args.dynamic_sampling else {}
            if "rso_rounds" in sampled:
                metrics["objective/rso_rounds"] = sampled["rso_rounds"].sum() / n_sampled
            if ref_logprobs is not None:  # KL(pi_old || pi_ref) per token: k3, whatever the loss's
                k3 = kl_penalty(old_logprobs, ref_logprobs, old_logprobs, "k3") * response_mask
                metrics["objective/kl"] = k3.sum() / all_reduce(response_mask.sum())
            values = all_reduce(torch.stack([value.double() for value in metrics.values()]))
            metrics = dict(zip(metrics, values.tolist()))
            metrics["val/ratio_var"] -= metrics["val/ratio"] ** 2
            metrics["train/grad_norm"] = torch.stack(grad_norms).mean().item()
            metrics["perf/episodes_per_sec"] = (done - t0_step) * batch_size / (time.time() - t0)
            if args.dynamic_sampling:
                metrics["objective/sampling_rounds"] = n_sampled // batch_size
            metrics |= {"policy/entropy_coef": entropy_bonus} if entropy_in_loss else {}
            log_metrics(args.out_dir, done, metrics | (evaluate() if eval_now else {}), show)
        if args.entropy_target is not None:  # the next step's coefficient, from this one's entropy
            h = all_reduce(torch.stack([sums["objective/entropy"], mask.sum().double()]))
            entropy = (h[0] / h[1].clamp(min=1)).item() / args.num_epochs
            delta = (args.entropy_target, args.entropy_coef_delta)
            entropy_coef, entropy_bonus = adaptive_entropy_coef(entropy_coef, entropy, *delta)
        extra = dict(entropy_coef=entropy_coef, entropy_bonus=entropy_bonus)
        checkpoint(args, done, models, device, due=eval_now, extra=extra)  # also on SIGTERM
        if log_now:
            t0, t0_step = time.time(), done  # the rate leaves out eval and checkpoint time

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
    # Each model in the HF layout, with its optimizer.pt.
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
            for name in models:
                safe_open(f"{path}/{name}/model.safetensors", "pt")
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
