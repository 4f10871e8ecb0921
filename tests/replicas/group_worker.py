"""One replica group's only rank, as its node agent would start it: `python -m tests.replicas.group_worker ARGS.json`.

ARGS holds the composed config (plain), the run directory, the group's layout, the group's number and count, the
lighthouse's address and a free port for the group's store. The environment is what hpctrain's agent sets for a
forked worker (RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT and the replica group's variables);
then the real task function runs: hpctrain.train.loop.train.
"""

from __future__ import annotations

import json
import os
import sys

from hpctrain.config.layout import Layout


def main(path: str) -> None:
    args = json.loads(open(path).read())
    os.environ.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(args["port"]),
            "TORCHELASTIC_RESTART_COUNT": str(args.get("restart", 0)),
            "HPCTRAIN_JOB_ID": args["job_id"],
            "HPCTRAIN_REPLICA_GROUP": str(args["group"]),
            "HPCTRAIN_REPLICA_GROUPS": str(args["groups"]),
            "TORCHFT_LIGHTHOUSE": args["lighthouse"],
        }
    )
    from hpctrain.train.loop import train

    result = train(args["config"], args["run_dir"], Layout(**args["layout"]))
    print(json.dumps({"result": result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
