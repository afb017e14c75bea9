"""Reward modelling: GPT-2 with a scalar head, trained on preference pairs with the Bradley–Terry loss.

Ziegler et al. 2019 ("Fine-tuning language models from human preferences", lm-human-preferences), Stiennon et al. 2020
and Ouyang et al. 2022 (InstructGPT) start the reward model from the SFT policy with a linear `score` head (init
N(0, 1/sqrt(n_embd + 1)), bias 0) read at the response's first stop token, and train it on pairs with
-log σ(r_chosen - r_rejected). Here optionally with a constant `--margin` (Llama 2 uses per-pair ones) and
+ `--center_rewards_coef` * (r_chosen + r_rejected)^2, which keeps rewards near 0 (TRL's center_rewards_coefficient).
The loss is a mean over the global batch of pairs, so 1 rank and N ranks (and any micro-batch split) take the same step.

Then, as in lm-human-preferences, the rewards are normalised: the `--model` policy (the SFT model PPO starts from)
answers `--norm_samples` pref_train prompts, and gain = 1/std, bias = -mean/std of their scores go into config.json
(`reward_gain`, `reward_bias`), so PPO and GRPO start from rewards of mean 0 and std 1. The samples are drawn at
`--norm_temperature`, which must be the temperature PPO samples at (ppo.py --temperature, 0.7 by default; pipeline.py
passes the same value to both): lm-human-preferences normalises on the policy's own samples, and the scores of
temperature-1 samples have another mean and spread than those PPO will score. Deviation: lm-human-preferences can also
normalise before training; here only after. The model is the HF GPT-2 layout plus `score.weight` (1, n_embd) and
`score.bias` (1,); `load_reward_model` (copied into ppo.py and grpo.py) reads it.

    python reward.py                                       # from runs/sft/latest (python sft.py), the offline task
    torchrun --nproc_per_node=2 reward.py                  # the same run, FSDP2 over 2 ranks (gloo on CPU, nccl on GPU)
    python reward.py --total_steps 3 --max_train_pairs 64 --eval_size 64 --norm_samples 64  # a smoke run of seconds
    python reward.py --model runs/sft/<run> --data data/hh --lr 5e-6 --batch_size 64 --micro_batch_size 8
    python reward.py --resume --out_dir runs/reward/<run>  # continue a run from its last checkpoint

Each run writes a fresh `runs/reward/<time>-s<seed>/` (model, checkpoints, args.json, metrics.jsonl);
`runs/reward/latest` links to the last finished one, where ppo.py and grpo.py look. The plumbing section at the bottom
(identical in every script) holds torchrun setup, run directories, atomic checkpoints and one-line errors.
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
import torch.nn as nn
import torch.nn.functional as F
import tyro

import data
import gpt2


@dataclass
class Args:
    model: str = "runs/sft/latest"
    """the SFT model the reward model starts from and whose samples set the normalisation (`tiny` = random init)"""
    data: str = "arithmetic"
    """`arithmetic` (the built-in offline task) or a directory with pref_{train,test} from `python -m data.prep`"""
    out_dir: str = ""
    """run directory; default a fresh runs/reward/<time>-s<seed>, linked as runs/reward/latest when it finishes"""
    overwrite: bool = False
    """delete the run already in --out_dir and start afresh"""
    resume: bool = False
    """continue the run in --out_dir from its last complete checkpoint"""
    seed: int = 1
    """seed for the head init, data order and normalisation samples (identical on every rank)"""
    lr: float = 1e-3
    """peak learning rate (1e-3 suits the tiny model: at 3e-4 held-out accuracy was still climbing at 0.89 after 1500
    steps on seed 1; use ~5e-6 for pretrained GPT-2)"""
    warmup_steps: int = 20
    """linear warmup steps, then cosine decay to lr * min_lr_ratio"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (not on biases, LayerNorms)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold on the global gradient norm"""
    total_steps: int = 3000
    """optimizer steps (96 epochs of the offline task's 2000 pairs). Why so many: the off-by-one near misses are learnt
    late, at step 500-1250 in our runs, and a 1000-step cosine schedule had decayed the lr before then in many runs
    (accuracy stuck at ~0.84); with 3000 every run we tried reached 0.998-1.0 (docs/results.md)"""
    batch_size: int = 64
    """preference pairs per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """pairs per forward pass on one rank (2x sequences: chosen and rejected together)"""
    max_train_pairs: int = 0
    """train on the first N pref_train pairs only (0 = all): with few steps, a smoke run of seconds"""
    margin: float = 0.0
    """constant margin m in -log σ(r_chosen - r_rejected - m)"""
    center_rewards_coef: float = 0.0
    """coefficient of mean((r_chosen + r_rejected)^2), which keeps rewards centred at 0 (TRL uses 0.01)"""
    norm_samples: int = 512
    """policy samples whose scores set the normalisation gain and bias (0 = no normalisation: gain 1, bias 0)"""
    norm_temperature: float = 0.7
    """sampling temperature of the normalisation samples: PPO's --temperature, so PPO's rewards get mean 0 and std 1"""
    response_length: int = 16
    """max new tokens of the normalisation samples (PPO's --response_length)"""
    eval_every: int = 250
    """steps between evals (and checkpoints)"""
    eval_size: int = 500
    """held-out pref_test pairs for eval loss and accuracy"""
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


# ---------------------------------------------------------------------------------------------------------------------
# The reward model (ScalarModel, load_reward_model and get_reward are copied verbatim into ppo.py and grpo.py)


class ScalarModel(gpt2.GPT):
    """GPT-2 with a scalar head: forward(query_response, attention_mask, keep_from=0) -> scores (B, T - keep_from),
    gain * score(h) + bias at the positions from keep_from on (get_reward asks for the response's only).

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

    def forward(self, query_response, attention_mask, keep_from: int = 0, shared_prefix: int = 0):
        hidden = super().forward(query_response, attention_mask=attention_mask, return_hidden=True, keep_from=keep_from,
                                 shared_prefix=shared_prefix)  # fmt: skip
        return self.score(hidden).squeeze(-1).float() * self.reward_gain + self.reward_bias  # (B, T - keep_from)


def load_reward_model(path: str) -> ScalarModel:
    """A reward model written by reward.py: backbone + `score.*` head, gain and bias from its config.json."""
    tensors, meta = gpt2.read_checkpoint(path)
    if "score.weight" not in tensors or "score.bias" not in tensors:
        raise ValueError(f"'{path}' has no reward head (score.weight, score.bias): pass a model written by reward.py")
    model = ScalarModel(gpt2.from_hf_state_dict(tensors, meta), meta.get("reward_gain", 1.0), meta.get("reward_bias", 0.0))
    model.score.load_state_dict({"weight": tensors["score.weight"], "bias": tensors["score.bias"]})
    return model


def get_reward(model, query, response, pad_token_id: int, eos_token_id: int):
    """Reward (B,) of each left-padded query (B, Tq) + response (B, Tr): the score at the response's first stop token
    (its last token when it has none). Tokens after the stop token are masked whatever they are (pad may differ from
    eos), so a response is scored the same however it is padded."""
    mask = response_mask(response, eos_token_id)  # (B, Tr) up to and including the stop token
    attention_mask = torch.cat([query != pad_token_id, mask], 1)
    # a prompt several rows share (a preference pair's, a GRPO group's) runs once: gpt2.GPT.forward's shared_prefix
    query_response, Tq = torch.cat([query, response], 1), query.size(1)
    scores = model(query_response, attention_mask, keep_from=Tq, shared_prefix=Tq)  # (B, Tr)
    return scores.gather(1, mask.sum(1, keepdim=True) - 1).squeeze(1)


# ---------------------------------------------------------------------------------------------------------------------
# Training: the Bradley–Terry loss on pairs, and the normalisation of lm-human-preferences


def preference_loss(r_chosen, r_rejected, margin: float = 0.0, center_coef: float = 0.0):
    """Per-pair Bradley–Terry loss (B,): -log σ(r_chosen - r_rejected - margin) + center_coef (r_chosen + r_rejected)^2
    (its batch mean is TRL's loss with a constant margin and center_rewards_coefficient)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin) + center_coef * (r_chosen + r_rejected) ** 2


def pair_rewards(model, query, chosen, rejected, pad_token_id: int, eos_token_id: int, ctx):
    """Rewards (B,), (B,) of the chosen and rejected responses to the same queries, in one forward pass of 2B rows."""
    width = max(chosen.size(1), rejected.size(1))
    response = torch.cat([F.pad(r, (0, width - r.size(1)), value=pad_token_id) for r in (chosen, rejected)])  # (2B, Tr)
    query, response = trim_padding(query.repeat(2, 1), response, pad_token_id, eos_token_id)
    with ctx:
        return get_reward(model, query, response, pad_token_id, eos_token_id).float().chunk(2)


def normalization(scores: torch.Tensor) -> tuple[float, float]:
    """(gain, bias) such that gain * scores + bias has mean 0 and std 1 over scores (N,) (population std)."""
    mean, std = scores.double().mean(), scores.double().std(correction=0)
    if not std > 1e-8:
        raise FloatingPointError(f"the normalisation samples all score {mean.item():.4g}: the reward model is "
                                 "constant; train longer or with another --lr, or pass --norm_samples 0")  # fmt: skip
    return 1.0 / std.item(), -(mean / std).item()


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
    rank, world_size, device = setup_distributed()
    master = rank == 0
    local_batch_size = exact_div(args.batch_size, world_size, "--batch_size must divide by the number of ranks")
    grad_accum = exact_div(local_batch_size, args.micro_batch_size, "per-rank batch (--batch_size / ranks) must divide by --micro_batch_size")
    exact_div(args.norm_samples or world_size, world_size, "--norm_samples must divide by the number of ranks")
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    torch.manual_seed(args.seed)  # the score head's init (and a `tiny` backbone's), the same on every rank

    # ---- data
    meta = data.load_meta(args.data)
    train, test = data.load_split(args.data, "pref_train"), data.load_split(args.data, "pref_test")
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    n_train = min(args.max_train_pairs or len(train["query"]), len(train["query"]))
    if n_train < args.batch_size:
        raise RunError(f"{n_train} training pairs (pref_train, --max_train_pairs) are fewer than --batch_size "
                       f"{args.batch_size}: lower it or raise --max_train_pairs")  # fmt: skip

    # ---- model: the SFT backbone + a fresh scalar head; optimizer
    model = ScalarModel(gpt2.load_model(args.model, vocab_size=meta["vocab_size"]))
    longest = train["query"].shape[1] + max(train["chosen"].shape[1], train["rejected"].shape[1])
    if longest > model.config.block_size:
        raise RunError(f"prompt + response ({longest} tokens) exceed the model context {model.config.block_size}: "
                       "prep with a smaller --max_query_len / --max_response_len")  # fmt: skip
    if args.norm_samples and train["query"].shape[1] + args.response_length > model.config.block_size:
        raise RunError(f"prompt ({train['query'].shape[1]}) + --response_length ({args.response_length}) tokens "
                       f"exceed the model context {model.config.block_size}: lower --response_length")  # fmt: skip
    model.activation_checkpointing = args.activation_checkpointing
    model.to(device)
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
    args.out_dir = start_run(args, "reward", master)
    state = load_checkpoint(args.out_dir, model, optimizer, master) if args.resume else None
    start_step = state["step"] if state else 0
    if state:  # the final checkpoint holds the normalisation: resuming a finished run keeps it
        model.reward_gain, model.reward_bias = state.get("reward_gain", 1.0), state.get("reward_bias", 0.0)
    stop = {"now": False}  # SIGTERM (a cluster's preemption): finish the step, save a checkpoint, exit
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    # ---- training loop
    steps_per_epoch = n_train // args.batch_size
    perm_cache = {}
    t0, tokens = time.time(), 0
    model.train()
    for step in range(start_step, args.total_steps):
        # 1. the global batch of pairs: one permutation per epoch from (seed, epoch), identical on every rank; rank r
        # takes its contiguous slice, so any number of ranks sees the same global batches
        epoch, k = divmod(step, steps_per_epoch)
        if epoch not in perm_cache:
            perm_cache = {epoch: np.random.default_rng([args.seed, epoch]).permutation(n_train)}
        batch_idx = perm_cache[epoch][k * args.batch_size : (k + 1) * args.batch_size]
        local_idx = batch_idx[rank * local_batch_size : (rank + 1) * local_batch_size]
        b_query, b_chosen, b_rejected = pair_tensors(train, local_idx, device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)

        # 2. rewards of the chosen and rejected responses, Bradley–Terry loss, backward over micro-batches (FSDP2
        # reduce-scatters the gradients once, on the last one)
        sums = dict(loss=0.0, correct=0.0, chosen=0.0, rejected=0.0)
        for micro in range(grad_accum):
            s = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
            if dist.is_initialized():
                model.set_requires_gradient_sync(micro == grad_accum - 1)
            r_chosen, r_rejected = pair_rewards(forward_model, b_query[s], b_chosen[s], b_rejected[s], pad, eos, ctx)
            loss = preference_loss(r_chosen, r_rejected, args.margin, args.center_rewards_coef).sum()
            # the mean over the global batch; FSDP averages gradients over ranks, so scale by world_size
            (loss * world_size / args.batch_size).backward()
            mb_sums = dict(loss=loss, correct=(r_chosen > r_rejected).sum(), chosen=r_chosen.sum(),
                           rejected=r_rejected.sum())  # fmt: skip
            sums = {name: sums[name] + v.detach().float() for name, v in mb_sums.items()}
            n_response = response_mask(b_chosen[s], eos).sum() + response_mask(b_rejected[s], eos).sum()
            tokens += 2 * int((b_query[s] != pad).sum()) + int(n_response)

        # 3. clip (the returned norm is the global one, before clipping) and step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        means = {name: v / args.batch_size for name, v in reduce_sums(sums, device).items()}  # over the global batch
        if not math.isfinite(means["loss"]) or not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite loss {means['loss']} or grad norm at step {step + 1}: lower --lr; "
                                     f"the last good checkpoint is in {args.out_dir}/checkpoints (--resume)")  # fmt: skip
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # 4. log and evaluate (raw rewards); after the last step, normalise the rewards on the policy's own samples
        last = step + 1 == args.total_steps
        eval_now = (step + 1) % args.eval_every == 0 or last
        if (step + 1) % args.log_every == 0 or step == start_step or eval_now:
            metrics = {"train/loss": means["loss"], "train/accuracy": means["correct"],
                       "rewards/chosen": means["chosen"], "rewards/rejected": means["rejected"],
                       "rewards/margins": means["chosen"] - means["rejected"],
                       "train/grad_norm": grad_norm.item(), "train/lr": lr_at(step, args),
                       "perf/tokens_per_sec": all_reduce(torch.tensor(float(tokens), device=device)).item() / (time.time() - t0)}  # fmt: skip
            if eval_now:
                metrics |= reward_eval(model, test, args, pad, eos, rank, world_size, device, ctx)
            if last and args.norm_samples:
                metrics |= normalize(model, train["query"][:n_train], args, meta, rank, world_size, device, ctx)
            log_metrics(args.out_dir, step + 1, metrics, SHOW, master)
            t0, tokens = time.time(), 0

        # 5. checkpoint, with the gain and bias (1 and 0 until the normalisation)
        if eval_now or stop["now"]:
            gain_bias = dict(reward_gain=model.reward_gain, reward_bias=model.reward_bias)
            save_checkpoint(args.out_dir, step + 1, model, optimizer, args.keep_checkpoints, extra=gain_bias)
        if stop["now"]:
            raise RunError(f"SIGTERM: saved a checkpoint at step {step + 1}; continue with --resume --out_dir {args.out_dir}")

    # ---- save the reward model: HF GPT-2 layout + score.*, the gain and bias in config.json (load_reward_model reads
    # it in ppo.py and grpo.py), teardown
    sd = gpt2.full_state_dict(model)
    if master:
        gain_bias = dict(reward_gain=model.reward_gain, reward_bias=model.reward_bias)
        gpt2.save_model(sd, model.config, args.out_dir, extra_config=gain_bias)
        print(f"saved {args.out_dir}/model.safetensors (score head, {gain_bias})", flush=True)
    finish_run(args, "reward", master)


SHOW = ("train/loss", "train/accuracy", "eval/accuracy", "norm/gain", "perf/tokens_per_sec")  # metrics.jsonl has all


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation and normalisation (every rank takes an equal share: FSDP2 needs all ranks in every forward)


def pair_tensors(split: dict, idx, device) -> list:
    """Rows idx of a preference split as [query, chosen, rejected] tensors on device."""
    return [torch.from_numpy(split[k][idx]).to(device) for k in ("query", "chosen", "rejected")]


@torch.no_grad()
def reward_eval(model, test, args, pad, eos, rank, world_size, device, ctx) -> dict:
    """Pairwise loss and accuracy (fraction of pref_test pairs with r_chosen > r_rejected)."""
    model.eval()
    n = min(args.eval_size, len(test["query"])) // world_size * world_size
    idx, sums = np.arange(rank, n, world_size), dict(loss=0.0, correct=0.0)
    for i in progress(range(0, len(idx), args.micro_batch_size), "eval pairs", rank == 0):
        r_c, r_r = pair_rewards(model, *pair_tensors(test, idx[i : i + args.micro_batch_size], device), pad, eos, ctx)
        sums["loss"] += preference_loss(r_c, r_r, args.margin, args.center_rewards_coef).sum()
        sums["correct"] += (r_c > r_r).sum()
    sums = reduce_sums(sums, device)
    model.train()
    return {"eval/loss": sums["loss"] / n, "eval/accuracy": sums["correct"] / n}


@torch.no_grad()
def normalize(model, queries, args, meta, rank, world_size, device, ctx) -> dict:
    """lm-human-preferences' normalisation: the --model policy answers --norm_samples of the queries (N, Tq) at
    --norm_temperature; the model's gain and bias are set so that their rewards have mean 0 and std 1, then they are
    scored again to check. Rank r samples and scores its contiguous share with uniforms sliced from one array drawn
    from (seed, "norm"): any number of ranks draws the same samples."""
    model.eval()
    n, pad, eos = args.norm_samples, meta["pad_token_id"], meta["eos_token_id"]
    rng = np.random.default_rng([args.seed, *b"norm"])  # its own stream ([seed] alone is [seed, 0]: epoch 0's order)
    queries = queries[rng.choice(len(queries), n, replace=n > len(queries))]
    noise = torch.from_numpy(rng.random((n, args.response_length), dtype=np.float32)).to(device)
    torch.manual_seed(args.seed)  # `--model tiny`: the random init the reward model's backbone started from
    policy = gpt2.load_model(args.model, vocab_size=meta["vocab_size"]).to(device).eval()  # plain, on every rank
    samples, local = [], n // world_size
    starts = range(rank * local, (rank + 1) * local, args.micro_batch_size)
    for i in progress(starts, "normalisation samples", rank == 0):
        j = slice(i, min(i + args.micro_batch_size, (rank + 1) * local))
        q = torch.from_numpy(queries[j]).to(device)
        q = q[:, min(int(first_true_indices((q != pad).any(0, keepdim=True))), q.size(1) - 1) :]
        with ctx:
            response = gpt2.generate(policy, q, pad, args.response_length, eos, args.norm_temperature, noise=noise[j])
        samples.append((j, q, response))
    del policy

    def scores():  # (N,) rewards of every rank's samples: each rank fills its share, the all-reduce the rest
        out = torch.zeros(n, dtype=torch.float64, device=device)
        for j, q, response in samples:
            with ctx:
                out[j] = get_reward(model, q, response, pad, eos).double()
        return all_reduce(out)

    raw = scores()
    model.reward_gain, model.reward_bias = normalization(raw)
    normed = scores()
    model.train()
    (raw_mean, raw_std), (mean, std) = ((x.mean().item(), x.std(correction=0).item()) for x in (raw, normed))
    return {"norm/raw_mean": raw_mean, "norm/raw_std": raw_std, "norm/gain": model.reward_gain,
            "norm/bias": model.reward_bias, "norm/mean": mean, "norm/std": std}  # fmt: skip


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
