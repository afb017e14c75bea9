"""reward.py: Bradley–Terry loss, head init, stop-token reward whatever the padding, normalisation at
--norm_temperature; a tiny run saves a loadable, normalised reward model; 1 rank == 2 ranks (FSDP2, gloo), resume;
--max_train_pairs; one-line errors; real HH-RLHF pairs end to end through data.prep."""

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

ROOT = Path(__file__).resolve().parents[1]
HH = Path(__file__).resolve().parents[2] / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import gpt2  # noqa: E402
import reward  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
SMALL = ["--model", "tiny", "--batch_size", "16", "--micro_batch_size", "4", "--eval_size", "32", "--warmup_steps", "5",
         "--log_every", "1", "--norm_samples", "32"]  # fmt: skip


def run(args, nproc=0, check=True, cwd=ROOT):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    p = subprocess.run(launcher + [str(ROOT / "reward.py"), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def tiny_reward_model(vocab_size=257):
    torch.manual_seed(0)
    return reward.ScalarModel(gpt2.GPT(gpt2.make_config("tiny", vocab_size))).eval()


def test_preference_loss_closed_form():
    r_c, r_r = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 1.0, 0.5])
    # -log σ(x) = log(1 + exp(-x)), x = r_c - r_r - margin; plus the centring term
    expected = [math.log1p(math.exp(-(c - r - 0.3))) + 0.05 * (c + r) ** 2 for c, r in zip(r_c.tolist(), r_r.tolist())]
    got = reward.preference_loss(r_c, r_r, margin=0.3, center_coef=0.05)
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6), (got, expected)
    assert reward.preference_loss(torch.zeros(1), torch.zeros(1)).item() == pytest.approx(math.log(2))


def test_normalization_gives_mean_0_std_1():
    scores = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3 + 7
    gain, bias = reward.normalization(scores)
    normed = gain * scores.double() + bias
    assert abs(normed.mean().item()) < 1e-9 and abs(normed.std(correction=0).item() - 1) < 1e-9
    with pytest.raises(FloatingPointError, match="constant"):
        reward.normalization(torch.full((8,), 2.5))


def test_scalar_model_head_init_gain_bias_and_stop_token_reward():
    torch.manual_seed(0)
    cfg = gpt2.GPTConfig(block_size=16, vocab_size=11, n_layer=1, n_head=4, n_embd=1024)
    model = reward.ScalarModel(gpt2.GPT(cfg)).eval()
    assert model.score.weight.shape == (1, 1024) and torch.all(model.score.bias == 0)
    assert model.score.weight.std().item() == pytest.approx(1 / math.sqrt(1025), rel=0.1)
    assert set(model.state_dict()) - set(gpt2.GPT(cfg).state_dict()) == {"score.weight", "score.bias"}
    pad, eos = 9, 10
    query = torch.randint(0, 9, (3, 4))
    query[0, :2] = pad  # left-padded
    response = torch.randint(0, 9, (3, 5))
    response[1, 1:] = torch.tensor([eos, pad, eos, pad])  # stops at column 1: what follows is never read
    response[2, 3] = eos  # stops at the last-but-one column
    mask = torch.cat([query != pad, reward.response_mask(response, eos)], 1)
    with torch.no_grad():
        scores = model(torch.cat([query, response], 1), mask)  # (3, 9)
        got = reward.get_reward(model, query, response, pad, eos)
        assert torch.allclose(got, scores[[0, 1, 2], [4 + 4, 4 + 1, 4 + 3]], atol=1e-6), (got, scores)
        model.reward_gain, model.reward_bias = 2.0, -1.0
        assert torch.allclose(model(torch.cat([query, response], 1), mask), 2 * scores - 1, atol=1e-6)


def test_pad_other_than_eos_gives_the_same_rewards_and_loss():
    """The same pairs padded with the stop token (the datasets' convention) and with a separate pad id 257: every mask
    comes from `query != pad` and the first stop token, so rewards, loss and the policy samples' rewards agree."""
    model = tiny_reward_model(vocab_size=258)
    split = data.load_split("arithmetic", "pref_test")
    query, chosen, rejected = (torch.from_numpy(split[k][:16]).long() for k in ("query", "chosen", "rejected"))
    eos, pad = 256, 257
    # two more pad columns (left of the queries, right of the responses), as a batch of mixed lengths has them
    query = torch.cat([torch.full((query.size(0), 2), eos), query], 1)
    chosen, rejected = (torch.cat([r, torch.full((r.size(0), 2), eos)], 1) for r in (chosen, rejected))
    repad_q = torch.where(query == eos, pad, query)  # the left padding (no query holds a stop token)
    repad_c, repad_r = (torch.where(reward.response_mask(r, eos), r, pad) for r in (chosen, rejected))
    assert (repad_q == pad).any() and (repad_c == pad).any() and (repad_r == pad).any()
    with torch.no_grad():
        a = reward.pair_rewards(model, query, chosen, rejected, eos, eos, nullcontext())
        b = reward.pair_rewards(model, repad_q, repad_c, repad_r, pad, eos, nullcontext())
        for x, y in zip(a, b):
            assert torch.allclose(x, y, atol=1e-6), (x, y)
        assert torch.allclose(reward.preference_loss(*a), reward.preference_loss(*b), atol=1e-6)
        # policy samples as the normalisation scores them: gpt2.generate fills what follows the stop token with pad
        response = torch.randint(0, 256, (16, 12), generator=torch.Generator().manual_seed(0))
        stop = torch.arange(16)[:, None]  # rows 12.. never stop
        response = torch.where(torch.arange(12)[None] < stop, response, eos)
        repad_response = torch.where(torch.arange(12)[None] <= stop, response, pad)
        assert torch.allclose(reward.get_reward(model, query, response, eos, eos),
                              reward.get_reward(model, repad_q, repad_response, pad, eos), atol=1e-6)  # fmt: skip


def test_normalisation_samples_at_norm_temperature_like_ppo(monkeypatch):
    """lm-human-preferences normalises on the policy's own samples: --norm_temperature reaches the sampler, and its
    default is ppo.py's --temperature (pipeline.py passes one value to both)."""
    ppo_args = next(n for n in ast.parse((ROOT / "ppo.py").read_text()).body if getattr(n, "name", "") == "Args")
    ppo_temperature = next(n.value.value for n in ppo_args.body if getattr(n, "target", None) and n.target.id == "temperature")
    assert reward.Args().norm_temperature == ppo_temperature == 0.7
    temperatures, generate = [], gpt2.generate
    monkeypatch.setattr(gpt2, "generate", lambda *a, **kw: temperatures.append(a[5]) or generate(*a, **kw))
    queries = data.load_split("arithmetic", "pref_train")["query"][:64]
    meta = data.load_meta("arithmetic")
    norms = {}
    for t in (0.7, 1.0):
        args = reward.Args(model="tiny", norm_samples=16, norm_temperature=t, response_length=8, micro_batch_size=8)
        norms[t] = reward.normalize(tiny_reward_model(), queries, args, meta, 0, 1, torch.device("cpu"), nullcontext())
        assert abs(norms[t]["norm/mean"]) < 1e-6 and abs(norms[t]["norm/std"] - 1) < 1e-6, norms[t]
    assert temperatures == [0.7, 0.7, 1.0, 1.0]  # two micro-batches of 8 samples per call
    assert norms[0.7]["norm/raw_mean"] != norms[1.0]["norm/raw_mean"]


def test_tiny_run_saves_a_normalised_reward_model(tmp_path):
    common = ["--out_dir", str(tmp_path), "--total_steps", "30", "--eval_every", "30", "--lr", "1e-3", *SMALL]
    run(common)
    m = metrics(tmp_path)
    assert len(m) == 30 and sum(r["train/loss"] for r in m[-5:]) < sum(r["train/loss"] for r in m[:5])
    last = m[-1]  # the last step's row holds its eval and the normalisation
    assert 0 <= last["eval/accuracy"] <= 1 and "rewards/margins" in last
    # normalised through the model's forward: mean 0, std 1 on the policy samples; gain/bias from the raw moments
    assert abs(last["norm/mean"]) < 1e-4 and abs(last["norm/std"] - 1) < 1e-4, last
    assert last["norm/gain"] == pytest.approx(1 / last["norm/raw_std"])
    assert last["norm/bias"] == pytest.approx(-last["norm/raw_mean"] / last["norm/raw_std"])
    tensors, cfg = gpt2.read_checkpoint(str(tmp_path))
    assert tensors["score.weight"].shape == (1, 128) and tensors["score.bias"].shape == (1,)
    assert (cfg["reward_gain"], cfg["reward_bias"]) == (last["norm/gain"], last["norm/bias"])
    rm = reward.load_reward_model(str(tmp_path))
    assert (rm.reward_gain, rm.reward_bias) == (cfg["reward_gain"], cfg["reward_bias"])
    assert torch.equal(rm.score.weight, tensors["score.weight"])
    # a finished run: the same command again is refused; --resume is a no-op that keeps the normalised model
    p = run(common, check=False)
    assert p.returncode == 1 and "already holds a run" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    run([*common, "--resume"])
    assert metrics(tmp_path) == m and gpt2.read_checkpoint(str(tmp_path))[1] == cfg
    gpt2.save_model(gpt2.load_model("tiny", 257).state_dict(), gpt2.make_config("tiny", 257), str(tmp_path / "lm"))
    with pytest.raises(ValueError, match="no reward head"):  # a policy checkpoint is not a reward model
        reward.load_reward_model(str(tmp_path / "lm"))


def test_one_rank_equals_two_ranks_and_resume(tmp_path):
    common = ["--total_steps", "6", "--eval_every", "3", *SMALL]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert len(a) == len(b) == 6
    keys = ("train/loss", "train/grad_norm", "eval/loss", "eval/accuracy", "norm/raw_mean", "norm/raw_std")
    for x, y in zip(a, b):  # the norm/* keys: the same policy samples on 1 and 2 ranks
        # the normalisation averages 512 raw scores of magnitude ~2 computed by a sharded vs a plain model
        bad = [(k, x[k], y[k]) for k in keys if k in x and abs(x[k] - y[k]) >= (1e-3 if k.startswith("norm/") else 1e-4) * max(1.0, abs(x[k]))]
        assert not bad, bad
    # resume from the step-3 checkpoint (backbone + score head + optimizer): steps 4..6 as uninterrupted
    shutil.copytree(tmp_path / "r1" / "checkpoints" / "step_00000003", tmp_path / "res" / "checkpoints" / "step_00000003")
    run(["--out_dir", str(tmp_path / "res"), "--resume", *common])
    resumed = metrics(tmp_path / "res")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for x, y in zip(a[3:], resumed):
        bad = [k for k in ("train/loss", "norm/gain") if k in x and abs(x[k] - y[k]) >= 1e-4 * max(1.0, abs(x[k]))]
        assert not bad, (bad, x, y)


def test_max_train_pairs_trains_on_the_first_pairs_only(tmp_path):
    # lr 0: the model never changes, so with the first 16 pairs as the only batch every step has the same loss
    run(["--out_dir", str(tmp_path), "--total_steps", "3", "--eval_every", "3", "--max_train_pairs", "16", "--lr", "0",
         "--norm_samples", "0", *SMALL[:-2]])  # fmt: skip
    m = metrics(tmp_path)
    assert len(m) == 3 and max(r["train/loss"] for r in m) - min(r["train/loss"] for r in m) < 1e-5, m
    assert "norm/gain" not in m[-1] and gpt2.read_checkpoint(str(tmp_path))[1]["reward_gain"] == 1.0


def test_missing_default_sft_model_is_a_one_line_error(tmp_path):
    p = run(["--total_steps", "2"], check=False, cwd=tmp_path)  # no runs/sft/latest under tmp_path
    assert p.returncode == 1 and "no SFT model at 'runs/sft/latest'" in p.stderr and "python sft.py" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists(), p.stderr


@pytest.mark.parametrize(
    "flags, expected",
    [(["--batch_size", "10", "--micro_batch_size", "4"], "micro_batch_size"), (["--data", "/nonexistent"], "no dataset at"),
     (["--response_length", "60"], "response_length"), (["--model", "/nonexistent"], "no checkpoint at"),
     (["--resume"], "no checkpoint in"), (["--max_train_pairs", "8"], "8 training pairs")],
)  # fmt: skip
def test_bad_flags_give_one_line_errors(tmp_path, flags, expected):
    p = run(["--out_dir", str(tmp_path), "--total_steps", "2", *SMALL, *flags], check=False)
    assert p.returncode != 0 and expected in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]


@pytest.mark.skipif(not HH.exists(), reason="HH-RLHF test file not in shared/data")
def test_hh_rlhf_prep_then_train(tmp_path):
    with gzip.open(HH, "rb") as f:
        (tmp_path / "hh.jsonl").write_bytes(b"".join(f.readline() for _ in range(800)))
    prep = ["hh-rlhf", "--input", str(tmp_path / "hh.jsonl"), "--out", str(tmp_path / "hh"), "--tokenizer", "bytes",
            "--max_query_len", "384", "--max_response_len", "128", "--truncate", "--drop_empty", "--test_fraction", "0.2"]  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "data.prep", *prep], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    cfg = gpt2.make_config("tiny", 257, block_size=512)  # byte-level dialogues need more than tiny's 64 positions
    gpt2.save_model(gpt2.GPT(cfg).state_dict(), cfg, str(tmp_path / "init"))
    run(["--model", str(tmp_path / "init"), "--data", str(tmp_path / "hh"), "--out_dir", str(tmp_path / "rm"),
         "--total_steps", "4", "--batch_size", "8", "--micro_batch_size", "4", "--eval_every", "4", "--eval_size", "16",
         "--norm_samples", "8", "--log_every", "1"])  # fmt: skip
    m = metrics(tmp_path / "rm")
    assert all(math.isfinite(r["train/loss"]) for r in m) and 0 <= m[-1]["eval/accuracy"] <= 1
    assert abs(m[-1]["norm/std"] - 1) < 1e-4
    assert reward.load_reward_model(str(tmp_path / "rm")).config.block_size == 512
