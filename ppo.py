"""PPO from human feedback (RLHF): a policy trained against a frozen reward model, with a per-token KL penalty to the
model it started from.

Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", openai/lm-human-preferences), Stiennon et
al. 2020 ("Learning to summarize from human feedback"), Ouyang et al. 2022 (InstructGPT); the details follow Huang et
al. 2023 ("The N Implementation Details of RLHF with PPO") and summarize_from_feedback_details. Four models: the policy
(--model), the frozen reference (a copy of the starting policy), the frozen reward model (--reward_model, reward.py's)
and a value model. Each update is the numbered steps of main:
  1. generate one response per prompt at temperature T (training log-probs use logits / T too)
  2. truncate at the first stop token: what follows it is padding, masked out of everything below
  3. score: log-probs under the policy and the reference, values, and the reward model's score at the last real token;
     a response that never stops gets --penalty_reward_value instead (lm-human-preferences)
  4. per-token rewards r_t = -kl_coef (log π(y_t) - log π_ref(y_t)), plus the score at the last real token
     (Ziegler eq. 2)
  5. rewards whitened (scale only, --whiten_rewards), GAE (Schulman et al. 2016), advantages whitened
  6. --num_ppo_epochs passes over --num_minibatches minibatches: clipped policy loss + vf_coef * clipped value loss
  7. log; kl_coef adapts towards --target_kl (Ziegler section 2.2) from the batch's mean KL
Choices and where they come from:
- Value model: a network of its own, initialised from the reward model (Stiennon et al. 2020, section 3.4; lm-human-
  preferences puts the value head on the policy's transformer). Its head starts at zero like lm-human-preferences'
  (`fc_layer(..., scale=0)`), so the first values are 0; `--value_head reward` keeps the reward head instead.
- `--optimizer adam_tf`: TensorFlow's Adam with eps 1e-5, what lm-human-preferences trained with (adam_tf.py says why
  it differs from torch's). No gradient clipping, lr decays linearly to 0. One optimizer per model: Adam is
  per-parameter, so this is the update of one optimizer over both.
- Rewards are whitened by default, as lm-human-preferences' train_policy.py (`whiten_rewards = True`); rewards and
  advantages use the statistics of the real tokens of the whole global batch (it: each minibatch on each rank).
- 1 rank and N ranks make the same update when --num_minibatches is 1: prompts, sampling noise and shuffles come from
  (seed, update) on every rank and losses are normalised by global token counts (with more minibatches, each rank
  shuffles its own slice into them, as lm-human-preferences does).

    python ppo.py                                          # from runs/sft/latest and runs/reward/latest, offline task
    python ppo.py --no-adaptive_kl --kl_coef 0.05          # a fixed KL coefficient
    torchrun --nproc_per_node=2 ppo.py                     # FSDP2 over 2 ranks (gloo on CPU, nccl on GPU)
    python ppo.py --model runs/sft/<run> --reward_model runs/reward/<run> --data DIR --lr 3e-6 --response_length 53
    python ppo.py --resume --out_dir runs/ppo/<run>        # continue a run from its last checkpoint

Each run writes a fresh `runs/ppo/<time>-s<seed>/` (the policy in the HF safetensors layout, checkpoints, args.json,
metrics.jsonl); `runs/ppo/latest` links to the last finished one. The file is longer than STYLE.md's 550–750 lines
by its plumbing section (~245 lines, identical in every script) and its copies of the TF-style Adam and the reward
model, which let it run alone.
"""

import atexit
import copy
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
from typing import Literal

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
    """the policy to start from (a copy is the frozen reference): an SFT run dir, a GPT-2 preset or `tiny` (random)"""
    reward_model: str = "runs/reward/latest"
    """the reward model written by reward.py (its backbone also starts the value model)"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a dataset directory written by `python -m data.prep`"""
    out_dir: str = ""
    """run directory; default a fresh runs/ppo/<time>-s<seed>, linked as runs/ppo/latest when it finishes"""
    overwrite: bool = False
    """delete the run already in --out_dir and start afresh"""
    resume: bool = False
    """continue the run in --out_dir from its last complete checkpoint"""
    seed: int = 1
    """seed for prompts, sampling and shuffling (identical on every rank)"""
    lr: float = 1e-5
    """learning rate of policy and value (1e-5 suits the tiny model; lm-human-preferences used 5e-6 on GPT-2)"""
    eps: float = 1e-5
    """Adam epsilon (1e-5 as lm-human-preferences)"""
    optimizer: Literal["adam_tf", "adam"] = "adam_tf"
    """`adam_tf` (TensorFlow's Adam, as lm-human-preferences) or `adam` (torch.optim.Adam)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the run"""
    total_episodes: int = 16384
    """prompts (episodes) to train on; updates = total_episodes / batch_size (128 updates: on the offline task seed 2
    reached 0.76 greedy accuracy after 64 and was still climbing, 0.82 after 128)"""
    batch_size: int = 128
    """prompts per rollout / PPO update, over all ranks"""
    num_minibatches: int = 2
    """minibatches (optimizer steps) per PPO epoch"""
    num_ppo_epochs: int = 4
    """passes over each rollout batch"""
    micro_batch_size: int = 64
    """sequences per forward pass on one rank (gradient accumulation makes up each minibatch)"""
    response_length: int = 16
    """max new tokens per response"""
    temperature: float = 0.7
    """sampling temperature; training log-probs use logits / temperature as well"""
    kl_coef: float = 0.2
    """initial coefficient of the per-token KL penalty"""
    adaptive_kl: bool = True
    """adapt kl_coef towards --target_kl (Ziegler et al. 2019); --no-adaptive_kl keeps it fixed"""
    target_kl: float = 0.3
    """target KL to the reference, in nats per response (summed over tokens)"""
    kl_horizon: int = 1000
    """adaptive controller horizon, in episodes (lm-human-preferences: 10000, for runs of ~10^5-10^6 episodes)"""
    penalty_reward_value: float | None = -1.0
    """score that REPLACES the reward of responses without a stop token (lm-human-preferences); None keeps the RM's"""
    gamma: float = 1.0
    """discount"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float = 0.2
    """PPO policy ratio clip"""
    cliprange_value: float = 0.2
    """value prediction clip around the rollout values"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    whiten_rewards: bool = True
    """whiten the per-token rewards (scale only) before GAE: lm-human-preferences' default (train_policy.py)"""
    value_head: Literal["zero", "reward"] = "zero"
    """value head init: `zero` (lm-human-preferences) or the reward head (summarize_from_feedback_details)"""
    eval_every: int = 16
    """updates between evals (and checkpoints)"""
    eval_size: int = 500
    """held-out prompts for the eval score and accuracy (greedy)"""
    log_every: int = 4
    """updates between status lines / metrics rows"""
    keep_checkpoints: int = 2
    """number of resumable checkpoints kept in out_dir/checkpoints"""
    dtype: str = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `float32` or `bfloat16` (autocast; FSDP2 bf16 params + fp32 reduce)"""
    compile: bool = False
    """torch.compile the policy and value forward passes"""
    wandb: bool = False
    """also log to Weights & Biases (imported only when set)"""


# ---------------------------------------------------------------------------------------------------------------------
# PPO: the math, as pure tensor functions (tests/test_ppo.py checks them against loops and formulas)


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens, vectorised over time:
    A_t = sum_{s >= t} (gamma lam)^(s - t) delta_s, delta_t = r_t + gamma V_{t+1} - V_t, as one matmul with an
    upper-triangular (T, T) discount matrix. The state after the last real token is terminal (V = 0).
    rewards, values, mask (B, T) -> advantages, returns (B, T), both 0 after the last real token."""
    values = values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    deltas = (rewards + gamma * next_values - values) * mask
    t = torch.arange(rewards.size(1), device=rewards.device)
    lag = (t[:, None] - t[None, :]).double()  # [s, t] = s - t
    discount = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0), 0.0)
    advantages = (deltas.double() @ discount).to(rewards.dtype) * mask
    return advantages, (advantages + values) * mask


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the entries where mask is True, with the statistics of the whole global batch (summed
    over ranks); 0 where mask is False. shift_mean=False adds the mean back (lm-human-preferences' reward whitening)."""
    m = mask.double()
    stats = all_reduce(torch.stack([(x * m).sum(), (x.double() ** 2 * m).sum(), m.sum()]))
    mean = stats[0] / stats[2]
    var = stats[1] / stats[2] - mean**2  # population variance, as tf.nn.moments in lm-human-preferences
    whitened = (x.double() - mean) * torch.rsqrt(var + 1e-8)
    return ((whitened if shift_mean else whitened + mean) * m).to(x.dtype)


def policy_loss(new_logprobs, logprobs, advantages, cliprange):
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7) as a loss; all (B, T). Returns the losses,
    the ratios and where the clipped term was the larger loss (what `clipfrac` counts)."""
    ratio = torch.exp(new_logprobs - logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.max(pg_losses, pg_losses2), ratio, pg_losses2 > pg_losses


def value_loss(vpred, values, returns, cliprange_value):
    """Clipped value loss per token (lm-human-preferences): the prediction may move at most cliprange_value from the
    rollout's value, and the larger of the clipped and unclipped squared errors is taken. Returns losses, clipped."""
    vpred_clipped = values + torch.clamp(vpred - values, -cliprange_value, cliprange_value)
    vf_losses1, vf_losses2 = (vpred - returns) ** 2, (vpred_clipped - returns) ** 2
    return 0.5 * torch.max(vf_losses1, vf_losses2), vf_losses2 > vf_losses1


def per_token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef):
    """Ziegler et al. 2019 eq. 2, per token: r_t = -kl_coef (log π(y_t) - log π_ref(y_t)), plus the score (B,) at the
    last real token. Returns the rewards, their KL part (non_score_reward) and the KL, all (B, T), 0 after the last
    real token."""
    kl = (logprobs - ref_logprobs) * mask
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rewards[torch.arange(len(scores), device=scores.device), mask.sum(1) - 1] += scores
    return rewards, non_score_reward, kl


def adaptive_kl_coef(kl_coef, kl, target, n_steps, horizon):
    """Ziegler et al. 2019, section 2.2: beta <- beta * (1 + e * n_steps / horizon), e = clip(KL / target - 1, -0.2,
    0.2), where n_steps is the number of episodes in the batch whose mean KL is `kl`."""
    error = float(np.clip(kl / target - 1, -0.2, 0.2))
    return kl_coef * (1 + error * n_steps / horizon)


def penalised_scores(scores, response, eos_token_id, penalty):
    """Scores (B,), with `penalty` instead for a response with no stop token (lm-human-preferences'
    penalty_reward_value: the reward model never saw a truncated response); penalty None changes nothing."""
    if penalty is None:
        return scores
    return torch.where((response == eos_token_id).any(1), scores, torch.full_like(scores, penalty))


def logprobs_from_logits(logits, labels, temperature, with_entropy=False):
    """Log-probabilities (B, T) of labels under softmax(logits / temperature), the distribution the sampler draws
    from, and with_entropy that distribution's entropy (B, T) from the same log-softmax, without gradient (a
    statistic; a (B, T, V) pass, so only when logged), else None."""
    logp = (logits.float() / temperature).log_softmax(-1)
    logprobs = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        return logprobs, -(logp.exp() * logp).sum(-1) if with_entropy else None


# ---- TensorFlow's Adam (the optimizer of adam_tf.py, copied; see there for how it differs from torch.optim.Adam)


def adam_tf_step(p, g, m, v, beta1_power, beta2_power, lr, beta1, beta2, eps):
    """One TensorFlow Adam update, in place on p, m, v. The arguments are those of TF's `ApplyAdam` op.

    beta1_power, beta2_power = beta1**t, beta2**t at step t = 1, 2, ... (passed in, not derived from t, so a caller
    can reproduce TF's own bookkeeping). Element-wise ops only, so it runs unchanged on FSDP2 DTensor shards.
    m and v may be fp32 for a bf16 p: the update is computed in m's dtype and rounded into p once.
    """
    g = g.to(m.dtype)
    m.mul_(beta1).add_(g, alpha=1 - beta1)  # m_t = beta1 m + (1 - beta1) g
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v_t = beta2 v + (1 - beta2) g^2
    lr_t = lr * (1 - beta2_power) ** 0.5 / (1 - beta1_power)  # both bias corrections folded into the step size
    p.sub_((m * lr_t) / (v.sqrt() + eps))  # eps on the *uncorrected* sqrt(v): the paper's eps_hat


class AdamTF(torch.optim.Optimizer):
    """`tf.compat.v1.train.AdamOptimizer` as a torch optimizer (no weight decay, no amsgrad: TF1's Adam has neither).

    State per parameter: `step` (int), `m`, `v` (param dtype for fp32/fp64; fp32 for bf16/fp16 params, whose
    ~3 significant digits cannot hold v = 1e-3 g^2 accumulations). Works with FSDP2: m, v are created like the
    (sharded DTensor) parameter, so each rank only stores and updates its shard.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps))

    @torch.no_grad()
    def step(self, closure=None):  # closure: unused, but torch.distributed.checkpoint calls step(closure=None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    dtype = torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype
                    state.update(step=0, m=torch.zeros_like(p, dtype=dtype), v=torch.zeros_like(p, dtype=dtype))
                state["step"] += 1
                t = state["step"]
                adam_tf_step(p, p.grad, state["m"], state["v"], beta1**t, beta2**t, group["lr"], beta1, beta2,
                             group["eps"])


# ---- masks (shared with the other scripts)


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


# ---------------------------------------------------------------------------------------------------------------------
# The models' forward passes: log-probs, values, scores of query + response


def sequence_inputs(query, response, pad_token_id, eos_token_id):
    """query_response (B, Tq + Tr) and its attention mask: the prompt's real tokens, the response up to and including
    its first stop token."""
    return torch.cat([query, response], 1), torch.cat([query != pad_token_id, response_mask(response, eos_token_id)], 1)


def forward_logits(model, query_response, attention_mask, context_length, ctx):
    """Logits (B, Tr, V) of each response token: position t's logits predict token t + 1, so the last token is only
    predicted, never read, and is left out of the input (one position less of compute)."""
    with ctx:
        return model(query_response[:, :-1], attention_mask=attention_mask[:, :-1], keep_from=context_length - 1)


def forward_values(model, query_response, attention_mask, context_length, ctx):
    """Values (B, Tr): the value of the state before each response token (read where its logits would be; the last
    token is left out of the input as in forward_logits)."""
    with ctx:
        return model(query_response[:, :-1], attention_mask[:, :-1], keep_from=context_length - 1)


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
        return self.score(hidden).squeeze(-1).float() * self.reward_gain + self.reward_bias  # (B, T - keep_from)


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


# ---------------------------------------------------------------------------------------------------------------------
# main


def main(args: Args):
    # ---- flags (before any heavy work), sizes, distributed setup, seeds
    for flag, path, stage in (("--model", args.model, "sft"), ("--reward_model", args.reward_model, "reward")):
        if path == f"runs/{stage}/latest" and not os.path.isfile(os.path.join(path, "model.safetensors")):
            raise RunError(f"no {stage} model at '{path}': run `python {stage}.py` (or `python pipeline.py`) first, or "
                           f"pass {flag} DIR")  # fmt: skip
    if args.temperature <= 0 or (args.adaptive_kl and args.target_kl <= 0):
        raise RunError("--temperature and --target_kl must be > 0 (PPO samples, and the KL target is a ratio)")
    rank, world_size, device = setup_distributed()
    master = rank == 0
    local_batch_size = exact_div(args.batch_size, world_size, "--batch_size must divide by the number of ranks")
    local_mini_batch_size = exact_div(local_batch_size, args.num_minibatches, "per-rank batch (--batch_size / ranks) "
                                      "must divide by --num_minibatches")  # fmt: skip
    grad_accum = exact_div(local_mini_batch_size, args.micro_batch_size, "per-rank minibatch (--batch_size / ranks / "
                           "--num_minibatches) must divide by --micro_batch_size")  # fmt: skip
    num_updates = exact_div(args.total_episodes, args.batch_size, "--total_episodes must divide by --batch_size")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)

    # ---- data
    meta = data.load_meta(args.data)
    prompts, test_prompts = data.load_split(args.data, "prompt_train"), data.load_split(args.data, "prompt_test")
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    n_prompts = len(prompts["query"])
    if n_prompts < args.batch_size:
        raise RunError(f"prompt_train has {n_prompts} prompts, fewer than --batch_size {args.batch_size}: lower it")

    # ---- models: the policy, the reference (a copy of the starting policy, so a random `tiny` init is its own
    # reference too), the frozen reward model, the value model (the reward model's backbone, trained)
    policy = gpt2.load_model(args.model, vocab_size=meta["vocab_size"])
    ref_policy = copy.deepcopy(policy).requires_grad_(False)
    reward_model = load_reward_model(args.reward_model)
    value_model = copy.deepcopy(reward_model)
    reward_model.requires_grad_(False)
    if args.value_head == "zero":  # lm-human-preferences: value head weights and bias start at 0, so V = 0
        nn.init.zeros_(value_model.score.weight)
        nn.init.zeros_(value_model.score.bias)
        value_model.reward_gain, value_model.reward_bias = 1.0, 0.0
    for name, m in (("--model", policy), ("--reward_model", reward_model)):
        if prompts["query"].shape[1] + args.response_length > m.config.block_size:
            raise RunError(f"prompt ({prompts['query'].shape[1]}) + --response_length ({args.response_length}) tokens "
                           f"exceed the {name} context of {m.config.block_size}: lower --response_length")  # fmt: skip
    if reward_model.config.vocab_size < meta["vocab_size"]:
        raise RunError(f"--reward_model has a {reward_model.config.vocab_size}-token vocabulary, fewer than the data "
                       f"tokenizer's {meta['vocab_size']}: pass a reward model trained on this data")  # fmt: skip
    for m in (policy, ref_policy, reward_model, value_model):
        m.to(device)
        if dist.is_initialized():
            shard_model(m, device, bf16)
    if args.optimizer == "adam_tf":
        policy_opt, value_opt = (AdamTF(m.parameters(), lr=args.lr, eps=args.eps) for m in (policy, value_model))
    else:  # fused: one kernel for all parameters, on CPU as on CUDA (see docs/benchmarks.md)
        policy_opt, value_opt = (torch.optim.Adam(m.parameters(), lr=args.lr, eps=args.eps, fused=True)
                                 for m in (policy, value_model))  # fmt: skip
    fwd_policy, fwd_value = (torch.compile(m) if args.compile else m for m in (policy, value_model))
    args.out_dir = start_run(args, "ppo", master)
    state = load_checkpoint(args.out_dir, policy, policy_opt, master) if args.resume else None
    if state:  # the reference stays the starting policy; value model, its optimizer and kl_coef continue
        load_value_state(state, value_model, value_opt)
    start, kl_coef = (state["step"], state["kl_coef"]) if state else (0, args.kl_coef)
    stop = {"now": False}  # SIGTERM (a cluster's preemption): finish the update, save a checkpoint, exit
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    def evaluate() -> dict:
        out = {"eval/score": eval_score(policy, reward_model, test_prompts, meta, args, rank, world_size, device, ctx)}
        if meta.get("task"):
            out["eval/accuracy"] = greedy_accuracy(policy, test_prompts, meta, args.eval_size, args.micro_batch_size,
                                                   args.response_length, rank, world_size, device, ctx)  # fmt: skip
        return out

    if state is None:  # the starting policy's numbers, to compare against
        log_metrics(args.out_dir, 0, evaluate(), SHOW, master)

    # ---- training loop: one permutation of the prompts per epoch from (seed, epoch), identical on every rank; rank r
    # takes its contiguous slice of each global batch, so any number of ranks sees the same global batches
    L, MB, micro, T = local_batch_size, local_mini_batch_size, args.micro_batch_size, args.temperature
    steps_per_epoch, perm_cache = n_prompts // args.batch_size, {}
    t0, episodes = time.time(), 0
    for update in range(start, num_updates):
        done = update + 1
        eval_now = done % args.eval_every == 0 or done == num_updates
        log_now = done % args.log_every == 0 or update == start or eval_now
        epoch, k = divmod(update, steps_per_epoch)
        if epoch not in perm_cache:
            perm_cache = {epoch: np.random.default_rng([args.seed, epoch]).permutation(n_prompts)}
        local_idx = perm_cache[epoch][k * args.batch_size : (k + 1) * args.batch_size][rank * L : (rank + 1) * L]
        b_query = torch.from_numpy(prompts["query"][local_idx]).to(device)  # (L, Tq) left-padded
        b_query = b_query[:, min(int(first_true_indices((b_query != pad).any(0, keepdim=True))), b_query.size(1) - 1) :]
        context_length = b_query.size(1)

        # 1. generate one response per prompt with the KV cache. The sampling uniforms of the global batch come from
        # (seed, update), so a prompt gets the same sample on 1 or N ranks (tags 1, 2: [seed, n, 0] = [seed, n])
        noise = np.random.default_rng([args.seed, update, 1]).random((args.batch_size, args.response_length), "f4")
        noise = torch.from_numpy(noise[rank * L : (rank + 1) * L]).to(device)  # (L, response_length)
        with torch.no_grad(), ctx:
            b_response = torch.cat([gpt2.generate(policy, b_query[i : i + micro], pad, args.response_length, eos, T,
                                                  noise=noise[i : i + micro]) for i in range(0, L, micro)])  # fmt: skip

        # 2. truncate at the first stop token: the mask keeps it and drops what follows (generate wrote pad there);
        # the columns after every response's stop are dropped (changes nothing: they are masked everywhere)
        b_query, b_response = trim_padding(b_query, b_response, pad, eos)
        b_mask = response_mask(b_response, eos)  # (L, Tr)

        # 3. score: log-probs of the sampled tokens under the policy and the reference, values, reward-model scores
        rollout = {k: [] for k in ("logprobs", "ref_logprobs", "values", "scores")}
        with torch.no_grad():
            for i in range(0, L, micro):
                query, response = b_query[i : i + micro], b_response[i : i + micro]
                inputs = (*sequence_inputs(query, response, pad, eos), context_length, ctx)
                for name, model in (("logprobs", fwd_policy), ("ref_logprobs", ref_policy)):
                    rollout[name].append(logprobs_from_logits(forward_logits(model, *inputs), response, T)[0])
                rollout["values"].append(forward_values(fwd_value, *inputs))
                with ctx:
                    scores = get_reward(reward_model, query, response, pad, eos)
                rollout["scores"].append(penalised_scores(scores, response, eos, args.penalty_reward_value))
            b_logprobs, b_ref_logprobs, b_values, b_scores = (torch.cat(v) for v in rollout.values())

            # 4. per-token rewards: the KL penalty at every token, the score at the last one (Ziegler et al. eq. 2)
            rewards, non_score_reward, kl = per_token_rewards(b_scores, b_logprobs, b_ref_logprobs, b_mask, kl_coef)
            if args.whiten_rewards:  # scale only: the sign of the summed reward is kept (lm-human-preferences)
                rewards = masked_whiten(rewards, b_mask, shift_mean=False)

            # 5. values, GAE advantages and returns; advantages whitened over the real tokens of the global batch
            b_values = b_values * b_mask
            b_advantages, b_returns = compute_gae(rewards, b_values, b_mask, args.gamma, args.lam)
            b_advantages = masked_whiten(b_advantages, b_mask)

        # 6. PPO: epochs over shuffled minibatches; each minibatch is one optimizer step over its micro-batches. Stats
        # are token sums; the policy's entropy only on the updates that are logged
        lr = args.lr * (1 - update / num_updates) if args.anneal_lr else args.lr
        for group in policy_opt.param_groups + value_opt.param_groups:
            group["lr"] = lr
        sums = dict.fromkeys(("pg_loss", "vf_loss", "approxkl", "pg_clipfrac", "vf_clipfrac", "ratio", "ratio_sq",
                              "tokens") + (("entropy",) if log_now else ()), 0.0)  # fmt: skip
        shuffle = np.random.default_rng([args.seed, update, 2])
        for _ in range(args.num_ppo_epochs):
            order = torch.from_numpy(shuffle.permutation(L)).to(device)
            for mb in range(args.num_minibatches):
                mb_idx = order[mb * MB : (mb + 1) * MB]
                n_tokens = all_reduce(b_mask[mb_idx].sum().float())  # the loss is a mean over the global minibatch
                for j in range(grad_accum):
                    idx = mb_idx[j * micro : (j + 1) * micro]
                    if dist.is_initialized():  # reduce-scatter once per minibatch, on its last micro-batch
                        policy.set_requires_gradient_sync(j == grad_accum - 1)
                        value_model.set_requires_gradient_sync(j == grad_accum - 1)
                    inputs = (*sequence_inputs(b_query[idx], b_response[idx], pad, eos), context_length, ctx)
                    logits = forward_logits(fwd_policy, *inputs)
                    new_logprobs, entropy = logprobs_from_logits(logits, b_response[idx], T, with_entropy=log_now)
                    vpred = forward_values(fwd_value, *inputs)
                    logprobs, mask = b_logprobs[idx], b_mask[idx]
                    pg_losses, ratio, pg_clipped = policy_loss(new_logprobs, logprobs, b_advantages[idx], args.cliprange)
                    vf_losses, vf_clipped = value_loss(vpred, b_values[idx], b_returns[idx], args.cliprange_value)
                    loss = ((pg_losses + args.vf_coef * vf_losses) * mask).sum()
                    # FSDP averages gradients over ranks, so scale by world_size to get sum / global token count
                    (loss * world_size / n_tokens).backward()
                    with torch.no_grad():
                        stats = dict(pg_loss=pg_losses, vf_loss=vf_losses, approxkl=0.5 * (new_logprobs - logprobs) ** 2,
                                     pg_clipfrac=pg_clipped, vf_clipfrac=vf_clipped, ratio=ratio, ratio_sq=ratio**2,
                                     tokens=mask)  # fmt: skip
                        if entropy is not None:
                            stats["entropy"] = entropy
                        for name, x in stats.items():
                            sums[name] = sums[name] + (x * mask).sum()
                policy_opt.step()
                value_opt.step()
                policy_opt.zero_grad(set_to_none=True)
                value_opt.zero_grad(set_to_none=True)

        # 7. statistics of the global batch (one all-reduce), the KL controller, log, evaluate, checkpoint
        rollout_sums = {"kl": kl.sum(), "neg_logprobs": -(b_logprobs * b_mask).sum(), "scores": b_scores.sum(),
                        "non_score_reward": non_score_reward.sum(), "stopped": (b_response == eos).any(1).sum()}
        s = reduce_sums(rollout_sums | sums, device)
        if not all(math.isfinite(v) for v in s.values()):
            raise FloatingPointError(f"non-finite PPO statistics at update {done}: lower --lr; the last good "
                                     f"checkpoint is in {args.out_dir}/checkpoints (--resume)")  # fmt: skip
        per_seq, per_token = (lambda k: s[k] / args.batch_size), (lambda k: s[k] / s["tokens"])
        metrics = {"objective/kl": per_seq("kl"), "objective/entropy": per_seq("neg_logprobs"),
                   "objective/non_score_reward": per_seq("non_score_reward"), "objective/scores": per_seq("scores"),
                   "objective/rlhf_reward": per_seq("scores") + per_seq("non_score_reward"),
                   "objective/kl_coef": kl_coef,
                   "loss/policy_avg": per_token("pg_loss"), "loss/value_avg": per_token("vf_loss"),
                   "policy/approxkl_avg": per_token("approxkl"), "policy/clipfrac_avg": per_token("pg_clipfrac"),
                   "val/clipfrac_avg": per_token("vf_clipfrac"), "val/ratio": per_token("ratio"),
                   "val/ratio_var": per_token("ratio_sq") - per_token("ratio") ** 2,
                   "val/stop_frac": per_seq("stopped"), "train/lr": lr}  # fmt: skip
        if log_now:
            metrics["policy/entropy_avg"] = per_token("entropy")
        if args.adaptive_kl:
            kl_coef = adaptive_kl_coef(kl_coef, metrics["objective/kl"], args.target_kl, args.batch_size,
                                       args.kl_horizon)  # fmt: skip
        episodes += args.batch_size
        if log_now:
            metrics["perf/episodes_per_sec"] = episodes / (time.time() - t0)
            if eval_now:
                metrics |= evaluate()
            log_metrics(args.out_dir, done, metrics, SHOW, master)
            t0, episodes = time.time(), 0
        if eval_now or stop["now"]:
            extra = value_state(value_model, value_opt) | {"kl_coef": kl_coef}
            save_checkpoint(args.out_dir, done, policy, policy_opt, args.keep_checkpoints, extra)
        if stop["now"]:
            raise RunError(f"SIGTERM: saved a checkpoint at update {done}; continue with --resume --out_dir "
                           f"{args.out_dir}")  # fmt: skip

    # ---- save the final policy in the HF GPT-2 layout, teardown
    sd = gpt2.full_state_dict(policy)
    if master:
        gpt2.save_model(sd, policy.config, args.out_dir)
        print(f"saved {args.out_dir}/model.safetensors", flush=True)
    finish_run(args, "ppo", master)


SHOW = ("objective/scores", "objective/kl", "policy/approxkl_avg", "eval/accuracy", "perf/episodes_per_sec")  # status


# ---------------------------------------------------------------------------------------------------------------------
# The value model's checkpoint (save_checkpoint holds one model and its optimizer: the policy), and evaluation


def value_state(value_model, value_opt) -> dict:
    """The value model and its optimizer as full (unsharded) state dicts, for save_checkpoint's `extra` (all ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opt_sd = value_opt.state_dict()
    if dist.is_initialized():
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        opt_sd = get_optimizer_state_dict(value_model, value_opt, options=options)
    return {"value": gpt2.full_state_dict(value_model), "value_optimizer": opt_sd}


def load_value_state(state: dict, value_model, value_opt):
    """Inverse of value_state: load into the (possibly sharded) value model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    gpt2.load_full_state_dict(value_model, state["value"])
    if dist.is_initialized():
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(value_model, value_opt, state["value_optimizer"], options=options)
    else:
        value_opt.load_state_dict(state["value_optimizer"])


@torch.no_grad()
def eval_score(policy, reward_model, prompts, meta, args, rank, world_size, device, ctx) -> float:
    """Mean reward-model score (missing-stop penalty included) of greedy responses to held-out prompts, over all ranks
    (strided equal shares, as greedy_accuracy: FSDP2 needs every rank in every forward)."""
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    n = min(args.eval_size, len(prompts["query"])) // world_size * world_size
    idx, total = np.arange(rank, n, world_size), 0.0
    for i in progress(range(0, len(idx), args.micro_batch_size), "eval score", rank == 0):
        query = torch.from_numpy(prompts["query"][idx[i : i + args.micro_batch_size]]).to(device)
        query = query[:, min(int(first_true_indices((query != pad).any(0, keepdim=True))), query.size(1) - 1) :]
        with ctx:
            response = gpt2.generate(policy, query, pad, args.response_length, eos, temperature=0.0)
            scores = get_reward(reward_model, query, response, pad, eos)
        total += penalised_scores(scores, response, eos, args.penalty_reward_value).sum().item()
    return reduce_sums({"score": total}, device)["score"] / max(n, 1)


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
