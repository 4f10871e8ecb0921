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
documents of no sequence: nothing trains on them either way). A document that is not text (more than 5% of its
characters NUL or other control characters: binary data, or UTF-16 read as UTF-8) is skipped with a warning
naming its file (and line); an input of nothing else is refused.

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

A document longer than PIECE_CHARS characters (one huge line, a whole book in one file) is tokenised in pieces
of about that size, cut before a space that follows and precedes a non-space character, where a byte-level BPE's
pre-tokenizer splits anyway: its tokens are those of the whole document (a tokenizer that adds a space at the
start of every text, SentencePiece-style, gets that space dropped from the piece instead; another tokenizer is
warned that a token may differ at each cut). Without such a space near the size (a run of one character), the
cut is where the size ends. So the memory for one document is that of a piece, not of the whole document (the
Encoding of a whole 15 MB line took over 2 GB). The BPE trainer sees the pieces too, and runs of more than
WORD_CHARS non-space characters cut into words of that size: its time grows with the square of a word's length
(200 KB of one character was minutes of training for nothing).

Progress: on a terminal, a bar; otherwise (a log file, `python -m hpctrain` under nohup or tee) a line every
PROGRESS_EVERY_S seconds with the documents, tokens and inputs done, so a long preparation is never silent.

Anything wrong (an input, the tokenizer, the output) stops the run with a `PrepareError` naming the file (and
line or byte), and leaves no dataset, half-written or not. The output's directory is checked to be writable
before any work (a probe file, removed): an unwritable `--output` is said at once, not after the training.
"""

from __future__ import annotations

import gzip
import itertools
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path
from typing import BinaryIO

import numpy as np
import tqdm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hpctrain.data.indexed import CODES, IndexedDatasetWriter, bin_path, idx_path, optimal_dtype
from hpctrain.data.sources import stdlib_sources
from hpctrain.entry import EntryParser

STDLIB = "stdlib"
JSON_LINES = (".jsonl", ".json")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TOKEN_DTYPES = sorted(dtype.name for dtype in CODES if dtype.kind in "iu")
CHUNK_CHARS = 1 << 18  # a few tenths of a second of one worker's time: fine-grained enough to balance workers
PIECE_CHARS = 1 << 18  # a longer document is tokenised in pieces of about this size (memory per document)
WORD_CHARS = 256  # the BPE trainer sees no longer run of non-space characters (its time: the square of it)
BINARY_SHARE = 0.05  # a document with more NUL/control characters than this is not text: skipped
PROGRESS_EVERY_S = 10.0  # without a terminal: a progress line this often

# C0 controls but the whitespace ones (\t \n \v \f \r) and ESC (terminal colours in logs), and DEL
CONTROLS = "".join(chr(c) for c in [*range(0x00, 0x09), *range(0x0E, 0x1B), *range(0x1C, 0x20), 0x7F])
_CONTROL = re.compile(f"[{re.escape(CONTROLS)}]")
_CLEAN_CUT = re.compile(r"(?<=\S) (?=\S)")  # a space between two non-spaces: pre-tokenizers split before it

Document = tuple[str, str]  # (text, where it is: the file, file:line, directory: row)
Source = Callable[[], Iterator[Document]]  # an input's documents, read when called


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
    skipped: list[str] = field(default_factory=list)  # documents left out as not text, where each is

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"{self.prefix}: {self.documents:,} documents, {self.tokens:,} tokens, vocabulary "
            f"{self.vocab_size:,} ({self.dtype}), {self.seconds:.1f} s, {self.tokens_per_second:,.0f} tokens/s; "
            f"tokenizer {self.tokenizer}"
            + (
                f"; {len(self.skipped):,} skipped as not text ({self.skipped[0]}"
                + (", ..." if len(self.skipped) > 1 else "")
                + ")"
                if self.skipped
                else ""
            )
        )


def stdlib_documents() -> Iterator[str]:
    """The standard library's .py files, one document each."""
    for text, _ in _stdlib():
        yield text


def _stdlib() -> Iterator[Document]:
    for path in stdlib_sources():
        yield _decode(path.read_bytes(), path), str(path)


def _decode(data: bytes, path: Path, line: int | None = None, offset: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"line {line}, " if line is not None else ""
        raise PrepareError(f"{path}: not UTF-8 ({where}byte offset {offset + err.start})") from None


def _open(path: Path) -> gzip.GzipFile | BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _is_json_lines(path: Path) -> bool:
    return (path.with_suffix("") if path.suffix == ".gz" else path).suffix in JSON_LINES


def _text_file(path: Path) -> Iterator[Document]:
    with _open(path) as f:
        yield _decode(f.read(), path), str(path)


def _json_lines(path: Path, text_key: str) -> Iterator[Document]:
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
                    raise PrepareError(
                        f"{path}:{number}: no field {text_key!r} (it has: {fields}); choose the field with --text-key"
                    )
                text = record[text_key]
                if not isinstance(text, str):
                    raise PrepareError(f"{path}:{number}: field {text_key!r} is {type(text).__name__}, not text")
                try:
                    text.encode()
                except UnicodeEncodeError as err:  # a lone surrogate escape (\ud800): the tokenizer would fail on it
                    raise PrepareError(
                        f"{path}:{number}: field {text_key!r} is not valid Unicode: "
                        f"{err.object[err.start]!r} at character {err.start}"
                    ) from None
                yield text, f"{path}:{number}"
            offset += len(raw)


def _hf_dataset(path: Path, text_key: str) -> Source:
    """`datasets` is imported here only: an optional dependency, and a second of import time."""
    try:
        import datasets
    except ImportError:
        raise PrepareError(
            f"{path} is a Hugging Face datasets directory; reading it needs the datasets package: "
            "pip install hpctrain[data]"
        ) from None

    def read() -> Iterator[Document]:
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise PrepareError(
                    f"{path}: splits {', '.join(data)} and no 'train'; give the directory of the "
                    f"split to read as the input, e.g. {path / next(iter(data))}"
                )
            data = data["train"]
        if text_key not in data.column_names:
            raise PrepareError(
                f"{path}: no column {text_key!r} (it has: {', '.join(data.column_names)}); choose "
                "the column with --text-key"
            )
        row = 0
        for batch in data.select_columns([text_key]).iter(batch_size=1024):
            for text in batch[text_key]:
                if not isinstance(text, str):
                    raise PrepareError(f"{path}: row {row}: column {text_key!r} is {type(text).__name__}, not text")
                yield text, f"{path}: row {row}"
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
            sources.append(_stdlib)
        elif path.is_dir() and any((path / marker).is_file() for marker in HF_MARKERS):
            sources.append(_hf_dataset(path, text_key))
        elif path.is_dir():
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            sources.extend(_file(p, text_key) for p in files)
        elif path.is_file():
            sources.append(_file(path, text_key))
        else:
            raise PrepareError(f"input {given}: no such file or directory")
    return sources


def _not_text(text: str) -> float:
    """The share of the text's characters that are NUL or other control characters (0 for any real text)."""
    if not text or _CONTROL.search(text) is None:
        return 0.0
    return sum(text.count(c) for c in CONTROLS) / len(text)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class _Progress:
    """What a long preparation has done, as it goes: on a terminal a bar (and the BPE trainer's own); otherwise
    a line on stderr every PROGRESS_EVERY_S seconds and at the end of each phase (a job's log, `tee`)."""

    def __init__(self, enabled: bool, label: str, inputs: int, every: float | None = None) -> None:
        self.tty = enabled and sys.stderr.isatty()
        self.lines = enabled and not self.tty
        self.label, self.inputs, self.every = label, inputs, PROGRESS_EVERY_S if every is None else every
        self.bar: tqdm.tqdm | None = None
        self.start("reading")

    def start(self, phase: str) -> None:
        self.phase, self.documents, self.tokens, self.chars, self.inputs_done = phase, 0, 0, 0, 0
        self.started = self.last = time.monotonic()
        if self.tty and phase == "tokenising":
            self.bar = tqdm.tqdm(unit="tok", unit_scale=True, file=sys.stderr, desc=self.label)

    def read(self, chars: int) -> None:
        """A document read (training: what the trainer has been given)."""
        if self.phase != "tokenising":
            self.documents, self.chars = self.documents + 1, self.chars + chars
            self._tick()

    def input_done(self, done: int) -> None:
        self.inputs_done = done
        self._tick()

    def wrote(self, documents: int, tokens: int) -> None:
        self.documents, self.tokens = self.documents + documents, self.tokens + tokens
        if self.bar is not None:
            self.bar.update(tokens)
        self._tick()

    def line(self, what: str = "") -> None:
        if not self.lines:
            return
        done = (
            f"{self.documents:,} documents, {self.tokens:,} tokens"
            if self.phase == "tokenising"
            else f"{self.documents:,} documents read ({self.chars / 1e6:,.1f} MB of text)"
        )
        print(
            f"{self.label}: {self.phase}: {done}, input {self.inputs_done}/{self.inputs}, "
            f"{time.monotonic() - self.started:,.0f} s{'; ' + what if what else ''}",
            file=sys.stderr,
            flush=True,
        )
        self.last = time.monotonic()

    def _tick(self) -> None:
        if self.lines and time.monotonic() - self.last >= self.every:
            self.line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _Reader:
    """The inputs' documents, in order, the same on every pass (training, then tokenising): at most
    `max_documents`; a document that is not text skipped, with a warning naming it on the first pass."""

    def __init__(self, sources: list[Source], max_documents: int | None, progress: _Progress) -> None:
        self.sources, self.max_documents, self.progress = sources, max_documents, progress
        self.skipped: list[str] = []
        self.passes = 0

    def __call__(self) -> Iterator[Document]:
        first, count = self.passes == 0, 0
        self.passes += 1
        try:
            for done, source in enumerate(self.sources, 1):
                for text, where in source():
                    if self.max_documents is not None and count >= self.max_documents:
                        return
                    count += 1
                    share = _not_text(text)
                    if share > BINARY_SHARE:
                        if first:
                            self.skipped.append(where)
                            _warn(
                                f"{where}: skipped, not text: {share:.0%} of its {len(text):,} characters are "
                                "NUL or other control characters (binary data, or UTF-16: convert text to UTF-8)"
                            )
                        continue
                    self.progress.read(len(text))
                    yield text, where
                self.progress.input_done(done)
        except (OSError, EOFError) as err:  # unreadable, or a damaged gzip stream
            raise PrepareError(f"cannot read the input: {err}") from None

    def nothing(self, inputs: Sequence[str | Path], what: str = "") -> PrepareError:
        """The error for inputs with no text, saying which documents were skipped as not text."""
        skipped = (
            ""
            if not self.skipped
            else (
                f"; {len(self.skipped):,} document(s) skipped as not text (NUL or control characters): "
                + ", ".join(self.skipped[:3])
                + (", ..." if len(self.skipped) > 3 else "")
            )
        )
        return PrepareError(f"no text in the input ({', '.join(map(str, inputs))}){what}{skipped}")


def _cut(text: str, start: int, size: int) -> tuple[int, bool]:
    """Where the piece of `text` from `start` ends, and whether the cut is clean: the last space between two
    non-spaces in the piece's last quarter (near the end first: most text has one there), else `start + size`."""
    end = start + size
    for low in (end - 1024, start + size * 3 // 4):
        last = None
        for last in _CLEAN_CUT.finditer(text, max(low, start + 1), end):  # noqa: B007 (the loop keeps the last)
            pass
        if last is not None:
            return last.start(), True
    return end, False


def _pieces(text: str, size: int, drop: bool = False) -> Iterator[str]:
    """`text` in pieces of at most `size` characters, cut cleanly where it can (`_cut`); `drop`: the space of a
    clean cut is left out (a tokenizer that puts one before every text puts it back)."""
    start = 0
    while len(text) - start > size:
        cut, clean = _cut(text, start, size)
        yield text[start:cut]
        start = cut + 1 if drop and clean else cut
    yield text[start:]


def _training_texts(documents: Iterable[Document]) -> Iterator[str]:
    """What the BPE trainer reads: each document in pieces, runs of non-space characters longer than WORD_CHARS
    cut into words of that size (a run of 200,000 NULs trained for minutes and made one token)."""
    long_run = re.compile(rf"(?<!\S)\S{{{WORD_CHARS + 1},}}")
    for text, _ in documents:
        for piece in _pieces(text, PIECE_CHARS):
            if max(map(len, piece.split()), default=0) <= WORD_CHARS:  # 3x faster than the regex's search
                yield piece
                continue
            position = 0
            for run in long_run.finditer(piece):
                if run.start() > position:
                    yield piece[position : run.start()]
                yield from (
                    piece[i : min(i + WORD_CHARS, run.end())] for i in range(run.start(), run.end(), WORD_CHARS)
                )
                position = run.end()
            if position < len(piece):
                yield piece[position:]


def train_tokenizer(texts: Iterable[str], vocab_size: int, progress: bool = False) -> Tokenizer:
    """A GPT-2-style byte-level BPE: no unknown tokens, exact decoding, <|endoftext|> as the end of document."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKENS[0]],
        show_progress=progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _load_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a missing or malformed file
        raise PrepareError(f"tokenizer {path}: cannot load it: {err}") from None


def _eod_id(tokenizer: Tokenizer, eod_token: str | None, path: Path) -> int:
    for token in [eod_token] if eod_token else EOD_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    if eod_token:
        raise PrepareError(f"tokenizer {path}: no token {eod_token!r}")
    raise PrepareError(
        f"tokenizer {path}: no usual end-of-document token ({', '.join(EOD_TOKENS)}); name one "
        "with --eod-token, or pass --no-eod"
    )


def _token_dtype(tokenizer: Tokenizer, dtype: str | None, path: Path) -> np.dtype:
    """megatron's choice for the vocabulary, unless one is asked for; refused when an id would not fit."""
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values())
    if dtype is None:
        return optimal_dtype(largest + 1)
    if dtype not in TOKEN_DTYPES:
        raise PrepareError(f"dtype {dtype}: not a token dtype ({', '.join(TOKEN_DTYPES)})")
    if largest > np.iinfo(dtype).max:
        raise PrepareError(
            f"tokenizer {path}: ids up to {largest} do not fit --dtype {dtype} (at most "
            f"{np.iinfo(dtype).max}); leave --dtype out to get one that fits"
        )
    return np.dtype(dtype)


def _output_prefix(output: str | Path, overwrite: bool, trains: bool) -> Path:
    prefix = Path(output)
    if prefix.suffix in (".bin", ".idx"):
        raise PrepareError(f"output {output}: give the prefix; PREFIX.bin and PREFIX.idx are written")
    outputs = [bin_path(prefix), idx_path(prefix)] + ([_tokenizer_path(prefix)] if trains else [])
    taken = [p for p in outputs if p.exists()]
    if taken and not overwrite:
        raise PrepareError(f"output {taken[0]} exists; pass --overwrite to replace it")
    _check_writable(prefix)
    return prefix


def _check_writable(prefix: Path) -> None:
    """Before any work (training a tokenizer can take minutes): the output's directory can be made and written
    in (a probe file, removed), else a PrepareError naming it and the fix. Leaves nothing: the directories it
    made go again (the dataset's are made when it is written)."""
    fix = (
        "give --output a prefix in a directory you can write (your home, the cluster's shared scratch), or make "
        "that directory writable"
    )
    parent, made = prefix.parent, []
    try:
        missing = []
        existing = parent
        while not existing.exists() and existing != existing.parent:
            missing.append(existing)
            existing = existing.parent
        if not existing.is_dir():
            raise PrepareError(f"output {prefix}: {existing} is a file, not a directory; {fix}")
        for directory in reversed(missing):
            try:
                directory.mkdir()
            except OSError as err:
                raise PrepareError(
                    f"output {prefix}: cannot create the directory {directory} ({err.strerror}); {fix}"
                ) from None
            made.append(directory)
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{prefix.name}.", suffix=".probe", dir=parent)
        except OSError as err:
            raise PrepareError(f"output {prefix}: cannot write in {parent} ({err.strerror}); {fix}") from None
        os.close(fd)
        os.unlink(probe)
    except OSError as err:  # a directory on the way that cannot be looked into
        raise PrepareError(f"output {prefix}: cannot reach {err.filename or parent} ({err.strerror}); {fix}") from None
    finally:
        for directory in reversed(made):
            try:
                directory.rmdir()
            except OSError:
                pass


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


def _encode_piece(text: str) -> np.ndarray:
    """A piece of a long document -> its tokens (the end of document comes after the last piece)."""
    assert _worker is not None, "_start_worker runs first"
    tokenizer, _, dtype = _worker
    return np.array(tokenizer.encode(text, add_special_tokens=False).ids, dtype)


def _split_mode(tokenizer: Tokenizer) -> str:
    """How the pieces of a long document keep its tokens, tried on a few texts: "space" (a cut before a space
    changes nothing: byte-level pre-tokenizers split there anyway), "drop" (the tokenizer puts a space before
    every text itself, SentencePiece-style: the cut's space goes), else "inexact" (warned when a cut is made)."""
    probes = [("Hello", " world"), ("x = f(1);", " y"), ("end.", " Next"), ("4096", " 42"), ("naïve", " café")]

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    if all(ids(left + right) == ids(left) + ids(right) for left, right in probes):
        return "space"
    if all(ids(left + right) == ids(left) + ids(right[1:]) for left, right in probes):
        return "drop"
    return "inexact"


Work = tuple[str, "list[str] | str", bool]  # ("documents", whole documents, True) or ("piece", text, last?)


def _chunks(documents: Iterable[Document], mode: str = "space") -> Iterator[Work]:
    """What the workers get, in order: whole documents up to about CHUNK_CHARS characters, and a document
    longer than PIECE_CHARS as its pieces, one item each (a worker never holds a whole huge document)."""
    chunk: list[str] = []
    size = 0
    for text, where in documents:
        if len(text) > PIECE_CHARS:
            if chunk:
                yield "documents", chunk, True
                chunk, size = [], 0
            if mode == "inexact":
                _warn(
                    f"{where}: {len(text):,} characters, tokenised in pieces of about {PIECE_CHARS:,}: with this "
                    "tokenizer a token may differ from a whole-document encoding at each of the cuts"
                )
            pieces = _pieces(text, PIECE_CHARS, drop=mode == "drop")
            piece = next(pieces)
            for following in pieces:
                yield "piece", piece, False
                piece = following
            yield "piece", piece, True
            continue
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield "documents", chunk, True
            chunk, size = [], 0
    if chunk:
        yield "documents", chunk, True


def _tokenize(
    work: Iterable[Work],
    writer: IndexedDatasetWriter,
    tokenizer: Tokenizer,
    eod: int | None,
    workers: int,
    progress: _Progress,
) -> tuple[int, int]:
    """(documents, tokens) written. Not Pool.imap: it reads its whole input ahead, the corpus into memory. The
    pieces of a long document come back in order: their tokens are held (as the dataset's dtype) until the last."""
    documents = tokens = 0
    held: list[np.ndarray] = []

    def write(kind: str, result: AsyncResult, last: bool) -> None:
        nonlocal documents, tokens
        if kind == "documents":
            lengths, ids = result.get()
        else:
            held.append(result.get())
            if not last:
                return
            ids = (
                np.concatenate(held + [np.array([] if eod is None else [eod], writer.dtype)])
                if sum(part.size for part in held)
                else np.zeros(0, writer.dtype)
            )
            held.clear()
            lengths = np.array([ids.size] if ids.size else [], np.int64)
        writer.add_documents(lengths, ids)
        documents, tokens = documents + lengths.size, tokens + ids.size
        progress.wrote(lengths.size, ids.size)

    context = multiprocessing.get_context("spawn")  # no fork: the parent may hold tokenizers' threads
    with _finished(context.Pool(workers, _start_worker, (tokenizer.to_str(), eod, writer.dtype.name))) as pool:
        pending: deque[tuple[str, AsyncResult, bool]] = deque()
        for kind, payload, last in work:
            pending.append(
                (kind, pool.apply_async(_encode if kind == "documents" else _encode_piece, (payload,)), last)
            )
            if len(pending) >= 2 * workers:
                write(*pending.popleft())
        while pending:
            write(*pending.popleft())
    return documents, tokens


@contextmanager
def _finished(pool: Pool) -> Iterator[Pool]:
    """The pool, closed and joined when the block ends, also by an error: the tasks still in flight (at most two per
    worker) finish, then the workers exit. `Pool.__exit__` terminates instead, and terminating with tasks in flight
    can leave CPython's task-handler thread waiting for the input queue's lock for ever (seen once in the test
    suite, Python 3.11: a bad line half-way through a corpus hung `prepare`). An interrupt still terminates."""
    try:
        yield pool
    except Exception:
        pool.close()
        pool.join()
        raise
    except BaseException:
        pool.terminate()
        raise
    pool.close()
    pool.join()


def prepare(
    inputs: Sequence[str | Path],
    output: str | Path,
    tokenizer: str | Path | None = None,
    vocab_size: int = 8192,
    workers: int = 1,
    text_key: str = "text",
    eod: bool = True,
    progress: bool = True,
    *,
    eod_token: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    max_documents: int | None = None,
    progress_every: float | None = None,
) -> Summary:
    """Tokenise `inputs` into the dataset `output` (a prefix); train a tokenizer when none is given. Raises
    PrepareError, leaving no dataset behind, when the corpus, the tokenizer or the output is unusable. The
    workers are spawned processes: a script that calls this needs the `if __name__ == "__main__":` guard.
    `progress`: a bar on a terminal, else a line every `progress_every` seconds (PROGRESS_EVERY_S)."""
    started = time.perf_counter()
    if workers < 1:
        raise PrepareError(f"workers must be at least 1, not {workers}")
    sources = _sources(inputs, text_key)
    prefix = _output_prefix(output, overwrite, trains=tokenizer is None)
    shown = _Progress(progress, prefix.name, len(sources), progress_every)
    reader = _Reader(sources, max_documents, shown)
    if tokenizer is None:
        tokenizer_path = _tokenizer_path(prefix)
        shown.start("training the tokenizer")
        texts = _training_texts(reader())
        first = next((text for text in texts if text), None)
        if first is None:
            raise reader.nothing(inputs)
        tok = train_tokenizer(
            _then(itertools.chain([first], texts), lambda: shown.line("all read; computing the merges")),
            vocab_size,
            shown.tty,
        )
        shown.line(f"done, vocabulary {tok.get_vocab_size(with_added_tokens=True):,}")
    else:
        tokenizer_path = Path(tokenizer)
        tok = _load_tokenizer(tokenizer_path)
    eod_id = _eod_id(tok, eod_token, tokenizer_path) if eod else None
    token_dtype = _token_dtype(tok, dtype, tokenizer_path)
    mode = _split_mode(tok)
    shown.start("tokenising")
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        with IndexedDatasetWriter(prefix, token_dtype) as writer:
            documents, tokens = _tokenize(_chunks(reader(), mode), writer, tok, eod_id, workers, shown)
            if documents == 0:
                raise reader.nothing(inputs, ": nothing tokenised")
            if tokenizer is None:
                _save_atomically(tok.to_str(), tokenizer_path)  # before the .idx: the dataset's commit point
            try:
                writer.finalize()
            except BaseException:
                if tokenizer is None:
                    tokenizer_path.unlink(missing_ok=True)
                raise
    except OSError as err:  # the disk filled, the directory went read-only: no traceback, nothing left
        raise PrepareError(
            f"output {prefix}: cannot write {err.filename or prefix.parent} ({err.strerror}); free "
            "space there or give --output a prefix in a directory you can write"
        ) from None
    finally:
        shown.close()
    shown.line("done")
    return Summary(
        documents=documents,
        tokens=tokens,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        dtype=token_dtype.name,
        seconds=time.perf_counter() - started,
        tokenizer=str(tokenizer_path),
        prefix=str(prefix),
        skipped=reader.skipped,
    )


def _then(items: Iterable[str], after: Callable[[], None]) -> Iterator[str]:
    """`items`, then `after()` once they are all read."""
    yield from items
    after()


def main(argv: Sequence[str] | None = None) -> int:
    parser = EntryParser(prog="prepare_data", description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help=f"files, directories, {STDLIB}")
    parser.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", type=Path, help="a tokenizers tokenizer.json (default: train a BPE)")
    which.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained when no tokenizer is given")
    parser.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="tokenizing processes (default: the cores this process may use)",
    )
    parser.add_argument("--text-key", default="text", help="the JSON field / datasets column holding the text")
    parser.add_argument("--no-eod", action="store_true", help="no end-of-document token after each document")
    parser.add_argument("--eod-token", help="the end-of-document token, when the tokenizer has no usual one")
    parser.add_argument("--dtype", choices=TOKEN_DTYPES, help="token dtype (default: megatron's choice)")
    parser.add_argument("--max-documents", type=int, help="stop after this many documents")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        summary = prepare(
            args.input,
            args.output,
            args.tokenizer,
            args.vocab_size,
            args.workers,
            args.text_key,
            not args.no_eod,
            not args.quiet,
            eod_token=args.eod_token,
            dtype=args.dtype,
            overwrite=args.overwrite,
            max_documents=args.max_documents,
        )
    except PrepareError as err:
        print(f"prepare_data: {err}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
