"""The run's records: the on-disk names everyone shares, the job history, and the checkpoint fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.models.family import Dims
from hpctrain.records.fingerprint import (
    Fingerprint,
    ModelFingerprint,
    fingerprint_of,
    upgrade_fingerprint,
)
from hpctrain.records.jobs import (
    append_attempt,
    append_job,
    read_attempts,
    read_jobs,
    write_report,
)
from hpctrain.records.paths import RunPaths


def test_the_run_directory_keeps_its_names(tmp_path: Path) -> None:
    """The on-disk contract (tests/slurm and users' scripts read these names literally)."""
    files = RunPaths(tmp_path)
    named = {
        files.config: "config.yaml",
        files.submitit: "submitit",
        files.plan: "plan.json",
        files.jobs: "jobs.jsonl",
        files.attempts: "attempts.jsonl",
        files.failed: "FAILED.json",
        files.metrics: "metrics.jsonl",
        files.events: "events.jsonl",
        files.faults: "faults",
        files.failures("7"): "failures/7",
        files.hosts("7"): "failures/7/hosts.json",
        files.hangs("7"): "hangs/7",
        files.preflight("7"): "health/7/preflight.json",
        files.archived_config("20260101-000000"): "config.20260101-000000.yaml",
    }
    assert {str(p.relative_to(tmp_path)): name for p, name in named.items()} == {v: v for v in named.values()}


def test_the_job_history_appends_and_reads_back(tmp_path: Path) -> None:
    append_job(tmp_path, "1", "slurm", resumed=False)
    append_job(tmp_path, "2", "slurm", resubmission_of="1", exclude=["n2"])
    append_attempt(tmp_path, {"job_id": "1", "action": "resubmit", "resubmitted_as": "2"})
    jobs = read_jobs(tmp_path)
    assert [j["job_id"] for j in jobs] == ["1", "2"] and jobs[1]["exclude"] == ["n2"]
    assert list(jobs[0]) == ["job_id", "executor", "submitted", "resumed"]
    assert read_attempts(tmp_path) == [{"job_id": "1", "action": "resubmit", "resubmitted_as": "2"}]
    assert json.loads(write_report(tmp_path, {"why": "x"}).read_text()) == {"why": "x"}


def legacy(cfg) -> dict:
    """The fingerprint as manifests held it before its fields had names (positional lists)."""
    m, d, t = cfg.model, cfg.data, cfg.train
    return {
        "model": [m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.context, m.ffn_mult],
        "global_batch": t.global_batch,
        "seq_len": t.seq_len,
        "seed": t.seed,
        "data": [d.kind.value, d.max_bytes],
    }


def test_the_fingerprint_has_names_and_reads_old_manifests(compose_cfg) -> None:
    cfg = compose_cfg()
    fp = fingerprint_of(cfg.model, cfg.train, cfg.data)
    assert fp.model == ModelFingerprint("gpt", Dims.of(cfg.model))
    saved = json.loads(json.dumps(fp.to_dict()))  # as a manifest holds it
    assert saved["model"]["n_layers"] == cfg.model.n_layers and saved["data"]["kind"] == "text_bytes"
    assert Fingerprint.from_dict(saved) == fp == Fingerprint.from_dict(legacy(cfg))
    assert upgrade_fingerprint(legacy(cfg)) == saved  # an old checkpoint still resumes exactly
    assert upgrade_fingerprint({"model": "other"}) == {"model": "other"}


def test_a_changed_field_still_differs(compose_cfg) -> None:
    cfg = compose_cfg("train.global_batch=32")
    old = upgrade_fingerprint(legacy(compose_cfg()))
    new = fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()
    assert {k for k in new if new[k] != old[k]} == {"global_batch"}


def as_legacy_manifests(root: Path) -> int:
    """Rewrite every manifest's fingerprint in the positional form of older hpctrain versions (which wrote no
    checksums and no seal either)."""
    manifests = list(root.rglob("manifest.json"))
    for path in manifests:
        manifest = json.loads(path.read_text())
        fp = manifest["fingerprint"]
        if isinstance(fp["model"], dict):  # a GPT run: its MLP ffn_mult x d_model wide
            m = fp["model"]
            fp["model"] = [m["n_layers"], m["d_model"], m["n_heads"], m["vocab_size"], m["context"]]
            fp["model"].append(m["ffn_hidden"] // m["d_model"])
            fp["data"] = [fp["data"]["kind"], fp["data"]["source"]]
        for key in ("crc32c", "manifest_crc32c"):
            manifest.pop(key, None)
        path.write_text(json.dumps(manifest))
    return len(manifests)


@pytest.mark.timeout(300)
def test_a_checkpoint_of_an_older_version_resumes_and_still_refuses_a_change(compose_cfg, tmp_path: Path) -> None:
    from tests.checkpoint.test_checkpoint import config, tiers
    from tests.checkpoint.training import train
    from tests.distributed_harness import DistributedTestError

    run_dir = tmp_path / "run"
    train(2, config(compose_cfg, tmp_path, 2, "train.max_steps=4", *tiers(tmp_path, 2, 100, 100)), run_dir)
    assert as_legacy_manifests(tmp_path)
    changed = config(
        compose_cfg, tmp_path, 2, "train.max_steps=6", "train.global_batch=16", *tiers(tmp_path, 2, 100, 100)
    )
    with pytest.raises(DistributedTestError, match="global_batch: 8 -> 16"):
        train(2, changed, run_dir, timeout=60)
    train(2, config(compose_cfg, tmp_path, 2, "train.max_steps=6", *tiers(tmp_path, 2, 100, 100)), run_dir)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [5, 6]


# ---------------------------------------------------------------- messages the user reads are whole
def long_message() -> str:
    """A 600-character error whose key and fix come last, as the config and data checks write them."""
    tail = " data.vocab_size: the tokenizer file says 4096 tokens, the config 300. fix: set data.vocab_size=4096"
    head = (
        "while opening the dataset for rank 0 the loader read the index, the sizes, the document boundaries "
        "and the tokenizer file beside the tokens file; "
    ) * 5
    return head[: 600 - len(tail)] + tail


def test_a_long_message_is_whole_in_the_records_the_report_the_log_and_the_console(tmp_path: Path, capsys) -> None:
    """FAILED.json, the failure records, the workers' stop and the supervisor's console line carry the whole
    message: the key and the fix are at its end (issue 29: they were cut at 200 characters)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from hpctrain.config.schema import Config
    from hpctrain.launch.supervise import decide, main
    from hpctrain.records.failures import attempt_key, diagnose, read_failures, record_failure, same_failure
    from hpctrain.records.jobs import read_report
    from hpctrain.train.loop import repeated_failure

    message = long_message()
    assert len(message) == 600 and message.endswith("fix: set data.vocab_size=4096")
    OmegaConf.save(OmegaConf.structured(Config), tmp_path / "config.yaml")  # the local executor
    append_job(tmp_path, "1", "local")
    record_failure(tmp_path, "1", 0, 7, ValueError(message))
    assert read_failures(tmp_path, "1")[0]["message"] == message
    first = decide(tmp_path, "1", 1, 5)
    assert first["action"] == "resubmit" and first["signature"]["message"] == message
    append_attempt(tmp_path, {"job_id": "1", **first, "resubmitted_as": "2"})
    append_job(tmp_path, "2", "local")
    record_failure(tmp_path, "2", 0, 7, ValueError(message))
    assert main([str(tmp_path), "2", "1"]) == 1  # the same error at the same step: stop, with the report
    console = capsys.readouterr().out
    assert "not resubmitting: deterministic failure" in console and message in console, console
    report = read_report(tmp_path)
    assert report is not None and message in report["why"] and report["signature"]["message"] == message

    for restart in (0, 1):  # the workers' own stop inside the allocation (its report and log line)
        record_failure(tmp_path, attempt_key("3", restart), 0, 9, ValueError(message))
    stop = repeated_failure(tmp_path, SimpleNamespace(job_id="3", restart=2, requeue=0))
    assert stop is not None and message in stop["why"] and stop["signature"]["message"] == message

    # Signatures are compared on a prefix: one written cut at 500 characters (before) still matches.
    _, signature = diagnose(read_failures(tmp_path, "2"))
    assert same_failure({**signature, "message": message[:500]}, signature)
    assert not same_failure({**signature, "message": "another error"}, signature)
