"""What `run.resume` refuses on the login node, and what it does not submit (issue 46): a change of the model's
shape even with checkpoint.force_resume=true; a saved config.yaml that cannot be read; a checkpoint tier linked out
of the run; a run that is already complete. Each case goes through `hpctrain.launch.cli.run` (what
`python -m hpctrain` calls) on a run directory made by the launcher's own functions, and the run directory is byte
for byte the same afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hpctrain.config.problems import Problem
from hpctrain.launch.cli import EXIT_CONFIG_ERROR, run
from hpctrain.launch.resume import MODEL_SHAPE, reshaping_keys
from hpctrain.launch.rundir import create_run_dir, resolve_run_dir
from hpctrain.records.jobs import write_completed
from tests.conftest import run_hpctrain

MOE = [
    "model.arch=qwen3_moe",
    "model.n_kv_heads=1",
    "model.head_dim=32",
    "model.ffn_hidden=64",
    "model.moe.top_k=2",
    "model.moe.n_experts=8",
]


def saved_run(compose_cfg, root: Path, run_id: str, *overrides: str) -> Path:
    """A run directory as a first submission leaves it (config.yaml, submitit/), made by the launcher's functions."""
    cfg = compose_cfg(f"run.root={root}", f"run.id={run_id}", *overrides)
    run_dir = resolve_run_dir(cfg.run)
    create_run_dir(cfg, run_dir)
    return run_dir.path


def files_of(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root`: a file's bytes, a link's target, a directory's kind (links not followed)."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def resumed(compose_cfg, root: Path, run_id: str, *overrides: str) -> tuple[int, list[str]]:
    """`python -m hpctrain run.resume=ID ...` in process: the exit code, and the command line it stands for."""
    line = [f"run.resume={run_id}", *overrides]
    cfg = compose_cfg(f"run.root={root}", *line)
    return run(cfg, line).code, line


def problem_lines(err: str, key: str) -> tuple[str, str]:
    """The problem of `key` in a ConfigError's text, and its fix line."""
    line = next(x for x in err.splitlines() if x.startswith(f"  - {key}:"))
    fix = err.split(line, 1)[1].lstrip("\n").splitlines()[0]
    return line, fix


# ---------------------------------------------------------------- the model's shape, even when forced
@pytest.mark.parametrize(
    "change, key",
    [
        ("model.moe.n_experts=4", "model.moe.n_experts"),
        ("model.moe.expert_hidden=32", "model.moe.expert_hidden"),
        ("model.moe.n_shared_experts=1", "model.moe.n_shared_experts"),
        ("model.n_layers=2", "model.n_layers"),
        ("model.head_dim=16", "model.head_dim"),
    ],
)
def test_force_resume_never_changes_a_parameters_shape(
    compose_cfg, capsys, tmp_path: Path, change: str, key: str
) -> None:
    run_dir = saved_run(compose_cfg, tmp_path, "moe", *MOE)
    before = files_of(run_dir)
    code, _ = resumed(compose_cfg, tmp_path, "moe", *MOE, change, "checkpoint.force_resume=true")
    assert code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    line, fix = problem_lines(err, key)
    assert "even with checkpoint.force_resume=true" in line and "the run moe has" in line, line
    assert f"drop {change}" in fix and "start a new run" in fix and "tools/checkpoint.py export" in fix, fix
    assert files_of(run_dir) == before


def test_force_resume_still_lets_a_shapeless_model_key_change(compose_cfg, capsys, tmp_path: Path) -> None:
    """RoPE's base and the norm's epsilon leave every parameter's shape: forced, they may change (a dry run: the
    plan, nothing written). The router's top_k does not change a shape either, but it is a field of the model's
    Dims, which the checkpoint's fingerprint holds whole (issue 47): a resume refuses it as it refuses a shape."""
    run_dir = saved_run(compose_cfg, tmp_path, "moe", *MOE)
    before = files_of(run_dir)
    code, _ = resumed(
        compose_cfg,
        tmp_path,
        "moe",
        *MOE,
        "model.rope.theta=5000",
        "model.norm_eps=1e-6",
        "checkpoint.force_resume=true",
        "dry_run=true",
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    assert files_of(run_dir) == before


def test_the_shape_keys_are_derived_from_the_families_shapes(compose_cfg) -> None:
    """`reshaping_keys` asks the family's own shape formulas: every model.* number whose change alters a parameter
    of the tiny GPT, a dense Llama or an MoE is found, and each such key is also in MODEL_SHAPE (so `allowed`, which
    knows keys only, never lets one through)."""
    cases = {"gpt": [], "llama": ["model=llama_tiny"], "moe": MOE}
    for name, overrides in cases.items():
        model = OmegaConf.to_container(compose_cfg(*overrides).model, resolve=True)
        changed = set()
        for section, values in [("", model), ("moe.", model["moe"]), ("rope.", model["rope"])]:
            for k, v in values.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                other = json.loads(json.dumps(model))
                target = other if not section else other[section[:-1]]
                target[k] = v * 2 if v else 2
                found = reshaping_keys(model, other, [f"model.{section}{k}"])
                changed |= found
        assert {"model.n_layers", "model.d_model", "model.vocab_size"} <= changed, (name, changed)
        assert (
            name != "moe" or {"model.moe.n_experts", "model.moe.expert_hidden", "model.moe.n_shared_experts"} <= changed
        ), changed
        assert changed <= set(MODEL_SHAPE), (name, changed - set(MODEL_SHAPE))
    moe = OmegaConf.to_container(compose_cfg(*MOE).model, resolve=True)
    fewer = {**moe, "moe": {**moe["moe"], "n_experts": 4}}
    assert reshaping_keys(moe, fewer, ["model.moe.n_experts"]) == {"model.moe.n_experts"}
    assert reshaping_keys(moe, {**moe, "norm_eps": 1e-6}, ["model.norm_eps"]) == set()


# ---------------------------------------------------------------- a config.yaml that cannot be read
def _zero_bytes(path: Path) -> None:
    path.write_bytes(b"")


BROKEN = {  # how config.yaml is spoiled, and what the message says of it
    "empty": (_zero_bytes, "is empty"),
    "random bytes": (lambda p: p.write_bytes(bytes.fromhex("9f8e7d6cfffe00a1b2") * 20), "is not"),
    "NUL bytes": (lambda p: p.write_bytes(b"\0" * 64), "is not a text file (it holds NUL bytes)"),
    "a YAML list": (lambda p: p.write_text("- model\n- train\n"), "holds a YAML list of 2 item(s), not a mapping"),
    "a YAML scalar": (lambda p: p.write_text("42\n"), "holds a single int value, not a mapping"),
    "not YAML": (lambda p: p.write_text("model: [\n"), "is not YAML"),
    "sections missing": (lambda p: p.write_text("train:\n  max_steps: 3\n"), "lacks cluster.name, model.d_model"),
    "a directory": (lambda p: (p.unlink(), p.mkdir()), "is not a regular file (it is a directory)"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_config_yaml_that_cannot_be_read_is_a_config_error(compose_cfg, capsys, tmp_path: Path, kind: str) -> None:
    run_dir = saved_run(compose_cfg, tmp_path, "r1")
    spoil, said = BROKEN[kind]
    spoil(run_dir / "config.yaml")
    before = files_of(run_dir)
    code, _ = resumed(compose_cfg, tmp_path, "r1")
    assert code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    line, fix = problem_lines(err, "run.resume")
    assert str(run_dir / "config.yaml") in line and said in line, line
    assert "fix: restore the run's config.yaml" in fix and "start a new run" in fix, fix
    assert "nothing was submitted" in err
    assert files_of(run_dir) == before


def test_a_binary_config_yaml_on_the_command_line_prints_no_traceback(compose_cfg, tmp_path: Path) -> None:
    run_dir = saved_run(compose_cfg, tmp_path, "r1")
    (run_dir / "config.yaml").write_bytes(os.urandom(512) + b"\xff")
    before = files_of(run_dir)
    proc = run_hpctrain(f"run.root={tmp_path}", "run.resume=r1", cwd=tmp_path, timeout=120)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    assert f"  - run.resume: the run's saved config cannot be read: {run_dir / 'config.yaml'}" in proc.stderr
    assert "    fix: restore the run's config.yaml" in proc.stderr
    assert files_of(run_dir) == before


# ---------------------------------------------------------------- checkpoint tiers linked out of the run
def test_a_tier_linked_to_another_runs_checkpoints_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    run_a = saved_run(compose_cfg, tmp_path, "a")
    run_b = saved_run(compose_cfg, tmp_path, "b")
    (run_a / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_b / "checkpoints").symlink_to(run_a / "checkpoints")
    before = files_of(tmp_path)
    code, _ = resumed(compose_cfg, tmp_path, "b", "train.max_steps=10")
    assert code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    line, fix = problem_lines(err, "checkpoint.tiers[0].path")
    assert f"{run_b / 'checkpoints'} is a symbolic link to {run_a / 'checkpoints'}, outside {run_b}" in line, line
    assert "retention delete its steps" in line and "fix: remove the link" in fix, fix
    assert files_of(tmp_path) == before


def test_a_checkpoint_linked_in_from_another_run_is_refused(compose_cfg, capsys, tmp_path: Path) -> None:
    run_a = saved_run(compose_cfg, tmp_path, "a")
    run_b = saved_run(compose_cfg, tmp_path, "b")
    (run_a / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_b / "checkpoints").mkdir()
    (run_b / "checkpoints" / "step_00000002").symlink_to(run_a / "checkpoints" / "step_00000002")
    before = files_of(tmp_path)
    assert resumed(compose_cfg, tmp_path, "b")[0] == EXIT_CONFIG_ERROR
    line, _ = problem_lines(capsys.readouterr().err, "checkpoint.tiers[0].path")
    assert f"{run_b / 'checkpoints' / 'step_00000002'} is a symbolic link" in line, line
    assert files_of(tmp_path) == before


def test_an_absolute_tier_may_be_under_a_link_but_its_run_subdirectory_may_not_lead_out(
    compose_cfg, capsys, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"
    (tmp_path / "lustre" / "a").mkdir(parents=True)
    scratch.symlink_to(tmp_path / "lustre")
    tier = f"checkpoint.tiers=[{{name: ssd, path: {scratch}, interval_steps: 2}}]"
    saved_run(compose_cfg, tmp_path / "runs", "b", tier)
    code, _ = resumed(compose_cfg, tmp_path / "runs", "b", tier, "dry_run=true")
    assert code == 0, capsys.readouterr().err[-3000:]  # scratch -> lustre: the mount may be a link
    (tmp_path / "lustre" / "b").symlink_to(tmp_path / "lustre" / "a")
    assert resumed(compose_cfg, tmp_path / "runs", "b", tier)[0] == EXIT_CONFIG_ERROR
    found, _ = problem_lines(capsys.readouterr().err, "checkpoint.tiers[0].path")
    assert f"{scratch / 'b'} is a symbolic link to {tmp_path / 'lustre' / 'a'}" in found, found
    assert f"{tmp_path / 'lustre' / 'b'}, this run's own directory of tier ssd" in found, found


def test_a_checkpoint_another_run_wrote_is_refused_before_a_job_would_be(compose_cfg, capsys, tmp_path: Path) -> None:
    """A copy of run a's checkpoint in run b's tier (or run a's directory renamed b): its manifest names run a, the
    job's checkpoint manager would refuse it, so the login node says so first."""
    from hpctrain.records.fingerprint import fingerprint_of

    run_b = saved_run(compose_cfg, tmp_path, "b")
    step = run_b / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    cfg = compose_cfg()
    (step / "manifest.json").write_text(
        json.dumps(
            {
                "step": 4,
                "run_id": "a",
                "files": {},
                "fingerprint": fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict(),
            }
        )
    )
    before = files_of(run_b)
    assert resumed(compose_cfg, tmp_path, "b", "train.max_steps=10")[0] == EXIT_CONFIG_ERROR
    line, fix = problem_lines(capsys.readouterr().err, "run.resume")
    assert f"the newest checkpoint of run b ({step}, step 4) belongs to run a (its manifest)" in line, line
    assert f"give it its name back ({tmp_path / 'smoke' / 'a'})" in fix and "remove it from this run" in fix, fix
    assert files_of(run_b) == before


def test_the_tier_problems_name_the_key(compose_cfg, tmp_path: Path) -> None:
    from hpctrain.launch.rundir import tier_problems

    cfg = compose_cfg(f"run.root={tmp_path}", "run.id=a")
    run_dir = resolve_run_dir(cfg.run)
    assert tier_problems(cfg.checkpoint, run_dir) == []  # a new run: nothing there yet
    run_dir.path.mkdir(parents=True)
    (run_dir.path / "checkpoints").symlink_to(tmp_path)
    problems = tier_problems(cfg.checkpoint, run_dir)
    assert [type(p) for p in problems] == [Problem] and problems[0].key == "checkpoint.tiers[0].path"


# ---------------------------------------------------------------- a run that is complete
def test_a_resume_of_a_complete_run_submits_nothing(compose_cfg, capsys, tmp_path: Path) -> None:
    run_dir = saved_run(compose_cfg, tmp_path, "done", "train.max_steps=10")
    write_completed(run_dir, "4242", 10)
    before = files_of(run_dir)
    code, _ = resumed(compose_cfg, tmp_path, "done")
    assert code == 0
    out = capsys.readouterr().out
    assert "run done is complete at step 10 (train.max_steps=10); nothing was submitted" in out, out
    assert "raise train.max_steps: python -m hpctrain run.resume=done train.max_steps=<more than 10>" in out
    assert files_of(run_dir) == before


def test_a_run_whose_newest_checkpoint_is_past_max_steps_submits_nothing(compose_cfg, capsys, tmp_path: Path) -> None:
    """No COMPLETED.json (the job was stopped after its last save), the newest checkpoint at step 12, the resume
    shortens the run to 8: nothing to train."""
    from hpctrain.records.fingerprint import fingerprint_of

    run_dir = saved_run(compose_cfg, tmp_path, "past", "train.max_steps=20")
    step = run_dir / "checkpoints" / "step_00000012"
    step.mkdir(parents=True)
    cfg = compose_cfg()
    fingerprint = fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()
    (step / "manifest.json").write_text(
        json.dumps({"step": 12, "run_id": "past", "files": {}, "fingerprint": fingerprint})
    )
    before = files_of(run_dir)
    assert resumed(compose_cfg, tmp_path, "past", "train.max_steps=8")[0] == 0
    assert "run past is at step 12, past train.max_steps=8; nothing was submitted" in capsys.readouterr().out
    assert files_of(run_dir) == before


def test_a_complete_run_with_more_steps_goes_on_and_a_dry_run_says_it(compose_cfg, capsys, tmp_path: Path) -> None:
    from hpctrain.launch.resume import finished

    run_dir = saved_run(compose_cfg, tmp_path, "done", "train.max_steps=10")
    write_completed(run_dir, "4242", 10)
    assert finished(compose_cfg("train.max_steps=12"), run_dir) is None  # raised: it trains on
    assert finished(compose_cfg("train.max_steps=12", "checkpoint=none"), run_dir) is None  # starts from 0
    assert "complete at step 10" in finished(compose_cfg("train.max_steps=10"), run_dir)
    before = files_of(run_dir)
    assert resumed(compose_cfg, tmp_path, "done", "dry_run=true")[0] == 0
    captured = capsys.readouterr()
    assert (
        "note: run done is complete at step 10" in captured.err and "without dry_run nothing would be" in captured.err
    )
    assert files_of(run_dir) == before
