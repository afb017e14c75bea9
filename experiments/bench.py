"""Speed of gpt2.py against Hugging Face transformers, side by side in one run (not a test).

Sections (--sections):
  forward   forward + backward tokens/s of gpt2.GPT and transformers.GPT2LMHeadModel, the
            same weights and batch; fp32 and bf16 autocast; --compile adds torch.compile(ours)
  decode    ms per decode step of the tiny model at batch 64: this tree's gpt2.py against
            the one at git ref --baseline (imported as gpt2_baseline), the same weights
  padding   the share of real tokens in each script's micro-batches (8, 16, 32 and its default
            rows), over --pad_batches random ones, on the data sets below (no model)
  prefix    gpt2.generate of --gen_batch rows in groups of G equal prompts (GRPO's samples of
            one prompt, G in --group_sizes): the prefill once per group (group_size=G) against
            once per row, the same uniforms; each of --presets
  packing   each script's training pass (forward + backward of one default micro-batch),
            packed (padding-free, gpt2.pack) against padded, and the share of its tokens that
            are real: the tiny model on the offline task; GPT-2 124M on HH-RLHF pairs (--hh)
            and GSM8K (--gsm8k), each prepared by data.prep as README says

Turns are interleaved (ours, HF, ours, HF, ...) after a warmup, so load on a shared machine
hits both alike; a ratio is the median over turns of the ratio within one turn, with its
range. Weights are random: speed does not depend on them. The GPU's figures (MFU, sampling
against the bandwidth limit) and sampling against HF `generate` are experiments/gpu_check.py's
(`--device cpu` runs them on CPU at tiny sizes).

    python experiments/bench.py  # forward: minutes on 2 cores
    python experiments/bench.py --sections decode --baseline 427b2e5
    python experiments/bench.py --sections forward --presets tiny --compile --out bench.json
    python experiments/bench.py --sections prefix --presets tiny --gen_batch 256 --prompt_len 14
    python experiments/bench.py --sections packing --hh runs/data/hh --gsm8k runs/data/gsm8k
"""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
import tyro

# gpt2.py lives at the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import data  # noqa: E402
import gpt2  # noqa: E402

SECTIONS = ("forward", "decode", "prefix", "padding", "packing")


@dataclass
class Args:
    sections: str = "forward"  # comma-separated: forward, decode, prefix, padding, packing
    presets: str = "tiny,gpt2"  # comma-separated gpt2.py presets (not decode's: tiny)
    dtypes: str = "auto"  # forward: float32 and/or bfloat16; auto: both on CPU, bf16 on CUDA
    fwd_shape: str = "auto"  # forward: B x T; auto: 64x64 tiny, else 2x128 CPU, 8x1024 CUDA
    compile: bool = False  # forward: also time torch.compile(ours)
    gen_batch: int = 64  # decode, prefix: rows per call
    prompt_len: int = 16  # decode, prefix: longest prompt (half to all of it, left-padded)
    new_tokens: int = 32  # decode, prefix: tokens sampled per row (decode: and half as many)
    group_sizes: str = "4,8,16"  # prefix: comma-separated G, each dividing --gen_batch
    repeats: int = 7  # timed turns per variant after one warmup call; medians are reported
    min_time: float = 0.3  # seconds one timed turn lasts at least (short calls are looped)
    baseline: str = "427b2e5"  # decode: the git ref of the gpt2.py to compare with
    hh: str = ""  # packing: an HH-RLHF data dir from data.prep (GPT-2 tokenizer); "" skips it
    gsm8k: str = ""  # packing: a GSM8K data dir from data.prep (GPT-2 tokenizer); "" skips it
    passes: str = "sft,reward,dpo,grpo"  # packing: the scripts' passes to time
    pack_repeats: int = 3  # packing: timed turns per variant (a 124M pass takes a minute)
    pad_batches: int = 200  # padding: random micro-batches per pass and size
    policy: str = ""  # packing: a trained tiny policy (runs/sft/latest) for grpo's rollouts
    ragged: bool = False  # packing: grpo's tiny responses stop at random columns (an early policy)
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
        B, T = map(int, shape.split("x"))
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


def gpt2_at(ref):
    """gpt2.py as it was at git ref, imported as gpt2_baseline."""
    show = ["git", "show", f"{ref}:gpt2.py"]
    source = subprocess.run(show, cwd=ROOT, capture_output=True, text=True)
    if source.returncode:
        raise gpt2.RunError(f"--baseline {ref}: {source.stderr.strip()}")
    path = os.path.join(tempfile.mkdtemp(), "gpt2_baseline.py")
    with open(path, "w") as f:
        f.write(source.stdout)
    spec = importlib.util.spec_from_file_location("gpt2_baseline", path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up here
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def bench_decode(args, device, sync):
    """Time per decode step of the tiny model, this tree's gpt2.py against --baseline's, the same
    weights and prompts. A step's time is (t(n) - t(n / 2)) / (n / 2) of two generate calls of n
    and n / 2 new tokens, so that the prefill cancels."""
    trees = {"this tree": gpt2, f"gpt2.py at {args.baseline}": gpt2_at(args.baseline)}
    B = args.gen_batch
    n = args.new_tokens
    fns = {}
    weights = None
    for name, module in trees.items():
        model = module.GPT(module.GPTConfig(**gpt2.PRESETS["tiny"], vocab_size=257))
        # the first tree's random init, in both
        weights = weights or model.state_dict()
        model.load_state_dict(weights)
        model.to(device).eval()
        pad = model.config.vocab_size - 1
        query = left_padded_prompts(B, args.prompt_len, pad, args.seed, device)
        for tokens in (n, n // 2):
            # eos None: every call samples all its tokens (generate is no_grad in both)
            fns[name, tokens] = partial(module.generate, model, query, pad, tokens, None, 1.0)
    times = interleaved(fns, args.repeats, args.min_time, sync)[2]
    steps = {}
    for name in trees:
        pairs = zip(times[name, n], times[name, n // 2])
        steps[name] = [(long - short) / (n - n // 2) for long, short in pairs]
    baseline = list(trees)[1]
    row = {"B x (prompt+new)": f"{B}x({args.prompt_len}+{n})"}
    for name, secs in steps.items():
        ms = [s * 1e3 for s in secs]
        row[f"{name}: ms/step"] = f"{statistics.median(ms):.2f} ({min(ms):.2f}–{max(ms):.2f})"
    row |= speedup(steps, "this tree", baseline, "this tree faster by")
    return [show(row)]


def sample(ctx, model, query, pad, noise, group_size):
    """One generate call of noise.shape[1] tokens, no stop token, in ctx."""
    with ctx:
        gpt2.generate(
            model,
            query,
            pad_token_id=pad,
            max_new_tokens=noise.shape[1],
            noise=noise,
            group_size=group_size,
        )


def bench_prefix(args, device, sync):
    """generate's seconds per call with the prefill once per group of G equal prompts against
    once per row: the same weights, prompts and uniforms, bf16 autocast on CUDA as the scripts."""
    ctx = nullcontext()
    if device.type == "cuda":
        ctx = torch.autocast("cuda", torch.bfloat16)
    rows = []
    for preset in args.presets.split(","):
        torch.manual_seed(args.seed)
        model = gpt2.GPT(config(preset)).to(device).eval()
        pad = model.config.vocab_size - 1
        for G in [int(g) for g in args.group_sizes.split(",")]:
            if args.gen_batch % G:
                raise gpt2.RunError(
                    f"--group_sizes {G} does not divide --gen_batch {args.gen_batch}"
                )
            prompts = left_padded_prompts(
                args.gen_batch // G, args.prompt_len, pad, args.seed, device
            )
            query = prompts.repeat_interleave(G, 0)  # (B, Tq)
            g = torch.Generator().manual_seed(args.seed)
            noise = torch.rand(args.gen_batch, args.new_tokens, generator=g).to(device)
            call = partial(sample, ctx, model, query, pad, noise)
            fns = {"per row": partial(call, 1), "per group": partial(call, G)}
            medians, _, times = interleaved(fns, args.repeats, args.min_time, sync)
            shape = f"{args.gen_batch}x({args.prompt_len}+{args.new_tokens})"
            row = {"preset": preset, "B x (prompt+new)": shape, "G": G}
            row["per row: ms"] = medians["per row"] * 1e3
            row["per group: ms"] = medians["per group"] * 1e3
            row |= speedup(times, "per group", "per row", "per group faster by")
            rows.append(show(row))
    return rows


# The scripts' default micro-batches, in rows per forward: reward and dpo score a pair's two
# responses in one pass. grpo's pass is the policy's log-probs with the entropy.
PASS_ROWS = {"sft": 32, "reward": 64, "dpo": 64, "grpo": 64}
# The passes each data set feeds: preference pairs, or prompts with demonstrations.
PASSES = {"arithmetic": ("sft", "reward", "dpo", "grpo"), "hh": ("reward", "dpo")}
PASSES["gsm8k"] = ("sft", "grpo")
# GRPO's responses on GSM8K: the answers, cut where --response_length 256 cuts a rollout.
GSM8K_RESPONSE = 256


def pass_batch(split, name, rows, pad, rng, response_length=None):
    """query (B, Tq), response (B, Tr) of one random micro-batch of a split for a script's pass:
    a pair's chosen and rejected responses as two rows (reward, dpo), else query and response."""
    pairs = name in ("reward", "dpo")
    n = rows // 2 if pairs else rows
    idx = rng.choice(len(split["query"]), n, replace=False)
    query = torch.from_numpy(split["query"][idx]).long()
    if pairs:
        responses = [torch.from_numpy(split[key][idx]).long() for key in data.PAIR]
        width = max(r.size(1) for r in responses)
        responses = [F.pad(r, (0, width - r.size(1)), value=pad) for r in responses]
        return query.repeat(2, 1), torch.cat(responses)
    response = torch.from_numpy(split["response"][idx]).long()
    if response_length:
        response = response[:, :response_length]
    return query, response


def pass_step(model, name, query, response, packing):
    """A call: one forward + backward of a script's training pass on query, response."""
    pad = model.config.pad_token_id
    eos = model.config.eos_token_id

    def step():
        model.packing = packing
        model.zero_grad(set_to_none=True)
        if name == "reward":
            q, r = gpt2.trim_padding(query, response, pad, eos)
            loss = gpt2.get_reward(model, q, r, pad, eos).sum()
        else:
            logps, entropy = gpt2.logprobs(model, query, response, entropy=name == "grpo")
            loss = logps.sum()
            if entropy is not None:
                loss = loss + 0.01 * entropy.sum()
        loss.backward()

    return step


def real_share(query, response, pad, eos):
    """The share of a trimmed micro-batch's tokens that are real (query + response to its stop)."""
    q, r = gpt2.trim_padding(query, response, pad, eos)
    real = (q != pad).sum() + gpt2.response_mask(r, eos).sum()
    return (real / (q.numel() + r.numel())).item()


def data_cases(args):
    """(preset, data dir or builtin name, kind) of each data set to measure."""
    cases = [("tiny", "arithmetic", "arithmetic")]
    if args.hh:
        cases.append(("gpt2", args.hh, "hh"))
    if args.gsm8k:
        cases.append(("gpt2", args.gsm8k, "gsm8k"))
    return cases


def pass_split(path, name):
    split_name = "pref_train" if name in ("reward", "dpo") else "sft_train"
    return data.load_split(path, split_name)


def bench_padding(args):
    """The share of real tokens in the scripts' micro-batches, over many random ones."""
    rows = []
    for _, path, kind in data_cases(args):
        meta = data.load_meta(path)
        pad = meta["pad_token_id"]
        eos = meta["eos_token_id"]
        for name in PASSES[kind]:
            split = pass_split(path, name)
            cut = GSM8K_RESPONSE if kind == "gsm8k" and name == "grpo" else None
            row = {"pass": name, "data": kind}
            for size in sorted({8, 16, 32, PASS_ROWS[name]}):
                rng = np.random.default_rng(args.seed)
                shares = []
                for _ in range(args.pad_batches):
                    query, response = pass_batch(split, name, size, pad, rng, cut)
                    shares.append(real_share(query, response, pad, eos))
                row[f"real share, {size} rows"] = statistics.mean(shares)
            rows.append(show(row))
    return rows


def bench_packing(args, device, sync):
    """Packed against padded, per pass and data set: real tokens per second and the speed-up, on
    one random micro-batch of the script's default size (its real share printed beside)."""
    rows = []
    for preset, path, kind in data_cases(args):
        meta = data.load_meta(path)
        cfg = gpt2.GPTConfig(**gpt2.PRESETS[preset], vocab_size=meta["vocab_size"])
        cfg.pad_token_id = meta["pad_token_id"]
        cfg.eos_token_id = meta["eos_token_id"]
        pad = cfg.pad_token_id
        eos = cfg.eos_token_id
        torch.manual_seed(args.seed)
        backbone = gpt2.GPT(cfg).to(device)
        models = {"reward": gpt2.ScalarModel(backbone).to(device)}
        for name in PASSES[kind]:
            if name not in args.passes.split(","):
                continue
            split = pass_split(path, name)
            cut = GSM8K_RESPONSE if kind == "gsm8k" and name == "grpo" else None
            rng = np.random.default_rng(args.seed)
            query, response = pass_batch(split, name, PASS_ROWS[name], pad, rng, cut)
            if kind == "arithmetic" and name == "grpo" and args.policy:
                response = rollouts(args.policy, meta, query)
            if kind == "arithmetic" and name == "grpo" and args.ragged:
                response = random_stops(len(query), pad, eos, args.seed)
            query = query.to(device)
            response = response.to(device)
            model = models.get(name, backbone)
            fns = {}
            fns["packed"] = pass_step(model, name, query, response, packing=True)
            fns["padded"] = pass_step(model, name, query, response, packing=False)
            sec, first, times = interleaved(fns, args.pack_repeats, args.min_time, sync)
            tokens = (query != pad).sum() + gpt2.response_mask(response, eos).sum()
            row = {"pass": name, "model": preset, "data": kind, "rows": len(query)}
            row["real share"] = real_share(query, response, pad, eos)
            row["packed tok/s"] = tokens.item() / sec["packed"]
            row["padded tok/s"] = tokens.item() / sec["padded"]
            row |= speedup(times, "packed", "padded", "packed/padded")
            rows.append(show(row))
    return rows


def random_stops(rows, pad, eos, seed):
    """Responses (rows, 16) of random tokens, each stopping at a random column 2..15, pads after:
    the ragged rollouts of a policy that still errs."""
    g = torch.Generator().manual_seed(seed)
    response = torch.randint(0, pad, (rows, 16), generator=g)
    stops = torch.randint(2, 16, (rows, 1), generator=g)
    response[torch.arange(16) == stops] = eos
    response[torch.arange(16) > stops] = pad
    return response


def rollouts(policy_dir, meta, query):
    """Responses (B, 16) sampled from a trained policy at grpo.py's defaults: ragged, as RL's."""
    policy = gpt2.load(policy_dir, meta)
    noise = torch.rand(len(query), 16, generator=torch.Generator().manual_seed(0))
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    rollout = gpt2.generate(policy, query, pad, 16, eos, temperature=1.0, noise=noise)
    return rollout.response


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
        elif section == "prefix":
            results[section] = bench_prefix(args, device, sync)
        elif section == "padding":
            results[section] = bench_padding(args)
        elif section == "packing":
            results[section] = bench_packing(args, device, sync)
        else:
            results[section] = bench_decode(args, device, sync)
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
    main(tyro.cli(Args, use_underscores=True))
