"""`python -m hpctrain [+experiment=NAME] [key=value ...] [-m]`: Hydra composes, hpctrain checks and launches."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from hpctrain.config.schema import register

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
register()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> dict:
    from hpctrain.launch.cli import exit_on_failure, run

    return exit_on_failure(run(cfg))


if __name__ == "__main__":
    main()
