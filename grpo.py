"""Group Relative Policy Optimization (GRPO): PPO without a value model, advantages from a group of samples.

Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), Sec. 4.1: sample G responses for each prompt from the current
policy, score them (here with the task's verifier and/or a reward model from reward.py), and give every token of a
response the group-normalised reward (r - mean(group)) / std(group) as its advantage. The policy is updated with the
PPO clipped surrogate (Schulman et al. 2017) plus beta * KL(pi_theta || pi_ref) as a term IN THE LOSS (PPO-RLHF puts
the KL in the reward instead), estimated per token from the sampled tokens.

What the field learned since, as flags:
- `--kl_estimator k1|k2|k3|k4`: which per-token estimate of the KL is differentiated (see `kl_penalty`). DeepSeekMath
  uses k3; its gradient is that of KL(pi_ref || pi_theta), the other direction. k4 (ratio * log(pi/pi_ref), from the
  open-instruct GRPO thread, issue #534) has the unbiased gradient of KL(pi_theta || pi_ref) even off-policy.
  `objective/kl` always logs the k3 value, whatever is optimised, so runs are comparable.
- `--loss_aggregation token` (the default; DAPO, Yu et al. 2025, arXiv 2503.14476) averages over all tokens of the
  minibatch, so long responses are not down-weighted; `sequence` is DeepSeekMath's mean per response, then over
  responses. Both divide by GLOBAL counts, so 1 rank and N ranks compute the same update.
- `--no-scale_rewards_by_std` is Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): no division by the group std, which
  over-weights near-unanimous groups. `--batch_norm_advantages` whitens the advantages once more over the global batch.
- `--missing_eos_penalty`: subtract this from the score of a response that never emitted the stop token (TRL's
  meaning; ppo.py's `--penalty_reward_value` instead replaces the score, as lm-human-preferences does).
Deviations: sampling uses the full tempered distribution (no top-k/top-p), so the logprobs in the loss are exactly
those of the sampler; each PPO minibatch takes an equal share of every group (so minibatches are the same on any
number of ranks); a group of G=1 has no baseline and is refused.

    python grpo.py                                     # from runs/sft (what `python sft.py` writes), arithmetic verifier
    torchrun --nproc_per_node=2 grpo.py --beta 0.03    # the same with a KL penalty, FSDP2 over 2 ranks
    python grpo.py --kl_estimator k4 --beta 0.1        # the unbiased-gradient KL estimator
    python grpo.py --reward_model runs/reward --no-verifier --data DIR   # a learned reward (reward.py) instead
    python grpo.py --resume                            # continue the run in --out_dir from its last checkpoint
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

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tyro

import data
import gpt2


@dataclass
class Args:
    model: str = "runs/sft"
    """policy to start from: a checkpoint dir (what `python sft.py` writes), a GPT-2 preset, or `tiny`"""
    ref_model: str | None = None
    """reference policy of the KL term (frozen); default: the same checkpoint as --model"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a dataset directory with prompt_{train,test} from data.prep"""
    reward_model: str | None = None
    """optional reward model dir written by reward.py; its normalised score is added to the verifier reward"""
    verifier: bool = True
    """use the task's verifier (1 correct / 0 wrong) when it has one; --no-verifier leaves the reward model alone"""
    out_dir: str = "runs/grpo"
    """where the model (HF safetensors layout), checkpoints, args.json and metrics.jsonl are written"""
    seed: int = 1
    """seed for prompt order, sampling and minibatch split (identical on every rank)"""
    lr: float = 1e-5
    """learning rate (constant); 1e-5 suits the tiny SFT model (3e-5 and 1e-4 ended below it), ~1e-6 pretrained GPT-2"""
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
    """sampling temperature; the loss uses logprobs of logits / temperature, the distribution actually sampled"""
    beta: float = 0.0
    """KL coefficient (DeepSeekMath: 0.04; 0 = no KL term, as in DAPO and Dr. GRPO)"""
    kl_estimator: str = "k3"
    """per-token KL estimate differentiated in the loss: k1, k2, k3 (DeepSeekMath) or k4 (unbiased gradient)"""
    clip_eps: float = 0.2
    """PPO clip range of the ratio pi_theta / pi_old"""
    loss_aggregation: str = "token"
    """`token`: mean over all tokens of a minibatch (DAPO); `sequence`: mean per response, then over responses"""
    scale_rewards_by_std: bool = True
    """divide group-centred rewards by the group std (GRPO); --no-scale_rewards_by_std is Dr. GRPO"""
    batch_norm_advantages: bool = False
    """whiten the advantages once more over the global batch"""
    missing_eos_penalty: float | None = None
    """subtract this from the score of responses that never emit the stop token"""
    eval_every: int = 50
    """steps between evals (greedy accuracy on prompt_test) and checkpoints"""
    eval_size: int = 500
    """held-out prompts for eval accuracy"""
    log_every: int = 1
    """steps between status lines / metrics rows"""
    keep_checkpoints: int = 2
    """number of resumable checkpoints kept in out_dir/checkpoints"""
    resume: bool = False
    """continue from the last checkpoint in out_dir"""
    dtype: str = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `float32` or `bfloat16` (autocast; FSDP2 bf16 params + fp32 reduce)"""
    compile: bool = False
    """torch.compile the policy for the loss forward passes"""
    wandb: bool = False
    """also log to Weights & Biases (imported only when set)"""


KL_ESTIMATORS = ("k1", "k2", "k3", "k4")

# ---------------------------------------------------------------------------------------------------------------------
# Helpers (pure tensor functions and the distributed boilerplate every script shares)


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


def trim_padding(query: torch.Tensor, response: torch.Tensor, pad_token_id: int):
    """Drop the left-pad columns every query shares and the right-pad columns every response shares (saves compute,
    changes nothing: positions come from the mask)."""
    q_start = int(first_true_indices((query != pad_token_id).any(0, keepdim=True)).item())
    r_len = int(response_mask(response, pad_token_id).sum(1).max().item())
    return query[:, min(q_start, query.size(1) - 1) :], response[:, :r_len]


def trim_left(query: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Drop the left-pad columns every query shares (changes nothing: positions come from the mask)."""
    start = int(first_true_indices((query != pad_token_id).any(0, keepdim=True)).item())
    return query[:, min(start, query.size(1) - 1) :]


def kl_penalty(new_logprobs, ref_logprobs, old_logprobs, estimator: str) -> torch.Tensor:
    """Per-token estimate (B, T) of KL(pi_theta || pi_ref) at tokens sampled from pi_old, differentiable through
    new_logprobs. With logr = log pi_theta - log pi_ref, the true gradient is E_pi[logr * grad log pi] (the extra
    E_pi[grad log pi] is 0). Expected gradients (values: http://joschu.net/blog/kl-approx.html):
      k1 = logr                     E[grad] = E[grad log pi] = 0: k1 in the loss does not pull toward pi_ref
      k2 = logr^2 / 2               E_old[logr * grad log pi] = grad KL only on-policy (pi_old = pi_theta)
      k3 = exp(-logr) - 1 + logr    E[(1 - pi_ref / pi) grad log pi] = -E_ref[grad log pi] = grad KL(pi_ref || pi)
      k4 = w * logr, w = pi_theta / pi_old with the gradient flowing through w (pi_old fixed): grad = w (logr + 1)
           grad log pi, and E_old[w f] = E_pi[f], so E_old[grad] = E_pi[(logr + 1) grad log pi] = grad KL for ANY
           pi_old (later minibatches and epochs too); its value E_old[w logr] = KL is unbiased as well. (w * k3, as in
           DeepSeek-V3.2, is unbiased too: its gradient w logr grad log pi lacks k4's zero-mean w grad log pi.)"""
    logr = new_logprobs - ref_logprobs
    if estimator == "k1":
        return logr
    if estimator == "k2":
        return 0.5 * logr.square()
    if estimator == "k3":
        return torch.expm1(-logr) + logr
    if estimator == "k4":
        return torch.exp(new_logprobs - old_logprobs) * logr
    raise ValueError(f"unknown --kl_estimator '{estimator}': use one of {', '.join(KL_ESTIMATORS)}")


def group_advantages(scores: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-4):
    """(B,) scores of consecutive groups → (B,) advantages (r - mean(group)) [/ (std(group) + eps)] (DeepSeekMath
    Sec. 4.1.2). A group whose rewards are all equal carries no signal: its advantages are exactly 0, never NaN."""
    s = scores.view(-1, group_size)  # (P, G)
    centred = s - s.mean(1, keepdim=True)
    centred = centred.masked_fill((s == s[:, :1]).all(1, keepdim=True), 0.0)  # no rounding residue either
    if scale_by_std:
        centred = centred / (s.std(1, keepdim=True) + eps)
    return centred.flatten()


def grpo_loss(new_logprobs, old_logprobs, ref_logprobs, advantages, clip_eps: float, beta: float, estimator: str):
    """Per-token loss (B, T): PPO-clip surrogate with the response's advantage (B,) + beta * KL estimate, and the
    per-token pieces for logging (detached)."""
    logratio = new_logprobs - old_logprobs
    ratio = torch.exp(logratio)
    pg_losses = -advantages[:, None] * ratio
    pg_losses2 = -advantages[:, None] * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    pg_loss = torch.max(pg_losses, pg_losses2)
    kl = kl_penalty(new_logprobs, ref_logprobs, old_logprobs, estimator)
    stats = dict(ratio=ratio, approxkl=0.5 * logratio.square(), clipfrac=(pg_losses2 > pg_losses).float(),
                 pg_loss=pg_loss, kl=kl)  # fmt: skip
    return pg_loss + beta * kl, {k: v.detach() for k, v in stats.items()}


def aggregate_loss(loss, mask, how: str, n_tokens, n_seqs):
    """Scalar loss from per-token (B, T): `token` = sum / global token count; `sequence` = per-response mean, summed
    and divided by the global number of responses. Global counts make micro-batches and ranks add up exactly."""
    loss = loss * mask
    if how == "token":
        return loss.sum() / n_tokens
    return (loss.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs


def forward_logprobs(model, query, response, pad_token_id, temperature, ctx, with_entropy=False):
    """Logprobs (B, Tr) of the response tokens under logits / temperature (the distribution that was sampled) and,
    if asked, the per-token entropy (B, Tr) of that distribution (detached), else None."""
    attention_mask = torch.cat([query != pad_token_id, response_mask(response, pad_token_id)], 1)
    with ctx:
        # logits from the last prompt position on: position t predicts token t + 1
        logits = model(torch.cat([query, response], 1), attention_mask=attention_mask, keep_from=query.size(1) - 1)[:, :-1]
    logp = F.log_softmax(logits.float() / temperature, dim=-1)  # (B, Tr, V)
    entropy = -(logp.detach().exp() * logp.detach()).sum(-1) if with_entropy else None
    return logp.gather(-1, response.long().unsqueeze(-1)).squeeze(-1), entropy


def decode_responses(enc, response: torch.Tensor, eos_token_id: int) -> list[str]:
    """Text of each response before its first stop token."""
    stop = first_true_indices(response == eos_token_id).tolist()
    return [enc.decode(row[:s]) for row, s in zip(response.tolist(), stop)]


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


def global_grad_norm(parameters) -> torch.Tensor:
    """Clip-free global L2 norm of the gradients (DTensor-aware)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


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


def load_full_state_dict(model: torch.nn.Module, sd: dict):
    """Load a full (unsharded) state dict into a plain or an FSDP2-sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.is_initialized():
        return set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))
    model.load_state_dict(sd)


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


# ---------------------------------------------------------------------------------------------------------------------
# GRPO


@torch.no_grad()
def evaluate_accuracy(model, prompts, meta, n, chunk, response_length, rank, world_size, device, ctx) -> float:
    """Greedy accuracy with the task's verifier on the first n held-out prompts. n is a multiple of world_size and
    every rank makes the same number of generate calls (each gathers the FSDP2 shards: a collective)."""
    enc, pad, eos = data.get_encoding(meta["tokenizer"]), meta["pad_token_id"], meta["eos_token_id"]
    local = n // world_size
    idx = np.arange(rank * local, (rank + 1) * local)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, local, chunk):
        j = idx[i : i + chunk]
        q = trim_left(torch.from_numpy(prompts["query"][j]).to(device), pad)
        with ctx:
            resp = gpt2.generate(model, q, pad, min(response_length, model.config.block_size - q.size(1)), eos, 0.0)
        for text, gt in zip(decode_responses(enc, resp, eos), prompts["ground_truth"][j]):
            sums[0] += data.verify(meta["task"], text, str(gt))
        sums[1] += len(j)
    all_reduce(sums)
    return (sums[0] / sums[1]).item()


def main(args: Args):
    # ---- sizes, distributed setup, seeds, logging
    if args.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown --kl_estimator '{args.kl_estimator}': use one of {', '.join(KL_ESTIMATORS)}")
    if args.loss_aggregation not in ("token", "sequence"):
        raise ValueError(f"unknown --loss_aggregation '{args.loss_aggregation}': use token or sequence")
    if args.num_samples_per_prompt < 2 or args.temperature <= 0:
        raise ValueError("GRPO needs --num_samples_per_prompt >= 2 (the group is the baseline) and --temperature > 0")
    rank, world_size, device = setup_distributed()
    master = rank == 0
    G = args.num_samples_per_prompt
    batch_size = args.num_prompts_per_step * G  # episodes per step, over all ranks
    local_num_prompts = exact_div(args.num_prompts_per_step, world_size, "--num_prompts_per_step must divide by the number of ranks")
    local_batch_size = local_num_prompts * G
    samples_per_minibatch = exact_div(G, args.num_minibatches, "--num_samples_per_prompt must divide by --num_minibatches (each minibatch takes a share of every group)")
    mini_batch_size = args.num_prompts_per_step * samples_per_minibatch  # global
    local_mini_batch_size = local_num_prompts * samples_per_minibatch
    micro_batch_size = min(args.micro_batch_size, local_mini_batch_size)
    grad_accum = exact_div(local_mini_batch_size, micro_batch_size,
                           "per-rank minibatch (--num_prompts_per_step / ranks * --num_samples_per_prompt / --num_minibatches) must divide by --micro_batch_size")  # fmt: skip
    num_steps = args.total_episodes // batch_size
    if num_steps < 1:
        raise ValueError(f"--total_episodes {args.total_episodes} is less than one step of {batch_size} episodes")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)
    logger = MetricsLogger(args, master)

    # ---- data and reward
    meta = data.load_meta(args.data)
    train, test = data.load_split(args.data, "prompt_train"), data.load_split(args.data, "prompt_test")
    pad, eos, enc = meta["pad_token_id"], meta["eos_token_id"], data.get_encoding(meta["tokenizer"])
    use_verifier = args.verifier and meta.get("task") in ("arithmetic", "gsm8k")
    if not use_verifier and args.reward_model is None:
        raise ValueError(f"no reward: task '{meta.get('task')}' has no verifier (or --no-verifier); pass --reward_model DIR written by reward.py")  # fmt: skip
    n_train = len(train["query"])
    if n_train < args.num_prompts_per_step:
        raise ValueError(f"prompt_train has {n_train} prompts, fewer than --num_prompts_per_step {args.num_prompts_per_step}")

    # ---- models: the policy (trained), the reference policy and the reward model (frozen, no optimizer state)
    if args.model == Args.model and not os.path.exists(args.model):
        raise FileNotFoundError(f"no SFT model at '{args.model}': run `python sft.py` first or pass --model DIR")
    policy = gpt2.load_model(args.model, vocab_size=meta["vocab_size"])
    ref_policy = gpt2.load_model(args.ref_model or args.model, vocab_size=meta["vocab_size"])
    reward_model = load_reward_model(args.reward_model) if args.reward_model else None
    if train["query"].shape[1] + args.response_length > policy.config.block_size:
        raise ValueError(f"prompt + response ({train['query'].shape[1]} + {args.response_length} tokens) exceed the "
                         f"model context {policy.config.block_size}: lower --response_length")  # fmt: skip
    # dropout is 0 in every model gpt2.load_model builds: logprobs of the same tokens agree between passes
    frozen = [m for m in (ref_policy, reward_model) if m is not None]
    for m in [policy, *frozen]:
        m.to(device)
        if dist.is_initialized():
            shard_model(m, device, bf16)
    for m in frozen:
        m.eval().requires_grad_(False)
    # fused: one kernel for all parameters, on CPU as on CUDA (6x the default foreach step, GPT-2 124M on CPU: bench.py)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  fused=True)  # fmt: skip
    forward_model = torch.compile(policy) if args.compile else policy

    # ---- resume: the model and optimizer continue where the checkpoint left them; sampling is seeded by the step
    start_step = 0
    ckpt = latest_checkpoint(args.out_dir) if args.resume else None
    if args.resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {args.out_dir}/checkpoints; drop --resume to start fresh")
    if ckpt:
        load_full_state_dict(policy, gpt2.load_model(ckpt).state_dict())
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        load_optimizer_state(policy, optimizer, state["optimizer"])
        start_step = state["step"]
        if master:
            print(f"resumed from {ckpt} at step {start_step}")

    # SIGTERM (a cluster's preemption): finish the current step, save a checkpoint, exit
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    eval_n = min(args.eval_size, len(test["query"])) // world_size * world_size

    def evaluate():
        if not (use_verifier and eval_n):
            return None
        return evaluate_accuracy(policy, test, meta, eval_n, local_batch_size, args.response_length, rank, world_size,
                                 device, ctx)  # fmt: skip

    if start_step == 0 and (acc := evaluate()) is not None:
        logger.log(0, {"eval/accuracy": acc})  # the starting point, for before/after

    # ---- training loop
    steps_per_epoch = n_train // args.num_prompts_per_step
    rows = slice(rank * local_batch_size, (rank + 1) * local_batch_size)
    perm_cache = {}
    for step in range(start_step, num_steps):
        t0 = time.time()
        # 1. the global prompt batch: one permutation per epoch, identical on every rank; rank r takes its contiguous
        #    slice of prompts and samples all G responses of each, so every group lives on one rank
        epoch, k = divmod(step, steps_per_epoch)
        if epoch not in perm_cache:
            perm_cache = {epoch: np.random.default_rng([args.seed, epoch]).permutation(n_train)}
        prompt_idx = perm_cache[epoch][k * args.num_prompts_per_step : (k + 1) * args.num_prompts_per_step]
        prompt_idx = prompt_idx[rank * local_num_prompts : (rank + 1) * local_num_prompts]
        query = trim_left(torch.from_numpy(train["query"][prompt_idx]).to(device), pad).repeat_interleave(G, 0)  # (local_bs, Tq)
        ground_truth = np.repeat(train["ground_truth"][prompt_idx], G)

        # 2. generate: the uniforms come from one global tensor seeded by (seed, step), so each episode is sampled
        #    with the same noise on 1 or N ranks
        noise = np.random.default_rng([args.seed, step]).random((batch_size, args.response_length), dtype=np.float32)
        with ctx:
            response = gpt2.generate(policy, query, pad, args.response_length, eos, args.temperature,
                                     noise=torch.from_numpy(noise[rows]).to(device))  # (local_bs, Tr) fmt: skip
        mask = response_mask(response, eos)  # (local_bs, Tr) to and including the stop token
        stopped = (response == eos).any(1)

        # 3. score: the verifier on the text before the stop token, + the reward model's score at the last real token,
        #    - the missing-eos penalty
        scores = torch.zeros(local_batch_size, device=device)
        if use_verifier:
            texts = decode_responses(enc, response, eos)
            scores += torch.tensor([data.verify(meta["task"], t, str(g)) for t, g in zip(texts, ground_truth)], device=device)
        if reward_model is not None:
            with torch.no_grad(), ctx:
                for i in range(0, local_batch_size, args.micro_batch_size):
                    s = slice(i, i + args.micro_batch_size)
                    q, r = trim_padding(query[s], response[s], pad)
                    scores[s] += get_reward(reward_model, torch.cat([q, r], 1), torch.cat([q != pad, mask[s, : r.size(1)]], 1)).float()
        if args.missing_eos_penalty is not None:
            scores -= args.missing_eos_penalty * (~stopped).float()

        # 4. advantages: normalised within each prompt's group (all of it on this rank), optionally over the batch
        advantages = group_advantages(scores, G, args.scale_rewards_by_std)
        if args.batch_norm_advantages:
            m1, m2 = all_reduce(torch.stack([advantages.sum(), advantages.square().sum()]).double()) / batch_size
            advantages = ((advantages - m1) / ((m2 - m1.square()).clamp(min=0).sqrt() + 1e-8)).float()

        # 5. logprobs of the responses under the sampling policy (pi_old: the ratio's denominator, so the first
        #    minibatch has ratio 1) and under the reference policy, both at the sampling temperature
        old_logprobs, ref_logprobs, entropy = (torch.zeros(response.shape, device=device) for _ in range(3))
        with torch.no_grad():
            for i in range(0, local_batch_size, args.micro_batch_size):
                s = slice(i, i + args.micro_batch_size)
                q, r = trim_padding(query[s], response[s], pad)
                w = r.size(1)
                old_logprobs[s, :w], entropy[s, :w] = forward_logprobs(forward_model, q, r, pad, args.temperature, ctx, True)
                ref_logprobs[s, :w] = forward_logprobs(ref_policy, q, r, pad, args.temperature, ctx)[0]

        # 6. update: num_epochs x num_minibatches optimizer steps; each minibatch takes the same share of every group,
        #    chosen from a generator seeded by (seed, step, epoch) over the global batch, so ranks do not change it
        upd = torch.zeros(7, dtype=torch.float64, device=device)  # tokens, ratio, ratio^2, approxkl, clipfrac, pg, kl
        grad_norms = []
        for ppo_epoch in range(args.num_epochs):
            order = np.random.default_rng([args.seed, step, ppo_epoch]).random((args.num_prompts_per_step, G)).argsort(1)
            order = order[rank * local_num_prompts : (rank + 1) * local_num_prompts] + G * np.arange(local_num_prompts)[:, None]
            for mb in range(args.num_minibatches):
                mb_idx = torch.from_numpy(order[:, mb * samples_per_minibatch : (mb + 1) * samples_per_minibatch].flatten()).to(device)
                n_tokens = all_reduce(mask[mb_idx].sum().float())  # global, so 1 and N ranks normalise alike
                for micro in range(grad_accum):
                    idx = mb_idx[micro * micro_batch_size : (micro + 1) * micro_batch_size]
                    if dist.is_initialized():
                        policy.set_requires_gradient_sync(micro == grad_accum - 1)
                    q, r = trim_padding(query[idx], response[idx], pad)
                    w = r.size(1)
                    new_logprobs = forward_logprobs(forward_model, q, r, pad, args.temperature, ctx)[0]
                    loss, st = grpo_loss(new_logprobs, old_logprobs[idx, :w], ref_logprobs[idx, :w], advantages[idx],
                                         args.clip_eps, args.beta, args.kl_estimator)  # fmt: skip
                    m = mask[idx, :w].float()
                    # FSDP averages gradients over ranks: scale by world_size to get the global sum / global count
                    (aggregate_loss(loss, m, args.loss_aggregation, n_tokens, mini_batch_size) * world_size).backward()
                    per_token = (st["ratio"], st["ratio"].square(), st["approxkl"], st["clipfrac"], st["pg_loss"], st["kl"])
                    upd += torch.stack([m.sum(), *((v * m).sum() for v in per_token)]).double()
                grad_norm = global_grad_norm(policy.parameters())
                if not torch.isfinite(grad_norm):
                    raise FloatingPointError(f"non-finite grad norm at step {step}: lower --lr; "
                                             f"the last good checkpoint is in {args.out_dir}/checkpoints")  # fmt: skip
                torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                grad_norms.append(grad_norm.item())

        # 7. log: sums over the global batch, reduced once (exact means, the same on 1 or N ranks)
        eval_now = (step + 1) % args.eval_every == 0 or step + 1 == num_steps
        if (step + 1) % args.log_every == 0 or step == start_step or eval_now:
            k3 = kl_penalty(old_logprobs, ref_logprobs, old_logprobs, "k3")
            groups = scores.view(-1, G)
            roll = torch.stack([scores.sum(), mask.sum(), (k3 * mask).sum(), (entropy * mask).sum(), stopped.sum(),
                                (groups == groups[:, :1]).all(1).sum()]).double()  # fmt: skip
            roll, upd = all_reduce(roll), all_reduce(upd)
            metrics = {
                "objective/scores": roll[0].item() / batch_size,
                "objective/kl": (roll[2] / roll[1]).item(),
                "objective/entropy": (roll[3] / roll[1]).item(),
                "objective/response_length": roll[1].item() / batch_size,
                "val/stop_frac": roll[4].item() / batch_size,
                "objective/zero_std_frac": roll[5].item() / args.num_prompts_per_step,
                "policy/approxkl_avg": (upd[3] / upd[0]).item(),
                "policy/clipfrac_avg": (upd[4] / upd[0]).item(),
                "loss/policy_avg": (upd[5] / upd[0]).item(),
                "loss/kl_avg": (upd[6] / upd[0]).item(),
                "val/ratio": (upd[1] / upd[0]).item(),
                "val/ratio_var": (upd[2] / upd[0] - (upd[1] / upd[0]).square()).item(),
                "train/grad_norm": float(np.mean(grad_norms)),
                "perf/episodes_per_sec": batch_size / (time.time() - t0),
            }
            if eval_now and (acc := evaluate()) is not None:
                metrics["eval/accuracy"] = acc
            logger.log(step + 1, metrics)
        if eval_now or stop["now"]:
            save_checkpoint(args.out_dir, step + 1, policy, optimizer, {}, args.keep_checkpoints)
        if stop["now"]:
            if master:
                print(f"SIGTERM: saved a checkpoint at step {step + 1}; continue with --resume", flush=True)
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
