"""Corpus -> Megatron indexed dataset (PREFIX.bin + PREFIX.idx, see `indexed`), tokenised by worker processes.

    python -m hpctrain.data.prepare --input PATH [PATH ...] --output PREFIX
        [--tokenizer tokenizer.json | --vocab-size N] [--workers N] [--text-key text] [--no-eod]
        [--eod-token TOKEN] [--dtype uint16] [--max-documents N] [--overwrite] [--quiet]

Inputs, documents in the order given (so the dataset is a function of the command line):
  - a JSON lines file (.jsonl, .json, either gzipped): one document per line, its `--text-key` field;
  - a directory saved by Hugging Face `datasets` (save_to_disk): its `train` split, or the split directory given;
  - any other file (gzipped or not): one document;
  - a directory: its files, walked in sorted order (hidden ones left out), each read as above;
  - `stdlib` (the word; ./stdlib is a path): the standard library's .py files, one document each: a corpus
    with no download.
Text must be UTF-8. Documents that tokenise to nothing are left out (megatron's preprocess_data keeps them as
documents of no sequence: nothing trains on them either way).

The tokenizer is a Hugging Face `tokenizers` tokenizer.json, or, without one, a byte-level BPE trained on the
corpus itself and saved as PREFIX.tokenizer.json (byte-level: every text round-trips exactly). Each document is
one sequence followed by the end-of-document token. Special tokens in the text are encoded as plain text: a
document that quotes `<|endoftext|>` must not gain a document boundary.

Why worker processes, each tokenizing on one thread (RAYON_NUM_THREADS=1), rather than one process and
tokenizers' own threads: the Python around each call (encodings into arrays, a few % of the time) runs on every
core instead of queuing behind one GIL, which would cap the speed-up on a many-core login node; and the workers
tokenise while the parent reads the corpus, hands out chunks and writes the results, in order. At most two
chunks per worker are in flight, so memory stays flat whatever the corpus size. bench/bench_prepare.py measures
both against the tokenizer's own one-thread rate.

Anything wrong (an input, the tokenizer, the output) stops the run with a `PrepareError` naming the file (and
line or byte), and leaves no dataset, half-written or not.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

import numpy as np
import tqdm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hpctrain.data.indexed import CODES, IndexedDatasetWriter, bin_path, idx_path, optimal_dtype
from hpctrain.data.sources import stdlib_sources

STDLIB = "stdlib"
JSON_LINES = (".jsonl", ".json")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TOKEN_DTYPES = sorted(dtype.name for dtype in CODES if dtype.kind in "iu")
CHUNK_CHARS = 1 << 18  # a few tenths of a second of one worker's time: fine-grained enough to balance workers

Source = Callable[[], Iterator[str]]  # an input's documents, read when called


class PrepareError(ValueError):
    """A corpus, tokenizer or output that cannot make a dataset; the message says which and where."""


@dataclass
class Summary:
    documents: int
    tokens: int
    vocab_size: int
    dtype: str
    seconds: float
    tokenizer: str
    prefix: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"{self.prefix}: {self.documents:,} documents, {self.tokens:,} tokens, vocabulary "
                f"{self.vocab_size:,} ({self.dtype}), {self.seconds:.1f} s, {self.tokens_per_second:,.0f} tokens/s; "
                f"tokenizer {self.tokenizer}")


def stdlib_documents() -> Iterator[str]:
    """The standard library's .py files, one document each."""
    for path in stdlib_sources():
        yield _decode(path.read_bytes(), path)


def _decode(data: bytes, path: Path, line: int | None = None, offset: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"line {line}, " if line is not None else ""
        raise PrepareError(f"{path}: not UTF-8 ({where}byte offset {offset + err.start})") from None


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _is_json_lines(path: Path) -> bool:
    return (path.with_suffix("") if path.suffix == ".gz" else path).suffix in JSON_LINES


def _text_file(path: Path) -> Iterator[str]:
    with _open(path) as f:
        yield _decode(f.read(), path)


def _json_lines(path: Path, text_key: str) -> Iterator[str]:
    offset = 0
    with _open(path) as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    record = json.loads(_decode(raw.rstrip(b"\r\n"), path, number, offset))
                except json.JSONDecodeError as err:
                    raise PrepareError(f"{path}:{number}: invalid JSON: {err.msg}: column {err.colno}") from None
                if not isinstance(record, dict) or text_key not in record:
                    fields = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                    raise PrepareError(f"{path}:{number}: no field {text_key!r} (it has: {fields}); choose the "
                                       "field with --text-key")
                text = record[text_key]
                if not isinstance(text, str):
                    raise PrepareError(f"{path}:{number}: field {text_key!r} is {type(text).__name__}, not text")
                try:
                    text.encode()
                except UnicodeEncodeError as err:  # a lone surrogate escape (\ud800): the tokenizer would fail on it
                    raise PrepareError(f"{path}:{number}: field {text_key!r} is not valid Unicode: "
                                       f"{err.object[err.start]!r} at character {err.start}") from None
                yield text
            offset += len(raw)


def _hf_dataset(path: Path, text_key: str) -> Source:
    """`datasets` is imported here only: an optional dependency, and a second of import time."""
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"{path} is a Hugging Face datasets directory; reading it needs the datasets package: "
                           "pip install hpctrain[data]") from None

    def read() -> Iterator[str]:
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise PrepareError(f"{path}: splits {', '.join(data)} and no 'train'; give the directory of the "
                                   f"split to read as the input, e.g. {path / next(iter(data))}")
            data = data["train"]
        if text_key not in data.column_names:
            raise PrepareError(f"{path}: no column {text_key!r} (it has: {', '.join(data.column_names)}); choose "
                               "the column with --text-key")
        row = 0
        for batch in data.select_columns([text_key]).iter(batch_size=1024):
            for text in batch[text_key]:
                if not isinstance(text, str):
                    raise PrepareError(f"{path}: row {row}: column {text_key!r} is {type(text).__name__}, not text")
                yield text
                row += 1
    return read


def _file(path: Path, text_key: str) -> Source:
    return (lambda: _json_lines(path, text_key)) if _is_json_lines(path) else (lambda: _text_file(path))


def _sources(inputs: Sequence[str | Path], text_key: str) -> list[Source]:
    """Each input checked (it exists; a datasets directory can be read) before anything runs."""
    if not inputs:
        raise PrepareError("no input given")
    sources: list[Source] = []
    for given in inputs:
        path = Path(given)
        if str(given) == STDLIB:
            sources.append(stdlib_documents)
        elif path.is_dir() and any((path / marker).is_file() for marker in HF_MARKERS):
            sources.append(_hf_dataset(path, text_key))
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            sources.extend(_file(p, text_key) for p in files)
        elif path.is_file():
            sources.append(_file(path, text_key))
        else:
            raise PrepareError(f"input {given}: no such file or directory")
    return sources


def _documents(sources: list[Source], max_documents: int | None) -> Iterator[str]:
    documents = itertools.chain.from_iterable(source() for source in sources)
    try:
        yield from itertools.islice(documents, max_documents)
    except (OSError, EOFError) as err:  # unreadable, or a damaged gzip stream
        raise PrepareError(f"cannot read the input: {err}") from None


def train_tokenizer(texts: Iterable[str], vocab_size: int, progress: bool = False) -> Tokenizer:
    """A GPT-2-style byte-level BPE: no unknown tokens, exact decoding, <|endoftext|> as the end of document."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKENS[0]], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _load_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a missing or malformed file
        raise PrepareError(f"tokenizer {path}: cannot load it: {err}") from None


def _eod_id(tokenizer: Tokenizer, eod_token: str | None, path: Path) -> int:
    for token in [eod_token] if eod_token else EOD_TOKENS:
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    if eod_token:
        raise PrepareError(f"tokenizer {path}: no token {eod_token!r}")
    raise PrepareError(f"tokenizer {path}: no usual end-of-document token ({', '.join(EOD_TOKENS)}); name one "
                       "with --eod-token, or pass --no-eod")


def _token_dtype(tokenizer: Tokenizer, dtype: str | None, path: Path) -> np.dtype:
    """megatron's choice for the vocabulary, unless one is asked for; refused when an id would not fit."""
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values())
    if dtype is None:
        return optimal_dtype(largest + 1)
    if dtype not in TOKEN_DTYPES:
        raise PrepareError(f"dtype {dtype}: not a token dtype ({', '.join(TOKEN_DTYPES)})")
    if largest > np.iinfo(dtype).max:
        raise PrepareError(f"tokenizer {path}: ids up to {largest} do not fit --dtype {dtype} (at most "
                           f"{np.iinfo(dtype).max}); leave --dtype out to get one that fits")
    return np.dtype(dtype)


def _output_prefix(output: str | Path, overwrite: bool, trains: bool) -> Path:
    prefix = Path(output)
    if prefix.suffix in (".bin", ".idx"):
        raise PrepareError(f"output {output}: give the prefix; PREFIX.bin and PREFIX.idx are written")
    outputs = [bin_path(prefix), idx_path(prefix)] + ([_tokenizer_path(prefix)] if trains else [])
    taken = [p for p in outputs if p.exists()]
    if taken and not overwrite:
        raise PrepareError(f"output {taken[0]} exists; pass --overwrite to replace it")
    return prefix


def _tokenizer_path(prefix: Path) -> Path:
    return Path(f"{prefix}.tokenizer.json")


def _save_atomically(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_worker: tuple[Tokenizer, int | None, np.dtype] | None = None


def _start_worker(tokenizer_json: str, eod: int | None, dtype: str) -> None:
    """Once per worker process: one tokenizing thread (the pool starts at the first encode, after this)."""
    global _worker
    os.environ["RAYON_NUM_THREADS"] = "1"
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True
    _worker = (tokenizer, eod, np.dtype(dtype))


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A chunk of documents -> (tokens per document, their tokens concatenated), empty documents left out."""
    assert _worker is not None, "_start_worker runs first"
    tokenizer, eod, dtype = _worker
    ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    ids = [doc + [eod] if eod is not None else doc for doc in ids if doc]
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    return lengths, np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum()))


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _tokenize(texts: Iterable[str], writer: IndexedDatasetWriter, tokenizer: Tokenizer, eod: int | None,
              workers: int, bar: tqdm.tqdm) -> tuple[int, int]:
    """(documents, tokens) written. Not Pool.imap: it reads its whole input ahead, the corpus into memory."""
    documents = tokens = 0

    def write(result: AsyncResult) -> None:
        nonlocal documents, tokens
        lengths, ids = result.get()
        writer.add_documents(lengths, ids)
        documents, tokens = documents + lengths.size, tokens + ids.size
        bar.update(ids.size)

    context = multiprocessing.get_context("spawn")  # no fork: the parent may hold tokenizers' threads
    with context.Pool(workers, _start_worker, (tokenizer.to_str(), eod, writer.dtype.name)) as pool:
        pending: deque[AsyncResult] = deque()
        for chunk in _chunks(texts):
            pending.append(pool.apply_async(_encode, (chunk,)))
            if len(pending) >= 2 * workers:
                write(pending.popleft())
        while pending:
            write(pending.popleft())
    return documents, tokens


def prepare(inputs: Sequence[str | Path], output: str | Path, tokenizer: str | Path | None = None,
            vocab_size: int = 8192, workers: int = 1, text_key: str = "text", eod: bool = True,
            progress: bool = True, *, eod_token: str | None = None, dtype: str | None = None,
            overwrite: bool = False, max_documents: int | None = None) -> Summary:
    """Tokenise `inputs` into the dataset `output` (a prefix); train a tokenizer when none is given. Raises
    PrepareError, leaving no dataset behind, when the corpus, the tokenizer or the output is unusable. The
    workers are spawned processes: a script that calls this needs the `if __name__ == "__main__":` guard."""
    started = time.perf_counter()
    if workers < 1:
        raise PrepareError(f"workers must be at least 1, not {workers}")
    sources = _sources(inputs, text_key)
    prefix = _output_prefix(output, overwrite, trains=tokenizer is None)
    show = progress and sys.stderr.isatty()
    if tokenizer is None:
        tokenizer_path = _tokenizer_path(prefix)
        texts = _documents(sources, max_documents)
        first = next((text for text in texts if text), None)
        if first is None:
            raise PrepareError(f"no text in the input ({', '.join(map(str, inputs))})")
        tok = train_tokenizer(itertools.chain([first], texts), vocab_size, show)
    else:
        tokenizer_path = Path(tokenizer)
        tok = _load_tokenizer(tokenizer_path)
    eod_id = _eod_id(tok, eod_token, tokenizer_path) if eod else None
    token_dtype = _token_dtype(tok, dtype, tokenizer_path)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, token_dtype) as writer, \
            tqdm.tqdm(unit="tok", unit_scale=True, file=sys.stderr, disable=not show, desc=prefix.name) as bar:
        documents, tokens = _tokenize(_documents(sources, max_documents), writer, tok, eod_id, workers, bar)
        if documents == 0:
            raise PrepareError(f"no text in the input ({', '.join(map(str, inputs))}): nothing tokenised")
        if tokenizer is None:
            _save_atomically(tok.to_str(), tokenizer_path)  # before the .idx: the dataset's commit point
        try:
            writer.finalize()
        except BaseException:
            if tokenizer is None:
                tokenizer_path.unlink(missing_ok=True)
            raise
    return Summary(documents=documents, tokens=tokens, vocab_size=tok.get_vocab_size(with_added_tokens=True),
                   dtype=token_dtype.name, seconds=time.perf_counter() - started, tokenizer=str(tokenizer_path),
                   prefix=str(prefix))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prepare_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help=f"files, directories, {STDLIB}")
    parser.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", type=Path, help="a tokenizers tokenizer.json (default: train a BPE)")
    which.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained when no tokenizer is given")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="tokenizing processes (default: the cores this process may use)")
    parser.add_argument("--text-key", default="text", help="the JSON field / datasets column holding the text")
    parser.add_argument("--no-eod", action="store_true", help="no end-of-document token after each document")
    parser.add_argument("--eod-token", help="the end-of-document token, when the tokenizer has no usual one")
    parser.add_argument("--dtype", choices=TOKEN_DTYPES, help="token dtype (default: megatron's choice)")
    parser.add_argument("--max-documents", type=int, help="stop after this many documents")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        summary = prepare(args.input, args.output, args.tokenizer, args.vocab_size, args.workers, args.text_key,
                          not args.no_eod, not args.quiet, eod_token=args.eod_token, dtype=args.dtype,
                          overwrite=args.overwrite, max_documents=args.max_documents)
    except PrepareError as err:
        print(f"prepare_data: {err}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
