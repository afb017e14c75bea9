"""PPO from human feedback: a policy trained against a frozen reward model with a per-token KL penalty to the SFT model.

Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", openai/lm-human-preferences) and Stiennon et
al. 2020 ("Learning to summarize from human feedback"); the details follow Huang et al. 2023 ("The N Implementation
Details of RLHF with PPO") and summarize_from_feedback_details. Four models: the policy (from --model), a frozen
reference (the same weights, never updated), a frozen reward model (--reward_model, written by reward.py) and a value
model. Each update:

  1. generate one response per prompt with the KV cache (temperature T; logits / T in training too, so the
     probabilities PPO optimises are the ones it samples from); tokens after the first stop token are padding
  2. score with the reward model at the last real token; a response that never stops gets --penalty_reward_value
  3. reward per token r_t = -kl_coef * (logprob_t - ref_logprob_t), plus the score at the last real token (Ziegler
     eq. 2); kl_coef fixed or adapted to --target_kl (Ziegler section 2.2) from the global mean KL
  4. GAE advantages (gamma = 1, lam = 0.95), whitened over the real tokens of the whole global batch
  5. --num_ppo_epochs passes over --num_minibatches minibatches: clipped policy loss + vf_coef * clipped value loss

Choices and where they come from:
- Value model: a separate network (Stiennon et al. 2020) whose backbone is the reward model's. Its head starts at zero,
  as lm-human-preferences' value head (`fc_layer(..., scale=0)` in language/model.py: zero weights and bias), so the
  first values are 0; `--value_head reward` copies the reward head instead (summarize_from_feedback_details).
- Optimizer: `--optimizer adam_tf` is TensorFlow's Adam with eps 1e-5, what lm-human-preferences trained with; PyTorch's
  Adam at the same lr/eps makes a larger first update (see adam_tf.py, whose AdamTF is copied here verbatim).
  Policy and value have one optimizer each: Adam is per-parameter and there is no gradient clipping (as in
  lm-human-preferences), so this is the same update as one optimizer over both. lr decays linearly to 0.
- Dropout is off (the GPT-2 config here has dropout 0.0): sampling-time and training-time logprobs must agree.
- Distributed: prompts, sampling noise and the PPO shuffle come from generators seeded identically on every rank, losses
  are normalised by global token counts, so 1 rank and N ranks make the same update when --num_minibatches is 1 (with
  more, each rank shuffles its own slice into minibatches, as lm-human-preferences does).

    python ppo.py                                            # runs/sft + runs/reward on the offline arithmetic task
    python ppo.py --adaptive_kl --target_kl 0.3              # kl_coef adapted to hold the KL near 0.3 nats
    torchrun --nproc_per_node=2 ppo.py                       # FSDP2 over 2 ranks (gloo on CPU, nccl on GPU)
    python ppo.py --model gpt2-sft-dir --reward_model rm-dir --data DIR --lr 3e-6 --response_length 53
    python ppo.py --resume                                   # continue the run in --out_dir from its last checkpoint
"""

import json
import math
import os
import random
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
    model: str = "runs/sft"
    """the SFT policy to start from (and the frozen reference): a checkpoint dir or a GPT-2 preset"""
    reward_model: str = "runs/reward"
    """the reward model checkpoint written by reward.py (also the value model's initial backbone)"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a dataset directory written by `python -m data.prep`"""
    out_dir: str = "runs/ppo"
    """where the policy (HF safetensors layout), checkpoints, args.json and metrics.jsonl are written"""
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
    total_episodes: int = 8192
    """prompts (episodes) to train on; updates = total_episodes / batch_size"""
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
    """sampling temperature; training logprobs use logits / temperature as well"""
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
    whiten_rewards: bool = False
    """whiten the per-token rewards (scale only) before GAE, as lm-human-preferences"""
    value_head: Literal["zero", "reward"] = "zero"
    """value head init: `zero` (lm-human-preferences) or a copy of the reward head (summarize_from_feedback_details)"""
    eval_every: int = 16
    """updates between evals (and checkpoints)"""
    eval_size: int = 500
    """held-out prompts for eval accuracy / score (greedy)"""
    log_every: int = 4
    """updates between status lines / metrics rows"""
    keep_checkpoints: int = 2
    """number of resumable checkpoints kept in out_dir/checkpoints"""
    resume: bool = False
    """continue from the last checkpoint in out_dir"""
    dtype: str = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `float32` or `bfloat16` (autocast; FSDP2 bf16 params + fp32 reduce)"""
    compile: bool = False
    """torch.compile the policy and value forward passes used in training"""
    wandb: bool = False
    """also log to Weights & Biases (imported only when set)"""


# ---------------------------------------------------------------------------------------------------------------------
# Helpers (copied verbatim from sft.py: the distributed boilerplate every script shares)


def exact_div(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index of the first True in each row of (B, T), or T when there is none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def response_mask(response: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) bool: response tokens up to and including the first stop token."""
    stop = first_true_indices(response == eos_token_id)
    return torch.arange(response.size(1), device=response.device)[None, :] <= stop[:, None]


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
    """FSDP2: shard each transformer block, then the root (tied wte/lm_head stay together in the root unit). Works for
    a GPT or any module holding one (a reward/value model with a scalar head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw = dict(mesh=mesh, mp_policy=mp) if mp else dict(mesh=mesh)
    for block in [m for m in model.modules() if isinstance(m, gpt2.Block)]:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def full_state_dict(model: torch.nn.Module) -> dict:
    """The full (unsharded) model state dict on CPU; under FSDP2 gathered on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def all_reduce(x: torch.Tensor, op=None) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x


def save_checkpoint(out_dir, step, model, optimizer, extra, keep):
    """Resumable checkpoint: model (HF layout), optimizer, step, RNG and data position. Written to a temp dir, then
    renamed, so a kill mid-save never leaves a broken checkpoint; only the last `keep` are kept."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = full_state_dict(model)
    opt_sd = optimizer.state_dict()
    if dist.is_initialized():
        opt_sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return dist.barrier()
    root = os.path.join(out_dir, "checkpoints")
    tmp, final = os.path.join(root, f".tmp_step_{step:08d}"), os.path.join(root, f"step_{step:08d}")
    gpt2.save_model(sd, model.config, tmp)
    state = dict(step=step, optimizer=opt_sd, rng=dict(torch=torch.get_rng_state(), numpy=np.random.get_state(),
                 python=random.getstate()), **extra)  # fmt: skip
    torch.save(state, os.path.join(tmp, "state.pt"))
    if os.path.isdir(final):
        os.rename(final, final + ".old")
    os.replace(tmp, final)
    for old in sorted(d for d in os.listdir(root) if d.startswith("step_"))[:-keep]:
        import shutil

        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def latest_checkpoint(out_dir: str) -> str | None:
    root = os.path.join(out_dir, "checkpoints")
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) else []
    return os.path.join(root, steps[-1]) if steps else None


def load_optimizer_state(model, optimizer, opt_sd):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not dist.is_initialized():
        return optimizer.load_state_dict(opt_sd)
    set_optimizer_state_dict(model, optimizer, opt_sd, options=StateDictOptions(full_state_dict=True))


class MetricsLogger:
    """Rank 0 prints one status line and appends one JSON row per log step to out_dir/metrics.jsonl."""

    def __init__(self, args, master: bool):
        self.master, self.path, self.wandb = master, os.path.join(args.out_dir, "metrics.jsonl"), None
        if master:
            try:
                os.makedirs(args.out_dir, exist_ok=True)
                with open(os.path.join(args.out_dir, "args.json"), "w") as f:
                    json.dump(asdict(args), f, indent=2)
            except OSError as e:
                raise PermissionError(f"cannot write to out_dir '{args.out_dir}' ({e.strerror}): pass a writable --out_dir") from None
            if args.wandb:
                import wandb

                self.wandb = wandb.init(config=asdict(args), dir=args.out_dir)

    def log(self, step: int, metrics: dict):
        if not self.master:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        print(f"step {step:5d} | " + " | ".join(f"{k} {v:.4g}" for k, v in metrics.items()), flush=True)
        if self.wandb:
            self.wandb.log(metrics, step=step)


def reduce_metrics(metrics: dict, device) -> dict:
    """Average a dict of scalars over ranks (one all-reduce)."""
    t = torch.tensor(list(metrics.values()), dtype=torch.float64, device=device)
    t = all_reduce(t) / (dist.get_world_size() if dist.is_initialized() else 1)
    return dict(zip(metrics, t.tolist()))


def load_full_state_dict(model: torch.nn.Module, sd: dict):
    """Load a full (unsharded) state dict into a plain or an FSDP2-sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.is_initialized():
        return set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))
    model.load_state_dict(sd)


def full_optimizer_state_dict(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer state with full (unsharded) tensors, as save_checkpoint stores it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not dist.is_initialized():
        return optimizer.state_dict()
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---------------------------------------------------------------------------------------------------------------------
# Reward model (copied verbatim from reward.py, which writes the checkpoints read here)


class ScalarModel(gpt2.GPT):
    """GPT-2 with a scalar head: forward(query_response, attention_mask) -> (B, T) scores, gain * score(h) + bias.

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

    def forward(self, query_response, attention_mask):
        hidden = super().forward(query_response, attention_mask=attention_mask, return_hidden=True)  # (B, T, C)
        return self.score(hidden).squeeze(-1).float() * self.reward_gain + self.reward_bias  # (B, T)


def load_reward_model(path: str) -> ScalarModel:
    """A reward model written by reward.py: backbone + `score.*` head, gain and bias from its config.json."""
    tensors, meta = gpt2.read_checkpoint(path)
    if "score.weight" not in tensors or "score.bias" not in tensors:
        raise ValueError(f"'{path}' has no reward head (score.weight, score.bias): pass a model written by reward.py")
    model = ScalarModel(gpt2.from_hf_state_dict(tensors, meta), meta.get("reward_gain", 1.0), meta.get("reward_bias", 0.0))
    model.score.load_state_dict({"weight": tensors["score.weight"], "bias": tensors["score.bias"]})
    return model


def get_reward(model, query_response, attention_mask):
    """Reward (B,) of each sequence: the score at its last real token (the stop token when the response stopped)."""
    scores = model(query_response, attention_mask)  # (B, T)
    last = attention_mask.size(1) - 1 - first_true_indices(attention_mask.flip(1).bool())  # (B,) last column with a 1
    return scores.gather(1, last[:, None]).squeeze(1)


# ---------------------------------------------------------------------------------------------------------------------
# TensorFlow's Adam (copied verbatim from adam_tf.py; see there for why it differs from torch.optim.Adam)


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
        if not lr >= 0:
            raise ValueError(f"AdamTF: lr must be >= 0, got {lr}; pass e.g. lr=1e-5")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamTF: betas must be two numbers in [0, 1), got {betas}; pass e.g. betas=(0.9, 0.999)")
        if not eps >= 0:
            raise ValueError(f"AdamTF: eps must be >= 0, got {eps}; pass e.g. eps=1e-5")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("AdamTF: sparse gradients are not supported; use dense embeddings (sparse=False)")
                state = self.state[p]
                if not state:
                    low_precision = p.dtype in (torch.bfloat16, torch.float16)
                    state_dtype = torch.float32 if low_precision else p.dtype
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
                    state["v"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                adam_tf_step(p, p.grad, state["m"], state["v"], beta1**t, beta2**t, group["lr"], beta1, beta2,
                             group["eps"])
        return loss


# ---------------------------------------------------------------------------------------------------------------------
# PPO: pure tensor functions (what tests/test_ppo.py checks against loops and formulas)


def trim_left(query: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Drop the left-pad columns every query shares (changes nothing: positions come from the mask)."""
    start = int(first_true_indices((query != pad_token_id).any(0, keepdim=True)).item())
    return query[:, min(start, query.size(1) - 1) :]


def sequence_inputs(query, response, pad_token_id, eos_token_id):
    """query_response (B, Tq + Tr), its attention mask, and the response mask (B, Tr): real tokens up to the stop."""
    mask = response_mask(response, eos_token_id)
    return torch.cat([query, response], 1), torch.cat([query != pad_token_id, mask], 1), mask


def logprobs_from_logits(logits, labels, temperature):
    """Log-probabilities (B, T) of labels under softmax(logits / temperature), the distribution the sampler draws
    from, and the entropies (B, T) of that distribution."""
    logp = (logits.float() / temperature).log_softmax(-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def policy_logprobs(model, query_response, attention_mask, context_length, temperature, ctx):
    """Logprobs and entropies (B, Tr) of the response tokens: position t's logits predict token t + 1."""
    with ctx:
        logits = model(query_response, attention_mask=attention_mask, keep_from=context_length - 1)[:, :-1]
    return logprobs_from_logits(logits, query_response[:, context_length:], temperature)


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the entries where mask is True, with the statistics of the whole global batch (summed
    over ranks); 0 where mask is False. shift_mean=False adds the mean back (lm-human-preferences' reward whitening)."""
    m = mask.double()
    stats = all_reduce(torch.stack([(x * m).sum(), (x.double() ** 2 * m).sum(), m.sum()]))
    mean = stats[0] / stats[2]
    var = stats[1] / stats[2] - mean**2  # population variance, as tf.nn.moments in lm-human-preferences
    whitened = (x.double() - mean) * torch.rsqrt(var + 1e-8)
    return ((whitened if shift_mean else whitened + mean) * m).to(x.dtype)


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


def adaptive_kl_coef(kl_coef, kl, target, n_steps, horizon):
    """Ziegler et al. 2019, section 2.2: beta <- beta * (1 + e * n_steps / horizon), e = clip(KL / target - 1, -0.2,
    0.2), where n_steps is the number of episodes in the batch whose mean KL is `kl`."""
    error = float(np.clip(kl / target - 1, -0.2, 0.2))
    return kl_coef * (1 + error * n_steps / horizon)


# ---------------------------------------------------------------------------------------------------------------------
# Rollout pieces and eval


def value_forward(model, query_response, attention_mask, context_length, ctx):
    """Values (B, Tr): the value of the state before each response token (read where its logits would be)."""
    with ctx:
        return model(query_response, attention_mask)[:, context_length - 1 : -1]


def score_responses(reward_model, query_response, attention_mask, response, eos_token_id, penalty, ctx):
    """Reward-model scores (B,); responses with no stop token get `penalty` instead (summarize_from_feedback_details'
    missing-EOS penalty: a truncated response would otherwise be judged by a reward model that never saw one)."""
    with ctx:
        scores = get_reward(reward_model, query_response, attention_mask)
    if penalty is None:
        return scores
    return torch.where((response == eos_token_id).any(1), scores, torch.full_like(scores, penalty))


@torch.no_grad()
def ppo_eval(policy, reward_model, args, meta, prompts, rank, world_size, device, ctx):
    """Greedy responses to prompt_test: mean reward-model score (missing-EOS penalty included) and, for tasks with a
    verifier, accuracy. Every rank takes an equal contiguous share: under FSDP all ranks must run the same passes."""
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    verifier = meta.get("task") in ("arithmetic", "gsm8k")
    enc = data.get_encoding(meta["tokenizer"]) if verifier else None
    n = min(args.eval_size, len(prompts["query"])) // world_size
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # score, correct, count
    for i in range(rank * n, (rank + 1) * n, args.micro_batch_size):
        j = np.arange(i, min(i + args.micro_batch_size, (rank + 1) * n))
        query = trim_left(torch.from_numpy(prompts["query"][j]).to(device), pad)
        with ctx:
            response = gpt2.generate(policy, query, pad, args.response_length, eos, temperature=0.0)
        query_response, attention_mask, _ = sequence_inputs(query, response, pad, eos)
        scores = score_responses(reward_model, query_response, attention_mask, response, eos, args.penalty_reward_value, ctx)
        sums[0] += scores.sum()
        sums[2] += len(j)
        for row, gt in zip(response.tolist() if verifier else [], prompts["ground_truth"][j]):
            sums[1] += data.verify(meta["task"], enc.decode(row[: row.index(eos)] if eos in row else row), str(gt))
    all_reduce(sums)
    if sums[2] == 0:
        return {}
    out = {"eval/score": (sums[0] / sums[2]).item()}
    if verifier:
        out["eval/accuracy"] = (sums[1] / sums[2]).item()
    return out


# ---------------------------------------------------------------------------------------------------------------------
# PPO training


def main(args: Args):
    # ---- sizes, distributed setup, seeds, logging
    rank, world_size, device = setup_distributed()
    master = rank == 0
    local_batch_size = exact_div(args.batch_size, world_size, "--batch_size must divide by the number of ranks")
    local_mini_batch_size = exact_div(local_batch_size, args.num_minibatches,
                                      "per-rank batch (--batch_size / ranks) must divide by --num_minibatches")  # fmt: skip
    grad_accum = exact_div(local_mini_batch_size, args.micro_batch_size, "per-rank minibatch (--batch_size / ranks / "
                           "--num_minibatches) must divide by --micro_batch_size")  # fmt: skip
    num_updates = exact_div(args.total_episodes, args.batch_size, "--total_episodes must divide by --batch_size")
    if args.temperature <= 0 or (args.adaptive_kl and args.target_kl <= 0):
        raise ValueError("--temperature and --target_kl must be > 0 (PPO samples, and the KL target is a ratio)")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)
    logger = MetricsLogger(args, master)

    # ---- data
    meta = data.load_meta(args.data)
    prompts, test_prompts = data.load_split(args.data, "prompt_train"), data.load_split(args.data, "prompt_test")
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    n_prompts = len(prompts["query"])
    if n_prompts < args.batch_size:
        raise ValueError(f"prompt_train has {n_prompts} prompts, fewer than --batch_size {args.batch_size}")

    # ---- models: policy, frozen reference (= initial policy), frozen reward model, value model (reward backbone)
    policy = gpt2.load_model(args.model, vocab_size=meta["vocab_size"])
    ref_policy = gpt2.load_model(args.model, vocab_size=meta["vocab_size"])
    reward_model, value_model = load_reward_model(args.reward_model), load_reward_model(args.reward_model)
    if args.value_head == "zero":  # lm-human-preferences: value head weights and bias start at 0, so V = 0
        nn.init.zeros_(value_model.score.weight)
        nn.init.zeros_(value_model.score.bias)
        value_model.reward_gain, value_model.reward_bias = 1.0, 0.0
    for name, m in (("--model", policy), ("--reward_model", reward_model)):
        if prompts["query"].shape[1] + args.response_length > m.config.block_size:
            raise ValueError(f"prompt ({prompts['query'].shape[1]}) + --response_length ({args.response_length}) tokens "
                             f"exceed the {name} context of {m.config.block_size}: lower --response_length")  # fmt: skip
        if m.config.vocab_size < meta["vocab_size"]:
            raise ValueError(f"{name} has vocab {m.config.vocab_size} < {meta['vocab_size']} of the dataset's tokenizer")
    ref_policy.requires_grad_(False)
    reward_model.requires_grad_(False)
    for m in (policy, ref_policy, reward_model, value_model):
        m.to(device)
        if dist.is_initialized():
            shard_model(m, device, bf16)
    if args.optimizer == "adam_tf":
        policy_opt, value_opt = (AdamTF(m.parameters(), lr=args.lr, eps=args.eps) for m in (policy, value_model))
    else:
        # fused: one kernel for all parameters (6x the default foreach step for GPT-2 124M on CPU, bench.py)
        policy_opt, value_opt = (torch.optim.Adam(m.parameters(), lr=args.lr, eps=args.eps, fused=True)
                                 for m in (policy, value_model))  # fmt: skip
    fwd_policy, fwd_value = (torch.compile(m) if args.compile else m for m in (policy, value_model))

    # ---- resume: policy, value, both optimizers, kl_coef and RNG continue where the checkpoint left them
    start, kl_coef = 0, args.kl_coef
    ckpt = latest_checkpoint(args.out_dir) if args.resume else None
    if args.resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {args.out_dir}/checkpoints; drop --resume to start fresh")
    if ckpt:
        load_full_state_dict(policy, gpt2.load_model(ckpt).state_dict())
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        load_full_state_dict(value_model, state["value"])
        load_optimizer_state(policy, policy_opt, state["optimizer"])
        load_optimizer_state(value_model, value_opt, state["value_optimizer"])
        start, kl_coef = state["step"], state["kl_coef"]
        torch.set_rng_state(state["rng"]["torch"])
        if master:
            print(f"resumed from {ckpt} at update {start}")

    # SIGTERM (a cluster's preemption): finish the current update, save a checkpoint, exit
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    # ---- training loop
    L, MB, micro = local_batch_size, local_mini_batch_size, args.micro_batch_size
    steps_per_epoch, perm_cache = n_prompts // args.batch_size, {}
    if start == 0:  # the starting point, to compare against
        logger.log(0, ppo_eval(policy, reward_model, args, meta, test_prompts, rank, world_size, device, ctx))
    t0, episodes = time.time(), 0
    for update in range(start, num_updates):
        # 1. prompts: one permutation per epoch from the seed; rank r takes its contiguous slice of the global batch
        epoch, k = divmod(update, steps_per_epoch)
        if epoch not in perm_cache:
            perm_cache = {epoch: np.random.default_rng(args.seed + epoch).permutation(n_prompts)}
        local_idx = perm_cache[epoch][k * args.batch_size : (k + 1) * args.batch_size][rank * L : (rank + 1) * L]
        b_query = trim_left(torch.from_numpy(prompts["query"][local_idx]).to(device), pad)  # (L, Tq)
        context_length = b_query.size(1)
        # sampling uniforms for the global batch from (seed, update): a prompt gets the same sample on 1 or N ranks
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + update)
        noise = torch.rand(args.batch_size, args.response_length, generator=gen)[rank * L : (rank + 1) * L].to(device)

        # 2. rollouts: generate with the KV cache (tokens after the first stop token are padding), then logprobs,
        # reference logprobs, values and scores of the truncated responses
        rollout = {k: [] for k in ("response", "logprobs", "ref_logprobs", "values", "scores")}
        with torch.no_grad():
            for i in range(0, L, micro):
                query = b_query[i : i + micro]
                with ctx:
                    response = gpt2.generate(policy, query, pad, args.response_length, eos,
                                             temperature=args.temperature, noise=noise[i : i + micro])  # fmt: skip
                query_response, attention_mask, _ = sequence_inputs(query, response, pad, eos)
                inputs = (query_response, attention_mask, context_length)
                rollout["response"].append(response)
                rollout["logprobs"].append(policy_logprobs(fwd_policy, *inputs, args.temperature, ctx)[0])
                rollout["ref_logprobs"].append(policy_logprobs(ref_policy, *inputs, args.temperature, ctx)[0])
                rollout["values"].append(value_forward(fwd_value, *inputs, ctx))
                rollout["scores"].append(score_responses(reward_model, query_response, attention_mask, response, eos,
                                                         args.penalty_reward_value, ctx))  # fmt: skip
            b_response, b_logprobs, b_ref_logprobs, b_values, b_scores = (torch.cat(v) for v in rollout.values())
            b_mask = response_mask(b_response, eos)  # (L, Tr) real tokens, the stop token included

            # 3. per-token rewards (Ziegler et al. eq. 2): the KL penalty at every token, the score at the last one
            kl = (b_logprobs - b_ref_logprobs) * b_mask  # (L, Tr)
            non_score_reward = -kl_coef * kl
            rewards = non_score_reward.clone()
            rewards[torch.arange(L, device=device), b_mask.sum(1) - 1] += b_scores
            if args.whiten_rewards:
                rewards = masked_whiten(rewards, b_mask, shift_mean=False)

            # 4. advantages and returns; advantages whitened over the real tokens of the global batch
            b_values = b_values * b_mask
            b_advantages, b_returns = compute_gae(rewards, b_values, b_mask, args.gamma, args.lam)
            b_advantages = masked_whiten(b_advantages, b_mask)

        # 5. PPO: epochs over shuffled minibatches; each minibatch is one optimizer step over its micro-batches
        lr = args.lr * (1 - update / num_updates) if args.anneal_lr else args.lr
        for group in policy_opt.param_groups + value_opt.param_groups:
            group["lr"] = lr
        # token sums of: pg_loss, vf_loss, approxkl, pg_clipfrac, vf_clipfrac, ratio, ratio^2, entropy, count
        sums = torch.zeros(9, dtype=torch.float64, device=device)
        shuffle = torch.Generator().manual_seed(args.seed * 1_000_003 + update)
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(L, generator=shuffle).to(device)
            for mb in range(args.num_minibatches):
                mb_idx = order[mb * MB : (mb + 1) * MB]
                n_tokens = all_reduce(b_mask[mb_idx].sum().float())  # the loss is a mean over the global minibatch
                for j in range(grad_accum):
                    idx = mb_idx[j * micro : (j + 1) * micro]
                    if dist.is_initialized():  # reduce-scatter once per minibatch, on its last micro-batch
                        policy.set_requires_gradient_sync(j == grad_accum - 1)
                        value_model.set_requires_gradient_sync(j == grad_accum - 1)
                    query_response, attention_mask, mask = sequence_inputs(b_query[idx], b_response[idx], pad, eos)
                    inputs = (query_response, attention_mask, context_length)
                    new_logprobs, entropy = policy_logprobs(fwd_policy, *inputs, args.temperature, ctx)
                    vpred = value_forward(fwd_value, *inputs, ctx)
                    pg_losses, ratio, pg_clipped = policy_loss(new_logprobs, b_logprobs[idx], b_advantages[idx],
                                                               args.cliprange)  # fmt: skip
                    vf_losses, vf_clipped = value_loss(vpred, b_values[idx], b_returns[idx], args.cliprange_value)
                    loss = ((pg_losses + args.vf_coef * vf_losses) * mask).sum()
                    # FSDP averages gradients over ranks, so scale by world_size to get sum / global token count
                    (loss * world_size / n_tokens).backward()
                    with torch.no_grad():
                        approxkl = 0.5 * (new_logprobs - b_logprobs[idx]) ** 2
                        parts = (pg_losses, vf_losses, approxkl, pg_clipped, vf_clipped, ratio, ratio**2, entropy, mask)
                        sums += torch.stack([(p * mask).sum() for p in parts]).double()
                policy_opt.step()
                value_opt.step()
                policy_opt.zero_grad(set_to_none=True)
                value_opt.zero_grad(set_to_none=True)

        # 6. statistics over the global batch, then the KL controller (from the global mean KL)
        sums = all_reduce(sums)
        if not torch.isfinite(sums).all():
            raise FloatingPointError(f"non-finite PPO loss at update {update}: lower --lr; the last good checkpoint "
                                     f"is in {args.out_dir}/checkpoints")  # fmt: skip
        avg = (sums[:8] / sums[8]).tolist()
        metrics = reduce_metrics({  # per-sequence means: every rank holds the same number of sequences
            "objective/kl": kl.sum(1).mean().item(),
            "objective/entropy": (-b_logprobs * b_mask).sum(1).mean().item(),
            "objective/non_score_reward": non_score_reward.sum(1).mean().item(),
            "objective/scores": b_scores.mean().item(),
            "val/stop_frac": (b_response == eos).any(1).float().mean().item(),
        }, device)  # fmt: skip
        metrics["objective/rlhf_reward"] = metrics["objective/scores"] + metrics["objective/non_score_reward"]
        metrics["objective/kl_coef"] = kl_coef
        metrics |= dict(zip(["loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "policy/clipfrac_avg",
                             "val/clipfrac_avg", "val/ratio"], avg[:6]))  # fmt: skip
        metrics |= {"val/ratio_var": avg[6] - avg[5] ** 2, "policy/entropy_avg": avg[7], "train/lr": lr}
        if args.adaptive_kl:
            kl_coef = adaptive_kl_coef(kl_coef, metrics["objective/kl"], args.target_kl, args.batch_size, args.kl_horizon)
        episodes += args.batch_size

        done = update + 1
        eval_now = done % args.eval_every == 0 or done == num_updates
        if done % args.log_every == 0 or update == start or eval_now:
            metrics["perf/episodes_per_sec"] = episodes / (time.time() - t0)
            if eval_now:
                metrics |= ppo_eval(policy, reward_model, args, meta, test_prompts, rank, world_size, device, ctx)
            logger.log(done, metrics)
            t0, episodes = time.time(), 0
        if eval_now or stop["now"]:
            extra = dict(value=full_state_dict(value_model), kl_coef=kl_coef,
                         value_optimizer=full_optimizer_state_dict(value_model, value_opt))  # fmt: skip
            save_checkpoint(args.out_dir, done, policy, policy_opt, extra, args.keep_checkpoints)
        if stop["now"]:
            if master:
                print(f"SIGTERM: saved a checkpoint at update {done}; continue with --resume", flush=True)
            break

    # ---- save the final policy in the HF GPT-2 layout, teardown
    sd = full_state_dict(policy)
    if master:
        gpt2.save_model(sd, policy.config, args.out_dir)
        print(f"saved {args.out_dir}/model.safetensors")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:
        main(args)
    except (ValueError, FileNotFoundError, KeyError, FloatingPointError, PermissionError) as e:
        sys.exit(f"error: {e}")
