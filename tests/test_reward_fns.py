"""grpo_variants.py --reward_fn FILE.py:NAME (data/rewards.py): what a function is given (prompts without
padding, responses up to their stop token, None for a missing ground truth), the returns it may
give, one-line errors for a bad spec, weight count or return (on any rank), tracebacks kept for
the user's own code; end to end: the weighted sum against the logged means, a run with reward
functions only, 1 rank == 2 ranks, resume == uninterrupted."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import data.rewards
import gpt2
import grpo_variants
from failed_run import why
from runs import error_line, in_process

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
EOS = 256  # the offline task's stop token and pad
META = dict(tokenizer="bytes", pad_token_id=EOS, eos_token_id=EOS)
TINY = (  # a random tiny policy: its bytes rarely stop, and the functions below tell them apart
    "--model tiny --no_verifier --num_prompts_per_step 8 --num_samples_per_prompt 4 "
    "--micro_batch_size 8 --eval_size 0 --response_length 4 --num_minibatches 1 --lr 3e-3 "
    "--missing_eos_penalty 1 --log_every 1"
).split()
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]

PLUGIN = '''
import numpy as np
import torch

seen = []
CONSTANT = 3


def spread(prompts, responses, ground_truth):
    """Distinct characters of each response: scores that differ within a group."""
    seen.append((prompts, responses, ground_truth))
    return [float(len(set(r))) for r in responses]


def first_byte(prompts, responses, ground_truth):
    return torch.tensor([ord(r[0]) / 256 if r else 0.0 for r in responses])


def as_tuple(prompts, responses, ground_truth):
    return tuple(len(r) for r in responses)


def as_array(prompts, responses, ground_truth):
    return np.arange(len(responses), dtype=np.int64)


def boom(prompts, responses, ground_truth):
    raise ValueError("boom inside the user's function")


def short(prompts, responses, ground_truth):
    return [1.0] * (len(responses) - 1)


def nan_on_rank_1(prompts, responses, ground_truth):
    import os
    bad = os.environ.get("RANK") == "1"
    return [float("nan") if bad else 0.0 for r in responses]
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "plug.py"
    path.write_text(PLUGIN)
    return str(path)


def command(args, nproc=0):
    return (
        [*TORCHRUN, str(nproc), "grpo_variants.py", *args]
        if nproc
        else [sys.executable, "grpo_variants.py", *args]
    )


def run(args, nproc=0, check=True):
    cmd = command(args, nproc)
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 or not check, why(p)
    return p


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


# ---- loading and scoring


def test_a_function_gets_prompts_responses_and_ground_truth_as_text(plugin):
    """Left-padded prompts lose their padding, responses end before their first stop token (pad
    and stray tokens after it are dropped), "" ground truth is None; both functions of one file
    share its module."""
    fns = data.rewards.load_reward_fns([f"{plugin}:spread", f"{plugin}:first_byte"])
    assert [fn.name for fn in fns] == ["spread", "first_byte"]
    query = torch.tensor([[EOS, EOS, *b"1+2="], [*b"10+20="]])
    response = torch.tensor([[*b" 33", EOS, EOS, 7], [*b"xyzzy", 9]])
    truth = np.array(["3", ""])
    scores = data.rewards.reward_fn_scores(fns, META, query, response, truth)
    module = sys.modules[fns[0].fn.__module__]
    assert module.seen == [(["1+2=", "10+20="], [" 33", "xyzzy\t"], ["3", None])]
    assert fns[1].fn.__module__ == fns[0].fn.__module__
    want = [[2.0, ord(" ") / 256], [4.0, ord("x") / 256]]  # " 33": " " and "3"
    assert scores.dtype == torch.float64 and scores.tolist() == want


@pytest.mark.parametrize("name, want", [("as_tuple", [3.0, 0.0]), ("as_array", [0.0, 1.0])])
def test_a_tuple_or_an_integer_array_is_a_return_too(plugin, name, want):
    fns = data.rewards.load_reward_fns([f"{plugin}:{name}"])
    query = torch.tensor([[*b"1+2="], [*b"2+2="]])
    response = torch.tensor([[*b"abc"], [EOS, 1, 2]])
    scores = data.rewards.reward_fn_scores(fns, META, query, response, ["3", "4"])
    assert scores[:, 0].tolist() == want


BAD_RETURNS = {  # what a function returns for 2 responses: the error
    "[1.0]": "returned 1 scores for 2 responses",
    "1.0": "returned float",
    "['1', '2']": "returned a list holding a non-number",
    "np.zeros((2, 1))": "returned a ndarray of shape (2, 1) and dtype float64",
    "np.array(['a', 'b'])": "returned a ndarray of shape (2,) and dtype <U1",
    "torch.tensor(1.0)": "returned a Tensor of shape () and dtype torch.float32",
    "[0.0, float('nan')]": "returned a non-finite score (nan)",
    "torch.tensor([float('-inf'), 0.0])": "returned a non-finite score (-inf)",
    "None": "returned NoneType",
}


@pytest.mark.parametrize("returned, expected", BAD_RETURNS.items())
def test_a_bad_return_is_a_one_line_error(tmp_path, returned, expected):
    path = tmp_path / "bad.py"
    path.write_text(f"import numpy as np\nimport torch\n\ndef f(p, r, t):\n    return {returned}\n")
    fns = data.rewards.load_reward_fns([f"{path}:f"])
    query = torch.tensor([[*b"1+2="], [*b"2+2="]])
    response = torch.tensor([[*b"abc"], [*b"def"]])
    with pytest.raises(gpt2.RunError) as e:
        data.rewards.reward_fn_scores(fns, META, query, response, ["3", "4"])
    assert str(e.value) == f"--reward_fn {path}:f {expected}: return one finite float " + (
        "per response (a list, tuple, 1-D array or tensor)"
    )


# ---- one-line errors, and tracebacks for the user's own code


def bad_specs(plugin):  # flags: the error
    missing = str(Path(plugin).parent / "missing.py")
    return {
        "--reward_fn plug": "--reward_fn plug: not FILE.py:NAME; pass e.g. experiments/",
        f"--reward_fn {plugin}:": f"--reward_fn {plugin}:: not FILE.py:NAME",
        "--reward_fn notes.txt:f": "--reward_fn notes.txt:f: 'notes.txt' is not a .py file",
        f"--reward_fn {missing}:f": f"--reward_fn {missing}:f: no file '{missing}'",
        f"--reward_fn {plugin}:nope": f"'{plugin}' defines no 'nope'; pass a function it",
        f"--reward_fn {plugin}:CONSTANT": "'CONSTANT' is not callable (int); pass a function",
        f"--reward_fn {plugin}:spread --reward_fn {plugin}:spread": "also named spread",
        f"--reward_fn {plugin}:spread --reward_weights 1 2": "--reward_weights: 2 for 1 --reward_fn",
        "--reward_weights 1": "--reward_weights: 1 for 0 --reward_fn",
        f"--reward_fn {plugin}:spread --reward_weights nan": "--reward_weights nan: not a finite",
        "": "no reward: no verifier (for this task, or --no_verifier): pass --reward_model, --reward_fn or",
    }


@pytest.mark.parametrize("case", range(11))
def test_bad_specs_give_one_line_errors_before_the_run_dir(tmp_path, plugin, case):
    flags, expected = list(bad_specs(plugin).items())[case]
    args = [*TINY, "--out_dir", str(tmp_path / "x"), *flags.split()]
    line = error_line(grpo_variants, args)
    assert expected in line, line
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["nope", "spread --reward_weights 1 2 3"])
def test_a_bad_spec_prints_one_line_and_exits_1(tmp_path, plugin, name):
    """As a user runs it: `--reward_fn a.py:f --reward_fn b.py:g` is two functions; a bad one is
    one line on stderr, exit status 1."""
    args = [*TINY, "--out_dir", str(tmp_path / "x"), "--reward_fn", f"{plugin}:first_byte"]
    args += ["--reward_fn", f"{plugin}:{name.split()[0]}", *name.split()[1:]]
    p = run(args, check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert not (tmp_path / "x").exists()


def test_an_error_inside_the_users_code_keeps_its_traceback(tmp_path, plugin):
    """Importing the file and calling the function run the user's code: a traceback, not a line."""
    broken = tmp_path / "broken.py"
    broken.write_text("def f(p, r, t):\n    return r\n\n1 / 0\n")
    args = [*TINY, "--out_dir", str(tmp_path / "a"), "--total_episodes", "32"]
    p = run([*args, "--reward_fn", f"{broken}:f"], check=False)
    assert p.returncode == 1 and "Traceback" in p.stderr and "ZeroDivisionError" in p.stderr
    assert f'"{broken}", line 4' in p.stderr, p.stderr
    args = [*TINY, "--out_dir", str(tmp_path / "b"), "--total_episodes", "32"]
    p = run([*args, "--reward_fn", f"{plugin}:boom"], check=False)
    assert p.returncode == 1 and "Traceback" in p.stderr, p.stderr
    assert "ValueError: boom inside the user's function" in p.stderr, p.stderr


# ---- end to end


def test_reward_functions_only_log_their_means_and_add_up_weighted(tmp_path, plugin):
    """No verifier, no reward model: objective/scores is 0.5 x spread - 2 x first_byte, minus
    the missing-stop penalty of 1, in every step's means (the weighted sum is linear)."""
    flags = ["--reward_fn", f"{plugin}:spread", "--reward_fn", f"{plugin}:first_byte"]
    flags += ["--reward_weights", "0.5", "-2", "--total_episodes", "96"]
    in_process(grpo_variants, [*TINY, "--out_dir", str(tmp_path), *flags])
    m = metrics(tmp_path)
    assert [r["step"] for r in m] == [1, 2, 3] and "eval/accuracy" not in m[-1]
    for r in m:
        spread = r["objective/reward_fn/spread"]
        first_byte = r["objective/reward_fn/first_byte"]
        assert 1 <= spread <= 4 and first_byte > 0 and r["objective/zero_std_frac"] < 1
        want = 0.5 * spread - 2 * first_byte - (1 - r["val/stop_frac"])
        assert r["objective/scores"] == pytest.approx(want, abs=1e-5)


def test_one_rank_equals_two_ranks_and_a_bad_return_on_rank_1_is_one_line(tmp_path, plugin):
    common = [*TINY, "--reward_fn", f"{plugin}:spread", "--total_episodes", "64"]
    common += ["--reward_fn", "experiments/reward_fns.py:answer_format", "--beta", "0.05"]
    in_process(grpo_variants, ["--out_dir", str(tmp_path / "r1"), *common])
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and "objective/reward_fn/answer_format" in x
        for k in (k for k in x if not k.startswith("perf/")):
            assert abs(x[k] - y[k]) < 1e-4, (k, x[k], y[k])
    # rank 1's rows only: rank 0 prints the line, once
    args = [*TINY, "--out_dir", str(tmp_path / "bad"), "--reward_fn", f"{plugin}:nan_on_rank_1"]
    p = run(args, nproc=2, check=False)
    want = f"error: --reward_fn {plugin}:nan_on_rank_1 returned a non-finite score (nan)"
    assert p.returncode != 0 and p.stderr.count(want) == 1, p.stderr[-3000:]
    # torchrun then prints its own ChildFailedError summary, but no rank a traceback
    assert 'grpo_variants.py", line' not in p.stderr and "rewards.py" not in p.stderr, p.stderr[
        -3000:
    ]


def test_resume_with_a_reward_function_matches_uninterrupted(tmp_path, plugin):
    common = [*TINY, "--reward_fn", f"{plugin}:spread", "--total_episodes", "128"]
    common += ["--eval_every", "2", "--keep_checkpoints", "5"]
    in_process(grpo_variants, ["--out_dir", str(tmp_path / "full"), *common])
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    in_process(grpo_variants, ["--out_dir", str(tmp_path / "resumed"), "--resume", *common])
    full = {r["step"]: r for r in metrics(tmp_path / "full")}
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        for k in (k for k in r if not k.startswith("perf/")):
            assert r[k] == pytest.approx(full[r["step"]][k], abs=1e-6), k
