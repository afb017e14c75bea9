"""reward.py: the Bradley–Terry loss, normalisation at --norm_temperature, rewards whatever the
padding; a tiny run learns and saves a normalised reward model whose eval it reproduces; 1 rank ==
2 ranks (FSDP2, gloo), resume; --max_train_pairs; one-line errors; real HH-RLHF pairs."""

import ast
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

import data
import gpt2
import reward
from failed_run import why
from runs import error_line, in_process

ROOT = Path(__file__).resolve().parents[1]
HH = ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
SMALL = ["--model", "tiny", "--batch_size", "16", "--micro_batch_size", "4", "--eval_size", "32"]
SMALL += ["--warmup_steps", "5", "--log_every", "1", "--norm_samples", "32"]
META, PAIR = data.load_meta("arithmetic"), ("query", "chosen", "rejected")


def run(args, nproc=0, check=True, cwd=ROOT):
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command = [sys.executable, *(torchrun if nproc else []), str(ROOT / "reward.py"), *args]
    p = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, why(p)
    return p


def run_here(args):
    """A run as run() makes it, in this process (runs.in_process): for the tests whose subject is
    the run, not its process."""
    in_process(reward, args)


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def tiny_reward_model(meta=META):
    torch.manual_seed(0)
    return gpt2.load("tiny", meta, head="new").eval()


@torch.no_grad()
def saved_model_eval(out_dir, data_dir, n, micro_batch_size):
    """Pairwise accuracy and loss of the saved reward model on the first n pref_test pairs, in the
    run's micro-batches, on raw scores (its gain and bias undone): what the run's last eval saw."""
    meta, split = data.load_meta(data_dir), data.load_split(data_dir, "pref_test")
    model = gpt2.load(str(out_dir), meta, head="saved").eval()
    raw = lambda r: (r - model.reward_bias) / model.reward_gain
    correct, loss = 0, 0.0
    for i in range(0, n, micro_batch_size):
        pair = [torch.from_numpy(split[k][i : i + micro_batch_size]) for k in PAIR]
        pad, eos = meta["pad_token_id"], meta["eos_token_id"]
        r_chosen, r_rejected = reward.pair_rewards(model, *pair, pad, eos, nullcontext())
        correct += int((r_chosen > r_rejected).sum())
        loss += reward.preference_loss(raw(r_chosen), raw(r_rejected)).sum().item()
    return correct / n, loss / n


def test_preference_loss_closed_form():
    r_c, r_r = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 1.0, 0.5])
    # -log σ(x) = log(1 + exp(-x)), x = r_c - r_r - margin; plus the centring term
    pairs = zip(r_c.tolist(), r_r.tolist())
    expected = [math.log1p(math.exp(-(c - r - 0.3))) + 0.05 * (c + r) ** 2 for c, r in pairs]
    got = reward.preference_loss(r_c, r_r, margin=0.3, center_coef=0.05)
    torch.testing.assert_close(got, torch.tensor(expected))
    assert reward.preference_loss(torch.zeros(1), torch.zeros(1)).item() == pytest.approx(
        math.log(2)
    )


def test_normalization_gives_mean_0_std_1():
    scores = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3 + 7
    gain, bias = reward.normalization(scores)
    normed = gain * scores.double() + bias
    assert abs(normed.mean().item()) < 1e-9 and abs(normed.std(correction=0).item() - 1) < 1e-9
    with pytest.raises(gpt2.RunError, match="all score 2.5"):
        reward.normalization(torch.full((8,), 2.5))


def test_pad_other_than_eos_gives_the_same_rewards_and_loss():
    """The same pairs padded with the stop token (the datasets' convention) and with a separate pad
    id 257: every mask comes from `query != pad` and the first stop token, so rewards agree."""
    model = tiny_reward_model(dict(META, vocab_size=258))
    split = data.load_split("arithmetic", "pref_test")
    query, chosen, rejected = (torch.from_numpy(split[k][:16]).long() for k in PAIR)
    eos, pad = 256, 257
    # two more pad columns (left of the queries, right of the responses), as mixed lengths have
    query = torch.cat([torch.full((16, 2), eos), query], 1)
    chosen, rejected = (torch.cat([r, torch.full((16, 2), eos)], 1) for r in (chosen, rejected))
    repad_q = torch.where(query == eos, pad, query)  # the left padding (no query holds eos)
    repad_c, repad_r = (torch.where(gpt2.response_mask(r, eos), r, pad) for r in (chosen, rejected))
    assert (repad_q == pad).any() and (repad_c == pad).any() and (repad_r == pad).any()
    with torch.no_grad():
        a = reward.pair_rewards(model, query, chosen, rejected, eos, eos, nullcontext())
        b = reward.pair_rewards(model, repad_q, repad_c, repad_r, pad, eos, nullcontext())
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(reward.preference_loss(*a), reward.preference_loss(*b))


def test_normalisation_samples_at_norm_temperature_like_ppo(monkeypatch):
    """lm-human-preferences normalises on the policy's own samples: --norm_temperature reaches the
    sampler, its default is ppo.py's --temperature, and the samples do not depend on the split
    into micro-batches (nor, so, on the ranks: each takes its slice of one noise tensor)."""
    ppo_args = next(
        n for n in ast.parse((ROOT / "ppo.py").read_text()).body if getattr(n, "name", "") == "Args"
    )
    fields = {n.target.id: n.value for n in ppo_args.body if isinstance(n, ast.AnnAssign)}
    assert reward.Args().norm_temperature == fields["temperature"].value == 0.7
    temperatures, generate = [], gpt2.generate
    monkeypatch.setattr(gpt2, "generate", lambda *a: temperatures.append(a[5]) or generate(*a))
    queries = data.load_split("arithmetic", "pref_train")["query"][:64]
    norms = {}
    for temperature, micro_batch_size in ((0.7, 8), (0.7, 16), (1.0, 16)):
        args = reward.Args(model="tiny", norm_samples=16, norm_temperature=temperature)
        args.micro_batch_size, args.response_length = micro_batch_size, 8
        norm = reward.normalize(tiny_reward_model(), queries, args, META, False, nullcontext())
        assert abs(norm["norm/mean"]) < 1e-6 and abs(norm["norm/std"] - 1) < 1e-6, norm
        norms[temperature, micro_batch_size] = norm
    assert temperatures == [0.7, 0.7, 0.7, 1.0]  # 2 + 1 + 1 micro-batches
    assert norms[0.7, 8]["norm/raw_mean"] == pytest.approx(norms[0.7, 16]["norm/raw_mean"], 1e-6)
    assert norms[0.7, 16]["norm/raw_mean"] != norms[1.0, 16]["norm/raw_mean"]


def test_tiny_run_learns_and_saves_a_normalised_reward_model(tmp_path):
    """16 pairs, seen every step: the loss falls from ln 2 to < 1e-3 by step 30 (seeds 1-3)."""
    common = ["--out_dir", str(tmp_path), "--total_steps", "30", "--eval_every", "30", *SMALL]
    run_here([*common, "--max_train_pairs", "16"])
    m = metrics(tmp_path)
    assert len(m) == 30 and abs(m[0]["train/loss"] - math.log(2)) < 0.05
    assert m[-1]["train/loss"] < 0.05 and all(r["train/accuracy"] == 1 for r in m[-5:]), m[-5:]
    last = m[-1]  # the last step's row holds its eval and the normalisation
    accuracy, loss = saved_model_eval(tmp_path, "arithmetic", 32, 4)
    assert last["eval/accuracy"] == accuracy and last["eval/loss"] == pytest.approx(loss, 1e-4)
    # normalised through the model's forward: mean 0, std 1 on the policy samples
    assert abs(last["norm/mean"]) < 1e-4 and abs(last["norm/std"] - 1) < 1e-4, last
    assert last["norm/gain"] == pytest.approx(1 / last["norm/raw_std"])
    assert last["norm/bias"] == pytest.approx(-last["norm/raw_mean"] / last["norm/raw_std"])
    config = json.load(open(tmp_path / "config.json"))
    assert (config["reward_gain"], config["reward_bias"]) == (last["norm/gain"], last["norm/bias"])
    # a finished run: the same command again is refused; --resume keeps the normalised model
    line = error_line(reward, common)
    assert "holds a run" in line, line
    run_here([*common, "--resume"])
    assert metrics(tmp_path) == m and json.load(open(tmp_path / "config.json")) == config


def test_one_rank_equals_two_ranks_and_resume(tmp_path):
    common = ["--total_steps", "6", "--eval_every", "3", *SMALL]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert len(a) == len(b) == 6
    keys = ("train/loss", "train/grad_norm", "eval/loss", "eval/accuracy", "norm/raw_mean")
    for x, y in zip(a, b):  # norm/*: the same policy samples, scored by a sharded vs a plain model
        tol = {k: (1e-3 if k.startswith("norm/") else 1e-4) * max(1.0, abs(x[k])) for k in x}
        assert not [k for k in keys if k in x and abs(x[k] - y[k]) >= tol[k]], (x, y)
    # resume from the step-3 checkpoint (backbone, score head, optimizer): steps 4..6 as before
    ckpt = Path("checkpoints", "step_00000003")
    shutil.copytree(tmp_path / "r1" / ckpt, tmp_path / "res" / ckpt)
    run_here(["--out_dir", str(tmp_path / "res"), "--resume", *common])
    resumed = metrics(tmp_path / "res")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for x, y in zip(a[3:], resumed):
        assert abs(x["train/loss"] - y["train/loss"]) < 1e-5, (x, y)
    assert resumed[-1]["norm/gain"] == pytest.approx(a[-1]["norm/gain"], rel=1e-4)


def test_max_train_pairs_trains_on_the_first_pairs_only(tmp_path):
    # lr 0: the model never changes, so with the first 16 pairs as the only batch the loss is fixed
    flags = ["--total_steps", "3", "--eval_every", "3", "--max_train_pairs", "16", "--lr", "0"]
    run_here(["--out_dir", str(tmp_path), *flags, *SMALL[:-2], "--norm_samples", "0"])
    m = metrics(tmp_path)
    assert len(m) == 3 and max(r["train/loss"] for r in m) - min(r["train/loss"] for r in m) < 1e-6
    assert "norm/gain" not in m[-1]
    assert json.load(open(tmp_path / "config.json"))["reward_gain"] == 1.0


def test_missing_default_sft_model_is_a_one_line_error(tmp_path):
    p = run(["--total_steps", "2"], check=False, cwd=tmp_path)  # no runs/sft/latest under tmp_path
    assert p.returncode == 1 and "no SFT model at runs/sft/latest" in p.stderr
    assert "python sft.py" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--batch_size", "10", "--micro_batch_size", "4"], "change --micro_batch_size"),
        (["--data", "/nonexistent"], "no dataset at"),
        (["--response_length", "60"], "exceed the model's context"),
        (["--model", "/nonexistent"], "no checkpoint at"),
        (["--resume"], "no complete checkpoint in"),
        (["--max_train_pairs", "8"], "8 training pairs"),
        (["--lr", "-1"], "--lr -1.0: must be 0 or more"),
        (["--batch_size", "0"], "--batch_size 0: must be 1 or more"),
        (["--norm_temperature", "nan"], "--norm_temperature nan: not a finite number"),
    ],
)
def test_bad_flags_give_one_line_errors(tmp_path, flags, expected):
    """In this process; as a user runs one: test_missing_default_sft_model_is_a_one_line_error."""
    line = error_line(reward, ["--out_dir", str(tmp_path), "--total_steps", "2", *SMALL, *flags])
    assert expected in line, line


@pytest.mark.skipif(not HH.exists(), reason="HH-RLHF test file not in shared/data")
def test_hh_rlhf_prep_then_train(tmp_path):
    with gzip.open(HH, "rb") as f:
        (tmp_path / "hh.jsonl").write_bytes(b"".join(f.readline() for _ in range(800)))
    prep = ["hh-rlhf", "--input", str(tmp_path / "hh.jsonl"), "--out", str(tmp_path / "hh")]
    prep += ["--tokenizer", "bytes", "--max_query_len", "384", "--max_response_len", "128"]
    prep += ["--truncate", "--drop_empty", "--test_fraction", "0.2"]
    p = subprocess.run([sys.executable, "-m", "data.prep", *prep], cwd=ROOT, env=ENV, text=True)
    assert p.returncode == 0
    torch.manual_seed(0)  # byte-level dialogues need more than tiny's 64 positions
    config = gpt2.GPTConfig(**gpt2.PRESETS["tiny"] | dict(block_size=512), vocab_size=257)
    gpt2.save(gpt2.GPT(config), str(tmp_path / "init"))
    flags = ["--model", str(tmp_path / "init"), "--data", str(tmp_path / "hh"), "--log_every", "1"]
    flags += ["--total_steps", "4", "--batch_size", "8", "--micro_batch_size", "4"]
    run_here(
        [*flags, "--out_dir", str(tmp_path / "rm"), "--eval_size", "16", "--norm_samples", "8"]
    )
    last = metrics(tmp_path / "rm")[-1]
    accuracy, loss = saved_model_eval(tmp_path / "rm", str(tmp_path / "hh"), 16, 4)
    assert last["eval/accuracy"] == accuracy and last["eval/loss"] == pytest.approx(loss, 1e-4)
    assert abs(last["norm/std"] - 1) < 1e-4
    assert gpt2.load(str(tmp_path / "rm"), head="saved").config.block_size == 512
