#!/usr/bin/env python3
"""Keep the quick test tier quick: list the tests that a measured run found slow in tests/slow_tests.txt.

    python -m pytest -q --durations=0 > run.log     # the whole suite, as .ci/run does
    python tools/quick_tier.py run.log [--over 0.75]

Every test whose setup + call + teardown took at least --over seconds in that run is written to
tests/slow_tests.txt (one pytest node id a line, parametrised cases apart); tests/conftest.py gives those the
`slow` marker, so `pytest -m "not slow and not slurm"` (the quick tier, under 5 minutes on a 2-core machine)
leaves them out, but for a few REPRESENTATIVES of the real multi-process paths. Tests marked slow or slurm in their
own files stay so; the full suite runs everything.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without an install too

from hpctrain.entry import EntryParser  # noqa: E402

LIST = Path(__file__).resolve().parents[1] / "tests" / "slow_tests.txt"
# Kept in the quick tier however long they take: one real multi-process run of each path a change most often
# breaks (a 3-D-ish layout against the one-process reference, the step's one collective, a resharding resume,
# expert parallelism with TP).
REPRESENTATIVES = (
    "tests/parallel/test_engine_layouts.py::test_layout_matches_single_process[zero3_dp2xtp2_sp]",
    "tests/parallel/test_control_plane.py::test_one_collective_per_step_on_the_default_group[fsdp2xtp2]",
    "tests/checkpoint/test_checkpoint.py::test_resume_in_another_layout_continues_exactly[tp2-to-tp1]",
    "tests/parallel/test_moe_layouts.py::test_moe_layout_matches_single_process[ep2_tp2_sp]",
)
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S+::.+)$")


def durations(log: str) -> dict[str, float]:
    """Seconds per test node id (its phases summed) from pytest's --durations report."""
    out: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = DURATION.match(line.strip())
        if m:
            out[m.group(2)] += float(m.group(1))
    return dict(out)


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("log", type=Path, help="the output of a pytest run with --durations=0")
    parser.add_argument("--over", type=float, default=0.75, help="seconds from which a test is slow")
    parser.add_argument("--out", type=Path, default=LIST, help="where the list goes")
    args = parser.parse_args()
    measured = durations(args.log.read_text())
    if not measured:
        parser.error(f"{args.log} has no --durations report")
    slow = sorted(node for node, seconds in measured.items() if seconds >= args.over and node not in REPRESENTATIVES)
    args.out.write_text(
        f"# tests that took >= {args.over} s in a measured run (tools/quick_tier.py): marked slow by "
        "tests/conftest.py\n" + "".join(f"{node}\n" for node in slow)
    )
    listed = set(slow)
    quick = sum(s for node, s in measured.items() if node not in listed)
    print(f"{len(slow)} slow tests listed in {args.out}; the rest took {quick:.0f} s in that run")


if __name__ == "__main__":
    main()
