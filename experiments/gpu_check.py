"""The GPU acceptance check (issues 27 and 28): what a machine with GPUs runs first.

Items (`--items` picks some; a failed item is reported and the next one runs):
  smoke      `python pipeline.py --smoke`, then every script for 3 steps on all N GPUs
  attention  GPT-2 124M forward + backward, left-padded: gpt2.py's SDPA backends against
             cuDNN forced; then one SDPA call built to hit pytorch#196678
  ranks      every script at 1 and 2 GPUs: fp32 within 1e-5, bf16 within --bf16_tol; the
             1-GPU run's checkpoint resumes on 2 GPUs and on the CPU

    python experiments/gpu_check.py               # every item
    python experiments/gpu_check.py --device cpu  # a dry run on CPU

A 15-minute lease in one call: the speed benchmark alone first (it times the GPU; targets:
MFU >= 45%, sampling >= 3x HF's), then the items and the test suite side by side
(tests/conftest.py gives the GPU to tests/test_cuda.py only: its bf16 parity checks), each
stopped after --deadline seconds; a report is rewritten after each item:

    D=runs/gpu_check/lease; mkdir -p $D; B="python experiments/bench.py --sections cuda"
    $B,forward,generate --presets gpt2 --out $D/bench.json; $B --compile --out $D/bc.json
    for i in smoke,attention ranks; do python experiments/gpu_check.py --items $i \\
        --out $D/$i --deadline 380 & done; timeout 380 pytest -v -n 6 tests; wait

Without CUDA it runs the attention item's CPU sanity check only; --device cpu runs every item
on CPU (gloo ranks for GPUs, tiny shapes). The report goes to stdout and to --out (default
runs/gpu_check/<time>/report.{md,json}); exit status 1 when an item fails.
"""

import contextlib
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
import tyro
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel

# gpt2.py lives at the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpt2  # noqa: E402

ITEMS = ("smoke", "attention", "ranks")
SCRIPTS = ("sft", "reward", "dpo", "ppo", "grpo")


@dataclass
class Args:
    items: str = ",".join(ITEMS)  # comma-separated, of the items above
    device: Literal["auto", "cuda", "cpu"] = "auto"  # cpu: a dry run of every item on CPU
    out: str = ""  # report directory; default runs/gpu_check/<time>
    cpu_ranks: int = 2  # --device cpu: gloo ranks stand in for GPU counts up to this
    scripts: str = ",".join(SCRIPTS)  # the scripts that the smoke and ranks items run
    bf16_tol: float = 0.05  # ranks: largest bf16 |Δ1 - Δ2| / |Δ1| (Δ: the weights' change)
    attn_tol: float = 0.05  # attention: largest relative L2 difference of bf16 gradients
    timeout: int = 3600  # seconds any one subprocess may run
    deadline: int = 0  # seconds from the start after which no run starts (0: none)


# ---------------------------------------------------------------------------------------
# What the items share: the context, runs of the scripts, their flags, weights and metrics


class Failed(Exception):
    """A check that failed: the message is the report's line."""


@dataclass
class Ctx:
    args: Args
    cuda: bool
    gpus: int  # GPUs to use, or the CPU ranks that stand in for them
    out: str
    env: dict
    device: torch.device
    end: float = math.inf  # time.time() of --deadline
    stage: dict = field(default_factory=dict)  # the SFT and reward models of the short runs

    def dir(self, *parts):
        """A fresh path under out/work (its parent made, the path itself not)."""
        path = os.path.join(self.out, "work", *parts)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path


def launch(script, flags, nproc=0):
    """A script's command: plain python (nproc 0) or torchrun --nproc_per_node=nproc."""
    cmd = [sys.executable]
    if nproc:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    path = script if script.endswith(".py") else os.path.join(ROOT, f"{script}.py")
    return cmd + [path, *map(str, flags)]


def run(ctx, name, cmd, env=None, cwd=ROOT, check=True):
    """Run cmd, its output kept in out/logs/<name>.log: (return code, output); check: raise.
    It is killed, with every process it started, at --timeout or --deadline."""
    log = os.path.join(ctx.out, "logs", name.replace("/", "_") + ".log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    timeout = min(ctx.args.timeout, ctx.end - time.time())
    if timeout <= 0:
        raise Failed(f"{name}: not run, --deadline reached")
    t0 = time.time()
    # streamed: a run stopped midway leaves what it printed
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=cwd, env=ctx.env | (env or {}), stdout=f, stderr=f)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            p.wait()
            f.write(f"\ntimed out after {timeout:.0f} s\n")
            rc = 124
    with open(log) as f:
        # less the command line
        output = f.read().split("\n", 1)[-1]
    print(f"  {'ok  ' if rc == 0 else 'FAIL'} {name} ({time.time() - t0:.0f} s)", flush=True)
    if check and rc:
        raise Failed(f"{name} exited {rc}: {last_line(output)} (log: {log})")
    return rc, output


def kill_tree(pid):
    """SIGKILL pid and every process below it, read from /proc: torchrun starts its ranks in
    sessions of their own, out of reach of a process-group kill."""
    for each in [pid, *descendants(pid)]:
        # a process that ended meanwhile
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def descendants(pid):
    """The processes below pid (tests/test_world_sizes.py walks them the same way)."""
    try:
        kids = []
        for task in os.scandir(f"/proc/{pid}/task"):
            with open(f"{task.path}/children") as f:
                kids += [int(kid) for kid in f.read().split()]
    except OSError:
        # pid ended meanwhile
        return []
    return kids + [k for kid in kids for k in descendants(kid)]


def last_line(output):
    """The last error line of a run's output, else its last line."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or line.startswith("error:")]
    return (errors or lines or [""])[-1][-300:]


def yes(ok):
    return "yes" if ok else "NO"


def table(header, body):
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in body]


# per script: a 3-step run on the built-in task, a checkpoint at step 2; global batches of n
# sequences (pairs; prompts for ppo) or p prompts x 4 samples (grpo); e: 3 steps' episodes
STEPS = "--micro_batch_size 2 --warmup_steps 1 --total_steps 3"
FLAGS = {
    "sft": f"--batch_size {{n}} {STEPS}",
    "reward": f"--batch_size {{n}} {STEPS} --norm_samples {{n}}",
    "dpo": f"--batch_size {{n}} {STEPS}",
    "ppo": "--batch_size {n} --micro_batch_size 2 --num_minibatches 1 --total_episodes {e} "
    "--response_length 4",
    "grpo": "--num_prompts_per_step {p} --num_samples_per_prompt 4 --micro_batch_size 4 "
    "--num_minibatches 2 --total_episodes {e} --response_length 4 --beta 0.05 "
    "--missing_eos_penalty 1",
}


def script_flags(ctx, script, k, eval_size=0):
    """A short run of script from the stage models; global batch 8 k (grpo: 2 k prompts), so
    that k ranks take 8 each. sft starts from the stage SFT model too: every start is on disk."""
    stage = stage_models(ctx)
    flags = FLAGS[script].format(n=8 * k, p=2 * k, e=24 * k).split()
    flags += ["--eval_size", eval_size, "--eval_every", 2, "--log_every", 1]
    flags += ["--model", stage["sft"]]
    if script == "ppo":
        flags += ["--reward_model", stage["reward"]]
    return flags


def stage_models(ctx):
    """An SFT model and a reward model for the other runs: a few steps each, made once."""
    if not ctx.stage:
        sft = ctx.dir("stage", "sft")
        reward = ctx.dir("stage", "reward")
        flags = FLAGS["sft"].format(n=16).split() + ["--eval_size", 0, "--out_dir", sft]
        run(ctx, "stage/sft", launch("sft", flags))
        flags = FLAGS["reward"].format(n=16).split() + ["--eval_size", 0, "--model", sft]
        run(ctx, "stage/reward", launch("reward", [*flags, "--out_dir", reward]))
        ctx.stage.update(sft=sft, reward=reward)
    return ctx.stage


def scripts(ctx):
    chosen = ctx.args.scripts.split(",")
    if set(chosen) - set(SCRIPTS):
        raise Failed(f"--scripts {ctx.args.scripts}: use some of {','.join(SCRIPTS)}")
    return chosen


# Parameters whose gradient is 0 in exact arithmetic (tests/test_world_sizes.py): the attention
# key bias, and under the pairwise reward loss the biases that shift both rewards alike. Adam
# divides their rounding noise by its own size: they are left out of the comparisons.
NULL = {"reward": ("transformer.ln_f.bias", "score.bias")}


def without_keys(t):
    """An attention c_attn bias (queries, keys, values) without its keys."""
    third = t.numel() // 3
    return torch.cat([t[:third], t[2 * third :]])


def weight_diff(out_a, out_b, script, start=None):
    """(max |a - b|, |update_a - update_b| / |update_a|) of two runs' final weights; the relative
    one over the tensors of `start`, the weights both runs began from (nan without it)."""
    a = load_file(os.path.join(out_a, "model.safetensors"))
    b = load_file(os.path.join(out_b, "model.safetensors"))
    w0 = load_file(os.path.join(start, "model.safetensors")) if start else {}
    worst = 0.0
    num, den = 0.0, 0.0
    for k in a:
        if k in NULL.get(script, ()):
            continue
        x, y = a[k].double(), b[k].double()
        if k.endswith("attn.c_attn.bias"):
            x, y = without_keys(x), without_keys(y)
        worst = max(worst, (x - y).abs().max().item())
        if k in w0 and not k.endswith("attn.c_attn.bias"):
            num += (x - y).square().sum().item()
            den += (x - w0[k].double()).square().sum().item()
    return worst, math.sqrt(num / den) if den else float("nan")


def padded_batch(B, T, pad, device, seed=0):
    """Random tokens (B, T) below pad, row i left-padded with i * T // (2 B) pads; the mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] >= (torch.arange(B) * T // (2 * B))[:, None]
    idx = torch.randint(0, pad, (B, T), generator=g).masked_fill(~mask, pad)
    return idx.to(device), mask.to(device)


# ---------------------------------------------------------------------------------------
# The items: each returns (passed: True, False, or None for a measurement; report lines; values)


def item_smoke(ctx):
    """pipeline.py --smoke (one process per stage), then every script under torchrun on all N
    GPUs (the ranks item runs them at 1 and 2)."""
    work = ctx.dir("smoke")
    # the pipeline's runs/ and `latest` links go here, not into the repository
    os.makedirs(work)
    cmd = [sys.executable, f"{ROOT}/pipeline.py", "--smoke"]
    rc, output = run(ctx, "smoke/pipeline", cmd, cwd=work, check=False)
    results = {"pipeline": "ok" if rc == 0 else f"FAILED: {last_line(output)}"}
    k = ctx.gpus
    lines = []
    for script in scripts(ctx):
        flags = [*script_flags(ctx, script, k, 16), "--out_dir", f"{work}/{script}_{k}"]
        rc, output = run(ctx, f"smoke/{script}_{k}", launch(script, flags, k), check=False)
        results[script] = "ok" if rc == 0 else f"FAILED: {last_line(output)}"
        warnings = [line.strip() for line in output.splitlines() if "Warning" in line]
        lines += [f"warning printed: {script}: {line[:200]}" for line in warnings[:1]]
    body = [[script, results[script][:80]] for script in scripts(ctx)]
    head = [f"`python pipeline.py --smoke`: {results['pipeline']}", ""]
    lines = head + table(["script", f"torchrun x{k}"], body) + lines
    return all(v == "ok" for v in results.values()), lines, results


def lse_case(device, backends, T, dtype):
    """pytorch#196678's case in one SDPA call: the padded rows (which see only themselves, as in
    gpt2.py) score -100, a logsumexp below -88.7. 'finite' when grad_q is."""
    g = torch.Generator().manual_seed(T)
    # row 1: its first half is padding
    B, H = 2, 4
    hd = 64
    pads = T // 2
    q, k, v = (torch.randn(B, H, T, hd, generator=g) for _ in range(3))
    k_sq = k[1, :, :pads].square().sum(-1, keepdim=True)
    # so that q.k / sqrt(hd) = -100
    q[1, :, :pads] = -k[1, :, :pads] * 100 * math.sqrt(hd) / k_sq
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :pads] = False
    i = torch.arange(T)
    attn = ((i[None, :] <= i[:, None]) & real[:, None, None, :]) | (i[None, :] == i[:, None])
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, attn.to(device))
        out.float().square().sum().backward()
    except RuntimeError as e:
        # no kernel of these backends takes the inputs
        return f"not available ({str(e).splitlines()[0][:60]})"
    return "finite" if torch.isfinite(q.grad).all() else "NaN"


def model_grads(model, idx, mask, backends, amp):
    """All parameters' gradients (flat) of the mean next-token loss, with these SDPA backends."""
    model.zero_grad(set_to_none=True)
    ours = gpt2.SDPA_BACKENDS
    gpt2.SDPA_BACKENDS = backends
    try:
        with amp:
            logits = model(idx, mask)[:, :-1].flatten(0, 1).float()
            nll = F.cross_entropy(logits, idx[:, 1:].flatten(), reduction="none")
    finally:
        gpt2.SDPA_BACKENDS = ours
    (nll * mask[:, 1:].flatten()).sum().div(mask[:, 1:].sum()).backward()
    return torch.cat([p.grad.to_dense().flatten().float() for p in model.parameters()])


def item_attention(ctx):
    """GPT-2 124M (on CPU a 2-layer model) forward + backward, left-padded, at three lengths with
    gpt2.py's SDPA backends and with cuDNN forced (the math kernel on CPU); then lse_case."""
    cuda = ctx.cuda
    small = dict(n_layer=2, n_head=4, n_embd=128, vocab_size=257)
    cfg = gpt2.GPTConfig(**(gpt2.PRESETS["gpt2"] if cuda else small))
    forced = [SDPBackend.CUDNN_ATTENTION] if cuda else [SDPBackend.MATH]
    name = "cuDNN" if cuda else "math"
    amp = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = gpt2.GPT(cfg).to(ctx.device)
    ok = True
    body, values = [], {}
    for T in (192, 320, 704):
        idx, mask = padded_batch(4, T, cfg.vocab_size - 1, ctx.device, seed=T)
        ours = model_grads(model, idx, mask, gpt2.SDPA_BACKENDS, amp)
        ours_finite = bool(torch.isfinite(ours).all())
        try:
            other = model_grads(model, idx, mask, forced, amp)
            finite = "yes" if torch.isfinite(other).all() else "NO (NaN)"
            diff = ((ours - other).norm() / ours.norm()).item()
        except RuntimeError as e:
            # no kernel for these inputs
            finite = f"not available ({str(e).splitlines()[0][:60]})"
            diff = float("nan")
        case = {
            "ours": lse_case(ctx.device, gpt2.SDPA_BACKENDS, T, dtype),
            name: lse_case(ctx.device, forced, T, dtype),
        }
        # gpt2.py's choice must be finite and, where the forced one is finite too, agree with it
        ok &= ours_finite and case["ours"] == "finite" and not diff > ctx.args.attn_tol
        body.append([T, yes(ours_finite), finite, f"{diff:.2e}", case["ours"], case[name]])
        values[T] = dict(finite=ours_finite, forced=finite, rel_diff=diff, lse_case=case)
    header = ["T", "gpt2.py: finite", f"{name}: finite", "rel. L2 diff of grads"]
    lines = table([*header, "lse < -88.7 case: gpt2.py", f"lse case: {name}"], body)
    precision = "bf16 autocast" if cuda else "fp32"
    lines.append(
        f"pass: gpt2.py's SDPA choice finite at every T and in the lse case; where {name} is"
        f" finite too, the gradients agree within --attn_tol {ctx.args.attn_tol}"
        f" ({cfg.n_layer} layers, {precision})"
    )
    return ok, lines, values


def tensors_in(obj):
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if not isinstance(obj, list | tuple):
        return []
    return [t for v in obj for t in tensors_in(v)]


def cpu_only(checkpoint):
    """Whether a checkpoint's .pt files (the run's state, its optimizers') hold CPU tensors only."""
    files = glob.glob(os.path.join(checkpoint, "**", "*.pt"), recursive=True)
    state = [torch.load(f, "cpu", weights_only=True) for f in files]
    return all(t.device.type == "cpu" for t in tensors_in(state))


def item_ranks(ctx):
    """Each script at 1 and 2 GPUs (torchrun both), in fp32 and in bf16: the final weights
    agree. The 1-GPU fp32 run's step-2 checkpoint holds CPU tensors only, and resumed under
    torchrun on 2 GPUs and on the CPU it ends at the uninterrupted run's weights."""
    start = stage_models(ctx)["sft"]
    two = ctx.gpus >= 2
    ok = True
    body, values = [], {}
    for script in scripts(ctx):
        flags = [*script_flags(ctx, script, 2), "--keep_checkpoints", 5]
        runs = [("float32", 1)]
        if two:
            runs += [("float32", 2), ("bfloat16", 1), ("bfloat16", 2)]
        dirs = {}
        for dtype, k in runs:
            name = f"{script}_{dtype}_{k}"
            dirs[dtype, k] = ctx.dir("ranks", name)
            cmd = launch(script, [*flags, "--dtype", dtype, "--out_dir", dirs[dtype, k]], k)
            run(ctx, f"ranks/{name}", cmd)
        first = dirs["float32", 1]
        step2 = os.path.join(first, "checkpoints", "step_00000002")
        res = {"cpu_only": cpu_only(step2)}
        if two:
            res["fp32"] = weight_diff(first, dirs["float32", 2], script, start)[0]
            bf16 = weight_diff(dirs["bfloat16", 1], dirs["bfloat16", 2], script, start)
            res["bf16"], res["bf16_rel"] = bf16
        targets = {"cpu": (0, {"CUDA_VISIBLE_DEVICES": ""})}
        if two:
            targets["2gpus"] = (2, {})
        for name, (nproc, env) in targets.items():
            resumed = ctx.dir("ranks", f"{script}_resumed_{name}")
            shutil.copytree(step2, os.path.join(resumed, "checkpoints", "step_00000002"))
            resume = ["--dtype", "float32", "--out_dir", resumed, "--resume"]
            cmd = launch(script, [*flags, *resume], nproc)
            run(ctx, f"ranks/{script}_resumed_{name}", cmd, env)
            res[f"resumed_{name}"] = weight_diff(first, resumed, script)[0]
        # the CPU's fp32 kernels are not the GPU's: 1e-4 there, 1e-5 between GPU rank counts
        good = res["cpu_only"] and res["resumed_cpu"] <= 1e-4
        if two:
            good &= res["fp32"] <= 1e-5 and res["bf16_rel"] <= ctx.args.bf16_tol
            good &= res["resumed_2gpus"] <= 1e-5
        ok &= good
        keys = ("fp32", "bf16", "bf16_rel", "resumed_2gpus", "resumed_cpu")
        cells = [f"{res[key]:.2e}" if key in res else "– (1 GPU)" for key in keys]
        body.append([script, *cells, yes(res["cpu_only"]), yes(good)])
        values[script] = res
    header = ["script", "fp32 max diff", "bf16 max diff", "bf16 rel. update diff"]
    header += ["resumed on 2 GPUs", "resumed on CPU", "checkpoint on CPU", "ok"]
    lines = table(header, body)
    lines.append(
        "pass: 1 vs 2 GPUs, fp32 within 1e-5 and bf16 |Δ1 - Δ2| / |Δ1| <= --bf16_tol"
        f" {ctx.args.bf16_tol} (Δ: the weights' change, L2); the checkpoint's tensors on the CPU;"
        " resumed, 2 GPUs within 1e-5 and the CPU within 1e-4 of the uninterrupted 1-GPU run"
    )
    return ok, lines, values


# ---------------------------------------------------------------------------------------
# main: the items in turn, then one report


def run_item(ctx, item):
    """One item: its report entry (status, seconds, lines, values), printed as it ends."""
    print(f"\n== {item}", flush=True)
    t0 = time.time()
    passed, values = False, {}
    try:
        passed, lines, values = globals()[f"item_{item}"](ctx)
    except Failed as e:
        lines = [f"FAILED: {e}"]
    except Exception:
        # a crash in the check itself: reported, and the next item runs
        lines = ["ERROR", *traceback.format_exc().splitlines()[-8:]]
    status = {True: "PASS", False: "FAIL", None: "MEASURED"}[passed]
    if "--deadline reached" in lines[0]:
        status = "NOT RUN"
    # what an item left cached would shrink the next one's GPU
    torch.cuda.empty_cache()
    print("\n".join(lines), flush=True)
    return dict(status=status, seconds=round(time.time() - t0), lines=lines, values=values)


def write_report(out, head, args, report):
    """report.md and report.json in out: written after every item, so a stopped run keeps
    them. Returns the summary table's lines."""
    md = [f"# {head}", "", f"`{' '.join(sys.argv)}`", ""]
    for item, r in report.items():
        md += [f"## {item}: {r['status']} ({r['seconds']} s)", "", *r["lines"], ""]
    rows = [[item, r["status"], r["seconds"]] for item, r in report.items()]
    summary = table(["item", "status", "seconds"], rows)
    md += ["## summary", "", *summary]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(dict(head=head, args=asdict(args), items=report), f, indent=2, default=str)
    return summary


def main(args: Args):
    t_start = time.time()
    items = args.items.split(",")
    unknown = sorted(set(items) - set(ITEMS))
    if unknown:
        raise gpt2.RunError(f"--items: unknown {unknown}: use some of {','.join(ITEMS)}")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        raise gpt2.RunError("--device cuda: no CUDA device here")
    if not cuda and args.device == "auto":
        print("no CUDA device: only the attention item's CPU sanity check runs (--device cpu)")
        items = [i for i in items if i == "attention"]
    gpus = torch.cuda.device_count() if cuda else args.cpu_ranks
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.abspath(args.out or os.path.join(ROOT, "runs", "gpu_check", stamp))
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    threads = os.environ.get("OMP_NUM_THREADS", "4" if cuda else "1")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=threads)
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    end = t_start + args.deadline if args.deadline > 0 else math.inf
    device = torch.device("cuda" if cuda else "cpu")
    ctx = Ctx(args, cuda, gpus, out, env, device, end)
    if cuda:
        machine = f"{gpus} x {torch.cuda.get_device_name()}"
    else:
        machine = f"{os.cpu_count()} CPU cores"
        if args.device == "cpu":
            machine += f", {gpus} gloo ranks as GPUs"
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip() or "?"
    head = f"gpu_check: {machine}; torch {torch.__version__}; commit {commit}"
    print(f"{head}\n`{' '.join(sys.argv)}`", flush=True)
    report = {}
    for item in items:
        report[item] = run_item(ctx, item)
        write_report(out, head, args, report)
    summary = write_report(out, head, args, report)
    print("\n" + "\n".join(summary) + f"\n\nwritten to {out}/report.md and .json")
    sys.exit(1 if any(r["status"] == "FAIL" for r in report.values()) else 0)


if __name__ == "__main__":
    main(tyro.cli(Args))
