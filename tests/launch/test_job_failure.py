"""Issue 46, what a local job prints on the login console. A job that fails ends with what failed (rank, step,
error, from the run's failure records), the failed task's log file and the run directory: no submitit hint, no
traceback on the console (it stays in the log file), exit status 1. An FP8 run on CPU prints none of torchao's
import-time warnings about the CUDA libraries and Triton this machine has not."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import submitit

from hpctrain.launch.submit import explain_failure
from tests.conftest import run_hpctrain


def test_an_injected_fault_is_explained_without_a_traceback(tmp_path: Path) -> None:
    proc = run_hpctrain(
        "+cluster.env.HPCTRAIN_INJECT_FAULT='raise:step=3:rank=1'",
        "train.max_steps=5",
        "optim.warmup_steps=0",
        f"run.root={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=300,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console[-4000:]
    assert "Traceback" not in console and "job.stderr(" not in console, console[-4000:]
    run_dir = next((tmp_path / "runs" / "smoke").iterdir())
    said = proc.stderr[proc.stderr.index("hpctrain: job ") :]
    assert " failed: rank 1 failed at step 3: InjectedFault: injected fault at step 3 on rank 1\n" in said, said
    assert f"  failure record: {run_dir}/failures/" in said and "/rank1.json" in said
    assert "  the run stopped: deterministic failure: the same error at step 3 on two attempts in a row" in said
    log = Path(said.split("  task log: ", 1)[1].splitlines()[0])
    assert log.parent == run_dir / "submitit" and log.name.endswith("_0_log.err")
    assert "Traceback" in log.read_text()  # where the traceback went
    assert f"  run directory: {run_dir}" in said


class FakeJob:
    """What explain_failure asks of a submitit job: its id, its tasks and their log paths."""

    def __init__(self, folder: Path, job_id: str = "77", tasks: int = 1) -> None:
        self.job_id, self.num_tasks, self.folder = job_id, tasks, folder
        self.paths = self.task(0).paths

    def task(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(paths=submitit.core.utils.JobPaths(self.folder, self.job_id, i))


def _record(run_dir: Path, key: str, rank: int, **fields: object) -> None:
    folder = run_dir / "failures" / key
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "host": "n1",
        "job_id": "77",
        "step": 9,
        "type": "RuntimeError",
        "message": "Connection closed by peer",
        "peer": True,
        "blame": None,
        "time": 1.0 + rank,
        **fields,
    }
    (folder / f"rank{rank}.json").write_text(json.dumps(record))


def test_a_rank_that_died_without_a_record(tmp_path: Path) -> None:
    """`exit`/`kill`: only its peers left records; torchelastic's root cause names the rank and its exit code;
    with one task per rank (launcher.in_allocation=false) the log is that rank's task's."""
    _record(tmp_path, "77", 0)
    (tmp_path / "failures" / "77" / "hosts.json").write_text(json.dumps(["n1", "n1"]))
    exc = submitit.core.utils.FailedJobError(
        "Job (task=1) failed during processing with trace:\n----------------------\nTraceback (most recent call "
        'last):\n  File "x.py", line 1, in f\n    g()\ntorch.distributed.elastic.multiprocessing.errors.'
        "ChildFailedError: \n====\nRoot Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
        "  exitcode  : -9 (pid: 5)\n====\n\n----------------------\nYou can check full logs with 'job.stderr(1)'"
    )
    text = explain_failure(tmp_path, FakeJob(tmp_path / "submitit", tasks=2), exc, ranks_per_task=1)
    assert text.startswith("rank 1 was killed by signal 9 without a failure record\n"), text
    assert "rank 0 lost its peers at step 9: RuntimeError: Connection closed by peer" in text
    assert f"task log: {tmp_path}/submitit/77_1_log.err" in text and "job.stderr" not in text
    assert "Traceback" not in text


def test_damaged_records_and_no_records(tmp_path: Path) -> None:
    """A record that is not JSON is passed over; with none at all, the task's own last error line (its class
    without the module), never its traceback."""
    _record(tmp_path, "77", 1, peer=False, type="ValueError", message="bad batch", step=4)
    (tmp_path / "failures" / "77" / "rank0.json").write_bytes(b"\x00\xff{not json")
    (tmp_path / "FAILED.json").write_bytes(b"\xff")
    job = FakeJob(tmp_path / "submitit")
    text = explain_failure(tmp_path, job, RuntimeError("x"))
    assert text.splitlines()[0] == "rank 1 failed at step 4: ValueError: bad batch", text
    assert f"task log: {tmp_path}/submitit/77_0_log.err\nrun directory: {tmp_path}" in text
    bare = tmp_path / "bare"
    exc = submitit.core.utils.FailedJobError(
        "Job (task=0) failed during processing with trace:\n----------------------\nTraceback (most recent call "
        "last):\n  File \"t.py\", line 3, in __call__\n    raise RunStopped('x')\nhpctrain.train.task.RunStopped: "
        "run stopped: a reason\n\n----------------------\nYou can check full logs with 'job.stderr(0)'"
    )
    text = explain_failure(bare, FakeJob(bare / "submitit"), exc)
    assert text.splitlines()[0] == "RunStopped: run stopped: a reason", text
    assert "Traceback" not in text and "job.stderr" not in text


def test_fp8_on_cpu_prints_no_torchao_library_warnings(tmp_path: Path) -> None:
    proc = run_hpctrain(
        "precision=bf16",
        "precision.fp8=tensorwise",
        "train.max_steps=1",
        "optim.warmup_steps=0",
        f"run.root={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=300,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "step 1/1" in proc.stdout, console[-4000:]
    for noise in ("Failed to load", ".so", "triton", "WARNING torchao"):
        assert noise not in console, (noise, console[-4000:])
    assert "Traceback" not in console


def test_torchao_warnings_that_are_not_the_expected_ones_stay() -> None:
    """The filter drops the CPU-expected lines only, and only on the torchao loggers."""
    import logging

    from hpctrain.parallel.float8 import _ExpectedOnCPU

    keep = logging.LogRecord(
        "torchao",
        logging.WARNING,
        "x",
        1,
        "Skipping import of cpp extensions due to incompatible torch version",
        None,
        None,
    )
    drop = logging.LogRecord(
        "torchao",
        logging.WARNING,
        "x",
        1,
        "Failed to load %s: %s",
        ("/p/_C_mxfp8.abi3.so", "Could not load this library"),
        None,
    )
    triton = logging.LogRecord(
        "torchao.kernel.intmm",
        logging.WARNING,
        "x",
        1,
        "Warning: Detected no triton, on systems without Triton certain kernels will not work",
        None,
        None,
    )
    assert _ExpectedOnCPU().filter(keep) and not _ExpectedOnCPU().filter(drop)
    assert not _ExpectedOnCPU().filter(triton)
