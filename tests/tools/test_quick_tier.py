"""tools/quick_tier.py: the slow list from a real --durations report; every listed test still exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# Lines of the CI's own --durations=0 report (phases of one test add up; the representative stays quick).
REPORT = """\
============================= slowest durations ==============================
171.83s call     tests/simulate/test_layouts.py::test_the_planner_holds_against_torch_on_the_most_loaded_rank[gpt3_13b_16node]
6.20s call     tests/parallel/test_engine_layouts.py::test_layout_matches_single_process[zero3_dp2xtp2_sp]
0.50s setup    tests/checkpoint/test_integrity.py::test_a_flipped_bit_is_named_by_file_and_tensor
0.40s call     tests/checkpoint/test_integrity.py::test_a_flipped_bit_is_named_by_file_and_tensor
0.10s call     tests/config/test_compose.py::test_default_config_composes
(1 durations < 0.005s hidden.  Use -vv to show these durations.)
"""  # noqa: E501 (a real report's lines)


def test_a_report_gives_the_slow_list(tmp_path: Path) -> None:
    log, out = tmp_path / "run.log", tmp_path / "slow.txt"
    log.write_text(REPORT)
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "quick_tier.py"), str(log), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    listed = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    assert listed == [
        "tests/checkpoint/test_integrity.py::test_a_flipped_bit_is_named_by_file_and_tensor",  # 0.5 + 0.4 s
        "tests/simulate/test_layouts.py::test_the_planner_holds_against_torch_on_the_most_loaded_rank[gpt3_13b_16node]",
    ]
    assert "2 slow tests" in proc.stdout


@pytest.mark.slow  # a whole collection: 20 s
def test_every_listed_test_exists() -> None:
    """A renamed test would silently fall back into the quick tier: the list names only collected tests."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    listed = [
        line.strip()
        for line in (REPO / "tests" / "slow_tests.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert collected and not [node for node in listed if node not in collected]
