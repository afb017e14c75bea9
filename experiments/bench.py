"""Benchmark of gpt2.py against Hugging Face transformers, side by side in one run (not a test).

1. forward: forward+backward tokens/s of gpt2.GPT vs transformers.GPT2LMHeadModel, same config,
   weights and batch, HF with its default attention (sdpa); fp32 and bf16 autocast (bf16 only on
   CUDA); `--compile` adds torch.compile.
2. generate: batched sampling tokens/s of gpt2.generate (KV cache) vs HF `generate` on the same
   left-padded prompts with an attention mask (temperature 1, top_k 0, no stop token: both sample
   exactly B x new_tokens), and whether greedy fp32 outputs are identical.
3. memory: MEASURED, per rank, one training step of the policy (forward + backward + AdamW at
   --memory_shape, 2 x 256 tokens) under FSDP2 at gpt2-large's shape on 1 and 2 ranks, one
   `torchrun` launch per rank count (sharded by a copy of the scripts' own `shard`): the bytes of
   parameters, gradients and Adam states, RSS once the model is loaded as the scripts load it
   (gpt2.load(shard=): rank 0 reads a random checkpoint, the other ranks build on the meta
   device and receive their shards) and peak RSS (on CUDA also max_memory_allocated). Then a
   COMPUTED table: the
   GPU memory each script should need per rank at gpt2-large and gpt2-xl, 256- and 512-token
   responses, on --expected_ranks, with and without activation checkpointing (`expected_memory`).
4. optimizer: one AdamW step over each preset's parameters, torch's three implementations (for-loop,
   foreach, fused) side by side: the scripts use fused on CPU and CUDA.
4b. gemm (CPU): the model's fp32 GEMMs through MKL (torch's default) and oneDNN (gpt2.matmul's
   choice on AMD CPUs), at a decode step's rows and at a training batch's rows: the forward, the
   input's and the weight's gradients, and all of a decode step's GEMMs in model order against the
   time to read every weight once.
4c. prompts: one forward + backward of the rows a step trains on (GRPO's groups, DPO's pairs; the
   task's 6-token prompts): each row's last token left out of the input (as the scripts do) against
   kept, and (where gpt2.py uses oneDNN) its small-weight GEMMs on oneDNN from ONEDNN_MIN_ROWS rows
   on against always on MKL.
5. cuda: an sft.py-like bf16 training step of GPT-2 124M → MFU, and a GRPO-style rollout → tokens/s
   (CUDA only).

Timings are interleaved (ours, HF, ours, HF, ...) after a warmup, so load on a shared machine hits
both alike; each ratio is the median over turns of the ratio within one turn, printed with its range
over the turns. Weights are random (speed does not depend on them). transformers is a benchmark-only
dependency: pip install -r requirements-test.txt.

    python experiments/bench.py  # everything, CPU-sized: minutes on 2 cores, 12 GB of RAM
    python experiments/bench.py --sections forward --presets tiny --compile --out bench.json
    python experiments/bench.py --sections memory  # gpt2-large: 12 GB RSS, 3 min on 2 cores
    python experiments/bench.py --sections memory --memory_preset gpt2 --memory_shape 2x64
    python experiments/bench.py --sections optimizer --presets tiny --repeats 3  # seconds
    python experiments/bench.py --sections gemm --presets tiny,gpt2  # MKL vs oneDNN on this CPU
    python experiments/bench.py --sections prompts --presets tiny,gpt2 --repeats 15
"""

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # gpt2.py lives at the repository root

import gpt2  # noqa: E402

SECTIONS = ("forward", "generate", "memory", "optimizer", "gemm", "prompts", "cuda")
TINY_VOCAB = 257  # the offline arithmetic task's byte tokenizer; other presets keep GPT-2's 50257


NOTES = dict(  # printed above each section's table
    forward="forward+backward of one batch, the same cross-entropy on all logits; HF "
    "GPT2LMHeadModel with its default attention (sdpa); no attention mask for either (no padding)",
    generate="sampling (temperature 1, top_k 0, no stop token) from left-padded prompts with an "
    "attention mask, tokens/s = sampled tokens; HF model.generate with its default cache and "
    "attention",
    memory="MEASURED: one step of the policy (forward + backward of the response log-probs "
    "through gpt2.logprobs + fused AdamW) under FSDP2 (fp32 on CPU; bf16 params, fp32 reduce on "
    "CUDA); bytes are this rank's local shards; 'loaded' is RSS once the model is loaded and "
    "sharded as the scripts do (gpt2.load(shard=): only rank 0 reads the full weights); torchrun "
    "workers run with MALLOC_MMAP_THRESHOLD_=131072 unless set, so RSS tracks the live tensors",
    expected="COMPUTED, not measured: GPU GiB per rank = the models' shards (trained: fp32 params "
    "+ grads + Adam, 16 B/param; frozen: bf16 blocks, fp32 root) + the larger of training (FSDP's "
    "gathered root and blocks, activations of one micro-batch of 8 (pairs for dpo, reward): 34 C "
    "bytes per token per layer in bf16 (2 C with checkpointing, plus one layer's 34 C), a bf16 "
    "mask per layer, fp32 logits over the response, their gradient written over them) and "
    "sampling (the whole policy gathered, a bf16 KV cache of the rollout batch: ppo and reward 8 "
    "sequences, grpo 32 x 8 / N); 128-token prompts; ppo: policy + value trained, reference + "
    "reward frozen; grpo: policy trained, reference frozen (beta > 0); dpo: policy only (the "
    "reference's log-probs precomputed); reward: one model (+ the frozen policy sampling for the "
    "normalisation); a cell: without / with activation checkpointing; *: sampling sets the peak",
    optimizer="one torch.optim.AdamW step (gradients present) over all parameters of a preset",
    gemm="fp32 GEMMs of each linear layer's shape through MKL (torch's default) and oneDNN "
    "(gpt2.py's choice on AMD CPUs): forward x @ W, the input's gradient g @ W.T and the weight's "
    "x.T @ g",
    gemm_decode="a decode step's GEMMs (every block's four, each layer's own weight, in model "
    "order) through MKL and oneDNN, against reading every one of those weights once (w.sum())",
    prompts="one forward + backward of a step's rows (logits from the last prompt position on, as "
    "the scripts): the last token left out (as the scripts) or kept; small-weight GEMMs on oneDNN "
    "from ONEDNN_MIN_ROWS rows on (as gpt2.py) or always on MKL",
    cuda="GPT-2 124M, sft.py's bf16 training step, the LM head in fp32 (default), TF32 or bf16; "
    "MFU = (6 N + 12 L C T) tokens / s / peak",
)


@dataclass
class Args:
    sections: str = "forward,generate,memory,optimizer,gemm,cuda"
    """comma-separated sections: forward, generate, memory, optimizer, gemm (CPU only), prompts,
    cuda (skipped without a GPU)"""
    presets: str = "tiny,gpt2"
    """comma-separated gpt2.py presets for the forward, generate and optimizer sections"""
    dtypes: str = "auto"
    """forward section: comma-separated float32, bfloat16 (autocast); auto = both on CPU, bfloat16
    on CUDA"""
    fwd_shape: str = "auto"
    """forward section: batch x sequence length; auto = 64x64 for tiny, else 2x128 on CPU and 8x1024
    on CUDA"""
    compile: bool = False
    """forward section: also time torch.compile(ours) (on CPU each model and dtype compiles for ~30
    s or more)"""
    gen_batch: int = 0
    """generate section: prompts per call; 0 = 64 for tiny, else 8 on CPU and 64 on CUDA"""
    prompt_len: int = 16
    """generate section: longest prompt (prompts are half to all of it, left-padded)"""
    new_tokens: int = 32
    """generate section: tokens sampled per prompt"""
    repeats: int = 7
    """timed turns per variant after one warmup call; medians are reported"""
    min_time: float = 0.3
    """seconds one timed turn lasts at least (short calls are looped)"""
    memory_preset: str = "gpt2"
    """memory section: preset of the measured policy"""
    memory_shape: str = "2x256"
    """memory section: micro-batch x sequence length of the measured step"""
    memory_checkpoint: str = ""
    """memory section, internal: the random checkpoint the workers load"""
    memory_ranks: str = "1,2"
    """memory section: comma-separated rank counts, one torchrun launch each"""
    expected_ranks: str = "1,8"
    """memory section: the rank counts of the COMPUTED table"""
    peak_flops: float = 989e12
    """cuda section: the GPU's dense bf16 peak FLOP/s for MFU (989e12 = H100 SXM)"""
    mfu_shape: str = "16x1024"
    """cuda section: batch x sequence length of the training step"""
    rollout_shape: str = "256x128x128"
    """cuda section: prompts x prompt length x new tokens of the rollout"""
    seed: int = 0
    """seed for weights, inputs and sampling"""
    out: str | None = None
    """also write all results to this JSON file"""


# ----------------------------------------------------------------------------------------------
# Helpers


# setup_distributed and shard: copied from the scripts' plumbing section, so the memory
# section measures exactly the sharding they do (experiments import no top-level script)
def setup_distributed():
    """torchrun → process group (nccl on CUDA, gloo on CPU); plain python → a single process.
    Returns (rank, world_size, device)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world_size, local_rank = (
        int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    )
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, world_size, device


def shard(model, device, bf16):
    """FSDP2: each block, then the root (the tied wte and lm_head together). In bf16: bf16 block
    parameters and fp32 gradient reduction; the root stays fp32 for the model's fp32 head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fp32 = MixedPrecisionPolicy(torch.float32, torch.float32)
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else fp32
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=fp32 if model.fp32_head else mp)


def config(preset: str, vocab_size: int | None = None) -> gpt2.GPTConfig:
    """A preset's config; tiny gets the task's byte vocabulary, the others GPT-2's."""
    vocab_size = vocab_size or (TINY_VOCAB if preset == "tiny" else 50257)
    return gpt2.GPTConfig(**gpt2.PRESETS[preset], vocab_size=vocab_size)


def parse_shape(s: str, n: int, flag: str) -> list[int]:
    dims = [int(d) for d in s.lower().split("x") if d.isdigit()]
    if len(dims) != n or len(s.split("x")) != n or min(dims) <= 0:
        example = "x".join(["8"] * n)
        raise gpt2.RunError(
            f"--{flag} '{s}': expected {n} positive integers joined by 'x': {example}"
        )
    return dims


def interleaved(fns: dict, repeats: int, min_time: float, sync) -> tuple[dict, dict, dict]:
    """Median seconds per call of each fn, timed in turns (a, b, a, b, ...) so machine load hits all
    alike; the seconds of each first (warmup) call, which also sizes the inner loop of each timed
    turn; every turn's seconds."""
    first, loops, times = {}, {}, {k: [] for k in fns}
    for k, fn in fns.items():
        t = time.perf_counter()
        fn(), sync()
        first[k] = time.perf_counter() - t
        loops[k] = max(1, round(min_time / first[k]))
    for _ in range(repeats):
        for k, fn in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(loops[k]):
                fn()
            sync()
            times[k].append((time.perf_counter() - t) / loops[k])
    return {k: statistics.median(v) for k, v in times.items()}, first, times


def speedup(times: dict, fast: str, slow: str, label: str) -> dict:
    """How many times faster `fast` ran than `slow`: the median over turns of the ratio within one
    turn, and its range over the turns."""
    ratios = [s / f for f, s in zip(times[fast], times[slow])]
    spread = f"{min(ratios):.2f}–{max(ratios):.2f}"
    return {label: statistics.median(ratios), f"{label} range": spread}


def markdown(rows: list[dict]) -> str:
    def fmt(v):
        if not isinstance(v, float):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    keys = list(dict.fromkeys(k for r in rows for k in r))  # every row's, in order; "–" if absent
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(
        lines + ["| " + " | ".join(fmt(r.get(k, "–")) for k in keys) + " |" for r in rows]
    )


def model_pair(preset: str, seed: int, device):
    """Our GPT (random init) and an HF GPT2LMHeadModel of the same config holding the same
    weights."""
    try:
        import transformers as hft
    except ImportError:
        raise gpt2.RunError(
            "bench.py needs transformers: pip install -r requirements-test.txt"
        ) from None
    hft.logging.set_verbosity_error()
    cfg = config(preset)
    torch.manual_seed(seed)
    ours = gpt2.GPT(cfg)
    shape = dict(
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size
    )
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = hft.GPT2LMHeadModel(
        hft.GPT2Config(
            **shape,
            **no_dropout,
            n_positions=cfg.block_size,
            layer_norm_epsilon=cfg.layer_norm_epsilon,
            bos_token_id=None,
            eos_token_id=None,
        )
    )
    tensors = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}  # HF's names
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to wte in both
        raise RuntimeError(
            f"weight mapping to HF failed: missing {missing}, unexpected {unexpected}"
        )
    version = f"{hft.__version__}, attention {hf.config._attn_implementation}"
    return ours.to(device), hf.to(device), cfg, version


def left_padded_prompts(batch: int, prompt_len: int, pad: int, seed: int, device) -> torch.Tensor:
    """(batch, prompt_len) random prompts of prompt_len // 2 .. prompt_len tokens, left-padded with
    pad."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randint(0, pad, (batch, prompt_len), generator=g)
    lengths = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (batch,), generator=g)
    query[torch.arange(prompt_len)[None, :] < (prompt_len - lengths)[:, None]] = pad
    return query.to(device)


def show(rows: list[dict]) -> list[dict]:
    print(markdown(rows).splitlines()[-1], flush=True)  # one progress line per measured row
    return rows


# ----------------------------------------------------------------------------------------------
# Sections


def train_step(model, idx, ctx, is_hf=False):
    """A call: forward + backward of idx (B, T), the same cross-entropy on all logits for both."""

    def step():
        model.zero_grad(set_to_none=True)
        with ctx:
            logits = model(idx).logits if is_hf else model(idx)  # (B, T, V)
        F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()

    return step


def bench_forward(args: Args, device, sync, meta) -> list[dict]:
    cuda, rows = device.type == "cuda", []
    dtypes = args.dtypes.split(",")
    if args.dtypes == "auto":
        dtypes = ["bfloat16"] if cuda else ["float32", "bfloat16"]
    if set(dtypes) - {"float32", "bfloat16"}:
        raise gpt2.RunError(f"--dtypes '{args.dtypes}': use float32 and/or bfloat16")
    for preset in args.presets.split(","):
        ours, hf, cfg, meta["transformers"] = model_pair(preset, args.seed, device)
        auto = "64x64" if preset == "tiny" else "8x1024" if cuda else "2x128"
        B, T = parse_shape(auto if args.fwd_shape == "auto" else args.fwd_shape, 2, "fwd_shape")
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
            row |= {"ours tok/s": B * T / sec["ours"], "HF tok/s": B * T / sec["hf"]}
            row |= speedup(times, "ours", "hf", "ours/HF")
            if args.compile:
                row["compiled tok/s"] = B * T / sec["compiled"]
                row["compile s"] = first["compiled"] - first["ours"]
                row |= speedup(times, "compiled", "ours", "compiled/ours")
            rows += show([row])
    return rows


def sampler(model, query, pad, n, sample=True, ctx=None):
    """A call: n tokens (B, n) sampled at temperature 1 (greedy if not sample) after the left-padded
    query (B, Tq), by gpt2.generate or HF's `generate` (model is ours or HF's)."""

    @torch.no_grad()
    def run():
        with ctx or nullcontext():
            if isinstance(model, gpt2.GPT):
                return gpt2.generate(model, query, pad, n, None, float(sample)).response
            kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
            out = model.generate(
                input_ids=query,
                attention_mask=(query != pad).long(),
                max_new_tokens=n,
                pad_token_id=pad,
                **(kw if sample else dict(do_sample=False)),
            )
        if out.shape[1] != query.shape[1] + n:  # both must sample exactly B x n tokens
            raise RuntimeError(f"HF generated {out.shape[1] - query.shape[1]} tokens, not {n}")
        return out[:, query.shape[1] :]

    return run


def bench_generate(args: Args, device, sync, meta) -> list[dict]:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else None
    rows = []
    for preset in args.presets.split(","):
        ours, hf, cfg, meta["transformers"] = model_pair(preset, args.seed, device)
        ours.eval(), hf.eval()
        B = args.gen_batch or (64 if preset == "tiny" or device.type == "cuda" else 8)
        pad, n = cfg.vocab_size - 1, args.new_tokens  # pad: the last id, GPT-2's <|endoftext|>
        query = left_padded_prompts(B, args.prompt_len, pad, args.seed, device)
        fns = {
            "ours": sampler(ours, query, pad, n, ctx=ctx),
            "hf": sampler(hf, query, pad, n, ctx=ctx),
        }
        sec, _, times = interleaved(fns, args.repeats, args.min_time, sync)
        greedy = [sampler(m, query, pad, n, sample=False)() for m in (ours, hf)]  # in fp32
        same = int((greedy[0] == greedy[1]).all(1).sum())
        row = {"preset": preset, "dtype": dtype, "B x (prompt+new)": f"{B}x({args.prompt_len}+{n})"}
        row |= {"ours tok/s": B * n / sec["ours"], "HF tok/s": B * n / sec["hf"]}
        row |= speedup(times, "ours", "hf", "ours/HF")
        row["greedy fp32 identical"] = f"{'yes' if same == B else 'NO'} ({same}/{B} rows)"
        rows += show([row])
    return rows


def bench_memory(args: Args, device) -> tuple[list[dict], list[dict]]:
    """MEASURED: the memory worker under torchrun once per rank count (rank 0 prints one JSON line
    for all ranks); then the COMPUTED table of expected_memory."""
    rows, checkpoint = [], tempfile.mkdtemp(prefix="bench_memory_")
    torch.manual_seed(args.seed)
    gpt2.save(gpt2.GPT(config(args.memory_preset)), checkpoint)  # the workers load it
    for n in [int(r) for r in args.memory_ranks.split(",")]:
        if device.type == "cuda" and n > torch.cuda.device_count():
            print(f"skipped {n} ranks: {torch.cuda.device_count()} GPU(s)")
            continue
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        flags = ["--memory_preset", args.memory_preset, "--memory_shape", args.memory_shape]
        cmd = [*torchrun, f"--nproc_per_node={n}", os.path.abspath(__file__), *flags]
        cmd += ["--seed", str(args.seed), "--sections", "memory_worker"]
        cmd += ["--memory_checkpoint", checkpoint]
        # glibc's adaptive mmap threshold keeps freed FSDP all-gather buffers in the heap (GBs of
        # RSS on CPU for gpt2): a fixed threshold hands them back, so RSS tracks the live tensors
        defaults = dict(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
        env = os.environ | {k: os.environ.get(k, v) for k, v in defaults.items()}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("MEMORY_JSON ")]
        if proc.returncode or not lines:
            log = f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            raise RuntimeError(f"memory worker on {n} ranks failed:\n{log}")
        ranks = json.loads(lines[0].removeprefix("MEMORY_JSON "))
        mb = {k: max(r[k] for r in ranks) / 2**20 for k in ranks[0]}  # the largest rank's
        row = {"ranks": n, "preset": args.memory_preset, "B x T": args.memory_shape}
        row |= {"params MB/rank": mb["params"], "grads MB/rank": mb["grads"]}
        row |= {"Adam MB/rank": mb["adam"], "RSS loaded MB/rank": mb["built_rss"]}
        row |= {"peak RSS MB/rank": mb["peak_rss"]}
        if "cuda_peak" in mb:
            row["CUDA peak MB/rank"] = mb["cuda_peak"]
        rows += show([row])
    shutil.rmtree(checkpoint)
    return rows, expected_table(args)


# how many models each script holds, trained and frozen (GPT or scalar head), the sequences of
# one training micro-batch of 8 (dpo and reward: 8 pairs), which of them produce logits, and the
# sequences it samples at once (ppo, reward: a micro-batch; grpo: its whole batch, 32 x 8, / N)
SCRIPT_SHAPES = {
    "sft": dict(trained=1, frozen=0, seqs=8, logit_seqs=8, sampled=0),
    "reward": dict(trained=1, frozen=1, seqs=16, logit_seqs=0, sampled=8),
    "dpo": dict(trained=1, frozen=0, seqs=16, logit_seqs=16, sampled=0),
    "ppo": dict(trained=2, frozen=2, seqs=16, logit_seqs=8, sampled=8),
    "grpo": dict(trained=1, frozen=1, seqs=8, logit_seqs=8, sampled=256),
}


def expected_memory(script, preset, response_length, ranks, checkpointing, prompt_length=128):
    """COMPUTED GiB per rank of a script on GPUs (bf16 under FSDP2), and the phase that peaks:
    shards + max(training, sampling). A model, not a measurement (see NOTES["expected"])."""
    cfg, shape = config(preset), SCRIPT_SHAPES[script]
    L, C, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    block = 12 * C * C + 13 * C  # a block's parameters
    root = (V + cfg.block_size + 2) * C  # wte (tied to lm_head), wpe, ln_f
    params = L * block + root
    # shards: trained fp32 params + grads + Adam m, v; frozen bf16 blocks and fp32 root
    shards = (16 * params * shape["trained"] + (2 * L * block + 4 * root) * shape["frozen"]) / ranks
    T, S = prompt_length + response_length, shape["seqs"]
    per_token = 2 * C * L + 34 * C if checkpointing else 34 * C * L  # bf16 saved for backward
    mask = S * T * T * (3 if checkpointing else 2 * L)  # the bool mask, as a bf16 bias per layer
    head = 4 * V * shape["logit_seqs"] * response_length  # fp32 logits; their gradient over them
    gathered = (4 * root + 8 * block) * min(shape["trained"], 2)  # fp32 root, 2 blocks + grads
    train = gathered + S * T * per_token + mask + head
    batch = -(-shape["sampled"] // ranks) if script == "grpo" else shape["sampled"]
    kv = 2 * 2 * L * batch * T * C  # keys and values in bf16
    sample = (4 * root + 2 * L * block + kv) if batch else 0  # the whole policy gathered
    phase = "train" if train >= sample else "sample"
    return (shards + max(train, sample)) / 2**30, phase


def expected_table(args: Args) -> list[dict]:
    """COMPUTED: expected_memory per script at gpt2-large and gpt2-xl, 256 and 512 response tokens;
    each cell 'without / with activation checkpointing', * where sampling sets the peak."""
    rows, ranks = [], [int(r) for r in args.expected_ranks.split(",")]
    for script in SCRIPT_SHAPES:
        row = {"COMPUTED GiB per GPU": script}
        for preset in ("gpt2-large", "gpt2-xl"):
            for length in (256, 512):
                for n in ranks:
                    cells = [expected_memory(script, preset, length, n, ckpt) for ckpt in (0, 1)]
                    text = [f"{gib:.1f}" + ("*" if ph == "sample" else "") for gib, ph in cells]
                    name = f"{preset.removeprefix('gpt2-')} {length}, {n} GPU" + "s" * (n > 1)
                    row[name] = " / ".join(text)
        rows.append(row)
    return rows


def bench_optimizer(args: Args, device, sync) -> list[dict]:
    rows = []
    for preset in args.presets.split(","):
        torch.manual_seed(args.seed)
        model = gpt2.GPT(config(preset)).to(device)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        kinds = dict(
            for_loop=dict(foreach=False), foreach=dict(foreach=True), fused=dict(fused=True)
        )
        fns = {
            k: torch.optim.AdamW(model.parameters(), lr=1e-5, **kw).step for k, kw in kinds.items()
        }
        sec, _, times = interleaved(fns, args.repeats, args.min_time, sync)
        n_params = sum(p.numel() for p in model.parameters())
        row = {"preset": preset, "params": f"{n_params / 1e6:.1f}M"}
        row |= {f"{k} ms": 1e3 * sec[k] for k in kinds}
        row |= speedup(times, "fused", "foreach", "fused/foreach")
        rows += show([row | speedup(times, "fused", "for_loop", "fused/for-loop")])
    return rows


def onednn(x, w):  # x @ w through oneDNN, w (in, out)
    return torch.ops.mkldnn._linear_pointwise(x, w.t(), None, "none", [], "")


def gemm_fns(x, w, g):
    """The forward x @ w, the input's gradient g @ w.T and the weight's x.T @ g, MKL and oneDNN."""
    return {
        "fwd mkl": lambda: x @ w,
        "fwd onednn": lambda: onednn(x, w),
        "dx mkl": lambda: g @ w.t(),
        "dx onednn": lambda: onednn(g, w.t()),
        "dw mkl": lambda: x.t() @ g,
        "dw onednn": lambda: onednn(x.t(), g),
    }


def decode_fns(xs, weights):
    """A decode step's GEMMs, each layer's own weight in model order, and reading every weight."""
    return {
        "decode mkl": lambda: [xs[w.shape[0]] @ w for w in weights],
        "decode onednn": lambda: [onednn(xs[w.shape[0]], w) for w in weights],
        "read weights": lambda: [w.sum() for w in weights],
    }


def bench_gemm(args: Args, device, sync) -> tuple[list[dict], list[dict]]:
    """MKL vs oneDNN for each linear layer's shape, (rows, in) @ (in, out) with the weight stored
    (in, out) as in gpt2.py, at gen_batch rows (a decode step) and at a training batch's rows; then
    one decode step's GEMMs over every layer's own weight (weights streamed from memory as in
    generation) against reading every weight once."""
    rows, decode = [], []
    for preset in args.presets.split(","):
        cfg = config(preset)
        C, gen_rows = cfg.n_embd, args.gen_batch or (64 if preset == "tiny" else 8)
        # the GRPO benchmark's batch x (prompt + response)
        train_rows = (128 if preset == "tiny" else 8) * 22
        torch.manual_seed(args.seed)
        for m in (gen_rows, train_rows):
            for k, n in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C), (C, cfg.vocab_size)):
                fns = gemm_fns(torch.randn(m, k), torch.randn(k, n), torch.randn(m, n))
                sec, _, times = interleaved(fns, args.repeats, args.min_time, sync)
                row = {"preset": preset, "rows x in x out": f"{m}x{k}x{n}"}
                row |= {f"{f} us": 1e6 * t for f, t in sec.items()}
                for part in ("fwd", "dx", "dw"):
                    row |= speedup(times, f"{part} onednn", f"{part} mkl", f"{part} mkl/onednn")
                rows += show([row])
        shapes = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)] * cfg.n_layer
        weights = [torch.randn(k, n) for k, n in shapes]
        xs = {k: torch.randn(gen_rows, k) for k in (C, 4 * C)}
        sec, _, times = interleaved(decode_fns(xs, weights), args.repeats, args.min_time, sync)
        row = {"preset": preset, "rows": gen_rows, "GEMMs": len(weights)}
        row |= {f"{f} ms": 1e3 * t for f, t in sec.items()}
        decode += show([row | speedup(times, "decode onednn", "decode mkl", "mkl/onednn")])
    return rows, decode


def train_rows(model, ids, keep_from, min_rows=gpt2.ONEDNN_MIN_ROWS):
    """A call: forward + backward of the rows ids (B, T), logits from keep_from on, as the
    scripts' training forwards, with gpt2.matmul's oneDNN threshold at min_rows."""

    def step():
        gpt2.ONEDNN_MIN_ROWS = min_rows
        logits = model(ids, attention_mask=torch.ones_like(ids), keep_from=keep_from)
        logits.float().log_softmax(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def bench_prompts(args: Args, device, sync) -> list[dict]:
    """Forward + backward of a step's rows (GRPO: prompts x samples, DPO: pairs x 2; 6-token
    prompts) with each row's last token left out of the input (as the scripts do) or kept, and
    (where gpt2.py uses oneDNN) with its small-weight GEMMs on oneDNN from ONEDNN_MIN_ROWS rows on
    (as it does) or always on MKL."""
    rows, min_rows_default, Tq = [], gpt2.ONEDNN_MIN_ROWS, 6
    shapes = dict(
        tiny=dict(dpo=(64, 2, 4), grpo=(16, 8, 16)), gpt2=dict(dpo=(4, 2, 4), grpo=(2, 4, 16))
    )
    for preset in args.presets.split(","):
        torch.manual_seed(args.seed)
        # the task's 257-token vocabulary at every preset, as peer_bench.py's GPT-2 124M shape
        model = gpt2.GPT(config(preset, TINY_VOCAB)).to(device).train()
        for algo, (P, G, Tr) in shapes.get(preset, shapes["gpt2"]).items():
            query = torch.randint(0, 256, (P, Tq), device=device).repeat_interleave(G, 0)
            ids = torch.cat([query, torch.randint(0, 256, (P * G, Tr), device=device)], 1)
            fns = {
                "last_out": train_rows(model, ids[:, :-1], Tq - 1),
                "last_kept": train_rows(model, ids, Tq - 1),
            }
            if gpt2.ONEDNN:
                fns["small_mkl"] = train_rows(model, ids[:, :-1], Tq - 1, min_rows=1 << 62)
            sec, _, times = interleaved(fns, args.repeats, args.min_time, sync)
            row = {"preset": preset, "rows": f"{algo}: {P} x {G} rows, {Tq} + {Tr} tokens"}
            row |= {f"{k} ms": 1e3 * v for k, v in sec.items()}
            row |= speedup(times, "last_out", "last_kept", "last token out/kept")
            if gpt2.ONEDNN:
                row |= speedup(times, "last_out", "small_mkl", "small GEMMs onednn/mkl")
            rows += show([row])
    gpt2.ONEDNN_MIN_ROWS = min_rows_default
    return rows


def memory_worker(args: Args):
    """One rank: the policy loaded as the scripts load it (gpt2.load(shard=)), one forward +
    backward of the response log-probs (gpt2.logprobs, as the scripts) + fused AdamW step at
    --memory_shape (half prompt, half response); then its bytes."""
    rank, world_size, device = setup_distributed()
    B, T = parse_shape(args.memory_shape, 2, "memory_shape")
    bf16 = device.type == "cuda"
    policy = gpt2.load(args.memory_checkpoint, shard=lambda m: shard(m, device, bf16))
    built_rss = rss()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True)
    torch.manual_seed(args.seed)
    idx = torch.randint(0, policy.config.vocab_size - 1, (B, T), device=device)  # no stop token
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    with ctx:
        logprobs = gpt2.logprobs(policy, idx[:, : T // 2], idx[:, T // 2 :])[0]
    (-logprobs.mean()).backward()
    optimizer.step()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard here
    nbytes = lambda ts: sum(local(t).numel() * t.element_size() for t in ts)
    stats = dict(params=nbytes(policy.parameters()), built_rss=built_rss)
    stats["grads"] = nbytes(p.grad for p in policy.parameters() if p.grad is not None)
    states = optimizer.state.values()
    stats["adam"] = nbytes(t for s in states for t in s.values() if t.dim() > 0)
    stats["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if device.type == "cuda":
        stats["cuda_peak"] = torch.cuda.max_memory_allocated(device)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        print("MEMORY_JSON " + json.dumps(gathered), flush=True)
    dist.destroy_process_group()


def rss():
    """This process's resident set now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


HEADS = ("fp32", "tf32", "bf16")  # the LM head's GEMM: gpt2.py's default, TF32 tensor cores, bf16


def bench_cuda(args: Args, device, sync) -> list[dict]:
    """GPT-2 124M: sft.py's bf16 training step (its loss through gpt2.logprobs, autocast, AdamW,
    clipping) with the LM head's GEMM in each of HEADS, turn about → MFU of each; a rollout →
    tokens/s (the default head)."""
    B, T = parse_shape(args.mfu_shape, 2, "mfu_shape")
    Bq, Tq, n = parse_shape(args.rollout_shape, 3, "rollout_shape")
    torch.manual_seed(args.seed)
    model = gpt2.GPT(config("gpt2")).to(device)
    cfg, ctx = model.config, torch.autocast(device.type, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    forward_model = torch.compile(model) if args.compile else model
    # one prompt token and T response tokens, none the stop token (the last id): T positions
    idx = torch.randint(0, cfg.vocab_size - 1, (B, T + 1), device=device)

    def train_step(head):
        def step():
            model.fp32_head = head != "bf16"
            torch.backends.cuda.matmul.allow_tf32 = head == "tf32"
            with ctx:
                logprobs = gpt2.logprobs(forward_model, idx[:, :1], idx[:, 1:])[0]  # (B, T)
            (-logprobs.mean()).backward()  # sft.py's loss, per token
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    fns = {head: train_step(head) for head in HEADS}
    for fn in fns.values():  # a second warmup: the first allocates the optimizer state (compiles)
        fn()
    secs, _, times = interleaved(fns, args.repeats, args.min_time, sync)
    model.fp32_head, torch.backends.cuda.matmul.allow_tf32 = gpt2.FP32_HEAD, False
    # nanoGPT's estimate (PaLM appendix B): 6 N per token for the matmuls (N without wpe; wte counts
    # as lm_head) + 12 L C T for attention scores and mixing
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
        row |= {"step ms": secs[head] * 1e3, "train tok/s": B * T / secs[head]}
        row["MFU"] = f"{flops / secs[head] / args.peak_flops:.1%} of {args.peak_flops:.3g}"
        row |= speedup(times, head, "fp32", "vs fp32 head") if head != "fp32" else {}
        rows.append(row)
    rows[0] |= {"rollout B x (prompt+new)": f"{Bq}x({Tq}+{n})", "rollout tok/s": Bq * n / gen_sec}
    return show(rows)


def main(args: Args):
    if args.sections == "memory_worker":  # internal: what bench_memory launches under torchrun
        memory_worker(args)
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter's teardown, which can abort on gloo's threads
    sections = args.sections.split(",")
    if set(sections) - set(SECTIONS):
        unknown = sorted(set(sections) - set(SECTIONS))
        raise gpt2.RunError(f"--sections: unknown {unknown}: use some of {','.join(SECTIONS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    name = f"cpu, {torch.get_num_threads()} threads"
    name = torch.cuda.get_device_name() if device.type == "cuda" else name
    meta = dict(device=name, torch=torch.__version__, args=asdict(args))
    print(f"device: {meta['device']} | torch {torch.__version__}", flush=True)
    results = {"meta": meta}
    for section in sections:
        print(f"\n## {section}\n\n{NOTES[section]}\n", flush=True)
        if section == "forward":
            results[section] = bench_forward(args, device, sync, meta)
        elif section == "generate":
            results[section] = bench_generate(args, device, sync, meta)
        elif section == "memory":
            results[section], results["expected"] = bench_memory(args, device)
            print(f"\n{NOTES['expected']}\n\n{markdown(results['expected'])}", flush=True)
        elif section == "optimizer":
            results[section] = bench_optimizer(args, device, sync)
        elif section == "gemm":
            gemm = torch.backends.mkldnn.is_available()
            results[section], results["gemm_decode"] = (
                bench_gemm(args, device, sync) if gemm else ([], [])
            )
        elif section == "prompts":
            results[section] = bench_prompts(args, device, sync)
        elif device.type == "cuda":
            results[section] = bench_cuda(args, device, sync)
        else:
            print("skipped: no CUDA device")
    versions = f"torch {meta['torch']}, transformers {meta.get('transformers', '-')}"
    print(f"\n# summary ({meta['device']}, {versions})")
    for section, rows in results.items():
        if section != "meta" and rows:
            print(f"\n## {section}\n\n{NOTES[section]}\n\n{markdown(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
