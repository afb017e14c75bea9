"""AdamTF against TensorFlow's numbers, against its own formula, against torch.optim.Adam, and under
FSDP2; and a cheap run of experiments/adam_difference.py, the study built on it."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from adam_tf import AdamTF, adam_tf_step  # noqa: E402

G = [0.1, -0.2, 0.3, 1e-6, 1e-4]  # the same gradient at every step, from x = 0
# tf.compat.v1.train.AdamOptimizer(1e-5, epsilon=1e-5), default betas, float64 variables
TF_STEP1 = [-9.968476e-06, 9.984213e-06, -9.989470e-06, -3.152289e-08, -2.402519e-06]
TF_STEP3 = [-2.992782e-05, 2.996381e-05, -2.997583e-05, -1.304797e-07, -9.029842e-06]


def _run(opt_cls, steps, **kw):
    x = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    opt = opt_cls([x], **kw)
    for _ in range(steps):
        x.grad = torch.tensor(G, dtype=torch.float64)
        opt.step()
    return x.detach()


def test_formula_reproduces_tensorflow_with_tf_float32_bookkeeping():
    # TF1 turns the Python-float lr/betas/eps into float32 tensors and keeps beta1^t, beta2^t in
    # float32 variables, casting them to float64 for a float64 variable. With that bookkeeping the
    # formula matches TF to 7 digits.
    f32 = np.float32
    lr, beta1, beta2, eps = f32(1e-5), f32(0.9), f32(0.999), f32(1e-5)
    x, m, v = (torch.zeros(5, dtype=torch.float64) for _ in range(3))
    beta1_power, beta2_power = beta1, beta2
    for t in range(1, 4):
        g = torch.tensor(G, dtype=torch.float64)
        powers = float(beta1_power), float(beta2_power)
        hparams = float(lr), float(beta1), float(beta2), float(eps)
        adam_tf_step(x, g, m, v, *powers, *hparams)
        # float32 products, as in TF
        beta1_power, beta2_power = beta1_power * beta1, beta2_power * beta2
        if t in (1, 3):
            ref = torch.tensor(TF_STEP1 if t == 1 else TF_STEP3, dtype=torch.float64)
            torch.testing.assert_close(x, ref, rtol=1e-6, atol=0)


def test_optimizer_matches_tensorflow_up_to_float32_hyperparameters():
    # AdamTF keeps hyperparameters in float64: ~1e-5 relative from TF's float32 bookkeeping
    for steps, tf in ((1, TF_STEP1), (3, TF_STEP3)):
        x = _run(AdamTF, steps, lr=1e-5, eps=1e-5)
        torch.testing.assert_close(x, torch.tensor(tf, dtype=torch.float64), rtol=2e-5, atol=0)


def test_torch_adam_first_step_is_larger_and_equals_tf_with_rescaled_eps():
    x_tf = _run(AdamTF, 1, lr=1e-5, eps=1e-5)
    x_pt = _run(torch.optim.Adam, 1, lr=1e-5, eps=1e-5)
    ratio = x_pt.abs() / x_tf.abs()  # measured: [1.003, 1.0015, 1.001, 28.8, 3.78]
    assert (ratio > 1).all(), ratio  # PyTorch's first update is larger on every coordinate ...
    # ... by far where |g| << eps
    assert ratio[3] > 20 and ratio[4] > 3 and (ratio[:3] < 1.01).all(), ratio
    # The docstring's identity: TF's Adam is PyTorch's with eps / sqrt(1 - beta2^t) (here t = 1).
    x_pt_rescaled = _run(torch.optim.Adam, 1, lr=1e-5, eps=1e-5 / math.sqrt(1 - 0.999))
    torch.testing.assert_close(x_pt_rescaled, x_tf, rtol=1e-12, atol=0)


def test_equals_python_loop_over_10_random_steps():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, dtype=torch.float64, generator=gen).requires_grad_()
    b = torch.randn(5, dtype=torch.float64, generator=gen).requires_grad_()
    # its grad stays None: untouched
    frozen = torch.randn(2, dtype=torch.float64, generator=gen).requires_grad_()
    lr, beta1, beta2, eps = 1e-2, 0.8, 0.99, 1e-6  # non-default so swapped arguments would show
    opt = AdamTF([a, b, frozen], lr=lr, betas=(beta1, beta2), eps=eps)
    xs = a.detach().flatten().tolist() + b.detach().tolist()
    ms, vs = [0.0] * len(xs), [0.0] * len(xs)
    frozen_before = frozen.detach().clone()
    for t in range(1, 11):
        a.grad = torch.randn(3, 4, dtype=torch.float64, generator=gen)
        # small gradients, where eps matters
        b.grad = torch.randn(5, dtype=torch.float64, generator=gen) * 1e-4
        opt.step()
        gs = a.grad.flatten().tolist() + b.grad.tolist()
        lr_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        for i, g in enumerate(gs):
            ms[i] = beta1 * ms[i] + (1 - beta1) * g
            vs[i] = beta2 * vs[i] + (1 - beta2) * g * g
            xs[i] -= lr_t * ms[i] / (math.sqrt(vs[i]) + eps)
    got = torch.cat([a.detach().flatten(), b.detach()])
    torch.testing.assert_close(got, torch.tensor(xs, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.equal(frozen.detach(), frozen_before) and frozen not in opt.state
    assert opt.state[a]["step"] == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes_state_precision(dtype):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(64, generator=gen).to(dtype)
    g = torch.randn(64, generator=gen).to(dtype)
    p = p0.clone().requires_grad_()
    opt = AdamTF([p], lr=1e-2)
    p.grad = g.clone()
    opt.step()
    state_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    assert p.dtype == dtype
    assert opt.state[p]["m"].dtype == opt.state[p]["v"].dtype == state_dtype
    # Reference: the same step in fp32 (fp64 for fp64), rounded into the param dtype once at the end
    ref = p0.to(state_dtype, copy=True)
    m, v = torch.zeros(64, dtype=state_dtype), torch.zeros(64, dtype=state_dtype)
    adam_tf_step(ref, g.to(state_dtype), m, v, 0.9, 0.999, 1e-2, 0.9, 0.999, 1e-8)
    assert torch.equal(p.detach(), ref.to(dtype))
    assert not torch.equal(p.detach(), p0)


def test_bad_hyperparameters_raise():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="lr"):
        AdamTF(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        AdamTF(p, betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="eps"):
        AdamTF(p, eps=-1e-8)


def test_adam_difference_experiment_goes_from_1x_to_large(tmp_path):
    # The study's two ends on a random tiny model (8 rollouts, one seed): eps far below every |g|
    # makes both optimizers take ~lr * sign(g) steps (ratio ~1); eps far above them makes both
    # linear in g, TF's 31.6x more damped, so the parameter steps differ by ~31.6x (never more: 1 /
    # sqrt(1 - beta2) is the bound) and approxkl by far more.
    out = tmp_path / "r.json"
    flags = "--model random:tiny --reward random --seeds 1 --batch_size 8 --eps 1e-9 1e-1"
    cmd = [sys.executable, str(ROOT / "experiments" / "adam_difference.py"), *flags.split()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "approxkl torch/TF" in proc.stdout
    (seed,) = json.loads(out.read_text())["seeds"]
    low, high = seed["sweep"]
    assert 0 < seed["grad"]["p10"] < seed["grad"]["median"] < seed["grad"]["p90"]
    assert low["approxkl_torch"] > 0, low
    assert abs(low["approxkl_torch"] / low["approxkl_tf"] - 1) < 0.05, low
    assert high["approxkl_torch"] / high["approxkl_tf"] > 100, high
    assert 20 < high["dtheta_torch"] / high["dtheta_tf"] <= 1 / math.sqrt(1 - 0.999) + 1e-9, high


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _train(model, steps=3):
    opt = AdamTF(model.parameters(), lr=1e-2, eps=1e-5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(6, 4, dtype=torch.float64, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _fsdp_worker(out_path):
    """Under torchrun: the same tiny model, FSDP2-sharded over 2 CPU ranks (same batch on each)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _tiny_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _train(model)
    for s in opt.state.values():  # state lives in shards: each rank stores half of every m and v
        assert isinstance(s["m"], DTensor) and isinstance(s["v"], DTensor)
        assert s["m"].to_local().numel() < s["m"].numel()
    full = {k: t.full_tensor() for k, t in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(full, out_path)
    dist.destroy_process_group()


def test_fsdp2_two_ranks_match_single_process(tmp_path):
    out = tmp_path / "fsdp.pt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc_per_node=2", __file__, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = _tiny_model()
    init = {k: t.clone() for k, t in model.state_dict().items()}
    _train(model)
    sharded = torch.load(out)
    for k, t in model.state_dict().items():
        assert not torch.equal(t, init[k]), k
        torch.testing.assert_close(sharded[k], t, rtol=1e-12, atol=1e-15)


if __name__ == "__main__":
    _fsdp_worker(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown, which can abort on gloo's threads
