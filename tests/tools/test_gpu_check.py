"""tools/gpu_check.py: the --cpu run passes every check and prints the table; a failing, dying or hanging check
is a FAIL row, never a missing table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"
FIRST_BLOCK = ["cmd", "ctl", "llama", "hf", "fr"]  # what a user runs: first, and alone with --quick
SINCE_MOE = ["moe", "cpb", "off", "fp8x", "sync", "rms", "gfree", "comp", "mem"]  # issue 45, item 5: right after it
CHECKS = [*FIRST_BLOCK, *SINCE_MOE, "a", "b1", "b2", "c", "d", "e", "f8", "cp"]


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _rows(stdout: str) -> dict[str, str]:
    """The table's rows by check key (the lines between the header and the closing line)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["check", "what", "result"])
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("all ") or line.split()[1:2] == ["of"]:
            break
        rows[line.split()[0]] = line
    return rows


@pytest.mark.slow
@pytest.mark.timeout(640)
def test_cpu_run_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--cpu", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=620,  # the --cpu budget (540 s) and start-up
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hpctrain GPU check (cpu mode)" in proc.stdout
    rows = _rows(proc.stdout)
    assert list(rows) == CHECKS, proc.stdout
    assert all(" PASS " in line for line in rows.values()), proc.stdout
    assert f"all {len(CHECKS)} checks passed" in proc.stdout

    report = json.loads(out.read_text())
    assert report["passed"] is True and report["mode"] == "cpu"
    checks = {c["check"]: c for c in report["checks"]}
    assert list(checks) == CHECKS and all(c["result"] == "PASS" and c["error"] is None for c in checks.values())
    # cmd: the user's command, twice, through the node's elastic agent (the check itself insists on its log line)
    cmd = checks["cmd"]["numbers"]
    assert cmd["exit_codes"] == [0, 0] and cmd["in_allocation"] is True and "agent" in checks["cmd"]["summary"]
    assert cmd["steps"] == [1, 2, 3, 4, 5] and cmd["resumed_from"] == 3 and cmd["checkpoint_steps"] == [3, 5]
    ctl = checks["ctl"]["numbers"]
    assert ctl["all_reduces_per_step"] == [1, 1, 1]  # a world of one still all-reduces the step's control values
    assert ctl["control_tensor"]["backend"] == "ProcessGroupGloo" and ctl["control_tensor"]["dtype"] == "float64"
    llama = checks["llama"]["numbers"]
    for p in ("bf16", "fp32"):
        assert llama[f"{p}_kernels_alone"] == ["flash"]  # torch's CPU flash kernel; no cuDNN/efficient on CPUs
        assert len(llama[f"{p}_losses"]) == 3 and llama[f"{p}_eval_vs_step"] <= 2e-3
    hf = checks["hf"]["numbers"]
    assert hf["bitwise_equal"] is True and hf["tensors"] > 0 and hf["changed_by_training"] > 0
    assert "config.json" in hf["files"] and len(hf["init_from_losses"]) == 2
    fr = checks["fr"]["numbers"]
    assert fr["exit_code"] == 3 and fr["dumps"]["gloo"]["all_reduces"] == 3 and "flight recorder" in fr["verdict"]
    assert checks["a"]["numbers"]["checkpoint_steps"][-1] == checks["a"]["numbers"]["steps"]
    for b in ("b1", "b2"):
        n = checks[b]["numbers"]
        assert n["mfu_median"] > 0 and n["peak_mem_gib_measured"] > 0 and n["peak_mem_gib_planned"] > 0
    assert checks["c"]["numbers"]["optimizer_tensors"] > 0 and checks["c"]["numbers"]["weights_changed_by_training"] > 0
    d = checks["d"]["numbers"]
    assert len(d["losses"]) == 3 and "cpu" in d["grad_devices"] and max(d["clipped_norms"]) <= 1.001 * d["max_norm"]
    assert d["nvme_bitwise_equal"] is True
    assert checks["e"]["numbers"]["difference"] <= 1e-3
    _assert_since_moe(checks)
    assert report["workdir"] is None  # all passed: the temporary directory is gone
    print(f"gpu_check --cpu: {seconds:.1f} s")


def _assert_since_moe(checks: dict) -> None:
    """The rows of what landed since MoE (issue 45, item 5), each PASS above: what each one measured on the CPU."""
    moe = checks["moe"]["numbers"]
    assert moe["grouped_mm_serves"] is False  # the CPU: the per-expert loop (the GPU run asserts _grouped_mm)
    assert moe["bf16_fsdp"]["gap"] <= 0.02 and all(d > 0 for d in moe["capacity_dropped"])
    assert moe["bias_max"] > 0 and moe["bias_error"] <= 1e-8  # the sigmoid router's bias moved, as the fp64 replay
    assert moe["ep"]["logits_error"] == 0.0 and moe["ep"]["grad_error"] == 0.0  # EP over one gloo rank: exact
    cpb = checks["cpb"]["numbers"]
    assert set(cpb["errors"]) == {"full", "cp4", "cp_attention"} and max(cpb["errors"]["cp4"].values()) < 1e-5
    off = checks["off"]["numbers"]
    assert off["backend"] == "gloo" and min(off["reference_norms"]) > off["max_norm"]  # every step clipped
    for name in ("optimizer", "params"):  # on the CPU the offloaded step is the unoffloaded one, bit for bit
        assert off[name] == {"loss_gap": 0.0, "norm_gap": 0.0, "update_gap": 0.0}
    fp8x = checks["fp8x"]["numbers"]
    assert fp8x["compile_backend"] == "aot_eager" and "aot_eager" in checks["fp8x"]["summary"]
    assert fp8x["tensorwise"]["float8_linears"] > 0 and fp8x["tensorwise"]["fp8_all_gather"] is True
    assert fp8x["tensorwise compiled"]["compile_s"] > 0 and fp8x["compiled_vs_eager"] <= 1e-3
    sync = checks["sync"]["numbers"]
    assert sync["host_reads_per_step"] == [1] * sync["steps"] and sync["budget"] == 1
    assert "Tensor.tolist at hpctrain.parallel.engine" in sync["host_reads"][0]
    rms = checks["rms"]["numbers"]
    assert rms["model"]["norms"] == 8 and rms["model"]["logits_error"] <= 1e-5  # 4 layers x (q, k)
    gfree = checks["gfree"]["numbers"]
    assert gfree["restarts"] == [0, 1] and gfree["steps"][-1] == 6 and gfree["compute_app_queries"] == []
    comp = checks["comp"]["numbers"]
    assert comp["compiled"]["compile_s"] > 0 and comp["loss_gap"] <= 1e-3
    assert checks["mem"]["numbers"]["planned_gib"] > 0 and "no allocator on CPU" in checks["mem"]["summary"]


def test_the_sync_budget_is_the_test_suites() -> None:
    """Check sync fails above the host syncs per step that the test suite pins (tests/gpu_rules.py)."""
    _tool()
    from tests.gpu_rules import SYNCS_PER_STEP
    from tools.gpu_checks.engine_checks import SYNCS_PER_STEP as tool_budget

    assert tool_budget == SYNCS_PER_STEP


def test_a_failing_dying_or_hanging_check_is_a_fail_row(tmp_path: Path, monkeypatch, capsys) -> None:
    tool = _tool()
    for var in ("CUDA_VISIBLE_DEVICES", "SUBMITIT_EXECUTOR", "SLURM_PROCID", "TORCHELASTIC_RUN_ID", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)  # main() sets or removes these: restored after the test

    def passes(ctx):
        return tool.Outcome(True, "fine", {"x": 1})

    def raises(ctx):
        raise ValueError("bad value\nsecond line")

    def misses_goal(ctx):
        return tool.Outcome(False, "MFU 12.0% (goal 45%)", {"mfu": 0.12})

    def dies(ctx):
        os._exit(3)  # what hpctrain's hang watchdog does

    def hangs(ctx):
        time.sleep(120)

    monkeypatch.setattr(
        tool,
        "CHECKS",
        [
            tool.Check("p", "passes", passes, 30, 30),
            tool.Check("r", "raises", raises, 30, 30),
            tool.Check("m", "misses its goal", misses_goal, 30, 30),
            tool.Check("x", "exits 3", dies, 30, 30),
            tool.Check("h", "hangs", hangs, 2, 2),
        ],
    )
    out = tmp_path / "r.json"
    started = time.monotonic()
    code = tool.main(["--cpu", "--json", str(out), "--workdir", str(tmp_path)])
    assert time.monotonic() - started < 30
    stdout = capsys.readouterr().out
    assert code == 1
    rows = _rows(stdout)
    assert list(rows) == ["p", "r", "m", "x", "h"], stdout
    assert " PASS " in rows["p"] and all(" FAIL " in rows[k] for k in "rmxh"), stdout
    assert "ValueError: bad value" in rows["r"] and "second line" not in rows["r"]
    assert "MFU 12.0%" in rows["m"]
    assert "hang watchdog" in rows["x"]
    assert "timed out" in rows["h"]
    assert "4 of 5 checks FAILED (r, m, x, h)" in stdout
    report = json.loads(out.read_text())
    assert report["passed"] is False and [c["result"] for c in report["checks"]] == ["PASS"] + ["FAIL"] * 4
    assert report["workdir"] and Path(report["workdir"]).is_dir()  # kept for the logs
    assert "ValueError" in (Path(report["workdir"]) / "r.log").read_text()


def test_budget_spent_skips_the_remaining_checks(tmp_path: Path, monkeypatch, capsys) -> None:
    tool = _tool()
    for var in ("CUDA_VISIBLE_DEVICES", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tool, "CHECKS", [tool.Check("p", "passes", lambda ctx: tool.Outcome(True, "ok"), 30, 30)])
    assert tool.main(["--cpu", "--budget", "1", "--workdir", str(tmp_path)]) == 1
    assert "skipped: the time budget" in capsys.readouterr().out


def test_quick_runs_the_first_block_alone_under_its_budget(tmp_path: Path, monkeypatch, capsys) -> None:
    tool = _tool()
    assert [c.key for c in tool.CHECKS] == CHECKS
    assert [c.key for c in tool.CHECKS if c.quick] == FIRST_BLOCK  # first in the table, and what --quick runs
    for var in ("CUDA_VISIBLE_DEVICES", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)

    def limit(ctx):  # the check's time limit: its own, cut to what is left of the run's budget
        return tool.Outcome(True, f"limit {ctx.timeout_s:.0f}")

    monkeypatch.setattr(
        tool,
        "CHECKS",
        [
            tool.Check("q1", "first", limit, 900, 900, quick=True),
            tool.Check("q2", "second", limit, 900, 900, quick=True),
            tool.Check("s", "slow", limit, 900, 900),
        ],
    )
    assert tool.main(["--cpu", "--quick", "--workdir", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    rows = _rows(stdout)
    assert list(rows) == ["q1", "q2"], stdout
    assert int(rows["q1"].split("limit ")[1]) <= tool.QUICK_BUDGET_S["cpu"] < tool.DEFAULT_BUDGET_S["cpu"]
    with pytest.raises(SystemExit):
        tool.main(["--cpu", "--quick", "--only", "s", "--workdir", str(tmp_path)])
    # --rest: the others, so that --quick and --rest are the whole run in two commands (GPU: each under 600 s)
    assert tool.main(["--cpu", "--rest", "--workdir", str(tmp_path)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == ["s"] and int(rows["s"].split("limit ")[1]) <= tool.REST_BUDGET_S["cpu"]
    assert tool.QUICK_BUDGET_S["gpu"] + tool.REST_BUDGET_S["gpu"] <= tool.DEFAULT_BUDGET_S["gpu"] <= 660
    assert tool.REST_BUDGET_S["gpu"] < 600 - 60  # the device tool's limit per command, start-up and imports left
    with pytest.raises(SystemExit):
        tool.main(["--cpu", "--quick", "--rest", "--workdir", str(tmp_path)])


def test_the_command_check_names_the_workers_error_from_the_task_logs(tmp_path: Path, monkeypatch) -> None:
    """A worker that dies of the fork fault: the row shows its CUDA error, not the agent's or submitit's wrapper;
    and the command never gets the tool's own PYTORCH_NVML_BASED_CUDA_CHECK, which would hide that fault."""
    _tool()  # puts the repository on sys.path, as the tool does
    from tools.gpu_checks.command import command_environment, first_fault

    run_dir = tmp_path / "run"
    (run_dir / "submitit").mkdir(parents=True)
    (run_dir / "submitit" / "7_0_log.err").write_text(
        'Traceback (most recent call last):\n  File "/x/hpctrain/train/loop.py", line 1, in train\n'
        "RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must "
        "use the 'spawn' start method\n"
        "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with exit code 1\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "hpctrain.train.task.RunStopped: run stopped: deterministic failure\n"
    )
    (tmp_path / "cmd_first.err").write_text("")
    assert first_fault(run_dir, tmp_path / "cmd_first").startswith("RuntimeError: Cannot re-initialize CUDA")
    (run_dir / "submitit" / "7_0_log.err").write_text(
        "hpctrain.train.faults.InjectedFault: injected fault at step 1 on rank 0\n"
        "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with exit code 1\n"
    )
    assert first_fault(run_dir, tmp_path / "cmd_first").startswith("hpctrain.train.faults.InjectedFault")
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setenv("RANK", "3")
    env = command_environment()
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in env and "RANK" not in env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_dying_under_the_agent_fails_the_command_check(tmp_path: Path) -> None:
    """The real command with a worker that raises at step 1 (hpctrain's fault injection, through the agent):
    a FAIL row with the exit code and the worker's own error from the task logs."""
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--cpu", "--only", "cmd", "--workdir", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "WANDB_MODE": "disabled", "HPCTRAIN_INJECT_FAULT": "raise:step=1:rank=0"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = _rows(proc.stdout)["cmd"]
    assert " FAIL " in row and "(first run) exited with 1" in row, proc.stdout
    assert "task log: hpctrain.train.faults.InjectedFault: injected fault at step 1 on rank 0" in row, proc.stdout
