"""Shared data prep and loading.

Every algorithm file reads its data through `load_split` and `load_meta`. A dataset is either the
built-in offline task (`arithmetic`, made in memory in a second) or a directory written by a prep
entry point (under runs/data/, which git ignores), holding `meta.json` and one `.npz` per split:

    sft_{train,test}.npz     query (N, Tq) left-padded, response (N, Tr) ending in the stop token,
                             then right-padded
    pref_{train,test}.npz    query, chosen, rejected (responses as above)
    prompt_{train,test}.npz  query, ground_truth (strings; empty where a task has none)

meta.json: tokenizer (`bytes`, `gpt2` or a .tiktoken path relative to the dataset dir), task (the
verifier's, or null), eos_token_id (the stop token `<|endoftext|>`), pad_token_id and vocab_size.
The pad id is the stop token's unless prep was given --pad_token_id; a pad id past the tokenizer's
vocabulary makes vocab_size grow to hold it. Since pad may differ from eos, a response's real tokens
are those up to and including its first stop token, and a query's are those != pad_token_id (no
prompt may contain the pad id: prep checks).

Entry points:
    python -m data.arithmetic --out runs/data/arithmetic
    python -m data.prep {jsonl,gsm8k,hh-rlhf,tldr}
"""

import json
import os
import re
import time
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gpt2
from data.tokenizer import get_encoding, portable_name, resolve_name
from gpt2 import RunError  # a problem the user can fix: one line, no traceback

SPLITS = ("sft_train", "sft_test", "pref_train", "pref_test", "prompt_train", "prompt_test")


def pad_left(seqs: list[list[int]], pad_id: int, width: int | None = None) -> np.ndarray:
    """Queries (N, width), padded on the left.

    A prompt holding the pad id would lose that token to the query mask, so that raises.
    """
    width = width or max(map(len, seqs))
    out = np.full((len(seqs), width), pad_id, dtype=np.int32)
    for i, s in enumerate(seqs):
        if s:
            out[i, width - len(s) :] = s
    if (out == pad_id).sum() != out.size - sum(map(len, seqs)):
        raise ValueError(
            f"a prompt contains the pad id {pad_id}: pass a --pad_token_id no prompt uses "
            "(e.g. the tokenizer's vocabulary size)"
        )
    return out


def pad_right(seqs: list[list[int]], pad_id: int, width: int | None = None) -> np.ndarray:
    width = width or max(map(len, seqs))
    out = np.full((len(seqs), width), pad_id, dtype=np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def make_meta(
    tokenizer: str, out_dir: str, task: str | None, pad_token_id: int | None = None
) -> dict:
    """meta.json of a dataset written to out_dir: the tokenizer named portably, pad = the stop token
    unless given, and a vocab_size that holds the pad id."""
    enc = get_encoding(tokenizer)
    pad = enc.eot_token if pad_token_id is None else pad_token_id
    if pad < 0:
        raise ValueError(
            f"--pad_token_id {pad} is negative: pass an id >= 0 (default: the stop token's)"
        )
    return dict(
        tokenizer=portable_name(tokenizer, out_dir),
        task=task,
        pad_token_id=pad,
        eos_token_id=enc.eot_token,
        vocab_size=max(enc.n_vocab, pad + 1),
    )


def progress(items, what: str, every: float = 5.0, show: bool = True):
    """Iterate over `items`, printing `what: i/n (rate/s)` every few seconds and at the end of a
    long phase."""
    t0 = last = time.time()
    for i, item in enumerate(items):
        yield item
        now = time.time()
        if show and (now - last > every or (i + 1 == len(items) and now - t0 > every)):
            print(f"{what}: {i + 1}/{len(items)} ({(i + 1) / (now - t0):.0f}/s)", flush=True)
            last = now


def write_dataset(out_dir: str, meta: dict, splits: dict[str, dict[str, np.ndarray]]) -> None:
    """Write meta.json and one npz per split (temp file, then rename, so a killed prep never leaves
    half a file)."""
    os.makedirs(out_dir, exist_ok=True)
    for name, arrays in splits.items():
        assert name in SPLITS, name
        np.savez(os.path.join(out_dir, name + ".tmp.npz"), **arrays)
        os.replace(os.path.join(out_dir, name + ".tmp.npz"), os.path.join(out_dir, name + ".npz"))
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    sizes = ", ".join(f"{k} {len(next(iter(v.values())))}" for k, v in splits.items())
    print(f"wrote {out_dir}: {sizes}")


@lru_cache(maxsize=4)
def _builtin(name: str):
    from data import arithmetic

    if name != "arithmetic":
        raise ValueError(f"unknown built-in dataset '{name}'")
    return arithmetic.META, arithmetic.build()


def _check_dir(data: str) -> None:
    if data != "arithmetic" and not os.path.isfile(os.path.join(data, "meta.json")):
        raise RunError(
            f"no dataset at '{data}' (meta.json missing): use --data arithmetic or a directory "
            "written by `python -m data.prep` / `python -m data.arithmetic --out DIR`"
        )


def load_meta(data: str) -> dict:
    """tokenizer (a name or a path get_encoding takes), task, pad_token_id, eos_token_id,
    vocab_size."""
    _check_dir(data)
    if data == "arithmetic":
        return dict(_builtin(data)[0])
    try:
        with open(os.path.join(data, "meta.json")) as f:
            meta = json.load(f)
        return dict(meta, tokenizer=resolve_name(meta["tokenizer"], data))
    except (ValueError, KeyError) as e:
        raise RunError(f"{data}/meta.json is damaged ({e!r}): prep the dataset again") from None


def eval_split(data: str, split: str, size: int) -> dict[str, np.ndarray] | None:
    """The first `size` rows of an optional eval split (pref_test for the preference accuracy), or
    None where the dataset has no such split or size is 0."""
    _check_dir(data)
    path = os.path.join(data, split + ".npz")
    there = split in _builtin(data)[1] if data == "arithmetic" else os.path.isfile(path)
    return {k: v[:size] for k, v in load_split(data, split).items()} if there and size else None


def load_split(data: str, split: str) -> dict[str, np.ndarray]:
    """The arrays of one split, e.g. load_split("arithmetic", "sft_train")["query"]."""
    _check_dir(data)
    if data == "arithmetic":
        splits = _builtin(data)[1]
        if split not in splits:
            raise RunError(f"split '{split}' not in dataset '{data}'")
        return splits[split]
    path = os.path.join(data, split + ".npz")
    if not os.path.isfile(path):
        raise RunError(
            f"dataset '{data}' has no split '{split}' ({path} missing): prep it with data.prep"
        )
    try:
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    except Exception as e:  # numpy and zipfile raise many kinds on a damaged file
        raise RunError(
            f"cannot read {path} ({e.__class__.__name__}): prep the dataset again"
        ) from None


def exact_div(a: int, b: int, flags: str) -> int:
    """a / b for batch sizes that must divide: else a one-line error naming the flags to change."""
    if b <= 0 or a % b:
        raise RunError(f"{a} does not divide by {b}: change {flags}")
    return a // b


def check_context(split: dict, block_size: int, response_length: int = 0) -> None:
    """A one-line error where a prompt and its longest response (or response_length new tokens)
    would not fit in the model's context."""
    responses = [v.shape[1] for k, v in split.items() if k in ("response", "chosen", "rejected")]
    length = split["query"].shape[1] + max(responses + [response_length])
    if length > block_size:
        fix = "lower --response_length or prep shorter data"
        raise RunError(f"prompt + response ({length} tokens) exceed the model's context: {fix}")


def batch_indices(seed: int, step: int, n: int, batch_size: int) -> np.ndarray:
    """Rows of the global batch of a step: one permutation of the n rows per epoch, keyed by (seed,
    epoch) and cut into n // batch_size batches, so any number of ranks sees the same batches.
    Every key ends in a nonzero stream tag: numpy ignores trailing zeros ([seed, 0] is [seed])."""
    epoch, k = divmod(step, n // batch_size)
    return np.random.default_rng([seed, epoch, 1]).permutation(n)[k * batch_size :][:batch_size]


# --------------------------------------------------------------------------------------------------
# Verifiers: reward 1.0 for a correct final answer, else 0.0


def _last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].replace(",", "") if nums else None


def verify(task: str, response: str, ground_truth: str) -> float:
    """The task's reward for one decoded response (text before the stop token)."""
    # arithmetic: the spaces that right-align the number in a column are not part of the answer
    if task == "arithmetic":
        return float(response.strip() == ground_truth)
    if task == "gsm8k":  # the last number in the response, compared as a number
        got = _last_number(response)
        try:
            return float(
                got is not None and abs(float(got) - float(ground_truth.replace(",", ""))) < 1e-6
            )
        except ValueError:
            return 0.0
    raise RunError(f"task '{task}' has no verifier: use a reward model (--reward_model) instead")


def verify_batch(meta: dict, responses: list[list[int]], ground_truth) -> list[float]:
    """The verifier's rewards of token-id responses, each decoded up to its first stop token."""
    enc, eos = get_encoding(meta["tokenizer"]), meta["eos_token_id"]
    texts = [enc.decode(r[: r.index(eos)] if eos in r else r) for r in responses]
    return [verify(meta["task"], t, str(gt)) for t, gt in zip(texts, ground_truth)]


@torch.no_grad()
def greedy_accuracy(model, prompts, meta, eval_size, batch_size, response_length, ctx) -> float:
    """Fraction of the first eval_size prompts of a split whose greedy response the task's verifier
    accepts, over all ranks. Each rank takes an equal strided share: FSDP2 needs every rank in
    every forward."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    n = min(eval_size, len(prompts["query"])) // world_size * world_size
    idx, correct, device = np.arange(rank, n, world_size), 0.0, next(model.parameters()).device
    length = min(response_length, model.config.block_size - prompts["query"].shape[1])
    was_training = model.training
    model.eval()
    for i in progress(range(0, len(idx), batch_size), "eval accuracy", show=rank == 0):
        j = idx[i : i + batch_size]
        query = torch.from_numpy(prompts["query"][j]).to(device)
        with ctx:
            rollout = gpt2.generate(
                model, query, meta["pad_token_id"], length, meta["eos_token_id"], 0.0
            )
        correct += sum(verify_batch(meta, rollout.response.tolist(), prompts["ground_truth"][j]))
    model.train(was_training)
    correct = torch.tensor(correct, device=device)
    if dist.is_initialized():
        dist.all_reduce(correct)
    return correct.item() / max(n, 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased pass@k of a prompt with c correct of n samples, 1 - C(n-c, k) /
    C(n, k), in their product form: no binomial grows past a float."""
    if not (0 < k <= n and 0 <= c <= n):
        raise ValueError(f"pass@{k} of {c} correct in {n} samples: need 0 < k <= n, 0 <= c <= n")
    if n - c < k:  # every set of k samples holds a correct one
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


EVAL_STREAM = 10**9  # sampled_accuracy's noise is keyed by [seed, EVAL_STREAM]: past any step


@torch.no_grad()
def sampled_accuracy(
    model, prompts, meta, eval_size, batch_size, response_length, ctx, samples, temperature, seed
) -> dict:
    """eval/pass@k (k = 1, 2, 4, ... up to samples, and samples) and eval/mean@samples of `samples`
    responses per prompt at `temperature`, over the first eval_size prompts of a split and all ranks
    (equal strided shares, as greedy_accuracy). Prompt p's uniforms are row p of one global array
    keyed by (seed, EVAL_STREAM): any rank count samples the same responses, every eval alike."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    n = min(eval_size, len(prompts["query"])) // world_size * world_size
    idx, device = np.arange(rank, n, world_size), next(model.parameters()).device
    length = min(response_length, model.config.block_size - prompts["query"].shape[1])
    noise = np.random.default_rng([seed, EVAL_STREAM]).random((n, samples, length), np.float32)
    # this rank's (prompt, sample) rows, batch_size at a time whatever `samples` is
    prompt, sample = np.repeat(idx, samples), np.tile(np.arange(samples), len(idx))
    correct = np.zeros(len(prompt))
    was_training = model.training
    model.eval()
    for i in progress(range(0, len(prompt), batch_size), "eval pass@k", show=rank == 0):
        p, s = prompt[i : i + batch_size], sample[i : i + batch_size]
        query = torch.from_numpy(prompts["query"][p]).to(device)
        u = torch.from_numpy(noise[p, s]).to(device)
        with ctx:
            rollout = gpt2.generate(
                model, query, meta["pad_token_id"], length, meta["eos_token_id"], temperature, u
            )
        correct[i : i + len(p)] = verify_batch(
            meta, rollout.response.tolist(), prompts["ground_truth"][p]
        )
    model.train(was_training)
    ks = sorted({2**i for i in range(samples.bit_length())} | {samples})
    per_prompt = [
        [pass_at_k(samples, int(c), k) for k in ks] + [c / samples]
        for c in correct.reshape(len(idx), samples).sum(1)
    ]
    sums = torch.tensor(np.sum(per_prompt, 0) if per_prompt else [0.0] * (len(ks) + 1))
    sums = sums.to(device, torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)
    names = [f"eval/pass@{k}" for k in ks] + [f"eval/mean@{samples}"]
    return dict(zip(names, (sums / max(n, 1)).tolist()))


# --------------------------------------------------------------------------------------------------
# Scored responses: the summed log-probs of a split's responses (the SFT eval loss, DPO's pairs),
# and the implicit reward's accuracy on preference pairs (every policy against its reference)

PAIR = ("chosen", "rejected")  # a preference split's responses to each query
RESPONSE = ("response",)  # an SFT split's


def split_tensors(split, idx, device, keys=PAIR) -> list[torch.Tensor]:
    """Rows idx of a split as [query, *responses] tensors on device."""
    return [torch.from_numpy(split[k][idx]).to(device) for k in ("query", *keys)]


def response_lengths(split, n, eos_token_id, keys=PAIR) -> torch.Tensor:
    """(n, R): tokens of the first n responses of each key, up to and including the stop."""
    masks = [gpt2.response_mask(torch.from_numpy(split[k][:n]), eos_token_id) for k in keys]
    return torch.stack([m.sum(1) for m in masks], 1)


def response_logprobs(model, query, *responses) -> torch.Tensor:
    """log π (B, R) of R responses to each query (B, Tq), each summed up to and including its stop
    token: one gpt2.logprobs call on R·B rows padded to one width (pad and stop ids are
    model.config's). Differentiable; call it under the autocast context."""
    pad, width = model.config.pad_token_id, max(r.size(1) for r in responses)
    padded = [F.pad(r, (0, width - r.size(1)), value=pad) for r in responses]
    logprobs = gpt2.logprobs(model, query.repeat(len(responses), 1), torch.cat(padded))[0]
    return logprobs.sum(1).view(len(responses), -1).T


@torch.no_grad()
def split_logprobs(model, split, n, batch_size, ctx, keys=PAIR) -> torch.Tensor:
    """response_logprobs (n, R) of a split's first n rows, on every rank. Each rank scores an equal
    share, the last row again past the end: FSDP2 needs every rank in every forward."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device, share = next(model.parameters()).device, -(-n // world_size)
    out, was_training = torch.zeros(n, len(keys), device=device), model.training
    model.eval()
    for i in progress(range(0, share, batch_size), "log-probs", show=rank == 0):
        idx = np.arange(rank * share + i, rank * share + min(i + batch_size, share))
        batch = split_tensors(split, idx.clip(max=n - 1), device, keys)  # query, *responses
        with ctx:
            logps = response_logprobs(model, *batch)
        out[idx[idx < n]] = logps[: (idx < n).sum()]
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(out)
    return out


def preference_accuracy(logps, ref_logps) -> float:
    """The share of pairs whose implicit reward r = log π - log π_ref (from (B, 2) chosen, rejected
    log-probs) ranks the chosen response first, a tie counting half: a policy equal to its
    reference scores 0.5 exactly. DPO's β > 0 scales r, so it cannot flip a ranking."""
    r = logps - ref_logps
    return ((r[:, 0] > r[:, 1]).double() + 0.5 * (r[:, 0] == r[:, 1]).double()).mean().item()
