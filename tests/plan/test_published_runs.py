"""The published-runs table (bench/bench_published.py, docs/planner.md "Published runs"): the docs show what the
script gives today, and every row the table claims lies within its band. Each row is a real dry run of the login-node
path (a subprocess per row)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import bench_published as published

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return published.measure()


def test_the_docs_table_is_the_scripts(rows: list[dict[str, Any]]) -> None:
    doc = published.DOCS.read_text()
    shown = doc.split(published.BEGIN, 1)[1].split(published.END, 1)[0].strip()
    assert shown == published.table(rows), "docs/planner.md is stale: run python bench/bench_published.py --docs"


def test_each_claimed_row_lies_within_its_band(rows: list[dict[str, Any]]) -> None:
    claimed = [r for r in rows if r["within"] is not None]
    assert {r["name"] for r in claimed} >= {"Llama 3 405B", "Llama 3 405B, 8K GPUs", "Llama 3 405B, 131K context"}
    off = [(r["name"], r["ratio"], r["within"]) for r in claimed if abs(r["planned"] / r["figure"] - 1) > r["within"]]
    assert not off, off


def test_each_row_plans_the_published_world_and_metas_pipeline(rows: list[dict[str, Any]]) -> None:
    """Every command plans on the published number of GPUs; the Meta rows are Table 4's TP 8 x PP 16 interleaved
    layouts, planned without recomputation (over the usable memory: docs/planner.md, 'Llama 3 405B')."""
    assert [r["world_size"] for r in rows] == [r["gpus"] for r in rows]
    meta = {r["name"]: r for r in rows if r["source"] == published.META}
    assert meta["Llama 3 405B"]["planned_layout"] == {
        "tp": 8,
        "pp": 16,
        "cp": 1,
        "ep": 1,
        "dp": 128,
        "virtual_stages": 4,
    }
    assert meta["Llama 3 405B, 131K context"]["planned_layout"]["cp"] == 16
    assert all(r["exit"] == 2 and not r["fits"] for n, r in meta.items() if "shipped" not in n)
    assert meta["Llama 3 405B as shipped"]["fits"]
