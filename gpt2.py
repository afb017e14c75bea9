"""GPT-2 from scratch for RLHF (Radford et al. 2019): the model every algorithm file shares, in
GPT-2's own module names and (in, out) layout, so weights move to and from Hugging Face as they are.
Beyond nanoGPT: positions from the attention mask (left padding changes no logit), KV-cache
generation, chunked log-probs, scalar heads, and load/save of plain or FSDP2-sharded models."""

import ctypes
import json
import math
import os
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


class RunError(SystemExit):
    """A problem the user can fix (a flag, a file): one line on rank 0, exit status 1, no trace."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}" if os.environ.get("RANK", "0") == "0" else 1)


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


PRESETS = {
    "tiny": dict(block_size=64, n_layer=4, n_head=4, n_embd=128),  # the offline default
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# bf16 logits lose the bits that tell the sampler's log-probs from the trainer's (MiniMax-M1's
# train/inference mismatch): ln_f and the heads run in fp32 unless GPT2_FP32_HEAD=0.
FP32_HEAD = os.environ.get("GPT2_FP32_HEAD", "1") != "0"
# cuDNN's SDPA backward can return NaN with a mask when T % 128 == 64 (pytorch#196678)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# ---- Model
class LayerCache:
    """One layer's keys and values (2, B, H, max_len, hd), allocated in the compute dtype."""

    def __init__(self, max_len):
        self.max_len, self.kv = max_len, None

    def update(self, k, v, pos):
        if self.kv is None:
            self.kv = k.new_empty(2, *k.shape[:2], self.max_len, k.shape[3])
        end = pos + k.size(2)
        self.kv[0, :, :, pos:end], self.kv[1, :, :, pos:end] = k, v
        return self.kv[0, :, :, :end], self.kv[1, :, :, :end]


class Conv1D(nn.Module):
    """y = x @ weight + bias, weight (in, out): GPT-2's layout, faster for decoding on CPU."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):  # (..., in) -> (..., out)
        return matmul(x, self.weight, self.bias)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        C, eps, self.n_head = cfg.n_embd, cfg.layer_norm_epsilon, cfg.n_head
        self.ln_1 = nn.LayerNorm(C, eps=eps)
        self.attn = nn.ModuleDict(dict(c_attn=Conv1D(C, 3 * C), c_proj=Conv1D(C, C)))
        self.ln_2 = nn.LayerNorm(C, eps=eps)
        self.mlp = nn.ModuleDict(dict(c_fc=Conv1D(C, 4 * C), c_proj=Conv1D(4 * C, C)))

    def forward(self, x, attn_mask, kv_cache=None, pos=0):
        B, T, C = x.shape
        qkv = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in qkv)  # (B, H, T, hd)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v, pos)
        with sdpa_kernel(SDPA_BACKENDS):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=attn_mask is None)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")  # GPT-2's gelu_new
        return x + self.mlp.c_proj(h)


class GPT(nn.Module):
    hooks = True  # False inside `unsharded`: the blocks are called without FSDP2's hooks

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config, C, eps = cfg, cfg.n_embd, cfg.layer_norm_epsilon
        self.activation_checkpointing = False  # recompute blocks in backward: less memory
        wte, wpe = nn.Embedding(cfg.vocab_size, C), nn.Embedding(cfg.block_size, C)
        h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.transformer = nn.ModuleDict(dict(wte=wte, wpe=wpe, h=h, ln_f=nn.LayerNorm(C, eps=eps)))
        self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)
        self.lm_head.weight = wte.weight  # tied, as in GPT-2
        self.n_logits = cfg.vocab_size  # the tokenizer's: padding rows are never sampled
        self.fp32_head = FP32_HEAD
        for m in self.modules():  # GPT-2's init; the biases are zeros already
            if isinstance(m, (nn.Linear, Conv1D, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: residual projections get 1/sqrt(2 L)
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx, attention_mask=None, kv_cache=None, hidden=False, keep_from=0):
        """idx (B, T), attention_mask (B, pos + T) after pos cached steps (None: no padding) -> the
        logits (B, T', V) or hidden states of positions keep_from.. (no dropout: RL needs them)."""
        (B, T), device = idx.shape, idx.device
        pos = 0 if attention_mask is None else attention_mask.size(1) - T
        if pos + T > self.config.block_size:
            raise ValueError(f"{pos + T} tokens exceed block_size {self.config.block_size}")
        if attention_mask is None or (pos == 0 and bool(attention_mask.all())):  # causal kernel
            position_ids, attn_mask = torch.arange(T, device=device).expand(B, T), None
        else:  # positions count real tokens, so left padding changes nothing
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            q_idx = torch.arange(pos, pos + T, device=device)[:, None]  # (T, 1)
            k_idx = torch.arange(pos + T, device=device)[None, :]  # (1, S)
            real = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
            # causal, not padding, and always itself: a pad row is never all -inf (NaN in SDPA)
            attn_mask = ((k_idx <= q_idx) & real) | (k_idx == q_idx)  # (B, 1, T, S)
        x = self.transformer.wte(idx) + self.transformer.wpe(position_ids)
        for block, cache in zip(self.transformer.h, kv_cache or [None] * len(self.transformer.h)):
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, attn_mask, cache, pos, use_reentrant=False)
            elif not self.hooks:  # as FSDP2 would, in the blocks' dtype
                x = block.forward(x.to(block.ln_1.weight.dtype), attn_mask, cache, pos)
            else:
                x = block(x, attn_mask, cache, pos)
        x = self.transformer.ln_f(x[:, keep_from:].float() if self.fp32_head else x[:, keep_from:])
        return x if hidden else self.logits(x)

    def logits(self, x):  # (..., C) -> (..., n_logits)
        w = self.lm_head.weight[: self.n_logits]
        if not self.fp32_head:
            return matmul(x, w, out_in=True)
        with torch.autocast(x.device.type, enabled=False):
            return matmul(x.float(), w.float(), out_in=True)


class ScalarModel(GPT):
    """GPT-2 with a scalar head (reward, value): gain * score(h) + bias, gain and bias set by reward
    normalisation and kept in config.json; its state dict is GPT-2's plus `score.*`."""

    def __init__(self, backbone: GPT, gain: float = 1.0, bias: float = 0.0):
        nn.Module.__init__(self)  # GPT.__init__ would build a second backbone
        for key in ("config", "n_logits", "fp32_head", "activation_checkpointing"):
            setattr(self, key, getattr(backbone, key))
        self.transformer, self.lm_head = backbone.transformer, backbone.lm_head  # lm_head unused
        self.score = nn.Linear(self.config.n_embd, 1)
        # lm-human-preferences: N(0, 1/sqrt(n_embd + 1)), so the first scores have unit scale
        nn.init.normal_(self.score.weight, std=1 / math.sqrt(self.config.n_embd + 1))
        nn.init.zeros_(self.score.bias)
        self.reward_gain, self.reward_bias = gain, bias

    def forward(self, query_response, attention_mask, keep_from=0):
        h = super().forward(query_response, attention_mask, hidden=True, keep_from=keep_from)
        w, b = self.score.weight.float(), self.score.bias.float()
        with torch.autocast(h.device.type, enabled=False):  # scores in fp32, as the logits
            return F.linear(h.float(), w, b).squeeze(-1) * self.reward_gain + self.reward_bias


def get_reward(model, query, response, pad_token_id, eos_token_id):
    """Rewards (B,) of queries + responses: the score at each response's stop token (or last)."""
    mask = response_mask(response, eos_token_id)  # (B, Tr)
    attention_mask = torch.cat([query != pad_token_id, mask], 1)
    scores = model(torch.cat([query, response], 1), attention_mask, keep_from=query.size(1))
    return scores.gather(1, mask.sum(1, keepdim=True) - 1).squeeze(1)


# ---- Generation, its masks, and the log-probs of given responses (for training)
def response_mask(response, eos_token_id):
    """(B, T) bool: the response tokens up to and including the first stop token."""
    stops = (response == eos_token_id).int()
    return stops.cumsum(1) - stops == 0  # no stop token before this one


def trim_padding(query, response, pad_token_id, eos_token_id=None):
    """Drop the left-pad columns every query has and the columns past every response's stop."""
    start = (query != pad_token_id).any(0).int().argmax()
    if eos_token_id is None:
        return query[:, int(start) :], response
    end = response_mask(response, eos_token_id).sum(1).max()
    start, end = torch.stack([start, end]).tolist()  # one host sync for both
    return query[:, start:], response[:, :end]


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


def sample_token(logits, u, temperature=1.0):
    """Next token (B,) from logits (B, V): greedy at temperature 0, else inverse CDF at u (B,)."""
    if temperature == 0.0:
        return logits.argmax(-1)
    cdf = (logits.float() / temperature).softmax(-1).cumsum(-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return token.clamp(max=logits.size(-1) - 1)


class Rollout(NamedTuple):
    query: torch.Tensor  # (B, Tq) the prompts, less the left-pad columns they all share
    response: torch.Tensor  # (B, Tr) pad after the first stop token
    mask: torch.Tensor  # (B, Tr) bool: response tokens up to and including the stop token
    logprobs: torch.Tensor  # (B, Tr) under logits / temperature, 0 past the stop


@torch.no_grad()
def generate(
    model, query, pad_token_id, max_new_tokens, eos_token_id=None, temperature=1.0, noise=None
) -> Rollout:
    """Sample responses (B, max_new_tokens) to left-padded queries (B, Tq) with a KV cache. noise:
    the (B, max_new_tokens) uniforms, a slice of one global tensor, so N ranks sample as one."""
    query = trim_padding(query, None, pad_token_id)[0]
    (B, Tq), device, total = query.shape, query.device, query.size(1) + max_new_tokens
    if total > model.config.block_size:
        raise ValueError(f"{total} tokens exceed the context of {model.config.block_size}")
    noise = torch.rand(B, max_new_tokens, device=device) if noise is None else noise
    mask = F.pad(query != pad_token_id, (0, max_new_tokens), value=True)  # responses: all seen
    response = torch.full((B, max_new_tokens), pad_token_id, dtype=query.dtype, device=device)
    logprobs = torch.zeros(B, max_new_tokens, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    with unsharded(model):
        kv, inputs = [LayerCache(total) for _ in range(model.config.n_layer)], query
        for t in range(max_new_tokens):
            logits = model(inputs, mask[:, : Tq + t], kv, keep_from=inputs.size(1) - 1)[:, -1]
            token = sample_token(logits, noise[:, t], temperature)
            response[:, t] = torch.where(done, pad_token_id, token)
            logp = torch.log_softmax(logits.float() / (temperature or 1.0), -1)
            logprobs[:, t] = logp.gather(-1, token[:, None]).squeeze(-1).masked_fill(done, 0)
            if eos_token_id is not None:
                done |= token == eos_token_id
                # a host sync: every step on CPU, where it is free, every 8 steps on GPU
                if (device.type == "cpu" or t % 8 == 7) and done.all():
                    break
            inputs = token[:, None]
    mask = response_mask(response, -1 if eos_token_id is None else eos_token_id)
    return Rollout(query, response, mask, logprobs)


class TokenLogProbs(torch.autograd.Function):
    """log_softmax(logits / t) (N, V) at targets (N,) and, if asked, the entropy (N,), CHUNK logits
    at a time; backward writes the gradient over the saved logits, so they must be a temporary."""

    CHUNK = 1 << 24  # the chunks' fp32 temporaries stay small

    @staticmethod
    def forward(ctx, logits, target, t, with_entropy):
        ctx.save_for_backward(logits, target)
        ctx.set_materialize_grads(False)  # an entropy only logged gets no gradient work
        ctx.t, ctx.n, out, entropy = t, max(1, TokenLogProbs.CHUNK // logits.size(1)), [], []
        for x, y in zip(logits.split(ctx.n), target.split(ctx.n)):
            logp = (x.float() / t).log_softmax(-1)  # generate's formula: the same bits
            out.append(logp.gather(1, y[:, None]).squeeze(1))
            entropy += [-(logp.exp() * logp).sum(-1)] if with_entropy else []
        return torch.cat(out), torch.cat(entropy) if with_entropy else None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, grad_entropy):
        (logits, target), n = ctx.saved_tensors, ctx.n
        grad = torch.zeros(len(target), device=logits.device) if grad is None else grad
        for i, (x, y) in enumerate(zip(logits.split(n), target.split(n))):
            logp, g = (x.float() / ctx.t).log_softmax(-1), grad[i * n : (i + 1) * n, None]
            # d log p_y / dx = (1[y] - p) / t and dH / dx = -p (log p + H) / t
            dx = logp.exp().mul_(-g)
            if grad_entropy is not None:
                h = -(logp.exp() * logp).sum(-1, keepdim=True)
                dx -= grad_entropy[i * n : (i + 1) * n, None] * logp.exp() * (logp + h)
            x.copy_(dx.scatter_add_(1, y[:, None], g).div_(ctx.t))
        return logits, None, None, None


def logprobs(model, query, response, temperature=1.0, entropy=False):
    """Log-probs (B, Tr) fp32 of the responses' tokens after left-padded queries under logits /
    temperature, as generate samples them, and if asked the entropy (B, Tr), else None; 0 past
    each row's stop. Pad and stop ids are model.config's; the logits are the one (B, Tr, V) made."""
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    query, trimmed = trim_padding(query, response, pad, eos)  # the columns that matter
    mask = response_mask(trimmed, eos)  # (B, Tr')
    inputs = torch.cat([query, trimmed[:, :-1]], 1)  # token t + 1 is predicted at position t
    attention_mask = torch.cat([query != pad, mask[:, :-1]], 1)
    logits = model(inputs, attention_mask, keep_from=query.size(1) - 1)  # (B, Tr', V)
    t = temperature or 1.0  # greedy's: generate's convention
    out = TokenLogProbs.apply(logits.flatten(0, 1), trimmed.flatten().long(), t, entropy)
    pad_to = (0, response.size(1) - mask.size(1))
    widen = lambda x: F.pad(x.view_as(mask).masked_fill(~mask, 0), pad_to)
    return widen(out[0]), None if out[1] is None else widen(out[1])


# ---- Model I/O in the Hugging Face GPT-2 safetensors layout
TIED = {"lm_head.weight": "transformer.wte.weight"}  # lm_head is wte: not saved, loaded from it


def load(name, tokenizer=None, head=None, shard=None):
    """`tiny` (random init), a GPT-2 preset (pretrained, downloaded once per node) or a checkpoint
    dir or file, ours or HF's. tokenizer: the data's meta (vocab_size, stop and pad ids). head: None
    (a GPT), "new" or "saved" (a ScalarModel). shard: the script's FSDP2 wrapper (model -> model),
    under which rank 0 alone reads (or inits) the weights and broadcasts them into every shard."""
    rank = dist.get_rank() if shard and dist.is_initialized() else None
    with torch.device("meta") if rank else nullcontext():  # no weights read: the header's shapes
        model = _build(name, tokenizer or {}, head, shapes_only=bool(rank))
    if rank is None:
        return shard(model) if shard else model
    state = {} if rank else model.state_dict()  # rank 0's full weights, kept past sharding
    model = shard(model)
    if rank:  # storage for the shards, in place: the tied wte and lm_head stay one parameter
        model.to_empty(device=next(model.parameters()).device_mesh.device_type)
    options = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dcp.set_model_state_dict(model, state, options=options)
    return model


def _build(name, tok, head, shapes_only):  # load()'s model, as one process builds it
    tensors, config = {}, {}
    if name == "tiny":
        model = GPT(GPTConfig(**PRESETS["tiny"], vocab_size=tok["vocab_size"]))
    else:
        tensors, config = _read(name, shapes_only)
        sd = {k.removeprefix("transformer."): v for k, v in tensors.items()}  # ours or HF's names
        if "wte.weight" not in sd:
            raise RunError(f"'{name}' is not a GPT-2 checkpoint (no wte.weight)")
        (rows, n_embd), n_pos = sd["wte.weight"].shape, sd["wpe.weight"].shape[0]
        n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("h."))
        n_head = config.get("n_head", n_embd // 64)  # every GPT-2 size has 64-wide heads
        model = GPT(GPTConfig(n_pos, rows, n_layer, n_head, n_embd))
        state = {k: sd[TIED.get(k, k).removeprefix("transformer.")] for k in model.state_dict()}
        model.load_state_dict(state)
        vocab = tok.get("vocab_size", rows)
        if not vocab <= rows <= -(-vocab // 128) * 128:
            msg = f"{rows}-token vocabulary, the data's tokenizer {vocab}: prep it with the model's"
            raise RunError(f"'{name}' has a {msg} (data.prep --tokenizer) or pass another model")
    model.n_logits = tok.get("vocab_size", model.n_logits)
    for key in ("eos_token_id", "pad_token_id"):
        setattr(model.config, key, tok.get(key, config.get(key, getattr(model.config, key))))
    if head == "saved" and "score.weight" not in tensors:
        raise RunError(f"'{name}' has no reward head (score.*): pass a model written by reward.py")
    if head is not None:
        model = ScalarModel(model, config.get("reward_gain", 1.0), config.get("reward_bias", 0.0))
    if head == "saved":
        model.score.load_state_dict({k: tensors[f"score.{k}"] for k in ("weight", "bias")})
    return model


def save(model, out_dir, optimizer=None):
    """model.safetensors, config.json (HF layout), optimizer.pt if given; all ranks call it."""
    full = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # on rank 0, in CPU memory
    state = dcp.get_model_state_dict(model, options=full)
    optim = optimizer and dcp.get_optimizer_state_dict(model, optimizer, options=full)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if k not in TIED}
    config = asdict(model.config)  # renamed to Hugging Face's GPT2Config
    config["n_positions"] = config["n_ctx"] = config.pop("block_size")
    config |= dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config |= dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", tie_word_embeddings=True)
    config |= dict(activation_function="gelu_new", bos_token_id=config["eos_token_id"])
    if isinstance(model, ScalarModel):
        config |= dict(reward_gain=model.reward_gain, reward_bias=model.reward_bias)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if optimizer:
        torch.save(optim, os.path.join(out_dir, "optimizer.pt"))


def load_weights(model, path, optimizer=None):
    """Load what `save` wrote, plain or FSDP2; optimizer.pt mmapped, so a node shares its pages."""
    tensors, config = _read(path)
    state = {k: tensors[TIED.get(k, k)] for k in model.state_dict()}
    options = dcp.StateDictOptions(full_state_dict=dist.is_initialized())
    dcp.set_model_state_dict(model, state, options=options)
    if optimizer:
        optim = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True, mmap=True)
        dcp.set_optimizer_state_dict(model, optimizer, optim, options=options)
    if isinstance(model, ScalarModel):
        model.reward_gain, model.reward_bias = config["reward_gain"], config["reward_bias"]


def _read(name, shapes_only=False):
    """(tensors, config dict) of a checkpoint: model.safetensors and the config.json beside it."""
    path = _resolve(name)
    try:
        if shapes_only:  # the header alone: meta tensors of the saved shapes
            f = safe_open(path, "pt")
            tensors = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
        else:
            tensors = load_file(path)
    except Exception as e:  # safetensors raises several kinds on a truncated or foreign file
        raise RunError(f"cannot read '{path}' ({e}): it is damaged; save it again") from None
    config_path = os.path.join(os.path.dirname(path), "config.json")
    config = json.load(open(config_path)) if os.path.isfile(config_path) else {}
    return tensors, config


def _resolve(name):
    """A .safetensors file, its directory, or a preset's weights (local rank 0 downloads them)."""
    path = os.path.join(name, "model.safetensors") if os.path.isdir(name) else name
    if os.path.isfile(path):
        return path
    if name not in PRESETS or name == "tiny":
        raise RunError(f"no checkpoint at '{name}': pass a model.safetensors or its directory")
    cache = os.path.expanduser(os.environ.get("GPT2_CACHE", "~/.cache/gpt2_rlhf"))
    path = os.path.join(cache, f"{name}.safetensors")
    if os.environ.get("LOCAL_RANK", "0") == "0" and not os.path.isfile(path):
        os.makedirs(cache, exist_ok=True)
        url = f"https://huggingface.co/{name}/resolve/main/model.safetensors"
        try:  # to a temp file, then renamed: nodes may share the cache directory
            torch.hub.download_url_to_file(url, path, progress=False)
        except OSError as e:
            raise RunError(f"could not download {url} ({e}); offline, pass its directory") from None
    if dist.is_initialized():
        dist.barrier()  # the node's other ranks wait for its local rank 0
    return path


# ---- CPU speed: the fp32 GEMM library and the allocator (nothing here runs on GPU)
# torch sends fp32 CPU GEMMs to MKL, which takes a slow generic path on AMD CPUs; oneDNN (also in
# torch) does not (docs/benchmarks.md). GPT2_CPU_GEMM=mkl|onednn overrides the choice.
AMD = os.path.isfile("/proc/cpuinfo") and "AuthenticAMD" in open("/proc/cpuinfo").read()
GEMM = os.environ.get("GPT2_CPU_GEMM") or ("onednn" if AMD else "mkl")
ONEDNN = GEMM == "onednn" and torch.backends.mkldnn.is_available()
# oneDNN's fixed cost per call loses on GEMMs with few weights and few rows (tiny's decode step)
ONEDNN_MIN_WEIGHTS, ONEDNN_MIN_ROWS = 1 << 18, 512
# x (M, in) @ w.T + b for w (out, in), looked up when called: not every torch build has oneDNN
_onednn = lambda x, w, b=None: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


class OneDNNMatmul(torch.autograd.Function):
    """matmul on oneDNN, forward and input gradient; the weight gradient is as fast on MKL."""

    @staticmethod
    def forward(ctx, x, w, b, out_in):
        ctx.save_for_backward(x, w)
        ctx.out_in = out_in
        return _onednn(x, w if out_in else w.t(), b)

    @staticmethod
    def backward(ctx, g):  # g (M, out)
        (x, w), (need_x, need_w, need_b, _) = ctx.saved_tensors, ctx.needs_input_grad
        gx = _onednn(g, w.t() if ctx.out_in else w) if need_x else None
        gw = (g.t() @ x if ctx.out_in else x.t() @ g) if need_w else None
        return gx, gw, g.sum(0) if need_b else None, None


def matmul(x, w, b=None, out_in=False):
    """x (..., in) @ w (in, out) + b, or x @ w.T for w (out, in); fp32 on CPU through oneDNN."""
    rows = x.numel() // x.size(-1)
    big = w.numel() >= ONEDNN_MIN_WEIGHTS or rows >= ONEDNN_MIN_ROWS
    cpu_fp32 = x.device.type == "cpu" and x.dtype == w.dtype == torch.float32
    eager = not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
    if not (ONEDNN and cpu_fp32 and big and eager):
        return F.linear(x, w if out_in else w.t(), b)
    y = OneDNNMatmul.apply(x.reshape(rows, x.size(-1)), w, b, out_in)  # no graph under no_grad
    # reshaped as torch.matmul does, not as a view: FSDP2 warns when a module returns a view
    return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.size(-1)))


def keep_freed_memory():
    """Keep freed multi-MB buffers in the process: glibc unmaps them and faults them in again."""
    libc = ctypes.CDLL(None)  # the process's C library
    if hasattr(libc, "mallopt"):  # glibc
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: buffers below 32 MiB come from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: up to 1 GiB of freed heap stays
