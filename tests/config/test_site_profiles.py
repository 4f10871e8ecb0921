"""Site profiles (hpctrain/config/site.py, docs/site_profiles.md): a site's `cluster` file outside the checkout,
found through HPCTRAIN_CONFIG_PATH or Hydra's hydra.searchpath, on the real command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hpctrain.config.site import VARIABLE, register_site_path, site_dirs
from hpctrain.launch.cli import EXIT_CONFIG_ERROR
from tests.conftest import CONF_DIR, REPO, run_hpctrain

GOLDEN = REPO / "tests" / "launch" / "golden"

SITE_CLUSTER = """\
# A site's cluster: what conf/cluster/slurm.yaml's comment asks a site to set, kept outside the checkout.
name: mysite
executor: slurm
nodes: 1
gpus_per_node: 2
gpu_type: cpu
partition: site_gpu
account: site_llm
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    conf = tmp_path / "site" / "conf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "cluster" / "mysite.yaml").write_text(SITE_CLUSTER)
    (conf / "cluster" / "slurm.yaml").write_text(SITE_CLUSTER.replace("name: mysite", "name: shadow"))
    return conf


def test_site_dirs_are_absolute_and_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert site_dirs(f"/a::rel:{Path('~').expanduser()}/b:") == [
        Path("/a"),
        tmp_path / "rel",
        Path("~").expanduser() / "b",
    ]
    assert site_dirs(None) == [] and site_dirs("") == []


def test_a_site_adds_names_and_does_not_replace_hpctrains(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Appended after conf/: cluster=mysite is found, and cluster=slurm stays hpctrain's own."""
    register_site_path()
    monkeypatch.setenv(VARIABLE, f"/nonexistent-is-checked-by-the-command:{site}")
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        mysite = compose(config_name="config", overrides=["cluster=mysite"])
        slurm = compose(config_name="config", overrides=["cluster=slurm"])
    assert (mysite.cluster.name, mysite.cluster.partition, mysite.cluster.account) == ("mysite", "site_gpu", "site_llm")
    assert slurm.cluster.name == "slurm"


def test_hpctrain_config_path_on_the_command_line(site: Path, tmp_path: Path) -> None:
    args = ("cluster=mysite", "dry_run=true", f"run.root={tmp_path / 'runs'}")
    proc = run_hpctrain(*args, cwd=tmp_path, env={VARIABLE: str(site)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "#SBATCH --partition=site_gpu\n" in proc.stdout and "#SBATCH --account=site_llm\n" in proc.stdout
    without = run_hpctrain(*args, cwd=tmp_path, env={VARIABLE: ""}, timeout=120)
    assert without.returncode != 0 and "cluster/mysite" in without.stderr


def test_hydra_searchpath_does_the_same_for_one_command(site: Path, tmp_path: Path) -> None:
    proc = run_hpctrain(
        "cluster=mysite",
        "dry_run=true",
        f"run.root={tmp_path / 'runs'}",
        f"hydra.searchpath=[file://{site}]",
        cwd=tmp_path,
        env={VARIABLE: ""},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "#SBATCH --partition=site_gpu\n" in proc.stdout


def test_a_directory_that_is_not_there_is_named(site: Path, tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "conf"
    proc = run_hpctrain(
        "cluster=mysite", "dry_run=true", cwd=tmp_path, env={VARIABLE: f"{site}:{missing}"}, timeout=120
    )
    assert proc.returncode == EXIT_CONFIG_ERROR
    assert f"{VARIABLE}: {missing} is not a directory" in proc.stderr and "fix: " in proc.stderr
    assert not (tmp_path / "outputs").exists()


def _yaml_blocks(page: str) -> list[str]:
    text = (REPO / "docs" / page).read_text()
    return [block.split("```", 1)[0] for block in text.split("```yaml\n")[1:]]


def _srun_and_setup(script: str) -> list[str]:
    return [line for line in script.split("# command")[0].split("# setup")[1].splitlines() if line] + [
        line for line in script.splitlines() if line.startswith("srun ")
    ]


def test_the_docs_cluster_files_work_as_site_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/site_profiles.md's and docs/containers.md's cluster files, saved in a site directory, compose and pass
    the checks; the containers page's two write the golden files' setup and srun lines."""
    from omegaconf import OmegaConf

    from hpctrain.checks.runner import check_config
    from hpctrain.launch.executor import sbatch_preview

    conf = tmp_path / "conf" / "cluster"
    conf.mkdir(parents=True)
    blocks = _yaml_blocks("site_profiles.md") + _yaml_blocks("containers.md")
    names = [OmegaConf.create(block).name for block in blocks]
    assert names == ["mysite", "mysite_pyxis", "mysite_apptainer"]
    for name, block in zip(names, blocks):
        (conf / f"{name}.yaml").write_text(block)
    register_site_path()
    monkeypatch.setenv(VARIABLE, str(conf.parent))
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        for name in names:
            cfg = compose(
                config_name="config", overrides=["+experiment=gpt3_1.3b_1node", f"cluster={name}", "dry_run=true"]
            )
            assert cfg.cluster.name == name and cfg.cluster.partition == "gpu"
            layout = check_config(cfg).layout
            runtime = name.partition("_")[2]
            if runtime:
                folder = Path("/runs") / runtime / "RUNID" / "submitit"
                golden = (GOLDEN / f"{runtime}.sbatch").read_text()
                assert _srun_and_setup(sbatch_preview(cfg, layout, "RUNID", folder)) == _srun_and_setup(golden)
