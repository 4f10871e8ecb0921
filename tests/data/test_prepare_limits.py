"""Data preparation at its limits (issue 29), each with real files and the real command: an output it cannot
write (said at once, exit 2, nothing left), input that is not text (NUL bytes, UTF-16: skipped with a warning
naming the file, in seconds), a run of one character (no minutes of BPE training), one huge line (memory bounded
by a piece, not the document, measured in a subprocess), and progress lines when stderr is not a terminal."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from hpctrain.data import prepare as prepare_module
from hpctrain.data.indexed import IndexedDataset
from hpctrain.data.prepare import PrepareError, prepare

REPO = Path(__file__).resolve().parents[2]
TOOL = [sys.executable, str(REPO / "tools" / "prepare_data.py")]


def run_tool(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def words_text(characters: int, seed: int = 29) -> str:
    """Text of made-up words separated by spaces, about `characters` long (deterministic)."""
    rng = random.Random(seed)
    vocabulary = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(2000)
    ]
    return " ".join(rng.choice(vocabulary) for _ in range(characters // 6))


# -- an output that cannot be written: a PrepareError at once, exit 2, nothing left


def unwritable_outputs(tmp: Path) -> dict[str, Path]:
    (tmp / "a_file").write_text("not a directory\n")
    cases = {
        "sysfs": Path("/sys/hpctrain_ds"),  # nobody, root included, may create files there
        "sysfs, a directory to make": Path("/sys/hpctrain_dir/ds"),
        "a file as the directory": tmp / "a_file" / "deeper" / "ds",
        # the directories are made, then the name cannot be: they must go again
        "a name too long": tmp / "made" / "deeper" / ("d" * 300),
    }
    if os.geteuid() != 0:  # root writes in a read-only directory anyway
        (tmp / "read_only").mkdir()
        (tmp / "read_only").chmod(0o555)
        cases["a read-only directory"] = tmp / "read_only" / "sub" / "ds"
    return cases


def test_an_unwritable_output_is_refused_at_once_naming_it(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(words_text(20_000))
    for case, output in unwritable_outputs(tmp_path).items():
        before = listing(tmp_path)
        started = time.monotonic()
        done = run_tool("--input", str(corpus), "--output", str(output), "--workers", "1", cwd=tmp_path)
        assert done.returncode == 2, (case, done.stderr)
        assert "Traceback" not in done.stderr and done.stdout == "", (case, done.stderr)
        (line,) = done.stderr.splitlines()
        assert (
            line.startswith(f"prepare_data: output {output}: ")
            and "give --output a prefix in a directory you can write" in line
        ), (case, line)
        assert listing(tmp_path) == before, case  # nothing left: no directory, no probe, no dataset
        assert time.monotonic() - started < 60, case  # before any tokenizer training


def test_the_python_api_raises_prepare_error_for_an_unwritable_output(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    with pytest.raises(PrepareError, match=r"output /sys/hpctrain_ds: cannot write in /sys \(Permission denied\)"):
        prepare([corpus], "/sys/hpctrain_ds", vocab_size=300, progress=False)


# -- input that is not text

NUL_BYTES = 200_000


def test_a_file_of_nul_bytes_is_skipped_with_a_warning_in_seconds(tmp_path: Path) -> None:
    (tmp_path / "zeros.bin").write_bytes(b"\0" * NUL_BYTES)
    (tmp_path / "text.txt").write_text("A document of real text.\n")
    (tmp_path / "utf16.txt").write_bytes("Text saved as UTF-16, every other byte NUL.".encode("utf-16-le"))
    (tmp_path / "lines.jsonl").write_text(
        json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "\0" * 1000 + "x"}) + "\n"
    )
    started = time.monotonic()
    done = run_tool(
        "--input",
        "zeros.bin",
        "text.txt",
        "utf16.txt",
        "lines.jsonl",
        "--output",
        "out/ds",
        "--workers",
        "1",
        "--vocab-size",
        "300",
        cwd=tmp_path,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert seconds < 30, seconds  # 200 KB of NULs trained a BPE for 135 s (21 s on a fast core)
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert [w.split(":")[1].strip() for w in warnings] == ["zeros.bin", "utf16.txt", "lines.jsonl"], warnings
    assert "lines.jsonl:2: skipped, not text: 100% of its 1,001 characters are NUL" in done.stderr
    assert f"{NUL_BYTES:,} characters" in warnings[0] and "UTF-16" in warnings[0]
    data = IndexedDataset(tmp_path / "out" / "ds")
    tok = Tokenizer.from_file(str(tmp_path / "out" / "ds.tokenizer.json"))
    texts = [tok.decode(data.get(i).tolist()[:-1]) for i in range(len(data))]
    assert texts == ["A document of real text.\n", "fine"]
    assert "3 skipped as not text (zeros.bin, ...)" in done.stdout


def test_input_that_is_only_nul_bytes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "zeros.bin").write_bytes(b"\0" * NUL_BYTES)
    started = time.monotonic()
    done = run_tool("--input", "zeros.bin", "--output", "out/ds", "--workers", "1", cwd=tmp_path)
    assert time.monotonic() - started < 30
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "prepare_data: no text in the input (zeros.bin); 1 document(s) skipped "
        "as not text (NUL or control characters): zeros.bin"
    )
    assert not (tmp_path / "out").exists() or listing(tmp_path / "out") == []


def test_a_long_run_of_one_character_trains_in_seconds(tmp_path: Path) -> None:
    """The BPE trainer's time grows with the square of a word's length: 400 KB of '=' is one word to the
    byte-level pre-tokenizer (minutes of training); the trainer sees it in WORD_CHARS words."""
    (tmp_path / "rule.txt").write_text("=" * 400_000 + "\nthen some text\n")
    started = time.monotonic()
    done = run_tool("--input", "rule.txt", "--output", "out/ds", "--workers", "1", cwd=tmp_path, timeout=120)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert seconds < 20, seconds
    data = IndexedDataset(tmp_path / "out" / "ds")
    tok = Tokenizer.from_file(str(tmp_path / "out" / "ds.tokenizer.json"))
    assert tok.decode(data.get(0).tolist()[:-1]) == "=" * 400_000 + "\nthen some text\n"


# -- one huge line: memory of a piece, not of the document

PEAK = """
import json, os, sys, threading, time
from hpctrain.data.prepare import main


def high_water_mib(pid):
    # VmHWM: the process's own peak resident memory. Not ru_maxrss: Linux carries that across exec, so a
    # process started by a big one (pytest) reports the starter's peak.
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


if __name__ == "__main__":
    workers, done = {}, threading.Event()

    def watch():  # the workers' peaks, read while they live (each worker's is its own since its exec)
        while not done.is_set():
            for child in children(os.getpid()):
                workers[child] = max(workers.get(child, 0.0), high_water_mib(child))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = main(sys.argv[1:])
    done.set()
    watcher.join()
    print(json.dumps({"code": code, "parent_mib": high_water_mib(os.getpid()),
                      "workers_mib": max(workers.values(), default=0.0)}), file=sys.stderr)
"""


def test_one_huge_line_keeps_memory_flat(tmp_path: Path) -> None:
    """A 2.5 MB line: the peak resident memory (VmHWM) of the parent (reading, training the BPE) and of the
    worker (tokenising) bounded by a piece, not the document (a 15.5 MB line: 1.26 GB and 2.3 GB before)."""
    (tmp_path / "peak.py").write_text(PEAK)
    (tmp_path / "huge.jsonl").write_text(json.dumps({"text": words_text(2_500_000)}) + "\n")
    done = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "peak.py"),
            "--input",
            "huge.jsonl",
            "--output",
            "out/ds",
            "--workers",
            "1",
            "--vocab-size",
            "300",
            "--quiet",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    peak = json.loads(done.stderr.splitlines()[-1])
    assert peak["code"] == 0, done.stderr
    assert peak["parent_mib"] < 160 and peak["workers_mib"] < 160, peak
    assert len(IndexedDataset(tmp_path / "out" / "ds")) == 1  # one document, in pieces


def test_a_long_document_in_pieces_has_the_tokens_of_the_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 2,000 characters, cut before a space: the dataset holds exactly the tokens of the whole
    document, with one end of document, whatever the number of workers; the trained tokenizer is the one the
    whole document trains."""
    text = words_text(30_000) + "\n" + "x" * 5_000 + " tail"  # one run with no space to cut at
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "short.txt").write_text("a short one")
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 2_000)
    for workers in (1, 2):
        summary = prepare(
            [tmp_path / "long.txt", tmp_path / "short.txt"],
            tmp_path / f"w{workers}" / "ds",
            vocab_size=400,
            workers=workers,
            progress=False,
        )
        tok = Tokenizer.from_file(summary.tokenizer)
        data = IndexedDataset(tmp_path / f"w{workers}" / "ds")
        eod = tok.token_to_id("<|endoftext|>")
        whole = tok.encode(text, add_special_tokens=False).ids
        # the hard cuts inside the run of x's may cut a token; everything else is the whole document's
        got = data.get(0).tolist()
        assert got[-1] == eod and eod not in got[:-1] and tok.decode(got[:-1]) == text
        assert got[:200] == whole[:200]  # the first pieces: clean cuts, the same tokens
        assert summary.documents == 2 and tok.decode(data.get(1).tolist()[:-1]) == "a short one"
    assert (tmp_path / "w1" / "ds.bin").read_bytes() == (tmp_path / "w2" / "ds.bin").read_bytes()
    words_only = words_text(30_000)
    (tmp_path / "words.txt").write_text(words_only)
    pieces = prepare([tmp_path / "words.txt"], tmp_path / "pieces" / "ds", vocab_size=400, progress=False)
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 1 << 30)
    whole_run = prepare([tmp_path / "words.txt"], tmp_path / "whole" / "ds", vocab_size=400, progress=False)
    assert Path(pieces.tokenizer).read_text() == Path(whole_run.tokenizer).read_text()
    assert (tmp_path / "pieces" / "ds.bin").read_bytes() == (tmp_path / "whole" / "ds.bin").read_bytes()


def sentencepiece_like(sample: list[str]) -> Tokenizer:
    """Llama-2's tokenizer.json style: a ▁ before every text, spaces as ▁, no pre-tokenizer (its merges never
    span a ▁ inside: trained here split before each ▁, as SentencePiece trains)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.train_from_iterator(
        sample, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"], show_progress=False)
    )
    tok.pre_tokenizer = None
    return tok


@pytest.mark.parametrize(
    "kind, mode",
    [("byte-level", "space"), ("metaspace", "space"), ("whitespace", "space"), ("no pre-tokenizer", "inexact")],
)
def test_how_each_kind_of_tokenizer_is_cut(kind: str, mode: str) -> None:
    sample = [words_text(3_000, seed) for seed in range(5)] + ["x = f(1); end. Next 4096 42 naïve café"] * 5
    if kind == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        alphabet = []
    elif kind == "whitespace":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        alphabet = []
    else:
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        alphabet = []
    trainer = (
        trainers.WordLevelTrainer(special_tokens=["<unk>"])
        if isinstance(tok.model, models.WordLevel)
        else trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<unk>"], initial_alphabet=alphabet, show_progress=False
        )
    )
    tok.train_from_iterator(sample, trainer)
    assert prepare_module._split_mode(tok) == mode
    if mode == "space":
        text = sample[0] * 3
        pieces = list(prepare_module._pieces(text, 500))
        assert len(pieces) > 10 and "".join(pieces) == text
        assert (
            sum((tok.encode(p, add_special_tokens=False).ids for p in pieces), [])
            == tok.encode(text, add_special_tokens=False).ids
        )


def test_a_tokenizer_that_adds_a_space_gets_the_cuts_space_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sample = [words_text(3_000, seed) for seed in range(5)]
    tok = sentencepiece_like(sample)
    assert prepare_module._split_mode(tok) == "drop"
    tok.save(str(tmp_path / "sp.json"))
    text = sample[0] * 2
    (tmp_path / "long.txt").write_text(text)
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 700)
    prepare([tmp_path / "long.txt"], tmp_path / "ds", tokenizer=tmp_path / "sp.json", progress=False)
    got = IndexedDataset(tmp_path / "ds").get(0).tolist()
    assert got == tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("</s>")]


def test_an_inexact_tokenizer_is_warned_when_a_document_is_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "</s>": 2}, unk_token="[UNK]")).save(str(tmp_path / "t.json"))
    (tmp_path / "long.txt").write_text("a " * 2_000)
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 1_000)
    prepare([tmp_path / "long.txt"], tmp_path / "ds", tokenizer=tmp_path / "t.json", progress=False)
    err = capfd.readouterr().err
    assert f"warning: {tmp_path / 'long.txt'}: 4,000 characters, tokenised in pieces of about 1,000" in err


# -- progress without a terminal


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    """A log file, `tee`, nohup: the bar is not shown, lines are: the training, then the tokenising, each with
    documents and inputs done."""
    done = run_tool(
        "--input",
        "stdlib",
        "--max-documents",
        "30",
        "--output",
        "out/ds",
        "--vocab-size",
        "300",
        "--workers",
        "1",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any(
        line.startswith("ds: training the tokenizer: 30 documents read (") and "computing the merges" in line
        for line in lines
    ), lines
    assert any(line.startswith("ds: training the tokenizer: ") and "done, vocabulary 300" in line for line in lines)
    final = [line for line in lines if line.startswith("ds: tokenising: 30 documents, ")]
    assert final and final[-1].endswith("; done"), lines


def test_progress_lines_come_every_few_seconds(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(words_text(5_000, i))
    prepare([corpus], tmp_path / "out" / "ds", vocab_size=300, progress=True, progress_every=0)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ds: ")]
    assert any("input 3/6" in line for line in lines if "training" in line), lines
    assert len([line for line in lines if "tokenising" in line]) >= 2, lines


def test_the_login_node_preparation_shows_progress(
    tmp_path: Path, compose_cfg: Callable[..., Any], capfd: pytest.CaptureFixture[str]
) -> None:
    """`data.prepare` (what `+experiment=stdlib_bpe` runs on the login node for about a minute): lines as it
    goes, then what was prepared."""
    from hpctrain.launch.data import prepare_data

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(words_text(50_000))
    cfg = compose_cfg(
        "data=indexed",
        f"data.blend={tmp_path / 'data' / 'ds'}",
        f"data.prepare.inputs=[{corpus}]",
        "data.prepare.vocab_size=300",
        "data.prepare.workers=1",
        "data.vocab_size=300",
    )
    prepare_data(cfg.data)
    out, err = capfd.readouterr()
    assert f"data: preparing {tmp_path / 'data' / 'ds'} from {corpus}" in out
    assert "ds: training the tokenizer: 1 documents read" in err and "ds: tokenising: 1 documents" in err
    assert f"data: prepared {tmp_path / 'data' / 'ds'}: 1 documents, " in out
