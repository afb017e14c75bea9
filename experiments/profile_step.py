"""Where a training step's time goes: torch.profiler over a window of optimizer steps of any
training script.

Runs SCRIPT with its own arguments in this process, profiles from the end of optimizer step START to
the end of step STOP (start-up, model loading and the first steps excluded), prints the wall time
per step and the profiler's table of ops by self CPU time, then exits without finishing the run (no
final evaluation or save). It hooks torch's global optimizer-step hook, so it works for this
project's scripts and for any torch trainer (TRL's included: that is how docs/benchmarks.md's
profiles of both sides were taken).

    python experiments/profile_step.py --start 6 --stop 14 -- sft.py --model DIR --total_steps 30 \\
        --out_dir /tmp/p
    python experiments/profile_step.py --rows 40 --out grpo.txt -- grpo.py --model DIR --beta 0 \\
        --out_dir /tmp/p

The profiler itself adds overhead (more for code that launches many small ops), so compare its
tables, not its times, with a benchmark's.
"""

import argparse
import os
import runpy
import sys
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--start", type=int, default=5, help="profile from the end of this optimizer step"
    )
    p.add_argument("--stop", type=int, default=13, help="... to the end of this one, then exit")
    p.add_argument("--rows", type=int, default=25, help="rows of the table")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT.py and its arguments")
    a = p.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    if not script or a.stop <= a.start:
        sys.exit("error: give `-- SCRIPT.py ARGS...` and --stop > --start")
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    state = {"steps": 0}

    def hook(optimizer, args, kwargs):
        state["steps"] += 1
        if state["steps"] == a.start:
            state["prof"], state["t0"] = profile(activities=activities), time.perf_counter()
            state["prof"].__enter__()
        elif state["steps"] == a.stop:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - state["t0"]) / (a.stop - a.start)
            state["prof"].__exit__(None, None, None)
            ops = state["prof"].key_averages()
            table = ops.table(sort_by="self_cpu_time_total", row_limit=a.rows)
            timing = (
                f"steps {a.start}-{a.stop}: {per_step * 1e3:.1f} ms per step under the profiler"
            )
            text = f"{' '.join(script)}\n{timing}\n{table}"
            print(text, flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    f.write(text)
            os._exit(0)  # the run's remaining steps, evaluation and save are not wanted

    register_optimizer_step_post_hook(hook)
    sys.argv = script
    sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
    runpy.run_path(script[0], run_name="__main__")
    sys.exit(f"error: {script[0]} ran {state['steps']} optimizer steps, fewer than --stop {a.stop}")


if __name__ == "__main__":
    main()
