"""The callable submitit pickles and runs on every task.

It carries only plain data (the resolved config as a dict, the run directory and the Layout the login node
resolved and checked), so unpickling on a compute node needs nothing from the login node's session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.config.layout import Layout


@dataclass
class TrainTask:
    config: dict[str, Any]
    run_dir: str
    layout: Layout

    def __call__(self) -> dict[str, Any]:
        from hpctrain.train.loop import train

        return train(self.config, self.run_dir, self.layout)
