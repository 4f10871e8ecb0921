#!/usr/bin/env python3
"""A DeepSpeed config as hpctrain overrides: the command line that runs the same settings, then, key by key,
where each setting went, what hpctrain does anyway, and what has no equivalent and why.

    python tools/from_deepspeed.py ds_config.json [hpctrain overrides ...]

The overrides after the file (`cluster=...`, `+experiment=...`) set the layout DeepSpeed's batch arithmetic is
checked against (its data-parallel size) and what "auto" takes. `python -m hpctrain +deepspeed=ds_config.json`
does the same inside a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.config.deepspeed import load, translate  # noqa: E402
from hpctrain.config.problems import ConfigError  # noqa: E402
from hpctrain.config.schema import register  # noqa: E402

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    register()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        cfg = compose(config_name="config", overrides=argv[1:])
    try:
        translation = translate(load(argv[0]), cfg)
    except ConfigError as err:
        print(f"from_deepspeed: {argv[0]}: {err}", file=sys.stderr)
        return 2
    print("python -m hpctrain " + " ".join([*argv[1:], *translation.command_line()]))
    print()
    print(translation.report())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
