"""Reward functions as plug-ins: `grpo_variants.py --reward_fn FILE.py:NAME`, repeatable.

A reward function is a plain Python function of three lists of equal length,

    def my_reward(prompts, responses, ground_truth):
        return [float(len(r) < 10) for r in responses]

prompts and responses decoded as text with the task's tokenizer (a prompt without its
padding; a response up to, not including, its stop token), and ground_truth as the task
stores it (None where the data has none). It returns one score per response: a list,
tuple, 1-D numpy array or 1-D tensor of finite numbers. Each rank scores its own rows,
so a function must score each response on its own (not against the rest of the batch)
for 1 rank and N ranks to train alike, and be a pure function of its inputs for a resume
to match an uninterrupted run. experiments/reward_fns.py has two to copy.

A problem with the flag (a malformed spec, a missing file or function, a return of the
wrong kind) is a one-line RunError; an exception raised by the user's own code, when the
file is imported or the function called, keeps its traceback.
"""

import importlib.util
import numbers
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from data.tokenizer import get_encoding

# RunError is a problem the user can fix: it prints one line, no traceback.
from gpt2 import RunError

EXAMPLE = "experiments/reward_fns.py:closeness"


class RewardFn(NamedTuple):
    spec: str  # FILE.py:NAME, as passed
    name: str  # NAME: the metric's name
    fn: Callable


def load_module(path: str):
    """The module of a .py file, loaded once per file: two functions of one file share it."""
    name = "reward_fns_" + os.path.abspath(path).replace(os.sep, "_").replace(".", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # In sys.modules before it runs, as an import would be (dataclasses look it up).
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_reward_fns(specs) -> list[RewardFn]:
    """--reward_fn FILE.py:NAME, each -> a RewardFn, in the order given."""
    reward_fns = []
    for spec in specs:
        path, _, name = spec.rpartition(":")
        flag = f"--reward_fn {spec}"
        if not (path and name.isidentifier()):
            raise RunError(f"{flag}: not FILE.py:NAME; pass e.g. {EXAMPLE}")
        if not path.endswith(".py"):
            raise RunError(f"{flag}: '{path}' is not a .py file; pass a Python file")
        if not os.path.isfile(path):
            raise RunError(f"{flag}: no file '{path}'; pass an existing .py file")
        if name in [reward_fn.name for reward_fn in reward_fns]:
            why = f"another --reward_fn is also named {name} (its metric's name)"
            raise RunError(f"{flag}: {why}; rename one")
        # The user's code runs here: an error inside it keeps its traceback.
        module = load_module(path)
        if not hasattr(module, name):
            raise RunError(f"{flag}: '{path}' defines no '{name}'; pass a function it defines")
        fn = getattr(module, name)
        if not callable(fn):
            kind = type(fn).__name__
            raise RunError(f"{flag}: '{name}' is not callable ({kind}); pass a function")
        reward_fns.append(RewardFn(spec=spec, name=name, fn=fn))
    return reward_fns


def texts(meta: dict, query: torch.Tensor, response: torch.Tensor) -> tuple[list, list]:
    """Prompts (B, Tq) and responses (B, Tr) decoded: a prompt's tokens other than the pad,
    a response's up to its first stop token (as the verifier reads it)."""
    enc = get_encoding(meta["tokenizer"])
    pad = meta["pad_token_id"]
    eos = meta["eos_token_id"]
    prompts = []
    for row in query.tolist():
        prompts.append(enc.decode([t for t in row if t != pad]))
    responses = []
    for row in response.tolist():
        if eos in row:
            row = row[: row.index(eos)]
        responses.append(enc.decode(row))
    return prompts, responses


def checked_scores(out, n: int) -> tuple[torch.Tensor | None, str | None]:
    """A reward function's return as (n,) float64 scores, or None and what is wrong."""
    if isinstance(out, (list, tuple)) and all(isinstance(x, numbers.Real) for x in out):
        scores = torch.tensor([float(x) for x in out], dtype=torch.float64)
    elif isinstance(out, np.ndarray) and out.ndim == 1 and out.dtype.kind in "biuf":
        scores = torch.from_numpy(out.astype(np.float64))
    elif isinstance(out, torch.Tensor) and out.dim() == 1 and not out.is_complex():
        scores = out.detach().to("cpu", torch.float64)
    else:
        what = type(out).__name__
        if isinstance(out, (np.ndarray, torch.Tensor)):
            what = f"a {what} of shape {tuple(out.shape)} and dtype {out.dtype}"
        elif isinstance(out, (list, tuple)):
            what = f"a {what} holding a non-number"
        return None, f"returned {what}"
    if len(scores) != n:
        return None, f"returned {len(scores)} scores for {n} responses"
    if not torch.isfinite(scores).all():
        bad = scores[~torch.isfinite(scores)][0].item()
        return None, f"returned a non-finite score ({bad})"
    return scores, None


def reward_fn_scores(reward_fns: list, meta: dict, query, response, ground_truth):
    """Each function's scores (B, F) of B responses (B, Tr) to their queries (B, Tq), and
    B ground truths as the prompt split stores them. A bad return on any rank is one line,
    which rank 0 prints: every rank calls this at the same time."""
    prompts, responses = texts(meta, query, response)
    # the data stores "" where a prompt has no ground truth
    truths = [str(truth) or None for truth in ground_truth]
    columns = []
    problem = None
    for reward_fn in reward_fns:
        # The user's code: what it raises keeps its traceback.
        out = reward_fn.fn(prompts, responses, truths)
        scores, why = checked_scores(out, len(responses))
        if why:
            fix = "return one finite float per response (a list, tuple, 1-D array or tensor)"
            problem = f"--reward_fn {reward_fn.spec} {why}: {fix}"
            break
        columns.append(scores)
    problems = [problem]
    if dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    for problem in problems:
        if problem:
            raise RunError(problem)
    return torch.stack(columns, 1)
