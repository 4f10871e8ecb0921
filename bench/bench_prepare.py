#!/usr/bin/env python3
"""Data preparation throughput against the tokenizer's own rate, on the same text, measured in the same run.

The corpus: the standard library's .py files (the first --megabytes of them, default all) in one JSON lines
file, the usual input (the `stdlib` input would add its walk of the library's directory, site-packages and all:
0.6 s here), tokenised by a byte-level BPE trained on them (--vocab-size; training time shown, not counted).
  raw:     tokenizers' own encode_batch over all the documents, in a fresh process with RAYON_NUM_THREADS=1 (and
           =N for each N workers: what its own threads make of N cores); only the call is timed;
  prepare: hpctrain.data.prepare end to end with N worker processes: starting them, reading and parsing the
           file, handing out chunks, tokenising, writing the dataset and its fsyncs; the tokenizer given.
Each repeat runs every way once, in turn; medians shown. Targets: prepare per worker >= 80% of the raw
one-thread rate, and the rate growing with the workers.

    python bench/bench_prepare.py [--megabytes 4] [--workers 1 2] [--vocab-size 32768] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.data.prepare import prepare, stdlib_documents, train_tokenizer  # noqa: E402
from hpctrain.entry import EntryParser


def corpus(megabytes: float | None) -> list[str]:
    """The first stdlib documents that fit in `megabytes` (at least one), or all of them."""
    texts, size = [], 0
    for text in stdlib_documents():
        size += len(text.encode())
        if texts and megabytes is not None and size > megabytes * 1e6:
            break
        texts.append(text)
    return texts


def raw_rate(tokenizer: Path, corpus_file: Path, threads: int) -> tuple[float, int]:
    """(seconds, tokens) of one encode_batch over the corpus in a fresh process (rayon reads its thread count
    once, at its first use) with `threads` threads."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads)}
    out = subprocess.run(
        [sys.executable, __file__, "--raw", str(tokenizer), "--corpus", str(corpus_file)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = json.loads(out)
    return result["seconds"], result["tokens"]


def raw_child(tokenizer: Path, corpus_file: Path) -> None:
    """The raw measurement's own process: the tokenizer set up as prepare's workers set theirs."""
    from tokenizers import Tokenizer

    texts = [json.loads(line)["text"] for line in corpus_file.read_text().splitlines()]
    tok = Tokenizer.from_file(str(tokenizer))
    tok.encode_special_tokens = True
    started = time.perf_counter()
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "tokens": sum(len(e.ids) for e in encodings)}))


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--megabytes", type=float, help="default: all of the standard library (13 MB on 3.11)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hpctrain-bench-prepare"))
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--raw", type=Path, help=argparse.SUPPRESS)  # the raw measurement's child process
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        raw_child(args.raw, args.corpus)
        return

    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    texts = corpus(args.megabytes)
    corpus_file = args.dir / "corpus.jsonl"
    corpus_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    started = time.perf_counter()
    tokenizer = args.dir / "tokenizer.json"
    train_tokenizer(texts, args.vocab_size).save(str(tokenizer))
    trained_s = time.perf_counter() - started

    ways = [("raw", 1)] + [("raw", n) for n in args.workers if n > 1] + [("prepare", n) for n in args.workers]
    seconds: dict[tuple[str, int], list[float]] = {way: [] for way in ways}
    tokens: dict[tuple[str, int], int] = {}
    for _ in range(args.repeats):
        for kind, n in ways:
            if kind == "raw":
                s, tokens[kind, n] = raw_rate(tokenizer, corpus_file, n)
            else:
                summary = prepare(
                    [corpus_file], args.dir / f"ds{n}", tokenizer=tokenizer, workers=n, progress=False, overwrite=True
                )
                s, tokens[kind, n] = summary.seconds, summary.tokens
            seconds[kind, n].append(s)
    shutil.rmtree(args.dir, ignore_errors=True)

    rate = {way: tokens[way] / statistics.median(seconds[way]) for way in ways}
    base = rate["raw", 1]
    rows = [
        {
            "way": kind,
            "threads_or_workers": n,
            "seconds": statistics.median(seconds[kind, n]),
            "tokens": tokens[kind, n],
            "tokens_per_s": rate[kind, n],
            "per_core_vs_raw_1_thread": rate[kind, n] / n / base,
        }
        for kind, n in ways
    ]
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    if args.json:
        print(
            json.dumps(
                {
                    "documents": len(texts),
                    "megabytes": megabytes,
                    "vocab_size": args.vocab_size,
                    "train_s": trained_s,
                    "cores": len(os.sched_getaffinity(0)),
                    "rows": rows,
                },
                indent=1,
            )
        )
        return
    print(
        f"corpus: stdlib, {len(texts)} documents, {megabytes:.1f} MB; byte-level BPE of {args.vocab_size} trained "
        f"on it in {trained_s:.1f} s; {len(os.sched_getaffinity(0))} cores; median of {args.repeats}"
    )
    print(f"{'':40s} {'seconds':>8s} {'tokens':>10s} {'tokens/s':>10s}  per core vs raw 1 thread")
    for row in rows:
        n = row["threads_or_workers"]
        name = (
            f"tokenizers encode_batch, {n} thread{'s' * (n > 1)}"
            if row["way"] == "raw"
            else f"prepare, {n} worker{'s' * (n > 1)} (end to end)"
        )
        note = "  [target >= 0.80x]" if row["way"] == "prepare" else ""
        print(
            f"{name:40s} {row['seconds']:8.2f} {row['tokens']:10,d} {row['tokens_per_s']:10,.0f}  "
            f"{row['per_core_vs_raw_1_thread']:.2f}x{note}"
        )
    for n in args.workers:
        if n > 1 and 1 in args.workers:
            print(
                f"prepare scaling, {n} workers vs 1: {rate['prepare', n] / rate['prepare', 1]:.2f}x;  tokenizers' "
                f"own {n} threads vs 1: {rate['raw', n] / base:.2f}x"
            )


if __name__ == "__main__":
    main()
