"""Tokenizers: tiktoken Encodings with `<|endoftext|>` as the stop token.

Nothing is downloaded:
- `bytes`: 256 byte tokens + `<|endoftext|>` = 256, built in code: the offline default.
- `gpt2`: the real GPT-2 BPE (50,257 tokens) from data/gpt2.tiktoken, which ships with
  the repository (the ranks file of the MIT-licensed openai-whisper package: see
  data/gpt2.tiktoken.LICENSE).
- a path to another `.tiktoken` file (base64 token, rank per line): a BPE from disk, with
  GPT-2's pre-tokenisation.

A dataset's meta.json names its tokenizer portably (`portable_name`): `bytes` / `gpt2`,
or a .tiktoken file by its path relative to the dataset directory, which `resolve_name`
turns back into a path when the dataset is loaded.
"""

import base64
import hashlib
import os
from functools import lru_cache

import tiktoken

# RunError is a problem the user can fix: it prints one line, no traceback.
from gpt2 import RunError

EOT = "<|endoftext|>"
NAMES = ("bytes", "gpt2")
GPT2_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2.tiktoken")
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenisation regex (tiktoken's gpt2 pattern).
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bpe(name: str, path: str) -> tiktoken.Encoding:
    """A .tiktoken ranks file read directly (tiktoken's own loader would copy it into a
    cache dir first)."""
    with open(path, "rb") as f:
        raw = f.read()
    if path == GPT2_FILE and hashlib.sha256(raw).hexdigest() != GPT2_SHA256:
        raise RunError(
            f"{path} is damaged (wrong checksum): "
            "restore it from the repository (git checkout data/)"
        )
    ranks = {}
    for line in raw.splitlines():
        if not line:
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name=name,
        pat_str=GPT2_PAT,
        mergeable_ranks=ranks,
        special_tokens={EOT: len(ranks)},
    )


@lru_cache(maxsize=8)
def get_encoding(name: str) -> tiktoken.Encoding:
    """`bytes`, `gpt2` or a path to a .tiktoken file."""
    if name == "bytes":
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding(
            name="bytes",
            pat_str=GPT2_PAT,
            mergeable_ranks=ranks,
            special_tokens={EOT: 256},
        )
    if name == "gpt2":
        return _bpe("gpt2", GPT2_FILE)
    if name.endswith(".tiktoken"):
        if not os.path.isfile(name):
            raise RunError(f"tokenizer file '{name}' not found: pass an existing .tiktoken path")
        return _bpe(os.path.basename(name), name)
    raise RunError(f"unknown tokenizer '{name}': use bytes, gpt2 or a path to a .tiktoken file")


def portable_name(tokenizer: str, dataset_dir: str) -> str:
    """The tokenizer as meta.json stores it: a name, or a .tiktoken file's path relative to
    the dataset dir (never an absolute path, so the dataset can move to another machine
    along with its tokenizer file)."""
    if tokenizer in NAMES:
        return tokenizer
    if os.path.isfile(tokenizer) and os.path.samefile(tokenizer, GPT2_FILE):
        return "gpt2"
    return os.path.relpath(os.path.abspath(tokenizer), os.path.abspath(dataset_dir))


def resolve_name(name: str, dataset_dir: str) -> str:
    """Inverse of portable_name: what get_encoding takes."""
    if name in NAMES:
        return name
    return os.path.normpath(os.path.join(dataset_dir, name))
