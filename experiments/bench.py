"""Speed of gpt2.py against Hugging Face transformers, side by side in one run (not a test).

Sections (--sections):
  forward   forward + backward tokens/s of gpt2.GPT and transformers.GPT2LMHeadModel, the
            same weights and batch; fp32 and bf16 autocast; --compile adds torch.compile(ours)
  generate  sampling tokens/s of gpt2.generate and HF `generate` from the same left-padded
            prompts (both sample exactly B x new_tokens); greedy fp32 outputs identical?
  cuda      GPT-2 124M: sft.py's bf16 step with the LM head in fp32, TF32 and bf16 -> MFU;
            a GRPO-sized rollout -> tokens/s (CUDA only)

Turns are interleaved (ours, HF, ours, HF, ...) after a warmup, so load on a shared machine
hits both alike; a ratio is the median over turns of the ratio within one turn, with its
range. Weights are random: speed does not depend on them.

    python experiments/bench.py  # forward, generate (and cuda on a GPU): minutes on 2 cores
    python experiments/bench.py --sections forward --presets tiny --compile --out bench.json
"""

import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import tyro

# gpt2.py lives at the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpt2  # noqa: E402

SECTIONS = ("forward", "generate", "cuda")
# the LM head's GEMM: gpt2.py's default, TF32 tensor cores, bf16
HEADS = ("fp32", "tf32", "bf16")
# dense bf16 peak FLOP/s by device name, the first match wins (for the MFU)
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12)]
PEAK_FLOPS += [("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12)]


@dataclass
class Args:
    sections: str = "forward,generate,cuda"  # comma-separated: forward, generate, cuda
    presets: str = "tiny,gpt2"  # comma-separated gpt2.py presets (not the cuda section's)
    dtypes: str = "auto"  # forward: float32 and/or bfloat16; auto: both on CPU, bf16 on CUDA
    fwd_shape: str = "auto"  # forward: B x T; auto: 64x64 tiny, else 2x128 CPU, 8x1024 CUDA
    compile: bool = False  # forward and cuda: also time torch.compile(ours)
    gen_batch: int = 0  # generate: prompts per call; 0: 64 for tiny or on CUDA, else 8
    prompt_len: int = 16  # generate: longest prompt (half to all of it, left-padded)
    new_tokens: int = 32  # generate: tokens sampled per prompt
    repeats: int = 7  # timed turns per variant after one warmup call; medians are reported
    min_time: float = 0.3  # seconds one timed turn lasts at least (short calls are looped)
    peak_flops: float = 0.0  # cuda: dense bf16 peak FLOP/s; 0: PEAK_FLOPS by name, else H100's
    mfu_shape: str = "16x1024"  # cuda: B x T of the training step
    rollout_shape: str = "256x128x128"  # cuda: prompts x prompt length x new tokens
    seed: int = 0  # seed for weights, inputs and sampling
    out: str = ""  # also write all results to this JSON file


# ---------------------------------------------------------------------------------------
# Timing and tables


def interleaved(fns, repeats, min_time, sync):
    """Each fn timed in turns (a, b, a, b, ...) so machine load hits all alike. Returns the median
    seconds per call, each first (warmup) call's seconds, which also size the inner loop of a
    timed turn, and every turn's seconds."""
    first, loops, times = {}, {}, {}
    for name, fn in fns.items():
        t = time.perf_counter()
        fn()
        sync()
        first[name] = time.perf_counter() - t
        loops[name] = max(1, round(min_time / first[name]))
        times[name] = []
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(loops[name]):
                fn()
            sync()
            times[name].append((time.perf_counter() - t) / loops[name])
    medians = {name: statistics.median(turns) for name, turns in times.items()}
    return medians, first, times


def speedup(times, fast, slow, label):
    """How many times faster `fast` ran than `slow`: the median over turns of the ratio within
    one turn, and its range over the turns."""
    ratios = [s / f for f, s in zip(times[fast], times[slow])]
    spread = f"{min(ratios):.2f}–{max(ratios):.2f}"
    return {label: statistics.median(ratios), f"{label} range": spread}


def cell(value):
    if not isinstance(value, float):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def markdown(rows):
    """A markdown table of every row's keys, in order; '–' where a row lacks one."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(key, "–")) for key in keys) + " |")
    return "\n".join(lines)


def show(row):
    """Print one measured row as a table line (progress), and return it."""
    print(markdown([row]).splitlines()[-1], flush=True)
    return row


def parse_shape(text, n, flag):
    dims = [int(d) for d in text.lower().split("x") if d.isdigit()]
    if len(dims) != n or len(text.split("x")) != n or min(dims) <= 0:
        example = "x".join(["8"] * n)
        raise gpt2.RunError(f"--{flag} '{text}': {n} positive integers joined by 'x': {example}")
    return dims


# ---------------------------------------------------------------------------------------
# Models and inputs


def config(preset):
    """A preset's config; tiny gets the offline task's byte vocabulary, the others GPT-2's."""
    vocab_size = 257 if preset == "tiny" else 50257
    return gpt2.GPTConfig(**gpt2.PRESETS[preset], vocab_size=vocab_size)


def model_pair(preset, seed, device):
    """Our GPT (random init) and an HF GPT2LMHeadModel of its config holding its weights."""
    try:
        import transformers as hft
    except ImportError:
        fix = "pip install -r requirements-test.txt"
        raise gpt2.RunError(f"bench.py needs transformers: {fix}") from None
    hft.logging.set_verbosity_error()
    cfg = config(preset)
    torch.manual_seed(seed)
    ours = gpt2.GPT(cfg)
    shape = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
    shape |= dict(vocab_size=cfg.vocab_size, n_positions=cfg.block_size)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    eps = cfg.layer_norm_epsilon
    no_stop = dict(bos_token_id=None, eos_token_id=None)
    hf_config = hft.GPT2Config(**shape, **no_dropout, layer_norm_epsilon=eps, **no_stop)
    hf = hft.GPT2LMHeadModel(hf_config)
    # the names are HF's; lm_head is tied to wte in both
    tensors = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights to HF: missing {missing}, unexpected {unexpected}")
    version = f"{hft.__version__}, attention {hf.config._attn_implementation}"
    return ours.to(device), hf.to(device), cfg, version


def left_padded_prompts(batch, prompt_len, pad, seed, device):
    """(batch, prompt_len) random prompts of prompt_len // 2 .. prompt_len tokens, left-padded."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randint(0, pad, (batch, prompt_len), generator=g)
    lengths = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (batch,), generator=g)
    query[torch.arange(prompt_len)[None, :] < (prompt_len - lengths)[:, None]] = pad
    return query.to(device)


# ---------------------------------------------------------------------------------------
# Sections


def train_step(model, idx, ctx, is_hf=False):
    """A call: forward + backward of idx (B, T), the same cross-entropy on all logits."""

    def step():
        model.zero_grad(set_to_none=True)
        with ctx:
            logits = model(idx).logits if is_hf else model(idx)  # (B, T, V)
        F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()

    return step


def bench_forward(args, device, sync, meta):
    cuda = device.type == "cuda"
    dtypes = args.dtypes.split(",")
    if args.dtypes == "auto":
        dtypes = ["bfloat16"] if cuda else ["float32", "bfloat16"]
    if set(dtypes) - {"float32", "bfloat16"}:
        raise gpt2.RunError(f"--dtypes '{args.dtypes}': use float32 and/or bfloat16")
    rows = []
    for preset in args.presets.split(","):
        ours, hf, cfg, meta["transformers"] = model_pair(preset, args.seed, device)
        shape = args.fwd_shape
        if shape == "auto":
            shape = "64x64" if preset == "tiny" else "8x1024" if cuda else "2x128"
        B, T = parse_shape(shape, 2, "fwd_shape")
        g = torch.Generator().manual_seed(args.seed)
        idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(device)
        for dtype in dtypes:
            ctx = nullcontext()
            if dtype == "bfloat16":
                ctx = torch.autocast(device.type, dtype=torch.bfloat16)
            fns = {"ours": train_step(ours, idx, ctx), "hf": train_step(hf, idx, ctx, is_hf=True)}
            if args.compile:
                fns["compiled"] = train_step(torch.compile(ours), idx, ctx)
            sec, first, times = interleaved(fns, args.repeats, args.min_time, sync)
            row = {"preset": preset, "dtype": dtype, "B x T": f"{B}x{T}"}
            row["ours tok/s"] = B * T / sec["ours"]
            row["HF tok/s"] = B * T / sec["hf"]
            row |= speedup(times, "ours", "hf", "ours/HF")
            if args.compile:
                row["compiled tok/s"] = B * T / sec["compiled"]
                row["compile s"] = first["compiled"] - first["ours"]
                row |= speedup(times, "compiled", "ours", "compiled/ours")
            rows.append(show(row))
    return rows


def sampler(model, query, pad, n, sample=True, ctx=None):
    """A call: n tokens (B, n) sampled at temperature 1 (greedy if not sample) after the
    left-padded query (B, Tq), by gpt2.generate or HF's `generate`."""

    @torch.no_grad()
    def run():
        with ctx or nullcontext():
            if isinstance(model, gpt2.GPT):
                return gpt2.generate(model, query, pad, n, None, float(sample)).response
            how = dict(input_ids=query, attention_mask=(query != pad).long(), do_sample=sample)
            if sample:
                how |= dict(temperature=1.0, top_k=0, top_p=1.0)
            out = model.generate(**how, max_new_tokens=n, pad_token_id=pad)
        # both must sample exactly B x n tokens
        if out.shape[1] != query.shape[1] + n:
            raise RuntimeError(f"HF generated {out.shape[1] - query.shape[1]} tokens, not {n}")
        return out[:, query.shape[1] :]

    return run


def bench_generate(args, device, sync, meta):
    cuda = device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else None
    rows = []
    for preset in args.presets.split(","):
        ours, hf, cfg, meta["transformers"] = model_pair(preset, args.seed, device)
        ours.eval()
        hf.eval()
        B = args.gen_batch or (64 if preset == "tiny" or cuda else 8)
        # pad: the last id, GPT-2's <|endoftext|>
        pad = cfg.vocab_size - 1
        n = args.new_tokens
        query = left_padded_prompts(B, args.prompt_len, pad, args.seed, device)
        fns = {
            "ours": sampler(ours, query, pad, n, ctx=ctx),
            "hf": sampler(hf, query, pad, n, ctx=ctx),
        }
        sec, _, times = interleaved(fns, args.repeats, args.min_time, sync)
        # greedy, in fp32
        greedy = [sampler(model, query, pad, n, sample=False)() for model in (ours, hf)]
        same = int((greedy[0] == greedy[1]).all(1).sum())
        row = {"preset": preset, "dtype": dtype, "B x (prompt+new)": f"{B}x({args.prompt_len}+{n})"}
        row["ours tok/s"] = B * n / sec["ours"]
        row["HF tok/s"] = B * n / sec["hf"]
        row |= speedup(times, "ours", "hf", "ours/HF")
        row["greedy fp32 identical"] = f"{'yes' if same == B else 'NO'} ({same}/{B} rows)"
        rows.append(show(row))
    return rows


def bench_cuda(args, device, sync):
    """GPT-2 124M: sft.py's bf16 training step (its loss through gpt2.logprobs, autocast, AdamW,
    clipping) with the LM head's GEMM in each of HEADS, turn about -> MFU of each; a rollout ->
    tokens/s (the default head)."""
    B, T = parse_shape(args.mfu_shape, 2, "mfu_shape")
    Bq, Tq, n = parse_shape(args.rollout_shape, 3, "rollout_shape")
    gpu = torch.cuda.get_device_name()
    peak = args.peak_flops or next((f for key, f in PEAK_FLOPS if key in gpu), 989e12)
    torch.manual_seed(args.seed)
    model = gpt2.GPT(config("gpt2")).to(device)
    cfg = model.config
    ctx = torch.autocast(device.type, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    forward_model = torch.compile(model) if args.compile else model
    # one prompt token and T response tokens, none the stop token (the last id)
    idx = torch.randint(0, cfg.vocab_size - 1, (B, T + 1), device=device)

    def train_step(head):
        def step():
            model.fp32_head = head != "bf16"
            torch.backends.cuda.matmul.allow_tf32 = head == "tf32"
            with ctx:
                logprobs = gpt2.logprobs(forward_model, idx[:, :1], idx[:, 1:])[0]  # (B, T)
            # sft.py's loss, per token
            (-logprobs.mean()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    fns = {head: train_step(head) for head in HEADS}
    # a second warmup: the first allocates the optimizer state (and compiles)
    for fn in fns.values():
        fn()
    secs, _, times = interleaved(fns, args.repeats, args.min_time, sync)
    model.fp32_head = gpt2.FP32_HEAD
    torch.backends.cuda.matmul.allow_tf32 = False
    # nanoGPT's estimate (PaLM appendix B): 6 N per token for the matmuls (N without wpe; wte
    # counts as lm_head) + 12 L C T for attention scores and mixing
    n_params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    flops = (6 * n_params + 12 * cfg.n_layer * cfg.n_embd * T) * B * T
    pad = cfg.vocab_size - 1
    query = left_padded_prompts(Bq, Tq, pad, args.seed, device)
    model.eval()

    def rollout():
        with ctx:
            gpt2.generate(model, query, pad, n, None, temperature=1.0)

    gen_sec = interleaved({"rollout": rollout}, args.repeats, args.min_time, sync)[0]["rollout"]
    rows = []
    for head in HEADS:
        row = {"LM head": head, "train B x T": f"{B}x{T}", "compiled": args.compile}
        row["step ms"] = secs[head] * 1e3
        row["train tok/s"] = B * T / secs[head]
        row["MFU"] = f"{flops / secs[head] / peak:.1%} of {peak:.3g}"
        if head != "fp32":
            row |= speedup(times, head, "fp32", "vs fp32 head")
        rows.append(row)
    rows[0]["rollout B x (prompt+new)"] = f"{Bq}x({Tq}+{n})"
    rows[0]["rollout tok/s"] = Bq * n / gen_sec
    return [show(row) for row in rows]


def main(args: Args):
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise gpt2.RunError(f"--sections: unknown {unknown}: use some of {','.join(SECTIONS)}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else torch.cpu.synchronize
    name = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} threads"
    meta = dict(device=name, torch=torch.__version__, args=asdict(args))
    print(f"device: {name} | torch {torch.__version__}", flush=True)
    results = {"meta": meta}
    for section in sections:
        print(f"\n## {section}\n", flush=True)
        if section == "forward":
            results[section] = bench_forward(args, device, sync, meta)
        elif section == "generate":
            results[section] = bench_generate(args, device, sync, meta)
        elif cuda:
            results[section] = bench_cuda(args, device, sync)
        else:
            print("skipped: no CUDA device")
    versions = f"torch {meta['torch']}, transformers {meta.get('transformers', '-')}"
    print(f"\n# summary ({name}, {versions})")
    for section, rows in results.items():
        if section != "meta" and rows:
            print(f"\n## {section}\n\n{markdown(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
