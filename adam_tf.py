"""TensorFlow's Adam (`tf.compat.v1.train.AdamOptimizer`) for PyTorch: what
lm-human-preferences trained PPO with.

Kingma & Ba 2014, "Adam: A Method for Stochastic Optimization", Algorithm 1
and the reordering given just before Section 2.1. TensorFlow implements the
reordered form, with t = 1, 2, ...:

    lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
    m    = beta1 * m + (1 - beta1) * g
    v    = beta2 * v + (1 - beta2) * g^2
    x   -= lr_t * m / (sqrt(v) + eps_hat)

PyTorch's `torch.optim.Adam` implements Algorithm 1:
x -= lr * m_hat / (sqrt(v_hat) + eps), with the bias-corrected
m_hat = m / (1 - beta1^t) and v_hat = v / (1 - beta2^t). The two differ only
in where epsilon goes: TF adds it to the uncorrected sqrt(v), PyTorch to the
corrected sqrt(v_hat). Dividing TF's update through by sqrt(1 - beta2^t)
shows that TF's Adam *is* PyTorch's Adam with a step-dependent epsilon

    eps_torch(t) = eps_hat / sqrt(1 - beta2^t)

(31.6 * eps_hat at t = 1 for beta2 = 0.999, -> eps_hat as t grows). So in
the first steps a parameter whose |g| is small next to
eps_hat / sqrt(1 - beta2^t) (3.2e-4 for eps 1e-5) takes a damped step
~ lr * g / eps instead of PyTorch's near-lr-sized one; where |g| is far above
it, both take ~ lr * sign(g).

The "minimal Adam difference" (Huang, Liu, von Werra 2023, "The N
Implementation Details of RLHF with PPO",
github.com/vwxyzjn/minimal-adam-difference): lm-human-preferences
(`utils/core.py: minimize`) trains with
`tf.train.AdamOptimizer(learning_rate=lr, epsilon=1e-5)`; replaying its first
PPO minibatch of GPT-2 124M with PyTorch's Adam at the same lr and eps makes
the first policy update far more aggressive than TF's. How large the gap is
depends on the per-parameter gradient size against TF's first-step eps:
experiments/adam_difference.py measures it, docs/adam.md has the figures.

Defaults are TF's (lr=1e-3, betas=(0.9, 0.999), eps=1e-8); pass eps=1e-5 to
match lm-human-preferences. Unlike TF1, hyperparameters and beta^t stay
Python floats, not float32 (a ~1e-5 relative difference,
tests/test_adam_tf.py). ppo.py carries a copy (`--optimizer adam_tf`); this
file is the reference, tested against TensorFlow's own numbers.

    python -m pytest -q tests/test_adam_tf.py   # TF's numbers, a loop, FSDP2
    python experiments/adam_difference.py       # torch Adam vs AdamTF
"""

import torch


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
    """`tf.compat.v1.train.AdamOptimizer` as a torch optimizer (no weight decay,
    no amsgrad: TF1's Adam has neither).

    State per parameter: `step` (int), `m`, `v`. They are in the parameter's
    dtype for fp32 and fp64, in fp32 for bf16 and fp16 parameters, whose ~3
    significant digits cannot hold v = 1e-3 g^2 accumulations. Works with
    FSDP2: m and v are created like the (sharded DTensor) parameter, so each
    rank only stores and updates its shard.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        # `not x >= 0` is also true for NaN.
        if not lr >= 0:
            raise ValueError(f"AdamTF: lr must be >= 0, got {lr}; pass e.g. lr=1e-5")
        betas_ok = len(betas) == 2 and all(0 <= beta < 1 for beta in betas)
        if not betas_ok:
            raise ValueError(
                f"AdamTF: betas must be two numbers in [0, 1), got {betas}; "
                "pass e.g. betas=(0.9, 0.999)"
            )
        if not eps >= 0:
            raise ValueError(f"AdamTF: eps must be >= 0, got {eps}; pass e.g. eps=1e-5")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps)
        super().__init__(params, defaults)

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
                    raise ValueError(
                        "AdamTF: sparse gradients are not supported; "
                        "use dense embeddings (sparse=False)"
                    )
                state = self.state[p]
                if not state:
                    # fp32 moments for a bf16 or fp16 parameter
                    low_precision = p.dtype in (torch.bfloat16, torch.float16)
                    state_dtype = torch.float32 if low_precision else p.dtype
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p, dtype=state_dtype)
                    state["v"] = torch.zeros_like(p, dtype=state_dtype)
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
        return loss
