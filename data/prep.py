"""Prepare a real dataset: read JSONL (optionally .gz), write the layout of `data.write_dataset`.

    python -m data.prep gsm8k --input gsm8k/train.jsonl --test_input gsm8k/test.jsonl \\
        --out runs/data/gsm8k --tokenizer gpt2
    python -m data.prep hh-rlhf --input harmless-base/train.jsonl.gz \\
        --test_input harmless-base/test.jsonl.gz --out runs/data/hh --tokenizer gpt2 \\
        --max_query_len 512 --max_response_len 256 --truncate --drop_empty
    python -m data.prep tldr --input comparisons/*.json --out runs/data/tldr \\
        --tokenizer gpt2 --max_query_len 600 --truncate
    python -m data.prep jsonl --input mine.jsonl --out runs/data/mine --task gsm8k \\
        --pad_token_id 50257

- jsonl: {prompt, completion} -> sft, {prompt, chosen, rejected} -> pref,
  {prompt, ground_truth} -> prompt.
- gsm8k: {question, answer}: prompt "Question: ...\\nAnswer:", sft response = the worked
  answer, ground truth = the number after "#### "; task gsm8k (checked by
  `data.verify`).
- hh-rlhf: {chosen, rejected} dialogues: prompt = the shared prefix up to and including
  its last "\\n\\nAssistant:", responses = the rest of each -> pref, sft (chosen),
  prompt (no ground truth).
- tldr: summarize-from-feedback comparisons
  {info{subreddit, title, post}, summaries[{text}, {text}], choice} -> pref, or the SFT
  format {subreddit, title, post, summary} -> sft; both -> prompt. Query format and the
  summary's leading space as in summarize_from_feedback_details.

Without --test_input a seeded fraction of the distinct prompts is held out, so no prompt
is in both train and test. A bad line stops the prep with `file:line: problem: fix`;
--truncate / --drop_empty drop over-long / empty rows. Padding uses the stop token unless
--pad_token_id names another id (one past the vocabulary, e.g. 50257 for gpt2, grows
meta.json's vocab_size by one); responses end in the stop token either way. The
tokenizer is one of the names `bytes`, `gpt2` (the GPT-2 BPE shipped in data/, no
download) or a .tiktoken file, which meta.json stores relative to --out.
"""

import argparse
import gzip
import json
import os
import random
import sys

import numpy as np

from data import RunError, make_meta, pad_left, pad_right, progress, write_dataset
from data.tokenizer import get_encoding

GSM8K_TEMPLATE = "Question: {question}\nAnswer:"
TLDR_TEMPLATE = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
HH_TURN = "\n\nAssistant:"
FIELDS = {
    "jsonl": "prompt plus completion, chosen+rejected or ground_truth",
    "gsm8k": "question and answer",
    "hh-rlhf": "chosen and rejected",
    "tldr": "info, summaries and choice (or subreddit, title, post, summary)",
}
# Formats with a verifier; the others are scored by a reward model.
TASKS = dict(gsm8k="gsm8k")
# The response arrays each kind of row has, in column order.
RESPONSES = dict(sft=("response",), pref=("chosen", "rejected"), prompt=())


def _str(record: dict, key: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise ValueError(f"missing string field '{key}'")
    return record[key]


def _space(text: str) -> str:
    if text[:1].isspace():
        return text
    return " " + text


# --------------------------------------------------------------------------------------------------
# One function per format: a JSON record -> rows (kind, prompt, *texts), where kind is
# sft, pref or prompt


def jsonl_rows(r: dict) -> list[tuple]:
    rows = []
    if "completion" in r:
        rows.append(("sft", _str(r, "prompt"), _str(r, "completion")))
    if "chosen" in r or "rejected" in r:
        rows.append(("pref", _str(r, "prompt"), _str(r, "chosen"), _str(r, "rejected")))
    if "ground_truth" in r:
        truth = r["ground_truth"]
        if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
            raise ValueError("field 'ground_truth' must be a string or a number")
        rows.append(("prompt", _str(r, "prompt"), str(truth)))
    if not rows:
        raise ValueError("no completion, chosen/rejected or ground_truth field")
    return rows


def gsm8k_rows(r: dict) -> list[tuple]:
    prompt = GSM8K_TEMPLATE.format(question=_str(r, "question").strip())
    answer = _str(r, "answer")
    if "####" not in answer:
        raise ValueError("answer has no final '#### <number>'")
    final_number = answer.split("####")[-1].strip()
    return [("sft", prompt, _space(answer)), ("prompt", prompt, final_number)]


def hh_rows(r: dict) -> list[tuple]:
    chosen = _str(r, "chosen")
    rejected = _str(r, "rejected")
    cut = os.path.commonprefix([chosen, rejected]).rfind(HH_TURN)
    if cut < 0:
        raise ValueError("chosen and rejected share no prefix ending in an Assistant turn")
    cut += len(HH_TURN)
    prompt = chosen[:cut]
    return [
        ("pref", prompt, chosen[cut:], rejected[cut:]),
        ("sft", prompt, chosen[cut:]),
        ("prompt", prompt, ""),
    ]


def tldr_rows(r: dict) -> list[tuple]:
    # Comparisons nest the post under info, the SFT format does not.
    post = r.get("info", r)
    fields = {k: _str(post, k) for k in ("subreddit", "title", "post")}
    prompt = TLDR_TEMPLATE.format(**fields)
    if "summaries" not in r:
        summary = _space(_str(r, "summary"))
        return [("sft", prompt, summary), ("prompt", prompt, "")]
    summaries = r["summaries"]
    choice = r.get("choice")
    if not isinstance(summaries, list) or len(summaries) != 2 or choice not in (0, 1):
        raise ValueError("'summaries' must hold two summaries and 'choice' be 0 or 1")
    texts = [_space(_str(s, "text")) for s in summaries]
    return [("pref", prompt, texts[choice], texts[1 - choice]), ("prompt", prompt, "")]


FORMATS = {"jsonl": jsonl_rows, "gsm8k": gsm8k_rows, "hh-rlhf": hh_rows, "tldr": tldr_rows}


# --------------------------------------------------------------------------------------------------
# Reading, checking, splitting, tokenizing


def read_rows(fmt: str, path: str) -> list[tuple]:
    """All rows of one file as (location, kind, prompt, *texts); the first bad line raises,
    naming file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"input file '{path}' not found: pass an existing --input / --test_input path"
        )
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        try:
            lines = f.readlines()
        # A broken .gz.
        except (OSError, EOFError) as e:
            raise ValueError(
                f"{path}: unreadable ({e}): pass a JSONL file or an intact .jsonl.gz"
            ) from None
    rows = []
    for lineno, line in enumerate(progress(lines, f"read {path}"), 1):
        if not line.strip():
            continue
        loc = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        # JSONDecodeError, or UnicodeDecodeError (which has no msg).
        except ValueError as e:
            why = getattr(e, "msg", "not UTF-8")
            raise ValueError(
                f"{loc}: malformed JSON ({why}): "
                "each line must be one JSON object (JSONL); fix or delete the line"
            ) from None
        try:
            if not isinstance(record, dict):
                raise ValueError("the line is not a JSON object")
            for row in FORMATS[fmt](record):
                rows.append((loc, *row))
        except ValueError as e:
            raise ValueError(f"{loc}: {e}: every {fmt} line needs {FIELDS[fmt]}") from None
    return rows


def problem(
    query: list[int], texts: list[str], responses: list[list[int]], names: tuple, a
) -> tuple | None:
    """(what is wrong with a tokenized row, the flag that drops such rows), or None if it
    is fine."""
    if not query:
        return "empty prompt", None
    if a.max_query_len and len(query) > a.max_query_len:
        too_long = f"prompt is {len(query)} tokens, over --max_query_len {a.max_query_len}"
        return too_long, "truncate"
    for name, text, ids in zip(names, texts, responses):
        if not text.strip():
            return f"empty {name}", "drop_empty"
        if a.max_response_len and len(ids) > a.max_response_len:
            over = f"over --max_response_len {a.max_response_len}"
            return f"{name} is {len(ids)} tokens (with eot), {over}", "truncate"
    return None


def split_prompts(rows: list[tuple], test_fraction: float, seed: int) -> tuple[list, list]:
    """Hold out a seeded fraction of the distinct prompts (with all their rows) as the test
    split."""
    prompts = sorted({r[2] for r in rows})
    random.Random(seed).shuffle(prompts)
    n_test = max(1, round(len(prompts) * test_fraction))
    if n_test >= len(prompts):
        raise ValueError(
            f"only {len(prompts)} distinct prompts: too few to hold out a test split; "
            "pass --test_input"
        )
    test_prompts = set(prompts[:n_test])
    train = [r for r in rows if r[2] not in test_prompts]
    test = [r for r in rows if r[2] in test_prompts]
    return train, test


def column(name: str, values: list, pad: int) -> np.ndarray:
    """One array of a split: ground truth as strings, the query left-padded, every other
    column (a response) right-padded."""
    if name == "ground_truth":
        return np.array(values)
    if name == "query":
        return pad_left(values, pad)
    return pad_right(values, pad)


def tokenize(
    rows: list[tuple], enc, pad: int, a, skipped: dict
) -> dict[str, dict[str, np.ndarray]]:
    """Rows -> {kind: arrays}: queries left-padded, responses ending in <|endoftext|> then
    right-padded, with `pad`."""
    eot = enc.eot_token
    out = {}
    seen = set()
    for loc, kind, prompt, *texts in progress(rows, "tokenize"):
        # A TL;DR post compared many times would otherwise be an RL prompt many times over.
        if kind == "prompt" and (prompt, texts[0]) in seen:
            continue
        names = RESPONSES[kind]
        query = enc.encode_ordinary(prompt)
        responses = [enc.encode_ordinary(t) + [eot] for t in texts[: len(names)]]
        bad = problem(query, texts, responses, names, a)
        if bad:
            what, flag = bad
            if flag and getattr(a, flag):
                skipped[flag] = skipped.get(flag, 0) + 1
                continue
            fix = f"pass --{flag} to drop such rows" if flag else "fix the line"
            raise ValueError(f"{loc}: {what}: {fix}")
        row = dict(query=query, **dict(zip(names, responses)))
        if kind == "prompt":
            seen.add((prompt, texts[0]))
            row["ground_truth"] = texts[0]
        out.setdefault(kind, []).append(row)
    arrays = {}
    for kind, kind_rows in out.items():
        arrays[kind] = {}
        for name in kind_rows[0]:
            values = [row[name] for row in kind_rows]
            arrays[kind][name] = column(name, values, pad)
    return arrays


def prep(a) -> dict:
    """Read, check, split and write one dataset; returns how many rows each flag
    dropped."""
    if not 0 < a.test_fraction < 1:
        raise ValueError(f"--test_fraction {a.test_fraction} must be between 0 and 1")
    enc = get_encoding(a.tokenizer)
    skipped = {}
    task = a.task or TASKS.get(a.format)
    meta = make_meta(a.tokenizer, a.out, task, a.pad_token_id)
    rows = [r for path in a.input for r in read_rows(a.format, path)]
    if a.test_input:
        train = rows
        test = [r for path in a.test_input for r in read_rows(a.format, path)]
    else:
        train, test = split_prompts(rows, a.test_fraction, a.seed)
    pad = meta["pad_token_id"]
    train = tokenize(train, enc, pad, a, skipped)
    test = tokenize(test, enc, pad, a, skipped)
    for kind in sorted(set(train) | set(test)):
        if kind not in train or kind not in test:
            empty = "test" if kind in train else "train"
            raise ValueError(
                f"no {kind} rows left in the {empty} split: "
                "use more data, a larger --test_fraction or a --test_input with such rows"
            )
    splits = {}
    for split_name, split in (("train", train), ("test", test)):
        for kind, arrays in split.items():
            splits[f"{kind}_{split_name}"] = arrays
    if not splits:
        raise ValueError(
            "no rows left: raise --max_query_len / --max_response_len or fix the input"
        )
    write_dataset(a.out, meta, splits)
    if skipped:
        counts = [f"{n} rows (--{flag})" for flag, n in skipped.items()]
        print("skipped " + ", ".join(counts))
    return skipped


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("format", choices=sorted(FORMATS), help="input format")
    p.add_argument("--input", nargs="+", required=True, help="JSONL file(s), optionally .gz")
    p.add_argument("--out", required=True, help="directory to write, e.g. runs/data/NAME")
    p.add_argument("--tokenizer", default="bytes", help="bytes, gpt2 or a .tiktoken path")
    p.add_argument(
        "--pad_token_id", type=int, default=None, help="padding id (default: the stop token's)"
    )
    p.add_argument(
        "--task",
        default=None,
        help="verifier task for prompt rows (default: gsm8k for gsm8k, else none)",
    )
    p.add_argument(
        "--max_query_len",
        type=int,
        default=None,
        help="longest prompt in tokens (default: no limit)",
    )
    p.add_argument(
        "--max_response_len",
        type=int,
        default=None,
        help="longest response in tokens incl. <|endoftext|>",
    )
    p.add_argument(
        "--truncate", action="store_true", help="drop over-long rows instead of stopping"
    )
    p.add_argument(
        "--drop_empty",
        action="store_true",
        help="drop rows with an empty response instead of stopping",
    )
    split = p.add_mutually_exclusive_group()
    split.add_argument(
        "--test_fraction", type=float, default=0.05, help="fraction of prompts held out as test"
    )
    split.add_argument(
        "--test_input", nargs="+", default=None, help="separate test file(s) instead"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        prep(parse_args())
    except (RunError, ValueError, OSError, RuntimeError) as e:
        # bad input: one line naming the problem and its fix reads better than a traceback
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        sys.exit(2)
