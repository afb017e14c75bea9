"""TensorFlow's Adam (`tf.compat.v1.train.AdamOptimizer`) for PyTorch, and why RLHF cares which Adam it runs.

Kingma & Ba 2014, "Adam: A Method for Stochastic Optimization", Algorithm 1 and the reordering given just before
Section 2.1. TensorFlow implements the reordered form, with t = 1, 2, ...:

    lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
    m    = beta1 * m + (1 - beta1) * g
    v    = beta2 * v + (1 - beta2) * g^2
    x   -= lr_t * m / (sqrt(v) + eps_hat)

PyTorch's `torch.optim.Adam` implements Algorithm 1: x -= lr * m_hat / (sqrt(v_hat) + eps) with the bias-corrected
m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t). The two agree except where epsilon goes: TF adds it to the
uncorrected sqrt(v), PyTorch to the corrected sqrt(v_hat). Dividing TF's update through by sqrt(1 - beta2^t) shows
that TF's Adam *is* PyTorch's Adam with a step-dependent epsilon

    eps_torch(t) = eps_hat / sqrt(1 - beta2^t)      (31.6 * eps_hat at t = 1 for beta2 = 0.999, -> eps_hat as t grows)

so in the first steps, where sqrt(v_hat) ~ |g| is tiny (small gradients, small lr), TF's epsilon dominates the
denominator and its update is smaller and more damped than PyTorch's at the same lr and eps.

Why it matters for RLHF: OpenAI's original RLHF code (openai/lm-human-preferences, `utils/core.py: minimize`) trains
with `tf.train.AdamOptimizer(learning_rate=lr, epsilon=1e-5)`. "The N Implementation Details of RLHF with PPO"
(Huang, Liu, von Werra, 2023) found that PyTorch's Adam at the same lr and eps makes a much more aggressive first
policy update; their repro (github.com/vwxyzjn/minimal-adam-difference) replays lm-human-preferences' first PPO
minibatch and gets approxkl 0.00237 with PyTorch's Adam vs 0.00037 with TF-style Adam (about 6x).

Defaults are TF's (lr=1e-3, betas=(0.9, 0.999), eps=1e-8); pass eps=1e-5 to match lm-human-preferences. Unlike
TF1, hyperparameters and beta^t stay Python floats, not float32 (a ~1e-5 relative difference, tests/test_adam_tf.py).

The experiment below replays it on the offline task (one PPO epoch, 4 minibatches of 64 SFT samples, lr 1e-5, eps
1e-5). On the tiny model (`runs/pipeline/sft`) the first step moves weights 1.58x more with torch's Adam but approxkl
is only 1.15x larger (0.0017 vs 0.0015), not 6x: its gradients mostly exceed TF's first-step eps
(1e-5 / sqrt(1 - 0.999) = 3.2e-4), so both take ~lr-sized sign steps; GPT-2 124M's per-parameter gradients are far
smaller.

    python adam_tf.py --model runs/sft   # the experiment: the first PPO epoch, torch Adam vs AdamTF, side by side
"""

import copy
import sys
from dataclasses import dataclass

import numpy as np
import torch
import tyro

import data
import gpt2

# ---- optimizer


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


# ---- experiment: one PPO epoch on one fixed batch of rollouts, with torch.optim.Adam and with AdamTF


@dataclass
class Args:
    model: str = "runs/sft"
    """the policy at the start of PPO (an SFT checkpoint, as in lm-human-preferences' first update)"""
    data: str = "arithmetic"
    """prompts (prompt_train) of a task with a verifier: `arithmetic` (built in) or a prepared gsm8k directory"""
    seed: int = 1
    """seed for the prompts, the samples and the minibatch order (the same for both optimizers)"""
    batch_size: int = 256
    """rollouts in the fixed batch"""
    num_minibatches: int = 4
    """optimizer steps in the one PPO epoch"""
    lr: float = 1e-5
    """learning rate of both optimizers (ppo.py's default)"""
    eps: float = 1e-5
    """epsilon of both optimizers (lm-human-preferences' value)"""
    temperature: float = 0.7
    """sampling temperature (responses of up to 16 tokens), also applied to the training logprobs"""


def policy_loss(new_logprobs, logprobs, advantages, cliprange):
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7) as a loss; all (B, T). Returns the losses,
    the ratios and where the clipped term was the larger loss (what `clipfrac` counts)."""
    ratio = torch.exp(new_logprobs - logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.max(pg_losses, pg_losses2), ratio, pg_losses2 > pg_losses


def main(args: Args):
    """One batch of samples rewarded by the verifier (1 / 0), each token's advantage its sequence's whitened reward
    (no value model, no KL penalty: only the optimizer differs), then one PPO epoch per optimizer, same start/order."""
    meta = data.load_meta(args.data)
    pad, eos, task = meta["pad_token_id"], meta["eos_token_id"], meta.get("task")
    if task not in ("arithmetic", "gsm8k") or args.batch_size % args.num_minibatches:
        raise ValueError("needs --data with a verifier (arithmetic/gsm8k) and --num_minibatches dividing --batch_size")
    prompts, enc = data.load_split(args.data, "prompt_train"), data.get_encoding(meta["tokenizer"])
    idx = np.random.default_rng(args.seed).permutation(len(prompts["query"]))[: args.batch_size]
    query = torch.from_numpy(prompts["query"][idx])
    query = query[:, int((query != pad).any(0).int().argmax()) :]  # drop the left padding all prompts share
    policy, gen = gpt2.load_model(args.model, vocab_size=meta["vocab_size"]), torch.Generator().manual_seed(args.seed)
    response = gpt2.generate(policy, query, pad, 16, eos, args.temperature, generator=gen)
    mask = ((response == eos).cumsum(1) - (response == eos).long()) == 0  # (B, Tr) real tokens, stop token included
    texts = [enc.decode(row[: row.index(eos)] if eos in row else row) for row in response.tolist()]
    scores = torch.tensor([data.verify(task, t, str(gt)) for t, gt in zip(texts, prompts["ground_truth"][idx])])
    advantages = ((scores - scores.mean()) / (scores.std() + 1e-8))[:, None].expand_as(mask)  # (B, Tr)
    query_response, attention_mask = torch.cat([query, response], 1), torch.cat([query != pad, mask], 1)

    def logprobs(model, i):  # (b, Tr) of the rollouts i, with the sampling temperature
        logits = model(query_response[i], attention_mask=attention_mask[i], keep_from=query.size(1) - 1)[:, :-1]
        return (logits / args.temperature).log_softmax(-1).gather(-1, response[i, :, None].long()).squeeze(-1)

    old_logprobs = logprobs(policy, slice(None)).detach()
    order, size, stats = torch.randperm(args.batch_size, generator=gen), args.batch_size // args.num_minibatches, {}
    for name, opt_cls in (("torch Adam", torch.optim.Adam), ("AdamTF", AdamTF)):
        model = copy.deepcopy(policy)
        opt = opt_cls(model.parameters(), lr=args.lr, eps=args.eps)
        for mb in range(args.num_minibatches + 1):  # the extra pass: the whole batch after the epoch, no step
            i = order[mb * size : (mb + 1) * size] if mb < args.num_minibatches else order
            new_logprobs, m = logprobs(model, i), mask[i]
            pg_losses, ratio, clipped = policy_loss(new_logprobs, old_logprobs[i], advantages[i], 0.2)  # ppo.py's clip
            pg_loss = (pg_losses * m).sum() / m.sum()
            diff, r = (new_logprobs - old_logprobs[i]).detach()[m], ratio.detach()[m]
            row = {f"{k}_{f}": getattr(x, f)().item() for k, x in (("logprobs_diff", diff), ("ratio", r))
                   for f in ("mean", "var", "max", "min")}  # fmt: skip
            row |= dict(approxkl=0.5 * (diff**2).mean().item(), pg_loss=pg_loss.item())
            row["pg_clipfrac"] = clipped[m].float().mean().item()
            moved = [(p - p0).detach().abs().flatten() for p, p0 in zip(model.parameters(), policy.parameters())]
            row["param_change_mean_abs"] = torch.cat(moved).mean().item()  # |theta - theta_0|: the optimizer's steps
            stats.setdefault(mb, {})[name] = row
            if mb < args.num_minibatches:
                opt.zero_grad()
                pg_loss.backward()
                opt.step()
    print(f"{args.batch_size} rollouts of {args.model}, verifier accuracy {scores.mean():.3f}; lr {args.lr}, eps "
          f"{args.eps}\n{'':22s}{'torch Adam':>12s}{'AdamTF':>12s}{'torch/TF':>10s}")
    for mb, rows in stats.items():
        print(f"-- minibatch {mb + 1} (stats before its step)" if mb < len(stats) - 1 else "-- whole batch after the epoch")
        for k in rows["AdamTF"]:
            a, b = rows["torch Adam"][k], rows["AdamTF"][k]
            print(f"{k:22s}{a:12.4g}{b:12.4g}{a / b if b else float('nan'):10.2f}")


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
