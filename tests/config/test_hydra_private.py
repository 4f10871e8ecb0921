"""The two private Hydra 1.3 functions hpctrain's command-line checks call, pinned (hpctrain/__main__.py,
hpctrain/config/compose_errors.py): `hydra._internal.utils.get_args_parser` (the argv parser `hydra.main` uses, so
the checks read the command line exactly as Hydra will) and `ConfigLoaderImpl._apply_overrides_to_config` (a
sweep's further values applied to the composed config without a compose each). pyproject.toml keeps hydra-core
below 1.4; these fail first, saying where to look, when a release moves either."""

from __future__ import annotations

import inspect

import hydra
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

WHERE = f"hydra-core {hydra.__version__} changed a private function hpctrain/config/compose_errors.py relies on"


def test_the_args_parser_reads_what_hydra_main_reads() -> None:
    args = get_args_parser().parse_args(["-m", "optim.lr=1e-4,3e-4", "--config-name", "x"])
    assert (args.multirun, args.overrides, args.config_name) == (True, ["optim.lr=1e-4,3e-4"], "x"), WHERE
    for flag in ("shell_completion", "experimental_rerun", "config_path", "config_dir", "help", "info", "cfg"):
        assert hasattr(args, flag), (WHERE, flag)


def test_overrides_apply_to_a_config_as_hydra_applies_them() -> None:
    assert list(inspect.signature(ConfigLoaderImpl._apply_overrides_to_config).parameters) == ["overrides", "cfg"], (
        WHERE
    )
    cfg = OmegaConf.create({"optim": {"lr": 1.0}})
    ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(["optim.lr=3e-4"]), cfg)
    assert cfg.optim.lr == 3e-4, WHERE
