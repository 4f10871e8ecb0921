"""The files a run will read, checked on the login node (hpctrain/checks/files.py): each bad file is refused
before anything is created, naming the key, the file and the fix, where the job used to find it after a queue wait.

Every file here is real: datasets written by hpctrain's own writer (and hpctrain.data.prepare), Hugging Face
directories written by hpctrain's exporter, checkpoints committed by hpctrain's own manifest writer (and one by a
real training run), file systems mounted for the test in a mount namespace of its own. The torch-free readers of
the login side are checked against the readers the job uses.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from hpctrain.checks.files import (
    FileProblem,
    hf_mismatches,
    hf_weight_shapes,
    min_documents,
    open_index,
    safetensors_header,
    tokenizer_vocab_size,
)
from hpctrain.checks.runner import check_config, run_checks
from hpctrain.data.indexed import IndexedDatasetWriter
from hpctrain.hardware import format_bytes
from hpctrain.launch.cli import EXIT_CONFIG_ERROR, run
from tests.conftest import REPO, run_hpctrain
from tests.gpu_rules import environment as rules_environment


def refused(compose_cfg, capsys, root: Path, *overrides: str, key: str, words: list[str]) -> str:
    """`python -m hpctrain OVERRIDES` (in process) exits 2 naming `key`, every one of `words` and a fix, and
    leaves nothing under the run root."""
    cfg = compose_cfg(*overrides, f"run.root={root}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "nothing was submitted" in err and f"{key}: " in err and "fix: " in err, err
    for word in words:
        assert word in err, err
    assert not root.exists() or not any(root.iterdir()), "a refused run must leave nothing behind"
    return err


def dataset(prefix: Path, lengths: list[int], dtype: type = np.uint16) -> Path:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for i, n in enumerate(lengths):
            writer.add_document(np.arange(i, i + n) % 200)
    return prefix


INDEXED = ["data=indexed", "data.vocab_size=256"]


# ---------------------------------------------------------------- data files


def test_an_idx_from_another_dataset_beside_a_bin_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    """The job's reader found the sizes disagree when every rank opened the dataset; the login node does now."""
    a = dataset(tmp_path / "data" / "a", [100 + i for i in range(200)])
    b = dataset(tmp_path / "data" / "b", [90 + i for i in range(150)])
    shutil.copy(f"{b}.idx", f"{a}.idx")  # b's index beside a's tokens
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *INDEXED,
        f"data.blend={a}",
        key="data.blend",
        words=[f"{a}.bin", f"{a}.idx", "not one dataset"],
    )


def test_a_valid_blend_dataset_is_checked_too(compose_cfg, capsys, tmp_path: Path) -> None:
    a = dataset(tmp_path / "data" / "a", [100] * 200)
    v = dataset(tmp_path / "data" / "v", [100] * 20)
    with open(f"{v}.bin", "ab") as f:
        f.write(b"\0\0")  # one token more than the index describes
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *INDEXED,
        f"data.blend={a}",
        f"data.valid_blend={v}",
        "data.valid_fraction=0",
        key="data.valid_blend",
        words=[f"{v}.bin", "4,002 bytes"],
    )


def test_a_damaged_index_header_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    a = dataset(tmp_path / "data" / "a", [100] * 200)
    with open(f"{a}.idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *INDEXED,
        f"data.blend={a}",
        key="data.blend",
        words=[f"{a}.idx", "not an indexed dataset index"],
    )


def test_a_dataset_tokenizer_larger_than_data_vocab_size_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    """hpctrain.data.prepare saves the BPE it trained as PREFIX.tokenizer.json; the job stopped at the first sample
    holding an id >= data.vocab_size."""
    from hpctrain.data.prepare import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted((Path(os.__file__).parent).glob("*.py"))[:12]):
        (corpus / f"{i:02d}.txt").write_text(path.read_text(errors="replace")[:20000])
    prefix = tmp_path / "data" / "bpe"
    summary = prepare([corpus], prefix, vocab_size=400, progress=False)
    assert summary.vocab_size == 400
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        "data=indexed",
        "data.vocab_size=300",
        "model.vocab_size=300",
        f"data.blend={prefix}",
        "data.valid_fraction=0",
        key="data.vocab_size",
        words=[f"{prefix}.tokenizer.json", "400 tokens", "data.vocab_size=300", "set data.vocab_size=400"],
    )


def test_a_given_tokenizer_larger_than_data_vocab_size_is_refused_before_preparing(
    compose_cfg, capsys, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer, models

    tokenizer = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(4096)}, unk_token="t0")).save(str(tokenizer))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("t1 t2 t3\n")
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        "data=indexed",
        "data.vocab_size=300",
        "model.vocab_size=300",
        f"data.blend={tmp_path / 'data' / 'ds'}",
        f"data.prepare.inputs=[{corpus}]",
        f"data.prepare.tokenizer={tokenizer}",
        key="data.vocab_size",
        words=[str(tokenizer), "4096 tokens"],
    )
    assert not (tmp_path / "data").exists(), "nothing prepared"


def test_one_document_with_the_default_validation_hold_out_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    """data=indexed holds out 1% of the documents by default: round(1 x 0.01) = 0 of one document."""
    one = dataset(tmp_path / "data" / "one", [5000])
    assert compose_cfg(*INDEXED, f"data.blend={one}").data.valid_fraction == 0.01
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *INDEXED,
        f"data.blend={one}",
        key="data.valid_fraction",
        words=[f"{one}.idx", "1 document(s)", "data.valid_fraction=0", "at least 51 documents"],
    )


def test_a_dataset_smaller_than_one_sample_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    small = dataset(tmp_path / "data" / "small", [10] * 100)  # 990 training tokens, 10 held out: < 129
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *INDEXED,
        f"data.blend={small}",
        key="data.valid_fraction",
        words=["the validation data of", "10 token(s)", "train.seq_len=128"],
    )


def test_an_odd_length_tokens_file_is_refused_naming_it(compose_cfg, capsys, tmp_path: Path) -> None:
    """numpy's "not a multiple of the data-type size" in the job named no file."""
    path = tmp_path / "data" / "train.bin"
    path.parent.mkdir()
    np.arange(5001, dtype=np.uint16).tofile(path)
    with open(path, "ab") as f:
        f.write(b"\x01")
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        "data=tokens",
        "data.vocab_size=256",
        f"data.path={path}",
        key="data.path",
        words=[str(path), "10,003 bytes", "uint16", "data.token_dtype"],
    )


def test_a_tokens_directory_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        "data=tokens",
        "data.vocab_size=256",
        f"data.path={tmp_path / 'data'}",
        key="data.path",
        words=["is not a file"],
    )


def test_sound_datasets_pass(compose_cfg, tmp_path: Path) -> None:
    a = dataset(tmp_path / "a", [100 + i for i in range(200)])
    check_config(compose_cfg(*INDEXED, f"data.blend='0.3 {a} 0.7 {a}'"))
    path = tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    check_config(compose_cfg("data=tokens", "data.vocab_size=256", f"data.path={path}"))


def test_the_header_reader_agrees_with_the_job_reader(tmp_path: Path) -> None:
    from hpctrain.checks import files as file_checks
    from hpctrain.data import indexed

    assert file_checks.INDEX_MAGIC == indexed.MAGIC and file_checks.INDEX_HEADER.format == indexed.HEADER.format
    assert {c: (dt.name, dt.itemsize) for c, dt in indexed.DTYPES.items()} == file_checks.INDEX_DTYPES
    for dtype in (np.uint16, np.int32):
        prefix = dataset(tmp_path / f"d{np.dtype(dtype).name}", [7, 0, 300, 12, 1])
        summary, job = open_index(str(prefix)), indexed.IndexedDataset(prefix)
        try:
            assert (summary.tokens, summary.sequences, summary.documents) == (
                job.num_tokens,
                len(job),
                len(job.document_indices) - 1,
            )
            starts = [int(p) // job.dtype.itemsize for p in job.sequence_pointers]
            assert [summary.tokens_before(s) for s in range(6)] == [*starts, job.num_tokens]
        finally:
            summary.close()
    for fraction in (0.01, 0.02, 0.1, 0.3):
        n = min_documents(fraction)
        assert 1 <= round(n * fraction) < n and not 1 <= round((n - 1) * fraction) < n - 1


def test_the_tokenizer_size_agrees_with_tokenizers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    from hpctrain.data.prepare import train_tokenizer

    bpe = train_tokenizer(iter(["hello world, " * 50, "another text with words " * 20]), 300)
    bpe.add_special_tokens(["<|extra|>"])
    uni = Tokenizer(models.Unigram([("a", -1.0), ("b", -2.0), ("<unk>", -3.0)], 2, False))
    for name, tok in (("bpe", bpe), ("unigram", uni)):
        tok.save(str(tmp_path / f"{name}.json"))
        assert tokenizer_vocab_size(tmp_path / f"{name}.json") == tok.get_vocab_size(with_added_tokens=True)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(FileProblem, match="bad.json: not valid JSON"):
        tokenizer_vocab_size(tmp_path / "bad.json")


# ---------------------------------------------------------------- model.init_from


def hf_dir(compose_cfg, path: Path, *overrides: str, max_shard_bytes: int = 5 * 10**9) -> Path:
    """A Hugging Face model directory written by hpctrain's exporter (zero weights of the model's shapes)."""
    import torch

    from hpctrain.checkpoint.hf import save_hf
    from hpctrain.models.hf import shapes

    m = compose_cfg(*overrides).model
    save_hf({k: torch.zeros(s) for k, s in shapes(m).items()}, m, path, max_shard_bytes)
    return path


LLAMA = ["model=llama_tiny"]


def test_a_matching_model_directory_passes(compose_cfg, tmp_path: Path) -> None:
    path = hf_dir(compose_cfg, tmp_path / "hf", *LLAMA)
    check_config(compose_cfg(*LLAMA, f"model.init_from={path}"))
    sharded = hf_dir(compose_cfg, tmp_path / "sharded", *LLAMA, max_shard_bytes=200_000)
    assert (sharded / "model.safetensors.index.json").exists()
    check_config(compose_cfg(*LLAMA, f"model.init_from={sharded}"))


def test_a_config_json_that_does_not_match_the_model_names_each_field(compose_cfg, capsys, tmp_path: Path) -> None:
    path = hf_dir(compose_cfg, tmp_path / "hf", *LLAMA, "model.n_layers=2", "model.ffn_hidden=256")
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={path}",
        key="model.init_from",
        words=[
            str(path / "config.json"),
            "model.n_layers: 4 here, 2 in config.json",
            "model.ffn_hidden: 352 here, 256 in config.json",
            "set model.n_layers=2 model.ffn_hidden=256",
        ],
    )


def test_a_truncated_safetensors_file_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    path = hf_dir(compose_cfg, tmp_path / "hf", *LLAMA)
    weights = path / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)  # a copy that did not finish
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={path}",
        key="model.init_from",
        words=[str(weights), "cut short", "copy or download the file again"],
    )


def test_an_invalid_config_json_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    path = hf_dir(compose_cfg, tmp_path / "hf", *LLAMA)
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 128,')
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={path}",
        key="model.init_from",
        words=[str(path / "config.json"), "is not valid JSON"],
    )


def test_a_file_instead_of_a_directory_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    path = hf_dir(compose_cfg, tmp_path / "hf", *LLAMA)
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={path / 'model.safetensors'}",
        key="model.init_from",
        words=["model.safetensors is a file, not a directory", f"model.init_from={path}"],
    )


def test_weights_that_disagree_with_their_config_json_are_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    path = hf_dir(compose_cfg, tmp_path / "hf", *LLAMA, "model.n_kv_heads=1")
    right = hf_dir(compose_cfg, tmp_path / "right", *LLAMA)
    shutil.copy(right / "config.json", path / "config.json")  # the run's shape claimed, other weights
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={path}",
        key="model.init_from",
        words=["although config.json does", "k_proj.weight: shape [32, 128], the config wants [64, 128]"],
    )


def test_a_missing_shard_and_a_pickle_only_directory_are_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    path = hf_dir(compose_cfg, tmp_path / "hf", *LLAMA, max_shard_bytes=200_000)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={path}",
        key="model.init_from",
        words=[f"names {shard.name}, which is not in {path}"],
    )
    pickles = hf_dir(compose_cfg, tmp_path / "pickles", *LLAMA)
    (pickles / "model.safetensors").rename(pickles / "pytorch_model.bin")
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *LLAMA,
        f"model.init_from={pickles}",
        key="model.init_from",
        words=["found pytorch_model.bin", "safe_serialization=True"],
    )


def test_the_torch_free_model_checks_agree_with_the_job(compose_cfg) -> None:
    from hpctrain.models.hf import hf_config, hf_shapes, mismatches

    models = [
        compose_cfg(*o).model
        for o in (
            [],
            LLAMA,
            [*LLAMA, "model.n_kv_heads=1"],
            ["model=gpt3_125m"],
            ["model=llama3_8b"],
            [*LLAMA, "model.rope.scaling_factor=8"],
        )
    ]
    for m in models:
        assert hf_weight_shapes(m) == hf_shapes(m)
        for other in models:
            assert hf_mismatches(m, hf_config(other)) == mismatches(m, hf_config(other))


def test_the_safetensors_header_reader_agrees_with_safetensors(tmp_path: Path) -> None:
    import torch
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(3, dtype=torch.bfloat16)}, str(path))
    data = path.read_bytes()
    assert safetensors_header(path) == {"a": (4, 4), "b": (3,)}
    for name, content in (("long", data + b"\0"), ("short", data[:-3]), ("header", data[:40])):
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(FileProblem, match=str(bad)):
            safetensors_header(bad)
        with pytest.raises(SafetensorError):
            with safe_open(str(bad), "pt") as handle:
                [handle.get_tensor(k) for k in handle.keys()]


# ---------------------------------------------------------------- zero.nvme_path

NVME = ["zero=stage3_nvme"]


def hpctrain_with_mounts(mounts: list[tuple[str, Path]], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m hpctrain ARGS` with tmpfs file systems (options, directory) mounted for it alone: in a mount
    namespace of its own (a user namespace too when not root), gone when it ends."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed")
    script = " && ".join(f"mount -t tmpfs -o {opts} tmpfs {shlex.quote(str(d))}" for opts, d in mounts)
    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
    env = rules_environment({**os.environ, "WANDB_MODE": "offline"})
    proc = subprocess.run(
        [unshare, *flags, "sh", "-c", script + ' && exec "$@"', "sh", sys.executable, "-m", "hpctrain", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if "hpctrain" not in proc.stderr and proc.returncode:
        pytest.skip(f"no mount namespace here: {proc.stderr.strip()[-300:]}")
    return proc


def test_nvme_path_on_a_read_only_file_system_is_refused(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    proc = hpctrain_with_mounts(
        [("ro,size=64m", nvme)], *NVME, f"zero.nvme_path={nvme}", f"run.root={tmp_path / 'runs'}", cwd=tmp_path
    )
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    assert f"zero.nvme_path: {nvme} is on a read-only file system" in proc.stderr and "fix: " in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode 0555 directory: the job would too")
def test_nvme_path_without_write_permission_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o555)
    try:
        refused(
            compose_cfg,
            capsys,
            tmp_path / "runs",
            *NVME,
            f"zero.nvme_path={nvme}",
            key="zero.nvme_path",
            words=[f"{nvme} is not writable"],
        )
    finally:
        nvme.chmod(0o755)


def test_nvme_path_too_small_says_how_much_in_a_readable_unit(tmp_path: Path) -> None:
    """The tiny model's moments take a few MiB per node: "0.00 GiB needed, 0.00 GiB free" said nothing."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    proc = hpctrain_with_mounts(
        [("size=1m", nvme)], *NVME, f"zero.nvme_path={nvme}", f"run.root={tmp_path / 'runs'}", cwd=tmp_path
    )
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    assert re.search(r"zero.nvme_path: Adam's moments need \d+\.\d\d MiB per node", proc.stderr), proc.stderr
    assert f"1.00 MiB free in {nvme}" in proc.stderr and "0.00 GiB" not in proc.stderr and "fix: " in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_nvme_path_that_is_a_file_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    (tmp_path / "nvme").write_text("")
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *NVME,
        f"zero.nvme_path={tmp_path / 'nvme'}",
        key="zero.nvme_path",
        words=["is not a directory"],
    )


def test_a_node_local_nvme_path_this_machine_does_not_have_is_left_to_the_job(compose_cfg, tmp_path: Path) -> None:
    report = run_checks(compose_cfg(*NVME, "cluster=dev", f"zero.nvme_path={tmp_path / 'absent' / 'local_nvme'}"))
    assert not [p for p in report.errors + report.warnings if p.key == "zero.nvme_path"]


def test_sizes_read_in_a_unit_that_shows_them() -> None:
    assert format_bytes(6.43 * 2**20) == "6.43 MiB" and format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 bytes" and format_bytes(3 * 2**40) == "3.00 TiB"
    assert format_bytes(2.5 * 2**30) == "2.50 GiB"


# ---------------------------------------------------------------- what the login node writes, what NCCL reads


def test_a_run_root_on_a_read_only_file_system_is_refused(tmp_path: Path) -> None:
    """The run directory is made at submission: a read-only run.root was a raw PermissionError there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    proc = hpctrain_with_mounts([("ro,size=1m", shared)], f"run.root={shared / 'runs'}", cwd=tmp_path)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    assert f"run.root: {shared / 'runs'} cannot be written: {shared} is on a read-only file system" in proc.stderr
    assert "fix: " in proc.stderr


def test_a_plan_chart_under_a_file_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("")
    refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        f"plan.png={tmp_path / 'notes' / 'a' / 'p.png'}",
        key="plan.png",
        words=[f"{tmp_path / 'notes'} is a file"],
    )
    assert run_checks(compose_cfg(f"plan.png={tmp_path / 'new' / 'dir' / 'p.png'}")).errors == []  # made then


def test_a_topology_file_this_machine_does_not_have_is_a_warning(compose_cfg, tmp_path: Path) -> None:
    report = check_config(compose_cfg(f"cluster.nccl.topo_file={tmp_path / 'topo.xml'}"))
    assert [w.key for w in report.warnings if str(tmp_path / "topo.xml") in w.message] == ["cluster.nccl.topo_file"]


# ---------------------------------------------------------------- a resume against its checkpoint


def committed_run(compose_cfg, root: Path, *overrides: str, steps: tuple[int, ...] = (200,)) -> Path:
    """A run directory (config.yaml) with checkpoints committed by hpctrain's own manifest writer (sealed), each
    with the fingerprint of the run's config."""
    from hpctrain.checkpoint.storage import partial_dir, publish, step_dir
    from hpctrain.records.fingerprint import fingerprint_of

    cfg = compose_cfg(*overrides, f"run.root={root}", "run.id=r1")
    run_dir = root / str(cfg.run.name) / "r1"
    run_dir.mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    for step in steps:
        partial = partial_dir(run_dir / "checkpoints", step)
        partial.mkdir(parents=True)
        (partial / ".metadata").write_bytes(b"\0" * 16)
        publish(
            partial,
            step_dir(run_dir / "checkpoints", step),
            {
                "step": step,
                "world_size": 2,
                "shared": True,
                "files": {".metadata": 16},
                "fingerprint": fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict(),
            },
        )
    return run_dir


def test_a_resume_that_does_not_match_its_checkpoint_is_refused(compose_cfg, tmp_path: Path) -> None:
    run_dir = committed_run(compose_cfg, tmp_path / "runs")
    cfg = compose_cfg(f"run.root={tmp_path / 'runs'}", f"run.resume={run_dir}", "model.n_layers=2", "train.seed=7")
    report = run_checks(cfg, run_dir)
    errors = {p.key: p for p in report.errors}
    where = str(run_dir / "checkpoints" / "step_00000200")
    assert where in errors["model.n_layers"].message and "cannot be loaded" in errors["model.n_layers"].message
    assert errors["model.n_layers"].fix.startswith("set model.n_layers=4")
    assert where in errors["train.seed"].message and "train.seed=1234" in errors["train.seed"].fix
    # the same without the run directory given: found from run.resume, by path or by id
    assert {p.key for p in run_checks(cfg).errors} >= {"model.n_layers", "train.seed"}
    by_id = compose_cfg(f"run.root={tmp_path / 'runs'}", "run.resume=r1", "train.seed=7")
    assert "train.seed" in {p.key for p in run_checks(by_id).errors}


def test_a_forced_resume_is_a_warning_but_never_another_model(compose_cfg, tmp_path: Path) -> None:
    run_dir = committed_run(compose_cfg, tmp_path / "runs")
    cfg = compose_cfg(
        f"run.root={tmp_path / 'runs'}",
        f"run.resume={run_dir}",
        "train.global_batch=32",
        "checkpoint.force_resume=true",
    )
    report = run_checks(cfg, run_dir)
    assert not report.errors and [w.key for w in report.warnings if "force_resume" in w.message] == [
        "train.global_batch"
    ]
    cfg = compose_cfg(
        f"run.root={tmp_path / 'runs'}", f"run.resume={run_dir}", "model.d_model=256", "checkpoint.force_resume=true"
    )
    assert "model.d_model" in {p.key for p in run_checks(cfg, run_dir).errors}


def test_the_checkpoint_a_resume_would_load_is_the_one_compared(compose_cfg, tmp_path: Path) -> None:
    """A manifest whose seal is broken is passed over by the job's resume: the older checkpoint is the one."""
    from hpctrain.checkpoint.integrity import seal_problem

    run_dir = committed_run(compose_cfg, tmp_path / "runs", steps=(100, 200))
    newest = run_dir / "checkpoints" / "step_00000200" / "manifest.json"
    manifest = json.loads(newest.read_text())
    manifest["fingerprint"]["seed"] = 99  # edited after sealing
    newest.write_text(json.dumps(manifest))
    assert seal_problem(manifest) is not None
    cfg = compose_cfg(f"run.root={tmp_path / 'runs'}", f"run.resume={run_dir}")
    assert not run_checks(cfg, run_dir).errors
    cfg = compose_cfg(f"run.root={tmp_path / 'runs'}", f"run.resume={run_dir}", "train.seed=99")
    assert "step_00000100" in next(p.message for p in run_checks(cfg, run_dir).errors if p.key == "train.seed")


def test_a_rerun_of_a_run_id_that_does_not_match_its_checkpoint_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    """run.id of an existing run continues it (its checkpoint); another model shape was refused only by the job."""
    root = tmp_path / "runs"
    run_dir = committed_run(compose_cfg, root)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    cfg = compose_cfg(f"run.root={root}", "run.id=r1", "model.n_layers=2")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"model.n_layers: 2 here, but the checkpoint this run resumes from ({run_dir / 'checkpoints'}" in err
    assert "fix: set model.n_layers=4" in err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before, "the run directory is left as it was"


@pytest.mark.slow
def test_a_real_checkpoint_is_compared_on_the_login_node(tmp_path: Path) -> None:
    """A real run's real checkpoint, then the same run id with another model: refused before anything is done."""
    root = tmp_path / "runs"
    proc = run_hpctrain("train.max_steps=2", f"run.root={root}", "run.id=real", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = (root / "smoke" / "real" / "config.yaml").read_text()
    proc = run_hpctrain(
        "train.max_steps=4", "model.n_heads=2", f"run.root={root}", "run.id=real", cwd=tmp_path, timeout=120
    )
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    assert "model.n_heads: 2 here, but the checkpoint this run resumes from" in proc.stderr
    assert "step_00000002" in proc.stderr
    assert (root / "smoke" / "real" / "config.yaml").read_text() == config
    assert not (root / "smoke" / "real" / "FAILED.json").exists()


def test_the_manifest_seal_agrees_with_the_job(tmp_path: Path) -> None:
    from hpctrain.checkpoint.integrity import seal, seal_problem
    from hpctrain.checks.files import _manifest_sealed

    manifest = seal({"step": 3, "files": {"a": 1}, "fingerprint": {"seed": 1}})
    assert _manifest_sealed(manifest) and seal_problem(manifest) is None
    broken = {**manifest, "step": 4}
    assert not _manifest_sealed(broken) and seal_problem(broken) is not None
    unsealed = {"step": 3, "files": {}}
    assert _manifest_sealed(unsealed) and seal_problem(unsealed) is None


# ---------------------------------------------------------------- the whole pass


def test_file_problems_come_with_the_config_problems_all_at_once(compose_cfg, capsys, tmp_path: Path) -> None:
    one = dataset(tmp_path / "data" / "one", [5000])
    path = hf_dir(compose_cfg, tmp_path / "hf", "model.n_layers=2")
    err = refused(
        compose_cfg,
        capsys,
        tmp_path / "runs",
        *INDEXED,
        f"data.blend={one}",
        f"model.init_from={path}",
        "optim.lr=-1",
        "cluster.signal_delay_s=-1",
        key="optim.lr",
        words=["data.valid_fraction: ", "model.init_from: ", "cluster.signal_delay_s: "],
    )
    assert "4 config error(s)" in err


def test_the_login_node_reads_headers_not_data_and_imports_no_torch(tmp_path: Path) -> None:
    """The checks of a 40 MB dataset read a few entries of its index (counted by the kernel: /proc/self/io's
    rchar), never its tokens, and torch stays unimported."""
    big = tmp_path / "big"
    with IndexedDatasetWriter(big, np.uint16) as writer:
        writer.add_documents(np.full(2_000, 10_000, np.int64), np.zeros(20_000_000, np.uint16))
    probe = (
        "import json, sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from hpctrain.config.schema import register\n"
        "from hpctrain.checks.runner import run_checks\n"
        "register()\n"
        "def rchar():\n"
        "    return int(next(l for l in open('/proc/self/io') if l.startswith('rchar')).split()[1])\n"
        f"with initialize_config_dir(version_base=None, config_dir={str(REPO / 'conf')!r}):\n"
        "    plain = compose(config_name='config', overrides=['data=indexed', 'data.vocab_size=256', "
        "'data.blend=/nonexistent/x', 'dry_run=true'])\n"
        f"    cfg = compose(config_name='config', overrides=['data=indexed', 'data.vocab_size=256', "
        f"'data.blend={big}'])\n"
        "run_checks(plain)  # the imports the checks make, once\n"
        "before = rchar()\n"
        "report = run_checks(cfg)\n"
        "print(json.dumps({'read': rchar() - before, 'errors': [p.key for p in report.errors],\n"
        "                  'torch': 'torch' in sys.modules}))\n"
    )
    if not Path("/proc/self/io").exists():
        pytest.skip("no /proc/self/io")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["errors"] == [] and out["torch"] is False
    assert out["read"] < 256 * 1024, out  # the .bin alone is 40,000,000 bytes
