"""Memory (issue 28): gpt2.logprobs keeps one (B, T, V) tensor, the logits, in forward and backward
(packed, issue 40: one (n, V) tensor for its n real tokens);
gpt2.load(..., shard=) under torchrun reads and builds the weights on rank 0 only, the other ranks
on the meta device, and every rank ends with rank 0's model."""

import ctypes
import os
import resource
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gpt2

ROOT = Path(__file__).resolve().parents[1]
# faulthandler: a worker that crashes (SIGSEGV) prints its Python stack into the failure message
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1")
PAD, V = 256, 257
META = dict(vocab_size=V, eos_token_id=PAD, pad_token_id=PAD)
CASES = {  # name: (checkpoint, head, bf16 blocks as reward.py's frozen models have them)
    "lm": ("lm", None, False),
    "rm": ("rm", "saved", False),
    "tiny": ("tiny", None, False),
    "new_head": ("lm", "new", False),
    "rm_bf16": ("rm", "saved", True),
}


def peak_logits_tensors(path):
    """Peak memory of one forward and backward, in (B, T, V) fp32 tensors: freed buffers over
    1 MiB go back to the OS (a fixed mmap threshold), so peak RSS counts the live tensors."""
    ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    B, Tq, Tr, vocab = 16, 8, 64, 32768
    model = gpt2.GPT(gpt2.GPTConfig(128, vocab, n_layer=1, n_head=2, n_embd=32))
    gpt2.TokenLogProbs.CHUNK = 1 << 20  # 4 MB temporaries against 134 MB of logits
    g = torch.Generator().manual_seed(0)
    query, response = torch.randint(0, 200, (B, Tq), generator=g), torch.randint(0, 200, (B, Tr))

    def step(query, response):
        if path == "plain":  # what the scripts did: logits, their log-softmax and its backward
            logits = model(torch.cat([query, response[:, :-1]], 1), keep_from=Tq - 1)
            logp = (logits.float() / 0.7).log_softmax(-1)
            logprobs = logp.gather(-1, response[..., None]).squeeze(-1)
            -(logp.exp() * logp).sum(-1).detach()  # entropy
        else:
            logprobs = gpt2.logprobs(model, query, response, 0.7, entropy=True)[0]
        logprobs.sum().backward()

    step(query[:1], response[:1])  # warm-up: lazily loaded kernels count in RSS too
    before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    step(query, response)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(peak / (B * Tr * vocab * 4))


# Slow: out of README's 2-worker command, in CI's one-process one. Peak RSS counts pages besides
# tensors, and beside another worker's tests it read 2.9 and 3.0 (1.13 alone). The tensor count of
# test_a_packed_pass_holds_one_logits_tensor_of_its_real_tokens, which no load blurs, runs in both.
@pytest.mark.slow
@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="needs glibc's mallopt")
def test_logprobs_keeps_one_logits_tensor():
    peak = {}
    for path in ("plain", "chunked"):
        cmd = [sys.executable, __file__, "peak", path]
        out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        peak[path] = float(out.stdout.split()[-1])
    assert peak["plain"] > 3  # the measure sees the plain path's copies
    # the logits and small chunks (about 1.1 alone); a second (B, T, V) tensor would add 1, so 2.1
    # or more. The margin is for the pages besides tensors that peak RSS also counts, which vary
    # with what ran before and the machine's load: 1.65 was seen once inside the whole suite.
    assert peak["chunked"] < 1.9, peak


class LargeTensors(TorchDispatchMode):
    """The most tensors of at least `size` elements alive at once (one per storage), over every
    op run under it, backward's included: a count that no machine's allocator blurs."""

    def __init__(self, size):
        super().__init__()
        self.size = size
        self.alive = {}
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.size:
                self.alive[t.untyped_storage().data_ptr()] = weakref.ref(t)
        self.alive = {ptr: ref for ptr, ref in self.alive.items() if ref() is not None}
        self.most = max(self.most, len(self.alive))
        return out


@pytest.mark.parametrize("path", ["plain", "padded", "packed"])
def test_a_packed_pass_holds_one_logits_tensor_of_its_real_tokens(path):
    """Issue 40: packed, the logits are (n, V) for the n real response tokens, and forward and
    backward hold no second tensor of half that size; the plain formula holds several."""
    B, Tq, Tr, vocab = 16, 8, 64, 32768
    model = gpt2.GPT(gpt2.GPTConfig(128, vocab, n_layer=1, n_head=2, n_embd=32))
    model.config.pad_token_id = PAD
    model.config.eos_token_id = PAD
    model.packing = path == "packed"
    gpt2.TokenLogProbs.CHUNK = 1 << 20
    g = torch.Generator().manual_seed(0)
    query = torch.randint(0, 200, (B, Tq), generator=g)
    response = torch.randint(0, 200, (B, Tr), generator=g)
    # A quarter of the response columns are padding, past each row's stop.
    stops = torch.arange(B) % (Tr // 2) + Tr // 2  # (B,)
    response[torch.arange(Tr)[None, :] > stops[:, None]] = PAD
    n = gpt2.response_mask(response, PAD).sum().item()
    large = LargeTensors(n * vocab // 2)
    with large:
        if path == "plain":
            logits = model(torch.cat([query, response[:, :-1]], 1), keep_from=Tq - 1)
            logp = (logits.float() / 0.7).log_softmax(-1)
            logprobs = logp.gather(-1, response[..., None]).squeeze(-1)
            del logits, logp
        else:
            logprobs = gpt2.logprobs(model, query, response, 0.7, entropy=True)[0]
        logprobs.sum().backward()
    if path == "plain":
        assert large.most >= 2  # the count sees a formula's copies
    else:
        assert large.most == 1


def shard_worker(tmp):
    """Under torchrun: every case loaded with shard=, its outputs and gathered weights saved."""
    dist.init_process_group("gloo")
    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (dist.get_world_size(),))
    if rank:  # the meta ranks must read no tensors, only the header
        gpt2.load_file = None
    query = torch.tensor([[PAD, PAD, 1, 2], [PAD, 3, 4, 5], [6, 7, 8, 9]])
    for case, (name, head, bf16) in CASES.items():

        def shard(model, bf16=bf16):
            mp = MixedPrecisionPolicy(torch.bfloat16 if bf16 else torch.float32, torch.float32)
            if bf16:  # as the scripts' frozen models: no gradients, bf16 blocks
                model.requires_grad_(False).transformer.h.to(torch.bfloat16)
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh, mp_policy=mp)
            return fully_shard(model, mesh=mesh)

        torch.manual_seed(rank)  # a `tiny` or new head initialised elsewhere would differ
        path = name if name == "tiny" else os.path.join(tmp, name)
        model = gpt2.load(path, META, head, shard=shard).eval()
        assert model.lm_head.weight is model.transformer.wte.weight  # still tied
        assert all(p.requires_grad != bf16 for p in model.parameters())
        with torch.no_grad():
            torch.save(model(query, query != PAD), os.path.join(tmp, f"{case}-{rank}.pt"))
        gpt2.save(model, os.path.join(tmp, f"{case}-saved"))
    dist.destroy_process_group()  # then no interpreter teardown, where gloo's threads can abort
    os._exit(0)


def test_sharded_load_equals_plain_load(tmp_path):
    torch.manual_seed(0)
    lm = gpt2.load("tiny", META)
    with torch.no_grad():  # randomised LayerNorms and biases: no mapping bug can hide
        for name, p in lm.named_parameters():
            p.add_(0.1 * torch.randn_like(p)) if "ln_" in name or "bias" in name else None
    gpt2.save(lm, str(tmp_path / "lm"))
    gpt2.save(gpt2.ScalarModel(gpt2.load("tiny", META), 2.0, -1.0), str(tmp_path / "rm"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [__file__, "shard", str(tmp_path)]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    query = torch.tensor([[PAD, PAD, 1, 2], [PAD, 3, 4, 5], [6, 7, 8, 9]])
    for case, (name, head, bf16) in CASES.items():
        torch.manual_seed(0)  # rank 0's seed: its `tiny` and new head are the ones kept
        plain = gpt2.load(name if name == "tiny" else str(tmp_path / name), META, head).eval()
        saved = load_file(str(tmp_path / f"{case}-saved" / "model.safetensors"))
        for k, v in plain.state_dict().items():
            v = v.to(torch.bfloat16) if bf16 and k.startswith("transformer.h.") else v
            assert k == "lm_head.weight" or torch.equal(saved[k], v), (case, k)
        if bf16:
            continue  # the bf16 blocks' outputs: not comparable with the fp32 plain model's
        with torch.no_grad():
            expected = plain(query, query != PAD)
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{case}-{rank}.pt")
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=f"{case} {rank}")


def test_resume_checks_checkpoints_by_their_headers_not_a_full_read(tmp_path, monkeypatch):
    """--resume: rank 0 checks the checkpoints newest first by their headers and zip directories,
    where a truncated file fails; reading them whole would hold the optimizer state once more."""
    import sft

    model = gpt2.load("tiny", META)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # Adam's moments: optimizer.pt is twice the weights
    for step in (1, 2):
        gpt2.save(model, str(tmp_path / f"checkpoints/step_{step:08d}/model"), optimizer)
        torch.save({"step": step}, tmp_path / f"checkpoints/step_{step:08d}/state.pt")
    (tmp_path / "checkpoints/step_00000002/model/optimizer.pt").write_bytes(b"PK")  # truncated
    (tmp_path / "metrics.jsonl").write_text("")
    reads, load = [], torch.load
    record = lambda f, **kw: reads.append((Path(f).name, kw.get("mmap"))) or load(f, **kw)
    monkeypatch.setattr(torch, "load", record)
    monkeypatch.setattr(gpt2, "load_weights", lambda model, path, optimizer: reads.append(path))
    assert sft.load_checkpoint(str(tmp_path), {"model": (model, optimizer)})["step"] == 1
    checks = reads[: reads.index(str(tmp_path / "checkpoints/step_00000001/model"))]
    assert [r for r in checks if r[0] == "optimizer.pt"] == [("optimizer.pt", True)] * 2, reads


if __name__ == "__main__":
    dict(peak=peak_logits_tensors, shard=shard_worker)[sys.argv[1]](sys.argv[2])
