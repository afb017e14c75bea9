"""Direct Preference Optimization (DPO) and the variants people compare it with: fit the policy to preference pairs
directly, without a reward model or RL.

Rafailov et al. 2023. Log-probs are summed over the response tokens up to and including the first stop token (never a
pad). With h = [log π(y_w|x) - log π_ref(y_w|x)] - [log π(y_l|x) - log π_ref(y_l|x)], --loss_type picks the pair loss:
  sigmoid   DPO eq. 7, -log σ(βh); with --label_smoothing ε, conservative DPO (cDPO, Mitchell 2023):
            -(1 - ε) log σ(βh) - ε log σ(-βh)
  hinge     SLiC-HF (Zhao et al. 2023): max(0, 1 - βh)
  ipo       IPO (Azar et al. 2023, eq. 17) on length-averaged log-probs, as TRL's ipo: (h̄ - 1/(2β))², where h̄ divides
            each log-ratio by its response length
  ipo_sum   the same on summed log-probs (IPO as OpenRLHF's --ipo computes it)
  dpo_norm  the sigmoid loss on length-averaged log-probs (open-instruct's dpo_norm; Tulu 3 uses β = 5)
  simpo     SimPO (Meng et al. 2024, eq. 6): -log σ(β (avg log π(y_w) - avg log π(y_l)) - γ), no reference model
With --rpo_alpha α, RPO (Pang et al. 2024) adds α times the chosen response's NLL (--rpo_normalization: per-sequence
mean as in the paper and OpenRLHF, or TRL's token mean, here over the global batch rather than per device, so the
number of ranks does not change it). The implicit reward is r = β log π/π_ref (per-token for ipo, dpo_norm, simpo). docs/variants_dpo.md says which library default each
option reproduces. The reference log-probs of the training pairs (all, or --max_train_pairs) and of the eval pairs are
computed once before step 0, by the starting policy (or --ref_model), so no reference model is in memory while
training (simpo and --reference_free skip this pass; --resume repeats it). Eval, also at step 0: loss and preference
accuracy (r_chosen > r_rejected) on pref_test and, for tasks with a verifier, greedy accuracy on prompt_test.

    python dpo.py                                          # from runs/sft/latest (python sft.py), the offline task
    python dpo.py --loss_type ipo --rpo_alpha 1.0          # IPO (length-averaged, as TRL) plus RPO's NLL term
    python dpo.py --loss_type simpo                        # β 2.0 and γ 0.5 by default, no reference pass
    python dpo.py --total_steps 3 --max_train_pairs 64     # a smoke run of a few seconds
    torchrun --nproc_per_node=2 dpo.py                     # FSDP2 over 2 ranks: the same run as on 1
    python dpo.py --model runs/sft_hh --data data/hh --lr 1e-6 --batch_size 64 --micro_batch_size 8
    python dpo.py --resume --out_dir runs/dpo/<run>        # continue a run from its last checkpoint

Each run writes a fresh `runs/dpo/<time>-s<seed>/` (model in the HF safetensors layout, checkpoints, args.json,
metrics.jsonl); `runs/dpo/latest` links to the last finished one. The file is longer than STYLE.md's 350–450
lines by its plumbing section (~245 lines, identical in every script: torchrun, run directories, atomic checkpoints,
one-line errors), which lets it run alone; the algorithm and main() take ~440.
"""

import atexit
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

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

import data
import gpt2


@dataclass
class Args:
    model: str = "runs/sft/latest"
    """the policy to start from: an SFT run dir (`python sft.py`), a GPT-2 preset, or `tiny` (random init, for tests)"""
    ref_model: str = ""
    """the reference policy π_ref (empty = --model, scored before training starts)"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a directory with pref_{train,test} from `python -m data.prep`"""
    out_dir: str = ""
    """run directory; default a fresh runs/dpo/<time>-s<seed>, linked as runs/dpo/latest when it finishes"""
    overwrite: bool = False
    """delete the run already in --out_dir and start afresh"""
    resume: bool = False
    """continue the run in --out_dir from its last complete checkpoint"""
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
    max_train_pairs: int = 0
    """train on the first N pairs of pref_train only (0 = all): the reference pass scores only these"""
    loss_type: str = "sigmoid"
    """`sigmoid` (DPO), `hinge` (SLiC), `ipo` (length-averaged, TRL), `ipo_sum`, `dpo_norm` or `simpo`"""
    beta: float | None = None
    """β, the scale of the implicit reward (larger = stay closer to π_ref); default 2.0 for simpo (SimPO's default),
    5.0 for dpo_norm (Tulu 3's), else 0.1"""
    label_smoothing: float = 0.0
    """ε of conservative DPO (sigmoid, dpo_norm, simpo): the assumed fraction of flipped labels, in [0, 0.5)"""
    simpo_gamma: float = 0.5
    """γ, SimPO's target reward margin (0.5 = SimPO's β 2.0 x γ/β 0.25 and TRL's simpo_gamma)"""
    reference_free: bool = False
    """use log π_ref = 0 (no reference pass: the loss compares the policy's own log-probs)"""
    rpo_alpha: float = 0.0
    """weight of the chosen response's NLL added to the loss (RPO, Pang et al. 2024; TRL's rpo_alpha)"""
    rpo_normalization: str = "sequence"
    """RPO's NLL: `sequence` (mean over pairs of each chosen response's per-token NLL: the paper, OpenRLHF) or `token`
    (summed NLL / chosen tokens in the global batch: TRL)"""
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
    dtype: str = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `float32` or `bfloat16` (autocast; FSDP2 bf16 params + fp32 reduce)"""
    compile: bool = False
    """torch.compile the model"""
    activation_checkpointing: bool = False
    """recompute block activations in backward to save memory"""
    wandb: bool = False
    """also log to Weights & Biases (imported only when set)"""


DPO_LOSSES = ("sigmoid", "hinge", "ipo", "ipo_sum", "dpo_norm", "simpo")
PER_TOKEN_LOSSES = ("ipo", "dpo_norm", "simpo")  # log-probs divided by the response length before the loss
DPO_BETA = {"simpo": 2.0, "dpo_norm": 5.0}  # --beta's default per loss; 0.1 for the others


# ---------------------------------------------------------------------------------------------------------------------
# DPO: sequence log-probs, the pair losses, and the masks they need


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


def sequence_logprobs(model, query, response, pad_token_id, eos_token_id, ctx):
    """log π(response | query) (B,): token log-probs summed up to and including the first stop token, never a pad."""
    mask = response_mask(response, eos_token_id)  # (B, Tr)
    attention_mask = torch.cat([query != pad_token_id, mask], 1)
    with ctx:
        # logits from the last prompt position on: position t predicts token t + 1, so the last token is only
        # predicted, never read, and is left out of the input. A prompt that several rows share (a pair's chosen and
        # rejected) runs once (shared_prefix): the same numbers for half the prompt's compute
        logits = model(torch.cat([query, response[:, :-1]], 1), attention_mask=attention_mask[:, :-1],
                       keep_from=query.size(1) - 1, shared_prefix=query.size(1) - 1)  # (B, Tr, V) fmt: skip
    logprobs = -F.cross_entropy(logits.float().flatten(0, 1), response.flatten().long(), reduction="none")
    return (logprobs.view_as(mask) * mask).sum(1)


def pair_logprobs(model, query, chosen, rejected, pad_token_id, eos_token_id, ctx):
    """log π of the chosen and of the rejected responses (B,), (B,), in one forward pass of 2B rows (chosen rows, then
    rejected rows, padded to one width: every response ends in its stop token, so the pad is never scored)."""
    width = max(chosen.size(1), rejected.size(1))
    response = torch.cat([F.pad(r, (0, width - r.size(1)), value=pad_token_id) for r in (chosen, rejected)])  # (2B, T)
    query, response = trim_padding(query.repeat(2, 1), response, pad_token_id, eos_token_id)
    return sequence_logprobs(model, query, response, pad_token_id, eos_token_id, ctx).chunk(2)


def dpo_loss(logps_chosen, logps_rejected, ref_chosen, ref_rejected, beta, loss_type="sigmoid", label_smoothing=0.0,
             simpo_gamma=0.5):  # fmt: skip
    """Per-pair loss (B,) of the log-ratio difference h = log π/π_ref (chosen) - log π/π_ref (rejected). The inputs are
    summed log-probs, or per-token means for PER_TOKEN_LOSSES (see pair_loss)."""
    h = (logps_chosen - ref_chosen) - (logps_rejected - ref_rejected)
    if loss_type in ("sigmoid", "dpo_norm", "simpo"):
        # DPO eq. 7, cDPO when label_smoothing > 0; SimPO eq. 6 is reference-free with a target margin γ
        z = beta * (logps_chosen - logps_rejected) - simpo_gamma if loss_type == "simpo" else beta * h
        return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    if loss_type in ("ipo", "ipo_sum"):  # IPO eq. 17: regress h onto 1/(2β) instead of pushing it to infinity
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":  # SLiC-HF's calibration loss with margin 1/β
        return torch.relu(1 - beta * h)
    raise ValueError(f"unknown --loss_type '{loss_type}': use {', '.join(DPO_LOSSES)}")


def pair_loss(logps_chosen, logps_rejected, ref_chosen, ref_rejected, len_chosen, len_rejected, args: Args):
    """The --loss_type loss and the implicit rewards β log π/π_ref of the chosen and rejected responses, all (B,), from
    summed log-probs and response lengths (tokens up to and including the stop token)."""
    if args.loss_type in PER_TOKEN_LOSSES:  # length-normalised: policy and reference alike
        logps_chosen, ref_chosen = logps_chosen / len_chosen, ref_chosen / len_chosen
        logps_rejected, ref_rejected = logps_rejected / len_rejected, ref_rejected / len_rejected
    loss = dpo_loss(logps_chosen, logps_rejected, ref_chosen, ref_rejected, args.beta, args.loss_type,
                    args.label_smoothing, args.simpo_gamma)  # fmt: skip
    return loss, args.beta * (logps_chosen - ref_chosen), args.beta * (logps_rejected - ref_rejected)


def rpo_nll(logps_chosen, len_chosen, normalization: str, tokens_per_pair):
    """RPO's NLL term per pair (B,), to be averaged over the global batch like the pair loss: `sequence` gives the mean
    over pairs of -log π(y_w|x) / |y_w| (Pang et al. 2024, OpenRLHF); `token` divides by the mean chosen length of the
    global batch, so the average is the summed NLL over all its chosen tokens / their count (TRL's cross-entropy)."""
    return -logps_chosen / (len_chosen if normalization == "sequence" else tokens_per_pair)


def lr_at(step: int, args: Args) -> float:
    """Linear warmup, then cosine to lr * min_lr_ratio."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + np.cos(np.pi * min(1.0, progress))))


# ---------------------------------------------------------------------------------------------------------------------
# main


def main(args: Args):
    # ---- flags (before any heavy work), sizes, distributed setup, seeds
    if args.model == "runs/sft/latest" and not os.path.isfile(os.path.join(args.model, "model.safetensors")):
        raise RunError("no SFT model at 'runs/sft/latest': run `python sft.py` (or `python pipeline.py`) first, or pass --model DIR")  # fmt: skip
    if args.loss_type not in DPO_LOSSES or args.rpo_normalization not in ("sequence", "token"):
        raise RunError(f"unknown --loss_type '{args.loss_type}' or --rpo_normalization '{args.rpo_normalization}': use "
                       f"one of {', '.join(DPO_LOSSES)} and sequence or token")  # fmt: skip
    args.beta = DPO_BETA.get(args.loss_type, 0.1) if args.beta is None else args.beta
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5:
        raise RunError(f"--beta {args.beta} must be > 0 and --label_smoothing {args.label_smoothing} in [0, 0.5)")
    if args.label_smoothing and args.loss_type not in ("sigmoid", "dpo_norm", "simpo"):
        raise RunError("--label_smoothing smooths a sigmoid loss: use --loss_type sigmoid, dpo_norm or simpo")
    rank, world_size, device = setup_distributed()
    master = rank == 0
    local_batch_size = exact_div(args.batch_size, world_size, "--batch_size must divide by the number of ranks")
    grad_accum = exact_div(local_batch_size, args.micro_batch_size, "per-rank batch (--batch_size / ranks) must divide by --micro_batch_size")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)

    # ---- data
    meta = data.load_meta(args.data)
    train, test = data.load_split(args.data, "pref_train"), data.load_split(args.data, "pref_test")
    prompts = data.load_split(args.data, "prompt_test") if meta.get("task") else None
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    n_train = min(args.max_train_pairs or len(train["query"]), len(train["query"]))
    n_test = min(args.eval_size, len(test["query"]))
    if n_train < args.batch_size:
        raise RunError(f"{n_train} training pairs (pref_train, --max_train_pairs) are fewer than --batch_size "
                       f"{args.batch_size}: lower it or raise --max_train_pairs")  # fmt: skip

    # ---- policy; the run dir is claimed before the reference pass, so a busy --out_dir fails at once
    model = gpt2.load_model(args.model, vocab_size=meta["vocab_size"])
    longest = train["query"].shape[1] + max(train["chosen"].shape[1], train["rejected"].shape[1])
    if longest > model.config.block_size:
        raise RunError(f"prompt + response ({longest} tokens) exceed the model context {model.config.block_size}: "
                       "prep with a smaller --max_query_len / --max_response_len")  # fmt: skip
    model.to(device)
    args.out_dir = start_run(args, "dpo", master)

    # ---- reference log-probs of every pair, computed once by the unsharded starting policy (or --ref_model)
    ref_train = torch.zeros(n_train, 2, dtype=torch.float64, device=device)  # log π_ref = 0 when reference-free
    ref_test = torch.zeros(n_test, 2, dtype=torch.float64, device=device)
    if not (args.reference_free or args.loss_type == "simpo"):
        ref = gpt2.load_model(args.ref_model, vocab_size=meta["vocab_size"]).to(device) if args.ref_model else model
        if master:
            print(f"reference log-probs of {n_train} train and {n_test} eval pairs (once, before step 0)", flush=True)
        ref_train = reference_logprobs(ref, train, n_train, args.micro_batch_size, pad, eos, rank, world_size, device, ctx)
        ref_test = reference_logprobs(ref, test, n_test, args.micro_batch_size, pad, eos, rank, world_size, device, ctx)
        del ref

    # ---- shard, optimizer, resume
    model.activation_checkpointing = args.activation_checkpointing
    if dist.is_initialized():
        shard_model(model, device, bf16)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    # fused: one kernel for all parameters, on CPU as on CUDA (see docs/benchmarks.md)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip
    forward_model = torch.compile(model) if args.compile else model
    state = load_checkpoint(args.out_dir, model, optimizer, master) if args.resume else None
    start_step = state["step"] if state else 0
    stop = {"now": False}  # SIGTERM (a cluster's preemption): finish the step, save a checkpoint, exit
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    def lengths(response):  # (B,) response tokens up to and including the stop token
        return response_mask(response, eos).sum(1)

    def evaluate() -> dict:
        """On pref_test: the pair loss, preference accuracy (r_chosen > r_rejected), reward margin and likelihood
        accuracy (log π(chosen) > log π(rejected)); with a verifier, greedy accuracy on prompt_test."""
        model.eval()
        n = n_test // world_size * world_size  # equal shares: FSDP2 needs every rank in every forward
        idx, sums = np.arange(rank, n, world_size), dict(loss=0.0, correct=0.0, margin=0.0, logps_correct=0.0)
        with torch.no_grad():
            for i in progress(range(0, len(idx), args.micro_batch_size), "eval loss", master):
                j = idx[i : i + args.micro_batch_size]
                q, c, r = pair_tensors(test, j, device)
                logp_c, logp_r = pair_logprobs(model, q, c, r, pad, eos, ctx)
                ref = ref_test[torch.from_numpy(j).to(device)].float()  # (b, 2)
                loss, r_c, r_r = pair_loss(logp_c, logp_r, ref[:, 0], ref[:, 1], lengths(c), lengths(r), args)
                for k, v in zip(sums, (loss.sum(), (r_c > r_r).sum(), (r_c - r_r).sum(), (logp_c > logp_r).sum())):
                    sums[k] += v
        sums = {k: v / max(n, 1) for k, v in reduce_sums(sums, device).items()}
        out = {"eval/loss": sums["loss"], "eval/preference_accuracy": sums["correct"],
               "eval/rewards_margins": sums["margin"], "eval/logps_accuracy": sums["logps_correct"]}  # fmt: skip
        if prompts is not None:
            out["eval/accuracy"] = greedy_accuracy(model, prompts, meta, args.eval_size, args.micro_batch_size,
                                                   args.response_length, rank, world_size, device, ctx)  # fmt: skip
        model.train()
        return out

    if state is None:  # the starting policy's numbers: DPO's baseline (loss ln 2 when π = π_ref)
        log_metrics(args.out_dir, 0, evaluate(), SHOW, master)

    # ---- training loop: one permutation of the pairs per epoch from (seed, epoch), identical on every rank; rank r
    # takes its contiguous slice of each global batch, so any number of ranks sees the same global batches
    steps_per_epoch = n_train // args.batch_size
    perm_cache = {}
    t0, tokens = time.time(), 0
    model.train()
    for step in range(start_step, args.total_steps):
        epoch, k = divmod(step, steps_per_epoch)
        if epoch not in perm_cache:
            perm_cache = {epoch: np.random.default_rng([args.seed, epoch]).permutation(n_train)}
        batch_idx = perm_cache[epoch][k * args.batch_size : (k + 1) * args.batch_size]
        local_idx = batch_idx[rank * local_batch_size : (rank + 1) * local_batch_size]
        b_query, b_chosen, b_rejected = pair_tensors(train, local_idx, device)
        b_ref = ref_train[torch.from_numpy(local_idx).to(device)].float()  # (local_batch_size, 2)
        # 1. RPO's token mean is over the chosen tokens of the global batch: the same on 1 or N ranks
        chosen_tokens_per_pair = all_reduce(lengths(b_chosen).sum().float()) / args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        # 2. forward/backward over micro-batches: policy log-probs, the pair loss (+ RPO's NLL), mean over the global
        # batch; FSDP2 reduce-scatters the gradients once, on the last micro-batch
        sums = {}
        for micro in range(grad_accum):
            s = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
            if dist.is_initialized():
                model.set_requires_gradient_sync(micro == grad_accum - 1)
            len_c, len_r = lengths(b_chosen[s]), lengths(b_rejected[s])
            logp_c, logp_r = pair_logprobs(forward_model, b_query[s], b_chosen[s], b_rejected[s], pad, eos, ctx)
            loss, r_c, r_r = pair_loss(logp_c, logp_r, b_ref[s, 0], b_ref[s, 1], len_c, len_r, args)
            nll = rpo_nll(logp_c, len_c, args.rpo_normalization, chosen_tokens_per_pair)
            loss_sum = (loss + args.rpo_alpha * nll).sum()
            # FSDP averages gradients over ranks, so scale by world_size to get the mean over the global batch
            (loss_sum * world_size / args.batch_size).backward()
            terms = dict(loss=loss_sum, nll=nll.sum(), r_chosen=r_c.sum(), r_rejected=r_r.sum(), correct=(r_c > r_r).sum(),
                         logps_chosen=logp_c.sum(), logps_rejected=logp_r.sum())  # fmt: skip
            sums = {k: sums.get(k, 0.0) + v.detach() for k, v in terms.items()}
            tokens += 2 * int((b_query[s] != pad).sum()) + int(len_c.sum() + len_r.sum())
        # 3. clip (the returned norm is the global one, before clipping) and step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        m = {k: v / args.batch_size for k, v in reduce_sums(sums, device).items()}
        if not math.isfinite(m["loss"]) or not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite loss {m['loss']} or grad norm at step {step + 1}: lower --lr; the "
                                     f"last good checkpoint is in {args.out_dir}/checkpoints (--resume)")  # fmt: skip
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # 4. log, evaluate, checkpoint
        eval_now = (step + 1) % args.eval_every == 0 or step + 1 == args.total_steps
        if (step + 1) % args.log_every == 0 or step == start_step or eval_now:
            metrics = {"train/loss": m["loss"], "rewards/chosen": m["r_chosen"], "rewards/rejected": m["r_rejected"],
                       "rewards/margins": m["r_chosen"] - m["r_rejected"], "rewards/accuracies": m["correct"],
                       "logps/chosen": m["logps_chosen"], "logps/rejected": m["logps_rejected"],
                       "train/grad_norm": grad_norm.item(), "train/lr": lr_at(step, args),
                       "perf/tokens_per_sec": all_reduce(torch.tensor(float(tokens), device=device)).item() / (time.time() - t0)}  # fmt: skip
            if args.rpo_alpha:
                metrics["train/nll"] = m["nll"]
            if eval_now:
                metrics |= evaluate()
            log_metrics(args.out_dir, step + 1, metrics, SHOW, master)
            t0, tokens = time.time(), 0
        if eval_now or stop["now"]:
            save_checkpoint(args.out_dir, step + 1, model, optimizer, args.keep_checkpoints)
        if stop["now"]:
            raise RunError(f"SIGTERM: saved a checkpoint at step {step + 1}; continue with --resume --out_dir {args.out_dir}")

    # ---- save the final policy in the HF GPT-2 layout, teardown
    sd = gpt2.full_state_dict(model)
    if master:
        gpt2.save_model(sd, model.config, args.out_dir)
        print(f"saved {args.out_dir}/model.safetensors", flush=True)
    finish_run(args, "dpo", master)


SHOW = ("train/loss", "rewards/margins", "eval/preference_accuracy", "eval/accuracy", "perf/tokens_per_sec")


# ---------------------------------------------------------------------------------------------------------------------
# Data, the reference pass, and the evaluation shared with sft.py, ppo.py and grpo.py


def pair_tensors(split: dict, idx, device) -> list:
    """Rows idx of a preference split as [query, chosen, rejected] tensors on device."""
    return [torch.from_numpy(split[k][idx]).to(device) for k in ("query", "chosen", "rejected")]


@torch.no_grad()
def reference_logprobs(model, split, n, batch, pad_token_id, eos_token_id, rank, world_size, device, ctx):
    """log π_ref of the chosen and rejected responses of the first n pairs of a split, (n, 2) float64 on every rank.
    `model` is plain (unsharded) on every rank: each rank scores a contiguous share, one all-reduce gathers them."""
    was_training = model.training
    model.eval()
    out, share = torch.zeros(n, 2, dtype=torch.float64, device=device), -(-n // world_size)
    lo, hi = rank * share, min(n, (rank + 1) * share)
    for i in progress(range(lo, hi, batch), f"reference log-probs, batches of {batch} pairs", rank == 0):
        j = slice(i, min(i + batch, hi))
        out[j] = torch.stack(pair_logprobs(model, *pair_tensors(split, j, device), pad_token_id, eos_token_id, ctx), 1)
    model.train(was_training)
    return all_reduce(out)


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
