"""The offline default task: a+b for a, b < 100, shown by an annotator who often forgets the carry.

    prompt "47+38="   response " 85<|endoftext|>"   verifier: response.strip() == "85"

The regime RLHF is for: demonstrations with a systematic error, and feedback that can
remove it. On the problems whose units digits sum to 10 or more (45% of them) the
annotator forgets the carry SLIP_RATE = 2/3 of the time and writes the slip, the sum less
10 (`slip`: 47+38 -> 75, 7+8 -> 5); elsewhere they are right. A converged SFT model learns
that distribution: greedy decoding writes the slip on most carry problems and the right
answer on all others (greedy accuracy ~0.55, every error a slip), while sampling at
temperature 1 is right on ~1/3 of the carry problems, successes that PPO and GRPO can
reinforce. The preference pairs and the verifier know the truth, so DPO, PPO and GRPO
have ~45 points of greedy accuracy to gain. Why 2/3: above 1/2 so that greedy decoding
picks the slip even though the model's estimate of the rate scatters from problem to
problem; not much higher, so that RL still samples right answers.

- sft: prompt + the annotator's answer (the slip or the right one); sft_test measures the
  fit to the annotator, whose entropy bounds eval/loss from below (~0.066 nats per
  response token).
- pref: chosen = the right answer; rejected = the slip on carry problems, and on the
  others a near miss (a spurious carry, +10, or the last digit one off), so "bigger is
  better" does not separate the pairs.
- prompt: prompt + ground truth (the right answer, no padding), for RL with the verifier.

Numbers are right-aligned as in a column sum: operands in two characters (" 7+48="),
answers in three (" 55"). The tiny model's positions are learned, absolute ones: with
every digit in a fixed place it leaves its initial loss plateau within a few hundred SFT
steps on every seed tried, where ragged numbers ("7+48=", "55") left it there for
anything from 250 to over 1500 steps depending on the seed, and SFT would not converge in
the minute or two its defaults take.

All 10,000 problems (0 <= a, b <= 99) are shuffled with a fixed seed and dealt out in
turn: the splits are uniform draws, no prompt is in two of them, and everything (problems
and slips) is deterministic in the seed.

    # write it as a prepared dataset dir
    python -m data.arithmetic --out runs/data/arithmetic
"""

import argparse
import random

import numpy as np

from data import make_meta, pad_left, pad_right, write_dataset
from data.tokenizer import get_encoding

META = dict(
    tokenizer="bytes", task="arithmetic", pad_token_id=256, eos_token_id=256, vocab_size=257
)
SIZES = dict(
    sft_train=5000, sft_test=500, pref_train=2000, pref_test=500, prompt_train=1500, prompt_test=500
)
# How often the annotator forgets the carry on a carry problem.
SLIP_RATE = 2 / 3


def prompt(a: int, b: int) -> str:
    """Operands right-aligned in two characters, as in a column sum (" 7+48="), so the
    units digits keep their place."""
    return f"{a:>2}+{b:>2}="


def written(n: int) -> str:
    """An answer as the annotator writes it: right-aligned in three characters (" 55"); the
    verifier strips spaces."""
    return f"{n:>3}"


def answer(a: int, b: int) -> int:
    return a + b


def slip(a: int, b: int) -> int:
    """The annotator's typical mistake: the carry from the units into the tens is lost
    (47+38 -> 75, 7+8 -> 5)."""
    if a % 10 + b % 10 >= 10:
        return a + b - 10
    return a + b


def near_miss(rng: random.Random, right: int) -> int:
    """A plausible wrong answer on a problem without a carry: a carry where there is none,
    or the last digit one off."""
    candidates = [w for w in (right + 10, right + 1, right - 1) if w >= 0]
    return rng.choice(candidates)


def annotated(annotator: random.Random, a: int, b: int) -> int:
    """The annotator's answer: on a carry problem the slip SLIP_RATE of the time, else the
    right one (a draw from `annotator` on carry problems only)."""
    right = answer(a, b)
    wrong = slip(a, b)
    if wrong != right and annotator.random() < SLIP_RATE:
        return wrong
    return right


def rejected_answer(annotator: random.Random, a: int, b: int) -> int:
    """A preference pair's rejected answer: the slip on a carry problem, else a near miss."""
    right = answer(a, b)
    wrong = slip(a, b)
    if wrong != right:
        return wrong
    return near_miss(annotator, right)


def deal(seed: int, sizes: dict) -> dict[str, list[tuple[int, int]]]:
    """Disjoint problems per split, in turn from one shuffled list of all of them."""
    pool = [(a, b) for a in range(100) for b in range(100)]
    if sum(sizes.values()) > len(pool):
        raise ValueError(
            f"arithmetic has {len(pool)} problems, fewer than the split sizes {sizes}: lower them"
        )
    random.Random(seed).shuffle(pool)
    out = {}
    start = 0
    for split, n in sizes.items():
        out[split] = pool[start : start + n]
        start += n
    return out


def build(
    seed: int = 0,
    sizes: dict | None = None,
    tokenizer: str = "bytes",
    pad_token_id: int | None = None,
) -> dict:
    """All splits as arrays: queries left-padded, responses ending in the stop token then
    right-padded."""
    enc = get_encoding(tokenizer)
    eot = enc.eot_token
    if pad_token_id is None:
        pad = eot
    else:
        pad = pad_token_id

    def responses(numbers: list[int]) -> np.ndarray:
        return pad_right([enc.encode_ordinary(written(n)) + [eot] for n in numbers], pad)

    # A stream of its own, so the slips never change which problems a split gets.
    annotator = random.Random(f"annotator-{seed}")
    splits = {}
    for split, rows in deal(seed, sizes or SIZES).items():
        query = pad_left([enc.encode_ordinary(prompt(a, b)) for a, b in rows], pad)
        if split.startswith("sft"):
            given = [annotated(annotator, a, b) for a, b in rows]
            splits[split] = dict(query=query, response=responses(given))
        elif split.startswith("pref"):
            right = [answer(a, b) for a, b in rows]
            rejected = [rejected_answer(annotator, a, b) for a, b in rows]
            chosen = responses(right)
            splits[split] = dict(query=query, chosen=chosen, rejected=responses(rejected))
        else:
            truth = [str(answer(a, b)) for a, b in rows]
            splits[split] = dict(query=query, ground_truth=np.array(truth))
    return splits


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory to write, e.g. runs/data/arithmetic")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the problems' order and of the annotator's slips",
    )
    p.add_argument("--tokenizer", default="bytes", help="bytes, gpt2 or a .tiktoken path")
    p.add_argument(
        "--pad_token_id", type=int, default=None, help="padding id (default: the stop token's)"
    )
    a = p.parse_args()
    meta = make_meta(a.tokenizer, a.out, "arithmetic", a.pad_token_id)
    splits = build(a.seed, tokenizer=a.tokenizer, pad_token_id=meta["pad_token_id"])
    write_dataset(a.out, meta, splits)
