"""Reward modelling: GPT-2 with a scalar head, trained on preference pairs with the Bradley–Terry loss.

Ziegler et al. 2019 (lm-human-preferences), Stiennon et al. 2020, Ouyang et al. 2022: the SFT model with a linear
`score` head (init N(0, 1/sqrt(n_embd + 1)), bias 0), read at the last real token of query + response (the stop token),
trained with -log σ(r_chosen - r_rejected - margin) (a constant `--margin`; Llama 2 uses per-pair ones), optionally
+ `--center_rewards_coef` * (r_chosen + r_rejected)^2 to keep rewards near 0 (TRL's center_rewards_coefficient).

Then, as in lm-human-preferences, the rewards are normalised: responses sampled from the `--model` policy (the SFT model
PPO starts from; a random one for `--model tiny`) to pref_train queries are scored, and gain = 1/std, bias = -mean/std
go into config.json (`reward_gain`, `reward_bias`), so PPO/GRPO start from rewards of mean 0, std 1. The checkpoint is
the HF GPT-2 layout plus `score.weight` (1, n_embd) and `score.bias` (1,); `load_reward_model` reads it.

    python reward.py                                       # from runs/sft (python sft.py) on the offline task
    python reward.py --model /work/ckpt/sft                # from any SFT checkpoint
    torchrun --nproc_per_node=2 reward.py                  # FSDP2 over 2 ranks: the same run
    python reward.py --model runs/sft_hh --data data/hh --lr 5e-6 --batch_size 64 --micro_batch_size 8
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
    """the SFT checkpoint the reward model starts from (`tiny` = random init), and the policy of the normalisation"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a directory with pref_{train,test} from `python -m data.prep`"""
    out_dir: str = "runs/reward"
    """where the reward model (HF layout + score head), checkpoints, args.json and metrics.jsonl are written"""
    seed: int = 1
    """seed for the head init, data order and normalisation samples (identical on every rank)"""
    lr: float = 3e-4
    """peak learning rate (3e-4 suits the tiny model; use ~5e-6 for pretrained GPT-2)"""
    warmup_steps: int = 20
    """linear warmup steps, then cosine decay to lr * min_lr_ratio"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on biases, LayerNorms)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global gradient norm"""
    total_steps: int = 1500
    """optimizer steps (on the offline task 500 steps reach 0.73 pair accuracy but rank the policy's own samples
    barely above chance, AUC 0.59; 1500 steps: 0.91 and AUC 0.79)"""
    batch_size: int = 64
    """preference pairs per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """pairs per forward pass on one rank (2x sequences: chosen and rejected together)"""
    margin: float = 0.0
    """constant margin m in -log σ(r_chosen - r_rejected - m)"""
    center_rewards_coef: float = 0.0
    """coefficient of mean((r_chosen + r_rejected)^2), which keeps rewards centred at 0 (TRL uses 0.01)"""
    norm_samples: int = 512
    """policy samples whose scores set the normalisation gain and bias (0 = no normalisation: gain 1, bias 0)"""
    response_length: int = 16
    """max new tokens of the normalisation samples (use PPO's)"""
    temperature: float = 1.0
    """sampling temperature of the normalisation samples (use PPO's)"""
    eval_every: int = 250
    """steps between evals (and checkpoints)"""
    eval_size: int = 500
    """held-out pref_test pairs for eval loss and accuracy"""
    log_every: int = 10
    """steps between status lines / metrics rows"""
    keep_checkpoints: int = 2
    """number of resumable checkpoints kept in out_dir/checkpoints"""
    resume: bool = False
    """continue from the last checkpoint in out_dir"""
    dtype: str = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `float32` or `bfloat16` (autocast; FSDP2 bf16 params + fp32 reduce)"""
    compile: bool = False
    """torch.compile the model"""
    activation_checkpointing: bool = False
    """recompute block activations in backward to save memory"""
    wandb: bool = False
    """also log to Weights & Biases (imported only when set)"""

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


def lr_at(step: int, args: Args) -> float:
    """Linear warmup, then cosine to lr * min_lr_ratio."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + np.cos(np.pi * min(1.0, progress))))


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
# Reward model (ScalarModel, load_reward_model and get_reward are copied verbatim into ppo.py and grpo.py)


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


def pair_tensors(split: dict, idx, device) -> list:
    """Rows idx of a preference split as [query, chosen, rejected] tensors on device."""
    return [torch.from_numpy(split[k][idx]).to(device) for k in ("query", "chosen", "rejected")]


def stack_pairs(query, chosen, rejected, pad_token_id):
    """Queries (2B, Tq) and responses (2B, Tr): chosen rows, then rejected rows, right-padded to one width, trimmed."""
    width = max(chosen.size(1), rejected.size(1))
    response = torch.cat([F.pad(r, (0, width - r.size(1)), value=pad_token_id) for r in (chosen, rejected)])
    return trim_padding(query.repeat(2, 1), response, pad_token_id)


def pair_rewards(model, query, chosen, rejected, pad_token_id, ctx):
    """Rewards (B,), (B,) of the chosen and rejected responses to the same queries, in one forward pass of 2B rows."""
    query, response = stack_pairs(query, chosen, rejected, pad_token_id)
    attention_mask = torch.cat([query != pad_token_id, response_mask(response, pad_token_id)], 1).long()
    with ctx:
        return get_reward(model, torch.cat([query, response], 1), attention_mask).float().chunk(2)


def preference_loss(r_chosen, r_rejected, margin: float = 0.0, center_coef: float = 0.0):
    """Per-pair Bradley–Terry loss (B,): -log σ(r_chosen - r_rejected - margin) + center_coef (r_chosen + r_rejected)^2
    (its batch mean is TRL's loss with a constant margin and center_rewards_coefficient)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin) + center_coef * (r_chosen + r_rejected) ** 2


def normalization(scores: torch.Tensor) -> tuple[float, float]:
    """(gain, bias) such that gain * scores + bias has mean 0 and std 1 over scores (N,) (population std)."""
    mean, std = scores.double().mean(), scores.double().std(correction=0)
    if not std > 1e-8:
        raise FloatingPointError(f"the normalisation samples all score {mean.item():.4g}: the reward model is "
                                 "constant; train longer or with another --lr, or pass --norm_samples 0")  # fmt: skip
    return 1.0 / std.item(), -(mean / std).item()


@torch.no_grad()
def reward_eval(model, args, test, pad, rank, world_size, device, ctx) -> dict:
    """Pairwise loss and accuracy (fraction of pref_test pairs with r_chosen > r_rejected)."""
    model.eval()
    n = min(args.eval_size, len(test["query"])) // world_size * world_size  # equal shares: FSDP2 needs all ranks
    idx = np.arange(rank, n, world_size)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for i in range(0, len(idx), args.micro_batch_size):
        j = idx[i : i + args.micro_batch_size]
        r_c, r_r = pair_rewards(model, *pair_tensors(test, j, device), pad, ctx)
        loss = preference_loss(r_c, r_r, args.margin, args.center_rewards_coef)
        sums += torch.stack([loss.sum(), (r_c > r_r).sum(), torch.tensor(len(j), device=device)]).double()
    all_reduce(sums)
    model.train()
    return {"eval/loss": (sums[0] / sums[2]).item(), "eval/accuracy": (sums[1] / sums[2]).item()}


@torch.no_grad()
def normalize(model, policy, queries, args, meta, rank, world_size, device, ctx) -> dict:
    """lm-human-preferences' normalisation: sample responses to queries (N, Tq) from `policy`, set the model's gain and
    bias so that their rewards have mean 0 and std 1, score them again through the model to check. Rank r samples and
    scores its contiguous share with uniforms sliced from one tensor seeded by --seed: any number of ranks agrees."""
    model.eval()
    n, pad, local = len(queries), meta["pad_token_id"], len(queries) // world_size
    noise = torch.rand(n, args.response_length, generator=torch.Generator().manual_seed(args.seed)).to(device)
    samples = []
    for i in range(rank * local, (rank + 1) * local, args.micro_batch_size):
        j = slice(i, min(i + args.micro_batch_size, (rank + 1) * local))
        q = torch.from_numpy(queries[j]).to(device)
        q = q[:, min(int(first_true_indices((q != pad).any(0, keepdim=True))), q.size(1) - 1) :]
        with ctx:
            response = gpt2.generate(policy, q, pad, args.response_length, meta["eos_token_id"], args.temperature,
                                     noise=noise[j])
        samples.append((j, torch.cat([q, response], 1), torch.cat([q != pad, response_mask(response, pad)], 1).long()))

    def scores():  # (N,) rewards of every rank's samples: each rank fills its slice, the all-reduce the rest
        out = torch.zeros(n, dtype=torch.float64, device=device)
        for j, query_response, attention_mask in samples:
            with ctx:
                out[j] = get_reward(model, query_response, attention_mask).double()
        return all_reduce(out)

    raw = scores()
    model.reward_gain, model.reward_bias = normalization(raw)
    normed = scores()
    model.train()
    (raw_mean, raw_std), (mean, std) = ((x.mean().item(), x.std(correction=0).item()) for x in (raw, normed))
    return {"norm/raw_mean": raw_mean, "norm/raw_std": raw_std, "norm/gain": model.reward_gain,
            "norm/bias": model.reward_bias, "norm/mean": mean, "norm/std": std}


def main(args: Args):
    # ---- sizes, distributed setup, seeds, logging
    rank, world_size, device = setup_distributed()
    master = rank == 0
    local_batch_size = exact_div(args.batch_size, world_size, "--batch_size must divide by the number of ranks")
    grad_accum = exact_div(local_batch_size, args.micro_batch_size, "per-rank batch (--batch_size / ranks) must divide by --micro_batch_size")
    exact_div(args.norm_samples or world_size, world_size, "--norm_samples must divide by the number of ranks")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)
    logger = MetricsLogger(args, master)

    # ---- data
    meta = data.load_meta(args.data)
    train, test = data.load_split(args.data, "pref_train"), data.load_split(args.data, "pref_test")
    pad = meta["pad_token_id"]
    n_train = len(train["query"])
    if n_train < args.batch_size:
        raise ValueError(f"pref_train has {n_train} pairs, fewer than --batch_size {args.batch_size}")

    # ---- model (the SFT backbone + a fresh scalar head), optimizer
    model = ScalarModel(gpt2.load_model(args.model, vocab_size=meta["vocab_size"]))
    longest = train["query"].shape[1] + max(train["chosen"].shape[1], train["rejected"].shape[1])
    if longest > model.config.block_size:
        raise ValueError(f"prompt + response ({longest} tokens) exceed the model context {model.config.block_size}: "
                         "prep with a smaller --max_query_len / --max_response_len")  # fmt: skip
    if args.norm_samples and train["query"].shape[1] + args.response_length > model.config.block_size:
        raise ValueError(f"prompt ({train['query'].shape[1]}) + --response_length ({args.response_length}) tokens "
                         f"exceed the model context {model.config.block_size}: lower --response_length")  # fmt: skip
    model.activation_checkpointing = args.activation_checkpointing
    model.to(device)
    if world_size > 1 or dist.is_initialized():
        shard_model(model, device, bf16)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    # fused: one kernel for all parameters, on CPU as on CUDA (6x the default foreach step, GPT-2 124M on CPU: bench.py)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip
    forward_model = torch.compile(model) if args.compile else model

    # ---- resume: the model, optimizer, RNG and data order continue exactly where the checkpoint left them
    start_step = 0
    ckpt = latest_checkpoint(args.out_dir) if args.resume else None
    if args.resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {args.out_dir}/checkpoints; drop --resume to start fresh")
    if ckpt:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        sd = load_reward_model(ckpt).state_dict()
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True)) if dist.is_initialized() else model.load_state_dict(sd)
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        load_optimizer_state(model, optimizer, state["optimizer"])
        start_step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        if master:
            print(f"resumed from {ckpt} at step {start_step}")

    # SIGTERM (a cluster's preemption): finish the current step, save a checkpoint, exit
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    # ---- training loop: one global batch of pairs per step from a per-epoch permutation shared by all ranks; rank r
    # takes its contiguous slice, so any number of ranks sees the same global batches
    steps_per_epoch = n_train // args.batch_size
    perm_cache = {}
    t0, tokens = time.time(), 0
    model.train()
    for step in range(start_step, args.total_steps):
        epoch, k = divmod(step, steps_per_epoch)
        if epoch not in perm_cache:
            perm_cache = {epoch: np.random.default_rng(args.seed + epoch).permutation(n_train)}
        batch_idx = perm_cache[epoch][k * args.batch_size : (k + 1) * args.batch_size]
        local_idx = batch_idx[rank * local_batch_size : (rank + 1) * local_batch_size]
        b_query, b_chosen, b_rejected = pair_tensors(train, local_idx, device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        sums = torch.zeros(4, device=device)  # loss, correct pairs, r_chosen, r_rejected, summed over pairs
        for micro in range(grad_accum):
            s = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
            if dist.is_initialized():
                model.set_requires_gradient_sync(micro == grad_accum - 1)  # reduce-scatter once, on the last micro
            r_chosen, r_rejected = pair_rewards(forward_model, b_query[s], b_chosen[s], b_rejected[s], pad, ctx)
            loss = preference_loss(r_chosen, r_rejected, args.margin, args.center_rewards_coef).sum()
            # mean over the global batch; FSDP averages gradients over ranks, so scale by world_size
            (loss * world_size / args.batch_size).backward()
            sums += torch.stack([loss, (r_chosen > r_rejected).sum(), r_chosen.sum(), r_rejected.sum()]).detach()
            n_response = response_mask(b_chosen[s], pad).sum() + response_mask(b_rejected[s], pad).sum()
            tokens += 2 * int((b_query[s] != pad).sum()) + int(n_response)
        grad_norm = global_grad_norm(model.parameters())
        loss, accuracy, r_chosen, r_rejected = (all_reduce(sums) / args.batch_size).tolist()
        if not math.isfinite(loss) or not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite loss {loss} or grad norm at step {step}: lower --lr; "
                                     f"the last good checkpoint is in {args.out_dir}/checkpoints")  # fmt: skip
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        eval_now = (step + 1) % args.eval_every == 0 or step + 1 == args.total_steps
        if (step + 1) % args.log_every == 0 or step == start_step or eval_now:
            dt = time.time() - t0
            metrics = {"train/loss": loss, "train/accuracy": accuracy, "rewards/chosen": r_chosen,
                       "rewards/rejected": r_rejected, "rewards/margins": r_chosen - r_rejected,
                       "train/grad_norm": grad_norm.item(), "train/lr": lr_at(step, args),
                       "perf/tokens_per_sec": all_reduce(torch.tensor(float(tokens), device=device)).item() / dt}  # fmt: skip
            if eval_now:
                metrics |= reward_eval(model, args, test, pad, rank, world_size, device, ctx)
            logger.log(step + 1, metrics)
            t0, tokens = time.time(), 0
        if eval_now or stop["now"]:
            save_checkpoint(args.out_dir, step + 1, model, optimizer, {}, args.keep_checkpoints)
        if stop["now"]:
            if master:
                print(f"SIGTERM: saved a checkpoint at step {step + 1}; continue with --resume", flush=True)
            break

    # ---- normalise: rewards of mean 0 and std 1 on responses of the --model policy to pref_train queries
    if args.norm_samples and not stop["now"]:
        policy = gpt2.load_model(args.model, vocab_size=meta["vocab_size"]).to(device).eval()  # plain, on every rank
        pick = np.random.default_rng(args.seed).choice(n_train, args.norm_samples, replace=args.norm_samples > n_train)
        norm = normalize(model, policy, train["query"][pick], args, meta, rank, world_size, device, ctx)
        logger.log(args.total_steps, norm)
        del policy

    # ---- save the reward model (HF GPT-2 layout + score.* + reward_gain/bias in config.json), teardown
    sd = full_state_dict(model)
    if master and not stop["now"]:
        gain_bias = dict(reward_gain=model.reward_gain, reward_bias=model.reward_bias)
        gpt2.save_model(sd, model.config, args.out_dir, extra_config=gain_bias)
        print(f"saved {args.out_dir}/model.safetensors (score head, {gain_bias})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:
        main(args)
    except (ValueError, FileNotFoundError, KeyError, FloatingPointError, PermissionError) as e:
        sys.exit(f"error: {e}")
