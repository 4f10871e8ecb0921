"""`python -m hpctrain [+experiment=NAME] [key=value ...] [-m]`: Hydra composes, hpctrain checks and launches."""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from hpctrain.config.problems import ConfigError
from hpctrain.config.schema import register
from hpctrain.config.site import VARIABLE, register_site_path, site_problems

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
register()
register_site_path()  # HPCTRAIN_CONFIG_PATH: site profiles outside the checkout (hpctrain/config/site.py)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> dict:
    from hpctrain.launch.cli import exit_on_failure, run

    return exit_on_failure(run(cfg))


if __name__ == "__main__":
    if problems := site_problems(os.environ.get(VARIABLE)):
        from hpctrain.launch.cli import EXIT_CONFIG_ERROR

        print(f"hpctrain: {ConfigError(problems)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    main()
