"""A training worker, as its node's elastic agent (hpctrain/distributed/elastic.py) starts it.

The agent imports this module (and with it torch and the whole training stack) once, then forks every worker
from itself: a restart pays no interpreter start and no `import torch`, the largest part of a restart when
each worker is a new process (2.5-4 s here). The ranks come from the variables the agent sets (RANK,
WORLD_SIZE, TORCHELASTIC_RESTART_COUNT...). A worker that fails leaves at once (its traceback printed, its
failure record already written): the agent restarts the whole group as soon as it sees one exit, so an
orderly shutdown (joining checkpoint writer threads, tearing the process group down) would only add to every
restart.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

import torch

from hpctrain.train.loop import train


def run_worker(task: Any) -> dict[str, Any]:
    """One worker's whole run: `task` carries the config, the run directory and the layout."""
    started = time.time()
    try:
        if torch.cuda._is_in_bad_fork():  # the agent initialised CUDA before forking: no CUDA call can work here
            raise RuntimeError(
                "this worker was forked from an agent that had initialised CUDA, so its first CUDA "
                "call would fail ('Cannot re-initialize CUDA in forked subprocess'); something in "
                "the agent's process (hpctrain/distributed/elastic.py) touched CUDA before the fork"
            )
        return train(task.config, task.run_dir, task.layout, process_started=started)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
