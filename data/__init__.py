"""Shared data prep and loading.

Every algorithm file reads its data through `load_split` and `load_meta`. A dataset is
either the built-in offline task (`arithmetic`, made in memory in a second) or a
directory written by a prep entry point (under runs/data/, which git ignores), holding
`meta.json` and one `.npz` per split:

    sft_{train,test}.npz     query (N, Tq) left-padded, response (N, Tr) ending in the
                             stop token, then right-padded
    pref_{train,test}.npz    query, chosen, rejected (responses as above)
    prompt_{train,test}.npz  query, ground_truth (strings; empty where a task has none)

meta.json: tokenizer (`bytes`, `gpt2` or a .tiktoken path relative to the dataset dir),
task (the verifier's, or null), eos_token_id (the stop token `<|endoftext|>`),
pad_token_id and vocab_size. The pad id is the stop token's unless prep was given
--pad_token_id; a pad id past the tokenizer's vocabulary makes vocab_size grow to hold
it. Since pad may differ from eos, a response's real tokens are those up to and
including its first stop token, and a query's are those != pad_token_id (no prompt may
contain the pad id: prep checks).

Entry points:
    python -m data.arithmetic --out runs/data/arithmetic
    python -m data.prep {jsonl,gsm8k,hh-rlhf,tldr}
"""

import json
import math
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

# RunError is a problem the user can fix: it prints one line, no traceback.
from gpt2 import RunError

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
    pads_written = out.size - sum(map(len, seqs))
    if (out == pad_id).sum() != pads_written:
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
    """meta.json of a dataset written to out_dir: the tokenizer named portably, pad = the
    stop token unless given, and a vocab_size that holds the pad id."""
    enc = get_encoding(tokenizer)
    if pad_token_id is None:
        pad = enc.eot_token
    else:
        pad = pad_token_id
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
    """Iterate over `items`, printing `what: i/n (rate/s)` every few seconds and at the end
    of a long phase."""
    t0 = last = time.time()
    for i, item in enumerate(items):
        yield item
        now = time.time()
        done = i + 1
        is_due = now - last > every
        ends_long_phase = done == len(items) and now - t0 > every
        if show and (is_due or ends_long_phase):
            rate = done / (now - t0)
            print(f"{what}: {done}/{len(items)} ({rate:.0f}/s)", flush=True)
            last = now


def write_dataset(out_dir: str, meta: dict, splits: dict[str, dict[str, np.ndarray]]) -> None:
    """Write meta.json and one npz per split."""
    os.makedirs(out_dir, exist_ok=True)
    for name, arrays in splits.items():
        assert name in SPLITS, name
        # A temp file, then a rename, so a killed prep never leaves half a file.
        tmp_path = os.path.join(out_dir, name + ".tmp.npz")
        np.savez(tmp_path, **arrays)
        os.replace(tmp_path, os.path.join(out_dir, name + ".npz"))
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    sizes = []
    for name, arrays in splits.items():
        first_array = next(iter(arrays.values()))
        sizes.append(f"{name} {len(first_array)}")
    print(f"wrote {out_dir}: {', '.join(sizes)}")


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
        meta, _ = _builtin(data)
        return dict(meta)
    try:
        with open(os.path.join(data, "meta.json")) as f:
            meta = json.load(f)
        tokenizer = resolve_name(meta["tokenizer"], data)
        return dict(meta, tokenizer=tokenizer)
    except (ValueError, KeyError) as e:
        raise RunError(f"{data}/meta.json is damaged ({e!r}): prep the dataset again") from None


def eval_split(data: str, split: str, size: int) -> dict[str, np.ndarray] | None:
    """The first `size` rows of an optional eval split (pref_test for the preference
    accuracy), or None where the dataset has no such split or size is 0."""
    _check_dir(data)
    if data == "arithmetic":
        _, splits = _builtin(data)
        there = split in splits
    else:
        there = os.path.isfile(os.path.join(data, split + ".npz"))
    if not (there and size):
        return None
    arrays = load_split(data, split)
    return {name: array[:size] for name, array in arrays.items()}


def load_split(data: str, split: str) -> dict[str, np.ndarray]:
    """The arrays of one split, e.g. load_split("arithmetic", "sft_train")["query"]."""
    _check_dir(data)
    if data == "arithmetic":
        _, splits = _builtin(data)
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
    # numpy and zipfile raise many kinds of error on a damaged file.
    except Exception as e:
        why = e.__class__.__name__
        raise RunError(f"cannot read {path} ({why}): prep the dataset again") from None


def exact_div(a: int, b: int, flags: str) -> int:
    """a / b for batch sizes that must divide: else a one-line error naming the flags to
    change."""
    if b <= 0 or a % b:
        raise RunError(f"{a} does not divide by {b}: change {flags}")
    return a // b


def check_context(split: dict, block_size: int, response_length: int = 0) -> None:
    """A one-line error where a prompt and its longest response (or response_length new
    tokens) would not fit in the model's context."""
    widths = [response_length]
    for name in ("response", "chosen", "rejected"):
        if name in split:
            widths.append(split[name].shape[1])
    length = split["query"].shape[1] + max(widths)
    if length > block_size:
        fix = "lower --response_length or prep shorter data"
        raise RunError(f"prompt + response ({length} tokens) exceed the model's context: {fix}")


def batch_indices(seed: int, step: int, n: int, batch_size: int) -> np.ndarray:
    """Rows of the global batch of a step: one permutation of the n rows per epoch, keyed by
    (seed, epoch) and cut into n // batch_size batches, so any number of ranks sees the
    same batches. Every key ends in a nonzero stream tag: numpy ignores trailing zeros
    ([seed, 0] is [seed])."""
    batches_per_epoch = n // batch_size
    epoch, k = divmod(step, batches_per_epoch)
    order = np.random.default_rng([seed, epoch, 1]).permutation(n)
    start = k * batch_size
    return order[start : start + batch_size]


def _rank_and_world_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --------------------------------------------------------------------------------------------------
# Verifiers: reward 1.0 for a correct final answer, else 0.0


def _last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not nums:
        return None
    return nums[-1].replace(",", "")


def verify(task: str, response: str, ground_truth: str) -> float:
    """The task's reward for one decoded response (text before the stop token)."""
    if task == "arithmetic":
        # The spaces that right-align the number in a column are not part of the answer.
        return float(response.strip() == ground_truth)
    if task == "gsm8k":
        # The last number in the response, compared as a number.
        got = _last_number(response)
        if got is None:
            return 0.0
        try:
            error = abs(float(got) - float(ground_truth.replace(",", "")))
        except ValueError:
            return 0.0
        return float(error < 1e-6)
    raise RunError(f"task '{task}' has no verifier: use a reward model (--reward_model) instead")


def verify_batch(meta: dict, responses: list[list[int]], ground_truth) -> list[float]:
    """The verifier's rewards of token-id responses, each decoded up to its first stop
    token."""
    enc = get_encoding(meta["tokenizer"])
    eos = meta["eos_token_id"]
    rewards = []
    for response, truth in zip(responses, ground_truth):
        if eos in response:
            response = response[: response.index(eos)]
        text = enc.decode(response)
        rewards.append(verify(meta["task"], text, str(truth)))
    return rewards


@torch.no_grad()
def greedy_accuracy(model, prompts, meta, eval_size, batch_size, response_length, ctx) -> float:
    """Fraction of the first eval_size prompts of a split whose greedy response the task's
    verifier accepts, over all ranks. Each rank takes an equal strided share: FSDP2 needs
    every rank in every forward."""
    rank, world_size = _rank_and_world_size()
    n = min(eval_size, len(prompts["query"])) // world_size * world_size
    idx = np.arange(rank, n, world_size)
    device = next(model.parameters()).device
    length = min(response_length, model.config.block_size - prompts["query"].shape[1])
    correct = 0.0
    was_training = model.training
    model.eval()
    for i in progress(range(0, len(idx), batch_size), "eval accuracy", show=rank == 0):
        j = idx[i : i + batch_size]
        query = torch.from_numpy(prompts["query"][j]).to(device)
        with ctx:
            rollout = gpt2.generate(
                model,
                query,
                pad_token_id=meta["pad_token_id"],
                max_new_tokens=length,
                eos_token_id=meta["eos_token_id"],
                temperature=0.0,
            )
        rewards = verify_batch(meta, rollout.response.tolist(), prompts["ground_truth"][j])
        correct += sum(rewards)
    model.train(was_training)
    correct = torch.tensor(correct, device=device)
    if dist.is_initialized():
        dist.all_reduce(correct)
    return correct.item() / max(n, 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased pass@k of a prompt with c correct of n samples,
    1 - C(n-c, k) / C(n, k), in their product form: no binomial grows past a float."""
    if not (0 < k <= n and 0 <= c <= n):
        raise ValueError(f"pass@{k} of {c} correct in {n} samples: need 0 < k <= n, 0 <= c <= n")
    # Every set of k samples then holds a correct one.
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


# sampled_accuracy's noise is keyed by [seed, EVAL_STREAM], a tag past any training step.
EVAL_STREAM = 10**9


@torch.no_grad()
def sampled_accuracy(
    model,
    prompts,
    meta,
    eval_size,
    batch_size,
    response_length,
    ctx,
    samples,
    temperature,
    seed,
    top_k=0,
    top_p=1.0,
) -> dict:
    """eval/pass@k (k = 1, 2, 4, ... up to samples, and samples) and eval/mean@samples of
    `samples` responses per prompt at `temperature`, top_k and top_p (the training sampler's),
    over the first eval_size prompts of a split and all ranks (equal strided shares, as
    greedy_accuracy). Prompt p's uniforms are row p of one global array keyed by (seed,
    EVAL_STREAM): any rank count samples the same responses, every eval alike."""
    rank, world_size = _rank_and_world_size()
    n = min(eval_size, len(prompts["query"])) // world_size * world_size
    idx = np.arange(rank, n, world_size)
    device = next(model.parameters()).device
    length = min(response_length, model.config.block_size - prompts["query"].shape[1])
    rng = np.random.default_rng([seed, EVAL_STREAM])
    noise = rng.random((n, samples, length), np.float32)
    # This rank's (prompt, sample) rows, batch_size at a time whatever `samples` is.
    prompt = np.repeat(idx, samples)
    sample = np.tile(np.arange(samples), len(idx))
    correct = np.zeros(len(prompt))
    # Batches and prompts both start at multiples of `group`: one prefill per run of equal queries.
    group = math.gcd(batch_size, samples)
    was_training = model.training
    model.eval()
    for i in progress(range(0, len(prompt), batch_size), "eval pass@k", show=rank == 0):
        p = prompt[i : i + batch_size]
        s = sample[i : i + batch_size]
        query = torch.from_numpy(prompts["query"][p]).to(device)
        u = torch.from_numpy(noise[p, s]).to(device)
        with ctx:
            rollout = gpt2.generate(
                model,
                query,
                pad_token_id=meta["pad_token_id"],
                max_new_tokens=length,
                eos_token_id=meta["eos_token_id"],
                temperature=temperature,
                noise=u,
                top_k=top_k,
                top_p=top_p,
                group_size=group,
            )
        rewards = verify_batch(meta, rollout.response.tolist(), prompts["ground_truth"][p])
        correct[i : i + len(p)] = rewards
    model.train(was_training)
    ks = sorted({2**i for i in range(samples.bit_length())} | {samples})
    # One row per prompt of this rank: pass@k for each k, then the mean.
    per_prompt = []
    for c in correct.reshape(len(idx), samples).sum(1):
        pass_rates = [pass_at_k(samples, int(c), k) for k in ks]
        per_prompt.append(pass_rates + [c / samples])
    if per_prompt:
        sums = torch.tensor(np.sum(per_prompt, 0))
    else:
        sums = torch.tensor([0.0] * (len(ks) + 1))
    sums = sums.to(device, torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)
    names = [f"eval/pass@{k}" for k in ks] + [f"eval/mean@{samples}"]
    means = sums / max(n, 1)
    return dict(zip(names, means.tolist()))


# --------------------------------------------------------------------------------------------------
# Scored responses: the summed log-probs of a split's responses (the SFT eval loss, DPO's
# pairs), and the implicit reward's accuracy on preference pairs (every policy against its
# reference)

# A preference split's responses to each query.
PAIR = ("chosen", "rejected")
# An SFT split's.
RESPONSE = ("response",)


def split_tensors(split, idx, device, keys=PAIR) -> list[torch.Tensor]:
    """Rows idx of a split as [query, *responses] tensors on device."""
    tensors = []
    for name in ("query", *keys):
        rows = torch.from_numpy(split[name][idx])
        tensors.append(rows.to(device))
    return tensors


def response_lengths(split, n, eos_token_id, keys=PAIR) -> torch.Tensor:
    """(n, R): tokens of the first n responses of each key, up to and including the
    stop."""
    lengths = []
    for name in keys:
        responses = torch.from_numpy(split[name][:n])
        mask = gpt2.response_mask(responses, eos_token_id)
        lengths.append(mask.sum(1))
    return torch.stack(lengths, 1)


def response_logprobs(model, query, *responses) -> torch.Tensor:
    """log π (B, R) of R responses to each query (B, Tq), each summed up to and including
    its stop token: one gpt2.logprobs call on R·B rows padded to one width (pad and stop
    ids are model.config's). Differentiable; call it under the autocast context."""
    return response_logprobs_and_entropy(model, query, *responses, entropy=False)[0]


def response_logprobs_and_entropy(model, query, *responses, entropy):
    """response_logprobs (B, R), and the entropy of gpt2.logprobs' `entropy` kind summed
    over each response's tokens (B, R), from the same forward pass (None if entropy=False)."""
    pad = model.config.pad_token_id
    width = max(r.size(1) for r in responses)
    padded = [F.pad(r, (0, width - r.size(1)), value=pad) for r in responses]
    queries = query.repeat(len(responses), 1)
    logprobs, token_entropy = gpt2.logprobs(model, queries, torch.cat(padded), entropy=entropy)
    logps = logprobs.sum(1).view(len(responses), -1).T
    if token_entropy is None:
        return logps, None
    return logps, token_entropy.sum(1).view(len(responses), -1).T


@torch.no_grad()
def split_logprobs(model, split, n, batch_size, ctx, keys=PAIR) -> torch.Tensor:
    """response_logprobs (n, R) of a split's first n rows, on every rank. Each rank scores
    an equal share, the last row again past the end: FSDP2 needs every rank in every
    forward."""
    rank, world_size = _rank_and_world_size()
    device = next(model.parameters()).device
    share = -(-n // world_size)
    first = rank * share
    out = torch.zeros(n, len(keys), device=device)
    was_training = model.training
    model.eval()
    for i in progress(range(0, share, batch_size), "log-probs", show=rank == 0):
        idx = np.arange(first + i, first + min(i + batch_size, share))
        query, *responses = split_tensors(split, idx.clip(max=n - 1), device, keys)
        with ctx:
            logps = response_logprobs(model, query, *responses)
        inside = idx < n
        out[idx[inside]] = logps[: inside.sum()]
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(out)
    return out


def preference_accuracy(logps, ref_logps) -> float:
    """The share of pairs whose implicit reward r = log π - log π_ref (from (B, 2) chosen,
    rejected log-probs) ranks the chosen response first, a tie counting half: a policy
    equal to its reference scores 0.5 exactly. DPO's β > 0 scales r, so it cannot flip a
    ranking."""
    r = logps - ref_logps
    chosen = r[:, 0]
    rejected = r[:, 1]
    wins = (chosen > rejected).double()
    ties = (chosen == rejected).double()
    return (wins + 0.5 * ties).mean().item()
