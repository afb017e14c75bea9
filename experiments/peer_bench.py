"""Peer benchmark: this project's training scripts against the TRL trainers users would otherwise
pick, at equal work.

Compared, each on the tiny model (0.8M) and on the GPT-2 124M shape (vocab 257, smaller batches):

  sft   sft.py vs trl.SFTTrainer, in tokens/s
  dpo   dpo.py vs trl.DPOTrainer, its default (a reference forward every step) and
        precompute_ref_log_probs=True (dpo.py always scores the reference once before step 0), in
        pairs/s
  grpo  grpo.py vs trl.GRPOTrainer at beta 0 and beta 0.03, the task's verifier as the reward on
        both sides, in episodes/s
  ppo   ppo.py vs TRL's PPO trainer, when the installed TRL still has one (TRL 1.16 has none: the
        section says so)

Equal work: the same weights (a random init saved with gpt2.save, loaded by
transformers.GPT2LMHeadModel; the logits are checked equal), the same rows of the offline arithmetic
task (built in memory, written to a temporary dataset dir for our scripts), batch sizes, response
lengths, optimizer steps, fp32, no gradient checkpointing, a log row every step on both sides. Every
remaining difference is printed with its section (and listed in docs/benchmarks.md). Each run is its
own process; a step is timed from one optimizer step's end to the next (our scripts: a global
optimizer-step hook; TRL: a TrainerCallback's on_step_end), the first --warmup steps and all
start-up and evaluation excluded; the process exits right after its last timed step. Ours and TRL's
runs alternate (ABBA over turns), each turn gives a ratio ours/TRL of throughputs; the summary is
the median and range over turns, plus the peak RSS of each process (ru_maxrss from wait4). A last
table gives the limit: the GEMMs each step cannot avoid, timed alone at their shapes on this machine
with the faster of torch's two CPU GEMM libraries (`matmul_floor`), as a share of each side's
measured step time.

Needs its own venv (trl, transformers, datasets, accelerate on top of the runtime packages); our
scripts run in it too, so both sides use the same torch:

    python3 -m venv /work/peer-venv
    /work/peer-venv/bin/pip install -r experiments/requirements-peer.txt
    /work/peer-venv/bin/python experiments/peer_bench.py  # all: ~8 min on 2 quiet cores
    /work/peer-venv/bin/python experiments/peer_bench.py --sections grpo --presets gpt2 --turns 5
    /work/peer-venv/bin/python experiments/peer_bench.py --turns 1 --steps 3 --warmup 1  # smoke
    /work/peer-venv/bin/python experiments/peer_bench.py --compare_gemm --turns 5  # + ours on MKL
"""

import json
import os
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("sft", "dpo", "grpo", "ppo")
# Sizes per preset: the 124M shape gets smaller batches so that a full run fits ~10 minutes on 2
# cores. steps includes the warmup steps; only steps - warmup are timed.
PRESETS = {
    "tiny": dict(
        sft_batch=64,
        dpo_batch=64,
        grpo_prompts=16,
        grpo_samples=8,
        response_length=16,
        steps=dict(sft=30, dpo=30, grpo=10),
        warmup=dict(sft=5, dpo=5, grpo=2),
    ),
    "gpt2": dict(
        sft_batch=8,
        dpo_batch=4,
        grpo_prompts=2,
        grpo_samples=4,
        response_length=16,
        steps=dict(sft=8, dpo=8, grpo=6),
        warmup=dict(sft=2, dpo=2, grpo=2),
    ),
}
LR = 1e-5  # the same on both sides; speed does not depend on it
GRPO_BETAS = (0.0, 0.03)
# rows in each test split: the scripts' evaluations (at step 0, and never again) stay short
EVAL_ROWS = 16
NEVER = 10**9  # --eval_every: no evaluation inside the timed steps
SAME = (
    "the --dtype (fp32 by default)",
    "fused AdamW",
    "no gradient checkpointing",
    "grad-norm clip 1.0",
    "a log row every step",
    "micro-batch = batch (no accumulation)",
    "learning rate 1e-5",
)
DIFFERENT = (
    "learning-rate schedules and Adam betas (no effect on speed)",
    "peak RSS is the whole process: TRL's also holds transformers, datasets and accelerate",
)


@dataclass
class Args:
    sections: str = "sft,dpo,grpo,ppo"
    """comma-separated sections: sft, dpo, grpo, ppo"""
    presets: str = "tiny,gpt2"
    """comma-separated shapes: tiny (gpt2.py's preset) and gpt2 (the 124M shape with the task's
    257-token vocab)"""
    turns: int = 3
    """runs of each side per comparison, alternated ours/TRL then TRL/ours; ratios are medians over
    turns"""
    steps: int = 0
    """optimizer steps per run, warmup included (0 = the preset's: see PRESETS)"""
    warmup: int = 0
    """untimed first steps per run, at least 1 (0 = the preset's)"""
    dtype: str = "float32"
    """float32, or bfloat16: autocast on both sides (our --dtype bfloat16, TRL's bf16=True); pays on
    CPUs with AMX"""
    threads: int = 0
    """OMP_NUM_THREADS of every run (0 = inherit this process's environment, i.e. torch's
    default)"""
    out: str | None = None
    """also write every run's numbers to this JSON file"""
    timeout: float = 600.0
    """seconds after which one run is killed (and the benchmark stops with its log)"""
    keep: bool = False
    """keep the temporary dir (models, datasets, logs of every run) and print its path"""
    compare_gemm: bool = False
    """also run each of our scripts with GPT2_CPU_GEMM=mkl (torch's default GEMMs) in the same
    turns: the ratio with and without gpt2.py's oneDNN GEMMs, and the lever's own (matters on AMD
    CPUs, where gpt2.py picks oneDNN)"""


# ----------------------------------------------------------------------------------------------
# Children: one training run each, started as `python peer_bench.py --child SPEC.json`


def write_result(spec: dict, ends: list, lengths: list) -> None:
    """The step-end times and the mean tokens per sampled response (None: nothing sampled)."""
    with open(spec["result"], "w") as f:
        json.dump(dict(ends=ends, response_length=statistics.mean(lengths) if lengths else None), f)


def child_ours(spec: dict) -> None:
    """Run one of our scripts in this process with a global optimizer-step hook; exit right after
    the last step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    ends = []

    def hook(optimizer, args, kwargs):
        ends.append(time.perf_counter())
        # before the last step's logging, like TRL's on_step_end: skip eval and saving
        if len(ends) == spec["steps"]:
            rows = []
            path = os.path.join(spec["out_dir"], "metrics.jsonl")
            if os.path.isfile(path):
                rows = [json.loads(line) for line in open(path) if line.strip()]
            key = "objective/response_length"
            lengths = [r[key] for r in rows if key in r]
            write_result(spec, ends, lengths)
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)

    register_optimizer_step_post_hook(hook)
    script = os.path.join(ROOT, spec["script"])
    sys.path.insert(0, ROOT)
    sys.argv = [script, *spec["argv"]]
    runpy.run_path(script, run_name="__main__")
    sys.exit(
        f"{spec['script']} ran {len(ends)} optimizer steps, fewer than the {spec['steps']} asked"
    )


def byte_tokenizer():
    """The task's `bytes` tokenizer as a transformers tokenizer: byte b is id b, <|endoftext|> is
    256 (stop and pad). A BPE with no merges over GPT-2's byte-to-unicode alphabet: each byte is one
    token, offline, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spans = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))  # the bytes GPT-2 maps to themselves
    printable = [b for lo, hi in spans for b in range(ord(lo), ord(hi) + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {char[b]: b for b in range(256)} | {"<|endoftext|>": 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eot = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, pad_token=eot)


def text_rows(split: dict, meta: dict) -> dict:
    """A split's arrays as the text columns TRL takes: prompt, and completion / chosen / rejected /
    ground_truth (the stop token left out: TRL appends it to completions, chosen and rejected, as
    our data has it)."""
    import data

    enc, pad, eos = data.get_encoding(meta["tokenizer"]), meta["pad_token_id"], meta["eos_token_id"]
    strip = lambda row, drop: enc.decode([t for t in row.tolist() if t != drop])
    until_eos = lambda row: enc.decode(row.tolist()[: (row.tolist() + [eos]).index(eos)])
    out = {"prompt": [strip(q, pad) for q in split["query"]]}
    for k in ("response", "chosen", "rejected"):
        if k in split:
            out["completion" if k == "response" else k] = [until_eos(r) for r in split[k]]
    if "ground_truth" in split:
        out["ground_truth"] = [str(g) for g in split["ground_truth"]]
    return out


def child_trl(spec: dict) -> None:
    """One TRL run with a step-timing callback; exit right after the last step."""
    sys.path.insert(0, ROOT)
    import datasets
    import torch
    import transformers
    import trl

    import data

    meta = data.load_meta(spec["data"])
    tok = byte_tokenizer()
    model = transformers.GPT2LMHeadModel.from_pretrained(spec["model"], dtype=torch.float32)
    ends = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            if len(ends) == spec["steps"]:
                key = "completions/mean_length"
                write_result(spec, ends, [r[key] for r in state.log_history if key in r])
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(0)

    common = dict(
        output_dir=os.path.join(spec["out_dir"]),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1,
        learning_rate=LR,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        gradient_checkpointing=False,
        bf16=spec["dtype"] == "bfloat16",
        use_cpu=True,
        seed=1,
        dataloader_num_workers=0,
    )
    kind, rows = spec["kind"], text_rows(data.load_split(spec["data"], spec["split"]), meta)
    hooks = dict(processing_class=tok, callbacks=[StepTimer()])
    if kind == "sft":
        cfg = trl.SFTConfig(**common, completion_only_loss=True, packing=False, max_length=None)
        ds = datasets.Dataset.from_dict({k: rows[k] for k in ("prompt", "completion")})
        trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, **hooks)
    elif kind == "dpo":
        cfg = trl.DPOConfig(
            **common,
            beta=0.1,
            loss_type=["sigmoid"],
            max_length=None,
            precompute_ref_log_probs=spec["precompute"],
        )
        ds = datasets.Dataset.from_dict({k: rows[k] for k in ("prompt", "chosen", "rejected")})
        trainer = trl.DPOTrainer(model=model, args=cfg, train_dataset=ds, **hooks)
    elif kind == "grpo":
        # scores the text before the stop token, as grpo.py does
        def verifier(completions, ground_truth, **kwargs):
            return [data.verify(meta["task"], c, g) for c, g in zip(completions, ground_truth)]

        cfg = trl.GRPOConfig(
            **common,
            num_generations=spec["samples"],
            max_completion_length=spec["response_length"],
            steps_per_generation=1,
            num_iterations=1,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            beta=spec["beta"],
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
        )
        ds = datasets.Dataset.from_dict({k: rows[k] for k in ("prompt", "ground_truth")})
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=[verifier], args=cfg, train_dataset=ds, **hooks
        )
    else:
        raise ValueError(kind)
    trainer.train()
    sys.exit(f"TRL {kind} ran {len(ends)} optimizer steps, fewer than the {spec['steps']} asked")


# ----------------------------------------------------------------------------------------------
# Setup in the parent: models, datasets, the runs of each comparison


def build_model(preset: str, vocab_size: int, eos_token_id: int, out_dir: str) -> float:
    """A random init (seed 0) of gpt2.py's preset saved in the HF layout; returns the max |logit
    difference| between gpt2.GPT and transformers.GPT2LMHeadModel loaded from the same file (the
    same weights on both sides)."""
    import torch
    import transformers

    import gpt2

    torch.manual_seed(0)
    stop = dict(eos_token_id=eos_token_id, pad_token_id=eos_token_id)  # config.json's, for HF
    cfg = gpt2.GPTConfig(**gpt2.PRESETS[preset], vocab_size=vocab_size, **stop)
    model = gpt2.GPT(cfg).eval()
    gpt2.save(model, out_dir)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out_dir, dtype=torch.float32).eval()
    idx = torch.randint(0, vocab_size, (2, 12))
    with torch.no_grad():
        return (model(idx) - hf(idx).logits).abs().max().item()


def build_data(out_dir: str, sizes: dict) -> float:
    """The first `sizes[split]` rows of each train split of the arithmetic task, EVAL_ROWS of each
    test split, as a dataset dir our scripts read with --data; returns the mean tokens per SFT row
    (prompt + response + stop token)."""
    import numpy as np

    import data

    meta = data.load_meta("arithmetic")
    splits = {
        s: {k: v[: sizes.get(s, EVAL_ROWS)] for k, v in data.load_split("arithmetic", s).items()}
        for s in data.SPLITS
    }
    with open(os.devnull, "w") as null:  # write_dataset prints a line per dir
        stdout, sys.stdout = sys.stdout, null
        try:
            data.write_dataset(out_dir, meta, splits)
        finally:
            sys.stdout = stdout
    sft = splits["sft_train"]
    # response tokens up to and including the stop token
    resp_len = (np.cumsum(sft["response"] == meta["eos_token_id"], 1) == 0).sum(1) + 1
    return float(((sft["query"] != meta["pad_token_id"]).sum(1) + resp_len).mean())


def flags(**kw) -> list[str]:
    """Command-line flags: flags(batch_size=8) == ["--batch_size", "8"]."""
    return [arg for k, v in kw.items() for arg in (f"--{k}", str(v))]


def comparisons(
    section: str,
    p: dict,
    steps: int,
    model: str,
    data_dir: str,
    tokens_per_row: float,
    dtype: str = "float32",
) -> tuple:
    """The differences left between the two sides of a section (printed with it), and its
    comparisons: [(label, unit, units per step, our run spec, TRL run spec, the comparison's own
    note)]."""
    common = flags(model=model, data=data_dir, seed=1, lr=LR, dtype=dtype, eval_every=NEVER)
    common += flags(eval_size=EVAL_ROWS, log_every=1)
    padding = (
        "padding: ours pads prompts left and responses right, trimmed per batch to the longest "
        "prompt + the longest response; TRL right-pads prompt + completion to the longest row, so "
        "ours may run a few more pad columns"
    )
    order = "data order: both sides train on the same rows, each in its own shuffled order"
    if section == "sft":
        b = p["sft_batch"]
        argv = common + flags(total_steps=steps, batch_size=b, micro_batch_size=b)
        ours = dict(side="ours", tag="sft-ours", script="sft.py", steps=steps, argv=argv)
        trl_ = dict(side="trl", tag="sft-trl", kind="sft", steps=steps, batch=b)
        tokens = f" (tokens/s = the rows' mean {tokens_per_row:.1f} tokens x batch / step time)"
        notes = [padding, order + tokens]
        return notes, [("SFT", "tokens/s", b * tokens_per_row, ours, trl_, "")]
    if section == "dpo":
        b = p["dpo_batch"]
        argv = common + flags(total_steps=steps, batch_size=b, micro_batch_size=b)
        argv += flags(beta=0.1, loss_type="sigmoid")
        ours = dict(side="ours", tag="dpo-ours", script="dpo.py", steps=steps, argv=argv)
        notes = [
            padding,
            order,
            "dpo.py scores the reference log-probs of every training pair once before step 0 "
            "(start-up, not timed); the one dpo.py run of a turn is compared with both TRL modes",
        ]
        modes = {
            "default": "TRL runs a reference forward every step and keeps a second model",
            "precompute_ref_log_probs": "TRL scores the reference in its __init__ (not timed)",
        }
        comps = []
        for name, note in modes.items():
            trl_ = dict(side="trl", tag=f"dpo-trl-{name}", kind="dpo", steps=steps, batch=b)
            trl_["precompute"] = name == "precompute_ref_log_probs"
            comps.append((f"DPO vs TRL {name}", "pairs/s", b, ours, trl_, note))
        return notes, comps
    if section == "grpo":
        P, G, R = p["grpo_prompts"], p["grpo_samples"], p["response_length"]
        notes = [
            "generation: gpt2.generate (preallocated KV cache) vs HF generate (DynamicCache); both "
            f"sample up to {R} tokens at temperature 1, no top-k/top-p, and stop early only once "
            "every row has stopped (the sampled tokens per response of each run are printed)",
            "the passes per step are each side's own: TRL (num_iterations 1, no vLLM) takes the "
            "sampling policy's log-probs from the training forward and loads no reference model at "
            "beta 0",
            "loss options (clip range, KL estimator, token-mean aggregation) are grpo.py's "
            "defaults and TRL's loss_type dapo, epsilon 0.2, k3: they change no pass or matmul",
            "a random-init policy earns reward 0 everywhere, so every advantage is 0; both sides "
            "still run the loss and the backward",
            order,
        ]
        comps = []
        for beta in GRPO_BETAS:
            argv = common + flags(total_episodes=steps * P * G, num_prompts_per_step=P)
            argv += flags(num_samples_per_prompt=G, num_minibatches=1, num_epochs=1)
            argv += flags(micro_batch_size=P * G, response_length=R, temperature=1.0, beta=beta)
            tag = f"grpo-beta{beta:g}"
            ours = dict(side="ours", tag=f"{tag}-ours", script="grpo.py", steps=steps, argv=argv)
            trl_ = dict(side="trl", tag=f"{tag}-trl", kind="grpo", steps=steps, batch=P * G)
            trl_ |= dict(samples=G, response_length=R, beta=beta)
            comps.append((f"GRPO beta {beta:g}", "episodes/s", P * G, ours, trl_, ""))
        return notes, comps
    raise ValueError(section)


def trl_has_ppo() -> str | None:
    """The import path of TRL's PPO trainer if the installed TRL has one."""
    import importlib.util

    import trl

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # find_spec imports it, which warns

    if hasattr(trl, "PPOTrainer"):
        return "trl.PPOTrainer"
    try:
        if importlib.util.find_spec("trl.experimental.ppo") is not None:
            return "trl.experimental.ppo"
    except ModuleNotFoundError:
        pass
    return None


# ----------------------------------------------------------------------------------------------
# Running and summarising


def run_child(spec: dict, tmp: str, env: dict, timeout: float) -> dict:
    """Start one run as a subprocess; its step-end times, its peak RSS (MB, from wait4) and its wall
    time."""
    name = f"{spec['tag']}-{spec['turn']}"
    spec = dict(spec, result=os.path.join(tmp, f"{name}.json"))
    spec["out_dir"] = os.path.join(tmp, "runs", name)
    if spec["side"] == "ours":  # a fresh dir per run: our scripts refuse a used --out_dir
        spec["argv"] = [*spec["argv"], "--out_dir", spec["out_dir"]]
    spec_path, log_path = os.path.join(tmp, name + ".spec.json"), os.path.join(tmp, name + ".log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", spec_path],
            cwd=ROOT,
            env=dict(env, **spec.get("env", {})),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        # reaps the child: its own rusage, not the sum of all children
        _, status, usage = os.wait4(proc.pid, 0)
        killer.cancel()
    wall, code = time.perf_counter() - t0, os.waitstatus_to_exitcode(status)
    shutil.rmtree(spec["out_dir"], ignore_errors=True)  # checkpoints of the 124M shape are large
    if code != 0 or not os.path.isfile(spec["result"]):
        why = f"killed after --timeout {timeout:.0f} s" if wall >= timeout else f"exit {code}"
        tail = "".join(open(log_path).readlines()[-25:])
        raise RuntimeError(f"run {name} failed ({why}); last lines of {log_path}:\n{tail}")
    with open(spec["result"]) as f:
        return dict(json.load(f), rss_mb=usage.ru_maxrss / 1024, wall_s=wall)  # KiB on Linux


def check_flags(script: str, argv: list, env: dict, known: dict = {}) -> None:  # noqa: B006 (cache)
    """Fail early, naming the flag, when one of our scripts no longer has a flag this benchmark
    passes."""
    if script not in known:
        cmd = [sys.executable, os.path.join(ROOT, script), "--help"]
        env = dict(env, COLUMNS="400")
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env).stdout
        known[script] = set(re.findall(r"--[a-z0-9_-]+", out.replace("_", "-")))
    dashed = [a for a in argv if a.startswith("--")]
    if missing := [a for a in dashed if a.replace("_", "-") not in known[script]]:
        sys.exit(
            f"error: {script} has no flag {', '.join(missing)}: update experiments/peer_bench.py"
        )


def step_time(ends: list, warmup: int) -> float:
    """Mean seconds per step over the steps after the warmup: from the end of step `warmup` to the
    end of the last."""
    return (ends[-1] - ends[warmup - 1]) / (len(ends) - warmup)


PROMPT_TOKENS = 6  # the arithmetic task's prompts (" 7+48="), the prefill of a GRPO rollout


def step_passes(
    section: str, p: dict, tokens_per_row: float, side: str, beta: float = 0.0, ref: bool = False
) -> list:
    """The model passes one optimizer step cannot avoid, as [(kind, tokens)], kind "fwd" or
    "fwdbwd": the training forward + backward over every row's tokens but its last (predicted, never
    read), a prompt that several rows share (a DPO pair's, a GRPO group's) counted once; a reference
    forward where the side runs one (TRL's DPO default; GRPO at beta > 0); GRPO's generation (a
    prefill of the distinct prompts, then one token per row per sampled token)."""
    if section == "sft":
        return [("fwdbwd", p["sft_batch"] * (tokens_per_row - 1))]
    if section == "dpo":  # chosen and rejected rows in one pass, their prompt once
        B = p["dpo_batch"]
        tokens = B * (PROMPT_TOKENS - 1) + 2 * B * (tokens_per_row - PROMPT_TOKENS)
        return [("fwdbwd", tokens)] + [("fwd", tokens)] * (side == "trl" and ref)
    P, n, R = p["grpo_prompts"], p["grpo_prompts"] * p["grpo_samples"], p["response_length"]
    rollout = [("fwd", P * (PROMPT_TOKENS - 1) + n)] + [("fwd", n)] * (R - 1)
    train = P * (PROMPT_TOKENS - 1) + n * R
    return rollout + [("fwdbwd", train)] + [("fwd", train)] * (beta > 0)


def matmul_floor(preset: str, vocab_size: int, passes: list, repeats=7, cache={}) -> float:  # noqa: B006
    """Seconds the GEMMs of `passes` take on this machine: for each pass, every linear layer's GEMM
    (rows x in) @ (in x out) in model order, each layer with its own weight as in the model (so
    weights come from memory, not from a cache warmed by repeating one GEMM); 1 GEMM per layer for a
    forward, 3 for forward + backward (the input's and the weight's gradients). Each pass is timed
    with both GEMM libraries in torch's CPU build, MKL (torch's default) and oneDNN (gpt2.py's
    choice on AMD CPUs), and the faster counts: the machine's best GEMM rate. The fastest of
    `repeats` per pass (a floor: on a shared VM a slow repeat is the neighbours' load), summed over
    passes. Attention, norms, the optimizer and all overhead are left out."""
    import torch

    import gpt2

    # x @ w through oneDNN
    onednn = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w.t(), None, "none", [], "")
    libraries = [torch.mm] + [onednn] * torch.backends.mkldnn.is_available()
    cfg = gpt2.GPTConfig(**gpt2.PRESETS[preset], vocab_size=vocab_size)
    C = cfg.n_embd
    if (preset, vocab_size) not in cache:  # one weight per linear layer, as in the model
        shapes = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)] * cfg.n_layer + [(C, vocab_size)]
        cache[preset, vocab_size] = [torch.randn(fan_in, fan_out) for fan_in, fan_out in shapes]
    weights, total = cache[preset, vocab_size], 0.0
    for kind, rows in passes:
        key = (preset, vocab_size, kind, max(1, round(rows)))
        if key not in cache:
            xs = {w.shape[0]: torch.randn(key[3], w.shape[0]) for w in weights}  # (rows, in)
            gs = {w.shape[1]: torch.randn(key[3], w.shape[1]) for w in weights}  # (rows, out)
            best = float("inf")
            for mm in libraries:
                times = []
                for _ in range(repeats + 1):  # the first is a warmup
                    t0 = time.perf_counter()
                    for w in weights:
                        x, g = xs[w.shape[0]], gs[w.shape[1]]
                        mm(x, w)
                        if kind == "fwdbwd":
                            mm(g, w.t()), mm(x.t(), g)
                    times.append(time.perf_counter() - t0)
                best = min(best, *times[1:])
            cache[key] = best
        total += cache[key]
    return total


def run_section(
    section: str, preset: str, model_dir: str, args: Args, tmp: str, env: dict, vocab_size: int
) -> list[dict]:
    """All turns of one section on one preset; returns a summary row per comparison."""
    p = PRESETS[preset]
    steps = args.steps or p["steps"][section]
    warmup = args.warmup or min(p["warmup"][section], steps - 1)
    split = dict(sft="sft_train", dpo="pref_train", grpo="prompt_train")[section]
    rows_per_step = p[dict(sft="sft_batch", dpo="dpo_batch", grpo="grpo_prompts")[section]]
    data_dir = os.path.join(tmp, f"data-{preset}-{section}")
    tokens_per_row = build_data(data_dir, {split: steps * rows_per_step})
    notes, comps = comparisons(section, p, steps, model_dir, data_dir, tokens_per_row, args.dtype)
    if args.compare_gemm:  # each of our runs again on torch's default GEMMs, in the same turns
        seen = set()
        for label, unit, units, ours, trl_, _ in list(comps):
            mkl = dict(ours, tag=f"{ours['tag']}-mkl", env=dict(GPT2_CPU_GEMM="mkl"))
            comps.append((f"{label} [ours on MKL]", unit, units, mkl, trl_, "GPT2_CPU_GEMM=mkl"))
            if ours["tag"] not in seen:
                seen.add(ours["tag"])
                lever = f"{ours['script']} oneDNN / MKL"
                comps.append((lever, unit, units, ours, mkl, "the GEMM lever alone"))
    runs = {}  # the distinct runs of the section (dpo.py's serves both TRL modes), in a fixed order
    for spec in [spec for c in comps for spec in c[3:5]]:
        if spec["tag"] not in runs:
            where = dict(data=data_dir, model=model_dir, split=split, dtype=args.dtype)
            runs[spec["tag"]] = dict(spec, tag=f"{preset}-{spec['tag']}", **where)
        if spec["side"] == "ours":
            check_flags(spec["script"], [*spec["argv"], "--out_dir"], env)
    runs_are = f"{steps} steps per run, the first {warmup} untimed; {args.turns} turns"
    print(f"\n-- {preset} {section}: {runs_are}", flush=True)
    for note in notes + [f"{c[0]}: {c[5]}" for c in comps if c[5]]:
        print(f"   differences: {note}", flush=True)
    done = {tag: [] for tag in runs}
    for turn in range(args.turns):
        for tag in list(runs)[:: 1 if turn % 2 == 0 else -1]:  # ABBA: drift hits both alike
            res = run_child(dict(runs[tag], turn=turn), tmp, env, args.timeout)
            res |= dict(tag=runs[tag]["tag"], turn=turn, step_s=step_time(res["ends"], warmup))
            done[tag].append(res)
            line = f"   turn {turn + 1} {res['tag']}: {res['step_s'] * 1e3:.1f} ms/step, "
            line += f"peak RSS {res['rss_mb']:.0f} MB, wall {res['wall_s']:.1f} s"
            if res["response_length"] is not None:
                line += f", {res['response_length']:.1f} tokens/response"
            print(line, flush=True)
    rows = []
    for label, unit, units, ours, trl_, note in comps:
        o, t = done[ours["tag"]], done[trl_["tag"]]
        ratios = [b["step_s"] / a["step_s"] for a, b in zip(o, t)]  # ours/TRL within each turn
        median = lambda runs, key: statistics.median(r[key] for r in runs)
        row = dict(preset=preset, label=label, unit=unit, notes=notes + [note] * bool(note))
        row |= dict(ratios=ratios, ratio=statistics.median(ratios), lo=min(ratios), hi=max(ratios))
        row |= dict(ours=units / median(o, "step_s"), trl=units / median(t, "step_s"))
        row |= dict(rss_ours=median(o, "rss_mb"), rss_trl=median(t, "rss_mb"), runs=o + t)
        beta, ref = float(trl_.get("beta", 0.0)), not trl_.get("precompute", True)
        if args.dtype == "float32" and trl_["side"] == "trl":
            for side, res in (("ours", o), ("trl", t)):
                passes = step_passes(section, p, tokens_per_row, side, beta, ref)
                row[f"floor_{side}"] = floor = matmul_floor(preset, vocab_size, passes)
                row[f"floor_pct_{side}"] = floor / median(res, "step_s")
        rows.append(row)
        per_turn = " ".join(f"{r:.2f}" for r in ratios)
        print(
            f"   {label}: ours/TRL {unit} per turn {per_turn} -> median {row['ratio']:.2f} "
            f"(range {row['lo']:.2f}-{row['hi']:.2f})",
            flush=True,
        )
    return rows


def main(args: Args) -> None:
    sections = [s for s in args.sections.split(",") if s]
    presets = [p for p in args.presets.split(",") if p]
    unknown = [s for s in sections if s not in SECTIONS] + [p for p in presets if p not in PRESETS]
    if unknown:
        sys.exit(
            f"error: unknown {', '.join(unknown)}: the sections are {', '.join(SECTIONS)}, the "
            f"presets {', '.join(PRESETS)}"
        )
    if args.dtype not in ("float32", "bfloat16"):
        sys.exit(f"error: --dtype {args.dtype}: use float32 or bfloat16")
    if args.turns < 1 or args.steps < 0 or args.warmup < 0 or 0 < args.steps <= max(args.warmup, 1):
        sys.exit("error: need --turns >= 1 and --steps > --warmup >= 1 (0 = the preset's)")
    import torch
    import transformers
    import trl

    sys.path.insert(0, ROOT)
    import data

    offline = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    quiet = dict(TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env = dict(os.environ, **offline, **quiet, PYTHONWARNINGS="ignore")
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    import gpt2

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl "
        f"{trl.__version__}; {os.cpu_count()} CPUs, OMP_NUM_THREADS="
        f"{env.get('OMP_NUM_THREADS', 'unset')}; our fp32 CPU GEMMs: "
        f"{'oneDNN' if gpt2.ONEDNN else 'MKL'} (GPT2_CPU_GEMM={env.get('GPT2_CPU_GEMM', 'auto')}), "
        "TRL's: MKL",
        flush=True,
    )
    print(f"both sides: {', '.join(SAME)}; differences: {'; '.join(DIFFERENT)}", flush=True)
    meta, tmp, summary = data.load_meta("arithmetic"), tempfile.mkdtemp(prefix="peer_bench_"), []
    try:
        for preset in presets:
            model_dir = os.path.join(tmp, f"model-{preset}")
            diff = build_model(preset, meta["vocab_size"], meta["eos_token_id"], model_dir)
            print(
                f"\n==== {preset}: a random init saved in the HF layout; max |logit diff| gpt2.py "
                f"vs GPT2LMHeadModel on it: {diff:.1e}",
                flush=True,
            )
            if diff > 1e-3:
                raise RuntimeError(f"{preset}: gpt2.py and transformers disagree ({diff:.2e})")
            for section in sections:
                if section != "ppo":
                    vocab = meta["vocab_size"]
                    summary += run_section(section, preset, model_dir, args, tmp, env, vocab)
                    continue
                where, trl_is = trl_has_ppo(), f"TRL {trl.__version__}"
                msg = f"{trl_is} has no PPO trainer (no trl.PPOTrainer, no trl.experimental.ppo)"
                if where:
                    msg = f"{trl_is} has a PPO trainer ({where}) this benchmark does not wire yet"
                print(f"\n-- {preset} ppo: not compared: {msg}", flush=True)
                summary.append(dict(preset=preset, label="PPO", skipped=msg))
    finally:
        if args.keep:
            print(f"\nkept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print(
        "\n| shape | comparison | ours | TRL | ours / TRL, median (range) | peak RSS ours / TRL |"
    )
    print("|---|---|---|---|---|---|")
    for r in summary:
        shape = "tiny (0.8M)" if r["preset"] == "tiny" else "GPT-2 124M shape"
        if "skipped" in r:
            print(f"| {shape} | {r['label']} | – | – | not compared: {r['skipped']} | – |")
        else:
            ratio = f"{r['ratio']:.2f} ({r['lo']:.2f}–{r['hi']:.2f})"
            rss = f"{r['rss_ours']:.0f} / {r['rss_trl']:.0f} MB"
            rss += f" ({r['rss_ours'] / r['rss_trl']:.2f}×)"
            cells = [shape, f"{r['label']} {r['unit']}", f"{r['ours']:.4g}", f"{r['trl']:.4g}"]
            print("| " + " | ".join([*cells, ratio, rss]) + " |")
    if args.dtype == "float32":  # the floor times fp32 GEMMs
        print(
            "\nThe limit: the GEMMs a step cannot avoid (its training forward + backward, and the "
            "reference forward and the rollout's forwards where the side runs them; a prompt "
            "shared by several rows once, each row's last token left out), one weight per layer as "
            "in the model, timed on this machine with the faster of MKL and oneDNN, against each "
            "side's measured time per step\n"
        )
        header = "comparison | matmul floor per step, ours / TRL | share of the step, ours / TRL"
        print(f"| shape | {header} |")
        print("|---|---|---|---|")
        for r in summary:
            if "floor_ours" in r:
                shape = "tiny (0.8M)" if r["preset"] == "tiny" else "GPT-2 124M shape"
                floor = f"{r['floor_ours'] * 1e3:.1f} / {r['floor_trl'] * 1e3:.1f} ms"
                share = f"{r['floor_pct_ours']:.0%} / {r['floor_pct_trl']:.0%}"
                print(f"| {shape} | {r['label']} | {floor} | {share} |")
    if args.out:
        with open(args.out, "w") as f:
            out = dict(args=vars(args), same=SAME, different=DIFFERENT, summary=summary)
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        (child_ours if spec["side"] == "ours" else child_trl)(spec)
    else:
        import tyro

        main(tyro.cli(Args))
