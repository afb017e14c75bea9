"""Direct Preference Optimization (DPO): fit the policy to preference pairs directly, without a reward model or RL.

Rafailov et al. 2023. With h = [log π(y_w|x) - log π_ref(y_w|x)] - [log π(y_l|x) - log π_ref(y_l|x)] (log-probs summed
over response tokens up to and including the stop token), the per-pair losses are
- sigmoid (DPO eq. 7): -log σ(β h); with --label_smoothing ε the conservative DPO (cDPO, Mitchell 2023), which assumes
  a fraction ε of flipped labels: -(1 - ε) log σ(β h) - ε log σ(-β h)
- ipo (Azar et al. 2023): (h - 1/(2β))^2, on summed log-probs as in the paper (TRL averages them per token)
- hinge (SLiC-HF, Zhao et al. 2023): max(0, 1 - β h)
plus, with --rpo_alpha, α times the chosen response's per-token NLL (RPO, Pang et al. 2024). The implicit reward is
r = β log π/π_ref. The reference log-probs of all pref_train / pref_test pairs are computed once before training (by the
starting policy itself unless --ref_model is given), so no reference model is in memory while training. Eval, also at
step 0 (the starting policy): loss and preference accuracy (r_chosen > r_rejected) on pref_test and, for tasks with a
verifier, accuracy of greedy generations on prompt_test.

    python dpo.py                                          # from runs/sft (python sft.py) on the offline task
    python dpo.py --model /work/ckpt/sft --beta 1.0        # the tiny offline task prefers a large β
    torchrun --nproc_per_node=2 dpo.py --loss_type ipo     # FSDP2 over 2 ranks: the same run as on 1
    python dpo.py --model runs/sft_hh --data data/hh --lr 1e-6 --batch_size 64 --micro_batch_size 8
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
import torch.nn.functional as F
import tyro

import data
import gpt2


@dataclass
class Args:
    model: str = "runs/sft"
    """the policy to start from: an SFT checkpoint (`tiny` = random init, for tests)"""
    ref_model: str = ""
    """the reference policy π_ref (empty = --model, scored before training starts)"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a directory with pref_{train,test} from `python -m data.prep`"""
    out_dir: str = "runs/dpo"
    """where the model (HF safetensors layout), checkpoints, args.json and metrics.jsonl are written"""
    seed: int = 1
    """seed for data order (identical on every rank)"""
    lr: float = 5e-5
    """peak learning rate (5e-5 suits the tiny model; use ~1e-6 for pretrained GPT-2)"""
    warmup_steps: int = 20
    """linear warmup steps, then cosine decay to lr * min_lr_ratio"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on biases, LayerNorms)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global gradient norm"""
    total_steps: int = 300
    """optimizer steps"""
    batch_size: int = 64
    """preference pairs per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """pairs per forward pass on one rank (2x sequences: chosen and rejected together)"""
    beta: float = 0.1
    """β: strength of the implicit KL penalty towards the reference (larger = stay closer)"""
    loss_type: str = "sigmoid"
    """`sigmoid` (DPO), `ipo` or `hinge`"""
    label_smoothing: float = 0.0
    """ε of conservative DPO (sigmoid loss only): the assumed fraction of flipped preference labels, in [0, 0.5)"""
    reference_free: bool = False
    """use log π_ref = 0 (no reference: the loss compares the policy's own log-probs)"""
    rpo_alpha: float = 0.0
    """weight of the chosen response's per-token NLL added to the loss (RPO, Pang et al. 2024; TRL's rpo_alpha)"""
    response_length: int = 16
    """max new tokens when generating for eval accuracy"""
    eval_every: int = 100
    """steps between evals (and checkpoints)"""
    eval_size: int = 500
    """held-out pairs (pref_test) and prompts (prompt_test) for eval"""
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
# DPO


def pair_tensors(split: dict, idx, device) -> list:
    """Rows idx of a preference split as [query, chosen, rejected] tensors on device."""
    return [torch.from_numpy(split[k][idx]).to(device) for k in ("query", "chosen", "rejected")]


def stack_pairs(query, chosen, rejected, pad_token_id):
    """Queries (2B, Tq) and responses (2B, Tr): chosen rows, then rejected rows, right-padded to one width, trimmed."""
    width = max(chosen.size(1), rejected.size(1))
    response = torch.cat([F.pad(r, (0, width - r.size(1)), value=pad_token_id) for r in (chosen, rejected)])
    return trim_padding(query.repeat(2, 1), response, pad_token_id)


def sequence_logprobs(model, query, response, pad_token_id, ctx):
    """Sum of log π(token | context) over response tokens up to and including the stop token (B,)."""
    mask = response_mask(response, pad_token_id)  # (B, Tr)
    query_response = torch.cat([query, response], 1)
    attention_mask = torch.cat([query != pad_token_id, mask], 1)
    with ctx:  # logits from the last prompt position on: position t predicts token t + 1
        logits = model(query_response, attention_mask=attention_mask, keep_from=query.size(1) - 1)[:, :-1]  # (B,Tr,V)
    logprobs = -F.cross_entropy(logits.float().flatten(0, 1), response.flatten().long(), reduction="none")
    return (logprobs.view_as(mask) * mask).sum(1)


def pair_logprobs(model, query, chosen, rejected, pad_token_id, ctx):
    """log π of the chosen and of the rejected responses (B,), (B,), in one forward pass of 2B rows."""
    return sequence_logprobs(model, *stack_pairs(query, chosen, rejected, pad_token_id), pad_token_id, ctx).chunk(2)


def dpo_loss(logps_chosen, logps_rejected, ref_chosen, ref_rejected, beta, loss_type="sigmoid", label_smoothing=0.0):
    """Per-pair loss (B,) of the log-ratio difference h = log π/π_ref (chosen) - log π/π_ref (rejected)."""
    h = (logps_chosen - ref_chosen) - (logps_rejected - ref_rejected)
    if loss_type == "sigmoid":  # DPO eq. 7; cDPO when label_smoothing > 0
        return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    if loss_type == "ipo":  # IPO: regress h onto 1/(2β) instead of pushing it to infinity
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * h)
    raise ValueError(f"unknown --loss_type '{loss_type}': use sigmoid, ipo or hinge")


@torch.no_grad()
def reference_logprobs(model, split, n, args, pad, rank, world_size, device, ctx):
    """log π_ref of the chosen and rejected responses of the first n pairs of a split, (n, 2) on every rank. `model`
    is a plain (unsharded) model on every rank: each rank scores a contiguous share, an all-reduce gathers them."""
    model.eval()
    out, share = torch.zeros(n, 2, dtype=torch.float64, device=device), -(-n // world_size)
    for i in range(rank * share, min(n, (rank + 1) * share), args.micro_batch_size):
        j = slice(i, min(i + args.micro_batch_size, n, (rank + 1) * share))
        logps = pair_logprobs(model, *pair_tensors(split, j, device), pad, ctx)
        out[j] = torch.stack(logps, 1).double()
    model.train()
    return all_reduce(out)


@torch.no_grad()
def dpo_eval(model, args, meta, test, ref_test, prompts, rank, world_size, device, ctx) -> dict:
    """On pref_test: DPO loss, preference accuracy (implicit reward r_chosen > r_rejected), likelihood accuracy
    (log π(chosen) > log π(rejected)); with a verifier: accuracy of greedy generations on prompt_test."""
    model.eval()
    pad = meta["pad_token_id"]
    n = len(ref_test) // world_size * world_size  # equal shares: FSDP2 needs every rank in every forward
    idx = np.arange(rank, n, world_size)
    sums = torch.zeros(7, dtype=torch.float64, device=device)
    for i in range(0, len(idx), args.micro_batch_size):
        j = idx[i : i + args.micro_batch_size]
        logp_c, logp_r = pair_logprobs(model, *pair_tensors(test, j, device), pad, ctx)
        ref = ref_test[torch.from_numpy(j).to(device)].float()  # (b, 2)
        loss = dpo_loss(logp_c, logp_r, ref[:, 0], ref[:, 1], args.beta, args.loss_type, args.label_smoothing)
        margin = args.beta * ((logp_c - ref[:, 0]) - (logp_r - ref[:, 1]))
        sums[:4] += torch.stack([loss.sum(), (margin > 0).sum(), margin.sum(), (logp_c > logp_r).sum()]).double()
        sums[4] += len(j)
    if meta.get("task") in ("arithmetic", "gsm8k"):
        enc = data.get_encoding(meta["tokenizer"])
        idx = np.arange(rank, min(args.eval_size, len(prompts["query"])) // world_size * world_size, world_size)
        for i in range(0, len(idx), args.micro_batch_size):
            j = idx[i : i + args.micro_batch_size]
            q = torch.from_numpy(prompts["query"][j]).to(device)
            q = q[:, min(int(first_true_indices((q != pad).any(0, keepdim=True))), q.size(1) - 1) :]
            length = min(args.response_length, model.config.block_size - q.size(1))
            with ctx:
                resp = gpt2.generate(model, q, pad, length, meta["eos_token_id"], temperature=0.0)
            for row, gt in zip(resp.tolist(), prompts["ground_truth"][j]):
                sums[5] += data.verify(meta["task"], enc.decode([t for t in row if t != pad]), str(gt))
                sums[6] += 1
    all_reduce(sums)
    model.train()
    out = {"eval/loss": sums[0] / sums[4], "eval/preference_accuracy": sums[1] / sums[4],
           "eval/rewards_margins": sums[2] / sums[4], "eval/logps_accuracy": sums[3] / sums[4]}  # fmt: skip
    if sums[6] > 0:
        out["eval/accuracy"] = sums[5] / sums[6]
    return {k: v.item() for k, v in out.items()}


def main(args: Args):
    # ---- sizes, distributed setup, seeds, logging
    rank, world_size, device = setup_distributed()
    master = rank == 0
    local_batch_size = exact_div(args.batch_size, world_size, "--batch_size must divide by the number of ranks")
    grad_accum = exact_div(local_batch_size, args.micro_batch_size, "per-rank batch (--batch_size / ranks) must divide by --micro_batch_size")
    if args.loss_type not in ("sigmoid", "ipo", "hinge"):
        raise ValueError(f"unknown --loss_type '{args.loss_type}': use sigmoid, ipo or hinge")
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5 or (args.label_smoothing and args.loss_type != "sigmoid"):
        raise ValueError(f"--beta {args.beta} must be > 0 and --label_smoothing {args.label_smoothing} in [0, 0.5), "
                         "the latter with --loss_type sigmoid only")  # fmt: skip
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)
    logger = MetricsLogger(args, master)

    # ---- data
    meta = data.load_meta(args.data)
    train, test = data.load_split(args.data, "pref_train"), data.load_split(args.data, "pref_test")
    prompts = data.load_split(args.data, "prompt_test") if meta.get("task") else None
    pad = meta["pad_token_id"]
    n_train, n_test = len(train["query"]), min(args.eval_size, len(test["query"]))
    if n_train < args.batch_size:
        raise ValueError(f"pref_train has {n_train} pairs, fewer than --batch_size {args.batch_size}")

    # ---- policy, and the reference log-probs of every pair, computed once (no reference model while training)
    model = gpt2.load_model(args.model, vocab_size=meta["vocab_size"])
    longest = train["query"].shape[1] + max(train["chosen"].shape[1], train["rejected"].shape[1])
    if longest > model.config.block_size:
        raise ValueError(f"prompt + response ({longest} tokens) exceed the model context {model.config.block_size}: "
                         "prep with a smaller --max_query_len / --max_response_len")  # fmt: skip
    model.to(device)
    ref_train = torch.zeros(n_train, 2, dtype=torch.float64, device=device)
    ref_test = torch.zeros(n_test, 2, dtype=torch.float64, device=device)
    if not args.reference_free:
        ref = gpt2.load_model(args.ref_model, vocab_size=meta["vocab_size"]).to(device) if args.ref_model else model
        ref_train = reference_logprobs(ref, train, n_train, args, pad, rank, world_size, device, ctx)
        ref_test = reference_logprobs(ref, test, n_test, args, pad, rank, world_size, device, ctx)
        del ref
    model.activation_checkpointing = args.activation_checkpointing
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

        sd = gpt2.load_model(ckpt).state_dict()
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True)) if dist.is_initialized() else model.load_state_dict(sd)
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        load_optimizer_state(model, optimizer, state["optimizer"])
        start_step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        if master:
            print(f"resumed from {ckpt} at step {start_step}")
    else:  # the starting policy's numbers: DPO's baseline
        logger.log(0, dpo_eval(model, args, meta, test, ref_test, prompts, rank, world_size, device, ctx))

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
        b_ref = ref_train[torch.from_numpy(local_idx).to(device)].float()  # (local_batch_size, 2)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        sums = torch.zeros(6, device=device)  # loss, r_chosen, r_rejected, correct, logp_chosen, logp_rejected
        for micro in range(grad_accum):
            s = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
            if dist.is_initialized():
                model.set_requires_gradient_sync(micro == grad_accum - 1)  # reduce-scatter once, on the last micro
            logp_c, logp_r = pair_logprobs(forward_model, b_query[s], b_chosen[s], b_rejected[s], pad, ctx)
            loss = dpo_loss(logp_c, logp_r, b_ref[s, 0], b_ref[s, 1], args.beta, args.loss_type, args.label_smoothing)
            if args.rpo_alpha:  # RPO: keep the chosen likelihood up (DPO alone may lower both chosen and rejected)
                loss = loss - args.rpo_alpha * logp_c / response_mask(b_chosen[s], pad).sum(1)
            loss = loss.sum()
            # mean over the global batch; FSDP averages gradients over ranks, so scale by world_size
            (loss * world_size / args.batch_size).backward()
            r_c, r_r = args.beta * (logp_c - b_ref[s, 0]), args.beta * (logp_r - b_ref[s, 1])  # implicit rewards
            sums += torch.stack([loss, r_c.sum(), r_r.sum(), (r_c > r_r).sum(), logp_c.sum(), logp_r.sum()]).detach()
            n_response = response_mask(b_chosen[s], pad).sum() + response_mask(b_rejected[s], pad).sum()
            tokens += 2 * int((b_query[s] != pad).sum()) + int(n_response)
        grad_norm = global_grad_norm(model.parameters())
        loss, r_c, r_r, accuracy, logp_c, logp_r = (all_reduce(sums) / args.batch_size).tolist()
        if not math.isfinite(loss) or not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite loss {loss} or grad norm at step {step}: lower --lr; "
                                     f"the last good checkpoint is in {args.out_dir}/checkpoints")  # fmt: skip
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        eval_now = (step + 1) % args.eval_every == 0 or step + 1 == args.total_steps
        if (step + 1) % args.log_every == 0 or step == start_step or eval_now:
            dt = time.time() - t0
            metrics = {"train/loss": loss, "rewards/chosen": r_c, "rewards/rejected": r_r, "rewards/margins": r_c - r_r,
                       "rewards/accuracies": accuracy, "logps/chosen": logp_c, "logps/rejected": logp_r,
                       "train/grad_norm": grad_norm.item(), "train/lr": lr_at(step, args),
                       "perf/tokens_per_sec": all_reduce(torch.tensor(float(tokens), device=device)).item() / dt}  # fmt: skip
            if eval_now:
                metrics |= dpo_eval(model, args, meta, test, ref_test, prompts, rank, world_size, device, ctx)
            logger.log(step + 1, metrics)
            t0, tokens = time.time(), 0
        if eval_now or stop["now"]:
            save_checkpoint(args.out_dir, step + 1, model, optimizer, {}, args.keep_checkpoints)
        if stop["now"]:
            if master:
                print(f"SIGTERM: saved a checkpoint at step {step + 1}; continue with --resume", flush=True)
            break

    # ---- save the final policy in the HF GPT-2 layout, teardown
    sd = full_state_dict(model)
    if master:
        gpt2.save_model(sd, model.config, args.out_dir)
        print(f"saved {args.out_dir}/model.safetensors")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:
        main(args)
    except (ValueError, FileNotFoundError, KeyError, FloatingPointError, PermissionError) as e:
        sys.exit(f"error: {e}")
