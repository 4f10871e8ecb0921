"""`python -m hpctrain.status RUN [--json] [--watch [SECONDS]]`: a run's jobs, progress, checkpoints, ETA, and
its goodput ledger (where every node-hour of its allocations went, across requeues and resubmissions).

RUN is a run directory, or a run id under `--root` (the runs' root, `run.root`: `outputs` by default).
The newest checkpoint of each tier is the newest committed one on disk (tiers this machine can read: the
run directory's; a node's RAM only on that node), or the newest the run's metrics reported, if newer.
Damaged records (junk bytes, a cut last line, a line that is not a record) are skipped, and the page says
how many lines of which file it could not read; of a huge record file only the tail is read.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hpctrain.bounded import Unreadable, read_text
from hpctrain.entry import EntryParser
from hpctrain.goodput.ledger import Ledger
from hpctrain.launch.rundir import find_run
from hpctrain.status.records import RunRecords
from hpctrain.status.view import render


def main(argv: list[str] | None = None) -> int:
    parser = EntryParser(prog="python -m hpctrain.status", description=__doc__)
    parser.add_argument("run", help="a run directory, or a run id under --root")
    parser.add_argument("--root", default="outputs", help="where run ids are looked for (run.root; default outputs)")
    parser.add_argument("--json", action="store_true", help="the whole ledger as JSON")
    parser.add_argument(
        "--watch",
        nargs="?",
        const=10.0,
        type=float,
        metavar="SECONDS",
        help="refresh every SECONDS (default 10) until the run ends; Ctrl-C leaves",
    )
    args = parser.parse_args(argv)
    run_dir = find_run(Path(args.root).expanduser().resolve(), args.run)
    if run_dir is None:
        print(
            f"no run {args.run!r}: give a run directory, or an id under --root ({args.root}/*/{args.run})",
            file=sys.stderr,
        )
        return 2
    records = RunRecords(run_dir)
    settings = records.settings()
    run = {"id": run_dir.name, "path": str(run_dir), "executor": settings["executor"]}
    try:
        while True:
            try:
                ledger = records.measure(settings)
            except Exception as exc:  # noqa: BLE001  (records each sound, still contradicting each other)
                print(
                    f"hpctrain.status: the records of {run_dir} do not make a ledger ({type(exc).__name__}: "
                    f"{exc})" + "".join(f"\n  {line}" for line in records.notes.lines()),
                    file=sys.stderr,
                )
                return 1
            ledger.checkpoints = newest_checkpoints(run_dir, ledger.checkpoints)
            ended = _ended(records, ledger)
            notes = records.notes.lines()
            if args.json:
                print(json.dumps({"run": run, **ledger.to_dict(), "unread": notes}, indent=1), flush=True)
            else:
                if args.watch:
                    print("\033[H\033[2J", end="")  # clear the terminal between pages
                print(render(ledger, run), flush=True)
                if notes:
                    print("\nrecords not read (the page is without them)\n" + "\n".join(f"  {n}" for n in notes))
                if ended:
                    print(f"\n{ended}")
            if not args.watch or ended:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _ended(records: RunRecords, ledger: Ledger) -> str | None:
    """Why the run is over, or None while it may still train. COMPLETED.json names the job that wrote it last,
    which may be a later resume of the finished run (it loaded the last step and trained nothing): the job
    that trained the last step is the ledger's."""
    completed = records.completed()
    if completed:
        step = int(completed["step"])
        trained = [j for j in ledger.jobs if j.steps and j.steps[1] >= step]
        job = trained[-1].job_id if trained else completed["job_id"]  # the last to train that step
        later = [j.job_id for j in ledger.jobs if not j.counted]
        return f"the run is complete: job {job} trained it to step {step}" + (
            f" ({', '.join(later)} resumed it after its end: nothing was left to train)" if later else ""
        )
    report = records.report()
    return f"the run stopped: {report['why']}" if report else None


# As hpctrain.checkpoint.storage writes them (not imported: it imports torch, seconds on a login node):
# `<tier>/step_<N>/manifest.json` exists only for a committed checkpoint.
PREFIX, MANIFEST = "step_", "manifest.json"
MANIFEST_BYTES = 16 * 2**20


def newest_checkpoints(run_dir: Path, reported: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Tier -> {"step", "time"} of its newest committed checkpoint: on disk where this machine can read the
    tier, or as the metrics reported it where that is newer (a node's RAM tier). The metrics alone miss the
    saves committed after the last row (the final save, a save at a stop signal): they showed the run's
    previous checkpoint."""
    from omegaconf import OmegaConf

    newest = dict(reported)
    try:
        cfg = OmegaConf.create(read_text(run_dir / "config.yaml"))
        tiers = [(str(t.name), Path(str(t.path)).expanduser()) for t in cfg.checkpoint.tiers]
        run_id = str(cfg.run.id)
    except Exception:  # an old or hand-made run directory: what the metrics say
        return newest
    for name, path in tiers:
        directory = path / run_id if path.is_absolute() else run_dir / path
        found = _newest_in(directory)
        if found and found["step"] > newest.get(name, {}).get("step", -1):
            newest[name] = found
    return newest


def _newest_in(directory: Path) -> dict[str, Any] | None:
    best = None
    try:
        entries = list(directory.iterdir())
    except OSError:
        return None
    for sub in entries:
        digits = sub.name[len(PREFIX) :]
        if not (sub.name.startswith(PREFIX) and digits.isdigit()) or (best and int(digits) <= best["step"]):
            continue
        try:
            manifest = sub / MANIFEST
            step = int(json.loads(read_text(manifest, MANIFEST_BYTES))["step"])
            committed = manifest.stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError, Unreadable):
            continue  # not committed, or not readable: the resume's checks decide, not this page
        if step == int(digits):
            best = {"step": step, "time": committed}
    return best


if __name__ == "__main__":
    sys.exit(main())
