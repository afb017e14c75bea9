"""GPT-2, written from scratch for RLHF: the one model file every algorithm shares.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners". The module names follow Hugging Face's
GPT2LMHeadModel so a checkpoint saved here loads into `transformers` and real GPT-2 weights load here, tensor for
tensor: the projection weights are kept as GPT-2 stores them, (in, out) (`Conv1D`), because that layout is also the
faster one for generation on CPU.

What RLHF needs beyond nanoGPT:
- **Left padding.** Prompts of different lengths are left-padded so every response starts at the same column.
  Position ids come from the attention mask (`cumsum(mask) - 1`), so a left-padded prompt gives the same logits at
  its real tokens as the unpadded prompt. Pad rows may attend to themselves only, which keeps SDPA free of NaN.
- **KV-cache generation** for a batch of left-padded prompts, with one preallocated cache, temperature, top-k, top-p,
  greedy and a stop token. Under FSDP2 the model is unsharded once for the whole generation, not once per token.
  Sampling can take its uniforms from the caller (`noise`) so a global batch samples identically on 1 or N ranks.
- **Hidden states** (`return_hidden=True`) for the reward and value heads that the scripts own.
- **Shared prompts** (`forward(shared_prefix=n)`): a GRPO group's G responses, or a preference pair's two, continue
  one prompt; each distinct prompt runs once and its rows read its keys and values, in the same autograd graph:
  the same logits and gradients for 1/G of the prompt's compute. Generation prefills a repeated prompt once.
- **Speed on CPU**: every projection goes through `matmul`, which on AMD CPUs runs the fp32 GEMMs of GPT-2-sized
  layers through oneDNN instead of MKL (a GRPO step of the GPT-2 124M shape 1.4-1.5x faster there); ~60 lines.

    GPT2_CPU_GEMM=mkl python grpo.py     # force torch's default GEMM library (or onednn) for an A/B comparison
    GPT2_SHARED_PREFIX=0 python grpo.py  # run every row's prompt in full, for an A/B comparison
    python gpt2.py                       # prints the parameter count of each preset
"""

import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


@dataclass
class GPTConfig:
    block_size: int = 1024  # context length (n_positions)
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0  # off for RLHF: dropout makes logprobs of the same tokens differ between passes
    layer_norm_epsilon: float = 1e-5


PRESETS = {
    "tiny": dict(block_size=64, n_layer=4, n_head=4, n_embd=128),  # the offline default; vocab from the tokenizer
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# ---------------------------------------------------------------------------------------------------------------------
# Model


class LayerCache:
    """Keys and values (B, H, max_len, head_dim) of one layer, preallocated at the first write in the compute dtype
    (bf16 under autocast or FSDP2 mixed precision), then written in place step by step."""

    def __init__(self, max_len):
        self.max_len, self.k, self.v = max_len, None, None

    def update(self, k, v, pos):
        if self.k is None:
            self.k = k.new_empty(*k.shape[:2], self.max_len, k.shape[3])  # only [:pos + T] is ever read
            self.v = torch.empty_like(self.k)
        self.k[:, :, pos : pos + k.size(2)] = k
        self.v[:, :, pos : pos + k.size(2)] = v
        return self.k[:, :, : pos + k.size(2)], self.v[:, :, : pos + k.size(2)]

    def share(self, rows, n):
        """Slots 0..n of B' distinct prefixes out to B rows: row b takes prefix rows[b]'s (a copy, differentiable)."""
        k, v = self.k[rows, :, :n], self.v[rows, :, :n]
        self.k = self.v = None
        self.update(k, v, 0)


def _cpu_gemm_library() -> str:
    """Which library runs the model's fp32 GEMMs on CPU. torch's CPU build sends them to MKL, which takes a generic,
    slower code path on AMD CPUs; oneDNN, also inside torch, runs GPT-2 124M's products there 1.2-1.5x faster at
    training shapes and a decode step's 1.9x faster (2-core AMD EPYC with AVX-512, docs/benchmarks.md). On Intel CPUs
    the two were equal at generation's shapes, so torch's default stays. GPT2_CPU_GEMM=mkl|onednn overrides."""
    choice = os.environ.get("GPT2_CPU_GEMM", "auto")
    if choice in ("mkl", "onednn"):
        return choice
    if choice != "auto":
        print(f"warning: GPT2_CPU_GEMM={choice} is not auto, mkl or onednn: using auto", file=sys.stderr)
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:  # not Linux
        vendor = ""
    return "onednn" if vendor == "AuthenticAMD" and torch.backends.mkldnn.is_available() else "mkl"


ONEDNN = _cpu_gemm_library() == "onednn"
# GPT2_SHARED_PREFIX=0 turns off `forward(shared_prefix=)`'s sharing, for A/B comparisons (docs/benchmarks.md)
SHARE_PREFIX = os.environ.get("GPT2_SHARED_PREFIX", "1") != "0"
# oneDNN's fixed cost per call outweighs its gain on GEMMs with few weights AND few rows: a 64 x 128 x 128 GEMM (the
# tiny preset's decode step) takes 49 us there against MKL's 20. From GPT-2 124M's 768 x 768 weights on, or from ~512
# rows on (the tiny preset's training GEMMs: 2016 x 128 x 384 forward 1.17x, grad-input 1.23x faster), it is faster
ONEDNN_MIN_WEIGHTS, ONEDNN_MIN_ROWS = 1 << 18, 512


def _onednn(x, w_out_in, b=None):  # x (M, in) @ w_out_in.T + b; w_out_in (out, in) may be a transposed view
    return torch.ops.mkldnn._linear_pointwise(x, w_out_in, b, "none", [], "")


class OneDNNMatmul(torch.autograd.Function):
    """x (M, in) @ w + b for w (in, out), or x @ w.T for w (out, in) (`out_in`), forward and backward on oneDNN,
    except the weight's gradient, which MKL computes about as fast at training shapes (0.9-1.2x by shape)."""

    @staticmethod
    def forward(ctx, x, w, b, out_in):
        ctx.save_for_backward(x, w)
        ctx.out_in = out_in
        return _onednn(x, w if out_in else w.t(), b)

    @staticmethod
    def backward(ctx, g):  # g (M, out)
        x, w = ctx.saved_tensors
        gx = _onednn(g, w.t() if ctx.out_in else w) if ctx.needs_input_grad[0] else None  # g @ w(out, in)
        gw = (g.t() @ x if ctx.out_in else x.t() @ g) if ctx.needs_input_grad[1] else None
        return gx, gw, g.sum(0) if ctx.needs_input_grad[2] else None, None


def matmul(x, w, b=None, out_in=False):
    """x (M, in) @ w (in, out) + b, or x @ w.T for a weight stored (out, in): in fp32 on CPU through oneDNN where
    ONEDNN, else torch's own GEMM (MKL on CPU, cuBLAS on CUDA, bf16 under autocast; torch.compile picks its own)."""
    cpu_fp32 = x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    big = w.numel() >= ONEDNN_MIN_WEIGHTS or x.size(0) >= ONEDNN_MIN_ROWS
    if ONEDNN and cpu_fp32 and big and not torch.compiler.is_compiling():
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return OneDNNMatmul.apply(x, w, b, out_in)
        return _onednn(x, w if out_in else w.t(), b)
    if out_in:
        return F.linear(x, w, b)
    return x @ w if b is None else torch.addmm(b, x, w)


class Conv1D(nn.Module):
    """y = x @ weight + bias with weight (in, out): GPT-2's own layout (OpenAI's TF code, HF's `Conv1D`), not
    nn.Linear's (out, in). Why: in generation's decode step (a few rows against every weight) the CPU GEMM is faster
    with (in, out): sampling 8 x 16 tokens from GPT-2 124M takes 499 instead of 590 ms on a 2-core Xeon; at training
    shapes the two layouts are equal within a few percent, forward and backward (docs/benchmarks.md)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):  # (..., in) -> (..., out)
        return matmul(x.reshape(-1, x.size(-1)), self.weight, self.bias).view(*x.shape[:-1], -1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask, kv_cache=None, pos=0):
        return self.resid_dropout(self.c_proj(self.attend(self.c_attn(x), attn_mask, kv_cache, pos)))

    def attend(self, qkv, attn_mask, kv_cache=None, pos=0):
        """Queries, keys and values (B, T, 3C) → the heads' outputs (B, T, C), before the output projection."""
        B, T, C = qkv.size(0), qkv.size(1), qkv.size(2) // 3
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
        if kv_cache is not None:  # write this step's keys/values into the preallocated cache, attend to all so far
            k, v = kv_cache.update(k, v, pos)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, hd)
        return y.transpose(1, 2).reshape(B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = Conv1D(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's "gelu_new"


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, attn_mask, kv_cache=None, pos=0, prefix=None):
        """x (B, T, C) at cache slots pos..; with prefix = (xp (B', pos, C), its attention mask, rows (B,)), x's rows
        continue B' distinct prefixes (row b prefix rows[b]), whose keys and values fill slots 0..pos of every row's
        cache. Returns x, or (x, xp) with a prefix (GPT.forward's shared_prefix)."""
        if prefix is None:
            x = x + self.attn(self.ln_1(x), attn_mask, kv_cache, pos)
            return x + self.mlp(self.ln_2(x))
        xp, prefix_mask, rows = prefix
        (Bp, n, C), (B, T) = xp.shape, x.shape[:2]
        unpack = lambda t: (t[: Bp * n].view(Bp, n, -1), t[Bp * n :].view(B, T, -1))  # noqa: E731
        # the token-wise layers take the prefix and the suffix tokens together, (B' n + B T, C): one GEMM per layer,
        # which at a few rows costs about what reading its weights does; only attention sees the two apart
        h = torch.cat([xp.reshape(-1, C), x.reshape(-1, C)])
        qkv_p, qkv = unpack(self.attn.c_attn(self.ln_1(h)))
        y_p = self.attn.attend(qkv_p, prefix_mask, kv_cache, 0)  # fills slots 0..n for the B' prefixes
        kv_cache.share(rows, n)  # ... and copies them to the B rows
        y = self.attn.attend(qkv, attn_mask, kv_cache, n)
        h = h + self.attn.resid_dropout(self.attn.c_proj(torch.cat([y_p.reshape(-1, C), y.reshape(-1, C)])))
        h = h + self.mlp(self.ln_2(h))
        xp, x = unpack(h)
        return x, xp


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.activation_checkpointing = False  # recompute each block in backward: less memory, ~30% more compute
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        # logits returned: the tokenizer's vocabulary, which a padded embedding (e.g. 50304 rows for GPT-2's 50257
        # tokens) may exceed; ids past it are then never sampled and never in a log-softmax
        self.n_logits = cfg.vocab_size
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2 scales residual projections by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, Conv1D, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, (nn.Linear, Conv1D)) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, attention_mask=None, kv_cache=None, pos=0, return_hidden=False, keep_from=0, shared_prefix=0):
        """idx (B, T) token ids; attention_mask (B, pos + T), 1 = real token (None = no padding); kv_cache from
        `new_kv_cache`, with `pos` the number of cached steps. Returns logits (B, T', V), or hidden states (B, T', C),
        for positions keep_from.. only (T' = T - keep_from): RL needs no (B, T, V) logits over the prompt.
        shared_prefix = n > 0 says the first n columns of idx and attention_mask repeat across rows (a GRPO group's
        prompt, a DPO pair's): each distinct prefix runs once and its rows read its keys and values, which gives the
        same outputs (to float rounding) for 1/G of the prefix's compute (needs pos == 0 and keep_from >= n)."""
        B, T = idx.shape
        # wte is tied to lm_head: when the logits are computed, the lookup's gradient (B*T rows) is passed sparse and
        # added into lm_head's dense (V, C) gradient, instead of building a zero (V, C) tensor and adding two of them
        # (not under torch.compile, whose inductor cannot take a sparse gradient)
        sparse = not return_hidden and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        checkpointing = self.activation_checkpointing and self.training
        n, prefix = min(shared_prefix, T - 1) if SHARE_PREFIX and not checkpointing else 0, None
        if n > 0:
            if pos != 0 or keep_from < n:
                raise ValueError(f"shared_prefix={n} needs pos=0 and keep_from >= {n}, got pos={pos}, keep_from={keep_from}")
            mask = torch.ones_like(idx) if attention_mask is None else attention_mask
            # the distinct (prefix, its mask) rows; row b continues prefix rows[b]
            uniq, rows = torch.unique(torch.cat([idx[:, :n], mask[:, :n].to(idx.dtype)], 1), dim=0, return_inverse=True)
            if len(uniq) < B:  # (B', n, C) hidden states of the distinct prefixes, their (B', 1, n, n) attention mask
                prefix = (*self.embed(uniq[:, :n], uniq[:, n:], 0, sparse), rows)
                idx, attention_mask, pos, keep_from = idx[:, n:], mask, n, keep_from - n
                kv_cache = self.new_kv_cache(T) if kv_cache is None else kv_cache
        x, attn_mask = self.embed(idx, attention_mask, pos, sparse)
        for i, block in enumerate(self.transformer.h):
            cache = None if kv_cache is None else kv_cache[i]
            if prefix is not None:  # one call per block with both (FSDP2 gathers its weights once per call)
                x, xp = block(x, attn_mask, cache, pos, prefix)
                prefix = (xp, *prefix[1:])
            elif checkpointing:
                x = torch.utils.checkpoint.checkpoint(block, x, attn_mask, cache, pos, use_reentrant=False)
            else:
                x = block(x, attn_mask, cache, pos)
        x = self.transformer.ln_f(x[:, keep_from:])
        return x if return_hidden else self.logits(x)

    def embed(self, idx, attention_mask, pos, sparse=False):
        """Token + position embeddings (B, T, C) of idx (B, T) at cache slots pos.., and the attention mask (B, 1, T,
        pos + T) of its queries (None: no padding, the causal kernel): positions count each row's real tokens."""
        B, T = idx.shape
        if attention_mask is None and pos > 0:
            attention_mask = torch.ones(B, pos + T, dtype=torch.long, device=idx.device)
        if attention_mask is None:  # no padding: the fast causal kernel
            position_ids, attn_mask = torch.arange(T, device=idx.device).expand(B, T), None
        else:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]  # left padding: count real tokens
            q_idx = torch.arange(pos, pos + T, device=idx.device)[:, None]  # (T, 1) absolute column of each query
            k_idx = torch.arange(pos + T, device=idx.device)[None, :]  # (1, S) column of each key
            # causal and not padding; every query may see itself, so a pad row is never all -inf (NaN in SDPA)
            attn_mask = ((k_idx <= q_idx) & attention_mask.bool()[:, None, None, :]) | (k_idx == q_idx)  # (B,1,T,S)
        if pos + T > self.config.block_size:  # a shape check: no device sync, unlike checking position_ids.max()
            raise ValueError(f"sequence of {pos + T} tokens exceeds block_size {self.config.block_size}")
        tok = F.embedding(idx, self.transformer.wte.weight, sparse=sparse)
        return self.transformer.drop(tok + self.transformer.wpe(position_ids)), attn_mask

    def logits(self, x):
        """Hidden states (..., C) → logits (..., n_logits)."""
        w = self.lm_head.weight if self.n_logits == self.config.vocab_size else self.lm_head.weight[: self.n_logits]
        return matmul(x.reshape(-1, x.size(-1)), w, out_in=True).view(*x.shape[:-1], -1)

    def decode_step(self, token, position, bias, kv_cache, pos):
        """Generation's inner loop: one new token per row, token and position (B,), written to cache slot `pos`; it
        attends to slots 0..pos with the additive bias (B, 1, 1, pos + 1), 0 or -inf (padding). Returns logits (B, V).
        `forward(token[:, None], mask, kv_cache, pos)` computes the same, but rebuilds the mask and the position ids
        from the whole attention mask at every token: 4–12% of generation time on the tiny model (docs/benchmarks.md)."""
        x = self.transformer.drop(self.transformer.wte(token) + self.transformer.wpe(position))[:, None]  # (B, 1, C)
        for block, cache in zip(self.transformer.h, kv_cache):
            x = block(x, bias, cache, pos)
        h, w = self.transformer.ln_f(x[:, 0]), self.lm_head.weight[: self.n_logits]  # (B, C), (V, C)
        if ONEDNN and h.device.type == "cpu" and w.numel() >= ONEDNN_MIN_WEIGHTS:
            return self.logits(h)
        # (V, C) @ (C, B), not (B, C) @ (C, V): with a few rows MKL reads the tied (V, C) embedding 1.5x faster this
        # way round (50257 x 768, 8 rows: 10 vs 15 ms per token on a Xeon); the (B, V) result is a transposed view
        return (w @ h.t()).t()

    def new_kv_cache(self, max_len):
        """One cache per layer for sequences of up to max_len tokens, filled by `forward(..., kv_cache=, pos=)`."""
        return [LayerCache(max_len) for _ in range(self.config.n_layer)]


# ---------------------------------------------------------------------------------------------------------------------
# Loading and saving in the Hugging Face safetensors layout

HF_URL = "https://huggingface.co/{name}/resolve/main/model.safetensors"


def make_config(model: str, vocab_size: int | None = None, block_size: int | None = None) -> GPTConfig:
    """Config of a preset name, optionally with the vocabulary and context length overridden."""
    if model not in PRESETS:
        raise ValueError(f"unknown model preset '{model}': use one of {', '.join(PRESETS)} or a checkpoint path")
    cfg = GPTConfig(**PRESETS[model])
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    if block_size is not None:
        cfg.block_size = block_size
    return cfg


def _resolve(path_or_name: str) -> str:
    """A local .safetensors file, a directory holding model.safetensors, or a preset name fetched into a cache."""
    if os.path.isdir(path_or_name):
        path_or_name = os.path.join(path_or_name, "model.safetensors")
    if os.path.isfile(path_or_name):
        return path_or_name
    if path_or_name not in PRESETS or path_or_name == "tiny":
        raise FileNotFoundError(f"no checkpoint at '{path_or_name}': pass a model.safetensors file or its directory")
    cache = os.path.join(os.path.expanduser(os.environ.get("GPT2_CACHE", "~/.cache/gpt2_rlhf")), path_or_name)
    target = os.path.join(cache, "model.safetensors")
    if not os.path.isfile(target):
        import urllib.request

        os.makedirs(cache, exist_ok=True)
        try:
            urllib.request.urlretrieve(HF_URL.format(name=path_or_name), target + ".part")
        except OSError as e:
            if os.path.exists(target + ".part"):
                os.remove(target + ".part")
            raise FileNotFoundError(
                f"could not download '{path_or_name}' weights ({e.__class__.__name__}); offline, pass the path of a "
                f"local model.safetensors (e.g. from huggingface.co/{path_or_name}) as --model"
            ) from None
        os.replace(target + ".part", target)
    return target


def read_checkpoint(path_or_name: str) -> tuple[dict, dict]:
    """(tensors, config dict) of a checkpoint; extra tensors (e.g. a reward head `score.*`) are kept."""
    path = _resolve(path_or_name)
    tensors = load_file(path)
    cfg_path = os.path.join(os.path.dirname(path), "config.json")
    meta = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            meta = json.load(f)
    return tensors, meta


def from_hf_state_dict(tensors: dict, meta: dict) -> GPT:
    """Build a GPT from HF GPT-2 tensors (keys with or without the `transformer.` prefix) and an HF config dict."""
    sd = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    if "wte.weight" not in sd:
        raise ValueError("not a GPT-2 checkpoint (no wte.weight): pass one written by gpt2.save_model or HF GPT-2")
    wte = sd["wte.weight"]
    n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("h."))
    cfg = GPTConfig(
        block_size=sd["wpe.weight"].shape[0],
        vocab_size=wte.shape[0],
        n_layer=n_layer,
        n_head=meta.get("n_head", {768: 12, 1024: 16, 1280: 20, 1600: 25}.get(wte.shape[1], wte.shape[1] // 64)),
        n_embd=wte.shape[1],
        layer_norm_epsilon=meta.get("layer_norm_epsilon", 1e-5),
    )
    model = GPT(cfg)
    own = model.state_dict()
    for name in own:
        if name == "lm_head.weight":
            continue  # tied to wte
        src = sd[name.removeprefix("transformer.")]
        own[name].copy_(src)
    return model


def load_model(model: str, vocab_size: int | None = None, block_size: int | None = None) -> GPT:
    """`tiny` (random init, vocab from the tokenizer), a GPT-2 preset name (pretrained weights) or a checkpoint.
    With `vocab_size` (the tokenizer's), a checkpoint must have an embedding of that size, or one padded up to the next
    multiple of 128; anything else is a tokenizer / model mismatch."""
    if model == "tiny":
        return GPT(make_config(model, vocab_size, block_size))
    model_ = from_hf_state_dict(*read_checkpoint(model))
    if vocab_size is not None:
        rows = model_.config.vocab_size
        if not vocab_size <= rows <= -(-vocab_size // 128) * 128:
            raise ValueError(
                f"checkpoint '{model}' has a {rows}-token vocabulary but the data's tokenizer has {vocab_size}: "
                "prep the data with the tokenizer the model was trained with (data.prep --tokenizer), or pass a model "
                "trained on this data"
            )
        model_.n_logits = vocab_size
    return model_


def full_state_dict(model: nn.Module) -> dict:
    """The full (unsharded) state dict on CPU: gathered from every rank under FSDP2 (a collective: call on all)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Load a full state dict (our names) into a plain or an FSDP2-sharded model (each rank keeps its shard)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.is_initialized():
        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state_dict)


def state_dict_from_hf(tensors: dict, model: nn.Module) -> dict:
    """HF-layout tensors (as `save_model` writes them) → the state dict of `model` (a GPT or a subclass with extra
    heads): the tied lm_head filled from wte."""
    sd = {}
    for name in model.state_dict():
        key = "transformer.wte.weight" if name == "lm_head.weight" else name
        src = tensors[key] if key in tensors else tensors[key.removeprefix("transformer.")]
        sd[name] = src
    return sd


def to_hf_state_dict(state_dict: dict) -> dict:
    """Our state dict → HF GPT2LMHeadModel tensors (the same names and layouts; the tied lm_head dropped)."""
    return {k: v.detach().contiguous().cpu() for k, v in state_dict.items() if k != "lm_head.weight"}


def save_model(state_dict: dict, cfg: GPTConfig, out_dir: str, extra_tensors=None, extra_config=None) -> None:
    """Write model.safetensors + config.json (HF GPT-2 layout) atomically: temp files, then rename."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = to_hf_state_dict(state_dict) | {k: v.detach().contiguous().cpu() for k, v in (extra_tensors or {}).items()}
    hf_cfg = dict(
        architectures=["GPT2LMHeadModel"], model_type="gpt2", n_positions=cfg.block_size, n_ctx=cfg.block_size,
        vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
        layer_norm_epsilon=cfg.layer_norm_epsilon, activation_function="gelu_new", resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, tie_word_embeddings=True,
    ) | (extra_config or {})  # fmt: skip
    path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, path + ".tmp", metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json.tmp"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    os.replace(path + ".tmp", path)
    os.replace(os.path.join(out_dir, "config.json.tmp"), os.path.join(out_dir, "config.json"))


# ---------------------------------------------------------------------------------------------------------------------
# Generation


@contextmanager
def unsharded(model):
    """Under FSDP2, gather the full parameters once for a whole generation instead of once per decoding step."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in fsdp:  # back to FSDP2's defaults: blocks reshard after forward, the root stays gathered for backward
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)


def sample_token(logits, u=None, temperature=1.0, top_k=0, top_p=1.0, generator=None):
    """Next token from logits (B, V): greedy when temperature == 0, else inverse-CDF sampling with uniforms u (B,)."""
    if temperature == 0.0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:  # nucleus: keep the smallest set of tokens whose mass reaches top_p (always the most likely one)
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    if u is None:
        u = torch.rand(logits.size(0), device=logits.device, generator=generator)
    cdf = probs.cumsum(-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.dtype), right=True).squeeze(-1)
    return token.clamp(max=logits.size(-1) - 1)


@torch.no_grad()
def generate(
    model, query, pad_token_id, max_new_tokens, eos_token_id=None, temperature=1.0, top_k=0, top_p=1.0,
    noise=None, generator=None, return_logprobs=False,
):  # fmt: skip
    """Sample responses (B, max_new_tokens) for left-padded queries (B, Tq) with a preallocated KV cache.

    Tokens after the first `eos_token_id` are `pad_token_id`. `noise` (B, max_new_tokens) are the uniforms used by
    inverse-CDF sampling; passing a slice of one global tensor makes sampling independent of the number of ranks.
    With `return_logprobs`, also the log-probs (B, max_new_tokens) of the sampled tokens under logits / temperature
    (0 after the stop token): the sampler's own numbers, which spares RL a second forward pass to compute them."""
    B, Tq = query.shape
    cfg = model.config
    if temperature > 0 and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if Tq + max_new_tokens > cfg.block_size:
        raise ValueError(f"query {Tq} + response {max_new_tokens} tokens exceed the context of {cfg.block_size}")
    if noise is None and temperature > 0:
        noise = torch.rand(B, max_new_tokens, device=query.device, generator=generator)
    real = query != pad_token_id  # (B, Tq)
    with unsharded(model):
        kv = model.new_kv_cache(Tq + max_new_tokens)
        # a prompt repeated G times (GRPO's groups) is prefilled once: shared_prefix
        logits = model(query, attention_mask=real.long(), kv_cache=kv, keep_from=Tq - 1, shared_prefix=Tq - 1)[:, -1]
        # for decode_step: the additive bias over all slots (padding -inf, every response slot 0) in the cache's
        # dtype, and each row's next absolute position (its number of real prompt tokens)
        bias = torch.zeros(B, 1, 1, Tq + max_new_tokens, dtype=kv[0].k.dtype, device=query.device)
        bias[:, 0, 0, :Tq].masked_fill_(~real, float("-inf"))
        position = real.sum(1)
        response = torch.full((B, max_new_tokens), pad_token_id, dtype=query.dtype, device=query.device)
        logprobs = torch.zeros(B, max_new_tokens, device=query.device) if return_logprobs else None
        done = torch.zeros(B, dtype=torch.bool, device=query.device)
        for t in range(max_new_tokens):
            token = sample_token(logits, None if noise is None else noise[:, t], temperature, top_k, top_p)
            response[:, t] = torch.where(done, pad_token_id, token)
            if return_logprobs:
                logp = torch.log_softmax(logits.float() / (temperature or 1.0), -1).gather(-1, token[:, None]).squeeze(-1)
                logprobs[:, t] = logp.masked_fill(done, 0.0)
            if eos_token_id is not None:
                done |= token == eos_token_id
                # the check syncs with the device: on GPU every few steps only, on CPU (no sync cost) every step
                if (query.device.type == "cpu" or t % 8 == 7) and done.all():
                    break
            if t + 1 < max_new_tokens:
                logits = model.decode_step(token, position + t, bias[..., : Tq + t + 1], kv, Tq + t)
    return (response, logprobs) if return_logprobs else response


if __name__ == "__main__":
    for name in PRESETS:
        m = GPT(make_config(name, vocab_size=257 if name == "tiny" else None))
        print(f"{name:12s} {sum(p.numel() for p in m.parameters()) / 1e6:8.2f}M parameters")
