"""data/: tokenizers (gpt2 offline), the arithmetic task and its annotator, data.prep on real GSM8K / HH-RLHF slices, a
TL;DR record, bad files, pad != eos, portable tokenizer paths."""

import base64
import gzip
import itertools
import json
import shutil
import socket
import subprocess
import sys
from contextlib import nullcontext
from math import comb
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import gpt2
from data import arithmetic, get_encoding, load_meta, load_split, verify
from data.prep import parse_args, prep

ROOT, SHARED = (
    Path(__file__).resolve().parents[1],
    Path(__file__).resolve().parents[2] / "shared" / "data",
)
GPT2 = SHARED / "gpt2-vocab" / "gpt2.tiktoken"
BYTES, EOT = get_encoding("bytes"), 256
KEYS = dict(
    sft={"query", "response"},
    pref={"query", "chosen", "rejected"},
    prompt={"query", "ground_truth"},
)


def write(path: Path, records: list) -> Path:
    with (gzip.open if path.suffix == ".gz" else open)(path, "wt") as f:
        f.write("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def run_prep(fmt: str, inp: Path, out: Path, *flags: str) -> dict:
    return prep(parse_args([fmt, "--input", str(inp), "--out", str(out), *flags]))


def query_text(row: np.ndarray, enc=BYTES, pad=None) -> str:
    real = row != (enc.eot_token if pad is None else pad)
    assert real.any() and np.all(real[np.argmax(real) :]), "queries are padded on the left only"
    return enc.decode(row[real].tolist())


def response_text(row: np.ndarray, enc=BYTES, pad=None) -> str:
    stop = np.flatnonzero(row == enc.eot_token)
    assert len(stop) and np.all(row[stop[0] + 1 :] == (enc.eot_token if pad is None else pad)), (
        "eot, then padding"
    )
    return enc.decode(row[: stop[0]].tolist())


def test_gpt2_offline(monkeypatch):
    """The GPT-2 BPE ships in data/: no network (sockets fail here), no tiktoken download cache."""
    monkeypatch.setattr(
        socket.socket, "connect", lambda *a: (_ for _ in ()).throw(OSError("network used"))
    )
    get_encoding.cache_clear()
    enc = get_encoding("gpt2")
    assert enc.encode_ordinary("Hello world") == [15496, 995] and (enc.eot_token, enc.n_vocab) == (
        50256,
        50257,
    )
    if GPT2.exists():  # the shipped file is the openai-whisper one, byte for byte
        assert (ROOT / "data" / "gpt2.tiktoken").read_bytes() == GPT2.read_bytes()


def test_product_never_reads_shared():
    for path in [*ROOT.glob("*.py"), *ROOT.glob("data/*.py")]:
        assert "/work/shared" not in path.read_text() and "../shared" not in path.read_text(), path


def test_bytes_encoding():
    ids = BYTES.encode_ordinary(text := "héllo, 12+3=15 <|endoftext|> ✓")
    assert (
        BYTES.decode(ids) == text
        and max(ids) < 256
        and (BYTES.eot_token, BYTES.n_vocab) == (EOT, 257)
    )


def arithmetic_rows(d: dict) -> tuple[list, list, list]:
    """(prompts, right answers computed here, whether the units digits carry) of one split."""
    prompts = [query_text(q) for q in d["query"]]
    pairs = [tuple(map(int, p[:-1].split("+"))) for p in prompts]
    return prompts, [str(a + b) for a, b in pairs], [a % 10 + b % 10 >= 10 for a, b in pairs]


def test_arithmetic_splits():
    prompts = {}
    for split, n in arithmetic.SIZES.items():
        d = load_split("arithmetic", split)
        assert (
            set(d) == KEYS[split.split("_")[0]]
            and all(len(v) == n for v in d.values())
            and d["query"].ndim == 2
        )
        prompts[split], truth, _ = arithmetic_rows(d)
        assert d.get("ground_truth", np.array(truth)).tolist() == truth
        for row, t in zip(d.get("chosen", []), truth):
            assert verify("arithmetic", response_text(row), t) == 1.0
    assert all(not set(a) & set(b) for a, b in itertools.combinations(prompts.values(), 2))
    again = arithmetic.build()  # deterministic; another seed deals other problems
    assert all(
        np.array_equal(again[s][k], v)
        for s in again
        for k, v in load_split("arithmetic", s).items()
    )
    assert not np.array_equal(
        arithmetic.build(seed=1)["sft_train"]["query"], again["sft_train"]["query"]
    )


def test_arithmetic_annotator_and_pairs():
    """SFT: the slip (carry lost: 47+38 -> 75) on ~SLIP_RATE of the carry problems, right everywhere else. Pref:
    chosen right, rejected the slip on carry problems and another wrong answer on the others."""
    d = load_split("arithmetic", "sft_train")
    prompts, truth, carry = arithmetic_rows(d)
    given = [response_text(r).strip() for r in d["response"]]  # answers are right-aligned: " 85"
    slips = [g != t for g, t in zip(given, truth)]
    assert 0.40 < np.mean(carry) < 0.50 and not any(s for s, c in zip(slips, carry) if not c)
    assert abs(np.mean([s for s, c in zip(slips, carry) if c]) - arithmetic.SLIP_RATE) < 0.03
    assert all(
        int(g) == int(t) - 10 for g, t, s in zip(given, truth, slips) if s
    )  # the sum less the lost carry
    assert [arithmetic.slip(*p) for p in ((47, 38), (57, 68), (7, 8), (41, 23))] == [75, 115, 5, 64]
    d = load_split("arithmetic", "pref_train")
    prompts, truth, carry = arithmetic_rows(d)
    chosen, rejected = [[response_text(r).strip() for r in d[k]] for k in ("chosen", "rejected")]
    assert chosen == truth and all(c != r for c, r in zip(chosen, rejected))
    assert all(
        (int(r) == int(t) - 10) == c for r, t, c in zip(rejected, truth, carry)
    )  # the slip iff a carry
    assert (
        0.3 < np.mean([int(r) > int(t) for r, t in zip(rejected, truth)]) < 0.7
    )  # "bigger is better" fails


@pytest.mark.skipif(not (SHARED / "gsm8k").exists(), reason="shared/data absent")
def test_prep_gsm8k(tmp_path):
    lines = (SHARED / "gsm8k" / "test.jsonl").read_text().splitlines()[:40]
    run_prep(
        "gsm8k",
        write(tmp_path / "g.jsonl", lines),
        tmp_path,
        "--tokenizer",
        "gpt2",
        "--test_fraction",
        "0.25",
    )
    meta, enc = load_meta(str(tmp_path)), get_encoding("gpt2")
    assert meta == dict(
        tokenizer="gpt2", task="gsm8k", pad_token_id=50256, eos_token_id=50256, vocab_size=50257
    )
    answers, seen = (
        {
            f"Question: {r['question'].strip()}\nAnswer:": r["answer"]
            for r in map(json.loads, lines)
        },
        {},
    )
    for split, n in (("train", 30), ("test", 10)):
        sft, pr = (load_split(str(tmp_path), f"{k}_{split}") for k in ("sft", "prompt"))
        assert len(sft["query"]) == len(sft["response"]) == len(pr["ground_truth"]) == n
        seen[split] = [query_text(q, enc) for q in pr["query"]]
        assert pr["ground_truth"].tolist() == [answers[p].split("#### ")[-1] for p in seen[split]]
        for q, r in zip(sft["query"], sft["response"]):
            answer = answers[query_text(q, enc)]
            assert response_text(r, enc) == " " + answer and verify(
                "gsm8k", answer, answer.split("#### ")[-1]
            )
    assert not set(seen["train"]) & set(seen["test"])


@pytest.mark.skipif(not (SHARED / "hh-rlhf").exists(), reason="shared/data absent")
def test_prep_hh(tmp_path):
    with gzip.open(SHARED / "hh-rlhf" / "harmless-base-test.jsonl.gz", "rt") as f:
        lines = [json.loads(line) for line in itertools.islice(f, 100)]
    with pytest.raises(
        ValueError, match=r"hh\.jsonl\.gz:87: empty chosen: pass --drop_empty"
    ):  # real HH has these
        run_prep("hh-rlhf", hh := write(tmp_path / "hh.jsonl.gz", lines), tmp_path)
    assert run_prep("hh-rlhf", hh, tmp_path, "--drop_empty") == {
        "drop_empty": 2
    }  # line 87's pref and sft rows
    assert load_meta(str(tmp_path))["task"] is None
    pairs = {(r["chosen"], r["rejected"]) for r in lines}
    for split in ("train", "test"):
        d = load_split(str(tmp_path), f"pref_{split}")
        for q, c, r in zip(d["query"], d["chosen"], d["rejected"]):
            p = query_text(
                q
            )  # the prompt ends in the Assistant turn; prompt + response gives the dialogue back
            assert (
                p.endswith("\n\nAssistant:")
                and (p + response_text(c), p + response_text(r)) in pairs
            )
        assert set(load_split(str(tmp_path), f"prompt_{split}")["ground_truth"]) == {""}


def test_prep_tldr(tmp_path):
    cmp = [
        dict(
            info=dict(subreddit="cats", title=f"title {i}", post=f"My cat {i} sleeps."),
            choice=choice,  # OpenAI's
            summaries=[dict(text=" cat sleeps"), dict(text=" lazy cat")],
        )
        for i, choice in ((0, 1), (1, 0), (2, 1))
    ]
    sft = dict(
        subreddit="dogs", title="walk", post="Is 5 km too far?", summary="too far?"
    )  # the SFT format
    test = write(tmp_path / "test.jsonl", [cmp[2], sft])
    run_prep(
        "tldr",
        write(tmp_path / "t.jsonl", [cmp[0], cmp[1], sft]),
        tmp_path,
        "--test_input",
        str(test),
    )
    d = load_split(str(tmp_path), "pref_train")
    assert (
        query_text(d["query"][0])
        == "SUBREDDIT: r/cats\n\nTITLE: title 0\n\nPOST: My cat 0 sleeps.\n\nTL;DR:"
    )
    assert [response_text(r) for r in d["chosen"]] == [" lazy cat", " cat sleeps"]
    assert [response_text(r) for r in d["rejected"]] == [" cat sleeps", " lazy cat"]
    assert (
        response_text(load_split(str(tmp_path), "sft_test")["response"][0]) == " too far?"
    )  # space added


GOOD = '{"prompt": "2+2=", "completion": "4"}'
BAD = {  # expected message: (lines, flags, line number of the bad line)
    "malformed JSON": ([GOOD, '{"prompt": "2+2=", '], [], 2),
    "missing string field 'rejected'": ([GOOD, GOOD, '{"prompt": "1+1=", "chosen": "2"}'], [], 3),
    "empty response: pass --drop_empty": ([GOOD, '{"prompt": "1+1=", "completion": " "}'], [], 2),
    "over --max_query_len 5: pass --truncate": (
        [GOOD, GOOD.replace("2+2", "2+2+2+2")],
        ["--max_query_len", "5"],
        2,
    ),
}


@pytest.mark.parametrize(
    "what, lines, flags, lineno", [(k, *v) for k, v in BAD.items()], ids=list(BAD)
)
def test_bad_file(tmp_path, what, lines, flags, lineno):
    with pytest.raises(ValueError) as e:
        run_prep(
            "jsonl",
            bad := write(tmp_path / "bad.jsonl", lines),
            tmp_path,
            "--test_input",
            str(bad),
            *flags,
        )
    assert (
        f"bad.jsonl:{lineno}: " in str(e.value)
        and what in str(e.value)
        and "\n" not in str(e.value)
    )


def test_truncate_counts(tmp_path):
    rows = [dict(prompt=f"{i}+1=", completion=str(i + 1)) for i in range(5)]
    rows += [
        dict(prompt="9" * 30 + "+1=", completion="x"),
        dict(prompt="1+1=", completion="2" * 30),
    ]  # too long
    t, flags = (
        write(tmp_path / "t.jsonl", rows),
        ["--max_query_len", "10", "--max_response_len", "10"],
    )
    flags += ["--test_input", str(write(tmp_path / "test.jsonl", [GOOD]))]
    with pytest.raises(ValueError, match="t.jsonl:6: prompt is 33 tokens"):
        run_prep("jsonl", t, tmp_path, *flags)
    assert run_prep("jsonl", t, tmp_path, *flags, "--truncate") == {"truncate": 2}
    assert load_split(str(tmp_path), "sft_train")["response"].shape == (5, 2)


def test_cli_one_line_error(tmp_path):
    bad = write(tmp_path / "bad.jsonl", [GOOD, "{oops"])
    cmd = [sys.executable, "-m", "data.prep", "jsonl", "--input", str(bad), "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert (
        p.returncode == 2
        and "Traceback" not in p.stderr
        and len(p.stderr.strip().splitlines()) == 1
    )
    assert f"{bad}:2: malformed JSON" in p.stderr


@pytest.mark.parametrize(
    "pad", [257, 0]
)  # past the vocabulary (vocab_size grows), or an id no prompt uses
def test_pad_not_eos(tmp_path, pad):
    rows = [
        dict(prompt="12+3=", completion="15"),
        dict(prompt="1+1=", completion="2", chosen="2", rejected="11"),
        dict(prompt="4+4=", ground_truth=8),
    ]
    test = write(tmp_path / "test.jsonl", rows)
    flags = ["--test_input", str(test), "--pad_token_id", str(pad)]
    run_prep("jsonl", write(tmp_path / "t.jsonl", rows), tmp_path / "d", *flags)
    meta = load_meta(str(tmp_path / "d"))
    assert (meta["pad_token_id"], meta["eos_token_id"], meta["vocab_size"]) == (
        pad,
        EOT,
        max(257, pad + 1),
    )
    sft = load_split(str(tmp_path / "d"), "sft_train")
    assert [query_text(q, pad=pad) for q in sft["query"]] == ["12+3=", "1+1="] and sft["query"][
        1, 0
    ] == pad
    assert [response_text(r, pad=pad) for r in sft["response"]] == ["15", "2"]
    assert sft["response"].tolist() == [[49, 53, EOT], [50, EOT, pad]]  # the stop token, then pad
    cmd = [
        sys.executable,
        "-m",
        "data.arithmetic",
        "--out",
        str(tmp_path / "a"),
        "--pad_token_id",
        str(pad),
    ]
    subprocess.run(
        cmd, cwd=ROOT, check=True, capture_output=True
    )  # the task written as a dataset dir, same meta
    assert load_meta(str(tmp_path / "a")) == dict(
        arithmetic.META, pad_token_id=pad, vocab_size=max(257, pad + 1)
    )
    with pytest.raises(
        ValueError, match="a prompt contains the pad id 49"
    ):  # "1" is byte 49: its mask would drop it
        run_prep("jsonl", test, tmp_path / "bad", "--test_input", str(test), "--pad_token_id", "49")


def test_meta_tokenizer_is_portable(tmp_path):
    """A .tiktoken tokenizer is stored relative to the dataset dir: the dataset moves with it, to any machine."""
    (tmp_path / "tok").mkdir()
    tok = tmp_path / "tok" / "mine.tiktoken"  # the byte-level ranks, written in tiktoken's format
    tok.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    rows = write(tmp_path / "t.jsonl", [dict(prompt="2+2=", completion="4")])
    run_prep("jsonl", rows, tmp_path / "d", "--test_input", str(rows), "--tokenizer", str(tok))
    assert (
        json.loads((tmp_path / "d" / "meta.json").read_text())["tokenizer"]
        == "../tok/mine.tiktoken"
    )
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for name in ("tok", "d"):
        shutil.move(tmp_path / name, moved / name)
    enc = get_encoding(load_meta(str(moved / "d"))["tokenizer"])
    assert enc.encode_ordinary("2+2=") == BYTES.encode_ordinary("2+2=") and enc.eot_token == EOT
    run_prep(
        "jsonl",
        rows,
        tmp_path / "g",
        "--test_input",
        str(rows),
        "--tokenizer",
        str(ROOT / "data/gpt2.tiktoken"),
    )
    assert (
        load_meta(str(tmp_path / "g"))["tokenizer"] == "gpt2"
    )  # the shipped file is stored by its name


def test_progress_lines(capsys):
    assert list(data.progress(range(3), "tokenize", every=0)) == [0, 1, 2]
    assert "tokenize: 3/3 (" in capsys.readouterr().out


# ---- the shared evals: pass@k, sampled accuracy, preference accuracy


def test_pass_at_k_by_hand():
    assert data.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    assert data.pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # 1 - C(7,4) / C(10,4)
    assert data.pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the fraction correct
    assert data.pass_at_k(4, 0, 4) == 0.0 and data.pass_at_k(4, 1, 4) == 1.0
    assert data.pass_at_k(6, 4, 3) == 1.0  # n - c < k: every 3 samples hold a correct one
    assert data.pass_at_k(1000, 1, 500) == pytest.approx(0.5)  # C(1000, 500) overflows a float
    for bad in [(4, 1, 5), (4, 1, 0), (4, 5, 1)]:
        with pytest.raises(ValueError):
            data.pass_at_k(*bad)


def peaked_model(logit_of: dict):
    """A tiny GPT whose next-token logits are the same at every position: ln_f outputs e_0, so the
    logits are wte[:, 0], set to logit_of[token] (0 for every other token)."""
    model = gpt2.load("tiny", dict(vocab_size=257, eos_token_id=EOT, pad_token_id=EOT))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()[0] = 1
        model.transformer.wte.weight[:, 0] = 0
        for token, logit in logit_of.items():
            model.transformer.wte.weight[token, 0] = logit
    return model


def test_sampled_accuracy_equals_a_hand_loop():
    """Each step writes "5" or stops with probability 1/2; by inverse CDF "5" (id 53 < stop 256) is
    sampled where u < 1/2. Prompts want "" or "5"; pass@k from the binomials, prompt by prompt."""
    model = peaked_model({ord("5"): 30.0, EOT: 30.0})
    prompts = dict(load_split("arithmetic", "prompt_test"))
    prompts["ground_truth"] = np.array(["", "5"] * (len(prompts["query"]) // 2))
    n, samples, length, seed = 12, 6, 4, 3
    got = data.sampled_accuracy(
        model, prompts, arithmetic.META, n, 5, length, nullcontext(), samples, 1.0, seed
    )
    assert list(got) == [f"eval/pass@{k}" for k in (1, 2, 4, 6)] + ["eval/mean@6"]
    noise = np.random.default_rng([seed, data.EVAL_STREAM]).random((n, samples, length), np.float32)
    want = {k: 0.0 for k in got}
    for p in range(n):
        fives = (noise[p] < 0.5).cumprod(1).sum(1)  # (samples,): the 5s before the first stop
        c = int(sum("5" * f == prompts["ground_truth"][p] for f in fives))
        for k in (1, 2, 4, 6):
            want[f"eval/pass@{k}"] += (1 - comb(samples - c, k) / comb(samples, k)) / n
        want["eval/mean@6"] += c / samples / n
    assert got == pytest.approx(want, abs=1e-12)
    assert 0 < got["eval/pass@1"] < got["eval/pass@2"] < got["eval/pass@6"] < 1  # not degenerate
    assert got["eval/pass@1"] == pytest.approx(got["eval/mean@6"], abs=1e-12)


def test_sampled_accuracy_of_a_model_that_is_always_right_or_always_wrong():
    model = peaked_model({EOT: 30.0})  # it always stops at once: the answer ""
    prompts = dict(load_split("arithmetic", "prompt_test"))
    for truth, want in [("", 1.0), ("5", 0.0)]:
        prompts["ground_truth"] = np.array([truth] * len(prompts["query"]))
        got = data.sampled_accuracy(
            model, prompts, arithmetic.META, 8, 16, 4, nullcontext(), 4, 2.0, 1
        )
        assert got == {"eval/pass@1": want, "eval/pass@2": want, "eval/pass@4": want} | {
            "eval/mean@4": want
        }


def test_sampled_accuracy_samples_through_the_top_p_filter():
    """The stop has probability 0.73 a step and "5" 0.27: top_p 0.5 keeps only the stop, so every
    response is "" and right; unfiltered, some responses write a "5" and are wrong."""
    model = peaked_model({ord("5"): 29.0, EOT: 30.0})
    prompts = dict(load_split("arithmetic", "prompt_test"))
    prompts["ground_truth"] = np.array([""] * len(prompts["query"]))
    for top_p, right in [(0.5, True), (1.0, False)]:
        got = data.sampled_accuracy(
            model, prompts, arithmetic.META, 8, 16, 4, nullcontext(), 4, 1.0, 1, top_p=top_p
        )
        assert (got["eval/mean@4"] == 1.0) == right


def test_preference_accuracy_counts_ties_half():
    logps = torch.tensor([[-1.0, -2.0], [-3.0, -1.0], [-2.0, -2.0], [-4.0, -5.0]])
    ref = torch.tensor([[-1.5, -1.5], [-3.0, -1.0], [-1.0, -3.0], [-4.0, -4.0]])
    # r = logps - ref: chosen first, tie, rejected first, chosen first
    assert data.preference_accuracy(logps, ref) == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert data.preference_accuracy(logps, logps) == 0.5  # a policy equal to its reference
    assert data.preference_accuracy(logps, torch.zeros(4, 2)) == pytest.approx(
        (1 + 0 + 0.5 + 1) / 4
    )


def test_eval_split_is_the_first_rows_or_none(tmp_path):
    splits = arithmetic.build(sizes=dict(sft_train=4, sft_test=4))
    data.write_dataset(str(tmp_path / "d"), arithmetic.META, splits)
    head = data.eval_split(str(tmp_path / "d"), "sft_test", 3)
    assert np.array_equal(head["query"], splits["sft_test"]["query"][:3])
    assert data.eval_split(str(tmp_path / "d"), "pref_test", 3) is None  # not prepped
    assert data.eval_split("arithmetic", "pref_test", 0) is None  # no eval
    assert len(data.eval_split("arithmetic", "pref_test", 5)["chosen"]) == 5
