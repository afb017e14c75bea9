"""Supervised fine-tuning (SFT) of GPT-2 on prompt → response pairs: the first stage of RLHF.

Stiennon et al. 2020 ("Learning to summarize from human feedback") and Ouyang et al. 2022
(InstructGPT) start RLHF from a policy fine-tuned with next-token cross-entropy on
demonstrations. The loss is on the response tokens only, up to and including the stop
token, so that the model learns to stop. It is normalised by the response tokens of the
whole global batch, so that 1 rank and N ranks, and any micro-batch split, make the same
update. Eval from step 0 (docs/metrics.md): the loss, greedy accuracy and the implicit
reward's preference accuracy, where the data has them.

    python sft.py                            # tiny GPT-2 from scratch, offline arithmetic
    torchrun --nproc_per_node=2 sft.py       # the same run, FSDP2 over 2 ranks
    python sft.py --model gpt2 --data runs/data/gsm8k --lr 1e-5   # pretrained GPT-2
    python sft.py --resume --out_dir runs/sft/<run>   # continue from its last checkpoint

A run writes runs/sft/<time>-s<seed>/; runs/sft/latest, the next stages' input, links the
last one.
"""

import atexit
import datetime
import fcntl
import glob
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
import tyro
from safetensors import safe_open
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import data
import gpt2


@dataclass
class Args:
    model: str = "tiny"
    """`tiny` (random init), a GPT-2 preset (pretrained) or a checkpoint dir"""
    data: str = "arithmetic"
    """`arithmetic` (built-in, offline) or a dir from `python -m data.prep`"""
    out_dir: str = ""
    """run directory; default a fresh runs/sft/<time>-s<seed>"""
    overwrite: bool = False
    """delete the run already in --out_dir and start afresh"""
    resume: bool = False
    """continue the run in --out_dir from its last complete checkpoint"""
    seed: int = 1
    """seed of the init and the data order (the same on every rank)"""
    lr: float = 3e-3
    """peak learning rate (tiny from scratch: 3e-3; pretrained GPT-2: ~1e-5)"""
    warmup_steps: int = 100
    """linear warmup steps, then cosine decay to lr * min_lr_ratio"""
    min_lr_ratio: float = 0.1
    """the final learning rate as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on biases and LayerNorms)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global gradient norm"""
    total_steps: int = 1000
    """optimizer steps"""
    batch_size: int = 128
    """sequences per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """sequences per forward pass on one rank"""
    response_length: int = 16
    """max new tokens when generating for eval accuracy"""
    eval_every: int = 100
    """steps between evals and checkpoints"""
    eval_size: int = 500
    """held-out examples for the eval loss and accuracy (0: no eval)"""
    log_every: int = 10
    """steps between status lines and metrics rows"""
    keep_checkpoints: int = 2
    """resumable checkpoints kept in out_dir/checkpoints (at least 1)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bf16 on CUDA, fp32 on CPU"""
    compile: bool = False
    """torch.compile the model"""
    activation_checkpointing: bool = False
    """recompute block activations in backward to save memory"""
    packing: bool = True
    """train on the real tokens only, packed into one row: no compute on padding"""
    wandb: bool = False
    """also log to Weights & Biases (imported only when set)"""


# Flags that live in a sibling script (parse_args): none.
MOVED = {}

# ----------------------------------------------------------------------------------------------
# SFT: the loss on response tokens


def sft_loss_sums(model, query, response, ctx):
    """Summed NLL of the response tokens, and their count: the tokens up to and including
    the stop token, so that the model learns to stop."""
    with ctx:
        # Each token's log-probability; 0 past the stop token.
        logprobs = gpt2.logprobs(model, query, response)[0]  # (B, Tr)
    nll_sum = -logprobs.sum()
    count = gpt2.response_mask(response, model.config.eos_token_id).sum()
    return nll_sum, count


def lr_at(step, args):
    """Linear warmup, then cosine to lr * min_lr_ratio."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    decay_steps = max(1, args.total_steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / decay_steps)
    # From 1 down to 0.
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


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


def check_args(args):
    """Every numeric flag's range, before any heavy work: a bad one stops the run with one
    line that names the flag and the fix, not a traceback (or a non-finite loss) later."""
    sizes = [
        "total_steps",
        "batch_size",
        "micro_batch_size",
        "response_length",
        "eval_every",
        "log_every",
    ]
    for name in sizes:
        value = getattr(args, name)
        fix = f"pass e.g. --{name} {getattr(Args, name)}"
        if value < 1:
            raise RunError(f"--{name} {value}: must be 1 or more; {fix}")
    # 0 means something for these: no warmup, no eval, the newest checkpoint only.
    counts = ["seed", "warmup_steps", "eval_size", "keep_checkpoints"]
    for name in counts:
        value = getattr(args, name)
        fix = f"pass e.g. --{name} {getattr(Args, name)}"
        if value < 0:
            raise RunError(f"--{name} {value}: must be 0 or more; {fix}")
    # nan compares false with everything, so it would pass the range checks below.
    floats = ["lr", "min_lr_ratio", "weight_decay", "max_grad_norm"]
    for name in floats:
        value = getattr(args, name)
        fix = f"pass e.g. --{name} {getattr(Args, name)}"
        if not math.isfinite(value):
            raise RunError(f"--{name} {value}: not a finite number; {fix}")
    if args.lr < 0:
        raise RunError(f"--lr {args.lr}: must be 0 or more; pass e.g. --lr {Args.lr}")
    if not 0 <= args.min_lr_ratio <= 1:
        ratio = args.min_lr_ratio
        raise RunError(f"--min_lr_ratio {ratio}: a fraction of --lr; pass 0 to 1, e.g. 0.1")
    if args.weight_decay < 0:
        decay = args.weight_decay
        raise RunError(f"--weight_decay {decay}: must be 0 or more; pass e.g. 0")
    if args.max_grad_norm <= 0:
        norm = args.max_grad_norm
        raise RunError(f"--max_grad_norm {norm}: clips every update to 0; pass e.g. 1")


def main(args: Args):
    # 1. flags, sizes, distributed setup, seeds
    check_args(args)
    rank, world_size, device = setup_distributed()
    local_batch_size = data.exact_div(args.batch_size, world_size, "--batch_size or the ranks")
    micro_batch_size = min(args.micro_batch_size, local_batch_size)
    grad_accum = data.exact_div(local_batch_size, micro_batch_size, "--micro_batch_size")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    # With bf16 off, autocast is a no-op.
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    torch.manual_seed(args.seed)

    # 2. data, and the held-out preference pairs where the dataset has them
    meta = data.load_meta(args.data)
    train = data.load_split(args.data, "sft_train")
    test = data.load_split(args.data, "sft_test")
    # Greedy accuracy needs a task that checks the answers.
    prompts = None
    if meta.get("task"):
        prompts = data.load_split(args.data, "prompt_test")
    # None where the dataset has no preference pairs.
    pairs = data.eval_split(args.data, "pref_test", args.eval_size)
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    n_train = len(train["query"])
    n_test = min(args.eval_size, len(test["query"]))
    test_tokens = data.response_lengths(test, n_test, eos, data.RESPONSE).sum().item()
    n_pairs = len(pairs["query"]) if pairs else 0
    if n_train < args.batch_size:
        raise RunError(f"sft_train has {n_train} examples: lower --batch_size {args.batch_size}")

    # 3. model, then the run directory (a bad --model leaves none), optimizer
    model_shard = partial(shard, device=device, bf16=bf16)
    model = gpt2.load(args.model, meta, shard=model_shard)
    data.check_context(train, model.config.block_size)
    args.out_dir = start_run(args, "sft")
    model.activation_checkpointing = args.activation_checkpointing
    model.packing = args.packing
    # Weight decay on matrices only, not on biases and LayerNorms.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay},
    ]
    optimizer = torch.optim.AdamW(
        groups,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0,
        fused=True,
    )
    forward_model = torch.compile(model) if args.compile else model
    models = {"model": (model, optimizer)}
    # The implicit reward's reference: the starting model, scored before a resume loads
    # its weights.
    ref_logps = data.split_logprobs(model, pairs, n_pairs, micro_batch_size, ctx)  # (n_pairs, 2)
    start = 0
    if args.resume:
        start = load_checkpoint(args.out_dir, models)["step"]

    def evaluate():
        """The loss per response token, the implicit reward's preference accuracy (0.5 at
        step 0) and greedy accuracy."""
        logps = data.split_logprobs(model, test, n_test, micro_batch_size, ctx, data.RESPONSE)
        out = {"eval/loss": -logps.sum().item() / test_tokens}
        if n_pairs:
            logps = data.split_logprobs(model, pairs, n_pairs, micro_batch_size, ctx)
            out["eval/preference_accuracy"] = data.preference_accuracy(logps, ref_logps)
        if prompts is not None:
            out["eval/accuracy"] = data.greedy_accuracy(
                model,
                prompts,
                meta,
                eval_size=args.eval_size,
                batch_size=micro_batch_size,
                response_length=args.response_length,
                ctx=ctx,
            )
        return out

    show = ("train/loss", "eval/loss", "eval/accuracy", "perf/tokens_per_sec")
    # Step 0: the starting model, before any update.
    if start == 0 and args.eval_size > 0:
        log_metrics(args, 0, evaluate(), show)

    # 4. training loop: one permutation of the data per epoch, keyed by (seed, epoch);
    # rank r takes its slice of each global batch, so any number of ranks sees the same
    # global batches
    t0, tokens = time.time(), torch.zeros((), device=device)
    for step in range(start, args.total_steps):
        batch_idx = data.batch_indices(args.seed, step, n_train, args.batch_size)
        local_idx = batch_idx[rank * local_batch_size :][:local_batch_size]
        b_query, b_response = data.split_tensors(train, local_idx, device, data.RESPONSE)
        # 4a. normalise by the global count of response tokens: the same update at any
        # number of ranks
        local_tokens = gpt2.response_mask(b_response, eos).sum().float()
        n_tokens = all_reduce(local_tokens)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        # 4b. forward and backward over micro-batches; FSDP2 reduces the gradients on the
        # last one
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            s = slice(micro * micro_batch_size, (micro + 1) * micro_batch_size)
            if dist.is_initialized():
                model.set_requires_gradient_sync(micro == grad_accum - 1)
            nll_sum, count = sft_loss_sums(forward_model, b_query[s], b_response[s], ctx)
            # FSDP2 averages gradients over ranks: times world_size gives sum / global count.
            (nll_sum * world_size / n_tokens).backward()
            with torch.no_grad():
                loss_sum += nll_sum
                tokens += count + (b_query[s] != pad).sum()
        # 4c. clip (the returned norm is the global one, before clipping) and step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        # Under FSDP2 the norm is a DTensor: its full value.
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        done = step + 1
        loss = all_reduce(loss_sum) / n_tokens
        if not torch.isfinite(loss) or not torch.isfinite(grad_norm):
            raise RunError(f"non-finite loss or grad norm at step {done}: lower --lr (or --resume)")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # 4d. log, evaluate, checkpoint
        eval_now = done % args.eval_every == 0 or done == args.total_steps
        if done % args.log_every == 0 or step == start or eval_now:
            elapsed = time.time() - t0
            metrics = {
                "train/loss": loss.item(),
                "train/grad_norm": grad_norm.item(),
                "train/lr": lr_at(step, args),
                "perf/tokens_per_sec": all_reduce(tokens.float()).item() / elapsed,
            }
            if eval_now and args.eval_size > 0:
                metrics |= evaluate()
            log_metrics(args, done, metrics, show)
            t0, tokens = time.time(), torch.zeros((), device=device)
        checkpoint(args, done, models, device, due=eval_now)

    # 5. the final model in the HF GPT-2 layout, where the next stages (reward.py, dpo.py,
    # ppo.py, grpo.py) look
    gpt2.save(model, args.out_dir)
    finish_run(args, "sft")


# ----------------------------------------------------------------------------------------------
# ---- plumbing: identical in every script (tests/test_copies.py)
# torchrun, the run directory, resumable checkpoints, metrics: not the algorithm. What a run does
# to the process that calls main() (a SIGTERM handler, the allocator's settings, the run dir and
# its `latest` link; the process's end under torchrun): docs/faults.md.
RunError = gpt2.RunError
# A cluster's preemption sends SIGTERM: every rank then saves at the same step
# (checkpoint).
SIGTERM = []
# Seconds the other ranks give rank 0 to print a RunError that every rank met.
RANK_EXIT_DELAY = 5


def is_master():
    """Rank 0, or the only process: the one that writes the run dir and prints."""
    return int(os.environ.get("RANK", "0")) == 0


def setup_distributed():
    """(rank, world_size, device); under torchrun, a process group: nccl on CUDA, gloo on CPU.
    The process keeps freed buffers (gpt2.keep_freed_memory) and takes SIGTERM as a request to
    save a checkpoint and stop."""
    gpt2.keep_freed_memory()
    SIGTERM.clear()
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
    # A run that stops on an exception still ends its process group.
    atexit.register(end_process_group)
    return rank, world_size, device


def end_process_group():
    """Destroy the process group, if one is left (at exit, after a run that stopped on an
    exception)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def start_run(args, algo):
    """Rank 0 claims the run dir: a fresh one, or --out_dir with --resume or --overwrite."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or f"runs/{algo}/{stamp}-s{args.seed}"
    claim = [None, None]
    if is_master():
        claim = [claim_run_dir(out_dir, args, algo), out_dir]
    # Every rank takes rank 0's name: their clocks may differ.
    if dist.is_initialized():
        dist.broadcast_object_list(claim, src=0)
    problem, out_dir = claim
    if problem:
        raise RunError(problem)
    if is_master() and args.wandb:
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
    # Each model in the HF layout, with its optimizer.pt if it has an optimizer.
    for name, (model, optimizer) in models.items():
        gpt2.save(model, f"{root}/.tmp/{name}", optimizer)
    if is_master():
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
            for name, (model, optimizer) in models.items():
                safe_open(f"{path}/{name}/model.safetensors", "pt")
                # A frozen model in the run's state (a refreshed reference) has no optimizer.
                if optimizer:
                    torch.load(f"{path}/{name}/optimizer.pt", weights_only=True, mmap=True)
            torch.load(f"{path}/state.pt", weights_only=True)
            return path
        except Exception as e:
            why = e.__class__.__name__
            print(f"warning: checkpoint {path} is damaged ({why})", flush=True)
    return None


def load_checkpoint(out_dir, models):
    """--resume: rank 0 picks the checkpoint, and every rank loads it, at any world size."""
    box = [newest_complete_checkpoint(out_dir, models) if is_master() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    path = box[0]
    if path is None:
        raise RunError(f"--resume: no complete checkpoint in {out_dir}/checkpoints: drop --resume")
    state = torch.load(f"{path}/state.pt", weights_only=True)
    for name, (model, optimizer) in models.items():
        gpt2.load_weights(model, f"{path}/{name}", optimizer)
    if is_master():
        print(f"resumed from {path} at step {state['step']}", flush=True)
        # The rows a killed run logged after this checkpoint will be logged again: cut
        # them, in one call, so that a kill leaves either every row or these. The rows
        # are in step order.
        rows = open(f"{out_dir}/metrics.jsonl", "rb").readlines()
        kept = [row for row in rows if json.loads(row)["step"] <= state["step"]]
        os.truncate(f"{out_dir}/metrics.jsonl", sum(len(row) for row in kept))
    return state


def log_metrics(args, step, metrics, show):
    """Rank 0: one JSON row in metrics.jsonl (every metric), one status line (`show`), and
    with --wandb, the row to Weights & Biases."""
    if not is_master():
        return
    with open(f"{args.out_dir}/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    status = " | ".join(f"{k} {metrics[k]:.4g}" for k in show if k in metrics)
    print(f"step {step:5d} | {status}", flush=True)
    if args.wandb:
        sys.modules["wandb"].log(metrics, step=step)


def finish_run(args, algo):
    """After the final save: runs/<algo>/latest, where the next stage looks, links this run;
    the process group ends, and main() returns on every rank."""
    if is_master() and os.path.dirname(args.out_dir) == f"runs/{algo}":
        # A new link under this process's own name, renamed over the old one: no reader
        # ever finds no link, and no other run shares the temporary name.
        link = f"runs/{algo}/.latest.{os.getpid()}"
        os.symlink(os.path.basename(args.out_dir), link)
        os.replace(link, f"runs/{algo}/latest")
    if is_master() and args.wandb:
        sys.modules["wandb"].finish()
    if dist.is_initialized():
        # Every rank is done with its collectives before any tears down its connections.
        dist.barrier()
    end_process_group()


def parse_args(argv):
    """Args from the command line (tyro). A flag that lives in a sibling script (MOVED) is one
    line naming that script."""
    for arg in argv:
        flag = arg.split("=")[0].removeprefix("--").replace("-", "_")
        # a boolean's --no_ form is its flag too
        flag = flag if flag in MOVED else flag.removeprefix("no_")
        if arg.startswith("--") and flag in MOVED:
            sibling = MOVED[flag]
            raise RunError(f"--{flag} lives in {sibling}: run `python {sibling} --{flag} ...`")
    return tyro.cli(Args, args=argv, use_underscores=True)


def exit_on(error):
    """The end of a run stopped by a RunError: its one line on rank 0 and exit status 1 on
    every rank. The other ranks exit a moment later: torchrun stops every rank when one fails,
    and rank 0, a moment behind on a loaded machine, would be stopped before its line."""
    if is_master():
        sys.exit(f"error: {error}")
    time.sleep(RANK_EXIT_DELAY)
    sys.exit(1)


if __name__ == "__main__":
    try:
        main(parse_args(sys.argv[1:]))
    except RunError as e:
        exit_on(e)
    # Under torchrun, gloo's threads can abort the interpreter's teardown after main() has
    # returned (docs/faults.md): the process ends here instead.
    if "RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
