"""Direct Preference Optimization (DPO) and its variants: fit the policy to
preference pairs, without a reward model or RL.

Rafailov et al. 2023, eq. 7: the loss of a pair is -log σ(βh), where
    h = [log π(y_w) - log π_ref(y_w)] - [log π(y_l) - log π_ref(y_l)]
and log π(y) sums a response's token log-probs, up to and including its stop token.

--loss_type picks the loss (docs/variants_dpo.md: the library each one matches):
    sigmoid   DPO eq. 7; cDPO with --label_smoothing
    hinge     SLiC-HF
    ipo       IPO eq. 17 on length-averaged log-probs (ipo_sum: on summed ones)
    dpo_norm  DPO on length-averaged log-probs (Tulu 3)
    simpo     SimPO eq. 6: no reference
--rpo_alpha adds RPO's NLL of the chosen response; --wpo weights each pair's loss by
the policy's probability of the pair (WPO, with its weight alignment, as TRL).

π_ref's log-probs are computed once before step 0 (again on --resume) by the
starting policy or --ref_model, sharded as the policy is: no reference model stays
in memory, and the first loss is ln 2. With --ref_sync_every τ (TR-DPO) π_ref stays,
scores each batch, and every τ steps moves toward π: π_ref ← α π + (1 - α) π_ref.
Eval, from step 0: the loss and reward accuracy on pref_test, greedy accuracy on
prompt_test.

    python dpo.py                                  # from runs/sft/latest (python sft.py)
    python dpo.py --loss_type ipo --rpo_alpha 1.0  # IPO plus RPO's NLL
    torchrun --nproc_per_node=2 dpo.py             # FSDP2 over 2 ranks: the same run
    python dpo.py --wpo --ref_sync_every 64 --ref_sync_mix 0.6  # WPO; TR-DPO's soft update
    python dpo.py --resume --out_dir runs/dpo/RUN  # continue from the last checkpoint

A run writes runs/dpo/<time>-s<seed>/; runs/dpo/latest links the last finished one.
"""

import atexit
import datetime
import fcntl
import functools
import glob
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from safetensors import safe_open
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import data
import gpt2

# the choices of --loss_type and --rpo_normalization (docs/variants_dpo.md)
LossType = Literal["sigmoid", "hinge", "ipo", "ipo_sum", "dpo_norm", "simpo"]
RpoNormalization = Literal["sequence", "token"]


@dataclass
class Args:
    model: str = "runs/sft/latest"  # policy to start from: SFT run dir, preset or `tiny`
    ref_model: str = ""  # the reference policy π_ref (empty: --model)
    data: str = "arithmetic"  # `arithmetic` (built in) or a dir made by data.prep
    out_dir: str = ""  # run directory; default a fresh runs/dpo/<time>-s<seed>
    overwrite: bool = False  # delete the run already in --out_dir and start afresh
    resume: bool = False  # continue the run in --out_dir from its last checkpoint
    seed: int = 1  # seed of the data order (the same on every rank)
    lr: float = 5e-5  # peak learning rate (5e-5: the tiny model; ~1e-6: GPT-2)
    warmup_steps: int = 20  # linear warmup steps, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1  # the final learning rate as a fraction of lr
    weight_decay: float = 0.0  # AdamW weight decay on matrices (not biases, LayerNorms)
    max_grad_norm: float = 1.0  # gradient clipping threshold on the global gradient norm
    total_steps: int = 300  # optimizer steps
    batch_size: int = 64  # preference pairs per optimizer step, over all ranks
    micro_batch_size: int = 32  # pairs per forward pass on one rank (2x sequences)
    max_train_pairs: int = 0  # train on the first N pairs of pref_train only (0: all)
    loss_type: LossType = "sigmoid"  # the pair loss: DPO's sigmoid or a variant
    beta: float | None = None  # β, the reward scale (simpo 2, dpo_norm 5, else 0.1)
    label_smoothing: float = 0.0  # ε of conservative DPO: the share of flipped labels
    simpo_gamma: float = 0.5  # γ, SimPO's target reward margin (TRL's simpo_gamma)
    reference_free: bool = False  # log π_ref = 0: no reference pass
    rpo_alpha: float = 0.0  # weight of the chosen response's NLL in the loss (RPO)
    rpo_normalization: RpoNormalization = "sequence"  # NLL per sequence (paper) or token (TRL)
    wpo: bool = False  # weight each pair's loss by its probability under π (WPO)
    wpo_align: bool = True  # WPO's alignment: log π(y_t) less log Σ_v π(v)² per token (TRL's)
    ref_sync_every: int = 0  # τ: refresh π_ref every this many steps (TR-DPO; 0: never)
    ref_sync_mix: float = 0.6  # α: π_ref ← α π + (1 - α) π_ref at a refresh (1: a copy)
    response_length: int = 16  # max new tokens when generating for eval accuracy
    eval_every: int = 100  # steps between evals and checkpoints
    eval_size: int = 500  # held-out pairs and prompts for eval (0: no eval)
    log_every: int = 10  # steps between status lines and metrics rows
    keep_checkpoints: int = 2  # checkpoints kept in out_dir/checkpoints (at least 1)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA only
    compile: bool = False  # torch.compile the model
    activation_checkpointing: bool = False  # less memory: recompute block activations
    packing: bool = True  # the real tokens only, packed into one row: no compute on padding
    wandb: bool = False  # also log to Weights & Biases (imported only when set)


# Flags that live in a sibling script (parse_args): none.
MOVED = {}

# ----------------------------------------------------------------------------------------------
# DPO: the pair loss from the log-probs of the chosen and rejected responses


def pair_loss(logps, ref_logps, lengths, args):
    """The --loss_type loss of each pair (B,) and the implicit rewards β log π/π_ref
    (B, 2), from the summed log-probs of the chosen and rejected responses (B, 2)
    and their lengths (B, 2). ref_logps are 0 for --reference_free and simpo."""
    # ipo, dpo_norm and simpo compare per-token log-probs, of both models
    if args.loss_type in ("ipo", "dpo_norm", "simpo"):
        logps = logps / lengths
        ref_logps = ref_logps / lengths
    pi_logratios = logps[:, 0] - logps[:, 1]
    ref_logratios = ref_logps[:, 0] - ref_logps[:, 1]
    rewards = args.beta * (logps - ref_logps)
    eps = args.label_smoothing

    if args.loss_type in ("sigmoid", "dpo_norm"):
        # DPO eq. 7: -log σ(βh). cDPO (Mitchell 2023): a share ε of the labels
        # is assumed flipped. dpo_norm (Tulu 3): the same on per-token log-probs
        logits = args.beta * (pi_logratios - ref_logratios)
        loss = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    elif args.loss_type == "simpo":
        # SimPO eq. 6 (Meng et al. 2024): no reference, a target reward margin γ
        logits = args.beta * (pi_logratios - args.simpo_gamma / args.beta)
        loss = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    elif args.loss_type == "hinge":
        # SLiC-HF (Zhao et al. 2023): max(0, 1 - βh), no loss past a margin 1/β
        loss = torch.relu(1 - args.beta * (pi_logratios - ref_logratios))
    elif args.loss_type in ("ipo", "ipo_sum"):
        # IPO eq. 17 (Azar et al. 2023): h regressed onto 1/(2β), not pushed to infinity
        loss = (pi_logratios - ref_logratios - 1 / (2 * args.beta)) ** 2
    return loss, rewards


def rpo_nll(logps_chosen, len_chosen, normalization, tokens_per_pair):
    """RPO's NLL of the chosen response of each pair (B,) (Pang et al. 2024),
    to be averaged over the global batch like the loss."""
    # the paper: each response's NLL per token
    if normalization == "sequence":
        return -logps_chosen / len_chosen
    # TRL's cross-entropy: divided by the global batch's mean chosen length
    return -logps_chosen / tokens_per_pair


def wpo_weights(logps, lengths, collision=None):
    """WPO's weight of each pair (B,) (Zhou et al. 2024, eq. 2): the policy's per-token
    probability of the chosen response times the rejected one's, exp(log π(y_w)/|y_w| +
    log π(y_l)/|y_l|), from the summed log-probs (B, 2) and lengths (B, 2). Detached: a
    weight, not a term to optimise. collision (B, 2): each response's summed -log Σ_v π(v)²,
    for the weight alignment."""
    logps = logps.detach()
    if collision is not None:
        # The weight alignment: each token's log π less log Σ_v π(v)², the log of the
        # probability the policy's own sample has on average (TRL 1.16: no cap at 1).
        aligned = (logps + collision.detach()) / lengths  # (B, 2)
        return aligned.sum(1).exp()
    per_token = logps / lengths  # (B, 2)
    return per_token.sum(1).exp()


@torch.no_grad()
def sync_reference(ref, policy, mix):
    """TR-DPO's refresh of π_ref, in place (Gorbatovski et al. 2024): π_ref ← mix π_θ +
    (1 - mix) π_ref, parameter by parameter; mix 1 is the hard update, a copy. Under FSDP2
    both models are sharded alike: each rank mixes its own shards, with no gather."""
    # A no-grad forward leaves an FSDP2 root gathered: its parameters are full tensors
    # until it is sharded again.
    for module in [*ref.modules(), *policy.modules()]:
        if isinstance(module, FSDPModule):
            module.reshard()
    for ref_param, param in zip(ref.parameters(), policy.parameters(), strict=True):
        # A DTensor's local shard is a view: writing it writes the parameter.
        if isinstance(ref_param, DTensor):
            ref_param = ref_param.to_local()
            param = param.to_local()
        if mix == 1:
            # The hard update, cast to π_ref's dtype (a frozen model's blocks are bf16 on CUDA).
            ref_param.copy_(param)
        else:
            # The soft update in fp32, rounded once to π_ref's dtype.
            ref_param.copy_(torch.lerp(ref_param.float(), param.float(), mix))


def lr_at(step, args):
    """Linear warmup, then cosine to lr * min_lr_ratio."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    decay_steps = max(1, args.total_steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / decay_steps)
    # From 1 down to 0.
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def check_args(args):
    """Every flag's range, before any work: a bad flag stops the run with one
    line that names it and the fix. Also sets --beta's default for the loss."""
    if args.model == "runs/sft/latest" and not os.path.isdir(args.model):
        raise RunError("no SFT model at runs/sft/latest: run `python sft.py` or pass --model")
    if args.beta is None:
        # each paper's β: SimPO's 2, Tulu 3's 5 for dpo_norm, DPO's 0.1
        args.beta = {"simpo": 2.0, "dpo_norm": 5.0}.get(args.loss_type, 0.1)
    if not (math.isfinite(args.beta) and args.beta > 0):
        raise RunError(f"--beta {args.beta}: must be above 0; drop it for the loss's default")

    # finite (nan is neither above nor below 0); a gradient clip of 0 would stop training
    norm = args.max_grad_norm
    if not (math.isfinite(norm) and norm > 0):
        raise RunError(f"--max_grad_norm {norm}: must be above 0; try the default 1.0")
    # rates, weights and margins: finite, and 0 turns them off
    for flag in ("lr", "weight_decay", "simpo_gamma", "rpo_alpha"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value >= 0):
            raise RunError(f"--{flag} {value}: must be 0 or more; 0 turns it off")
    ratio = args.min_lr_ratio
    if not 0 <= ratio <= 1:
        raise RunError(f"--min_lr_ratio {ratio}: a fraction of --lr; pass one in [0, 1]")
    eps = args.label_smoothing
    if not 0 <= eps < 0.5:
        raise RunError(f"--label_smoothing {eps}: the share of flipped labels is in [0, 0.5)")
    if eps and args.loss_type not in ("sigmoid", "dpo_norm", "simpo"):
        fix = "use sigmoid, dpo_norm or simpo"
        raise RunError(f"--label_smoothing: no smoothing in {args.loss_type}; {fix}")
    mix = args.ref_sync_mix
    if not 0 < mix <= 1:
        raise RunError(f"--ref_sync_mix {mix}: α is in (0, 1]; 1 copies π into π_ref")
    no_ref = args.reference_free or args.loss_type == "simpo"
    if args.ref_sync_every and no_ref:
        raise RunError("--ref_sync_every: simpo and --reference_free have no π_ref to refresh")

    # sizes and intervals: at least 1
    for flag in ("total_steps", "batch_size", "micro_batch_size", "response_length"):
        value = getattr(args, flag)
        default = getattr(Args, flag)
        if value < 1:
            raise RunError(f"--{flag} {value}: must be at least 1; try the default {default}")
    if args.eval_every < 1:
        raise RunError(f"--eval_every {args.eval_every}: at least 1; no eval is --eval_size 0")
    if args.log_every < 1:
        raise RunError(f"--log_every {args.log_every}: at least 1; pass 1 to log every step")
    if args.seed < 0:
        raise RunError(f"--seed {args.seed}: numpy takes no negative seed; pass 0 or more")
    # counts that may be 0
    counts = ["warmup_steps", "max_train_pairs", "eval_size", "keep_checkpoints"]
    counts += ["ref_sync_every"]
    for flag in counts:
        value = getattr(args, flag)
        default = getattr(Args, flag)
        if value < 0:
            raise RunError(f"--{flag} {value}: must be 0 or more; try the default {default}")


def all_reduce(x):
    """Sum over ranks, in place: the global batch's sums (a no-op in one process)."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def all_reduce_dict(sums):
    """{name: scalar tensor} summed over ranks in one collective -> {name: float}."""
    names = list(sums)
    total = all_reduce(torch.stack([sums[name].double() for name in names]))
    return dict(zip(names, total.tolist()))


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


def main(args: Args):
    # 1. flags, sizes, distributed setup, seeds
    check_args(args)
    rank, world_size, device = setup_distributed()
    local_batch_size = data.exact_div(args.batch_size, world_size, "--batch_size or the ranks")
    micro_batch_size = min(args.micro_batch_size, local_batch_size)
    grad_accum = data.exact_div(local_batch_size, micro_batch_size, "--micro_batch_size")
    # bf16 when asked for; `auto` picks it on CUDA, not on CPU
    bf16 = args.dtype == "bfloat16"
    if args.dtype == "auto":
        bf16 = device.type == "cuda"
    # with bf16 off, the autocast context is a no-op
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    torch.manual_seed(args.seed)

    # 2. data: the pairs and their response lengths (n, 2), stop token included
    meta = data.load_meta(args.data)
    train = data.load_split(args.data, "pref_train")
    test = data.load_split(args.data, "pref_test")
    # the prompts of a task with a verifier, for eval/accuracy
    prompts = None
    if meta.get("task"):
        prompts = data.load_split(args.data, "prompt_test")
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    n_pairs = len(train["query"])
    n_train = n_pairs
    if args.max_train_pairs:
        n_train = min(args.max_train_pairs, n_pairs)
    n_test = min(args.eval_size, len(test["query"]))
    if n_train < args.batch_size:
        fix = "raise --max_train_pairs"
        raise RunError(f"{n_train} pairs < --batch_size {args.batch_size}: {fix}")
    train_lengths = data.response_lengths(train, n_train, eos).to(device)
    test_lengths = data.response_lengths(test, n_test, eos).to(device)

    # 3. the policy and π_ref, then the run dir (none is left by a bad --model)
    policy_shard = functools.partial(shard, device=device, bf16=bf16)
    model = gpt2.load(args.model, meta, shard=policy_shard)
    data.check_context(train, model.config.block_size)
    use_ref = not (args.reference_free or args.loss_type == "simpo")
    # TR-DPO: π_ref changes during the run, so it stays in memory
    refresh = args.ref_sync_every > 0
    # π_ref is the starting policy, or --ref_model: frozen, sharded as π is
    ref = model
    ref_shard = functools.partial(shard, device=device, bf16=bf16, frozen=True)
    if args.ref_model and use_ref:
        ref = gpt2.load(args.ref_model, meta, shard=ref_shard)
    elif refresh:
        # a copy of the starting policy (`--model tiny`: its random init again)
        torch.manual_seed(args.seed)
        ref = gpt2.load(args.model, meta, shard=ref_shard)
    ref_shapes = [p.shape for p in ref.parameters()]
    if refresh and ref_shapes != [p.shape for p in model.parameters()]:
        raise RunError("--ref_sync_every mixes π into π_ref: pass a --ref_model of --model's size")
    args.out_dir = start_run(args, "dpo")
    model.activation_checkpointing = args.activation_checkpointing
    model.packing = args.packing
    ref.packing = args.packing

    # the optimizer: weight decay on the matrices, not on biases and LayerNorms
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=args.weight_decay), dict(params=no_decay)]
    optimizer = torch.optim.AdamW(
        groups,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0,
        fused=True,
    )
    forward_model = model
    if args.compile:
        forward_model = torch.compile(model)
    models = {"policy": (model, optimizer)}
    if refresh:
        # a refreshed π_ref is part of the run's state: the checkpoint holds it (no optimizer)
        models["reference"] = (ref, None)

    # 4. π_ref's log-probs of every pair, once, before a resume loads the
    # trained weights. Reference-free: log π_ref = 0. Refreshed: per batch, in the loop
    ref_train = torch.zeros(n_train, 2, device=device)
    ref_test = torch.zeros(n_test, 2, device=device)
    if use_ref and not refresh:
        if is_master():
            print(f"reference log-probs of {n_train} train and {n_test} eval pairs", flush=True)
        ref_train = data.split_logprobs(ref, train, n_train, micro_batch_size, ctx)
        ref_test = data.split_logprobs(ref, test, n_test, micro_batch_size, ctx)
        # frees a --ref_model
        ref = None
    start = 0
    if args.resume:
        start = load_checkpoint(args.out_dir, models)["step"]

    def evaluate():
        """Pair loss (no RPO term) and accuracies on pref_test; greedy accuracy on
        prompt_test."""
        ref_logps = ref_test
        if refresh:
            # against π_ref as it is now, as the training loss is
            ref_logps = data.split_logprobs(ref, test, n_test, micro_batch_size, ctx)
        logps = data.split_logprobs(model, test, n_test, micro_batch_size, ctx)
        loss, rewards = pair_loss(logps, ref_logps, test_lengths, args)
        out = {
            "eval/loss": loss.mean().item(),
            # on summed log-probs whatever the loss; a tie counts half
            "eval/preference_accuracy": data.preference_accuracy(logps, ref_logps),
            "eval/rewards_margins": (rewards[:, 0] - rewards[:, 1]).mean().item(),
            "eval/logps_accuracy": (logps[:, 0] > logps[:, 1]).float().mean().item(),
        }
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

    show = ("train/loss", "eval/preference_accuracy", "eval/accuracy", "perf/tokens_per_sec")
    # the starting policy: the loss is ln 2 when π = π_ref
    if start == 0 and args.eval_size > 0:
        log_metrics(args, 0, evaluate(), show)

    # 5. training loop: one permutation of the pairs per epoch, keyed by
    # (seed, epoch). Rank r takes its slice of each global batch, so any
    # number of ranks sees the same global batches
    t0, tokens = time.time(), 0
    for step in range(start, args.total_steps):
        batch_idx = data.batch_indices(args.seed, step, n_train, args.batch_size)
        local_idx = batch_idx[rank * local_batch_size :][:local_batch_size]
        # 5a. RPO's token mean is over the global batch's chosen tokens: the
        # same at any rank count
        mean_chosen = train_lengths[batch_idx, 0].float().mean()
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # 5b. forward and backward over micro-batches; FSDP2 reduces the
        # gradients on the last one
        sums = {}
        for micro in range(grad_accum):
            idx = local_idx[micro * micro_batch_size :][:micro_batch_size]
            if dist.is_initialized():
                model.set_requires_gradient_sync(micro == grad_accum - 1)
            query, chosen, rejected = data.split_tensors(train, idx, device)
            lengths = train_lengths[idx]
            ref_logps = ref_train[idx]
            if refresh:
                with torch.no_grad(), ctx:
                    ref_logps = data.response_logprobs(ref, query, chosen, rejected)
            # WPO's alignment needs -log Σ_v π(v)² of each token: from the same pass
            collision = None
            with ctx:
                if args.wpo and args.wpo_align:
                    logps, collision = data.response_logprobs_and_entropy(
                        forward_model, query, chosen, rejected, entropy="collision"
                    )
                else:
                    logps = data.response_logprobs(forward_model, query, chosen, rejected)
            loss, rewards = pair_loss(logps, ref_logps, lengths, args)
            # WPO: a pair the policy finds unlikely (off-policy) counts less
            weights = torch.ones_like(loss)
            if args.wpo:
                weights = wpo_weights(logps, lengths, collision)
            nll = rpo_nll(logps[:, 0], lengths[:, 0], args.rpo_normalization, mean_chosen)
            loss_sum = (weights * loss + args.rpo_alpha * nll).sum()
            # FSDP2 averages gradients over ranks: times world_size makes
            # the mean over the global batch
            (loss_sum * world_size / args.batch_size).backward()

            # the metrics, summed by name over this rank's pairs
            with torch.no_grad():
                # a tie, as at step 0, counts as wrong
                correct = rewards[:, 0] > rewards[:, 1]
                reward_sums = rewards.sum(0)
                logp_sums = logps.sum(0)
                micro_sums = {
                    "train/loss": loss_sum,
                    "train/nll": nll.sum(),
                    "train/wpo_weight": weights.sum(),
                    "rewards/chosen": reward_sums[0],
                    "rewards/rejected": reward_sums[1],
                    "rewards/accuracies": correct.sum(),
                    "logps/chosen": logp_sums[0],
                    "logps/rejected": logp_sums[1],
                }
                for name, value in micro_sums.items():
                    sums[name] = sums.get(name, 0) + value
            # tokens through the model: both responses, each after its query
            query_tokens = int((train["query"][idx] != pad).sum())
            tokens += lengths.sum() + 2 * query_tokens

        # 5c. clip by the global norm (returned as it was before clipping), step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        # under FSDP2 the norm is a DTensor: the global norm is its full tensor
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        done = step + 1
        # the global batch's means, over all ranks in one collective
        totals = all_reduce_dict(sums)
        means = {name: total / args.batch_size for name, total in totals.items()}
        if not math.isfinite(means["train/loss"]) or not torch.isfinite(grad_norm):
            fix = "lower --lr (or --resume)"
            raise RunError(f"non-finite loss or grad norm at step {done}: {fix}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # TR-DPO: every τ optimizer steps π_ref moves toward π (TRL's SyncRefModelCallback)
        if refresh and done % args.ref_sync_every == 0:
            sync_reference(ref, model, args.ref_sync_mix)

        # 5d. log, evaluate, checkpoint
        eval_now = done % args.eval_every == 0 or done == args.total_steps
        log_now = done % args.log_every == 0 or step == start or eval_now
        if log_now:
            seconds = time.time() - t0
            tokens_per_sec = all_reduce(tokens.float()).item() / seconds
            metrics = {
                "train/loss": means["train/loss"],
                "rewards/chosen": means["rewards/chosen"],
                "rewards/rejected": means["rewards/rejected"],
                "rewards/margins": means["rewards/chosen"] - means["rewards/rejected"],
                "rewards/accuracies": means["rewards/accuracies"],
                "logps/chosen": means["logps/chosen"],
                "logps/rejected": means["logps/rejected"],
                "train/grad_norm": grad_norm.item(),
                "train/lr": lr,
                "perf/tokens_per_sec": tokens_per_sec,
            }
            # RPO's NLL, only when it is part of the loss
            if args.rpo_alpha:
                metrics["train/nll"] = means["train/nll"]
            if args.wpo:
                metrics["train/wpo_weight"] = means["train/wpo_weight"]
            if eval_now and args.eval_size > 0:
                metrics |= evaluate()
            log_metrics(args, done, metrics, show)
            t0, tokens = time.time(), 0
        checkpoint(args, done, models, device, due=eval_now)

    # 6. the final policy in the HF GPT-2 layout
    gpt2.save(model, args.out_dir)
    finish_run(args, "dpo")


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
