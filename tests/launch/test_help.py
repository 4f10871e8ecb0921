"""`python -m hpctrain --help`: the experiments, the groups with their options, the main keys and examples."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from hpctrain.config.schema import Config
from tests.conftest import CONF_DIR, run_hpctrain


def test_help_lists_experiments_groups_keys_and_examples(tmp_path: Path) -> None:
    proc = run_hpctrain("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    page = proc.stdout
    assert "powered by Hydra" not in page and page.startswith("hpctrain:")
    experiments = page.split("== Experiments", 1)[1].split("==", 1)[1].split("\n\n", 1)[0]
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        assert re.search(rf"^  {re.escape(path.stem)} ", experiments, re.MULTILINE), path.stem  # each with what it is
    for group in ("model", "parallel", "zero", "optim", "precision", "data", "checkpoint", "cluster", "tracking"):
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        assert f"{group}: {', '.join(options)}" in page, group
    keys = page.split("== Main keys", 1)[1].split("== Examples", 1)[0]
    named = set(re.findall(r"\b((?:dry_run)|(?:[a-z]+\.[a-z0-9_.]*[a-z0-9_]))\b", keys))
    assert {
        "dry_run",
        "cluster.nodes",
        "parallel.tp",
        "zero.stage",
        "optim.lr",
        "train.max_steps",
        "run.resume",
    } <= named
    # MoE, context parallelism, FP8, compiled blocks, containers (issue 46)
    assert {
        "model.moe.n_experts",
        "model.moe.top_k",
        "parallel.ep",
        "parallel.cp",
        "precision.fp8",
        "parallel.compile",
        "cluster.container.runtime",
        "cluster.container.image",
        "cluster.container.mounts",
    } <= named, sorted(named)
    schema = OmegaConf.structured(Config)
    for key in named:
        parent, _, name = key.rpartition(".")
        node = OmegaConf.select(schema, parent) if parent else schema
        assert OmegaConf.is_dict(node) and name in node.keys(), (  # noqa: SIM118 (`in node` is False for a MISSING key)
            f"--help names {key}: not in the schema"
        )
    assert "python -m hpctrain +experiment=175b dry_run=true" in page.split("== Examples", 1)[1]
