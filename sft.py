"""Supervised fine-tuning (SFT) of GPT-2 on prompt → response pairs: the first stage of RLHF.

Stiennon et al. 2020 ("Learning to summarize from human feedback") and Ouyang et al. 2022 (InstructGPT) start RLHF from
a policy fine-tuned with next-token cross-entropy on demonstrations. The loss is on response tokens only (the prompt is
context), up to and including the stop token so the model learns to stop. Loss and gradients are normalised by the
number of response tokens in the whole global batch, so 1 rank and N ranks (and any micro-batch split) compute the same
update. Eval: teacher-forced loss on held-out pairs and, for tasks with a verifier, accuracy of greedy generations.

    python sft.py                                          # tiny GPT-2 from scratch on the offline arithmetic task
    torchrun --nproc_per_node=2 sft.py                     # the same run, FSDP2 over 2 ranks (gloo on CPU, nccl on GPU)
    python sft.py --model gpt2 --data DIR --lr 1e-5        # pretrained GPT-2 on a dataset written by data.prep
    python sft.py --resume                                 # continue the run in --out_dir from its last checkpoint
"""

import json
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
    model: str = "tiny"
    """`tiny` (random init), a GPT-2 preset (`gpt2`, `gpt2-medium`, ... pretrained weights) or a checkpoint dir"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a dataset directory written by `python -m data.prep`"""
    out_dir: str = "runs/sft"
    """where the model (HF safetensors layout), checkpoints, args.json and metrics.jsonl are written"""
    seed: int = 1
    """seed for init and data order (identical on every rank)"""
    lr: float = 1e-3
    """peak learning rate (1e-3 suits the tiny model from scratch; use ~1e-5 for pretrained GPT-2)"""
    warmup_steps: int = 100
    """linear warmup steps, then cosine decay to lr * min_lr_ratio"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on biases, LayerNorms)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global gradient norm"""
    total_steps: int = 1500
    """optimizer steps"""
    batch_size: int = 64
    """sequences per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """sequences per forward pass on one rank (gradient accumulation makes up the rest)"""
    response_length: int = 16
    """max new tokens when generating for eval accuracy"""
    eval_every: int = 250
    """steps between evals (and checkpoints)"""
    eval_size: int = 500
    """held-out examples for eval loss and accuracy"""
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


def reduce_metrics(metrics: dict, device) -> dict:
    """Average a dict of scalars over ranks (one all-reduce)."""
    t = torch.tensor(list(metrics.values()), dtype=torch.float64, device=device)
    t = all_reduce(t) / (dist.get_world_size() if dist.is_initialized() else 1)
    return dict(zip(metrics, t.tolist()))


# ---------------------------------------------------------------------------------------------------------------------
# SFT


def sft_loss_sums(model, query, response, pad_token_id, ctx):
    """Summed token NLL over response tokens (to and including the stop token), and their count."""
    mask = response_mask(response, pad_token_id)  # (B, Tr)
    query_response = torch.cat([query, response], 1)
    attention_mask = torch.cat([query != pad_token_id, mask], 1)
    with ctx:
        # logits from the last prompt position on: position t predicts token t + 1
        logits = model(query_response, attention_mask=attention_mask, keep_from=query.size(1) - 1)[:, :-1]  # (B,Tr,V)
    nll = F.cross_entropy(logits.float().flatten(0, 1), response.flatten().long(), reduction="none").view_as(mask)
    return (nll * mask).sum(), mask.sum()


@torch.no_grad()
def evaluate(model, args, meta, test, prompts, rank, world_size, device, ctx):
    """Teacher-forced loss on sft_test and, when the task has a verifier, greedy accuracy on prompt_test."""
    model.eval()
    pad = meta["pad_token_id"]
    n = min(args.eval_size, len(test["query"])) // world_size * world_size  # equal shares: FSDP2 needs all ranks
    idx = np.arange(rank, n, world_size)  # each rank a strided shard
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for i in range(0, len(idx), args.micro_batch_size):
        j = idx[i : i + args.micro_batch_size]
        q, r = (torch.from_numpy(test[k][j]).to(device) for k in ("query", "response"))
        loss, count = sft_loss_sums(model, *trim_padding(q, r, pad), pad, ctx)
        sums[0] += loss
        sums[1] += count
    if meta.get("task") in ("arithmetic", "gsm8k"):
        enc = data.get_encoding(meta["tokenizer"])
        n = min(args.eval_size, len(prompts["query"])) // world_size * world_size
        idx = np.arange(rank, n, world_size)
        for i in range(0, len(idx), args.micro_batch_size):
            j = idx[i : i + args.micro_batch_size]
            q = torch.from_numpy(prompts["query"][j]).to(device)
            q = q[:, min(int(first_true_indices((q != pad).any(0, keepdim=True))), q.size(1) - 1) :]
            length = min(args.response_length, model.config.block_size - q.size(1))
            with ctx:
                resp = gpt2.generate(model, q, pad, length, meta["eos_token_id"], temperature=0.0)
            for row, gt in zip(resp.tolist(), prompts["ground_truth"][j]):
                text = enc.decode([t for t in row if t != pad])
                sums[2] += data.verify(meta["task"], text, str(gt))
                sums[3] += 1
    all_reduce(sums)
    model.train()
    out = {"eval/loss": (sums[0] / sums[1]).item()}
    if sums[3] > 0:
        out["eval/accuracy"] = (sums[2] / sums[3]).item()
    return out


def main(args: Args):
    # ---- sizes, distributed setup, seeds, logging
    rank, world_size, device = setup_distributed()
    master = rank == 0
    local_batch_size = exact_div(args.batch_size, world_size, "--batch_size must divide by the number of ranks")
    grad_accum = exact_div(local_batch_size, args.micro_batch_size, "per-rank batch (--batch_size / ranks) must divide by --micro_batch_size")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)
    logger = MetricsLogger(args, master)

    # ---- data
    meta = data.load_meta(args.data)
    train, test = data.load_split(args.data, "sft_train"), data.load_split(args.data, "sft_test")
    prompts = data.load_split(args.data, "prompt_test") if meta.get("task") else None
    pad = meta["pad_token_id"]
    n_train = len(train["query"])
    if n_train < args.batch_size:
        raise ValueError(f"sft_train has {n_train} examples, fewer than --batch_size {args.batch_size}")

    # ---- model, optimizer
    model = gpt2.load_model(args.model, vocab_size=meta["vocab_size"])
    if train["query"].shape[1] + train["response"].shape[1] > model.config.block_size:
        raise ValueError(f"prompt + response ({train['query'].shape[1]} + {train['response'].shape[1]} tokens) exceed "
                         f"the model context {model.config.block_size}: prep with a smaller --max_query_len")  # fmt: skip
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

        sd = gpt2.load_model(ckpt).state_dict()
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

    # ---- training loop
    # the global data order is one permutation per epoch from the seed, identical on every rank; rank r takes its
    # contiguous slice of each global batch, so any number of ranks sees the same global batches
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
        b_query = torch.from_numpy(train["query"][local_idx]).to(device)
        b_response = torch.from_numpy(train["response"][local_idx]).to(device)
        # normalise by the global count of response tokens: the same update on 1 or N ranks, any micro split
        n_tokens = all_reduce(response_mask(b_response, pad).sum().float())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            s = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
            if dist.is_initialized():
                model.set_requires_gradient_sync(micro == grad_accum - 1)  # reduce-scatter once, on the last micro
            mb_query, mb_response = trim_padding(b_query[s], b_response[s], pad)
            nll_sum, count = sft_loss_sums(forward_model, mb_query, mb_response, pad, ctx)
            # FSDP averages gradients over ranks, so scale by world_size to get sum / global token count
            (nll_sum * world_size / n_tokens).backward()
            loss_sum += nll_sum.detach()
            tokens += int(count) + int((mb_query != pad).sum())
        grad_norm = global_grad_norm(model.parameters())
        loss = all_reduce(loss_sum) / n_tokens
        if not torch.isfinite(loss) or not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite loss {loss.item()} or grad norm at step {step + 1}: lower --lr; "
                                     f"the last good checkpoint (if any) is in {args.out_dir}/checkpoints")  # fmt: skip
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        eval_now = (step + 1) % args.eval_every == 0 or step + 1 == args.total_steps
        if (step + 1) % args.log_every == 0 or step == start_step or eval_now:
            dt = time.time() - t0
            metrics = {"train/loss": loss.item(), "train/grad_norm": grad_norm.item(), "train/lr": lr_at(step, args),
                       "perf/tokens_per_sec": all_reduce(torch.tensor(float(tokens), device=device)).item() / dt}  # fmt: skip
            if eval_now:
                metrics |= evaluate(model, args, meta, test, prompts, rank, world_size, device, ctx)
            logger.log(step + 1, metrics)
            t0, tokens = time.time(), 0
        if eval_now or stop["now"]:
            save_checkpoint(args.out_dir, step + 1, model, optimizer, {}, args.keep_checkpoints)
        if stop["now"]:
            if master:
                print(f"SIGTERM: saved a checkpoint at step {step + 1}; continue with --resume", flush=True)
            break

    # ---- save the final model in the HF GPT-2 layout (what reward.py, dpo.py, ppo.py and grpo.py load), teardown
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
