"""Corpus -> indexed dataset: every input kind decodes back to its text, workers change nothing, and every bad
input stops the run with the file and place named, leaving nothing in the output directory."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hpctrain.data import prepare as prepare_module
from hpctrain.data.indexed import IndexedDataset
from hpctrain.data.prepare import PrepareError, main, prepare, stdlib_documents

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "def f(x):\n    return x  # plain code\n",
    "Naïve café, 東京, emoji 🚀, tabs\tand\r\nCRLF line ends.",
    "A document that quotes <|endoftext|> and </s> mid-text stays one document.",
    "  leading and trailing spaces  \n\n",
]


@pytest.fixture(scope="module")
def eos_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json of someone else's making: byte-level BPE whose end of document is </s>, at id 3."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS * 3, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def documents_of(prefix: str | Path, tokenizer: str | Path, eod: str | None) -> list[str]:
    """The dataset decoded, one text per document, after checking that each ends with the EOD and only there."""
    tok = Tokenizer.from_file(str(tokenizer))
    data = IndexedDataset(prefix)
    assert data.document_indices.tolist() == list(range(len(data) + 1))
    texts = []
    for i in range(len(data)):
        ids = data.get(i).tolist()
        if eod is not None:
            assert ids[-1] == tok.token_to_id(eod) and tok.token_to_id(eod) not in ids[:-1]
            ids = ids[:-1]
        texts.append(tok.decode(ids, skip_special_tokens=False))
    return texts


def write_files(directory: Path, files: dict[str, str | bytes]) -> list[Path]:
    paths = []
    for name, content in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):  # text is gzipped when the name says so; bytes are written as they are
            content = gzip.compress(content.encode(), mtime=0) if name.endswith(".gz") else content.encode()
        path.write_bytes(content)
        paths.append(path)
    return paths


def jsonl(texts: list[str], key: str = "text") -> str:
    return "".join(json.dumps({"id": i, key: t}) + "\n" for i, t in enumerate(texts))


def test_text_files_with_a_trained_bpe(tmp_path: Path) -> None:
    inputs = write_files(tmp_path / "in", {f"doc{i}.txt": t for i, t in enumerate(TEXTS)} | {"empty.txt": ""})
    prefix = tmp_path / "out" / "deeper" / "ds"  # parents are created
    summary = prepare(inputs, prefix, vocab_size=320, progress=False)
    assert Path(summary.tokenizer) == tmp_path / "out" / "deeper" / "ds.tokenizer.json"
    assert documents_of(prefix, summary.tokenizer, "<|endoftext|>") == TEXTS  # the empty file left out
    data = IndexedDataset(prefix)
    assert (summary.documents, summary.tokens, summary.dtype, summary.prefix) == (
        4,
        data.num_tokens,
        "uint16",
        str(prefix),
    )
    assert summary.vocab_size == Tokenizer.from_file(summary.tokenizer).get_vocab_size() <= 320
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["ds.bin", "ds.idx", "ds.tokenizer.json"]


def test_json_lines_with_a_field_name_and_a_given_tokenizer(tmp_path: Path, eos_tokenizer: Path) -> None:
    inputs = write_files(
        tmp_path,
        {
            "a.jsonl": jsonl(TEXTS[:2], "body") + "\n   \n",  # blank lines skipped
            "b.jsonl.gz": jsonl(TEXTS[2:], "body"),
        },
    )
    summary = prepare(inputs, tmp_path / "ds", tokenizer=eos_tokenizer, text_key="body", progress=False)
    assert summary.tokenizer == str(eos_tokenizer)
    assert summary.vocab_size == Tokenizer.from_file(str(eos_tokenizer)).get_vocab_size() > 256
    assert documents_of(tmp_path / "ds", eos_tokenizer, "</s>") == TEXTS
    assert not (tmp_path / "ds.tokenizer.json").exists()


def test_a_directory_is_read_in_sorted_order(tmp_path: Path, eos_tokenizer: Path) -> None:
    write_files(
        tmp_path / "corpus",
        {
            "b.txt": TEXTS[2],
            "a/x.jsonl": jsonl(TEXTS[:2]),
            "c.txt.gz": TEXTS[3],
            ".hidden.txt": "left out",
            ".git/config": "left out",
        },
    )
    prepare([tmp_path / "corpus"], tmp_path / "ds", tokenizer=eos_tokenizer, progress=False)
    assert documents_of(tmp_path / "ds", eos_tokenizer, "</s>") == TEXTS


def test_a_hugging_face_datasets_directory(tmp_path: Path, eos_tokenizer: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install hpctrain[data])")
    datasets.disable_progress_bars()
    train = datasets.Dataset.from_dict({"content": TEXTS, "n": list(range(len(TEXTS)))})
    other = datasets.Dataset.from_dict({"content": ["not read"], "n": [0]})
    train.save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"validation": other, "train": train}).save_to_disk(str(tmp_path / "splits"))
    datasets.DatasetDict({"validation": other, "test": train}).save_to_disk(str(tmp_path / "no_train"))
    for i, given in enumerate([tmp_path / "single", tmp_path / "splits", tmp_path / "no_train" / "test"]):
        prepare([given], tmp_path / f"ds{i}", tokenizer=eos_tokenizer, text_key="content", progress=False)
        assert documents_of(tmp_path / f"ds{i}", eos_tokenizer, "</s>") == TEXTS
    with pytest.raises(PrepareError, match=r"no_train: splits validation, test and no 'train'; give .*no_train/"):
        prepare([tmp_path / "no_train"], tmp_path / "out" / "ds", tokenizer=eos_tokenizer, text_key="content")
    with pytest.raises(PrepareError, match=r"single: no column 'text' \(it has: content, n\)"):
        prepare([tmp_path / "single"], tmp_path / "out" / "ds", tokenizer=eos_tokenizer)
    assert list((tmp_path / "out").iterdir()) == []


def test_the_stdlib_corpus_and_workers_change_no_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks: many of them, so that two workers do interleave."""
    monkeypatch.setattr(prepare_module, "CHUNK_CHARS", 20_000)
    one = prepare(["stdlib"], tmp_path / "w1" / "ds", vocab_size=512, workers=1, max_documents=40, progress=False)
    two = prepare(["stdlib"], tmp_path / "w2" / "ds", vocab_size=512, workers=2, max_documents=40, progress=False)
    for name in ("ds.bin", "ds.idx", "ds.tokenizer.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    expected = [text for text in itertools.islice(stdlib_documents(), 40) if text]
    assert one.documents == two.documents == len(expected)
    assert documents_of(one.prefix, one.tokenizer, "<|endoftext|>") == expected


def test_end_of_document_choices(tmp_path: Path, eos_tokenizer: Path) -> None:
    corpus = write_files(tmp_path, {"c.jsonl": jsonl(TEXTS)})
    prepare(corpus, tmp_path / "plain", tokenizer=eos_tokenizer, eod=False, progress=False)
    assert documents_of(tmp_path / "plain", eos_tokenizer, None) == TEXTS
    prepare(corpus, tmp_path / "pad", tokenizer=eos_tokenizer, eod_token="<pad>", progress=False)
    assert documents_of(tmp_path / "pad", eos_tokenizer, "<pad>") == TEXTS
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "bare.json"))
    with pytest.raises(PrepareError, match=r"bare\.json: no usual end-of-document token .* --eod-token"):
        prepare(corpus, tmp_path / "out" / "ds", tokenizer=tmp_path / "bare.json", progress=False)
    with pytest.raises(PrepareError, match=r"no token '<sep>'"):
        prepare(corpus, tmp_path / "out" / "ds", tokenizer=eos_tokenizer, eod_token="<sep>", progress=False)


def test_a_large_vocabulary_gets_int32_and_refuses_uint16(tmp_path: Path) -> None:
    words = {f"w{i}": i for i in range(70_000)}
    tokenizer = Tokenizer(models.WordLevel(words | {"</s>": 70_000}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "big.json"))
    corpus = write_files(tmp_path, {"c.txt": "w1 w69999 w65536 w7"})
    summary = prepare(corpus, tmp_path / "ds", tokenizer=tmp_path / "big.json", progress=False)
    assert summary.dtype == "int32" and IndexedDataset(tmp_path / "ds").tokens.tolist() == [1, 69999, 65536, 7, 70000]
    with pytest.raises(PrepareError, match=r"big\.json: ids up to 70000 do not fit --dtype uint16"):
        prepare(corpus, tmp_path / "out" / "ds", tokenizer=tmp_path / "big.json", dtype="uint16")


BAD_INPUTS = {
    "missing input": ({}, ["nowhere.txt"], r"input .*nowhere\.txt: no such file or directory"),
    "field missing": (
        {"bad.jsonl": jsonl(TEXTS[:1]) + '{"body": "x"}\n'},
        ["bad.jsonl"],
        r"bad\.jsonl:2: no field 'text' \(it has: 'body'\); choose the field with --text-key",
    ),
    "field not text": ({"bad.jsonl": '{"text": 3}\n'}, ["bad.jsonl"], r"bad\.jsonl:1: field 'text' is int, not text"),
    "invalid JSON": (
        {"bad.jsonl": jsonl(TEXTS[:2]) + '{"text": "x"\n'},
        ["bad.jsonl"],
        r"bad\.jsonl:3: invalid JSON: Expecting ',' delimiter: column 13",
    ),
    "lone surrogate": (
        {"bad.jsonl": '{"text": "ok"}\n{"text": "a\\ud800b"}\n'},
        ["bad.jsonl"],
        r"bad\.jsonl:2: field 'text' is not valid Unicode: '\\ud800' at character 1",
    ),
    "not UTF-8": (
        {"latin1.txt": "café".encode("latin-1")},
        ["latin1.txt"],
        r"latin1\.txt: not UTF-8 \(byte offset 3\)",
    ),
    "not UTF-8 in JSON lines": (
        {"bad.jsonl": jsonl(["ok"]).encode() + b'{"text": "\xe9"}\n'},
        ["bad.jsonl"],
        r"bad\.jsonl: not UTF-8 \(line 2, byte offset 34\)",
    ),
    "no documents": ({"empty": "", "e.jsonl": "\n"}, ["empty", "e.jsonl"], "no text in the input"),
    "broken gzip": ({"b.txt.gz": b"\x1f\x8b not really"}, ["b.txt.gz"], "cannot read the input"),
    "no input": ({}, [], "no input given"),
}


@pytest.mark.parametrize("given", [None, "eos"], ids=["trained BPE", "given tokenizer"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_named_and_leaves_nothing(
    tmp_path: Path, eos_tokenizer: Path, case: str, given: str | None
) -> None:
    files, inputs, problem = BAD_INPUTS[case]
    write_files(tmp_path, files)
    with pytest.raises(PrepareError, match=problem):
        prepare(
            [tmp_path / i for i in inputs],
            tmp_path / "out" / "ds",
            progress=False,
            tokenizer=eos_tokenizer if given else None,
        )
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_failure_half_way_leaves_nothing(
    tmp_path: Path, eos_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny chunks: dozens are written before the bad line is reached."""
    monkeypatch.setattr(prepare_module, "CHUNK_CHARS", 50)
    write_files(tmp_path, {"c.jsonl": jsonl(TEXTS * 50) + "{oops\n"})
    with pytest.raises(PrepareError, match=r"c\.jsonl:201: invalid JSON"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "out" / "ds", tokenizer=eos_tokenizer, workers=2, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_output_problems(tmp_path: Path, eos_tokenizer: Path) -> None:
    corpus = write_files(tmp_path, {"c.txt": TEXTS[0]})
    with pytest.raises(PrepareError, match=r"output .*ds\.bin: give the prefix"):
        prepare(corpus, tmp_path / "ds.bin", tokenizer=eos_tokenizer)
    with pytest.raises(PrepareError, match=r"missing\.json: cannot load it"):
        prepare(corpus, tmp_path / "ds", tokenizer=tmp_path / "missing.json")
    with pytest.raises(PrepareError, match="dtype float32: not a token dtype"):
        prepare(corpus, tmp_path / "ds", tokenizer=eos_tokenizer, dtype="float32")
    prepare(corpus, tmp_path / "ds", progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("ds.*")}
    with pytest.raises(PrepareError, match=r"output .*ds\.bin exists; pass --overwrite"):
        prepare(corpus, tmp_path / "ds", progress=False)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("ds.*")} == before
    (tmp_path / "c.txt").write_text(TEXTS[1])
    prepare(corpus, tmp_path / "ds", progress=False, overwrite=True)
    assert documents_of(tmp_path / "ds", tmp_path / "ds.tokenizer.json", "<|endoftext|>") == [TEXTS[1]]


def test_command_line(tmp_path: Path, eos_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_files(tmp_path, {"c.jsonl": jsonl(TEXTS, "body")})
    assert (
        main(
            [
                "--input",
                str(corpus[0]),
                "--output",
                str(tmp_path / "ds"),
                "--tokenizer",
                str(eos_tokenizer),
                "--text-key",
                "body",
                "--workers",
                "1",
                "--dtype",
                "int32",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'ds'}: 4 documents, ")
    assert IndexedDataset(tmp_path / "ds").dtype == np.int32
    failed = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "prepare_data.py"),
            "--input",
            str(tmp_path / "c.jsonl"),
            "--output",
            str(tmp_path / "out" / "ds"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 2 and failed.stdout == ""
    assert (
        failed.stderr == f"prepare_data: {tmp_path / 'c.jsonl'}:1: no field 'text' (it has: 'id', 'body'); "
        "choose the field with --text-key\n"
    )
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
