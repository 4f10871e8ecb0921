"""Not a test: times the 175B dry run from a login shell against a bare `import hydra` (python bench/bench_dry_run.py).

Each command runs in a fresh interpreter, as a user's would; the two alternate so that load on a shared
machine hits both alike, and the median of the repeats is reported. The goal (issue 13): the dry run at most
1.5 s here, and no torch import on the way (checked once with -X importtime).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without an install too

from hpctrain.entry import EntryParser  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 1.5


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run; a failing command stops the bench (its output says why).

    CPU time (user + system of the child) is what the command itself costs; wall time adds waiting for a core,
    which on a shared machine says more about the neighbours than about the command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def torch_imports(cmd: list[str]) -> list[str]:
    """Modules named torch* that the command imports (python -X importtime lists every import on stderr)."""
    proc = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], cwd=REPO, capture_output=True, text=True)
    names = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")]
    return [n for n in names if n == "torch" or n.startswith("torch.")]


def report(name: str, runs: list[tuple[float, float]]) -> tuple[float, float]:
    """Print one command's median wall and CPU time (and the wall spread); return the medians."""
    wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    walls = [r[0] for r in runs]
    print(f"{name:<50} wall {wall:6.3f} s (min {min(walls):.3f}, max {max(walls):.3f}), CPU {cpu:6.3f} s")
    return wall, cpu


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        dry = [sys.executable, "-m", "hpctrain", "+experiment=175b", "dry_run=true", f"run.root={root}"]
        bare = [sys.executable, "-c", "import hydra"]
        timed(dry)  # warm the file cache for both
        timed(bare)
        runs: dict[str, list[tuple[float, float]]] = {"dry": [], "bare": []}
        for _ in range(args.repeats):
            runs["dry"].append(timed(dry))
            runs["bare"].append(timed(bare))
        torch = torch_imports(dry)
    print(f"{args.repeats} runs each, medians; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    dry_wall, dry_cpu = report("python -m hpctrain +experiment=175b dry_run=true", runs["dry"])
    bare_wall, bare_cpu = report("python -c 'import hydra'", runs["bare"])
    print(
        f"{'difference (hpctrain and Hydra composing)':<50} wall {dry_wall - bare_wall:6.3f} s, "
        f"CPU {dry_cpu - bare_cpu:6.3f} s"
    )
    print(f"torch imported by the dry run: {', '.join(torch[:5]) + ' ...' if torch else 'no'}")
    print(
        f"goal: dry run <= {GOAL_S} s: wall {'met' if dry_wall <= GOAL_S else 'NOT met'}, "
        f"CPU {'met' if dry_cpu <= GOAL_S else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
