"""`python -m hpctrain [+experiment=NAME] [key=value ...] [-m]`: Hydra composes, hpctrain checks and launches."""

import os
import sys
from pathlib import Path
from typing import Any

import hydra

from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import Config, register
from hpctrain.config.site import VARIABLE, register_site_path, site_problems

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
CONFIG_NAME = "config"
register()
register_site_path()  # HPCTRAIN_CONFIG_PATH: site profiles outside the checkout (hpctrain/config/site.py)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def main(cfg: Config) -> dict[str, Any]:  # a DictConfig of the schema: read as the dataclass (Hydra's pattern)
    from hpctrain.launch.cli import exit_on_failure, run

    return exit_on_failure(run(cfg))


def command_line_problems(argv: list[str]) -> list[Problem]:
    """What Hydra would refuse in this command line, as hpctrain's problems (hpctrain.config.compose_errors), before
    `hydra.main` composes it: the site directories, then every override (--help, --cfg and --info compose them too).
    Shell completion and a rerun are Hydra's own; so is a command line that changes the primary config's
    directory (--config-path/-dir)."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)  # what hydra.main parses (a bad flag: argparse's usage, exit 2)
    if problems := site_problems(os.environ.get(VARIABLE)):
        return problems
    if args.shell_completion or args.experimental_rerun or args.config_path or args.config_dir:
        return []
    from hpctrain.config.compose_errors import compose_problems

    multirun = args.multirun or any(o.replace(" ", "") == "hydra.mode=MULTIRUN" for o in args.overrides)
    return compose_problems(args.overrides, CONF_DIR, args.config_name or CONFIG_NAME, multirun=multirun)


if __name__ == "__main__":
    if problems := command_line_problems(sys.argv[1:]):
        from hpctrain.launch.cli import EXIT_CONFIG_ERROR

        print(f"hpctrain: {ConfigError(problems)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    main()
