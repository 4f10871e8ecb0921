"""One run, one directory: fixed ids and resumes land in the same place."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.config.problems import ConfigError
from hpctrain.launch.rundir import create_run_dir, new_run_id, resolve_run_dir


def test_new_ids_are_unique_and_sortable() -> None:
    ids = [new_run_id() for _ in range(2000)]  # a large sweep draws its ids within a second or two
    assert len(set(ids)) == len(ids)
    assert sorted(ids, key=lambda i: i[:15]) == ids  # the time prefix orders them by start


def test_a_fresh_id_never_lands_in_an_existing_run(compose_cfg, tmp_path: Path, monkeypatch) -> None:
    import hpctrain.launch.rundir as rundir

    cfg = compose_cfg(f"run.root={tmp_path}", "run.id=20261130-101500-00000000")
    taken = create_run_dir(cfg, resolve_run_dir(cfg.run))
    draws = iter(["20261130-101500-00000000", "20261130-101500-00000001"])
    monkeypatch.setattr(rundir, "new_run_id", lambda: next(draws))
    fresh = resolve_run_dir(compose_cfg(f"run.root={tmp_path}").run)
    assert fresh.run_id == "20261130-101500-00000001" and not fresh.resumed and taken.parent != fresh.path


def test_fixed_id_lands_in_the_same_directory(compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg(f"run.root={tmp_path}", "run.id=abc")
    first = resolve_run_dir(cfg.run)
    assert first.path == tmp_path / "smoke" / "abc" and not first.resumed
    cfg.run.id = first.run_id
    create_run_dir(cfg, first)
    again = resolve_run_dir(cfg.run)
    assert again.path == first.path and again.resumed


def test_resume_by_id_and_by_path(compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg(f"run.root={tmp_path}", "run.id=r1")
    run = resolve_run_dir(cfg.run)
    create_run_dir(cfg, run)
    by_id = resolve_run_dir(compose_cfg(f"run.root={tmp_path}", "run.resume=r1").run)
    by_path = resolve_run_dir(compose_cfg(f"run.root={tmp_path}", f"run.resume={run.path}").run)
    assert by_id.path == by_path.path == run.path and by_id.run_id == "r1" and by_id.resumed
    create_run_dir(cfg, by_id)
    assert (run.path / "config.yaml").exists() and len(list(run.path.glob("config.*.yaml"))) == 1


def test_resume_of_unknown_run_names_the_key(compose_cfg, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run.resume"):
        resolve_run_dir(compose_cfg(f"run.root={tmp_path}", "run.resume=nope").run)
