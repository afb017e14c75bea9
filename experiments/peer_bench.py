"""Peer benchmark: this project's training scripts against TRL's trainers at equal work (CPU).

  sft   sft.py vs trl.SFTTrainer, tokens/s
  dpo   dpo.py vs trl.DPOTrainer, its default (a reference forward every step) and
        precompute_ref_log_probs=True (dpo.py scores the reference before step 0), pairs/s
  grpo  grpo.py vs trl.GRPOTrainer at beta 0 and 0.03, the task's verifier, episodes/s

On the tiny model and the GPT-2 124M shape (vocab 257). TRL 1.16 has no PPO trainer. Equal
work: the same weights (checked equal logits), rows, batch sizes, response lengths, steps,
fp32, a log row every step; what still differs is printed with each section. Each run is
its own process, its steps timed from one optimizer step's end to the next after --warmup;
the sides alternate (ABBA over turns), and each comparison is the median and range over
turns of the ratio ours / TRL, with each process's peak RSS. Setup and figures:
docs/benchmarks.md. It needs TRL in a venv of its own, where our scripts run too:

    python3 -m venv /work/peer-venv
    /work/peer-venv/bin/pip install -r experiments/requirements-peer.txt
    /work/peer-venv/bin/python experiments/peer_bench.py  # all: ~8 min on 2 quiet cores
    /work/peer-venv/bin/python experiments/peer_bench.py --turns 1 --steps 3 --warmup 1
"""

import json
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("sft", "dpo", "grpo")
# Sizes per preset: the 124M shape gets smaller batches, so that a full run fits ~10 minutes
# on 2 cores. steps includes the warmup steps; only steps - warmup are timed.
PRESETS = {
    "tiny": dict(sft_batch=64, dpo_batch=64, grpo_prompts=16, grpo_samples=8, response_length=16),
    "gpt2": dict(sft_batch=8, dpo_batch=4, grpo_prompts=2, grpo_samples=4, response_length=16),
}
PRESETS["tiny"] |= dict(steps=dict(sft=30, dpo=30, grpo=10), warmup=dict(sft=5, dpo=5, grpo=2))
PRESETS["gpt2"] |= dict(steps=dict(sft=8, dpo=8, grpo=6), warmup=dict(sft=2, dpo=2, grpo=2))
# the same on both sides; speed does not depend on it
LR = 1e-5
GRPO_BETAS = (0.0, 0.03)
# rows in each test split: the scripts' evaluations (at step 0, and never again) stay short
EVAL_ROWS = 16
# --eval_every: no evaluation inside the timed steps
NEVER = 10**9


@dataclass
class Args:
    sections: str = "sft,dpo,grpo"  # comma-separated sections: sft, dpo, grpo
    presets: str = "tiny,gpt2"  # shapes: tiny (gpt2.py's preset), gpt2 (124M, 257-token vocab)
    turns: int = 3  # runs of each side per comparison, alternated; ratios are medians over turns
    steps: int = 0  # optimizer steps per run, warmup included (0: the preset's)
    warmup: int = 0  # untimed first steps per run, at least 1 (0: the preset's)
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: autocast on both sides
    out: str = ""  # also write every run's numbers to this JSON file
    timeout: float = 600.0  # seconds after which one run is killed (the benchmark stops)
    compare_gemm: bool = False  # also run ours with GPT2_CPU_GEMM=mkl in the same turns


# ---------------------------------------------------------------------------------------
# Children: one training run each, started as `python peer_bench.py --child SPEC.json`


def write_result(spec, ends, lengths):
    """The step-end times and the mean tokens per response (None: nothing sampled)."""
    length = statistics.mean(lengths) if lengths else None
    with open(spec["result"], "w") as f:
        json.dump(dict(ends=ends, response_length=length), f)


def child_ours(spec):
    """One of our scripts in this process, a global optimizer-step hook timing its
    steps; exit right after the last one, before its logging, as TRL's on_step_end (no
    eval, no save)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    ends = []

    def hook(optimizer, args, kwargs):
        ends.append(time.perf_counter())
        if len(ends) < spec["steps"]:
            return
        rows = []
        path = os.path.join(spec["out_dir"], "metrics.jsonl")
        if os.path.isfile(path):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        key = "objective/response_length"
        write_result(spec, ends, [row[key] for row in rows if key in row])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    register_optimizer_step_post_hook(hook)
    script = os.path.join(ROOT, spec["script"])
    sys.path.insert(0, ROOT)
    sys.argv = [script, *spec["argv"]]
    runpy.run_path(script, run_name="__main__")
    sys.exit(f"{spec['script']} ran {len(ends)} optimizer steps, fewer than {spec['steps']}")


def byte_tokenizer():
    """The task's `bytes` tokenizer as a transformers tokenizer: byte b is id b,
    <|endoftext|> is 256 (stop and pad). A BPE without merges over GPT-2's
    byte-to-unicode alphabet: each byte is one token, offline, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the bytes GPT-2 maps to themselves; the others to chr(256 + i)
    spans = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    printable = [b for lo, hi in spans for b in range(ord(lo), ord(hi) + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    eot = "<|endoftext|>"
    vocab = {char[b]: b for b in range(256)} | {eot: 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, pad_token=eot)


def text_rows(split, meta, columns):
    """A split's arrays as the text columns TRL takes: prompt, completion, chosen,
    rejected, ground_truth (the stop token left out: TRL appends it, as our data has
    it)."""
    import data

    enc = data.get_encoding(meta["tokenizer"])
    pad, eos = meta["pad_token_id"], meta["eos_token_id"]
    rows = {"prompt": [enc.decode([t for t in q.tolist() if t != pad]) for q in split["query"]]}
    for name in ("response", "chosen", "rejected"):
        if name in split:
            texts = []
            for row in split[name].tolist():
                texts.append(enc.decode(row[: (row + [eos]).index(eos)]))
            rows["completion" if name == "response" else name] = texts
    if "ground_truth" in split:
        rows["ground_truth"] = [str(g) for g in split["ground_truth"]]
    return {name: rows[name] for name in columns}


def child_trl(spec):
    """One TRL run with a step-timing callback; exit right after the last step."""
    sys.path.insert(0, ROOT)
    import datasets
    import torch
    import transformers
    import trl

    import data

    meta = data.load_meta(spec["data"])
    split = data.load_split(spec["data"], spec["split"])
    model = transformers.GPT2LMHeadModel.from_pretrained(spec["model"], dtype=torch.float32)
    ends = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            if len(ends) == spec["steps"]:
                key = "completions/mean_length"
                write_result(spec, ends, [r[key] for r in state.log_history if key in r])
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)

    common = dict(output_dir=spec["out_dir"], max_steps=spec["steps"], seed=1, use_cpu=True)
    common |= dict(per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1)
    common |= dict(learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1)
    common |= dict(save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True)
    common |= dict(gradient_checkpointing=False, bf16=spec["dtype"] == "bfloat16")
    common["dataloader_num_workers"] = 0
    hooks = dict(processing_class=byte_tokenizer(), callbacks=[StepTimer()])
    if spec["kind"] == "sft":
        rows = text_rows(split, meta, ("prompt", "completion"))
        cfg = trl.SFTConfig(**common, completion_only_loss=True, packing=False, max_length=None)
        train = datasets.Dataset.from_dict(rows)
        trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=train, **hooks)
    elif spec["kind"] == "dpo":
        rows = text_rows(split, meta, ("prompt", "chosen", "rejected"))
        dpo = dict(beta=0.1, loss_type=["sigmoid"], max_length=None)
        dpo["precompute_ref_log_probs"] = spec["precompute"]
        cfg = trl.DPOConfig(**common, **dpo)
        train = datasets.Dataset.from_dict(rows)
        trainer = trl.DPOTrainer(model=model, args=cfg, train_dataset=train, **hooks)
    else:
        rows = text_rows(split, meta, ("prompt", "ground_truth"))

        # scores the text before the stop token, as grpo.py does
        def verifier(completions, ground_truth, **kwargs):
            return [data.verify(meta["task"], c, g) for c, g in zip(completions, ground_truth)]

        grpo = dict(num_generations=spec["samples"], max_completion_length=spec["response_length"])
        grpo |= dict(steps_per_generation=1, num_iterations=1, temperature=1.0, top_k=0, top_p=1.0)
        grpo |= dict(beta=spec["beta"], epsilon=0.2, loss_type="dapo", scale_rewards="group")
        cfg = trl.GRPOConfig(**common, **grpo)
        train = datasets.Dataset.from_dict(rows)
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=[verifier], args=cfg, train_dataset=train, **hooks
        )
    trainer.train()
    sys.exit(f"TRL {spec['kind']} ran {len(ends)} optimizer steps, fewer than {spec['steps']}")


# ---------------------------------------------------------------------------------------
# Setup in the parent: models, datasets, the runs of each comparison


def build_model(preset, vocab_size, eos_token_id, out_dir):
    """A random init (seed 0) of gpt2.py's preset saved in the HF layout; returns the
    max |logit difference| of gpt2.GPT and transformers.GPT2LMHeadModel loaded from that
    file."""
    import torch
    import transformers

    import gpt2

    torch.manual_seed(0)
    # config.json's stop and pad tokens, for HF
    stop = dict(eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    cfg = gpt2.GPTConfig(**gpt2.PRESETS[preset], vocab_size=vocab_size, **stop)
    model = gpt2.GPT(cfg).eval()
    gpt2.save(model, out_dir)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out_dir, dtype=torch.float32).eval()
    idx = torch.randint(0, vocab_size, (2, 12))
    with torch.no_grad():
        return (model(idx) - hf(idx).logits).abs().max().item()


def build_data(out_dir, split, rows):
    """The first `rows` rows of one train split of the arithmetic task and EVAL_ROWS of
    every other split, as a dataset dir our scripts read with --data; returns the mean
    tokens per SFT row (prompt + response + stop token)."""
    import contextlib

    import numpy as np

    import data

    meta = data.load_meta("arithmetic")
    splits = {}
    for name in data.SPLITS:
        size = rows if name == split else EVAL_ROWS
        arrays = data.load_split("arithmetic", name)
        splits[name] = {k: v[:size] for k, v in arrays.items()}
    # write_dataset prints a line per dir
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        data.write_dataset(out_dir, meta, splits)
    sft = splits["sft_train"]
    # response tokens up to and including the stop token
    response = (np.cumsum(sft["response"] == meta["eos_token_id"], 1) == 0).sum(1) + 1
    prompt = (sft["query"] != meta["pad_token_id"]).sum(1)
    return float((prompt + response).mean())


def flags(**kw):
    """Command-line flags: flags(batch_size=8) == ["--batch_size", "8"]."""
    return [arg for k, v in kw.items() for arg in (f"--{k}", str(v))]


# the differences left, printed with each section (docs/benchmarks.md has them in full)
PADDING = "padding: ours pads prompts left, responses right; TRL right-pads whole rows"
ORDER = "data order: the same rows, in each side's own shuffled order"
GRPO_NOTES = [
    "generation: gpt2.generate vs HF generate, up to {R} tokens at temperature 1",
    "TRL takes the sampler's log-probs from the training forward, no reference at beta 0",
    "a random init earns reward 0: advantages 0, loss and backward still run",
    ORDER,
]


def comparison(label, unit, units, ours, trl, note=""):
    return dict(label=label, unit=unit, units=units, ours=ours, trl=trl, note=note)


def comparisons(section, p, steps, tokens_per_row, common):
    """The differences left between a section's two sides (printed with it), and its
    comparisons: label, unit, units per step, our run's spec, TRL's, and its own
    note."""
    if section == "sft":
        b = p["sft_batch"]
        argv = common + flags(total_steps=steps, batch_size=b, micro_batch_size=b)
        ours = dict(side="ours", tag="sft-ours", script="sft.py", steps=steps, argv=argv)
        trl = dict(side="trl", tag="sft-trl", kind="sft", steps=steps, batch=b)
        tokens = f"tokens/s = the rows' mean {tokens_per_row:.1f} tokens x batch / step time"
        notes = [PADDING, f"{ORDER} ({tokens})"]
        return notes, [comparison("SFT", "tokens/s", b * tokens_per_row, ours, trl)]
    if section == "dpo":
        b = p["dpo_batch"]
        argv = common + flags(total_steps=steps, batch_size=b, micro_batch_size=b)
        argv += flags(beta=0.1, loss_type="sigmoid")
        ours = dict(side="ours", tag="dpo-ours", script="dpo.py", steps=steps, argv=argv)
        once = "dpo.py scores the reference once before step 0 (not timed), for both TRL modes"
        modes = {
            "default": "TRL runs a reference forward every step and keeps a second model",
            "precompute_ref_log_probs": "TRL scores the reference in its __init__ (not timed)",
        }
        comps = []
        for name, note in modes.items():
            trl = dict(side="trl", tag=f"dpo-trl-{name}", kind="dpo", steps=steps, batch=b)
            trl["precompute"] = name == "precompute_ref_log_probs"
            comps.append(comparison(f"DPO vs TRL {name}", "pairs/s", b, ours, trl, note))
        return [PADDING, ORDER, once], comps
    P, G, R = p["grpo_prompts"], p["grpo_samples"], p["response_length"]
    comps = []
    for beta in GRPO_BETAS:
        argv = common + flags(total_episodes=steps * P * G, num_prompts_per_step=P)
        argv += flags(num_samples_per_prompt=G, num_minibatches=1, num_epochs=1)
        argv += flags(micro_batch_size=P * G, response_length=R, temperature=1.0, beta=beta)
        tag = f"grpo-beta{beta:g}"
        ours = dict(side="ours", tag=f"{tag}-ours", script="grpo.py", steps=steps, argv=argv)
        trl = dict(side="trl", tag=f"{tag}-trl", kind="grpo", steps=steps, batch=P * G)
        trl |= dict(samples=G, response_length=R, beta=beta)
        comps.append(comparison(f"GRPO beta {beta:g}", "episodes/s", P * G, ours, trl))
    return [note.format(R=R) for note in GRPO_NOTES], comps


# ---------------------------------------------------------------------------------------
# Running and summarising


def run_child(spec, tmp, env, timeout):
    """One run as a subprocess: its step-end times, peak RSS (MB, from wait4) and wall
    time."""
    name = f"{spec['tag']}-{spec['turn']}"
    spec = dict(spec, result=os.path.join(tmp, f"{name}.json"))
    spec["out_dir"] = os.path.join(tmp, "runs", name)
    # a fresh dir per run: our scripts refuse a used --out_dir
    if spec["side"] == "ours":
        spec["argv"] = [*spec["argv"], "--out_dir", spec["out_dir"]]
    spec_path = os.path.join(tmp, name + ".spec.json")
    log_path = os.path.join(tmp, name + ".log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", spec_path]
    child_env = dict(env, **spec.get("env", {}))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=log, stderr=log)
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        # reaps the child: its own rusage, not the sum of all children
        _, status, usage = os.wait4(proc.pid, 0)
        killer.cancel()
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    # checkpoints of the 124M shape are large
    shutil.rmtree(spec["out_dir"], ignore_errors=True)
    if code != 0 or not os.path.isfile(spec["result"]):
        why = f"killed after --timeout {timeout:.0f} s" if wall >= timeout else f"exit {code}"
        with open(log_path) as f:
            tail = "".join(f.readlines()[-25:])
        raise RuntimeError(f"run {name} failed ({why}); last lines of {log_path}:\n{tail}")
    with open(spec["result"]) as f:
        result = json.load(f)
    # ru_maxrss is in KiB on Linux
    return dict(result, rss_mb=usage.ru_maxrss / 1024, wall_s=wall)


def run_section(section, preset, model_dir, args, tmp, env):
    """All turns of one section on one preset; a summary row per comparison."""
    p = PRESETS[preset]
    steps = args.steps or p["steps"][section]
    warmup = args.warmup or min(p["warmup"][section], steps - 1)
    split = dict(sft="sft_train", dpo="pref_train", grpo="prompt_train")[section]
    batch = dict(sft="sft_batch", dpo="dpo_batch", grpo="grpo_prompts")[section]
    data_dir = os.path.join(tmp, f"data-{preset}-{section}")
    tokens_per_row = build_data(data_dir, split, steps * p[batch])
    common = flags(model=model_dir, data=data_dir, seed=1, lr=LR, dtype=args.dtype)
    common += flags(eval_every=NEVER, eval_size=EVAL_ROWS, log_every=1)
    notes, comps = comparisons(section, p, steps, tokens_per_row, common)
    if args.compare_gemm:
        # each of our runs again on torch's default GEMMs, in the same turns; the lever alone
        for c in list(comps):
            mkl = dict(c["ours"], tag=c["ours"]["tag"] + "-mkl", env=dict(GPT2_CPU_GEMM="mkl"))
            comps.append(
                comparison(c["label"] + " [ours on MKL]", c["unit"], c["units"], mkl, c["trl"])
            )
            lever = comparison(
                f"{c['ours']['script']} oneDNN / MKL", c["unit"], c["units"], c["ours"], mkl
            )
            if lever["label"] not in [x["label"] for x in comps]:
                comps.append(lever)
    # the distinct runs of the section (dpo.py's serves both TRL modes), in a fixed order
    runs = {}
    where = dict(data=data_dir, model=model_dir, split=split, dtype=args.dtype)
    for c in comps:
        for spec in (c["ours"], c["trl"]):
            if spec["tag"] not in runs:
                runs[spec["tag"]] = dict(spec, tag=f"{preset}-{spec['tag']}", **where)
    print(f"\n-- {preset} {section}: {args.turns} turns of {steps} steps, {warmup} untimed")
    for note in notes + [f"{c['label']}: {c['note']}" for c in comps if c["note"]]:
        print(f"   differences: {note}", flush=True)
    done = {tag: [] for tag in runs}
    for turn in range(args.turns):
        # ABBA: drift hits both alike
        order = list(runs) if turn % 2 == 0 else list(runs)[::-1]
        for tag in order:
            res = run_child(dict(runs[tag], turn=turn), tmp, env, args.timeout)
            step_s = (res["ends"][-1] - res["ends"][warmup - 1]) / (len(res["ends"]) - warmup)
            res |= dict(tag=runs[tag]["tag"], turn=turn, step_s=step_s)
            done[tag].append(res)
            line = f"   turn {turn + 1} {res['tag']}: {step_s * 1e3:.1f} ms/step"
            line += f", peak RSS {res['rss_mb']:.0f} MB, wall {res['wall_s']:.1f} s"
            if res["response_length"] is not None:
                line += f", {res['response_length']:.1f} tokens/response"
            print(line, flush=True)
    rows = []
    for c in comps:
        ours = done[c["ours"]["tag"]]
        trl = done[c["trl"]["tag"]]
        # ours / TRL within each turn
        ratios = [b["step_s"] / a["step_s"] for a, b in zip(ours, trl)]
        ours_s = statistics.median(r["step_s"] for r in ours)
        trl_s = statistics.median(r["step_s"] for r in trl)
        row = dict(preset=preset, label=c["label"], unit=c["unit"], notes=notes, runs=ours + trl)
        row |= dict(ratios=ratios, ratio=statistics.median(ratios), lo=min(ratios), hi=max(ratios))
        row |= dict(ours=c["units"] / ours_s, trl=c["units"] / trl_s)
        row["rss_ours"] = statistics.median(r["rss_mb"] for r in ours)
        row["rss_trl"] = statistics.median(r["rss_mb"] for r in trl)
        rows.append(row)
        per_turn = " ".join(f"{r:.2f}" for r in ratios)
        print(f"   {c['label']}: ours/TRL per turn {per_turn} -> {row['ratio']:.2f}", flush=True)
    return rows


def print_summary(summary):
    header = (
        "| shape | comparison | ours | TRL | ours / TRL, median (range) | peak RSS ours / TRL |"
    )
    print(f"\n{header}\n|---|---|---|---|---|---|")
    shapes = {"tiny": "tiny (0.8M)", "gpt2": "GPT-2 124M shape"}
    for r in summary:
        ratio = f"{r['ratio']:.2f} ({r['lo']:.2f}–{r['hi']:.2f})"
        rss = f"{r['rss_ours']:.0f} / {r['rss_trl']:.0f} MB"
        rss += f" ({r['rss_ours'] / r['rss_trl']:.2f}×)"
        cells = [shapes[r["preset"]], f"{r['label']} {r['unit']}", f"{r['ours']:.4g}"]
        cells += [f"{r['trl']:.4g}", ratio, rss]
        print("| " + " | ".join(cells) + " |")


def main(args: Args):
    sections = [s for s in args.sections.split(",") if s]
    presets = [p for p in args.presets.split(",") if p]
    unknown = [s for s in sections if s not in SECTIONS] + [p for p in presets if p not in PRESETS]
    if unknown:
        known = f"the sections are {', '.join(SECTIONS)}, the presets {', '.join(PRESETS)}"
        sys.exit(f"error: unknown {', '.join(unknown)}: {known}")
    if args.turns < 1 or args.steps < 0 or args.warmup < 0 or 0 < args.steps <= max(args.warmup, 1):
        sys.exit("error: need --turns >= 1 and --steps > --warmup >= 1 (0 = the preset's)")
    try:
        import torch
        import transformers
        import trl
    except ImportError as e:
        fix = "pip install -r experiments/requirements-peer.txt, in a venv of its own"
        sys.exit(f"error: peer_bench.py needs {e.name}: {fix}")

    sys.path.insert(0, ROOT)
    import data
    import gpt2

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env |= dict(TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env["PYTHONWARNINGS"] = "ignore"
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"{versions}, trl {trl.__version__}; {os.cpu_count()} CPUs", flush=True)
    threads = env.get("OMP_NUM_THREADS", "unset")
    gemm = "oneDNN" if gpt2.cpu_gemm() == "onednn" else "MKL"
    print(f"OMP_NUM_THREADS={threads}; our fp32 CPU GEMMs: {gemm}, TRL's: MKL", flush=True)
    meta = data.load_meta("arithmetic")
    tmp = tempfile.mkdtemp(prefix="peer_bench_")
    summary = []
    try:
        for preset in presets:
            model_dir = os.path.join(tmp, f"model-{preset}")
            diff = build_model(preset, meta["vocab_size"], meta["eos_token_id"], model_dir)
            print(f"\n==== {preset}: max |logit diff| of gpt2.py and HF's GPT-2: {diff:.1e}")
            if diff > 1e-3:
                raise RuntimeError(f"{preset}: gpt2.py and transformers disagree ({diff:.2e})")
            for section in sections:
                summary += run_section(section, preset, model_dir, args, tmp, env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_summary(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), summary=summary), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        if spec["side"] == "ours":
            child_ours(spec)
        else:
            child_trl(spec)
    else:
        import tyro

        main(tyro.cli(Args, use_underscores=True))
