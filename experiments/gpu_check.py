"""The GPU acceptance command (issue 39): what a lent GPU runs first, in one call of < 8 minutes.

    timeout -k 10 420 python experiments/gpu_check.py --deadline 390 --out runs/gpu_check/accept
    python experiments/gpu_check.py --device cpu --out /tmp/dry  # every part, tiny sizes

Parts, in order; report.md and report.json are rewritten after each, so a cut keeps what finished:
  calibrate     copy bandwidth (GB/s), bf16 GEMM TFLOP/s, µs per node of a captured CUDA graph
  train_124M    sft.py's step (gpt2.logprobs, fused AdamW, clip) at 16 x 1024, bf16 autocast, per
                LM head mode (env GPT2_HEAD: fp32, mixed, bf16), eager and compiled -> MFU, peak
                memory
  sample_64     64 x (16 + 32) tokens: ours with the CUDA graph, ours eager, HF `generate`
  sample_256    256 x (128 + 128) tokens, the same three -> tokens/s, ratio to HF, share of the
                bandwidth limit ((weights + mean KV cache) bytes per decode step / measured GB/s)
  greedy        fp32 greedy tokens equal HF's, every row
  graph         graph == eager bitwise with a stop token, and after an optimizer step; and
                tests/test_decode.py's CUDA test
  logprob_gap   per head mode, bf16: generate's log-probs against gpt2.logprobs of the same
                responses: mean and max |Δ log p|, k3 KL
  packing       issue 40: a ragged micro-batch of HH-RLHF's shape (64 rows, prompts 16..512
                left-padded, responses stopping at 8..128), bf16: packed (varlen FlashAttention)
                against padded log-probs (max |Δ|) and fwd + bwd tokens/s
  train_large   gpt2-large 8 x 1024, as train_124M
  suite         `pytest -v -rfE tests` on CPU (tests/conftest.py), started first on half the
                cores: every failure by name

Each head mode is a model built with GPT2_HEAD set (gpt2.py reads it when a model is built),
so the modes run side by side; a mode this gpt2.py refuses is skipped, with why. Weights are
random (no download). Times: interleaved turns after warmups, median (range).
"""

import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Literal
from unittest import mock

import torch
import tyro

# gpt2.py lives at the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpt2  # noqa: E402

PARTS = ("calibrate", "train_124M", "sample_64", "sample_256", "greedy", "graph")
PARTS += ("logprob_gap", "packing", "train_large", "script_memory", "suite")
HEADS = ("fp32", "mixed", "bf16")
# per device: training (preset, B, T); sampling (B, prompt, new); the calibration's sizes
SIZES = {
    "cuda": dict(train_124M=("gpt2", 16, 1024), train_large=("gpt2-large", 8, 1024)),
    "cpu": dict(train_124M=("tiny", 2, 32), train_large=("tiny", 1, 48)),
}
SIZES["cuda"] |= dict(sample_64=(64, 16, 32), sample_256=(256, 128, 128), sample_preset="gpt2")
SIZES["cpu"] |= dict(sample_64=(8, 8, 8), sample_256=(16, 16, 16), sample_preset="tiny")
# packing: (preset, rows, longest prompt, longest response)
SIZES["cuda"] |= dict(packing=("gpt2", 64, 512, 128))
SIZES["cpu"] |= dict(packing=("tiny", 8, 24, 16))
SIZES["cuda"] |= dict(copy_bytes=1 << 30, gemm=8192)
SIZES["cpu"] |= dict(copy_bytes=1 << 24, gemm=256)


@dataclass
class Args:
    device: Literal["auto", "cuda", "cpu"] = "auto"  # cpu: a dry run of every part, tiny sizes
    parts: str = ",".join(PARTS)  # comma-separated, of the parts above
    deadline: int = 480  # seconds from the start after which no part starts
    out: str = ""  # report directory; default runs/gpu_check/<time>
    turns: int = 5  # timed turns per variant, interleaved
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager: a quick dry run)
    peak_flops: float = 989e12  # the datasheet's dense bf16 FLOP/s for MFU (H100 SXM, H200)
    suite: str = "tests"  # pytest's arguments for the suite part
    seed: int = 0


class Skip(Exception):
    """A part or variant that did not run: the message says why."""


# ---------------------------------------------------------------------------------------
# Timing, models, head modes


def timed_turns(fns, turns, sync, warmup=False):
    """Seconds of each fn per turn, the fns taken in turns (a, b, a, b, ...) so load hits all
    alike, after one warmup call each if asked."""
    for fn in fns.values() if warmup else ():
        fn()
    times = {name: [] for name in fns}
    for _ in range(turns):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return times


def table(header, body):
    """Markdown lines: a header row, then a row per list of cells."""
    rows = [header, ["---"] * len(header), *body]
    return ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def spread(values, fmt="{:,.0f}"):
    """'median (min–max)' of values."""
    low = fmt.format(min(values))
    high = fmt.format(max(values))
    return f"{fmt.format(statistics.median(values))} ({low}–{high})"


def head_of(model):
    """The LM head mode a model was built with (GPT2_HEAD)."""
    if not model.fp32_head:
        return "bf16"
    if model.mixed_head:
        return "mixed"
    return "fp32"


def built_with_head(mode, cfg):
    """gpt2.GPT(cfg) built with the environment that selects LM head mode `mode`: GPT2_HEAD, and
    GPT2_FP32_HEAD (its earlier name) not 0. The environment is restored after."""
    with mock.patch.dict(os.environ, GPT2_HEAD=mode, GPT2_FP32_HEAD="1"):
        return gpt2.GPT(cfg)


def heads():
    """The head modes this gpt2.py builds; {mode: reason} for the others."""
    modes, missing = [], {}
    cfg = gpt2.GPTConfig(**gpt2.PRESETS["tiny"], vocab_size=8)
    for mode in HEADS:
        try:
            model = built_with_head(mode, cfg)
        except gpt2.RunError as e:
            # a gpt2.py that rejects the mode's name
            missing[mode] = f"GPT2_HEAD={mode}: {e}"[:200]
            continue
        if head_of(model) == mode:
            modes.append(mode)
        else:
            missing[mode] = f"GPT2_HEAD={mode} builds the {head_of(model)} head in this gpt2.py"
    return modes, missing


def matmul_params(model):
    """The parameters a token's matmuls read: all but wpe (wte, tied, counts once)."""
    return sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()


def new_model(preset, seed, device, head=None):
    """A preset's GPT, random init; tiny gets the offline task's byte vocabulary, stop and pad.
    head: the LM head mode it is built with; None: the run's own environment's, as the scripts'."""
    stop = dict(vocab_size=257, eos_token_id=256, pad_token_id=256) if preset == "tiny" else {}
    cfg = gpt2.GPTConfig(**gpt2.PRESETS[preset], **stop)
    torch.manual_seed(seed)
    if head is None:
        return gpt2.GPT(cfg).to(device)
    return built_with_head(head, cfg).to(device)


def left_padded(B, Tq, pad, seed, device):
    """(B, Tq) random prompts of Tq // 2 .. Tq tokens below pad, left-padded."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randint(0, pad, (B, Tq), generator=g)
    lengths = torch.randint(max(1, Tq // 2), Tq + 1, (B, 1), generator=g)
    return query.masked_fill(torch.arange(Tq) < Tq - lengths, pad).to(device)


def under(amp, fn, *args, **kwargs):
    """fn(*args, **kwargs) under the autocast context amp."""
    with amp:
        return fn(*args, **kwargs)


def hf_copy(model):
    """transformers' GPT2LMHeadModel with model's weights, via gpt2.save to a temporary dir."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as path:
        gpt2.save(model, path)
        hf = GPT2LMHeadModel.from_pretrained(path).to(next(model.parameters()).device).eval()
    # as ours is called: no stop token, so every row gets its n tokens, none suppressed
    hf.generation_config.eos_token_id = None
    return hf


def hf_generate(hf, query, pad, n, sample=True):
    """HF `generate`: exactly n new tokens (B, n), sampled at temperature 1 or greedy."""
    how = dict(do_sample=sample, max_new_tokens=n, pad_token_id=pad)
    if sample:
        how |= dict(temperature=1.0, top_k=0, top_p=1.0)
    out = hf.generate(input_ids=query, attention_mask=(query != pad).long(), **how)
    return out[:, query.size(1) :]


# ---------------------------------------------------------------------------------------
# The parts: each returns (report lines, values); Skip says why one did not run


def part_calibrate(ctx):
    size = ctx.sizes["copy_bytes"]
    src = torch.empty(size, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    copy = timed_turns({"copy": partial(dst.copy_, src)}, 10, ctx.sync, warmup=True)["copy"]
    # a copy reads and writes every byte
    gbps = [2 * size / t / 1e9 for t in copy]
    n = ctx.sizes["gemm"]
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    gemm = timed_turns({"gemm": partial(torch.mm, a, b)}, 10, ctx.sync, warmup=True)["gemm"]
    tflops = [2 * n**3 / t / 1e12 for t in gemm]
    ctx.values["bandwidth"] = statistics.median(gbps) * 1e9
    ctx.values["gemm_peak"] = statistics.median(tflops) * 1e12
    lines = [f"copy {size >> 20} MiB: {spread(gbps)} GB/s (read + write)"]
    lines.append(f"bf16 GEMM {n}³: {spread(tflops, '{:.1f}')} TFLOP/s")
    if not ctx.cuda:
        lines.append("kernel inside a CUDA graph: skipped, no CUDA device")
        return lines, dict(gbps=gbps, tflops=tflops)
    x = torch.zeros(1, device=ctx.device)
    nodes = 1000
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1)
    replay = timed_turns({"graph": graph.replay}, 10, ctx.sync, warmup=True)["graph"]
    us = [t / nodes * 1e6 for t in replay]
    lines.append(f"kernel inside a CUDA graph of {nodes} tiny ones: {spread(us, '{:.2f}')} µs")
    ctx.values["us_per_node"] = statistics.median(us)
    return lines, dict(gbps=gbps, tflops=tflops, us_per_node=us)


def sft_step(model, forward_model, optimizer, tokens, amp):
    """One step of sft.py's on tokens (B, 1 + T): the mean NLL of the T response tokens through
    gpt2.logprobs, clip, AdamW (forward_model: model or its torch.compile)."""

    def step():
        with amp:
            logprobs = gpt2.logprobs(forward_model, tokens[:, :1], tokens[:, 1:])[0]  # (B, T)
        (-logprobs.sum() / logprobs.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def peak_bytes(ctx, step, state):
    """max_memory_allocated over one step, less what was allocated before it but this model's
    state: as if the model were alone (CUDA; None on CPU)."""
    if not ctx.cuda:
        return step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    return torch.cuda.max_memory_allocated() - before + state


def train(ctx, part):
    """sft.py's step per head mode, eager and compiled, interleaved: MFU and peak memory."""
    preset, B, T = ctx.sizes[part]
    built, missing = heads()
    # the head the scripts build in this environment
    shipped = gpt2.head_mode()
    # the scripts' configuration first: the default head, eager
    modes = [mode for mode in built if mode == shipped]
    modes += [mode for mode in built if mode != shipped]
    # no warmup starts after part_end: the parts after train_124M get two thirds of what is
    # left; the large one, the last, all but a minute for its turns and the suite's report
    part_end = ctx.end - 60 if part == "train_large" else time.time() + ctx.left() / 3
    fns, peaks, skipped = {}, {}, dict(missing)
    for mode in modes:
        model = new_model(preset, ctx.args.seed, ctx.device, head=mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=True)
        pad = model.config.pad_token_id
        g = torch.Generator().manual_seed(ctx.args.seed)
        # one prompt token and T response tokens, none of them the stop token
        tokens = torch.randint(0, pad, (B, T + 1), generator=g).to(ctx.device)
        for compiled in (False, True):
            name = f"{mode}, {'compiled' if compiled else 'eager'}"
            if time.time() > part_end:
                skipped[name] = "not run: the part's share of --deadline was spent"
                continue
            forward_model = model
            if compiled:
                forward_model = torch.compile(model, backend=ctx.args.compile_backend)
            step = sft_step(model, forward_model, optimizer, tokens, ctx.amp)
            # its weights and AdamW's two moments
            state = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
            try:
                # the first step allocates the optimizer's state (and compiles)
                step()
                peaks[name] = peak_bytes(ctx, step, state)
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                skipped[name] = "out of memory"
                continue
            fns[name] = step
            print(f"  {part}: {name} warmed up", flush=True)
    times = timed_turns(fns, ctx.args.turns, ctx.sync)
    cfg = model.config
    # nanoGPT's estimate (PaLM appendix B): 6 N per token for the matmuls (N without wpe, wte
    # counted once as the head) + 12 L C T for attention's scores and mixing
    flops = (6 * matmul_params(model) + 12 * cfg.n_layer * cfg.n_embd * T) * B * T
    gemm_peak = ctx.values.get("gemm_peak", math.nan)
    amp = "bf16 autocast" if ctx.cuda else "fp32 (CPU)"
    lines = [f"{preset}, {B} x {T}, {amp}, scripts' default head: {shipped}", ""]
    rows, body = {}, []
    for name, secs in times.items():
        mfu = [flops / t / ctx.args.peak_flops * 100 for t in secs]
        measured = [flops / t / gemm_peak * 100 for t in secs]
        ms = [t * 1e3 for t in secs]
        tok = [B * T / t for t in secs]
        gib = "–" if peaks[name] is None else f"{peaks[name] / 2**30:.2f}"
        cells = [name, spread(ms, "{:.1f}"), spread(tok), spread(mfu, "{:.1f}%")]
        body.append([*cells, spread(measured, "{:.1f}%"), gib])
        rows[name] = dict(seconds=secs, mfu=mfu, peak_bytes=peaks[name])
    header = ["head, mode", "step ms", "tokens/s", "MFU of --peak_flops", "MFU of measured GEMM"]
    lines += table([*header, "peak GiB"], body)
    lines += [f"skipped: {name}: {why}" for name, why in skipped.items()]
    torch._dynamo.reset()
    return lines, dict(flops_per_step=flops, variants=rows, skipped=skipped)


def decode_bytes(model, B, Tq, n):
    """Bytes of bf16 a decode step must read: the weights (wte once, as the head; no wpe) and
    the mean KV cache, keys and values of Tq + n / 2 tokens (docs/gpu.md: the bandwidth limit)."""
    cfg = model.config
    kv = 2 * cfg.n_layer * cfg.n_embd * B * (Tq + n / 2)
    return 2 * (matmul_params(model) + kv)


def sample(ctx, part):
    """Ours (graph), ours eager, HF generate: the same weights and prompts, interleaved."""
    B, Tq, n = ctx.sizes[part]
    model = new_model(ctx.sizes["sample_preset"], ctx.args.seed, ctx.device).eval()
    hf = hf_copy(model)
    pad = model.config.pad_token_id
    query = left_padded(B, Tq, pad, ctx.args.seed, ctx.device)

    ours = partial(under, ctx.amp, gpt2.generate, model, query, pad, n, None, 1.0)
    fns = dict(graph=partial(ours, cuda_graph=True), eager=partial(ours, cuda_graph=False))
    fns["HF"] = partial(under, ctx.amp, hf_generate, hf, query, pad, n)
    times = timed_turns(fns, ctx.args.turns, ctx.sync, warmup=True)
    bandwidth = ctx.values.get("bandwidth", math.nan)
    step_bytes = decode_bytes(model, B, Tq, n)
    limit = B * bandwidth / step_bytes
    names = {"graph": "ours, CUDA graph", "eager": "ours, eager", "HF": "HF generate"}
    if not ctx.cuda:
        names["graph"] += " (no CUDA: runs eager)"
    lines = [f"{B} x ({Tq} + {n}), {'bf16 autocast' if ctx.cuda else 'fp32'}, random weights"]
    lines.append(f"bandwidth limit: {step_bytes / 1e6:,.1f} MB a decode step -> {limit:,.0f} tok/s")
    values = dict(limit=limit, step_bytes=step_bytes)
    body = []
    for name, secs in times.items():
        tok = [B * n / t for t in secs]
        ratio = [h / t for t, h in zip(secs, times["HF"])]
        share = [x / limit * 100 for x in tok]
        body.append([names[name], spread(tok), spread(ratio, "{:.2f}"), spread(share, "{:.2f}%")])
        values[name] = dict(seconds=secs, tokens_per_s=tok, vs_hf=ratio)
    header = ["sampler", "tokens/s", "/ HF", "share of the bandwidth limit"]
    return [*lines, "", *table(header, body)], values


def part_greedy(ctx):
    """fp32 greedy decoding, ours (graph and eager) against HF's, every row."""
    B, Tq, n = ctx.sizes["sample_64"]
    model = new_model(ctx.sizes["sample_preset"], ctx.args.seed, ctx.device).eval()
    hf = hf_copy(model)
    pad = model.config.pad_token_id
    query = left_padded(B, Tq, pad, ctx.args.seed, ctx.device)
    with torch.no_grad():
        theirs = hf_generate(hf, query, pad, n, sample=False)
        same = {}
        for graph in (True, False):
            ours = gpt2.generate(model, query, pad, n, None, 0.0, cuda_graph=graph).response
            same["graph" if graph else "eager"] = int((ours == theirs).all(1).sum())
    lines = [f"fp32 greedy, {B} x ({Tq} + {n}): ours == HF in {same} rows of {B}"]
    if min(same.values()) < B:
        raise AssertionError("; ".join(lines))
    return lines, same


def both_rollouts(model, query, pad, n, eos, noise, amp):
    """generate's Rollout eager and from the CUDA graph, the same uniforms; bitwise equal?"""
    with amp:
        eager = gpt2.generate(model, query, pad, n, eos, 0.7, noise, cuda_graph=False)
        graph = gpt2.generate(model, query, pad, n, eos, 0.7, noise, cuda_graph=True)
    return eager, all(torch.equal(a, b) for a, b in zip(eager, graph))


def part_graph(ctx):
    """Graph == eager bitwise at the sampling shape, bf16, with a stop token that fires for some
    rows; again after an optimizer step; then tests/test_decode.py's CUDA test (tiny, fp32+bf16)."""
    B, Tq, n = ctx.sizes["sample_64"]
    model = new_model(ctx.sizes["sample_preset"], ctx.args.seed, ctx.device)
    pad = model.config.pad_token_id
    query = left_padded(B, Tq, pad, ctx.args.seed, ctx.device)
    noise = torch.rand(B, n, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    first, _ = both_rollouts(model, query, pad, n, None, noise, ctx.amp)
    # a token that row 0 samples a few steps in: a stop that fires mid-way
    eos = int(first.response[0, n // 4])
    stopped, same = both_rollouts(model, query, pad, n, eos, noise, ctx.amp)
    share = stopped.mask.float().mean().item()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ctx.amp:
        model(query).float().logsumexp(-1).mean().backward()
    optimizer.step()
    after, same_after = both_rollouts(model, query, pad, n, eos, noise, ctx.amp)
    moved = not torch.equal(after.response, stopped.response)
    lines = [f"{B} x ({Tq} + {n}), stop token {eos}: {share:.0%} of response tokens kept"]
    lines.append(f"graph == eager bitwise (response, mask, log-probs): {same}")
    lines.append(f"after an optimizer step: graph == eager {same_after}; tokens changed {moved}")
    test = "tests/test_decode.py::test_cuda_graph_equals_eager_and_follows_optimizer_steps"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ctx.left())
    lines.append(f"`pytest {test}`: {p.stdout.strip().splitlines()[-1]}")
    if not (same and same_after and p.returncode == 0):
        raise AssertionError("; ".join(lines))
    return lines, dict(same=same, same_after_step=same_after, kept=share)


def part_logprob_gap(ctx):
    """Per head mode, bf16 autocast: generate's log-probs (the sampler) against gpt2.logprobs of
    the same responses (the trainer), the tokens up to each row's stop."""
    B, Tq, n = ctx.sizes["sample_256"]
    modes, missing = heads()
    lines = [f"{ctx.sizes['sample_preset']}, {B} x ({Tq} + {n}), bf16 autocast, temperature 1"]
    values, body = {}, []
    amp = torch.autocast(ctx.device.type, dtype=torch.bfloat16)
    for mode in modes:
        model = new_model(ctx.sizes["sample_preset"], ctx.args.seed, ctx.device, head=mode).eval()
        pad = model.config.pad_token_id
        query = left_padded(B, Tq, pad, ctx.args.seed, ctx.device)
        with amp, torch.no_grad():
            rollout = gpt2.generate(model, query, pad, n, model.config.eos_token_id, 1.0)
            trainer = gpt2.logprobs(model, rollout.query, rollout.response)[0]
        # log(p_trainer / p_sampler) on the response tokens
        delta = (trainer - rollout.logprobs)[rollout.mask].double()
        # k3 (Schulman's): an unbiased, positive estimate of KL(sampler || trainer)
        k3 = (delta.exp() - 1 - delta).mean().item()
        row = dict(mean=delta.abs().mean().item(), max=delta.abs().max().item(), k3=k3)
        values[mode] = row
        body.append([mode, *(f"{row[key]:.3e}" for key in ("mean", "max", "k3"))])
    lines += ["", *table(["head", "mean abs Δ log p", "max abs Δ log p", "k3 KL"], body)]
    lines += [f"skipped: {mode}: {why}" for mode, why in missing.items()]
    return lines, values


def part_packing(ctx):
    """Packed against padded log-probs of a ragged batch, bf16 autocast on CUDA: their gap, and
    forward + backward time in interleaved turns."""
    preset, B, Tq, Tr = ctx.sizes["packing"]
    model = new_model(preset, ctx.args.seed, ctx.device)
    pad = model.config.pad_token_id
    eos = model.config.eos_token_id
    g = torch.Generator().manual_seed(ctx.args.seed)
    query = left_padded(B, Tq, pad, ctx.args.seed, ctx.device)
    # Prompts of 1/32 .. all of Tq tokens, as HH-RLHF's: left_padded's shortest is Tq / 2.
    short = torch.arange(B, device=ctx.device) % 2 == 0
    query[short, : Tq - max(1, Tq // 32)] = pad
    response = torch.randint(0, pad, (B, Tr), generator=g).to(ctx.device)
    stops = torch.randint(Tr // 16, Tr, (B, 1), generator=g).to(ctx.device)
    response = response.masked_fill(torch.arange(Tr, device=ctx.device) >= stops, eos)
    outputs = {}

    def step(packing):
        model.packing = packing
        model.zero_grad(set_to_none=True)
        with ctx.amp:
            logps = gpt2.logprobs(model, query, response, entropy=True)[0]
        logps.sum().backward()
        outputs[packing] = logps.detach()

    # A packed forward returns (n, V), a padded one (B, T, V).
    dims = []
    hook = model.register_forward_hook(lambda module, args, out: dims.append(out.dim()))
    step(True)
    hook.remove()
    assert dims == [2], "the packed pass did not run packed"

    fns = dict(packed=partial(step, True), padded=partial(step, False))
    times = timed_turns(fns, ctx.args.turns, ctx.sync, warmup=True)
    mask = gpt2.response_mask(response, eos)
    delta = (outputs[True] - outputs[False])[mask].abs()
    tokens = (query != pad).sum().item() + mask.sum().item()
    ratios = [b / a for a, b in zip(times["packed"], times["padded"])]
    real = tokens / (B * (Tq + Tr))
    lines = [f"{preset}, {B} rows, prompts to {Tq}, responses to {Tr}: {real:.0%} real tokens"]
    body = []
    for name in ("packed", "padded"):
        body.append([name, spread([tokens / t for t in times[name]])])
    lines += ["", *table(["pass", "real tokens/s, fwd + bwd"], body)]
    lines += ["", f"packed/padded: {spread(ratios, '{:.2f}')}"]
    lines += [f"log-probs packed - padded: mean |Δ| {delta.mean():.2e}, max {delta.max():.2e}"]
    values = dict(speedup=statistics.median(ratios), max_delta=delta.max().item(), real=real)
    # bf16 on CUDA: another kernel rounds differently; fp32 on CPU: to round-off.
    bound = 0.1 if ctx.cuda else 1e-4
    assert delta.max().item() < bound, f"packed log-probs differ by {delta.max():.3e}"
    return lines, values


def part_script_memory(ctx):
    why = "a step of each script at gpt2-large, 256-token responses: not in this command"
    raise Skip(f"{why} (427b2e5's `gpu_check.py --items memory` ran it)")


def start_suite(ctx):
    """The suite in the background (it runs on CPU), on the upper half of the cores when there
    are several, with pytest-xdist when installed; its log streams to out/suite.log."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider"]
    cores = sorted(os.sched_getaffinity(0))
    workers = len(cores) // 2
    if importlib.util.find_spec("xdist") and workers > 1:
        cmd += ["-n", str(workers)]
    cmd += ctx.args.suite.split()
    if len(cores) > 1 and shutil.which("taskset"):
        cmd = ["taskset", "-c", ",".join(map(str, cores[len(cores) // 2 :])), *cmd]
        # the measurements keep the lower half, a thread a core
        os.sched_setaffinity(0, cores[: len(cores) // 2])
        torch.set_num_threads(len(cores) // 2)
    log = open(os.path.join(ctx.out, "suite.log"), "w")
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def part_suite(ctx):
    """Wait for the suite until the deadline; every failure and error by name."""
    proc = ctx.suite
    if proc is None:
        raise Skip("not started (--parts without suite)")
    try:
        proc.wait(timeout=max(1, ctx.left()))
        cut = False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        cut = True
    with open(os.path.join(ctx.out, "suite.log")) as f:
        log = f.read()
    outcomes = {}
    for line in log.splitlines():
        # `tests/x.py::name PASSED` (-v), `[gw0] PASSED tests/x.py::name` (xdist) or
        # `FAILED tests/x.py::name - why` (-rfE)
        test = re.search(r"tests/\S+::[^\s\[]+(\[[^\]]*\])?", line)
        outcome = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
        if test and outcome:
            outcomes[test.group()] = outcome.group()
    counts = sorted(Counter(outcomes.values()).items())
    summary = ", ".join(f"{k} {v}" for k, v in counts) or "no test finished"
    state = "cut at the deadline" if cut else f"exit {proc.returncode}"
    lines = [f"`pytest {ctx.args.suite}` ({state}): {summary}; log: suite.log"]
    bad = sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))
    lines += [f"- {outcomes[t]} {t}" for t in bad]
    return lines, dict(outcomes=outcomes, cut=cut, returncode=proc.returncode)


# ---------------------------------------------------------------------------------------
# main: the parts in turn, the report rewritten after each


@dataclass
class Ctx:
    args: Args
    cuda: bool
    device: torch.device
    out: str
    end: float
    head: str
    sizes: dict
    amp: object = None
    suite: subprocess.Popen | None = None
    # measured figures that later parts use (bandwidth, GEMM peak)
    values: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def left(self):
        return self.end - time.time()

    def write(self):
        """report.md and report.json: what finished so far."""
        md = [f"# {self.head}", ""]
        for part, r in self.report.items():
            md += [f"## {part}: {r['status']} ({r['seconds']} s)", "", *r["lines"], ""]
        with open(os.path.join(self.out, "report.md"), "w") as f:
            f.write("\n".join(md))
        with open(os.path.join(self.out, "report.json"), "w") as f:
            report = dict(head=self.head, args=asdict(self.args), parts=self.report)
            json.dump(report, f, indent=2, default=str)


def run_part(ctx, part):
    """One part: its report entry, printed and written as it ends."""
    print(f"\n== {part}", flush=True)
    t0 = time.time()
    values = {}
    try:
        if ctx.left() <= 0 and part != "suite":
            raise Skip("not run: --deadline reached")
        if part.startswith(("train", "sample")):
            lines, values = globals()[part.split("_")[0]](ctx, part)
        else:
            lines, values = globals()[f"part_{part}"](ctx)
        status = "ran"
    except Skip as e:
        status, lines = "skipped", [str(e)]
    except AssertionError as e:
        status, lines = "FAILED", [str(e)]
    except Exception:
        # a crash in the check itself: reported, and the next part runs
        status, lines = "ERROR", traceback.format_exc().splitlines()[-12:]
    if ctx.cuda:
        torch.cuda.empty_cache()
    print("\n".join(lines), flush=True)
    ctx.report[part] = dict(status=status, seconds=round(time.time() - t0), lines=lines)
    ctx.report[part]["values"] = values
    ctx.write()


def main(args: Args):
    t_start = time.time()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise gpt2.RunError(f"--parts: unknown {unknown}: use some of {','.join(PARTS)}")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        raise gpt2.RunError("--device cuda: no CUDA device here")
    if not cuda and args.device == "auto":
        raise gpt2.RunError("no CUDA device: use --device cpu for the dry run")
    out = args.out or os.path.join(ROOT, "runs", "gpu_check", time.strftime("%Y%m%d-%H%M%S"))
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    machine = torch.cuda.get_device_name() if cuda else "CPU (a dry run)"
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True)
    commit += " (uncommitted changes)" if dirty.stdout.strip() else ""
    command = " ".join(sys.argv)
    head = f"gpu_check: {machine}; torch {torch.__version__}; commit {commit}; `{command}`"
    print(head, flush=True)
    device = torch.device("cuda" if cuda else "cpu")
    ctx = Ctx(args, cuda, device, out, t_start + args.deadline, head, SIZES[device.type])
    ctx.amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    if "suite" in parts:
        ctx.suite = start_suite(ctx)
    for part in parts:
        run_part(ctx, part)
    print(f"\nwritten to {out}/report.md and .json")
    sys.exit(1 if any(r["status"] in ("FAILED", "ERROR") for r in ctx.report.values()) else 0)


if __name__ == "__main__":
    try:
        main(tyro.cli(Args, use_underscores=True))
    except gpt2.RunError as e:
        # a problem the user can fix: one line, no traceback
        sys.exit(f"error: {e}")
