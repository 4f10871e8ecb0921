"""The files a run will read, checked on the login node before anything is created or queued.

The job would find each of these problems too, but only after a queue wait, inside `FAILED.json`: here they are
reported with the config's own problems, all at once, naming the key, the file and the fix. Only what is cheap is
read: file sizes, headers, JSON files a few MB at most, never the data itself (the 175B dry run reads nothing).

- indexed datasets (`data.blend`, `data.valid_blend`): the `.idx` header, its size against the header, the
  `.bin`'s size against where the index puts its last sequence (an `.idx` of another dataset disagrees), the
  document indices' ends, and from a few entries where the validation hold-out cuts it, so that both parts hold
  a sample; `PREFIX.tokenizer.json` (written by `hpctrain.data.prepare`) against `data.vocab_size`;
- a flat tokens file (`data=tokens`): a whole number of token ids, and enough of them;
- `model.init_from`: a directory with a `config.json` that matches the model config (each differing field
  named), and safetensors files whose headers describe the model's tensors and fit the file sizes;
- `zero.nvme_path`, when this machine sees it: a writable directory with the space the moments take per node;
- a resume: the newest committed checkpoint's fingerprint (its manifest) against the config's.

No torch, no hpctrain.data or hpctrain.checkpoint (the `config` import contract): the few format facts needed are
restated here, each with a test that it agrees with the reader the job uses (tests/config/test_file_checks.py).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from omegaconf import OmegaConf

from hpctrain.bounded import CONFIG_BYTES, Unreadable, read_text
from hpctrain.checks.report import CheckReport
from hpctrain.config.layout import Layout
from hpctrain.config.schema import Config, DataConfig, DataKind, parse_blend
from hpctrain.hardware import format_bytes
from hpctrain.models.hf_fields import HFMismatch, hf_weight_shapes
from hpctrain.models.hf_fields import config_mismatches as hf_mismatches
from hpctrain.models.registry import FAMILIES, family_of, for_hf
from hpctrain.scheduler import scheduler_for

# ---------------------------------------------------------------- sizes for people


class FileProblem(Exception):
    """A file that the run cannot use; the message names the file and what is wrong."""


# ---------------------------------------------------------------- Megatron indexed datasets (hpctrain.data.indexed)

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
INDEX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices: 34 bytes
INDEX_DTYPES = {
    1: ("uint8", 1),
    2: ("int8", 1),
    3: ("int16", 2),
    4: ("int32", 4),
    5: ("int64", 8),
    6: ("float64", 8),
    7: ("float32", 4),
    8: ("uint16", 2),
}  # code -> (name, bytes per token)
_LENGTH, _POINTER = struct.Struct("<i"), struct.Struct("<q")


class IndexSummary:
    """What a few reads of an indexed dataset's `.idx` tell (header, and entries read on demand): the same facts
    hpctrain.data.indexed.IndexedDataset validates in full when the job opens the dataset."""

    def __init__(
        self,
        prefix: str,
        handle: BinaryIO,
        dtype: str,
        itemsize: int,
        sequences: int,
        document_indices: int,
        tokens: int,
    ) -> None:
        self.prefix, self._f, self.dtype, self.itemsize = prefix, handle, dtype, itemsize
        self.sequences, self.documents, self.tokens = sequences, document_indices - 1, tokens

    def close(self) -> None:
        self._f.close()

    def _entry(self, offset: int, item: struct.Struct) -> int:
        self._f.seek(offset)
        value: int = item.unpack(self._f.read(item.size))[0]
        return value

    def document_start(self, document: int) -> int:
        """The first sequence of `document` (document_indices[document])."""
        return self._entry(INDEX_HEADER.size + self.sequences * 12 + document * 8, _POINTER)

    def tokens_before(self, sequence: int) -> int:
        """Tokens of the sequences before `sequence` (its pointer: they lie back to back from byte 0)."""
        if sequence >= self.sequences:
            return self.tokens
        return self._entry(INDEX_HEADER.size + self.sequences * 4 + sequence * 8, _POINTER) // self.itemsize


def open_index(prefix: str) -> IndexSummary:
    """The header of PREFIX.idx checked against its size, and PREFIX.bin's size against where the index puts the
    end of its last sequence; FileProblem naming the file otherwise. The caller closes the summary (it reads
    entries on demand)."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx, bin_):
        if not path.is_file():
            raise FileProblem(f"{path}: not a file" if path.exists() else f"{path}: no such file")
    try:
        f = open(os.open(idx, os.O_RDONLY | os.O_NONBLOCK), "rb")  # a FIFO swapped in after is_file(): no block
    except OSError as exc:
        raise FileProblem(f"{idx}: cannot be read ({exc.strerror or exc})") from None
    try:
        size = os.fstat(f.fileno()).st_size
        if size < INDEX_HEADER.size:
            raise FileProblem(f"{idx}: {size} bytes, shorter than the {INDEX_HEADER.size}-byte header of an index")
        magic, version, code, n_seq, n_docs = INDEX_HEADER.unpack(f.read(INDEX_HEADER.size))
        if magic != INDEX_MAGIC:
            raise FileProblem(f"{idx}: not an indexed dataset index (magic {magic!r}, expected {INDEX_MAGIC!r})")
        if version != INDEX_VERSION:
            raise FileProblem(f"{idx}: version {version}, only version {INDEX_VERSION} exists")
        if code not in INDEX_DTYPES:
            raise FileProblem(f"{idx}: unknown dtype code {code} (known: {sorted(INDEX_DTYPES)})")
        dtype, itemsize = INDEX_DTYPES[code]
        expected = INDEX_HEADER.size + n_seq * 12 + n_docs * 8
        if size == expected + n_seq and n_seq:
            raise FileProblem(f"{idx}: a multimodal dataset (it has sequence modes), not supported")
        if size != expected:
            raise FileProblem(
                f"{idx}: {size} bytes, but its header ({n_seq} sequences, {n_docs} document "
                f"indices) makes it {expected}"
            )
        summary = IndexSummary(prefix, f, dtype, itemsize, n_seq, n_docs, 0)
        end = 0
        if n_seq:
            last_length = summary._entry(INDEX_HEADER.size + (n_seq - 1) * 4, _LENGTH)
            last_pointer = summary._entry(INDEX_HEADER.size + n_seq * 4 + (n_seq - 1) * 8, _POINTER)
            end = last_pointer + last_length * itemsize
        summary.tokens = end // itemsize
        first_doc = summary.document_start(0) if n_docs else -1
        last_doc = summary.document_start(n_docs - 1) if n_docs else -1
        if first_doc != 0 or last_doc != n_seq:
            raise FileProblem(
                f"{idx}: document indices must rise from 0 to the {n_seq} sequences (they run "
                f"from {first_doc} to {last_doc})"
            )
        bin_size = bin_.stat().st_size
        if bin_size != end:
            raise FileProblem(
                f"{bin_}: {bin_size:,} bytes, but {idx} ends its last sequence at byte {end:,} "
                f"({n_seq:,} sequences of {dtype}): the two files are not one dataset (an .idx of "
                "another dataset, or a copy cut short)"
            )
        return summary
    except BaseException:
        f.close()
        raise


def min_documents(valid_fraction: float) -> int:
    """The fewest documents from which `valid_fraction` holds out at least one and leaves at least one
    (hpctrain.data.loader._train_sequences: round(documents x fraction), Python's rounding)."""
    n = max(2, int(0.5 / valid_fraction) if valid_fraction > 0 else 2)
    while not 1 <= round(n * valid_fraction) < n:
        n += 1
    return n


# The largest files read whole (bytes), each a regular file (hpctrain.bounded): a tokenizer.json (Llama 3's is 9 MB,
# Gemma 3's 33 MB), a safetensors index (one line per tensor: DeepSeek-V3's is 9 MB), a checkpoint's manifest (one
# entry per file of every rank); a Hugging Face config.json (and a DeepSpeed config) at most bounded.CONFIG_BYTES.
TOKENIZER_BYTES = 128 * 2**20
INDEX_BYTES = 64 * 2**20
MANIFEST_BYTES = 256 * 2**20


def tokenizer_vocab_size(path: str | os.PathLike[str]) -> int:
    """The number of token ids a `tokenizers` tokenizer.json can produce (its highest id + 1, added tokens
    included: what `Tokenizer.get_vocab_size(with_added_tokens=True)` counts). FileProblem if unreadable: not a
    regular file (a FIFO would block the login node), larger than TOKENIZER_BYTES, or not JSON."""
    try:
        spec = json.loads(read_text(path, TOKENIZER_BYTES))
    except Unreadable as exc:
        raise FileProblem(str(exc)) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FileProblem(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise FileProblem(f'{path}: not a tokenizers tokenizer.json (no "model" object)')
    vocab = spec["model"].get("vocab")
    if isinstance(vocab, dict):
        ids = [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs, ids by position
        ids = [len(vocab) - 1] if vocab else []
    else:
        raise FileProblem(f"{path}: its model has no vocabulary")
    ids += [t["id"] for t in spec.get("added_tokens") or [] if isinstance(t, dict) and isinstance(t.get("id"), int)]
    return max(ids, default=-1) + 1


def _indexed(cfg: Config, r: CheckReport) -> None:
    d, seq_len = cfg.data, cfg.train.seq_len
    preparing = bool(d.prepare.inputs)
    for key in ("blend", "valid_blend"):
        try:
            pairs = parse_blend(getattr(d, key) or "")
        except ValueError:
            continue  # reported by checks._indexed_data
        for _, prefix in pairs:
            if not (os.path.exists(f"{prefix}.idx") and os.path.exists(f"{prefix}.bin")):
                continue  # missing: reported by checks._indexed_data (or made by data.prepare)
            try:
                summary = open_index(prefix)
            except FileProblem as exc:
                r.error(
                    f"data.{key}",
                    str(exc),
                    "give the prefix of a complete dataset (PREFIX.bin and its own "
                    "PREFIX.idx), or make it again with python -m hpctrain.data.prepare",
                )
                continue
            try:
                if key == "blend" and 0.0 <= d.valid_fraction < 1.0:  # else reported by checks._validation
                    _split(summary, d.valid_fraction, seq_len, r)
                else:
                    _enough(summary.prefix, "validation", summary.tokens, seq_len, "data.valid_blend", r)
            except (OSError, struct.error) as exc:
                r.error(f"data.{key}", f"{prefix}.idx: cannot be read ({exc})", "check the file")
            finally:
                summary.close()
            _dataset_tokenizer(prefix, d, r)
    if preparing and d.prepare.tokenizer and os.path.exists(d.prepare.tokenizer):  # missing: checks._indexed_data
        try:
            size = tokenizer_vocab_size(d.prepare.tokenizer)
        except FileProblem as exc:  # a directory or a FIFO too: data.prepare would block on it or fail
            r.error("data.prepare.tokenizer", str(exc), "give a tokenizers tokenizer.json (Tokenizer.save writes one)")
        else:
            if size > d.vocab_size:
                r.error(
                    "data.vocab_size",
                    f"the tokenizer {d.prepare.tokenizer} (data.prepare.tokenizer) has {size} "
                    f"tokens, more than data.vocab_size={d.vocab_size}",
                    f"set data.vocab_size={size} and model.vocab_size>={size}",
                )
    elif preparing and not d.prepare.tokenizer and d.prepare.vocab_size > d.vocab_size:
        r.warn(
            "data.prepare.vocab_size",
            f"data.prepare trains a tokenizer of up to {d.prepare.vocab_size} tokens, "
            f"more than data.vocab_size={d.vocab_size}: the preparation fails if it gets that many",
            f"set data.vocab_size={d.prepare.vocab_size} and model.vocab_size>={d.prepare.vocab_size}",
        )


def _split(s: IndexSummary, valid_fraction: float, seq_len: int, r: CheckReport) -> None:
    """Where the job's loader cuts the dataset (the last `valid_fraction` of its documents held out), and whether
    each part holds one sample of seq_len + 1 tokens (hpctrain.data.blend.PackedSamples refuses it otherwise)."""
    documents = s.documents
    held_out = int(round(documents * valid_fraction))
    if valid_fraction > 0 and (held_out < 1 or held_out >= documents):
        need = min_documents(valid_fraction)
        r.error(
            "data.valid_fraction",
            f"{s.prefix}.idx holds {documents} document(s): data.valid_fraction="
            f"{valid_fraction:g} holds out round({documents} x {valid_fraction:g}) = {held_out} of them, but "
            "there must be documents on both sides (training and validation)",
            "set data.valid_fraction=0 (and train.eval_every=0) to train on all of it, or give validation "
            f"data of its own with data.valid_blend, or use a dataset of at least {need} documents",
        )
        return
    cut = s.document_start(documents - held_out) if held_out else s.sequences
    train = s.tokens_before(cut)
    _enough(s.prefix, "training", train, seq_len, "data.blend", r)
    if held_out:
        _enough(s.prefix, "validation", s.tokens - train, seq_len, "data.valid_fraction", r)


def _enough(source: str, part: str, tokens: int, seq_len: int, key: str, r: CheckReport) -> None:
    """One sample of seq_len + 1 tokens at least (the samplers' condition)."""
    if (tokens - 1) // max(seq_len, 1) < 1:
        r.error(
            key,
            f"the {part} data of {source} holds {tokens:,} token(s), fewer than one sample of "
            f"train.seq_len={seq_len} + 1",
            "use more data"
            + (f", or train.seq_len<={tokens - 1}" if tokens > 1 else "")
            + (", or a larger data.valid_fraction" if key == "data.valid_fraction" else ""),
        )


def _dataset_tokenizer(prefix: str, d: DataConfig, r: CheckReport) -> None:
    """PREFIX.tokenizer.json (hpctrain.data.prepare saves the tokenizer it trained there): its vocabulary must
    fit data.vocab_size, or the job stops at the first sample that holds a larger id."""
    path = f"{prefix}.tokenizer.json"
    if not os.path.isfile(path):
        return
    try:
        size = tokenizer_vocab_size(path)
    except FileProblem as exc:  # the job never reads it: the data may still be right
        r.warn(
            "data.vocab_size",
            f"{exc}: the dataset's vocabulary cannot be checked against data.vocab_size",
            "check data.vocab_size against the tokenizer the data was made with",
        )
        return
    if size > d.vocab_size:
        r.error(
            "data.vocab_size",
            f"{path} has {size} tokens, more than data.vocab_size={d.vocab_size}: the job "
            f"would stop at the first sample that holds an id >= {d.vocab_size}",
            f"set data.vocab_size={size} and model.vocab_size>={size}",
        )


# ---------------------------------------------------------------- flat token files (data=tokens)

_TOKEN_BYTES = {"uint16": 2, "uint32": 4}


def _tokens(cfg: Config, r: CheckReport) -> None:
    d, seq_len = cfg.data, cfg.train.seq_len
    path = None if OmegaConf.is_missing(d, "path") else d.path
    if not path or not os.path.exists(path) or d.token_dtype not in _TOKEN_BYTES or not 0.0 <= d.valid_fraction < 1.0:
        return  # missing, of an unknown dtype, or a fraction out of range: reported by checks._train_and_data
    if not os.path.isfile(path):
        r.error(
            "data.path",
            f"{path} is not a file (data=tokens reads one flat file of token ids)",
            "set data.path to the .bin file itself",
        )
        return
    size, itemsize = os.path.getsize(path), _TOKEN_BYTES[d.token_dtype]
    if size % itemsize:
        r.error(
            "data.path",
            f"{path}: {size:,} bytes is not a whole number of {d.token_dtype} token ids "
            f"({itemsize} bytes each): the file is cut short, or its ids are not {d.token_dtype}",
            "check data.token_dtype (the dtype the file was written with: uint16 up to 65,536 ids, else "
            "uint32), or make the file again",
        )
        return
    n = size // itemsize
    held_out = int(n * d.valid_fraction)
    _enough(path, "training", n - held_out, seq_len, "data.path", r)
    if held_out:
        _enough(path, "validation", held_out, seq_len, "data.valid_fraction", r)


# ---------------------------------------------------------------- Hugging Face model directories (model.init_from)

HF_CONFIG, HF_WEIGHTS, HF_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
# safetensors' element types and their bytes (sub-byte types are not checked)
SAFETENSORS_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # safetensors' own limit


def safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors of a safetensors file by name with their shapes, from its header alone; FileProblem when the
    header does not describe the file exactly as the safetensors library requires (a file cut short, one with
    bytes after its tensors, offsets that overlap or do not match a tensor's shape and type)."""
    try:
        # O_NONBLOCK: a FIFO put there after the caller's is_file() opens without blocking, and is refused
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise FileProblem(f"{path}: not a regular file")
            size = info.st_size
            head = f.read(8)
            if len(head) < 8:
                raise FileProblem(f"{path}: {size} bytes, too short for a safetensors header")
            n = struct.unpack("<Q", head)[0]
            if n > min(MAX_SAFETENSORS_HEADER, size - 8):
                raise FileProblem(
                    f"{path}: its header claims {n:,} bytes, but the file has {size:,}: not a "
                    "safetensors file, or one cut short"
                )
            raw = f.read(n)
    except OSError as exc:
        raise FileProblem(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FileProblem(f"{path}: its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FileProblem(f"{path}: its header is not a JSON object")
    shapes, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise FileProblem(f"{path}: tensor {name} has no dtype, shape and data_offsets in the header") from None
        nbytes = math.prod(shape) * SAFETENSORS_BYTES[dtype] if dtype in SAFETENSORS_BYTES else None
        if not 0 <= start <= end or (nbytes is not None and end - start != nbytes):
            raise FileProblem(
                f"{path}: tensor {name} ({dtype} {list(shape)}) at bytes {start}..{end} of the data: "
                "its offsets do not match its shape and type"
            )
        shapes[name] = shape
        spans.append((start, end))
    data = size - 8 - n
    covered = max((end for _, end in spans), default=0)
    if covered > data:
        raise FileProblem(
            f"{path}: its header puts tensors up to byte {covered:,} of the data, but the file holds "
            f"{data:,} bytes of data ({size:,} in all): the file is cut short (a copy or download that "
            "did not finish)"
        )
    if covered < data:
        raise FileProblem(
            f"{path}: {data - covered:,} bytes after the last tensor its header describes: not a "
            "file safetensors reads (it must be covered exactly)"
        )
    spans.sort()
    if any(b[0] != a[1] for a, b in zip(spans, spans[1:])) or (spans and spans[0][0] != 0):
        raise FileProblem(f"{path}: the tensors' data offsets overlap or leave gaps")
    return shapes


def _init_from(cfg: Config, r: CheckReport) -> None:
    m = cfg.model
    if not m.init_from or not os.path.exists(m.init_from):
        return  # not set, or missing: checks._model_shape
    path = Path(m.init_from)
    key, fix_dir = (
        "model.init_from",
        (
            "give a Hugging Face model directory (config.json and model.safetensors, as "
            "save_pretrained or `tools/checkpoint.py export RUN --format hf OUT` writes it)"
        ),
    )
    if not path.is_dir():
        example = f", e.g. model.init_from={path.parent}" if path.name in (HF_CONFIG, HF_WEIGHTS) else ""
        r.error(
            key,
            f"{path} is a file, not a directory"
            if path.is_file()
            else f"{path} is not a directory (nor a regular file: a device, FIFO or socket)",
            fix_dir + example,
        )
        return
    config_file = path / HF_CONFIG
    if not config_file.exists():
        r.error(key, f"{path}: no {HF_CONFIG} there", fix_dir)
        return
    try:  # a regular file of at most CONFIG_BYTES: a FIFO or /dev/zero under the name would hold the login node
        hf = json.loads(read_text(config_file, CONFIG_BYTES))
    except Unreadable as exc:
        r.error(
            key,
            f"{exc}: not a model's {HF_CONFIG}",
            "restore the model's config.json (a JSON file of a few kilobytes: re-download or re-export the directory)",
        )
        return
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        r.error(
            key,
            f"{config_file} is not valid JSON ({exc})",
            "restore the model's config.json (re-download or re-export the directory)",
        )
        return
    if not isinstance(hf, dict):
        r.error(key, f"{config_file} is not a JSON object", "restore the model's config.json")
        return
    try:
        differ = hf_mismatches(m, hf)
    except HFMismatch as exc:
        known = ", ".join(f.hf.class_name for f in FAMILIES.values())
        r.error(key, f"{config_file}: {exc}", f"start from a model directory hpctrain represents ({known})")
        return
    except (KeyError, TypeError, ValueError) as exc:
        r.error(
            key,
            f"{config_file} lacks or mistypes a field of its model type ({type(exc).__name__}: {exc})",
            "restore the model's config.json (re-download or re-export the directory)",
        )
        return
    if differ:
        rows = "; ".join(f"{k}: {ours!r} here, {theirs!r} in {HF_CONFIG}" for k, ours, theirs in differ)
        sets = " ".join(f"{k}={theirs}" for k, _, theirs in differ if theirs is not None)
        r.error(
            key,
            f"{config_file} does not match the run's model config (model={m.name}): {rows}",
            f"set {sets} (or the model config of this checkpoint), or point model.init_from at a model of "
            "this config's shape",
        )
        return
    tied = bool(hf.get("tie_word_embeddings", for_hf(hf.get("model_type")).hf.tied_default))
    _hf_weights(path, m, tied, r)


def _hf_weights(path: Path, m: Any, tied: bool, r: CheckReport) -> None:
    key = "model.init_from"
    index = path / HF_INDEX
    if index.exists():
        try:  # bounded: a regular file of at most INDEX_BYTES (Unreadable is a ValueError, said as one below)
            weight_map = json.loads(read_text(index, INDEX_BYTES))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
            r.error(
                key,
                f"{index}: not a safetensors index ({type(exc).__name__}: {exc})",
                "restore the file (re-download or re-export the directory)",
            )
            return
    elif (path / HF_WEIGHTS).is_file():
        files = [HF_WEIGHTS]
    else:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
        r.error(
            key,
            f"{path}: no {HF_WEIGHTS} or {HF_INDEX}"
            + (f" (found {', '.join(pickles)}: pickles are never read, they can run code)" if pickles else ""),
            "convert the weights to safetensors once, where you trust them: AutoModelForCausalLM."
            "from_pretrained(...).save_pretrained(OUT, safe_serialization=True)"
            if pickles
            else "give a directory with the model's safetensors weights",
        )
        return
    found: dict[str, tuple[int, ...]] = {}
    family = family_of(m)
    base = family.hf.base_prefix
    for name in files:
        file = path / name
        if not file.is_file():
            r.error(
                key,
                f"{index} names {name}, which is not in {path}",
                "copy the missing file, or re-download the directory",
            )
            continue
        try:
            tensors = safetensors_header(file)
        except FileProblem as exc:
            r.error(key, str(exc), "copy or download the file again (compare its size with the source's)")
            continue
        found.update({k if k.startswith((base, "lm_head.")) else base + k: v for k, v in tensors.items()})
    if len(files) != sum(1 for n in files if (path / n).is_file()) or any(p.key == key for p in r.errors):
        return
    want = hf_weight_shapes(m)
    if tied:
        want.pop("lm_head.weight", None)
    have = {
        k: v
        for k, v in found.items()
        if not (k.endswith(family.hf.not_weights) or (k == "lm_head.weight" and k not in want))
    }
    problems = [f"{k}: missing" for k in want if k not in have]
    problems += [
        f"{k}: shape {list(have[k])}, the config wants {list(s)}"
        for k, s in want.items()
        if k in have and tuple(have[k]) != s
    ]
    problems += [f"{k}: not in the config's {family.name} model" for k in have if k not in want]
    if problems:
        r.error(
            key,
            f"the weights in {path} do not match the run's model config (model={m.name}) although "
            f"{HF_CONFIG} does: "
            + "; ".join(problems[:5])
            + (f"; ... {len(problems) - 5} more" if len(problems) > 5 else ""),
            "re-export or re-download the directory: its config.json and weights disagree",
        )


# ---------------------------------------------------------------- zero.nvme_path


def _nvme(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """The directory the job's ranks keep Adam's moments in (hpctrain/parallel/nvme.py reserves the space at the
    start). Node-local: checked only where this machine sees it (where the tasks run here)."""
    z = cfg.zero
    path = None if OmegaConf.is_missing(z, "nvme_path") else z.nvme_path
    if lay.offload_device != "nvme" or not z.offload_optimizer or not path:
        return
    here = scheduler_for(cfg.cluster.executor).capabilities.runs_here
    where = "" if here else " (as this machine sees it; the nodes' drive is what counts)"
    target = Path(path)
    if not target.exists():
        if not here:
            return  # node-local: the job makes it on each node
        target = _existing_ancestor(target)
        if not target.is_dir():
            r.error(
                "zero.nvme_path",
                f"{path} cannot be made: {target} is not a directory",
                "set zero.nvme_path to a directory on a node-local NVMe drive",
            )
            return
    elif not target.is_dir():
        r.error(
            "zero.nvme_path",
            f"{path} is not a directory{where}",
            "set zero.nvme_path to a directory on a node-local NVMe drive",
        )
        return
    if not os.access(target, os.W_OK | os.X_OK):
        ro = _read_only(target)
        r.error(
            "zero.nvme_path",
            f"{target} is {'on a read-only file system' if ro else 'not writable'}{where}: "
            "the ranks cannot create their moments files there",
            "set zero.nvme_path to a writable node-local directory, e.g. /raid/$USER/hpctrain",
        )
        return
    est = r.estimates
    offload = getattr(getattr(est, "step", None), "offload", None)
    if offload is None or offload.device != "nvme":
        return
    need = offload.nvme_bytes_per_node
    st = os.statvfs(target)
    free = st.f_bavail * st.f_frsize
    if need > free:
        r.error(
            "zero.nvme_path",
            f"Adam's moments need {format_bytes(need)} per node ({offload.gpus_per_node} "
            f"ranks, 8 bytes per parameter of each rank's shard), {format_bytes(free)} free in {target}{where}",
            "free space there, use a larger drive, or shard over more ranks (more nodes or a larger DP)",
        )


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


# ---------------------------------------------------------------- resume: the checkpoint's fingerprint

MANIFEST, STEP_PREFIX, SEAL = "manifest.json", "step_", "manifest_crc32c"  # hpctrain.checkpoint.storage/integrity


def _manifest_sealed(manifest: dict[str, Any]) -> bool:
    """hpctrain.checkpoint.integrity.seal_problem is None (a manifest from before seals is trusted)."""
    if SEAL not in manifest:
        return True
    from fastcrc.crc32 import iscsi as crc32c

    body = {k: v for k, v in manifest.items() if k != SEAL}
    return bool(manifest[SEAL] == f"{crc32c(json.dumps(body, sort_keys=True).encode()):08x}")


def newest_checkpoint(cfg: Config, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest committed checkpoint this machine sees over the config's tiers, the one a resume tries first
    (hpctrain.checkpoint.manager: newest step, faster tier first on a tie), with its manifest."""
    if not cfg.checkpoint.enabled:
        return None
    found = []
    for i, tier in enumerate(cfg.checkpoint.tiers):
        p = Path(str(tier.path)).expanduser()
        directory = p / run_dir.name if p.is_absolute() else run_dir / p
        if not directory.is_dir():
            continue
        for sub in directory.iterdir():
            tail = sub.name[len(STEP_PREFIX) :]
            if sub.name.startswith(STEP_PREFIX) and tail.isdigit():
                found.append((int(tail), -i, sub))
    for _, _, sub in sorted(found, reverse=True):
        try:  # bounded: a FIFO or a runaway file is not a committed checkpoint's manifest (Unreadable: a ValueError)
            manifest = json.loads(read_text(sub / MANIFEST, MANIFEST_BYTES))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            continue
        if (
            isinstance(manifest, dict)
            and isinstance(manifest.get("step"), int)
            and isinstance(manifest.get("files"), dict)
            and _manifest_sealed(manifest)
        ):
            return sub, manifest
    return None


_FINGERPRINT_KEYS = {"global_batch": "train.global_batch", "seq_len": "train.seq_len", "seed": "train.seed"}


def check_resume(cfg: Config, run_dir: str | os.PathLike[str], r: CheckReport) -> None:
    """A resume of `run_dir` against its newest committed checkpoint: what the job's CheckpointManager refuses
    (another model shape always; another batch, sequence length, seed or data unless checkpoint.force_resume),
    reported now, one problem per differing key, naming the checkpoint."""
    from hpctrain.records.fingerprint import config_key, fingerprint_of, upgrade_fingerprint

    newest = newest_checkpoint(cfg, Path(run_dir))
    if newest is None:
        return
    path, manifest = newest
    ours = upgrade_fingerprint(fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict())
    saved = upgrade_fingerprint(manifest.get("fingerprint") or {}, ours)
    where = f"the checkpoint this run resumes from ({path}, step {manifest['step']})"
    model = saved.get("model")
    theirs_model: dict[str, Any] = model if isinstance(model, dict) else {}
    for field, value in ours["model"].items():
        if theirs_model.get(field) != value:
            key = config_key(field)
            r.error(
                key,
                f"{value!r} here, but {where} holds a model with {theirs_model.get(field)!r}: "
                "its weights cannot be loaded",
                f"set {key}={theirs_model.get(field)} (a resume keeps the "
                "model's shape), or start a new run instead of resuming",
            )
    report = r.warn if cfg.checkpoint.force_resume else r.error
    tail = (
        ": checkpoint.force_resume=true resumes anyway, not exactly"
        if cfg.checkpoint.force_resume
        else ": the data order or position would differ"
    )
    for field, key in _FINGERPRINT_KEYS.items():
        if saved.get(field) != ours[field]:
            report(
                key,
                f"{ours[field]!r} here, {saved.get(field)!r} in {where}{tail}",
                f"set {key}={saved.get(field)} to continue the same training, or checkpoint.force_resume=true",
            )
    if saved.get("data") != ours["data"]:
        theirs = saved.get("data") or {}
        key = _data_key(theirs, ours["data"])
        report(
            key,
            f"the data is {ours['data']} here, {theirs} in {where}{tail}",
            f"restore {key} to the checkpoint's, or checkpoint.force_resume=true",
        )


def _data_key(saved: dict[str, Any], ours: dict[str, Any]) -> str:
    """The data key a fingerprint's data source differs by (hpctrain.records.fingerprint.fingerprint_of)."""
    if saved.get("kind") != ours["kind"]:
        return "data.kind"
    base = [str(d.get("source")).split(" valid_fraction=")[0] for d in (saved, ours)]
    if base[0] == base[1]:
        return "data.valid_fraction"
    return {"indexed": "data.blend", "text_bytes": "data.max_bytes"}.get(str(ours["kind"]), "data.path")


def resumed_run_dir(cfg: Config) -> Path | None:
    """The run directory an invocation continues, as hpctrain.launch.rundir resolves it: run.resume (a path, or
    an id under run.root), or run.root/run.name/run.id when that run exists; None for a new run."""
    root = Path(str(cfg.run.root)).expanduser()
    if cfg.run.resume:
        ref = str(cfg.run.resume)
        as_path = Path(ref).expanduser()
        candidates = [as_path] if as_path.is_absolute() or "/" in ref or as_path.is_dir() else []
        if root.is_dir():
            candidates += sorted(root.glob(f"*/{ref}"))
        return next((p for p in candidates if (p / "config.yaml").is_file()), None)
    if cfg.run.id:
        path = root / str(cfg.run.name) / str(cfg.run.id)
        return path if (path / "config.yaml").is_file() else None
    return None


# ---------------------------------------------------------------- what the login node writes, what NCCL reads


def _existing_ancestor(path: Path) -> Path:
    """`path` itself, or the nearest of its parents that exists (what a mkdir -p would start from)."""
    path = path.absolute()
    return next((p for p in (path, *path.parents) if p.exists()), Path(path.anchor or "/"))


def _outputs(cfg: Config, r: CheckReport) -> None:
    """run.root (the run directory is made in it when the job is submitted) and plan.png (written with the plan)
    must be writable here, or the launch ends in a raw PermissionError; NCCL's topology file is read on the
    nodes (a missing one is ignored with a warning of NCCL's own)."""
    root = Path(str(cfg.run.root)).expanduser()
    base = _existing_ancestor(root)
    if not base.is_dir():
        r.error(
            "run.root",
            f"{base} is not a directory: run directories cannot be made under {root}",
            "set run.root to a directory on shared storage",
        )
    elif not os.access(base, os.W_OK | os.X_OK):
        r.error(
            "run.root",
            f"{root} cannot be written: {base} is "
            f"{'on a read-only file system' if _read_only(base) else 'not writable'}",
            "set run.root to a writable directory on shared storage (run directories go to run.root/run.name/run.id)",
        )
    if cfg.plan.png:  # its directory is made if need be (hpctrain.launch.plan_chart)
        png = Path(str(cfg.plan.png)).expanduser()
        base = _existing_ancestor(png.absolute().parent)
        if png.is_dir() or not base.is_dir():
            r.error(
                "plan.png",
                f"{png if png.is_dir() else base} is {'a directory' if png.is_dir() else 'a file'}: "
                f"the chart cannot be written to {png}",
                "give the path of a .png file, e.g. plan.png=plan.png",
            )
        elif not os.access(base, os.W_OK | os.X_OK):
            r.error(
                "plan.png",
                f"{base} is not writable: the chart cannot be written to {png}",
                "give a path in a writable directory, e.g. plan.png=plan.png",
            )
    topo = cfg.cluster.nccl.topo_file
    if topo and not os.path.isfile(str(topo)):
        r.warn(
            "cluster.nccl.topo_file",
            f"{topo} is not a file on this machine: NCCL ignores a topology file it "
            "cannot read (with a warning in its log) and detects the topology itself",
            "give a file every node can read, or leave cluster.nccl.topo_file unset",
        )


# ---------------------------------------------------------------- the pass


def file_checks(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """Every file the run will read, from the config alone (a resume's checkpoint: `check_resume`)."""
    kind = cfg.data.kind
    if kind == DataKind.indexed:
        _indexed(cfg, r)
    elif kind == DataKind.tokens:
        _tokens(cfg, r)
    _init_from(cfg, r)
    _nvme(cfg, lay, r)
    _outputs(cfg, r)


def walk_values(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a config container (lists as key[i])."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk_values(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk_values(v, f"{key}[{i}]")
    else:
        yield key, node
