"""Group Relative Policy Optimization (GRPO): PPO without a value model, advantages from a group of samples.

Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), Sec. 4.1: sample G responses per prompt from the current policy,
score them (the task's verifier and/or a reward model from reward.py) and give every token of a response the
group-normalised reward (r - mean(group)) / std(group) as its advantage. The update is the PPO clipped surrogate
(Schulman et al. 2017) plus beta * KL(pi_theta || pi_ref) as a term IN THE LOSS (PPO-RLHF puts it in the reward),
estimated per token at the sampled tokens. What the field learned since, each a flag; the defaults are plain GRPO with
DAPO's token-mean loss (docs/variants_grpo.md: each formula, the library default it matches, published runs' flags):
- `--kl_estimator k1|k2|k3|k4`: the KL estimate in the loss (see kl_penalty; k3 is DeepSeekMath's, k4 unbiased).
- `--clip_eps_low/--clip_eps_high`: DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476), e.g. 0.2 / 0.28.
- `--dynamic_sampling` (DAPO): drop groups whose rewards are all equal, refill the batch with fresh prompts.
- `--mask_truncated` (DAPO's overlong filtering): responses that never emit the stop token are left out of the loss.
- `--loss_aggregation token|sequence|dr_grpo`: token mean (DAPO), per-response mean (DeepSeekMath), or a constant
  normaliser; Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) is BOTH `--loss_aggregation dr_grpo` and
  `--no-scale_rewards_by_std` (no division by the group std).
- `--importance_level sequence`: GSPO (Zheng et al. 2025, arXiv 2507.18071), one clipped ratio per response.
- `--advantage rloo`: the leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740).
Deviations: sampling uses the full tempered distribution (no top-k/top-p), so pi_old's log-probs are the sampler's own
(returned by generation); each minibatch takes an equal share of every group, the same on any number of ranks.

    python grpo.py                                     # from runs/sft/latest (python sft.py), arithmetic verifier
    torchrun --nproc_per_node=2 grpo.py --beta 0.03    # with a KL penalty, FSDP2 over 2 ranks
    python grpo.py --clip_eps_high 0.28 --dynamic_sampling --mask_truncated    # DAPO
    python grpo.py --no-scale_rewards_by_std --loss_aggregation dr_grpo        # Dr. GRPO
    python grpo.py --reward_model runs/reward/latest --no-verifier --data DIR  # a learned reward (reward.py)
    python grpo.py --resume --out_dir runs/grpo/<run>  # continue a run from its last checkpoint

The file is longer than STYLE.md's 400–550 lines by its plumbing section (~245 lines, identical in every script:
torchrun, run directories, atomic checkpoints, one-line errors) and its copies of the reward model and the greedy
eval, which let it run alone; the variants above add ~100 lines of small flagged functions.
"""

import atexit
import copy
import functools
import glob
import json
import math
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro

import data
import gpt2


@dataclass
class Args:
    model: str = "runs/sft/latest"
    """policy to start from: a checkpoint dir (what `python sft.py` writes), a GPT-2 preset, or `tiny`"""
    ref_model: str = ""
    """frozen reference of the KL term; default a copy of the starting --model (none at all when --beta is 0)"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a dataset directory with prompt_{train,test} from data.prep"""
    reward_model: str = ""
    """optional reward model dir written by reward.py; its normalised score is added to the verifier's"""
    verifier: bool = True
    """score with the task's verifier (1 correct / 0 wrong); --no-verifier leaves the reward model alone"""
    out_dir: str = ""
    """run directory; default a fresh runs/grpo/<time>-s<seed>, linked as runs/grpo/latest when it finishes"""
    overwrite: bool = False
    """delete the run already in --out_dir and start afresh"""
    resume: bool = False
    """continue the run in --out_dir from its last complete checkpoint"""
    seed: int = 1
    """seed for prompt order, sampling and minibatch split (identical on every rank)"""
    lr: float = 1e-5
    """learning rate (constant); 1e-5 suits the tiny SFT model, ~1e-6 pretrained GPT-2"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global gradient norm"""
    total_episodes: int = 51200
    """sampled responses over the whole run; steps = total_episodes / (prompts * samples per step)"""
    num_prompts_per_step: int = 32
    """prompts per step, over all ranks"""
    num_samples_per_prompt: int = 8
    """group size G: responses sampled per prompt (>= 2: the group is the baseline)"""
    num_minibatches: int = 4
    """optimizer steps per epoch over the batch (each minibatch takes an equal share of every group)"""
    num_epochs: int = 1
    """PPO epochs over each batch of samples (DeepSeekMath: 1)"""
    micro_batch_size: int = 64
    """sequences per forward pass on one rank, at most the per-rank minibatch (gradient accumulation does the rest)"""
    response_length: int = 16
    """max new tokens per response"""
    temperature: float = 1.0
    """sampling temperature; the loss uses log-probs of logits / temperature, the distribution actually sampled"""
    beta: float = 0.0
    """KL coefficient (DeepSeekMath: 0.04); 0: no KL term, no reference model, no objective/kl (DAPO, Dr. GRPO)"""
    kl_estimator: str = "k3"
    """per-token KL estimate in the loss: k1, k2, k3 (DeepSeekMath) or k4 (unbiased gradient)"""
    clip_eps_low: float = 0.2
    """the ratio is clipped below at 1 - clip_eps_low (PPO: 0.2)"""
    clip_eps_high: float = 0.2
    """the ratio is clipped above at 1 + clip_eps_high (PPO: 0.2; DAPO's clip-higher: 0.28)"""
    importance_level: str = "token"
    """`token` (PPO/GRPO: one ratio per token) or `sequence` (GSPO: exp(mean token log-ratio) per response)"""
    advantage: str = "grpo"
    """`grpo`: r - mean(group) [/ std]; `rloo`: r_i - mean of the other G-1 rewards (no std division)"""
    scale_rewards_by_std: bool = True
    """divide the group-centred rewards by the group std (GRPO); --no-scale_rewards_by_std as in Dr. GRPO"""
    batch_norm_advantages: bool = False
    """whiten the advantages once more over the global batch"""
    loss_aggregation: str = "token"
    """`token`: sum / tokens (DAPO); `sequence`: mean per response (DeepSeekMath); `dr_grpo`: constant normaliser"""
    mask_truncated: bool = False
    """leave responses without a stop token out of the loss (DAPO's overlong filtering)"""
    missing_eos_penalty: float | None = None
    """subtract this from the score of responses that never emit the stop token"""
    dynamic_sampling: bool = False
    """drop groups whose rewards are all equal and refill the batch with fresh prompts (DAPO)"""
    max_sampling_rounds: int = 4
    """--dynamic_sampling: extra generation rounds per step at most; a batch still short is topped up, masked out"""
    recompute_old_logprobs: bool = False
    """pi_old's log-probs from a second forward pass, not the sampler's (which differ from it by bf16 rounding)"""
    eval_every: int = 50
    """steps between evals (greedy accuracy on prompt_test) and checkpoints"""
    eval_size: int = 500
    """held-out prompts for eval accuracy"""
    log_every: int = 1
    """steps between status lines / metrics rows"""
    keep_checkpoints: int = 2
    """number of resumable checkpoints kept in out_dir/checkpoints"""
    dtype: str = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `float32` or `bfloat16` (autocast; FSDP2 bf16 params + fp32 reduce)"""
    compile: bool = False
    """torch.compile the policy for the loss forward passes"""
    wandb: bool = False
    """also log to Weights & Biases (imported only when set)"""


KL_ESTIMATORS = ("k1", "k2", "k3", "k4")
CHOICES = dict(kl_estimator=KL_ESTIMATORS, importance_level=("token", "sequence"), advantage=("grpo", "rloo"),
               loss_aggregation=("token", "sequence", "dr_grpo"))  # fmt: skip
KL_CLAMP = 40.0  # |log pi_theta - log pi_ref| cap, as open-instruct's grpo_fast: exp(40) is finite in fp32 and bf16

# ---------------------------------------------------------------------------------------------------------------------
# GRPO: KL estimators, group advantages, the clipped surrogate and its aggregation, log-probs


def kl_penalty(new_logprobs, ref_logprobs, old_logprobs, estimator: str) -> torch.Tensor:
    """Per-token estimate (B, T) of KL(pi_theta || pi_ref) at tokens sampled from pi_old, differentiable through
    new_logprobs. With logr = log pi_theta - log pi_ref, the true gradient is E_pi[logr * grad log pi] (the extra
    E_pi[grad log pi] is 0). Expected gradients (values: http://joschu.net/blog/kl-approx.html):
      k1 = logr                     E[grad] = E[grad log pi] = 0: k1 in the loss does not pull toward pi_ref
      k2 = logr^2 / 2               E_old[logr * grad log pi] = grad KL only on-policy (pi_old = pi_theta)
      k3 = exp(-logr) - 1 + logr    E[(1 - pi_ref / pi) grad log pi] = -E_ref[grad log pi] = grad KL(pi_ref || pi)
      k4 = w * logr, w = pi_theta / pi_old with the gradient flowing through w (pi_old fixed): grad = w (logr + 1)
           grad log pi, and E_old[w f] = E_pi[f], so E_old[grad] = E_pi[(logr + 1) grad log pi] = grad KL for ANY
           pi_old (later minibatches and epochs too); its value E_old[w logr] = KL is unbiased as well.
    logr is clamped to [-KL_CLAMP, KL_CLAMP] (open-instruct): past ~88, k3's exp(-logr) is inf in fp32, and then
    beta * inf and its gradient are NaN even at beta = 0."""
    logr = (new_logprobs - ref_logprobs).clamp(-KL_CLAMP, KL_CLAMP)
    if estimator == "k1":
        return logr
    if estimator == "k2":
        return 0.5 * logr.square()
    if estimator == "k3":
        return torch.expm1(-logr) + logr
    if estimator == "k4":
        return torch.exp(new_logprobs - old_logprobs) * logr
    raise ValueError(f"unknown --kl_estimator '{estimator}': use one of {', '.join(KL_ESTIMATORS)}")


def zero_std_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(P,) bool: groups whose G rewards are all equal (no learning signal: their advantages are 0)."""
    s = scores.view(-1, group_size)
    return (s == s[:, :1]).all(1)


def group_advantages(scores: torch.Tensor, group_size: int, how: str = "grpo", scale_by_std: bool = True, eps=1e-4):
    """(B,) scores of consecutive groups → (B,) advantages, exactly 0 (never NaN) for a group of equal rewards.
    grpo: (r - mean(group)) / (std(group) + eps), DeepSeekMath Sec. 4.1.2; without the std when not scale_by_std.
    rloo: r_i - mean_{j != i} r_j, the leave-one-out baseline (Kool et al. 2019, Ahmadian et al. 2024): a baseline
    independent of r_i keeps the policy gradient unbiased; it equals G / (G - 1) * (r_i - mean), no std division."""
    s = scores.view(-1, group_size)  # (P, G)
    if how == "rloo":
        centred = s - (s.sum(1, keepdim=True) - s) / (group_size - 1)
    else:
        centred = s - s.mean(1, keepdim=True)
    centred = centred.masked_fill(zero_std_groups(scores, group_size)[:, None], 0.0)  # no rounding residue either
    if how == "grpo" and scale_by_std:
        centred = centred / (s.std(1, keepdim=True) + eps)
    return centred.flatten()


def select_groups(scores: torch.Tensor, group_size: int, num_groups: int):
    """Dynamic sampling (DAPO, Yu et al. 2025): of the groups of (N * G,) scores, the rows (num_groups * G,) of those
    with reward variance, in order, then, only if too few, of zero-variance ones to keep the batch size; and whether
    each row is in the loss (only those of groups with variance)."""
    signal = ~zero_std_groups(scores, group_size)
    order = torch.cat([signal.nonzero()[:, 0], (~signal).nonzero()[:, 0]])[:num_groups]  # (num_groups,)
    rows = (order[:, None] * group_size + torch.arange(group_size, device=scores.device)).flatten()
    return rows, signal[order].repeat_interleave(group_size)


def loss_mask(response: torch.Tensor, eos_token_id: int, mask_truncated: bool) -> torch.Tensor:
    """(B, T) bool: the response tokens in the loss, up to and including the stop token; with mask_truncated (DAPO's
    overlong filtering) none of a response that never stops: its reward judges a cut-off answer, not the policy's."""
    mask = response_mask(response, eos_token_id)
    return mask & (response == eos_token_id).any(1, keepdim=True) if mask_truncated else mask


def grpo_loss(new_logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_low, clip_high, beta, estimator,
              importance_level="token"):  # fmt: skip
    """Per-token loss (B, T): the clipped surrogate with the response's advantage (B,), plus beta * KL estimate when
    there is a reference (ref_logprobs not None), and the per-token pieces for logging (detached).
    clip range [1 - clip_low, 1 + clip_high]: PPO's symmetric one, or DAPO's clip-higher (clip_high > clip_low).
    importance_level sequence (GSPO): one ratio per response, exp of its mean token log-ratio over `mask`, clipped
    once per response and shared by its tokens."""
    logratio = torch.where(mask.bool(), new_logprobs - old_logprobs, 0.0)  # (B, T) 0 past the stop token
    token_logratio = logratio
    if importance_level == "sequence":
        logratio = (logratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logratio)
    ratio = torch.exp(logratio)
    pg_losses = -advantages[:, None] * ratio
    pg_losses2 = -advantages[:, None] * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_loss = torch.max(pg_losses, pg_losses2)
    stats = dict(ratio=ratio, approxkl=0.5 * token_logratio.square(), clipfrac=(pg_losses2 > pg_losses).float(),
                 pg_loss=pg_loss)  # fmt: skip
    loss = pg_loss
    if ref_logprobs is not None:
        stats["kl"] = kl = kl_penalty(new_logprobs, ref_logprobs, old_logprobs, estimator)
        loss = loss + beta * kl if beta else loss
    return loss, {k: v.detach() for k, v in stats.items()}


def aggregate_loss(loss, mask, how: str, n_tokens, n_seqs, constant):
    """Scalar loss from per-token (B, T), over GLOBAL counts so micro-batches and ranks add up exactly:
    token    sum / tokens of the minibatch (DAPO): every token weighs the same, long responses are not down-weighted
    sequence per-response mean, summed / responses (DeepSeekMath): a token of a short response weighs more
    dr_grpo  sum / constant = responses * response_length (Dr. GRPO): no per-batch length in the normaliser at all"""
    loss = loss * mask
    if how == "token":
        return loss.sum() / n_tokens
    if how == "dr_grpo":
        return loss.sum() / constant
    return (loss.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs


def forward_logprobs(model, query, response, pad_token_id, eos_token_id, temperature, ctx, with_entropy=False):
    """Log-probs (B, Tr) of the response tokens under logits / temperature (the distribution that was sampled) and, if
    asked, the per-token entropy (B, Tr) of that distribution (detached), else None. log_softmax + gather: autograd
    keeps one (B, Tr, V) fp32 tensor (a logsumexp-based gather peaks higher on CPU); the entropy is taken a few rows
    at a time, so it adds no (B, Tr, V) temporaries on top of it."""
    attention_mask = torch.cat([query != pad_token_id, response_mask(response, eos_token_id)], 1)
    with ctx:
        # logits from the last prompt position on: position t predicts token t + 1, so the last token is only
        # predicted, never read, and is left out of the input. A group's G rows share their prompt: it runs once per
        # group (shared_prefix), the same numbers for 1/G of the prompt's compute
        logits = model(torch.cat([query, response[:, :-1]], 1), attention_mask=attention_mask[:, :-1],
                       keep_from=query.size(1) - 1, shared_prefix=query.size(1) - 1)  # fmt: skip
    logp = (logits.float() / temperature).log_softmax(-1)  # (B, Tr, V)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = torch.cat([-(rows.exp() * rows).sum(-1) for rows in logp.split(4)])
    return logp.gather(-1, response.long().unsqueeze(-1)).squeeze(-1), entropy


# ---------------------------------------------------------------------------------------------------------------------
# A step's rollout: prompts, rewards, log-probs of a batch; the masks (identical copies of sft.py's)


@torch.no_grad()
def score_responses(reward_model, query, response, ground_truth, meta, use_verifier, micro_batch_size, eos_penalty, ctx):
    """Rewards (B,): the task's verifier on the text before the stop token (1 / 0), + the reward model's score at the
    last real token, - eos_penalty for a response that never emits the stop token (TRL's missing_eos_penalty)."""
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    scores = torch.zeros(len(response), device=response.device)
    if use_verifier:
        enc, stop = data.get_encoding(meta["tokenizer"]), first_true_indices(response == eos).tolist()
        texts = [enc.decode(row[:s]) for row, s in zip(response.tolist(), stop)]
        correct = [data.verify(meta["task"], text, str(gt)) for text, gt in zip(texts, ground_truth)]
        scores += torch.tensor(correct, dtype=torch.float32, device=response.device)
    for i in range(0, len(response) if reward_model is not None else 0, micro_batch_size):
        q, r = trim_padding(query[i : i + micro_batch_size], response[i : i + micro_batch_size], pad, eos)
        with ctx:
            scores[i : i + len(q)] += get_reward(reward_model, q, r, pad, eos).float()
    if eos_penalty is not None:
        scores -= eos_penalty * (~(response == eos).any(1)).float()
    return scores


@torch.no_grad()
def batch_logprobs(model, query, response, pad_token_id, eos_token_id, temperature, micro_batch_size, ctx):
    """forward_logprobs (B, Tr) of a whole batch, micro-batch by micro-batch, without gradients."""
    out = torch.zeros(response.shape, device=response.device)
    for i in range(0, len(response), micro_batch_size):
        q, r = trim_padding(query[i : i + micro_batch_size], response[i : i + micro_batch_size], pad_token_id, eos_token_id)
        out[i : i + len(q), : r.size(1)] = forward_logprobs(model, q, r, pad_token_id, eos_token_id, temperature, ctx)[0]
    return out


def step_prompts(seed: int, step: int, rnd: int, n_train: int, num_prompts: int) -> np.ndarray:
    """Global prompt indices (P,) of one sampling round of a step, identical on every rank: round 0 takes the step's
    slice of one permutation per epoch; extra rounds (dynamic sampling) draw P prompts keyed by (seed, step, round),
    so a resumed run draws the same ones."""
    if rnd:
        return np.random.default_rng([seed, step, rnd, 1]).choice(n_train, num_prompts, replace=False)
    epoch, k = divmod(step, n_train // num_prompts)
    return epoch_permutation(seed, epoch, n_train)[k * num_prompts : (k + 1) * num_prompts]


@functools.lru_cache(maxsize=1)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index of the first True in each row of (B, T), or T when there is none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def response_mask(response: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) bool: response tokens up to and including the first stop token (whatever the pad token is)."""
    stop = first_true_indices(response == eos_token_id)
    return torch.arange(response.size(1), device=response.device)[None, :] <= stop[:, None]


def trim_padding(query: torch.Tensor, response: torch.Tensor, pad_token_id: int, eos_token_id: int):
    """Drop the left-pad columns every query shares and the columns after every response's stop token (saves compute,
    changes nothing: positions come from the mask)."""
    q_start = int(first_true_indices((query != pad_token_id).any(0, keepdim=True)).item())
    r_len = int(response_mask(response, eos_token_id).sum(1).max().item())
    return query[:, min(q_start, query.size(1) - 1) :], response[:, :r_len]


def trim_left(query: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Drop the left-pad columns every query shares (changes nothing: positions come from the mask)."""
    start = int(first_true_indices((query != pad_token_id).any(0, keepdim=True)).item())
    return query[:, min(start, query.size(1) - 1) :]


def gather_rows(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Every rank's (n, ...) rows stacked in rank order (world_size * n, ...) on every rank: an all-reduce of a
    zero-filled tensor, the same on gloo and nccl (dynamic sampling moves kept groups between ranks)."""
    if world_size == 1:
        return x
    out = x.new_zeros(world_size * x.size(0), *x.shape[1:])
    out[rank * x.size(0) : (rank + 1) * x.size(0)] = x
    return all_reduce(out)


# ---------------------------------------------------------------------------------------------------------------------
# main


def main(args: Args):
    # ---- one-line errors for what needs nothing loaded, before any distributed setup; sizes, setup, seeds
    check_args(args)
    rank, world_size, device = setup_distributed()
    master = rank == 0
    G, P = args.num_samples_per_prompt, args.num_prompts_per_step
    batch_size = P * G  # episodes per step, over all ranks
    local_num_prompts = exact_div(P, world_size, "--num_prompts_per_step must divide by the number of ranks")
    local_batch_size = local_num_prompts * G
    samples_per_minibatch = exact_div(G, args.num_minibatches, "--num_samples_per_prompt must divide by --num_minibatches (each minibatch takes a share of every group)")  # fmt: skip
    micro_batch_size = min(args.micro_batch_size, local_num_prompts * samples_per_minibatch)
    grad_accum = exact_div(local_num_prompts * samples_per_minibatch, micro_batch_size, "per-rank minibatch (--num_prompts_per_step / ranks * --num_samples_per_prompt / --num_minibatches) must divide by --micro_batch_size")  # fmt: skip
    num_steps = args.total_episodes // batch_size
    if num_steps < 1:
        raise RunError(f"--total_episodes {args.total_episodes} is less than one step of {batch_size} episodes")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)

    # ---- data and reward
    meta = data.load_meta(args.data)
    train, test = data.load_split(args.data, "prompt_train"), data.load_split(args.data, "prompt_test")
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    use_verifier = args.verifier and meta.get("task") in ("arithmetic", "gsm8k")
    if not use_verifier and not args.reward_model:
        raise RunError(f"no reward: task '{meta.get('task')}' has no verifier (or --no-verifier); pass --reward_model DIR written by reward.py")  # fmt: skip
    n_train = len(train["query"])
    if n_train < P:
        raise RunError(f"prompt_train has {n_train} prompts, fewer than --num_prompts_per_step {P}: lower it")

    # ---- models: the policy (trained), and frozen (no optimizer state): the reference, only when something uses it,
    # a copy of the policy as loaded (so KL = 0 at step 1, --model tiny too) unless --ref_model; the reward model
    policy = gpt2.load_model(args.model, vocab_size=meta["vocab_size"])
    ref_policy = None
    if args.beta > 0 or args.ref_model:
        ref_policy = gpt2.load_model(args.ref_model, meta["vocab_size"]) if args.ref_model else copy.deepcopy(policy)
    reward_model = load_reward_model(args.reward_model) if args.reward_model else None
    if train["query"].shape[1] + args.response_length > policy.config.block_size:
        raise RunError(f"prompt + response ({train['query'].shape[1]} + {args.response_length} tokens) exceed the "
                       f"model context {policy.config.block_size}: lower --response_length")  # fmt: skip
    frozen = [m for m in (ref_policy, reward_model) if m is not None]
    for m in [policy, *frozen]:
        m.to(device)
        if dist.is_initialized():
            shard_model(m, device, bf16)
    for m in frozen:
        m.eval().requires_grad_(False)
    # fused: one kernel for all parameters, on CPU as on CUDA (see docs/benchmarks.md)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  fused=True)  # fmt: skip
    forward_model = torch.compile(policy) if args.compile else policy
    args.out_dir = start_run(args, "grpo", master)
    start_step = load_checkpoint(args.out_dir, policy, optimizer, master)["step"] if args.resume else 0
    stop = {"now": False}  # SIGTERM (a cluster's preemption): finish the step, save a checkpoint, exit
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    def evaluate() -> dict:
        return {"eval/accuracy": greedy_accuracy(policy, test, meta, args.eval_size, local_batch_size,
                args.response_length, rank, world_size, device, ctx)} if use_verifier else {}  # fmt: skip

    if start_step == 0 and (acc := evaluate()):
        log_metrics(args.out_dir, 0, acc, SHOW, master)  # the starting point, for before/after

    # ---- training loop
    rows = slice(rank * local_batch_size, (rank + 1) * local_batch_size)  # this rank's episodes of the global batch
    t0, episodes = time.time(), 0
    for step in range(start_step, num_steps):
        eval_now = (step + 1) % args.eval_every == 0 or step + 1 == num_steps
        log_now = (step + 1) % args.log_every == 0 or step == start_step or eval_now
        rounds, sums = [], dict.fromkeys(("scores", "length", "stopped", "zero_std"), 0.0)  # rollout sums, all rounds
        for rnd in range(1 + args.max_sampling_rounds * args.dynamic_sampling):
            # 1. prompts (see step_prompts): rank r takes a contiguous slice and samples all G responses of each, so
            #    every group lives on one rank
            prompt_idx = step_prompts(args.seed, step, rnd, n_train, P)[rank * local_num_prompts : (rank + 1) * local_num_prompts]
            query = torch.from_numpy(train["query"][prompt_idx]).to(device).repeat_interleave(G, 0)  # (local_bs, Tq)

            # 2. generate: uniforms from one global tensor keyed by (seed, step[, round]), so each episode is sampled
            #    with the same noise on 1 or N ranks; the sampler's own log-probs are pi_old's (no second forward pass)
            rng = np.random.default_rng([args.seed, step] + ([rnd, 0] if rnd else []))
            noise = rng.random((batch_size, args.response_length), dtype=np.float32)[rows]
            with ctx:
                response, logprobs = gpt2.generate(policy, trim_left(query, pad), pad, args.response_length, eos,
                                                   args.temperature, noise=torch.from_numpy(noise).to(device),
                                                   return_logprobs=True)  # (local_bs, Tr) each fmt: skip

            # 3. score: verifier and/or reward model, minus the missing-eos penalty
            scores = score_responses(reward_model, query, response, np.repeat(train["ground_truth"][prompt_idx], G),
                                     meta, use_verifier, args.micro_batch_size, args.missing_eos_penalty, ctx)  # fmt: skip
            for k, v in dict(scores=scores, length=response_mask(response, eos), stopped=(response == eos).any(1),
                             zero_std=zero_std_groups(scores, G)).items():  # fmt: skip
                sums[k] += v.sum()
            ep = dict(query=query, response=response, logprobs=logprobs, scores=scores)
            rounds.append({k: gather_rows(v, rank, world_size) for k, v in ep.items()} if args.dynamic_sampling else ep)
            if not args.dynamic_sampling or sum(int((~zero_std_groups(r["scores"], G)).sum()) for r in rounds) >= P:
                break
        # --dynamic_sampling (DAPO): keep the first P groups with reward variance (topped up with masked zero-variance
        # ones if the rounds ran out), laid out as without it: rank r trains the r-th contiguous slice
        ep = {k: torch.cat([r[k] for r in rounds]) for k in rounds[0]}
        in_loss = torch.ones(local_batch_size, dtype=torch.bool, device=device)
        if args.dynamic_sampling:
            idx, in_loss = (x[rows] for x in select_groups(ep["scores"], G, P))
            ep = {k: v[idx] for k, v in ep.items()}
        query, response, old_logprobs, scores = ep["query"], ep["response"], ep["logprobs"], ep["scores"]
        mask = loss_mask(response, eos, args.mask_truncated) & in_loss[:, None]  # (local_bs, Tr) tokens in the loss

        # 4. advantages: normalised within each prompt's group (all of it on this rank), optionally over the batch
        advantages = group_advantages(scores, G, args.advantage, args.scale_rewards_by_std)
        if args.batch_norm_advantages:
            m1, m2 = all_reduce(torch.stack([advantages.sum(), advantages.square().sum()]).double()) / batch_size
            advantages = ((advantages - m1) / ((m2 - m1.square()).clamp(min=0).sqrt() + 1e-8)).float()

        # 5. log-probs under pi_ref (only when there is one) and, with --recompute_old_logprobs, pi_old's once more
        lp_args = (query, response, pad, eos, args.temperature, micro_batch_size, ctx)
        ref_logprobs = batch_logprobs(ref_policy, *lp_args) if ref_policy is not None else None
        if args.recompute_old_logprobs:
            old_logprobs = batch_logprobs(forward_model, *lp_args)

        # 6. update: num_epochs x num_minibatches optimizer steps; each minibatch takes the same share of every group,
        #    chosen from a generator keyed by (seed, step, epoch) over the global batch, so ranks do not change it
        upd, grad_norm_sum = dict.fromkeys(UPDATE_SUMS, 0.0), 0.0
        for ppo_epoch in range(args.num_epochs):
            order = np.random.default_rng([args.seed, step, ppo_epoch]).random((P, G)).argsort(1)
            order = order[rank * local_num_prompts : (rank + 1) * local_num_prompts] + G * np.arange(local_num_prompts)[:, None]
            for mb in range(args.num_minibatches):
                mb_idx = torch.from_numpy(order[:, mb * samples_per_minibatch : (mb + 1) * samples_per_minibatch].flatten()).to(device)
                # global counts, so 1 and N ranks normalise alike (clamped: a minibatch may be all masked out)
                n_tokens, n_seqs = all_reduce(torch.stack([mask[mb_idx].sum(), mask[mb_idx].any(1).sum()]).float()).clamp(min=1)
                for micro in range(grad_accum):
                    idx = mb_idx[micro * micro_batch_size : (micro + 1) * micro_batch_size]
                    if dist.is_initialized():
                        policy.set_requires_gradient_sync(micro == grad_accum - 1)
                    q, r = trim_padding(query[idx], response[idx], pad, eos)
                    w, m = r.size(1), mask[idx, : r.size(1)].float()
                    # entropy on logging steps only, from the first epoch's forward passes (no extra pass)
                    new_logprobs, entropy = forward_logprobs(forward_model, q, r, pad, eos, args.temperature, ctx,
                                                             with_entropy=log_now and ppo_epoch == 0)  # fmt: skip
                    loss, st = grpo_loss(new_logprobs, old_logprobs[idx, :w], None if ref_policy is None else ref_logprobs[idx, :w],
                                         advantages[idx], m, args.clip_eps_low, args.clip_eps_high, args.beta,
                                         args.kl_estimator, args.importance_level)  # fmt: skip
                    # FSDP averages gradients over ranks: scale by world_size to get the global sum / global count
                    (aggregate_loss(loss, m, args.loss_aggregation, n_tokens, n_seqs,
                                    P * samples_per_minibatch * args.response_length) * world_size).backward()  # fmt: skip
                    st |= dict(ratio_sq=st["ratio"].square(), tokens=torch.ones_like(m))
                    st |= dict(entropy=entropy, entropy_tokens=torch.ones_like(m)) if entropy is not None else {}
                    for k, v in st.items():
                        upd[k] += (v * m).sum()
                # the norm clip_grad_norm_ returns is the global one, before clipping (a DTensor under FSDP2)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                if not torch.isfinite(grad_norm):
                    raise FloatingPointError(f"non-finite loss or grad norm at step {step + 1}: lower --lr; the last "
                                             f"good checkpoint is in {args.out_dir}/checkpoints (--resume)")  # fmt: skip
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                grad_norm_sum += grad_norm  # global already: the same on every rank, not reduced

        # 7. log: named sums over the global batch, reduced once (exact means, the same on 1 or N ranks)
        episodes += batch_size
        if log_now:
            if ref_policy is not None:  # KL(pi_old || pi_ref) per response token, always k3 whatever the loss uses
                resp = response_mask(response, eos)
                upd |= dict(k3=(kl_penalty(old_logprobs, ref_logprobs, old_logprobs, "k3") * resp).sum(), resp=resp.sum())
            s = reduce_sums(sums | upd, device)
            metrics = step_metrics(s, len(rounds) * P, G)
            metrics |= {"train/grad_norm": float(grad_norm_sum) / (args.num_epochs * args.num_minibatches),
                        "perf/episodes_per_sec": episodes / (time.time() - t0)}  # fmt: skip
            if args.dynamic_sampling:  # P groups are trained on; the zero-variance ones sampled were dropped
                metrics |= {"objective/dropped_groups": s["zero_std"], "objective/sampling_rounds": len(rounds)}
            log_metrics(args.out_dir, step + 1, metrics | (evaluate() if eval_now else {}), SHOW, master)
        if eval_now or stop["now"]:
            save_checkpoint(args.out_dir, step + 1, policy, optimizer, args.keep_checkpoints)
        if stop["now"]:
            raise RunError(f"SIGTERM: saved a checkpoint at step {step + 1}; continue with --resume --out_dir {args.out_dir}")
        if log_now:
            t0, episodes = time.time(), 0  # the rate leaves out eval and checkpoint time

    # ---- save the final policy in the HF GPT-2 layout, teardown
    sd = gpt2.full_state_dict(policy)
    if master:
        gpt2.save_model(sd, policy.config, args.out_dir)
        print(f"saved {args.out_dir}/model.safetensors", flush=True)
    finish_run(args, "grpo", master)


def check_args(args: Args):
    if args.model == Args.model and not os.path.isfile(os.path.join(args.model, "model.safetensors")):
        raise RunError("no SFT model at 'runs/sft/latest': run `python sft.py` (or `python pipeline.py`) first, or pass --model DIR")  # fmt: skip
    for flag, choices in CHOICES.items():
        if getattr(args, flag) not in choices:
            raise RunError(f"unknown --{flag} '{getattr(args, flag)}': use one of {', '.join(choices)}")
    if args.num_samples_per_prompt < 2 or args.temperature <= 0:
        raise RunError("GRPO needs --num_samples_per_prompt >= 2 (the group is the baseline) and --temperature > 0")


def step_metrics(s: dict, n_groups: int, group_size: int) -> dict:
    """The logged means of a step from its named sums over every rank: rollout ones per response or group sampled
    (every round), update ones per token in the loss; the KL ones only when there is a reference."""
    n, t = n_groups * group_size, max(s["tokens"], 1)  # t: 0 when every response is masked out of the loss
    out = {"objective/scores": s["scores"] / n, "objective/response_length": s["length"] / n,
           "val/stop_frac": s["stopped"] / n, "objective/zero_std_frac": s["zero_std"] / n_groups,
           "objective/entropy": s["entropy"] / max(s["entropy_tokens"], 1),
           "val/ratio_var": s["ratio_sq"] / t - (s["ratio"] / t) ** 2}  # fmt: skip
    out |= {name: s[k] / t for name, k in TOKEN_MEANS.items() if k != "kl" or "k3" in s}
    return out | ({"objective/kl": s["k3"] / s["resp"]} if "k3" in s else {})


UPDATE_SUMS = ("tokens", "ratio", "ratio_sq", "approxkl", "clipfrac", "pg_loss", "kl", "entropy", "entropy_tokens")
TOKEN_MEANS = {"policy/approxkl_avg": "approxkl", "policy/clipfrac_avg": "clipfrac", "loss/policy_avg": "pg_loss",
               "val/ratio": "ratio", "loss/kl_avg": "kl"}  # metric: per-token sum of the update, over its tokens
SHOW = ("objective/scores", "objective/kl", "eval/accuracy", "perf/episodes_per_sec")  # the status line; metrics.jsonl has all


# ---------------------------------------------------------------------------------------------------------------------
# Reward model (copied verbatim from reward.py, which owns them) and the evaluation shared with sft.py, dpo.py, ppo.py


class ScalarModel(gpt2.GPT):
    """GPT-2 with a scalar head: forward(query_response, attention_mask, keep_from=0) -> scores (B, T - keep_from),
    gain * score(h) + bias at the positions from keep_from on (get_reward asks for the response's only).

    A subclass that adopts the backbone's modules (no copy, no re-init) rather than a wrapper, so its state dict is the
    HF GPT-2 layout plus `score.*`: gpt2.save_model writes a reward-model checkpoint as is, and FSDP2 sharding and the
    resumable checkpoints of the scripts treat it as a GPT. gain/bias are plain floats (not trained, not in the state
    dict): 1 and 0 while training, then set by the normalisation and stored in config.json."""

    def __init__(self, backbone: gpt2.GPT, gain: float = 1.0, bias: float = 0.0):
        nn.Module.__init__(self)  # GPT.__init__ would build and initialise a second backbone
        self.config, self.activation_checkpointing = backbone.config, backbone.activation_checkpointing
        self.transformer, self.lm_head = backbone.transformer, backbone.lm_head  # lm_head: tied to wte, unused
        self.score = nn.Linear(self.config.n_embd, 1)
        # lm-human-preferences: N(0, 1/sqrt(n_embd + 1)) so the initial scores have about unit scale
        nn.init.normal_(self.score.weight, std=1 / math.sqrt(self.config.n_embd + 1))
        nn.init.zeros_(self.score.bias)
        self.reward_gain, self.reward_bias = gain, bias

    def forward(self, query_response, attention_mask, keep_from: int = 0, shared_prefix: int = 0):
        hidden = super().forward(query_response, attention_mask=attention_mask, return_hidden=True, keep_from=keep_from,
                                 shared_prefix=shared_prefix)  # fmt: skip
        return self.score(hidden).squeeze(-1).float() * self.reward_gain + self.reward_bias  # (B, T)


def load_reward_model(path: str) -> ScalarModel:
    """A reward model written by reward.py: backbone + `score.*` head, gain and bias from its config.json."""
    tensors, meta = gpt2.read_checkpoint(path)
    if "score.weight" not in tensors or "score.bias" not in tensors:
        raise ValueError(f"'{path}' has no reward head (score.weight, score.bias): pass a model written by reward.py")
    model = ScalarModel(gpt2.from_hf_state_dict(tensors, meta), meta.get("reward_gain", 1.0), meta.get("reward_bias", 0.0))
    model.score.load_state_dict({"weight": tensors["score.weight"], "bias": tensors["score.bias"]})
    return model


def get_reward(model, query, response, pad_token_id: int, eos_token_id: int):
    """Reward (B,) of each left-padded query (B, Tq) + response (B, Tr): the score at the response's first stop token
    (its last token when it has none). Tokens after the stop token are masked whatever they are (pad may differ from
    eos), so a response is scored the same however it is padded."""
    mask = response_mask(response, eos_token_id)  # (B, Tr) up to and including the stop token
    attention_mask = torch.cat([query != pad_token_id, mask], 1)
    # a prompt several rows share (a preference pair's, a GRPO group's) runs once: gpt2.GPT.forward's shared_prefix
    query_response, Tq = torch.cat([query, response], 1), query.size(1)
    scores = model(query_response, attention_mask, keep_from=Tq, shared_prefix=Tq)  # (B, Tr)
    return scores.gather(1, mask.sum(1, keepdim=True) - 1).squeeze(1)


@torch.no_grad()
def greedy_accuracy(model, prompts, meta, eval_size, batch, response_length, rank, world_size, device, ctx) -> float:
    """Fraction of held-out prompts whose greedy response the task's verifier accepts, over all ranks (each rank
    takes a strided share; the shares are equal, as FSDP2 needs every rank in every forward)."""
    enc, pad, eos = data.get_encoding(meta["tokenizer"]), meta["pad_token_id"], meta["eos_token_id"]
    n = min(eval_size, len(prompts["query"])) // world_size * world_size
    idx, correct = np.arange(rank, n, world_size), 0.0
    was_training = model.training
    model.eval()
    for i in progress(range(0, len(idx), batch), "eval accuracy", rank == 0):
        j = idx[i : i + batch]
        q = torch.from_numpy(prompts["query"][j]).to(device)
        q = q[:, min(int(first_true_indices((q != pad).any(0, keepdim=True))), q.size(1) - 1) :]
        with ctx:
            resp = gpt2.generate(model, q, pad, min(response_length, model.config.block_size - q.size(1)), eos, 0.0)
        stop = first_true_indices(resp == eos).tolist()
        for row, s, gt in zip(resp.tolist(), stop, prompts["ground_truth"][j]):
            correct += data.verify(meta["task"], enc.decode(row[:s]), str(gt))
    model.train(was_training)
    return reduce_sums({"correct": correct}, device)["correct"] / max(n, 1)


# ---------------------------------------------------------------------------------------------------------------------
# ---- plumbing: identical in every script (tests/test_copies.py)
# Distributed setup, FSDP2 wrapping, run directories, checkpoints, logging and one-line errors. Nothing below is part of
# the algorithm; it is copied verbatim between the five scripts so each one stays a single runnable file.


class RunError(Exception):
    """A problem the user can fix (bad flag, missing file, busy out_dir): printed as one line by rank 0, no traceback."""


def exact_div(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b != 0:
        raise RunError(f"{what}: {a} is not divisible by {b}")
    return a // b


def setup_distributed():
    """torchrun → process group (nccl on CUDA, gloo on CPU); plain python → a single process. Returns
    (rank, world_size, device)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, world_size, device


def shard_model(model: torch.nn.Module, device: torch.device, bf16: bool):
    """FSDP2: shard each transformer block, then the root (tied wte/lm_head stay together in the root unit); bf16
    params with fp32 gradient reduction when bf16. Works for a GPT or a reward/value model with a scalar head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in [m for m in model.modules() if isinstance(m, gpt2.Block)]:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (a no-op in a single process)."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def reduce_sums(sums: dict, device) -> dict:
    """{name: scalar} summed over ranks with one all-reduce (stacked once, float64), returned by name."""
    t = all_reduce(torch.stack([torch.as_tensor(v, device=device).detach().double() for v in sums.values()]))
    return dict(zip(sums, t.tolist()))


def start_run(args, algo: str, master: bool) -> str:
    """Claim the run directory and return it. Default: a fresh `runs/<algo>/<time>-s<seed>`, so no run is ever
    overwritten; `runs/<algo>/latest` links to it once it finishes (where the next stage looks by default). An explicit
    --out_dir that already holds a run needs --resume (continue it) or --overwrite (delete it first), so two runs never
    mix in one metrics.jsonl. A lock file holding rank 0's pid stops a second run from writing into the same dir."""
    out_dir, error = args.out_dir or os.path.join("runs", algo, time.strftime("%Y%m%d-%H%M%S") + f"-s{args.seed}"), None
    while master and not args.out_dir and os.path.exists(out_dir):  # two runs started in the same second
        out_dir += "x"
    if master:
        try:
            _claim(args, out_dir, algo)
        except RunError as e:
            error = str(e)
    if dist.is_initialized():  # every rank takes rank 0's name (clocks differ) and fails together, never hangs
        box = [out_dir, error]
        dist.broadcast_object_list(box, src=0)
        out_dir, error = box
    if error:
        raise RunError(error)
    if master:
        print(f"run dir {out_dir} (continue it with --resume --out_dir {out_dir})", flush=True)
        if args.wandb:
            import wandb

            wandb.init(config=asdict(args), dir=out_dir, name=os.path.basename(out_dir))
    return out_dir


def _claim(args, out_dir: str, algo: str):
    if args.resume and not args.out_dir:
        raise RunError(f"--resume needs the run to continue: pass --out_dir runs/{algo}/<run> (printed at its start)")
    lock = os.path.join(out_dir, ".lock")
    if os.path.isfile(lock):
        pid = int(open(lock).read().strip() or 0)
        if pid and pid != os.getpid() and _pid_alive(pid):
            raise RunError(f"another run (pid {pid}) is writing to '{out_dir}': wait for it or pass another --out_dir")
    if args.resume and not glob.glob(os.path.join(out_dir, "checkpoints", "step_*")):
        raise RunError(f"--resume: no checkpoint in '{out_dir}/checkpoints': drop --resume to start a fresh run")
    has_run = any(os.path.exists(os.path.join(out_dir, f)) for f in RUN_FILES)
    if has_run and not (args.resume or args.overwrite):
        raise RunError(f"'{out_dir}' already holds a run: pass --resume to continue it, --overwrite to replace it, "
                       "or another --out_dir")  # fmt: skip
    try:
        if has_run and args.overwrite and not args.resume:
            for path in (os.path.join(out_dir, f) for f in RUN_FILES):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        os.makedirs(os.path.join(out_dir, "checkpoints"), exist_ok=True)
        with open(lock, "w") as f:
            f.write(str(os.getpid()))
        for d in glob.glob(os.path.join(out_dir, "checkpoints", ".tmp_*")):  # a save killed half-way
            shutil.rmtree(d, ignore_errors=True)
        with open(os.path.join(out_dir, "args.json"), "w") as f:
            json.dump(asdict(args) | {"out_dir": out_dir}, f, indent=2)
    except OSError as e:
        raise RunError(f"cannot write to '{out_dir}' ({e.strerror}): pass a writable --out_dir") from None
    atexit.register(lambda: os.path.isfile(lock) and open(lock).read() == str(os.getpid()) and os.remove(lock))


RUN_FILES = ("args.json", "metrics.jsonl", "checkpoints", "model.safetensors", "config.json")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def finish_run(args, algo: str, master: bool):
    """After the final model is saved: point runs/<algo>/latest at a default run dir (relative link, swapped
    atomically), then tear down the process group."""
    if master and args.out_dir == os.path.join("runs", algo, os.path.basename(args.out_dir)):
        link = os.path.join("runs", algo, "latest")
        os.symlink(os.path.basename(args.out_dir), link + ".tmp")
        os.replace(link + ".tmp", link)
        print(f"{link} -> {args.out_dir}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def save_checkpoint(out_dir, step, model, optimizer, keep: int, extra: dict | None = None):
    """Resumable checkpoint `checkpoints/step_N`: the model (HF layout), the optimizer, the step and `extra`. Written to
    a temp dir, fsynced, then renamed into place, so a kill at any moment leaves either the complete checkpoint or
    none; only the last `keep` are kept."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = gpt2.full_state_dict(model)
    opt_sd = optimizer.state_dict()
    if dist.is_initialized():
        opt_sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        root = os.path.join(out_dir, "checkpoints")
        tmp, final = os.path.join(root, f".tmp_step_{step:08d}"), os.path.join(root, f"step_{step:08d}")
        shutil.rmtree(tmp, ignore_errors=True)
        gpt2.save_model(sd, model.config, tmp)
        torch.save(dict(step=step, optimizer=opt_sd, **(extra or {})), os.path.join(tmp, "state.pt"))
        for f in os.listdir(tmp):
            with open(os.path.join(tmp, f), "rb") as fh:
                os.fsync(fh.fileno())
        if os.path.isdir(final):  # the same step saved again (a re-run after --resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        dir_fd = os.open(root, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
        for old in sorted(d for d in os.listdir(root) if d.startswith("step_"))[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(out_dir, model, optimizer, master: bool) -> dict:
    """--resume: load the newest complete checkpoint into the (possibly sharded) model and optimizer and return its
    state (step and extras). A damaged one (truncated file) is skipped with a warning naming it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    root = os.path.join(out_dir, "checkpoints")
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) else []
    for name in reversed(steps):
        path = os.path.join(root, name)
        try:
            sd = gpt2.read_checkpoint(path)[0]
            state = torch.load(os.path.join(path, "state.pt"), weights_only=False)
        except Exception as e:  # noqa: BLE001  (safetensors and torch.load raise many kinds on a truncated file)
            if master:
                print(f"warning: checkpoint {path} is damaged ({e.__class__.__name__}); trying the previous one", flush=True)
            continue
        gpt2.load_full_state_dict(model, gpt2.state_dict_from_hf(sd, model))
        if dist.is_initialized():
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(state["optimizer"])
        if master:
            print(f"resumed from {path} at step {state['step']}", flush=True)
            _truncate_metrics(out_dir, state["step"])
        return state
    raise RunError(f"--resume: no complete checkpoint in '{root}': drop --resume (and pass --overwrite) to start afresh")


def _truncate_metrics(out_dir: str, step: int):
    """Drop the metrics rows a killed run logged after its last checkpoint: they are logged again on resume."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(path):
        rows = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= step]
        with open(path, "w") as f:
            f.writelines(rows)


def log_metrics(out_dir, step: int, metrics: dict, show: tuple, master: bool):
    """Rank 0 appends one JSON row to metrics.jsonl (every metric) and prints one status line (the `show` ones)."""
    if not master:
        return
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    print(f"step {step:5d} | " + " | ".join(f"{k} {metrics[k]:.4g}" for k in show if k in metrics), flush=True)
    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].log(metrics, step=step)


def progress(items, what: str, master: bool, every: float = 5.0):
    """Iterate over `items`, printing `what: i/n (rate/s)` on rank 0 every few seconds and at the end of a long phase."""
    t0 = last = time.time()
    n = len(items)
    for i, item in enumerate(items):
        yield item
        now = time.time()
        if master and (now - last > every or (i + 1 == n and now - t0 > every)):
            print(f"{what}: {i + 1}/{n} ({(i + 1) / (now - t0):.1f}/s)", flush=True)
            last = now


def keep_freed_memory():
    """Linux/glibc: keep freed buffers of up to 32 MiB in the process. By default glibc returns a freed multi-MB buffer
    (a gradient, an activation) to the OS and page-faults it back in on the next step; at the GPT-2 124M shape on CPU
    that made a training step 14% slower and its time vary from run to run (docs/benchmarks.md)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: buffers below 32 MiB come from the heap, not fresh mmaps
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: up to 1 GiB of freed heap stays, for the next step to reuse


def run(main, args):
    """Run main(args); a RunError (or another problem the user can fix) becomes one line on rank 0 and exit code 1.
    Under torchrun the process then exits without the interpreter's teardown. With torch 2.13 on gloo, DTensor's
    caches keep the process group alive past destroy_process_group, and tearing its threads down with the interpreter
    aborted the process (SIGABRT) after the model was saved: 10 of 40 two-rank runs of a small FSDP2 script on a
    loaded 2-core machine."""
    keep_freed_memory()
    code = 0
    try:
        main(args)
    except (RunError, ValueError, FileNotFoundError, FloatingPointError, PermissionError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank once one exits failed: let rank 0 print the one error line first
            time.sleep(1)
        code = 1
    if dist.is_initialized():
        dist.destroy_process_group()
    if "RANK" in os.environ:
        atexit._run_exitfuncs()  # what a normal exit would run (the run-dir lock's cleanup)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run(main, tyro.cli(Args))
