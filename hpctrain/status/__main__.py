"""`python -m hpctrain.status RUN [--json] [--watch [SECONDS]]`: a run's jobs, progress, checkpoints, ETA, and
its goodput ledger (where every node-hour of its allocations went, across requeues and resubmissions).

RUN is a run directory, or a run id under `--root` (the runs' root, `run.root`: `outputs` by default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hpctrain.goodput.measure import measure, run_settings
from hpctrain.launch.rundir import find_run
from hpctrain.records.jobs import read_completed, read_report
from hpctrain.status.view import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.status", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run directory, or a run id under --root")
    parser.add_argument("--root", default="outputs", help="where run ids are looked for (run.root; default outputs)")
    parser.add_argument("--json", action="store_true", help="the whole ledger as JSON")
    parser.add_argument("--watch", nargs="?", const=10.0, type=float, metavar="SECONDS",
                        help="refresh every SECONDS (default 10) until the run ends; Ctrl-C leaves")
    args = parser.parse_args(argv)
    run_dir = find_run(Path(args.root).expanduser().resolve(), args.run)
    if run_dir is None:
        print(f"no run {args.run!r}: give a run directory, or an id under --root ({args.root}/*/{args.run})",
              file=sys.stderr)
        return 2
    settings = run_settings(run_dir)
    run = {"id": run_dir.name, "path": str(run_dir), "executor": settings["executor"]}
    try:
        while True:
            ledger = measure(run_dir)
            if args.json:
                print(json.dumps({"run": run, **ledger.to_dict()}, indent=1), flush=True)
            else:
                if args.watch:
                    print("\033[H\033[2J", end="")  # clear the terminal between pages
                print(render(ledger, run), flush=True)
                ended = _ended(run_dir)
                if ended:
                    print(f"\n{ended}")
            if not args.watch or _ended(run_dir):
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _ended(run_dir: Path) -> str | None:
    """Why the run is over, or None while it may still train."""
    completed = read_completed(run_dir)
    if completed:
        return f"the run is complete: job {completed['job_id']} trained it to step {completed['step']}"
    report = read_report(run_dir)
    return f"the run stopped: {report['why']}" if report else None


if __name__ == "__main__":
    sys.exit(main())
