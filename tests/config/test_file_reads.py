"""Every file the login node reads for the checks is a regular file of bounded size (issue 46: `+deepspeed=/dev/zero`
read 11.4 GB in 30 s; a FIFO blocked for ever): a device, a FIFO, a directory, a file of 20 MB where a config of
kilobytes belongs, or a binary file is a config error naming the key and the fix, found in well under a second,
with nothing created. The readers are hpctrain/bounded.py's (tests/test_bounded.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpctrain.launch.cli import EXIT_CONFIG_ERROR, run
from hpctrain.models.llama.entry import hf_config

# What a bad file is, and the words the message has for it
KINDS = {
    "device": "is not a regular file (it is a character device)",
    "fifo": "is not a regular file (it is a FIFO)",
    "directory": "is not a regular file (it is a directory)",
    "20mb": "is 20.0 MiB, more than the 16.0 MiB",
    "binary": "is not a text file (it holds NUL bytes)",
}


def bad_file(path: Path, kind: str) -> Path:
    """`path` made into the kind of file a reader must refuse (the device is /dev/zero itself)."""
    if kind == "device":
        return Path("/dev/zero")
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)  # nothing writes to it: an unguarded open() blocks for ever
    elif kind == "directory":
        path.mkdir()
    elif kind == "20mb":
        with open(path, "wb") as f:
            f.write(b'{"train_batch_size": 8,')
            f.truncate(20 * 2**20)  # sparse: 20 MB to read, nothing to write
    elif kind == "binary":
        path.write_bytes(b"\x89HDF\r\n\x1a\n\x00\x00\x00\x00" * 100)
    return path


def refused(
    compose_cfg: Callable, capsys: pytest.CaptureFixture, root: Path, *overrides: str, key: str, words: str
) -> str:
    """In process, as `python -m hpctrain OVERRIDES`: exit 2 within a second, naming the key, the words and a fix,
    with nothing under the run root."""
    cfg = compose_cfg(*overrides, f"run.root={root}")
    started = time.monotonic()
    assert run(cfg).code == EXIT_CONFIG_ERROR
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert "nothing was submitted" in err and f"{key}: " in err and words in err and "fix: " in err, err
    assert took < 1.0, f"{took:.2f} s to refuse it"
    assert not root.exists() or not any(root.iterdir()), "a refused run must leave nothing behind"
    return err


@pytest.mark.parametrize("kind", KINDS)
def test_a_deepspeed_config_that_is_not_a_small_text_file(compose_cfg, capsys, tmp_path: Path, kind: str) -> None:
    path = bad_file(tmp_path / "in" / "ds_config.json", kind)
    refused(compose_cfg, capsys, tmp_path / "runs", f"+deepspeed={path}", key="deepspeed", words=KINDS[kind])


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"train_batch_size": NaN}', "holds NaN, which is not a number a setting can take"),
        ('{"gradient_clipping": Infinity}', "holds Infinity"),
        ('{"a": ' * 100_000 + "1" + "}" * 100_000, "is nested too deeply"),
        ('{"train_batch_size": 1' + "0" * 5000 + "}", "holds Exceeds the limit"),  # Python's 4300-digit limit
        ("[1, 2]", "holds a list, not an object"),
    ],
    ids=["nan", "infinity", "nested", "digits", "list"],
)
def test_deepspeed_json_that_no_deepspeed_reads(compose_cfg, capsys, tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(text)
    refused(compose_cfg, capsys, tmp_path / "runs", f"+deepspeed={path}", key="deepspeed", words=words)


LLAMA = ["model=llama_tiny"]


def model_dir(compose_cfg: Callable, path: Path) -> Path:
    """A directory with llama_tiny's config.json (the file checks stop at it, or go on to the weights)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config(compose_cfg(*LLAMA).model, "float32")))
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_config_json_that_is_not_a_small_text_file(compose_cfg, capsys, tmp_path: Path, kind: str) -> None:
    if kind == "device":
        directory = tmp_path / "hf"
        directory.mkdir()
        (directory / "config.json").symlink_to("/dev/zero")
    else:
        directory = tmp_path / "hf"
        bad_file(directory / "config.json", kind)
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={directory}",
        key="model.init_from",
        words=KINDS[kind],
    )


@pytest.mark.parametrize("kind", ["fifo", "directory", "binary"])
def test_a_safetensors_index_that_is_not_a_small_text_file(compose_cfg, capsys, tmp_path: Path, kind: str) -> None:
    directory = model_dir(compose_cfg, tmp_path / "hf")
    bad_file(directory / "model.safetensors.index.json", kind)
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={directory}",
        key="model.init_from",
        words=KINDS[kind],
    )


def test_a_device_as_the_model_directory(compose_cfg, capsys, tmp_path: Path) -> None:
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        "model.init_from=/dev/zero",
        key="model.init_from",
        words="/dev/zero is not a directory",
    )


def test_a_fifo_as_the_safetensors_weights_is_not_opened(compose_cfg, capsys, tmp_path: Path) -> None:
    directory = model_dir(compose_cfg, tmp_path / "hf")
    os.mkfifo(directory / "model.safetensors")
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={directory}",
        key="model.init_from",
        words="no model.safetensors or model.safetensors.index.json",
    )


PREPARE = ["data=indexed", "data.vocab_size=4096", "model.vocab_size=4096", "data.prepare.inputs=[stdlib]"]


@pytest.mark.parametrize("kind", ["device", "fifo", "directory", "binary"])
def test_a_tokenizer_to_prepare_with_that_is_not_a_text_file(compose_cfg, capsys, tmp_path: Path, kind: str) -> None:
    path = bad_file(tmp_path / "in" / "tokenizer.json", kind)
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *PREPARE,
        f"data.blend={tmp_path / 'data' / 'd'}",
        f"data.prepare.tokenizer={path}",
        key="data.prepare.tokenizer",
        words=KINDS[kind],
    )


@pytest.mark.parametrize(
    "kind, words",
    [
        ("device", "/dev/zero is a character device, not a file or directory"),
        ("fifo", "is a FIFO, not a file or directory"),
    ],
)
def test_a_prepare_input_that_would_be_read_without_end(
    compose_cfg, capsys, tmp_path: Path, kind: str, words: str
) -> None:
    path = bad_file(tmp_path / "in" / "corpus.jsonl", kind)
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        "data=indexed",
        "data.vocab_size=256",
        f"data.blend={tmp_path / 'data' / 'd'}",
        f"data.prepare.inputs=[{path}]",
        key="data.prepare.inputs",
        words=words,
    )


def test_a_dataset_tokenizer_that_is_a_fifo_is_left_alone(compose_cfg, tmp_path: Path) -> None:
    """PREFIX.tokenizer.json is only compared with data.vocab_size when it is a file; a FIFO there is not opened."""
    from hpctrain.checks.runner import run_checks
    from tests.config.test_file_checks import dataset

    prefix = dataset(tmp_path / "data" / "d", [300] * 20)
    os.mkfifo(f"{prefix}.tokenizer.json")
    started = time.monotonic()
    report = run_checks(
        compose_cfg("data=indexed", "data.vocab_size=256", "data.valid_fraction=0", f"data.blend={prefix}")
    )
    assert time.monotonic() - started < 1.0 and not report.errors, report.errors


def test_a_manifest_that_is_a_fifo_is_not_a_checkpoint(compose_cfg, tmp_path: Path) -> None:
    """A resume's check reads the newest step's manifest.json: a FIFO there is skipped, as a damaged one is."""
    from hpctrain.checks.files import newest_checkpoint

    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    os.mkfifo(step / "manifest.json")
    started = time.monotonic()
    assert newest_checkpoint(compose_cfg(), run_dir) is None
    assert time.monotonic() - started < 1.0
