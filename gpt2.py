"""GPT-2 from scratch for RLHF (Radford et al. 2019): the model every algorithm file shares.

It keeps GPT-2's own module names and (in, out) weight layout, so weights move to and from
Hugging Face as they are. Beyond nanoGPT's model.py:
- positions come from the attention mask, so left padding changes no logit;
- generation with a KV cache, one fixed-shape decode step per token (a CUDA graph on GPU),
  with top-k and top-p (nucleus) sampling;
- log-probs of given responses, a chunk of logits at a time;
- padding-free training passes: a micro-batch's real tokens packed into one row (pack);
- scalar heads (reward, value);
- load and save of plain or FSDP2-sharded models in the HF safetensors layout.

It reads as nanoGPT's model.py first: the config, the blocks, and one forward pass from
embedding to logits, whose named passes are the packed one that training runs, the padded
one, and the cached one that decoding runs. Then, each in its section: the packed pass's
layout; model I/O; log-probs and rewards; generation; the GPU paths off by default; the CPU's
GEMM routing. Nothing happens at import: the environment's settings (GPT2_HEAD,
GPT2_ROLL_PADDING, GPT2_CPU_GEMM) are read when a model is built.
"""

import ctypes
import functools
import json
import math
import os
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import state_dict as dcp
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint


class RunError(Exception):
    """A problem the user can fix (a flag, a file): a script's __main__ prints it as one line,
    `error: <message>`, on rank 0, and exits with status 1; no traceback."""


# ---- The model: the config, the blocks, and one forward pass from embedding to logits
@dataclass
class GPTConfig:
    block_size: int = 1024  # context length (n_positions)
    vocab_size: int = 50257  # embedding rows; may exceed the tokenizer's vocabulary
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int = 50256  # the tokenizer's stop token, written to config.json
    pad_token_id: int = 50256


# The model sizes by name. "tiny" is the offline default (random init); the others are GPT-2's
# released checkpoints of 124M, 350M, 774M and 1558M parameters.
PRESETS = {
    "tiny": dict(block_size=64, n_layer=4, n_head=4, n_embd=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}

# No cuDNN: its SDPA backward can return NaN with a mask when T % 128 == 64 (pytorch#196678).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_contexts():
    """checkpoint's contexts: none around the forward, SDPA_BACKENDS around the recomputation."""
    return nullcontext(), sdpa_kernel(SDPA_BACKENDS)


def matmul(x, w, b=None, out_in=False):
    """x (..., in) @ w (in, out) + b, or x @ w.T for w (out, in): torch's GEMM."""
    if out_in:
        return F.linear(x, w, b)
    x_2d = x.reshape(-1, x.size(-1))
    # The weight enters the GEMM as the leaf it is: autocast caches its cast of a leaf for the
    # whole autocast region, but casts a view such as w.t() again at every call. F.linear of
    # w.t() would run this same addmm.
    if b is None:
        y = torch.mm(x_2d, w)
    else:
        y = torch.addmm(b, x_2d, w)
    return y.view(*x.shape[:-1], w.size(1))


class Conv1D(nn.Module):
    """y = x @ weight + bias, weight (in, out): GPT-2's layout, faster for decoding on CPU."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        # torch's GEMM; a model built to route its CPU GEMMs binds cpu_matmul here instead.
        self.gemm = matmul

    def forward(self, x):  # (..., in) -> (..., out)
        return self.gemm(x, self.weight, self.bias)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        C = cfg.n_embd
        eps = cfg.layer_norm_epsilon
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(C, eps=eps)
        self.attn = nn.ModuleDict(dict(c_attn=Conv1D(C, 3 * C), c_proj=Conv1D(C, C)))
        self.ln_2 = nn.LayerNorm(C, eps=eps)
        self.mlp = nn.ModuleDict(dict(c_fc=Conv1D(C, 4 * C), c_proj=Conv1D(4 * C, C)))

    def forward(self, x, attn_mask=None, kv_cache=None, layer=0, packing=None):
        """x (B, T, C) -> (B, T, C): attention, then the MLP, each added to the residual stream.

        attn_mask (B, 1, T, S) bool: the keys each query sees; None: no padding, and the causal
        kernel with no mask. kv_cache: this block's keys and values are written to it, and
        attention reads its columns (layer: the block's index). packing: x is one row of pack()'s
        real tokens (1, N, C), and attention stays within each of its sequences.
        """
        C = x.size(-1)
        qkv = self.attn.c_attn(self.ln_1(x))
        q, k, v = qkv.split(C, dim=2)
        if packing is None:
            y = self.attention(q, k, v, attn_mask, kv_cache, layer)
        else:
            y = packed_attention(q, k, v, self.n_head, packing)
        x = x + self.attn.c_proj(y)
        # The tanh approximation of GELU: GPT-2's gelu_new.
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp.c_proj(h)

    def attention(self, q, k, v, attn_mask, kv_cache, layer):
        """Multi-head attention of q, k, v (B, T, C) -> (B, T, C), over the cache's keys too."""
        B, T, C = q.shape
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, H, T, hd)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, H, T, hd)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)
        # No mask means no padding: the causal kernel. The backends are chosen once per
        # forward, around the blocks (GPT.body).
        is_causal = attn_mask is None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal)
        return y.transpose(1, 2).reshape(B, T, C)


class GPT(nn.Module):
    # False inside `unsharded`: forward then calls the blocks without FSDP2's hooks.
    hooks = True

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        C = cfg.n_embd
        # Recompute each block in backward instead of keeping its activations: less memory.
        self.activation_checkpointing = False
        # Train on the real tokens only (pack): logprobs and get_reward skip the padding.
        self.packing = False
        wte = nn.Embedding(cfg.vocab_size, C)
        wpe = nn.Embedding(cfg.block_size, C)
        h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        ln_f = nn.LayerNorm(C, eps=cfg.layer_norm_epsilon)
        self.transformer = nn.ModuleDict(dict(wte=wte, wpe=wpe, h=h, ln_f=ln_f))
        self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)
        # Tied to the token embedding, as in GPT-2.
        self.lm_head.weight = wte.weight
        # The tokenizer's vocabulary: the logits stop there, so padding rows are never sampled.
        self.n_logits = cfg.vocab_size
        # The environment's settings are read here, when a model is built: not at import.
        head = head_mode()
        # ln_f, the heads and the root's parameters in fp32: every head but bf16.
        self.fp32_head = head != "bf16"
        # With fp32_head: the head's GEMM from bf16 operands, on CUDA under bf16 autocast.
        self.mixed_head = head == "mixed"
        self.roll_padding = roll_padding_devices()
        # The LM head's GEMM, as Conv1D's: torch's, or cpu_matmul (bind_cpu_gemms).
        self.gemm = matmul
        # GPT-2's init: weights N(0, 0.02); the biases are zeros already.
        for m in self.modules():
            if isinstance(m, (nn.Linear, Conv1D, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        # GPT-2 scales the residual projections by 1/sqrt(N), N = 2 n_layer residual layers.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
        # The CPU's fp32 GEMMs to oneDNN where it pays (the CPU speed section at the end).
        bind_cpu_gemms(self)

    def forward(
        self,
        idx,
        attention_mask=None,
        kv_cache=None,
        hidden=False,
        keep_from=0,
        contiguous=False,
        packing=None,
    ):
        """The logits (B, T', V), or if hidden the hidden states (B, T', C), of positions
        keep_from.. of idx (B, T).

        attention_mask (B, T): 1 for a real token, 0 for padding; None: no padding. The
        arguments pick the pass, each a method below:
        - packing, pack()'s Packing of attention_mask: `packed`, the real tokens only, in one
          row; it returns the kept ones' logits (n, V) or hidden states (n, C). The scripts
          train through it by default (--packing): gpt2.logprobs in sft.py, dpo.py
          (data.response_logprobs), ppo.py and grpo.py; get_reward's scores in reward.py,
          ppo.py and grpo.py; ppo.py's values (forward_values).
        - kv_cache, a KVCache: `prefill`, the padded pass that starts gpt2.generate, whose keys
          and values fill the cache's columns 0..T-1; `decode` then feeds one token per row.
          ppo.py and grpo.py sample their rollouts this way, reward.py the responses it
          normalises its rewards on, and data's accuracy evaluations their answers.
        - otherwise `padded`: masked, or with no mask the causal kernel. It takes batches with
          no padding, queries with a pad between real tokens, and every training pass under
          --no_packing.
        A mask is always used as given: whether every token is real is the callers' to say (it
        takes a host sync, which they already make in _trim). contiguous: the caller has
        checked that each row's real tokens are one run, padding only before and after it, so
        that the rows may be rolled (rolled padding, off by default). No dropout: RL needs the
        same logits in every pass.
        """
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"{T} tokens exceed block_size {self.config.block_size}")
        if packing is not None:
            x = self.packed(idx, packing)  # (n, C)
        elif kv_cache is not None:
            x = self.prefill(idx, attention_mask, kv_cache)[:, keep_from:]
        elif contiguous and rolls_padding(self, idx, attention_mask):
            # GPT2_ROLL_PADDING, off by default: the section of GPU paths (docs/gpu.md).
            x = rolled(self, idx, attention_mask, keep_from)
        else:
            x = self.padded(idx, attention_mask)[:, keep_from:]
        return self.head(x, hidden)

    def padded(self, idx, attention_mask, kv_cache=None):
        """The blocks' output (B, T, C) for a padded batch idx (B, T), attention_mask as forward's.

        kv_cache: the blocks' keys and values are written to it too (prefill).
        """
        B, T = idx.shape
        device = idx.device
        if attention_mask is None:
            positions = torch.arange(T, device=device).expand(B, T)
            return self.body(idx, positions, None, kv_cache)
        # Positions count the real tokens only, so left padding changes nothing.
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        q_idx = torch.arange(T, device=device)[:, None]  # (T, 1)
        k_idx = torch.arange(T, device=device)[None, :]  # (1, T)
        real = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
        # Causal and not padding; and always itself, so that a pad row is never all -inf,
        # which SDPA turns into NaN.
        attn_mask = ((k_idx <= q_idx) & real) | (k_idx == q_idx)  # (B, 1, T, T)
        return self.body(idx, positions, attn_mask, kv_cache)

    def packed(self, idx, packing):
        """The blocks' output (n, C) at packing's kept tokens: the blocks see only the real tokens
        of idx (B, T), packed into one row."""
        packed_idx = idx.flatten()[packing.tokens][None]  # (1, N)
        positions = packing.positions[None]  # (1, N)
        x = self.body(packed_idx, positions, packing=packing)  # (1, N, C)
        return x[0, packing.keep]

    def prefill(self, idx, attention_mask, kv_cache):
        """padded's output (B, T, C), the blocks' keys and values written to kv_cache's columns
        0..T-1: the whole query at once, before generate's decode steps."""
        T = idx.size(1)
        kv_cache.cols = torch.arange(T, device=idx.device)
        kv_cache.width = T
        return self.padded(idx, attention_mask, kv_cache)

    def decode(self, token, positions, attn_mask, kv_cache):
        """The logits (B, V) after one token per row, token (B, 1) at positions (B, 1): a decode
        step (decode_step). The token's keys and values go to the cache's columns kv_cache.cols;
        attn_mask (B, 1, 1, S) marks which columns attention reads hold a real token."""
        x = self.body(token, positions, attn_mask, kv_cache)  # (B, 1, C)
        return self.head(x)[:, -1]

    def body(self, idx, positions, attn_mask=None, kv_cache=None, packing=None):
        """The blocks' output (B, T, C) for tokens idx (B, T) at positions (B, T).

        attn_mask, kv_cache and packing are Block.forward's.
        """
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(positions)  # (B, T, C)
        x = tok_emb + pos_emb
        # Entered once per forward, not per block: each entry costs host time.
        with sdpa_kernel(SDPA_BACKENDS):
            for layer, block in enumerate(self.transformer.h):
                x = self.run_block(block, x, attn_mask, kv_cache, layer, packing)
        return x

    def run_block(self, block, x, attn_mask, kv_cache, layer, packing):
        """One block: recomputed in backward, or hook-free inside `unsharded`, or plainly."""
        if self.activation_checkpointing and self.training:
            # The recomputation runs in backward, outside body's sdpa_kernel: it enters its own.
            return checkpoint(
                block,
                x,
                attn_mask,
                kv_cache,
                layer,
                packing,
                use_reentrant=False,
                context_fn=sdpa_contexts,
            )
        if not self.hooks:
            # No FSDP2 hooks: cast to the blocks' dtype, as FSDP2's would.
            x = x.to(block.ln_1.weight.dtype)
            return block.forward(x, attn_mask, kv_cache, layer, packing)
        return block(x, attn_mask, kv_cache, layer, packing)

    def head(self, x, hidden=False):
        """ln_f of the blocks' output x (..., C), then the logits (..., n_logits); or, if hidden,
        the hidden states (..., C)."""
        if self.fp32_head:
            x = x.float()
        x = self.transformer.ln_f(x)
        if hidden:
            return x
        return self.logits(x)

    def logits(self, x):  # (..., C) -> (..., n_logits)
        w = self.lm_head.weight[: self.n_logits]
        if not self.fp32_head:
            return self.gemm(x, w, out_in=True)
        if self.mixed_head and under_cuda_bf16_autocast(x):
            # GPT2_HEAD=mixed, off by default: the section of GPU paths (docs/gpu.md).
            return mixed_logits(x, w)
        with torch.autocast(x.device.type, enabled=False):
            return self.gemm(x.float(), w.float(), out_in=True)


class ScalarModel(GPT):
    """GPT-2 with a scalar head (reward, value): gain * score(h) + bias.

    Gain and bias are set by reward normalisation and kept in config.json; the state dict is
    GPT-2's plus `score.*`.
    """

    def __init__(self, backbone: GPT, gain: float = 1.0, bias: float = 0.0):
        # Not GPT.__init__: it would build a second backbone.
        nn.Module.__init__(self)
        self.config = backbone.config
        self.n_logits = backbone.n_logits
        self.fp32_head = backbone.fp32_head
        self.roll_padding = backbone.roll_padding
        self.activation_checkpointing = backbone.activation_checkpointing
        self.packing = backbone.packing
        self.transformer = backbone.transformer
        # Unused, but kept so that the state dict is GPT-2's plus `score.*`.
        self.lm_head = backbone.lm_head
        self.score = nn.Linear(self.config.n_embd, 1)
        # lm-human-preferences' init: the first scores have unit scale.
        nn.init.normal_(self.score.weight, std=1 / math.sqrt(self.config.n_embd + 1))
        nn.init.zeros_(self.score.bias)
        self.reward_gain = gain
        self.reward_bias = bias

    def forward(self, query_response, attention_mask, keep_from=0, packing=None):
        h = super().forward(
            query_response, attention_mask, hidden=True, keep_from=keep_from, packing=packing
        )
        w = self.score.weight.float()
        b = self.score.bias.float()
        # The scores in fp32, as the logits.
        with torch.autocast(h.device.type, enabled=False):
            score = F.linear(h.float(), w, b).squeeze(-1)  # (B, T'), or (n,) if packed
            return score * self.reward_gain + self.reward_bias


def head_mode():
    """The LM head GPT2_HEAD picks, read and checked when a model is built (GPT.__init__).

    "fp32" (operands, sums and logits), "mixed" (bf16 operands on tensor cores, fp32 sums and
    logits; CUDA under bf16 autocast only, fp32 elsewhere) or "bf16" (bf16 logits). bf16 logits
    lose the bits that tell the sampler's log-probs from the trainer's (MiniMax-M1's
    train/inference mismatch).
    """
    head = os.environ.get("GPT2_HEAD", "fp32")
    # GPT2_FP32_HEAD=0 is the earlier name of GPT2_HEAD=bf16.
    if os.environ.get("GPT2_FP32_HEAD") == "0":
        head = "bf16"
    if head not in ("fp32", "mixed", "bf16"):
        raise RunError(f"GPT2_HEAD={head}: expected fp32, mixed or bf16")
    return head


# ---- The packed pass's layout: the real tokens of a batch, in one row
class Packing(NamedTuple):
    """Where the real tokens of a padded batch (B, T) sit once packed into one row of N tokens.

    Each row's real tokens stay in order, at their own positions, and attend only to each
    other: attention is block-diagonal and causal, so no FLOP goes to a pad.
    """

    tokens: torch.Tensor  # (N,) the real tokens' flat indices into (B, T), row by row
    positions: torch.Tensor  # (N,) each token's position in its own sequence
    cu_seqlens: torch.Tensor  # (B + 1,) int32: where each row's tokens start, and the end
    slots: torch.Tensor  # (N,) each token's place in a (B, max_len) layout whose pads trail
    keep: torch.Tensor  # (n,) the packed tokens whose outputs the pass returns
    rows: int  # B
    max_len: int  # the most real tokens in a row


def pack(attention_mask, keep):
    """The Packing of attention_mask (B, T)'s real tokens; keep (B, T): the outputs wanted.

    Every kept position must be a real token: a pad has no place in the packed row.
    """
    real = attention_mask.bool()
    keep = keep.bool()
    lengths = real.sum(1)  # (B,)
    # One host sync: the longest row, and whether any kept position is a pad.
    stats = torch.stack([lengths.max(), (keep & ~real).any()]).tolist()
    if stats[1]:
        raise ValueError("pack: a kept position is padding; only real tokens have outputs")
    max_len = max(1, stats[0])
    # Positions count the real tokens only, as forward's do.
    positions = real.long().cumsum(1) - 1  # (B, T)
    tokens = real.flatten().nonzero().squeeze(1)  # (N,)
    token_positions = positions.flatten()[tokens]  # (N,)
    row = tokens // real.size(1)
    slots = row * max_len + token_positions
    keep = keep.flatten()[tokens].nonzero().squeeze(1)  # (n,)
    return Packing(
        tokens=tokens,
        positions=token_positions,
        cu_seqlens=F.pad(lengths.cumsum(0), (1, 0)).int(),
        slots=slots,
        keep=keep,
        rows=real.size(0),
        max_len=max_len,
    )


def unpack(values, keep):
    """pack's kept outputs (n, ...) back in keep (B, T)'s layout: (B, T, ...), 0 elsewhere."""
    out = values.new_zeros(keep.shape + values.shape[1:])
    out[keep] = values
    return out


def packed_attention(q, k, v, n_head, packing):
    """Causal attention within each sequence of a packed row: q, k, v (1, N, C) -> (1, N, C).

    On CUDA in bf16 or fp16: FlashAttention's variable-length kernel. Elsewhere the sequences
    are laid out (B, max_len) with their pads trailing, for the causal kernel with no mask: a
    real token sees only the real tokens before it. Its cost is that of the longest row.
    """
    N, C = q.shape[1:]
    q = q.view(N, n_head, C // n_head)  # (N, H, hd)
    k = k.view(N, n_head, C // n_head)
    v = v.view(N, n_head, C // n_head)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        # Imported on first use: the module brings torch's compiler stack, the slowest part of
        # every process's start, and only this CUDA path needs it.
        from torch.nn.attention.varlen import varlen_attn

        cu = packing.cu_seqlens
        L = packing.max_len
        # window_size (-1, 0): causal.
        y = varlen_attn(q, k, v, cu, cu, L, L, window_size=(-1, 0))
        return y.reshape(1, N, C)
    y = F.scaled_dot_product_attention(
        pads_trailing(q, packing),
        pads_trailing(k, packing),
        pads_trailing(v, packing),
        is_causal=True,
    )  # (B, H, L, hd)
    y = y.transpose(1, 2).reshape(packing.rows * packing.max_len, C)
    return y[packing.slots][None]


def pads_trailing(x, packing):
    """Packed x (N, H, hd) -> (B, H, L, hd): each sequence from column 0, zeros after it."""
    B = packing.rows
    L = packing.max_len
    H, hd = x.shape[1:]
    rows = x.new_zeros(B * L, H, hd).index_copy(0, packing.slots, x)
    return rows.view(B, L, H, hd).transpose(1, 2)


# ---- Model I/O in the Hugging Face GPT-2 safetensors layout
# lm_head is wte: it is not saved, and is loaded from wte.
TIED = {"lm_head.weight": "transformer.wte.weight"}


def load(name, tokenizer=None, head=None, shard=None):
    """A model by name: `tiny` (random init), a GPT-2 preset, or a checkpoint dir or file.

    A preset is GPT-2's pretrained weights, downloaded once per node; a checkpoint is ours or
    HF's. tokenizer: the data's meta (vocab_size, stop and pad ids). head: None (a GPT), "new" or
    "saved" (a ScalarModel). shard: the script's FSDP2 wrapper (model -> model), under which rank
    0 alone reads (or inits) the weights and broadcasts them into every shard.
    """
    rank = None
    if shard and dist.is_initialized():
        rank = dist.get_rank()
    if rank:
        # No weights read: a model of the header's shapes, on the meta device.
        with torch.device("meta"):
            model = _build(name, tokenizer or {}, head, shapes_only=True)
    else:
        model = _build(name, tokenizer or {}, head, shapes_only=False)
    if rank is None:
        return shard(model) if shard else model
    # Rank 0's full weights, kept past sharding.
    state = {} if rank else model.state_dict()
    model = shard(model)
    if rank:
        # Storage for the shards, in place: the tied wte and lm_head stay one parameter.
        device_type = next(model.parameters()).device_mesh.device_type
        model.to_empty(device=device_type)
    options = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dcp.set_model_state_dict(model, state, options=options)
    return model


def _build(name, tok, head, shapes_only):
    """load()'s model, as one process builds it."""
    tensors = {}
    config = {}
    if name == "tiny":
        model = GPT(GPTConfig(**PRESETS["tiny"], vocab_size=tok["vocab_size"]))
    else:
        tensors, config = _read(name, shapes_only)
        # Ours or HF's names: HF's have no "transformer." prefix.
        sd = {k.removeprefix("transformer."): v for k, v in tensors.items()}
        if "wte.weight" not in sd:
            raise RunError(f"'{name}' is not a GPT-2 checkpoint (no wte.weight)")
        # The sizes are read from the weights' shapes.
        rows, n_embd = sd["wte.weight"].shape
        n_positions = sd["wpe.weight"].shape[0]
        n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("h."))
        # Every GPT-2 size has 64-wide heads.
        n_head = config.get("n_head", n_embd // 64)
        cfg = GPTConfig(
            block_size=n_positions, vocab_size=rows, n_layer=n_layer, n_head=n_head, n_embd=n_embd
        )
        model = GPT(cfg)
        state = {}
        for key in model.state_dict():
            saved_key = TIED.get(key, key).removeprefix("transformer.")
            state[key] = sd[saved_key]
        model.load_state_dict(state)
        # The embedding may have padding rows past the tokenizer's vocabulary, up to the next
        # multiple of 128.
        vocab = tok.get("vocab_size", rows)
        padded_vocab = -(-vocab // 128) * 128
        if not vocab <= rows <= padded_vocab:
            raise RunError(
                f"'{name}' has a {rows}-token vocabulary, the data's tokenizer {vocab}: prep it"
                " with the model's (data.prep --tokenizer) or pass another model"
            )
    model.n_logits = tok.get("vocab_size", model.n_logits)
    # The stop and pad ids: the data's, else the checkpoint's, else GPT-2's.
    for key in ("eos_token_id", "pad_token_id"):
        default = config.get(key, getattr(model.config, key))
        setattr(model.config, key, tok.get(key, default))
    if head == "saved" and "score.weight" not in tensors:
        raise RunError(f"'{name}' has no reward head (score.*): pass a model written by reward.py")
    if head is not None:
        gain = config.get("reward_gain", 1.0)
        bias = config.get("reward_bias", 0.0)
        model = ScalarModel(model, gain, bias)
    if head == "saved":
        score = {k: tensors[f"score.{k}"] for k in ("weight", "bias")}
        model.score.load_state_dict(score)
    return model


def save(model, out_dir, optimizer=None):
    """model.safetensors, config.json (HF layout), optimizer.pt if given; all ranks call it."""
    # The full state, gathered on rank 0 in CPU memory.
    full = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = dcp.get_model_state_dict(model, options=full)
    optim = None
    if optimizer:
        optim = dcp.get_optimizer_state_dict(model, optimizer, options=full)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if k not in TIED}
    # Our config in Hugging Face's GPT2Config names, so that transformers loads the dir.
    config = asdict(model.config)
    block_size = config.pop("block_size")
    config["n_positions"] = block_size
    config["n_ctx"] = block_size
    config.update(
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        tie_word_embeddings=True,
        activation_function="gelu_new",
        bos_token_id=config["eos_token_id"],
    )
    if isinstance(model, ScalarModel):
        config["reward_gain"] = model.reward_gain
        config["reward_bias"] = model.reward_bias
    os.makedirs(out_dir, exist_ok=True)
    weights_path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights_path, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if optimizer:
        torch.save(optim, os.path.join(out_dir, "optimizer.pt"))


def load_weights(model, path, optimizer=None):
    """Load what `save` wrote, plain or FSDP2; optimizer.pt mmapped, so a node shares its pages."""
    tensors, config = _read(path)
    state = {k: tensors[TIED.get(k, k)] for k in model.state_dict()}
    # Under FSDP2, each rank takes its shards from the full tensors.
    options = dcp.StateDictOptions(full_state_dict=dist.is_initialized())
    dcp.set_model_state_dict(model, state, options=options)
    if optimizer:
        optimizer_path = os.path.join(path, "optimizer.pt")
        optim = torch.load(optimizer_path, weights_only=True, mmap=True)
        dcp.set_optimizer_state_dict(model, optimizer, optim, options=options)
    if isinstance(model, ScalarModel):
        model.reward_gain = config["reward_gain"]
        model.reward_bias = config["reward_bias"]


def _read(name, shapes_only=False):
    """(tensors, config dict) of a checkpoint: model.safetensors and the config.json beside it."""
    path = _resolve(name)
    try:
        if shapes_only:
            # The header alone: meta tensors of the saved shapes.
            f = safe_open(path, "pt")
            tensors = {}
            for k in f.keys():
                shape = f.get_slice(k).get_shape()
                tensors[k] = torch.empty(shape, device="meta")
        else:
            tensors = load_file(path)
    # safetensors raises several kinds of error on a truncated or foreign file.
    except Exception as e:
        raise RunError(f"cannot read '{path}' ({e}): it is damaged; save it again") from None
    config_path = os.path.join(os.path.dirname(path), "config.json")
    config = {}
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
    return tensors, config


def _resolve(name):
    """A .safetensors file, its directory, or a preset's weights (local rank 0 downloads them)."""
    path = name
    if os.path.isdir(name):
        path = os.path.join(name, "model.safetensors")
    if os.path.isfile(path):
        return path
    if name not in PRESETS or name == "tiny":
        raise RunError(f"no checkpoint at '{name}': pass a model.safetensors or its directory")
    cache = os.path.expanduser(os.environ.get("GPT2_CACHE", "~/.cache/gpt2_rlhf"))
    path = os.path.join(cache, f"{name}.safetensors")
    if os.environ.get("LOCAL_RANK", "0") == "0" and not os.path.isfile(path):
        os.makedirs(cache, exist_ok=True)
        url = f"https://huggingface.co/{name}/resolve/main/model.safetensors"
        # To a temporary file, then renamed: nodes may share the cache directory.
        try:
            torch.hub.download_url_to_file(url, path, progress=False)
        except OSError as e:
            raise RunError(f"could not download {url} ({e}); offline, pass its directory") from None
    # The node's other ranks wait for its local rank 0.
    if dist.is_initialized():
        dist.barrier()
    return path


# ---- Log-probs of given responses, with their hand-written backward; rewards
def response_mask(response, eos_token_id):
    """(B, T) bool: the response tokens up to and including the first stop token."""
    stops = (response == eos_token_id).int()
    # The stop tokens before this one: none.
    return stops.cumsum(1) - stops == 0


def trim_padding(query, response, pad_token_id, eos_token_id=None):
    """Drop the left-pad columns every query has and the columns past every response's stop."""
    query, response, _, _ = _trim(query, response, pad_token_id, eos_token_id)
    return query, response


def _trim(query, response, pad_token_id, eos_token_id=None):
    """trim_padding's query and response; whether query + response[:, :-1] (the teacher-forced
    input) then holds no padding at all, so that the forward needs no mask; and whether each
    query is padded on the left only and ends in a real token, so that each row's real tokens
    are one run, from which every response token is predicted. One host sync.
    """
    real = query != pad_token_id  # (B, Tq)
    start = real.any(0).int().argmax()
    # No query padding is left if the shortest query fills every column from start on.
    unpadded = real.sum(1).min() + start == query.size(1)
    # No pad after a real token: the response's real tokens, a prefix, then join the query's.
    left_padded = (real[:, 1:] >= real[:, :-1]).all() & real[:, -1].all()
    stats = [start, unpadded, left_padded]
    if eos_token_id is not None:
        lengths = response_mask(response, eos_token_id).sum(1)  # (B,)
        end = lengths.max()
        # The input's response tokens are real if no row stops before column end - 1.
        stats += [end, lengths.min() >= end - 1]
    # One host sync for all.
    stats = torch.stack(stats).tolist()
    query = query[:, stats[0] :]
    contiguous = bool(stats[2])
    if eos_token_id is None:
        return query, response, bool(stats[1]), contiguous
    return query, response[:, : stats[3]], bool(stats[1] and stats[4]), contiguous


def trained_logits(x, y, t, top_k=0, top_p=1.0):
    """fp32 logits x (n, V) / t, -inf outside the tokens top_k and top_p keep and target y (n,)
    keeps; and that set (n, V) bool, or None when both are off.

    The set is generate's (kept_tokens) plus the target: the sampler drew y from its own set,
    but pi_theta, a step or a rounding away, may rank y just outside its own, where its
    log-prob would be -inf and the loss NaN. The set is a selection made from the values of
    the logits: no gradient flows through it.
    """
    scaled = x.float() / t
    if top_k == 0 and top_p == 1.0:
        return scaled, None
    kept = kept_tokens(scaled.detach(), top_k, top_p)
    kept = kept.scatter(1, y[:, None], True)
    return scaled.masked_fill(~kept, -math.inf), kept


def chunk_logprobs(x, y, t, with_entropy, top_k=0, top_p=1.0):
    """log_softmax(x / t) of logits x (n, V) at targets y (n,); the entropy (n,) or None.

    with_entropy "collision": Renyi's entropy of order 2, -log sum_v p_v^2, in place of Shannon's.
    With top_k or top_p, all are of the distribution renormalised over trained_logits' set.
    """
    # generate's formula, so the same bits.
    scaled, kept = trained_logits(x, y, t, top_k, top_p)
    logp = scaled.log_softmax(-1)
    token_logp = logp.gather(1, y[:, None]).squeeze(1)
    if not with_entropy:
        return token_logp, None
    if with_entropy == "collision":
        # WPO's weight alignment; a filtered token's 2 log p is -inf, and counts nothing.
        return token_logp, -torch.logsumexp(2 * logp, -1)
    if kept is None:
        return token_logp, -(logp.exp() * logp).sum(-1)
    p = logp.exp()
    # 0 log 0 = 0 at the filtered tokens, not 0 x -inf.
    logp = logp.masked_fill(~kept, 0)
    return token_logp, -(p * logp).sum(-1)


def chunk_grad(x, y, t, g, g_entropy, top_k=0, top_p=1.0):
    """chunk_logprobs' gradient in x (n, V), for the weights g (n, 1) and g_entropy or None."""
    scaled, kept = trained_logits(x, y, t, top_k, top_p)
    logp = scaled.log_softmax(-1)
    p = logp.exp()
    # d log p_y / dx = (1[y] - p) / t and dH / dx = -p (log p + H) / t, over the kept tokens:
    # a filtered token has p = 0, and so no gradient.
    dx = p * -g
    if g_entropy is not None:
        if kept is not None:
            # 0 log 0 = 0 at the filtered tokens, not 0 x -inf.
            logp = logp.masked_fill(~kept, 0)
        h = -(p * logp).sum(-1, keepdim=True)
        dx -= g_entropy * p * (logp + h)
    return dx.scatter_add_(1, y[:, None], g).div_(t)


@functools.cache
def compiled(fn):
    """fn under torch.compile, made at its first use. On CUDA a chunk's many passes over the
    logits fuse into a few kernels; CPU runs the plain functions, and keeps their bits."""
    return torch.compile(fn, dynamic=True)


class TokenLogProbs(torch.autograd.Function):
    """log_softmax(logits / t) (N, V) at targets (N,) and, if asked, the entropy (N,); with
    top_k or top_p, over the tokens they keep (trained_logits).

    It takes CHUNK logits at a time. Backward writes the gradient over the saved logits, so they
    must be a temporary that nothing else reads.
    """

    # Rows are taken CHUNK // V at a time, so that the chunks' fp32 temporaries stay small.
    CHUNK = 1 << 24

    @staticmethod
    def forward(ctx, logits, target, t, with_entropy, top_k=0, top_p=1.0):
        ctx.save_for_backward(logits, target)
        # An entropy that is only logged gets None in backward, and no gradient work.
        ctx.set_materialize_grads(False)
        ctx.t = t
        ctx.top_k = top_k
        ctx.top_p = top_p
        ctx.with_entropy = with_entropy
        ctx.n = max(1, TokenLogProbs.CHUNK // logits.size(1))
        forward = compiled(chunk_logprobs) if logits.is_cuda else chunk_logprobs
        out = []
        entropy = []
        for x, y in zip(logits.split(ctx.n), target.split(ctx.n)):
            token_logp, token_entropy = forward(x, y, t, with_entropy, top_k, top_p)
            out.append(token_logp)
            entropy.append(token_entropy)
        if not with_entropy:
            return torch.cat(out), None
        return torch.cat(out), torch.cat(entropy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, grad_entropy):
        logits, target = ctx.saved_tensors
        n = ctx.n
        if grad_entropy is not None and ctx.with_entropy == "collision":
            raise RuntimeError("the collision entropy has no gradient here: use it detached")
        if grad is None:
            grad = torch.zeros(len(target), device=logits.device)
        gradient = compiled(chunk_grad) if logits.is_cuda else chunk_grad
        for i, (x, y) in enumerate(zip(logits.split(n), target.split(n))):
            rows = slice(i * n, (i + 1) * n)
            g_entropy = None
            if grad_entropy is not None:
                g_entropy = grad_entropy[rows, None]
            g = grad[rows, None]
            x.copy_(gradient(x, y, ctx.t, g, g_entropy, ctx.top_k, ctx.top_p))
        return logits, None, None, None, None, None


def logprobs(model, query, response, temperature=1.0, entropy=False, top_k=0, top_p=1.0):
    """Log-probs (B, Tr) fp32 of the responses' tokens after left-padded queries.

    They are under logits / temperature, as generate samples them; with them comes the entropy
    (B, Tr) if asked (entropy="collision": -log sum_v p_v^2, not differentiable), else None.
    Both are 0 past each row's stop. The pad and stop ids are model.config's. The logits are
    the one (B, Tr, V) tensor made. top_k and top_p (off: 0 and 1): both are those of the
    distribution renormalised over the tokens generate's filter keeps, and the target
    (trained_logits), so that a policy's ratio compares pi_theta and pi_old on the one
    distribution the sampler drew from (trl#6789: a ratio whose two log-probs are normalised
    over different sets carries the log of the kept mass).
    """
    pad = model.config.pad_token_id
    eos = model.config.eos_token_id
    # Only the columns that matter: no shared left padding, nothing past the last stop.
    query, trimmed, unpadded, contiguous = _trim(query, response, pad, eos)
    mask = response_mask(trimmed, eos)  # (B, Tr')
    # Token t + 1 is predicted at position t.
    inputs = torch.cat([query, trimmed[:, :-1]], 1)
    # With no padding, no mask: the causal kernel (FlashAttention on GPU).
    attention_mask = None
    if not unpadded:
        attention_mask = torch.cat([query != pad, mask[:, :-1]], 1)
    keep_from = query.size(1) - 1
    # Greedy's log-probs (temperature 0) are those of the logits, as in generate.
    t = temperature or 1.0
    packed = model.packing and attention_mask is not None and contiguous
    if packed:
        # The real tokens only; logits (n, V) at the n real response tokens.
        keep = torch.cat([torch.zeros_like(query[:, 1:], dtype=torch.bool), mask], 1)
        logits = model(inputs, attention_mask, packing=pack(attention_mask, keep))
        targets = trimmed[mask].long()
    else:
        # Each row's real tokens are one run if the queries are left-padded only (rolled).
        logits = model(inputs, attention_mask, keep_from=keep_from, contiguous=contiguous)
        logits = logits.flatten(0, 1)  # (B * Tr', V)
        targets = trimmed.flatten().long()
    token_logp, token_entropy = TokenLogProbs.apply(logits, targets, t, entropy, top_k, top_p)

    def as_response(x):
        """(B * Tr',) or (n,) -> (B, Tr): 0 past each row's stop and in the columns trimmed off."""
        if packed:
            x = unpack(x, mask)
        else:
            x = x.view_as(mask).masked_fill(~mask, 0)
        return F.pad(x, (0, response.size(1) - mask.size(1)))

    if token_entropy is None:
        return as_response(token_logp), None
    return as_response(token_logp), as_response(token_entropy)


def get_reward(model, query, response, pad_token_id, eos_token_id):
    """Rewards (B,) of queries + responses: the score at each response's stop token (or last)."""
    mask = response_mask(response, eos_token_id)  # (B, Tr)
    query_response = torch.cat([query, response], 1)
    attention_mask = torch.cat([query != pad_token_id, mask], 1)
    last = mask.sum(1, keepdim=True) - 1  # (B, 1)
    # Packed where there is padding to skip (one host sync).
    if model.packing and not attention_mask.all():
        # Only the last real token of each row is scored: the packed pass returns (B,).
        at_last = torch.zeros_like(mask).scatter_(1, last, True)
        keep = torch.cat([torch.zeros_like(query, dtype=torch.bool), at_last], 1)
        return model(query_response, attention_mask, packing=pack(attention_mask, keep))
    scores = model(query_response, attention_mask, keep_from=query.size(1))  # (B, Tr)
    return scores.gather(1, last).squeeze(1)


# ---- Generation: the fixed-shape decode step, the KV cache and the CUDA graph
class KVCache:
    """Every layer's keys and values, (B, H, S, hd) each, in the compute dtype.

    S is fixed for a whole generation, so a decode step has the same shapes and addresses at
    every token. cols (T,) is a device tensor of the columns the next forward writes, updated in
    place; width is how many columns attention reads. One tensor per layer and kind, written in
    place (not views of one buffer), so that torch.compile updates them without copies.
    """

    def __init__(self, n_layer, size):
        self.n_layer = n_layer
        self.size = size
        self.width = size
        self.cols = None
        self.keys = []
        self.values = []

    def update(self, layer, k, v):
        """Store k, v (B, H, T, hd) at columns cols; return the keys and values of width columns."""
        if not self.keys:
            B, H, _, hd = k.shape
            # Zeros, not garbage: unwritten columns are masked, and 0 * NaN would be NaN.
            self.keys = [k.new_zeros(B, H, self.size, hd) for _ in range(self.n_layer)]
            self.values = [v.new_zeros(B, H, self.size, hd) for _ in range(self.n_layer)]
        self.keys[layer].index_copy_(2, self.cols, k)
        self.values[layer].index_copy_(2, self.cols, v)
        keys = self.keys[layer][:, :, : self.width]
        values = self.values[layer][:, :, : self.width]
        return keys, values

    def repeat_rows(self, prefix, repeats):
        """Fill every column from prefix, a cache of B / repeats rows: each of its rows fills
        `repeats` rows in a row. In place where the tensors exist (a CUDA graph reads them)."""
        keys = [k.repeat_interleave(repeats, 0) for k in prefix.keys]
        values = [v.repeat_interleave(repeats, 0) for v in prefix.values]
        if not self.keys:
            self.keys = keys
            self.values = values
            return
        for mine, new in zip(self.keys + self.values, keys + values):
            mine.copy_(new)


@contextmanager
def unsharded(model):
    """Under FSDP2: the parameters gathered once for a whole generation, the blocks hook-free."""
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.unshard()
    model.hooks = False
    try:
        yield
    finally:
        model.hooks = True
        for m in fsdp:
            m.reshard()


def kept_tokens(logits, top_k=0, top_p=1.0):
    """(B, V) bool: the tokens that top-k, then top-p (nucleus) sampling keep of logits (B, V).

    top-k keeps the k largest logits; top-p then the fewest largest-probability tokens whose
    mass, under softmax over the tokens top-k kept, reaches top_p (Holtzman et al. 2020), as
    Hugging Face's warpers and vLLM chain them. The most likely token is always kept. Equal
    logits are ranked by token id, so the set is the same on every call. Call it on logits
    already divided by the temperature, as both libraries filter after it.
    """
    V = logits.size(-1)
    # Descending; stable, so that equal logits keep their id order.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    dropped = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k > 0:
        rank = torch.arange(V, device=logits.device)
        dropped = (rank >= top_k).expand_as(sorted_logits)
    if top_p < 1.0:
        probs = sorted_logits.masked_fill(dropped, -math.inf).softmax(-1)
        # The mass of the tokens ranked before each one: 0 for the first, which stays.
        before = probs.cumsum(-1) - probs
        dropped = dropped | (before >= top_p)
    kept = torch.empty_like(sorted_logits, dtype=torch.bool)
    return kept.scatter_(-1, order, ~dropped)


def sampling_logits(logits, temperature, top_k=0, top_p=1.0):
    """fp32 logits (B, V) / temperature, and -inf at the tokens top_k and top_p filter out.

    Their softmax is the distribution generate samples from: the kept tokens' probabilities,
    renormalised over the kept set. top_k 0 and top_p 1 are off, and leave the bits as they were.
    """
    scaled = logits.float() / temperature
    if top_k == 0 and top_p == 1.0:
        return scaled
    return scaled.masked_fill(~kept_tokens(scaled, top_k, top_p), -math.inf)


def sample_token(logits, u, temperature=1.0, top_k=0, top_p=1.0):
    """Next token (B,) from logits (B, V): greedy at temperature 0, else inverse CDF at u (B,)
    over softmax(logits / temperature), renormalised over the tokens top_k and top_p keep."""
    if temperature == 0.0:
        return logits.argmax(-1)
    scaled = sampling_logits(logits, temperature, top_k, top_p)
    filtered = top_k > 0 or top_p < 1.0
    return inverse_cdf(scaled, u, filtered)


def inverse_cdf(scaled, u, filtered):
    """The token (B,) at which the cdf of softmax(scaled (B, V)) passes u (B,) times its end.

    filtered: some of scaled are -inf (sampling_logits with top_k or top_p).
    """
    probs = scaled.softmax(-1)
    cdf = probs.cumsum(-1)
    # u scaled to the cdf's last value, which rounding keeps from being exactly 1.
    threshold = (u * cdf[:, -1])[:, None]  # (B, 1)
    token = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    if not filtered:
        # A threshold equal to the last value finds no value above it: V, one past the last id.
        return token.clamp(max=scaled.size(-1) - 1)
    # There, the last token with mass instead: the first at which the cdf reaches its end. A
    # filtered token's probability is 0, so the cdf never rises at one, and none is drawn.
    end = cdf[:, -1:].contiguous()  # (B, 1)
    last = torch.searchsorted(cdf, end).squeeze(-1)
    return torch.minimum(token, last)


class Rollout(NamedTuple):
    query: torch.Tensor  # (B, Tq) the prompts, less the left-pad columns they all share
    response: torch.Tensor  # (B, Tr) pad after the first stop token
    mask: torch.Tensor  # (B, Tr) bool: response tokens up to and including the stop token
    logprobs: torch.Tensor  # (B, Tr) of sampling_logits' softmax, 0 past the stop


@dataclass
class Decoding:
    """A generation's state on the device. Every tensor keeps its shape and address and is
    updated in place, so that a decode step is the same computation at every token: what a
    CUDA graph or torch.compile needs. Nothing in it is read by the host but done."""

    cache: KVCache
    token: torch.Tensor  # (B, 1) the token fed next
    pos: torch.Tensor  # (B, 1) its position: the count of real tokens before it
    col: torch.Tensor  # (1,) its column in the cache
    t: torch.Tensor  # (1,) the response index sampled next
    real: torch.Tensor  # (B, S) bool: the cache columns that hold a real token
    done: torch.Tensor  # (B,) bool: the rows past their stop token
    noise: torch.Tensor  # (B, n) the uniforms the sampler inverts
    response: torch.Tensor  # (B, n)
    logprobs: torch.Tensor  # (B, n)
    pad: int
    eos: int | None
    temperature: float
    top_k: int
    top_p: float


def new_decoding(model, noise, size, pad, eos, temperature, dtype, top_k=0, top_p=1.0):
    """A Decoding for noise's (B, n) shape, device and dtype, with size cache columns."""
    B, n = noise.shape
    device = noise.device
    cache = KVCache(model.config.n_layer, size)
    index = torch.zeros(B, 1, dtype=torch.long, device=device)
    return Decoding(
        cache=cache,
        token=index.clone(),
        pos=index.clone(),
        col=torch.zeros(1, dtype=torch.long, device=device),
        t=torch.zeros(1, dtype=torch.long, device=device),
        real=torch.zeros(B, size, dtype=torch.bool, device=device),
        done=torch.zeros(B, dtype=torch.bool, device=device),
        noise=noise.new_zeros(B, n),
        response=torch.full((B, n), pad, dtype=dtype, device=device),
        logprobs=torch.zeros(B, n, device=device),
        pad=pad,
        eos=eos,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )


def sample(s: Decoding, logits):
    """Sample response token s.t from logits (B, V); record it, its log-prob and the stops."""
    u = s.noise.index_select(1, s.t).squeeze(1)  # (B,)
    # One filter for the token and its log-prob. Greedy's log-probs (temperature 0) are those
    # of the logits themselves, filtered alike.
    scaled = sampling_logits(logits, s.temperature or 1.0, s.top_k, s.top_p)
    if s.temperature == 0.0:
        token = logits.argmax(-1)
    else:
        filtered = s.top_k > 0 or s.top_p < 1.0
        token = inverse_cdf(scaled, u, filtered)
    # The log-prob under the distribution sampled: renormalised over the kept tokens.
    logp = torch.log_softmax(scaled, -1)
    token_logp = logp.gather(-1, token[:, None])  # (B, 1)
    # A row that has stopped gets padding, and log-prob 0.
    response = torch.where(s.done, s.pad, token).to(s.response.dtype)
    s.response.index_copy_(1, s.t, response[:, None])
    s.logprobs.index_copy_(1, s.t, token_logp.masked_fill(s.done[:, None], 0))
    if s.eos is not None:
        s.done |= token == s.eos
    s.token.copy_(token[:, None])
    s.t += 1


def decode_step(model, s: Decoding):
    """Feed every row's last token, sample the next: fixed shapes, in place, no host sync.

    The same Python runs eagerly, under torch.compile, or captured once in a CUDA graph.
    """
    # The token fed now is real: its column joins the attention mask.
    s.real.index_fill_(1, s.col, True)
    attn_mask = s.real[:, None, None, : s.cache.width]  # (B, 1, 1, S)
    # The prefill wrote columns 0..Tq-1; a step writes the one column of its token.
    s.cache.cols = s.col
    logits = model.decode(s.token, s.pos, attn_mask, s.cache)  # (B, V)
    s.pos += 1
    s.col += 1
    sample(s, logits)


# The decode steps captured in CUDA graphs, per model and per shape.
GRAPHS = weakref.WeakKeyDictionary()


def captured_step(model, s: Decoding):
    """The decode step of a state like s captured in a CUDA graph, with the state it reads and
    writes: cached per model and shape (a cached one replaces s).

    The graph reads the weights where they were at capture. An optimizer step updates them in
    place, at the same addresses, so later replays read the new values; the autocast casts are
    captured too (the cache off), so they are redone from the new weights at every replay.
    Weights that moved (`.to()`, an FSDP2 gather into new storage) give a new capture.
    """
    autocast_dtype = None
    if torch.is_autocast_enabled("cuda"):
        autocast_dtype = torch.get_autocast_dtype("cuda")
    B, size = s.real.shape
    n = s.noise.size(1)
    dtypes = (s.noise.dtype, s.response.dtype, autocast_dtype)
    # The sampler's settings are constants of the captured kernels.
    sampler = (s.temperature, s.top_k, s.top_p)
    shape = (B, size, n, s.pad, s.eos, sampler, dtypes)
    weights = [p.data_ptr() for p in model.parameters()]
    graphs = GRAPHS.setdefault(model, {})
    if shape in graphs and graphs[shape][0] == weights:
        return graphs[shape][1:]
    s.cache.width = size
    # A cast cached outside the graph would be freed while the graph still reads it.
    no_cache = torch.autocast(
        "cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None, cache_enabled=False
    )
    # One eager step first, on a side stream (torch's advice): it allocates the KV cache and
    # initialises the libraries. Its writes are junk that each call's reset overwrites.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), no_cache:
        decode_step(model, s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Capture records the kernels and runs none of them.
    with torch.cuda.graph(graph), no_cache:
        decode_step(model, s)
    graphs[shape] = (weights, graph, s)
    return graph, s


@torch.no_grad()
def generate(
    model,
    query,
    pad_token_id,
    max_new_tokens,
    eos_token_id=None,
    temperature=1.0,
    noise=None,
    cuda_graph=False,
    top_k=0,
    top_p=1.0,
    group_size=1,
) -> Rollout:
    """Sample responses (B, max_new_tokens) to left-padded queries (B, Tq) with a KV cache.

    noise: the (B, max_new_tokens) uniforms the sampler inverts; the scripts pass a slice of one
    global tensor, so that N ranks sample as one. cuda_graph: on CUDA, replay the decode step
    from a CUDA graph, captured at the first call of each shape. Off by default until a GPU run
    has checked it (tests/test_decode.py's CUDA test, docs/gpu.md). top_k (0: off) and top_p
    (1: off): sample from the tokens kept_tokens keeps, renormalised; the log-probs recorded
    are those of that distribution. group_size: the rows come in groups of this many equal
    queries (GRPO's samples of one prompt); the prefill runs once per group, and the group's
    rows start from copies of its keys and values.
    """
    if group_size < 1:
        raise ValueError(f"group_size {group_size}: must be >= 1 (1: no groups)")
    query, _, unpadded, _ = _trim(query, None, pad_token_id)
    B, Tq = query.shape
    firsts = query[::group_size]  # (B / group_size, Tq)
    if group_size > 1:
        # torch.equal waits for the device: only where there are groups to check. Unequal
        # shapes (B not a multiple) are unequal too.
        grouped = firsts.repeat_interleave(group_size, 0)
        if not torch.equal(query, grouped):
            raise ValueError(f"group_size {group_size}: the rows are not groups of equal queries")
    n = max_new_tokens
    device = query.device
    if Tq + n > model.config.block_size:
        raise ValueError(f"{Tq + n} tokens exceed the context of {model.config.block_size}")
    if noise is None:
        noise = torch.rand(B, n, device=device)
    # Only the first n columns are read, should the caller's noise be wider.
    noise = noise[:, :n]
    real = query != pad_token_id  # (B, Tq)
    # The cache's columns. On GPU, rounded up to a multiple of 64, so that few shapes occur and
    # few graphs are captured. A CPU step runs eagerly, where shapes cost nothing, and zeroing or
    # striding over unused columns would: no rounding there.
    multiple = 64 if device.type == "cuda" else 1
    size = -(-(Tq + n) // multiple) * multiple
    s = new_decoding(
        model,
        noise=noise,
        size=size,
        pad=pad_token_id,
        eos=eos_token_id,
        temperature=temperature,
        dtype=query.dtype,
        top_k=top_k,
        top_p=top_p,
    )
    graph = None
    with unsharded(model):
        if cuda_graph and device.type == "cuda":
            graph, s = captured_step(model, s)
        # The state of this call, written in place.
        s.real.zero_()
        s.real[:, :Tq] = real
        s.pos.copy_(real.sum(1, keepdim=True))
        s.col.fill_(Tq)
        s.t.zero_()
        s.done.zero_()
        s.noise.copy_(noise)
        s.response.fill_(pad_token_id)
        s.logprobs.zero_()
        # The whole query at once: its keys and values, and the first token.
        attention_mask = None if unpadded else real
        if group_size == 1:
            logits = model(query, attention_mask, s.cache, keep_from=Tq - 1)[:, -1]  # (B, V)
        else:
            # One row per group through the model, then its keys, values and logits copied.
            # A row's results do not depend on the batch's other rows, but for round-off where
            # the GEMM library picks its kernel by the row count (cpu_matmul's oneDNN).
            prefix = KVCache(model.config.n_layer, size)
            if attention_mask is not None:
                attention_mask = attention_mask[::group_size]
            logits = model(firsts, attention_mask, prefix, keep_from=Tq - 1)[:, -1]
            logits = logits.repeat_interleave(group_size, 0)  # (B, V)
            s.cache.repeat_rows(prefix, group_size)
        sample(s, logits)
        for t in range(1, n):
            if graph is not None:
                graph.replay()
            else:
                # On CPU attention reads the live columns only: the CPU kernel's sums depend
                # on the column count, and this count keeps the bits of the generate this
                # step replaced. Elsewhere all columns, as the graph does: they compare bitwise.
                s.cache.width = Tq + t if device.type == "cpu" else size
                decode_step(model, s)
            # done.all() syncs with the host: free on CPU, so every step; on GPU every 8.
            check = device.type == "cpu" or t % 8 == 7
            if eos_token_id is not None and check and s.done.all():
                break
    response = s.response
    logprobs = s.logprobs
    if graph is not None:
        # The next call writes into the same buffers.
        response = response.clone()
        logprobs = logprobs.clone()
    # With no stop token, every response token counts: -1 is no token.
    stop = -1 if eos_token_id is None else eos_token_id
    mask = response_mask(response, stop)
    return Rollout(query=query, response=response, mask=mask, logprobs=logprobs)


# ---- GPU paths off by default: rolled padding and the mixed LM head
# Each is tested on CPU and stays off until a GPU run shows that it pays: docs/gpu.md says what
# that run must show. The third, the CUDA graph of the decode step, is generation's.
def roll_padding_devices():
    """The device types GPT2_ROLL_PADDING names, read when a model is built: none by default.

    On them, rows padded only before and after their real tokens are rolled so that their pads
    trail, for the causal kernel with no mask (FlashAttention on GPU). The real tokens' logits are
    the same up to rounding: attention sums the same keys at other offsets, and the weight
    gradients sum the rows in another order. CPU runs, where it does not pay, keep the masked path
    and its bits. Off until a GPU run has measured that it pays (docs/gpu.md):
    GPT2_ROLL_PADDING=cuda rolls on GPU, =cpu,cuda on both.
    """
    return os.environ.get("GPT2_ROLL_PADDING", "none").split(",")


def rolls_padding(model, idx, attention_mask):
    """Whether forward rolls rows of idx (rolled): a mask to roll by, on a device that
    GPT2_ROLL_PADDING names (model.roll_padding)."""
    return attention_mask is not None and idx.device.type in model.roll_padding


def rolled(model, idx, attention_mask, keep_from):
    """forward's blocks' output (B, T', C) at columns keep_from.. of rows whose real tokens are
    one run each, from the causal kernel with no mask.

    Each row is rolled left by its count of leading pads, so that every pad trails: a real
    token then sees the real tokens before it, at their positions, and no pad. The blocks'
    output is rolled back before the head.
    """
    T = idx.size(1)
    # Positions count the real tokens only, as padded's do.
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    # An all-pad row has no first real token: argmax gives 0, and it is not rolled.
    lead = attention_mask.int().argmax(1, keepdim=True)  # (B, 1)
    cols = torch.arange(T, device=idx.device)
    take = (cols + lead) % T  # (B, T)
    give_back = (cols - lead) % T  # (B, T)
    rolled_idx = idx.gather(1, take)
    rolled_positions = positions.gather(1, take)
    x = model.body(rolled_idx, rolled_positions)
    # Only the kept columns are taken back.
    order = give_back[:, keep_from:, None].expand(-1, -1, x.size(-1))
    return x.gather(1, order)


def under_cuda_bf16_autocast(x):
    """Whether x is on CUDA under bf16 autocast: the mixed head's case. Elsewhere it is fp32."""
    cuda_bf16 = x.is_cuda and torch.get_autocast_dtype("cuda") == torch.bfloat16
    return cuda_bf16 and torch.is_autocast_enabled("cuda")


def mixed_logits(x, w):
    """The logits (..., V) of x (..., C) and the head's w (V, C) by MixedHead: GPT2_HEAD=mixed."""
    with torch.autocast(x.device.type, enabled=False):
        logits = MixedHead.apply(x.flatten(0, -2), w)
        return logits.view(*x.shape[:-1], -1)


def mm_fp32(a, b):
    """a @ b of bf16 operands, summed and returned in fp32: tensor cores on CUDA.

    No CPU kernel has this signature; on CPU (the tests) the operands widened to fp32 give the
    same product.
    """
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class MixedHead(torch.autograd.Function):
    """x (N, C) @ w (V, C).T from bf16 operands, with fp32 sums and logits: GPT2_HEAD=mixed.

    The operands' rounding is the same for the sampler and the trainer; the fp32 logits keep the
    bits that bf16 logits would lose. Inside the GEMMs w has zero rows up to a multiple of 128,
    which keeps them on aligned tensor-core tiles; the logits are sliced back to V.
    """

    @staticmethod
    def forward(ctx, x, w):
        V, C = w.shape
        w_bf16 = w.new_zeros(V + -V % 128, C, dtype=torch.bfloat16)
        w_bf16[:V] = w
        x_bf16 = x.to(torch.bfloat16)
        ctx.save_for_backward(x_bf16, w_bf16)
        return mm_fp32(x_bf16, w_bf16.t())[:, :V]

    @staticmethod
    def backward(ctx, g):  # g (N, V) fp32
        x_bf16, w_bf16 = ctx.saved_tensors
        V = g.size(1)
        # The gradient in bf16, with zero columns for w's zero rows.
        g_bf16 = F.pad(g.to(torch.bfloat16), (0, len(w_bf16) - V))
        gx = None
        gw = None
        if ctx.needs_input_grad[0]:
            gx = mm_fp32(g_bf16, w_bf16)
        if ctx.needs_input_grad[1]:
            gw = mm_fp32(g_bf16.t(), x_bf16)[:V]
        return gx, gw


# ---- CPU speed: the fp32 GEMM library and the allocator (nothing here runs on GPU)
# torch sends fp32 CPU GEMMs to MKL, which takes a slow generic path on AMD CPUs; oneDNN (also
# in torch) does not (docs/benchmarks.md).
# oneDNN's fixed cost per call loses on GEMMs with few weights and few rows, such as a
# decode step of the tiny model.
ONEDNN_MIN_WEIGHTS = 1 << 18
ONEDNN_MIN_ROWS = 512


@functools.cache
def amd_cpu():
    """Whether this machine's CPU is AMD's: read once, when the first model is built."""
    if not os.path.isfile("/proc/cpuinfo"):
        return False
    with open("/proc/cpuinfo") as f:
        return "AuthenticAMD" in f.read()


def cpu_gemm():
    """The library of a model's fp32 CPU GEMMs, read when it is built: "onednn" or "mkl".

    oneDNN on AMD CPUs, MKL elsewhere; GPT2_CPU_GEMM=mkl|onednn overrides the choice. MKL where
    this torch has no oneDNN.
    """
    choice = os.environ.get("GPT2_CPU_GEMM") or ("onednn" if amd_cpu() else "mkl")
    if choice == "onednn" and torch.backends.mkldnn.is_available():
        return "onednn"
    return "mkl"


def bind_cpu_gemms(model):
    """Route the GEMMs of model's Conv1Ds and LM head through cpu_matmul, if cpu_gemm() is oneDNN.

    Bound once, when the model is built: a forward then makes no choice of library, only
    cpu_matmul's choice of oneDNN or torch by device, rows, dtype and compile state.
    """
    if cpu_gemm() != "onednn":
        return
    for m in model.modules():
        if isinstance(m, (Conv1D, GPT)):
            m.gemm = cpu_matmul


def cpu_matmul(x, w, b=None, out_in=False):
    """matmul, on oneDNN where it pays: a CPU GEMM, fp32, eager, and big enough."""
    if x.is_cuda:
        return matmul(x, w, b, out_in)
    rows = x.numel() // x.size(-1)
    big = w.numel() >= ONEDNN_MIN_WEIGHTS or rows >= ONEDNN_MIN_ROWS
    fp32 = x.dtype == w.dtype == torch.float32
    # Autocast and torch.compile know torch's GEMMs, not the custom Function below.
    eager = not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
    if not (fp32 and big and eager):
        return matmul(x, w, b, out_in)
    x_2d = x.reshape(rows, x.size(-1))
    # Under no_grad (decoding), apply records no graph.
    y = OneDNNMatmul.apply(x_2d, w, b, out_in)
    # Reshaped as torch.matmul does, not as a view: FSDP2 warns when a module returns a view.
    out_shape = (*x.shape[:-1], y.size(-1))
    return torch.ops.aten._unsafe_view(y, out_shape)


def _onednn(x, w, b=None):
    """x (M, in) @ w.T + b for w (out, in), on oneDNN.

    The op is looked up when called, not at import: not every torch build has oneDNN.
    """
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


class OneDNNMatmul(torch.autograd.Function):
    """matmul on oneDNN, forward and input gradient; the weight gradient is as fast on MKL."""

    @staticmethod
    def forward(ctx, x, w, b, out_in):
        ctx.save_for_backward(x, w)
        ctx.out_in = out_in
        # oneDNN takes the weight as (out, in).
        w_out_in = w if out_in else w.t()
        return _onednn(x, w_out_in, b)

    @staticmethod
    def backward(ctx, g):  # g (M, out)
        x, w = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        gx = None
        gw = None
        gb = None
        if need_x:
            # The input's gradient g @ w.T for w (in, out), or g @ w for w (out, in).
            w_in_out = w.t() if ctx.out_in else w
            gx = _onednn(g, w_in_out)
        if need_w:
            gw = g.t() @ x if ctx.out_in else x.t() @ g
        if need_b:
            gb = g.sum(0)
        return gx, gw, gb, None


def keep_freed_memory():
    """Keep freed multi-MB buffers in the process: glibc unmaps them and faults them in again."""
    # The process's own C library; mallopt is glibc's.
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):
        return
    # M_MMAP_THRESHOLD: buffers below 32 MiB come from the heap.
    libc.mallopt(-3, 32 << 20)
    # M_TRIM_THRESHOLD: up to 1 GiB of freed heap stays in the process.
    libc.mallopt(-1, 1 << 30)
