"""dpo.py: every loss variant against its formula written out by hand, ln 2 and preference accuracy
0.5 at the start, a step raises the chosen-rejected margin, log-probs (data.response_logprobs) stop
at the stop token (pad = eos or not), the pair limit, a tiny run, 1 rank == 2 ranks (FSDP2, gloo),
resume, one-line errors. WPO's weights and TR-DPO's reference refresh (by hand, under FSDP2, in runs:
1 rank == 2 ranks, resume bitwise)."""

import json
import math
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import data
import dpo
import gpt2
from failed_run import why
from runs import error_line, in_process

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
SMALL = "--model tiny --batch_size 16 --micro_batch_size 4 --eval_size 32 --warmup_steps 5"
SMALL = [*SMALL.split(), "--log_every", "1", "--lr", "1e-3"]
EOS = 256  # the offline task's <|endoftext|>, also its pad
META = dict(vocab_size=257, eos_token_id=EOS, pad_token_id=EOS)


@pytest.fixture
def small(small_data):
    """A small copy of the offline task (tests/conftest.py): the reference pass stays short."""
    return small_data


def run(args, nproc=0, check=True, cwd=ROOT):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher = [*torchrun, f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    p = subprocess.run(
        [*launcher, str(ROOT / "dpo.py"), *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert p.returncode == 0, why(p)
    return p


def run_here(args):
    """A run as run() makes it, in this process (runs.in_process): for the tests whose subject is
    the run, not its process."""
    in_process(dpo, args)


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


# ---- the losses against their formulas

LOGPS = torch.tensor([[-3.0, -4.0], [-5.0, -1.0], [-2.0, -2.5]])  # (B, 2): chosen, rejected
REF = torch.tensor([[-3.5, -3.0], [-4.0, -2.0], [-2.2, -2.4]])
LENS = torch.tensor([[2, 3], [4, 1], [1, 2]])


def log_sig(x):
    return -math.log1p(math.exp(-x))


def by_hand(loss_type, beta, ls, gamma, c, r, rc, rr, lc, lr):
    """The per-pair loss of each variant written out from its paper / library, from summed
    log-probs and lengths."""
    h = (c - rc) - (r - rr)
    h_avg = (c - rc) / lc - (r - rr) / lr  # TRL's ipo, open-instruct's dpo_norm
    smoothed = lambda z: -(1 - ls) * log_sig(z) - ls * log_sig(-z)  # cDPO; ls = 0 is DPO eq. 7
    return {
        "sigmoid": smoothed(beta * h),
        "hinge": max(0.0, 1 - beta * h),
        "ipo_sum": (h - 1 / (2 * beta)) ** 2,
        "ipo": (h_avg - 1 / (2 * beta)) ** 2,
        "dpo_norm": smoothed(beta * h_avg),
        "simpo": smoothed(beta * (c / lc - r / lr) - gamma),
    }[loss_type]


@pytest.mark.parametrize(
    "loss_type, beta, ls",
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("hinge", 0.3, 0.0), ("ipo", 0.5, 0.0)]
    + [("ipo_sum", 0.5, 0.0), ("dpo_norm", 5.0, 0.0), ("dpo_norm", 2.0, 0.1)]
    + [("simpo", 2.0, 0.0), ("simpo", 2.5, 0.1)],
)
def test_loss_variants_match_their_formulas(loss_type, beta, ls):
    args = dpo.Args(loss_type=loss_type, beta=beta, label_smoothing=ls, simpo_gamma=0.7)
    got, rewards = dpo.pair_loss(LOGPS, REF, LENS, args)
    for i in range(3):
        (c, r), (rc, rr), (lc, lr) = LOGPS[i].tolist(), REF[i].tolist(), LENS[i].tolist()
        want = by_hand(loss_type, beta, ls, 0.7, c, r, rc, rr, lc, lr)
        assert float(got[i]) == pytest.approx(want, rel=1e-5, abs=1e-6)
        scale = (lc, lr) if loss_type in ("ipo", "dpo_norm", "simpo") else (1, 1)  # loss's scale
        assert float(rewards[i, 0]) == pytest.approx(beta * (c - rc) / scale[0], rel=1e-5)
        assert float(rewards[i, 1]) == pytest.approx(beta * (r - rr) / scale[1], rel=1e-5)
    if loss_type == "simpo":  # reference-free: the reference log-probs do not enter
        assert torch.allclose(got, dpo.pair_loss(LOGPS, REF * 3 - 1, LENS, args)[0])


def test_ipo_and_ipo_sum_differ_when_lengths_differ():
    a, b = dpo.Args(loss_type="ipo", beta=0.5), dpo.Args(loss_type="ipo_sum", beta=0.5)
    assert not torch.allclose(
        dpo.pair_loss(LOGPS, REF, LENS, a)[0], dpo.pair_loss(LOGPS, REF, LENS, b)[0]
    )
    ones = torch.ones(3, 2)  # one-token responses: the same loss
    assert torch.allclose(
        dpo.pair_loss(LOGPS, REF, ones, a)[0], dpo.pair_loss(LOGPS, REF, ones, b)[0]
    )


def test_rpo_nll_per_sequence_and_per_token():
    logp_c, len_c = torch.tensor([-3.0, -5.0, -2.0, -6.0]), torch.tensor([1.0, 2.0, 1.0, 4.0])
    seq = dpo.rpo_nll(logp_c, len_c, "sequence", None).mean()  # the mean of per-token NLLs
    assert float(seq) == pytest.approx((3 / 1 + 5 / 2 + 2 / 1 + 6 / 4) / 4)
    tok = dpo.rpo_nll(logp_c, len_c, "token", len_c.sum() / 4).mean()  # NLL / chosen tokens
    assert float(tok) == pytest.approx((3 + 5 + 2 + 6) / (1 + 2 + 1 + 4))


def test_loss_is_ln2_when_policy_is_reference():
    for loss_type in ("sigmoid", "dpo_norm"):
        for ls in (0.0, 0.2):  # h = 0: -log σ(0) = ln 2, with or without cDPO's smoothing
            args = dpo.Args(loss_type=loss_type, beta=0.1, label_smoothing=ls)
            loss, rewards = dpo.pair_loss(LOGPS, LOGPS, LENS, args)
            assert torch.allclose(loss, torch.full((3,), math.log(2))) and not rewards.any()


def test_wpo_weights_are_each_pairs_per_token_probability_detached():
    logps = LOGPS.clone().requires_grad_()
    weights = dpo.wpo_weights(logps, LENS)
    for i in range(3):
        (c, r), (lc, lr) = LOGPS[i].tolist(), LENS[i].tolist()
        # Zhou et al. 2024, eq. 2 without the alignment: Π_t π(y_t)^(1/|y|), chosen x rejected
        assert float(weights[i]) == pytest.approx(math.exp(c / lc + r / lr), rel=1e-6)
    assert not weights.requires_grad  # a weight: no gradient flows through it
    # the alignment adds each response's summed -log Σ_v π(v)² (TRL 1.16: no cap at 1)
    collision = torch.tensor([[2.0, 3.0], [0.5, 0.1], [4.0, 6.0]]).requires_grad_()
    weights = dpo.wpo_weights(logps, LENS, collision)
    assert not weights.requires_grad
    for i in range(3):
        (c, r), (lc, lr) = LOGPS[i].tolist(), LENS[i].tolist()
        (hc, hr) = collision[i].tolist()
        expected = math.exp((c + hc) / lc + (r + hr) / lr)
        assert float(weights[i]) == pytest.approx(expected, rel=1e-6)
    assert float(weights[2]) > 1  # not capped


def test_sync_reference_averages_at_half_and_copies_at_one():
    """π_ref ← α π + (1 - α) π_ref, α 0.5 then 1, for an fp32 reference and for one whose blocks
    are bf16 (a frozen model on CUDA): a copy is the policy cast to the reference's dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        policy = gpt2.load("tiny", META)
        torch.manual_seed(1)
        ref = gpt2.load("tiny", META)
        ref.transformer.h.to(dtype)
        theta = [p.detach().clone() for p in policy.parameters()]
        before = [p.detach().clone() for p in ref.parameters()]
        assert not all(torch.equal(a, b.to(a.dtype)) for a, b in zip(before, theta))
        dpo.sync_reference(ref, policy, 0.5)
        for r, a, b in zip(ref.parameters(), before, theta):
            assert r.dtype == a.dtype
            torch.testing.assert_close(r.detach(), ((a.double() + b.double()) / 2).to(a.dtype))
        assert all(torch.equal(p, t) for p, t in zip(policy.parameters(), theta))  # π untouched
        dpo.sync_reference(ref, policy, 1.0)
        for r, b in zip(ref.parameters(), theta):
            assert torch.equal(r.detach(), b.to(r.dtype))


SYNC_UNDER_FSDP2 = """
import functools, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import dpo, gpt2
dist.init_process_group("gloo")
meta = dict(vocab_size=257, eos_token_id=256, pad_token_id=256)
full = lambda m: {k: v.float() for k, v in gpt2.dcp.get_model_state_dict(
    m, options=gpt2.dcp.StateDictOptions(full_state_dict=True)).items()}
# π trained (fp32, bf16 compute), π_ref frozen: bf16 blocks, as on CUDA
torch.manual_seed(0)
policy = gpt2.load("tiny", meta, shard=functools.partial(dpo.shard, device="cpu", bf16=True))
torch.manual_seed(1)
frozen = functools.partial(dpo.shard, device="cpu", bf16=True, frozen=True)
ref = gpt2.load("tiny", meta, shard=frozen)
a, b = full(ref), full(policy)
with torch.no_grad():  # leaves the root gathered
    ref(torch.randint(0, 256, (2, 8)))
dpo.sync_reference(ref, policy, float(sys.argv[2]))
got = full(ref)
if dist.get_rank() == 0:
    for k in got:
        want = torch.lerp(a[k], b[k], float(sys.argv[2]))
        want = want.to(torch.bfloat16).float() if ".h." in k else want
        assert torch.equal(got[k], want), k
    print("ok", len(got))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mix", ["0.5", "1.0"])
def test_sync_reference_under_fsdp2_mixes_each_ranks_shards(tmp_path, mix):
    script = tmp_path / "sync.py"
    script.write_text(SYNC_UNDER_FSDP2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc_per_node=2", str(script), str(ROOT), mix]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, why(p)


# ---- log-probs of real batches


def test_pair_logprobs_sum_to_stop_token_and_ignore_padding():
    torch.manual_seed(0)
    model = gpt2.load("tiny", META).eval()
    query = torch.tensor([[EOS, 5, 6], [7, 8, 9]])
    chosen = torch.tensor([[10, EOS, EOS, EOS], [11, 12, EOS, EOS]])
    rejected = torch.tensor([[13, 14, EOS], [EOS, EOS, EOS]])  # another width; a bare stop token
    got = data.response_logprobs(model, query, chosen, rejected)
    with torch.no_grad():  # unpadded, one row at a time; the stop token counts, what follows not
        for i, q in enumerate([[5, 6], [7, 8, 9]]):
            for j, (response, n) in enumerate([(chosen, [2, 3][i]), (rejected, [3, 1][i])]):
                seq = torch.tensor([q + response[i, :n].tolist()])
                logp = model(seq)[0, len(q) - 1 : -1].log_softmax(-1)
                want = float(logp[torch.arange(n), seq[0, len(q) :]].sum())
                assert float(got[i, j]) == pytest.approx(want, abs=1e-4)


def test_pad_other_than_eos_gives_the_same_logprobs_and_losses():
    """The same pairs padded with the stop token (256) and with a distinct pad id (257): masks
    come from the first stop token and from query != pad, so nothing changes."""
    torch.manual_seed(0)
    model = gpt2.load("tiny", dict(META, vocab_size=258)).eval()
    P = -1  # placeholder for the pad id
    query = [[P, P, 5, 6], [7, 8, 9, 10], [P, 3, 4, 5]]
    chosen = [[10, EOS, P, P], [11, 12, EOS, P], [13, 14, 15, EOS]]  # chosen, rejected: 2 widths
    rejected = [[20, 21, EOS, P, P], [22, EOS, P, P, P], [23, 24, 25, 26, EOS]]
    out = {}
    for pad in (EOS, 257):
        model.config.pad_token_id = pad  # as gpt2.load sets it from the data's meta
        rows = [
            [[pad if t == P else t for t in row] for row in x] for x in (query, chosen, rejected)
        ]
        split = {k: torch.tensor(x).numpy() for k, x in zip(("query", "chosen", "rejected"), rows)}
        with torch.no_grad():
            logps = data.response_logprobs(model, *data.split_tensors(split, [0, 1, 2], "cpu"))
        lengths = data.response_lengths(split, 3, EOS)
        assert lengths.tolist() == [[2, 3], [3, 2], [4, 5]]
        args = [dpo.Args(loss_type=t, beta=0.5) for t in typing.get_args(dpo.LossType)]
        losses = [
            dpo.pair_loss(logps, logps + torch.tensor([0.3, -0.2]), lengths, a)[0] for a in args
        ]
        out[pad] = [logps, *losses, dpo.rpo_nll(logps[:, 0], lengths[:, 0], "sequence", None)]
    for a, b in zip(out[EOS], out[257]):
        assert torch.allclose(a, b, atol=1e-5), (a, b)


def test_one_step_raises_the_chosen_minus_rejected_margin():
    torch.manual_seed(0)
    model = gpt2.load("tiny", META)
    batch = data.split_tensors(data.load_split("arithmetic", "pref_train"), range(16), "cpu")
    with torch.no_grad():
        ref = data.response_logprobs(model, *batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logps = data.response_logprobs(model, *batch)
    loss = dpo.pair_loss(logps, ref, None, dpo.Args(beta=0.1))[0].mean()
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        new = data.response_logprobs(model, *batch)
    margin = lambda x: (x[:, 0] - x[:, 1]).mean()
    assert margin(new) > margin(ref) + 1e-3


# ---- runs


def test_tiny_run_starts_at_ln2_and_saves(tmp_path, small):
    # 32 pairs, 10 epochs: the policy fits them (on fresh pairs a random-init model's margin
    # stays noise for 20 steps)
    common = ["--total_steps", "20", "--eval_every", "20", "--max_train_pairs", "32"]
    run_here(["--out_dir", str(tmp_path), *common, *SMALL, *small])
    m = metrics(tmp_path)
    start, first, last = m[0], m[1], m[-1]
    # step 0: π = π_ref to the bit (the same forward scores both), so every reward is 0 and every
    # pair a tie, counted half
    assert start["step"] == 0 and start["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert start["eval/preference_accuracy"] == 0.5 and start["eval/rewards_margins"] == 0
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert last["rewards/margins"] > 0.1 and last["train/loss"] < math.log(2) - 0.05
    assert last["rewards/accuracies"] > 0.8 and last["eval/preference_accuracy"] > 0.5
    assert last["logps/chosen"] > first["logps/chosen"] - 1 and "eval/accuracy" in last
    assert gpt2.load(str(tmp_path)).config.n_layer == 4
    assert json.load(open(tmp_path / "args.json"))["beta"] == 0.1  # the loss's default, recorded


def test_bf16_under_fsdp2_starts_at_ln2(tmp_path, small):
    """FSDP2's bf16 parameters: π_ref comes from the same sharded bf16 forward as π, so the first
    losses are ln 2 (scored by the plain model under autocast, they were not)."""
    common = ["--total_steps", "1", "--max_train_pairs", "16", "--dtype", "bfloat16"]
    run(["--out_dir", str(tmp_path), *common, *SMALL, *small], nproc=2)
    start, first = metrics(tmp_path)
    assert start["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert start["eval/rewards_margins"] == 0 and start["eval/preference_accuracy"] == 0.5
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_max_train_pairs_limits_training_and_the_reference_pass(tmp_path, capsys):
    """Pairs past the limit hold a token id outside the vocabulary: touching any of them (in the
    reference pass or a training step) would crash the run."""
    from data import arithmetic

    sizes = dict(
        sft_train=8, sft_test=8, pref_train=64, pref_test=16, prompt_train=8, prompt_test=16
    )
    splits = arithmetic.build(sizes=sizes)
    splits["pref_train"]["chosen"][32:, 0] = 999
    data.write_dataset(str(tmp_path / "poisoned"), arithmetic.META, splits)
    common = [
        "--data",
        str(tmp_path / "poisoned"),
        "--total_steps",
        "3",
        "--eval_every",
        "3",
        *SMALL,
    ]
    capsys.readouterr()
    run_here(["--out_dir", str(tmp_path / "ok"), "--max_train_pairs", "32", *common])
    assert "reference log-probs of 32 train" in capsys.readouterr().out
    assert [r["step"] for r in metrics(tmp_path / "ok")] == [0, 1, 2, 3]
    with pytest.raises(IndexError):  # what kept it clear: the embedding has no row 999
        run_here(["--out_dir", str(tmp_path / "all"), *common])


@pytest.mark.parametrize("loss_type", ["simpo", "ipo"])
def test_length_normalised_losses_train(tmp_path, small, loss_type, capsys):
    rpo = ["--rpo_alpha", "0.5", "--rpo_normalization", "token"]
    common = ["--total_steps", "10", "--eval_every", "10", "--max_train_pairs", "32", *rpo]
    run_here(["--out_dir", str(tmp_path), "--loss_type", loss_type, *common, *SMALL, *small])
    out = capsys.readouterr().out
    assert ("reference log-probs" in out) == (loss_type != "simpo")  # SimPO: no reference
    first, last = metrics(tmp_path)[1], metrics(tmp_path)[-1]
    assert last["rewards/margins"] > first["rewards/margins"] + 0.05
    assert last["train/loss"] < first["train/loss"] and last["train/nll"] < first["train/nll"]


def test_one_rank_equals_two_ranks_and_resume(tmp_path, small):
    ipo = [
        "--loss_type",
        "ipo",
        "--beta",
        "0.5",
        "--rpo_alpha",
        "0.5",
        "--rpo_normalization",
        "token",
    ]
    common = [
        "--total_steps",
        "6",
        "--eval_every",
        "3",
        "--max_train_pairs",
        "64",
        *ipo,
        *SMALL,
        *small,
    ]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert len(a) == len(b) == 7
    for x, y in zip(a, b):
        keys = [k for k in x if not k.startswith("perf/")]
        assert keys == [k for k in y if not k.startswith("perf/")]
        assert all(abs(x[k] - y[k]) < 1e-4 for k in keys), (x, y)
    # resume from the step-3 checkpoint (π_ref scored again from --model): steps 4..6 as before
    step3 = Path("checkpoints") / "step_00000003"
    shutil.copytree(tmp_path / "r1" / step3, tmp_path / "res" / step3)
    run_here(["--out_dir", str(tmp_path / "res"), "--resume", *common])
    resumed = metrics(tmp_path / "res")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for x, y in zip(a[4:], resumed):
        assert abs(x["train/loss"] - y["train/loss"]) < 1e-5, (x, y)
    line = error_line(dpo, ["--out_dir", str(tmp_path / "r1"), *common])  # never overwritten
    assert "holds a run" in line and len(metrics(tmp_path / "r1")) == 7, line


def test_wpo_run_averages_the_weighted_loss_over_the_global_batch(tmp_path, small):
    """At step 1 π = π_ref, so every pair's sigmoid loss is ln 2: the weighted loss averaged over
    the batch (TRL's mean, not a weight-normalised one) is ln 2 x the mean weight."""
    common = ["--total_steps", "2", "--eval_size", "0", "--max_train_pairs", "32", "--wpo"]
    run_here(["--out_dir", str(tmp_path / "plain"), *SMALL, *small, *common, "--no_wpo_align"])
    run_here(["--out_dir", str(tmp_path / "aligned"), *SMALL, *small, *common])
    plain = metrics(tmp_path / "plain")[0]
    aligned = metrics(tmp_path / "aligned")[0]
    for first in (plain, aligned):
        assert first["train/wpo_weight"] > 0
        loss = math.log(2) * first["train/wpo_weight"]
        assert first["train/loss"] == pytest.approx(loss, rel=1e-5)
    # the alignment divides each token's probability by Σ_v π(v)² <= 1: larger weights
    assert aligned["train/wpo_weight"] > plain["train/wpo_weight"]


def test_hard_refresh_every_step_starts_each_step_at_ln2(tmp_path, small, capsys):
    """--ref_sync_every 1 --ref_sync_mix 1: π_ref is a copy of π after every update, so each step
    scores its batch with π = π_ref: loss ln 2 and margins 0 at every step, not only the first."""
    common = ["--total_steps", "4", "--eval_every", "2", "--max_train_pairs", "32"]
    common += ["--ref_sync_every", "1", "--ref_sync_mix", "1"]
    run_here(["--out_dir", str(tmp_path), *common, *SMALL, *small])
    out = capsys.readouterr().out
    assert "reference log-probs of" not in out  # no pass before step 0: per batch
    m = metrics(tmp_path)
    assert [r["step"] for r in m] == [0, 1, 2, 3, 4]
    for r in m[1:]:
        assert r["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert r["rewards/margins"] == 0 and r["rewards/accuracies"] == 0
    # eval against the refreshed π_ref: π = π_ref after the step's refresh
    assert m[2]["eval/preference_accuracy"] == 0.5 and m[2]["eval/rewards_margins"] == 0
    assert m[-1]["logps/chosen"] != m[1]["logps/chosen"]  # yet the policy moved


def test_refresh_one_rank_equals_two_ranks_and_resumes_bitwise(tmp_path, small):
    """TR-DPO's soft update every 2 steps with WPO: 1 rank == 2 ranks; a resume from the step-3
    checkpoint (π_ref mixed at step 2, different from --model and from π) ends bitwise where the
    uninterrupted run ended, and a 2-rank checkpoint resumes at 1 rank."""
    common = ["--total_steps", "6", "--eval_every", "3", "--max_train_pairs", "64", "--wpo"]
    common += ["--ref_sync_every", "2", "--ref_sync_mix", "0.5", *SMALL, *small]
    run(["--out_dir", str(tmp_path / "r1"), *common], nproc=1)
    run(["--out_dir", str(tmp_path / "r2"), *common], nproc=2)
    a, b = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(7))
    for x, y in zip(a, b):
        keys = [k for k in x if not k.startswith("perf/")]
        assert keys == [k for k in y if not k.startswith("perf/")]
        assert all(abs(x[k] - y[k]) < 1e-4 for k in keys), (x, y)
    assert a[3]["rewards/margins"] != 0  # π_ref refreshed at step 2 is not π at step 3
    step3 = Path("checkpoints") / "step_00000003"
    for name, source in (("same", "r1"), ("across", "r2")):
        shutil.copytree(tmp_path / source / step3, tmp_path / name / step3)
        run(["--out_dir", str(tmp_path / name), "--resume", *common], nproc=1)
    # the same layout: every metric and weight to the bit
    resumed = metrics(tmp_path / "same")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for x, y in zip(a[4:], resumed):
        assert {k: v for k, v in x.items() if not k.startswith("perf/")} == {
            k: v for k, v in y.items() if not k.startswith("perf/")
        }
    want = load_file(str(tmp_path / "r1" / "model.safetensors"))
    got = load_file(str(tmp_path / "same" / "model.safetensors"))
    assert all(torch.equal(want[k], got[k]) for k in want)
    ref = Path("checkpoints") / "step_00000006" / "reference" / "model.safetensors"
    want, got = load_file(str(tmp_path / "r1" / ref)), load_file(str(tmp_path / "same" / ref))
    assert all(torch.equal(want[k], got[k]) for k in want)
    # across world sizes: the rounding of the reduction order only
    for x, y in zip(a[4:], metrics(tmp_path / "across")):
        assert abs(x["train/loss"] - y["train/loss"]) < 1e-4, (x, y)


@pytest.mark.parametrize(
    "flags, expected",
    [(["--label_smoothing", "0.1", "--loss_type", "ipo"], "label_smoothing")]
    + [
        (["--batch_size", "10"], "micro_batch_size"),
        (["--max_train_pairs", "8"], "--max_train_pairs"),
    ]
    + [(["--ref_model", "/nonexistent"], "no checkpoint at")]
    + [(["--ref_sync_every", "2", "--loss_type", "simpo"], "no π_ref to refresh")],
)
def test_bad_flags_give_one_line_errors(tmp_path, flags, expected):
    """In this process; as a user runs one: test_missing_default_sft_model_names_the_command."""
    line = error_line(dpo, ["--out_dir", str(tmp_path / "x"), "--total_steps", "2", *SMALL, *flags])
    assert expected in line, line
    assert not (tmp_path / "x").exists()  # no run dir to --overwrite later


# A numeric flag out of its range: check_args stops the run before any work.
@pytest.mark.parametrize(
    "flag, value",
    [("--lr", "-1"), ("--batch_size", "0"), ("--beta", "nan"), ("--max_grad_norm", "inf")]
    + [("--micro_batch_size", "0"), ("--label_smoothing", "0.5"), ("--rpo_alpha", "nan")]
    + [("--min_lr_ratio", "2"), ("--eval_every", "0"), ("--keep_checkpoints", "-1")]
    + [("--seed", "-1"), ("--warmup_steps", "-1"), ("--simpo_gamma", "-inf")]
    + [("--ref_sync_every", "-1"), ("--ref_sync_mix", "0"), ("--ref_sync_mix", "1.5")]
    + [("--ref_sync_mix", "nan")],
)
def test_out_of_range_flags_give_one_line_errors(tmp_path, flag, value):
    line = error_line(dpo, ["--out_dir", str(tmp_path / "x"), *SMALL, flag, value])
    assert line.startswith(f"error: {flag} "), line
    assert not (tmp_path / "x").exists()


# A choice flag outside its Literal: tyro's parser stops with the choices listed.
@pytest.mark.parametrize(
    "flag, value, choice",
    [("--loss_type", "kto", "sigmoid"), ("--rpo_normalization", "mean", "token")]
    + [("--dtype", "float16", "bfloat16")],
)
def test_bad_choices_list_the_choices(tmp_path, capsys, flag, value, choice):
    """tyro's exit status 2, in this process: the parser is the one `python dpo.py` runs."""
    args = ["--out_dir", str(tmp_path / "x"), *SMALL, flag, value]
    with pytest.raises(SystemExit) as e:
        dpo.tyro.cli(dpo.Args, args=args, use_underscores=True)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"invalid choice '{value}'" in err and choice in err, err
    assert not (tmp_path / "x").exists()


def test_missing_default_sft_model_names_the_command(tmp_path):
    p = run(["--total_steps", "2"], check=False, cwd=tmp_path)  # no runs/sft/latest here
    assert p.returncode == 1 and "python sft.py" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()
