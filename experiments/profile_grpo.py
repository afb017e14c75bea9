"""Where a grpo.py step goes on CPU: torch.profiler over a few steps of the tiny
model at experiments/peer_bench.py's GRPO shape (16 prompts x 8 samples, up to 16
tokens, beta 0, one minibatch of all 128 rows), in this process.

It prints the step's time under the profiler, the rollout's `gpt2.generate` within
it, and the ops that take the most self CPU time per step. docs/benchmarks.md
("Where tiny GRPO's step goes") quotes it.

    OMP_NUM_THREADS=1 python experiments/profile_grpo.py
    OMP_NUM_THREADS=1 python experiments/profile_grpo.py --active 4 --top 10
"""

import os
import runpy
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import tyro
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, record_function, schedule

# grpo.py and gpt2.py live at the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpt2  # noqa: E402


@dataclass
class Args:
    warmup: int = 3  # steps run before the profiler records
    active: int = 8  # steps the profiler records
    top: int = 15  # ops listed, by self CPU time per step
    prompts: int = 16  # prompts per step
    samples: int = 8  # responses per prompt
    response_length: int = 16  # most tokens per response


def profiled_generate(*args, **kwargs):
    """gpt2.generate under its own label: the rollout's share of the step."""
    with record_function("gpt2.generate"):
        return GENERATE(*args, **kwargs)


GENERATE = gpt2.generate


def main(args: Args):
    with tempfile.TemporaryDirectory() as tmp:
        profile_steps(args, out_dir=os.path.join(tmp, "run"))


def profile_steps(args, out_dir):
    rows = args.prompts * args.samples
    steps = args.warmup + args.active
    flags = dict(
        model="tiny",
        out_dir=out_dir,
        total_episodes=(steps + 1) * rows,
        num_prompts_per_step=args.prompts,
        num_samples_per_prompt=args.samples,
        num_minibatches=1,
        num_epochs=1,
        micro_batch_size=rows,
        response_length=args.response_length,
        temperature=1.0,
        beta=0.0,
        eval_size=0,
        eval_every=steps + 1,
    )
    script = os.path.join(ROOT, "grpo.py")
    argv = [script] + [arg for k, v in flags.items() for arg in (f"--{k}", str(v))]
    # One profiler step per GRPO step: one minibatch and one epoch make one optimizer
    # step per GRPO step.
    plan = schedule(wait=0, warmup=args.warmup, active=args.active, repeat=1)
    # The start, then the time at the end of each optimizer step.
    ends = [time.perf_counter()]

    def step_done(optimizer, *_):
        ends.append(time.perf_counter())
        prof.step()

    with profile(activities=[ProfilerActivity.CPU], schedule=plan) as prof:
        hook = register_optimizer_step_post_hook(step_done)
        gpt2.generate = profiled_generate
        # grpo.py runs as from its command line, in this process: its calls of
        # gpt2.generate find the labelled one.
        sys.argv = argv
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            gpt2.generate = GENERATE
            hook.remove()

    # The recorded steps: from the end of the last warmup step to the end of the last
    # active one.
    recorded = ends[args.warmup : args.warmup + args.active + 1]
    wall = [1000 * (b - a) for a, b in zip(recorded, recorded[1:])]
    events = prof.key_averages()
    ms = {e.key: e.self_cpu_time_total / args.active / 1000 for e in events}
    generate = next(e for e in events if e.key == "gpt2.generate")
    print(f"threads {torch.get_num_threads()}, {args.active} steps after {args.warmup}")
    print(f"step under the profiler: {statistics.median(wall):.0f} ms (median)")
    print(f"  gpt2.generate: {generate.cpu_time_total / args.active / 1000:.0f} ms")
    # A label's self time is what no op inside it took: the Python between the ops.
    python = ms["ProfilerStep*"] + ms["gpt2.generate"]
    print(f"  Python between the ops: {python:.0f} ms (the labels' self time)")
    print("ops by self CPU time, ms per step:")
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    for e in ranked[: args.top]:
        print(f"  {ms[e.key]:7.1f}  {e.count // args.active:5d} calls  {e.key}")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
