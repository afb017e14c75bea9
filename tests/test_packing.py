"""Packed (padding-free) passes (issue 40): gpt2.pack puts a batch's real tokens in one row, and
every training pass that reads a padded batch (log-probs and entropies, rewards, values) gives the
padded pass's numbers to round-off, with the same gradients; batches with no padding keep their
bits; the scripts train the same with --packing and --no_packing.

Tolerances: in fp32 the packed pass multiplies the same numbers in GEMMs of another row count, and
attention sums each row's keys in another layout, so the sums round differently in the last bits:
about 1e-7 relative per op, 1e-6 after the model's dozen layers of it. The gradients sum the
tokens' contributions in another order: 1e-5 of their scale."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpt2
import ppo

ROOT = Path(__file__).resolve().parents[1]
PAD = 256
META = dict(vocab_size=257, eos_token_id=PAD, pad_token_id=PAD)


def ragged_batch(B=8, Tq=12, Tr=10, seed=0):
    """Left-padded queries of 3..Tq tokens and responses that stop at different columns (or
    never), as the scripts' micro-batches are."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randint(0, PAD, (B, Tq), generator=g)
    response = torch.randint(0, PAD, (B, Tr), generator=g)
    for b in range(B):
        query[b, : b % (Tq - 2)] = PAD
        if b % 4:
            response[b, b % Tr :] = PAD
    return query, response


def tiny_model(scalar=False):
    torch.manual_seed(0)
    model = gpt2.load("tiny", META)
    with torch.no_grad():  # random biases and LayerNorms: no mapping bug can hide
        for name, p in model.named_parameters():
            if "ln_" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    if scalar:
        return gpt2.ScalarModel(model, gain=2.0, bias=-1.0)
    return model


def outputs_and_grads(model, packing, forward):
    model.packing = packing
    model.zero_grad(set_to_none=True)
    outputs = forward(model)
    sum(x.sum() for x in outputs).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [x.detach() for x in outputs], grads


def assert_same(forward, scalar=False):
    model = tiny_model(scalar)
    padded, padded_grads = outputs_and_grads(model, False, forward)
    packed, packed_grads = outputs_and_grads(model, True, forward)
    for a, b in zip(packed, padded):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
        # 0 where the padded pass gives 0: past each row's stop
        assert torch.equal(a == 0, b == 0)
    assert packed_grads.keys() == padded_grads.keys()
    for name, g in padded_grads.items():
        scale = g.abs().max().item()
        assert (packed_grads[name] - g).abs().max().item() <= 1e-5 * scale + 1e-8, name


def test_logprobs_and_entropy_packed_equal_padded():
    query, response = ragged_batch()

    def forward(model):
        return gpt2.logprobs(model, query, response, temperature=0.7, entropy=True)

    assert_same(forward)


def test_rewards_packed_equal_padded():
    query, response = ragged_batch()

    def forward(model):
        return [gpt2.get_reward(model, query, response, PAD, PAD)]

    assert_same(forward, scalar=True)


def test_ppo_values_packed_equal_padded():
    query, response = ragged_batch()

    def forward(model):
        values = ppo.forward_values(model, query, response, PAD, PAD)
        # The padded pass's values past each stop are not 0: only the masked ones count.
        return [values * gpt2.response_mask(response, PAD)]

    assert_same(forward, scalar=True)


def test_packed_forward_is_exact_for_any_mask_not_just_left_padding():
    """Padding inside a row: each real token still sees the real tokens before it only."""
    model = tiny_model()
    query, _ = ragged_batch(B=4, Tq=16)
    mask = query != PAD
    mask[:, 5] = False  # a hole in every row
    mask[0] = True
    with torch.no_grad():
        padded = model(query, mask)  # (B, T, V)
        packing = gpt2.pack(mask, keep=mask)
        packed = model(query, mask, packing=packing)  # (n, V)
    torch.testing.assert_close(packed, padded[mask], atol=2e-6, rtol=1e-5)
    assert torch.equal(gpt2.unpack(packed, mask)[mask], packed)


def test_packed_forward_is_one_graph():
    """pack's host syncs happen before the model: its forward compiles whole, as the padded one."""
    model = tiny_model()
    query, _ = ragged_batch()
    mask = query != PAD
    packing = gpt2.pack(mask, keep=mask)
    explain = torch._dynamo.explain(model)(query, mask, packing=packing)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons


def test_pack_refuses_a_kept_pad():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]]).bool()
    with pytest.raises(ValueError, match="kept position is padding"):
        gpt2.pack(mask, keep=torch.ones_like(mask))


def test_a_batch_without_padding_keeps_its_bits():
    """The offline task's queries and answers have one width: packing changes nothing there."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    query = torch.randint(0, PAD, (8, 6), generator=g)
    response = torch.randint(0, PAD, (8, 4), generator=g)
    response[:, -1] = PAD
    padded, padded_grads = outputs_and_grads(
        model, False, lambda m: gpt2.logprobs(m, query, response, entropy=True)
    )
    packed, packed_grads = outputs_and_grads(
        model, True, lambda m: gpt2.logprobs(m, query, response, entropy=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(packed, padded))
    assert all(torch.equal(packed_grads[n], g) for n, g in padded_grads.items())


def test_packed_pass_scores_only_real_tokens():
    """The logits of a packed pass are (n, V) for the n real response tokens: no row of them is
    padding, so a micro-batch's memory counts real tokens (tests/test_memory.py)."""
    model = tiny_model()
    model.packing = True
    query, response = ragged_batch()
    shapes = []
    hook = model.register_forward_hook(lambda m, args, out: shapes.append(out.shape))
    gpt2.logprobs(model, query, response)
    hook.remove()
    n = gpt2.response_mask(response, PAD).sum().item()
    assert shapes == [torch.Size([n, model.n_logits])]


def stopping_policy(out):
    """A tiny random policy that stops after about 5 tokens (eos probability ~0.2 a token), so
    that its responses, and the scripts' batches, are ragged."""
    model = tiny_model()
    with torch.no_grad():
        w_eos = model.transformer.wte.weight[PAD]
        # ln_f's bias along w_eos: every eos logit gains 4.2, e^4.2 ~ 64 against ~256 others.
        model.transformer.ln_f.bias.copy_(4.2 * w_eos / w_eos.dot(w_eos))
    gpt2.save(model, str(out))
    query = torch.randint(0, PAD, (32, 6), generator=torch.Generator().manual_seed(0))
    rollout = gpt2.generate(model, query, PAD, 8, PAD)
    lengths = rollout.mask.sum(1)
    assert lengths.min() < lengths.max()
    return out


def script_metrics(out, script, args):
    cmd = [sys.executable, f"{script}.py", "--out_dir", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.parametrize(
    "script, args",
    [
        (
            "grpo",
            "--model {policy} --total_episodes 32 --num_prompts_per_step 4 --num_samples_per_prompt 4 "
            "--micro_batch_size 8 --response_length 8 --eval_size 8 --eval_every 2 --log_every 1",
        ),
        (
            "ppo",
            "--model {policy} --reward_model {rm} --total_episodes 16 --batch_size 8 "
            "--micro_batch_size 4 --num_minibatches 2 --response_length 8 --eval_size 8 "
            "--eval_every 2 --log_every 1",
        ),
    ],
)
def test_scripts_train_the_same_packed_and_padded(tmp_path, script, args):
    """A tiny policy's responses stop anywhere: ragged batches, packed or padded. The first step's
    losses agree to round-off; later steps sample from weights that differ in the last
    bits, so only the first is compared."""
    torch.manual_seed(0)
    gpt2.save(gpt2.ScalarModel(gpt2.load("tiny", META)), str(tmp_path / "rm"))
    args = args.format(rm=tmp_path / "rm", policy=stopping_policy(tmp_path / "policy"))
    packed = script_metrics(tmp_path / "packed", script, [*args.split(), "--packing"])
    padded = script_metrics(tmp_path / "padded", script, [*args.split(), "--no_packing"])
    first = [m for m in packed if m["step"] == 1][0]
    same = [m for m in padded if m["step"] == 1][0]
    assert first.keys() == same.keys()
    compared = [k for k in first if k.startswith(("loss/", "policy/", "objective/", "val/"))]
    assert len(compared) >= 4
    for k in compared:
        assert first[k] == pytest.approx(same[k], rel=1e-4, abs=1e-6), k


def test_grpo_packed_on_one_and_two_ranks_and_after_a_resume(tmp_path):
    """Packed batches under FSDP2: 1 rank = 2 ranks, and a resumed run = the uninterrupted one."""
    policy = stopping_policy(tmp_path / "policy")
    common = f"--model {policy} --total_episodes 64 --num_prompts_per_step 4 --beta 0.05 "
    common += "--num_samples_per_prompt 4 --micro_batch_size 4 --response_length 8 "
    common += "--eval_size 8 --eval_every 2 --log_every 1 --keep_checkpoints 5 --num_minibatches 1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {}
    for name, nproc in (("r1", 1), ("r2", 2)):
        cmd = [*torchrun, f"--nproc_per_node={nproc}", "grpo.py", "--out_dir", str(tmp_path / name)]
        result = subprocess.run(
            [*cmd, *common.split()], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    assert [m["step"] for m in runs["r1"]] == [0, 1, 2, 3, 4]
    for a, b in zip(runs["r1"], runs["r2"]):
        for k in (k for k in a if not k.startswith("perf/")):
            assert abs(a[k] - b[k]) < 1e-4, (k, a[k], b[k])
    checkpoint = tmp_path / "r1" / "checkpoints" / "step_00000002"
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoints" / checkpoint.name)
    resumed = script_metrics(tmp_path / "resumed", "grpo", [*common.split(), "--resume"])
    assert [m["step"] for m in resumed] == [3, 4]
    full = {m["step"]: m for m in runs["r1"]}
    for m in resumed:
        for k in (k for k in m if not k.startswith("perf/")):
            assert m[k] == full[m["step"]][k], (k, m[k], full[m["step"]][k])
