"""Measured-cost JSON, state scaling, replica groups' network costs, and the tools/goodput.py table, JSON and
plot, with the recovery modes side by side."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hpctrain.goodput.costs import (
    MeasuredTier,
    costs_from_bandwidths,
    heal_seconds,
    node_state_bytes,
    outer_sync_seconds,
    parse_costs,
    pick_tiers,
    scale_tier,
)
from hpctrain.goodput.model import Replicas, TierCost, replica_overhead

TOOL = Path(__file__).resolve().parents[2] / "tools" / "goodput.py"
MEASURED = {
    "schema": "hpctrain.goodput.costs/1",
    "state_bytes_per_node": 2e9,
    "tiers": {
        "ram": {"blocked_s": 0.5, "write_s": 0.2},
        "local": {"blocked_s": 0.5, "write_s": 2.0, "load_s": 1.0},
        "shared": {"blocked_s": 0.5, "write_s": 10.0, "load_s": 8.0},
    },
    "restart_s": 240,
    "p_fast": 0.4,
}


def _tool():
    spec = importlib.util.spec_from_file_location("goodput_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_costs_defaults_and_errors() -> None:
    costs = parse_costs(MEASURED)
    assert costs.tiers["ram"].cost == TierCost(0.5, 0.2, 0.2)  # load defaults to the write time
    assert costs.tiers["shared"].durable and not costs.tiers["local"].durable
    assert (costs.restart_s, costs.p_fast, costs.state_bytes_per_node) == (240.0, 0.4, 2e9)
    assert pick_tiers(costs, None, None) == ("ram", "shared")
    assert pick_tiers(costs, "local", None) == ("local", "shared")
    with pytest.raises(ValueError, match="blocked_s"):
        parse_costs({"tiers": {"shared": {"write_s": 1}}})
    with pytest.raises(ValueError, match="durable"):
        parse_costs({"tiers": {"ram": {"blocked_s": 1}}})
    with pytest.raises(ValueError, match="schema"):
        parse_costs({**MEASURED, "schema": "other/2"})
    with pytest.raises(ValueError, match="nvme"):
        pick_tiers(costs, "nvme", None)


def test_state_scaling_175b_on_4096_gpus() -> None:
    node = node_state_bytes(175e9, 14, 4096, 8)
    assert node == pytest.approx(175e9 * 14 / 512)  # 4.79 GB per node
    costs = costs_from_bandwidths(stage_gbps=4, ram_gbps=10, shared_node_gbps=2, restart_s=300)
    ram = scale_tier(costs.tiers["ram"], costs.state_bytes_per_node, node, 175e9 * 14, 40)
    assert ram == TierCost(pytest.approx(node / 4e9), pytest.approx(node / 10e9), pytest.approx(node / 10e9))
    shared = scale_tier(costs.tiers["shared"], costs.state_bytes_per_node, node, 175e9 * 14, 40)
    assert shared.blocked_s == pytest.approx(node / 4e9)
    assert shared.write_s == pytest.approx(175e9 * 14 / 40e9)  # the file system, not the NICs, limits
    tier = MeasuredTier(TierCost(2.0, 4.0, 4.0), False)
    assert scale_tier(tier, 2e9, 1e9, 1e12, 40) == TierCost(1.0, 2.0, 2.0)
    assert scale_tier(tier, None, 1e9, 1e12, 40) == tier.cost  # no measured size: used as is
    sync = MeasuredTier(TierCost(2.0), True)
    assert scale_tier(sync, 2e9, 1e9, 1e12, 40).blocked_s == pytest.approx(25.0)  # 1 TB at 40 GB/s


def test_tool_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(MEASURED))
    png = tmp_path / "goodput.png"
    rc = _tool().main(
        ["--costs", str(costs), "--gpus", "64,4096,16384", "--reps", "20", "--days", "20", "--json", "--png", str(png)]
    )
    assert rc == 0 and png.stat().st_size > 10_000
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["gpus"] for r in rows] == [64, 4096, 16384]
    assert rows[0]["mtbf_h"] > rows[-1]["mtbf_h"]
    for row in rows:
        only = row["policies"]["shared only"]
        assert abs(only["sim"]["goodput"] - only["model"]) < 3 * only["sim"]["ci95"] + 1e-3
        assert row["policies"]["ram+shared"]["model"] >= only["model"] - 1e-12
    assert rows[-1]["policies"]["fixed"]["model"] < rows[-1]["policies"]["shared only"]["model"]
    assert rows[-1]["policies"]["ram+shared"]["dominant"] == "restarts"


def test_tool_table_and_bad_costs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    assert tool.main(["--gpus", "1024,2048", "--reps", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["GPUs", "MTBF"] and lines[1].split()[0] == "1024" and len(lines) == 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tiers": {"ram": {"blocked_s": 1}}}))
    assert tool.main(["--costs", str(bad)]) == 2
    assert "durable" in capsys.readouterr().err


def test_heal_and_outer_sync_hand_computed() -> None:
    # 175B x 14 bytes on 1024 GPUs = 128 nodes in 2 groups: each node of a group holds 2.45 TB / 64 = 38.3 GB
    assert heal_seconds(175e9 * 14, 128, 2, 10.0) == pytest.approx(175e9 * 14 / 64 / 10e9)
    # DiLoCo's ring all-reduce of 4-byte pseudo-gradients across 4 groups of 32 nodes: 2 x 3/4 of 21.9 GB per node
    assert outer_sync_seconds(175e9, 4, 128, 4, 10.0) == pytest.approx(1.5 * 175e9 * 4 / 32 / 10e9)
    assert outer_sync_seconds(175e9, 4, 128, 1, 10.0) == 0.0


def test_tool_recovery_modes_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    args = ["--gpus", "1024,16384", "--recovery", "all", "--reps", "10", "--days", "10"]
    assert tool.main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for row in rows:
        modes = row["recovery"]
        assert set(modes) == {"restart", "replicas", "diloco"}
        assert modes["restart"] == row["policies"]["ram+shared"]
        for mode in ("replicas", "diloco"):
            e = modes[mode]
            assert abs(e["sim"]["goodput"] - e["model"]) < 3 * e["sim"]["ci95"] + 1e-3, (row["gpus"], mode)
            assert e["tau_slow_s"] > modes["restart"]["tau_slow_s"]  # checkpoints only for the loss of every group
        assert modes["diloco"]["replicas"]["sync_every"] == 20 and modes["replicas"]["replicas"]["sync_every"] == 1
    big = rows[-1]["recovery"]
    assert big["restart"]["model"] < 0.93 < 0.99 < big["replicas"]["model"]  # 16,384 GPUs: a failure every 1.46 h
    assert big["replicas"]["replicas"]["heal_s"] == pytest.approx(175e9 * 14 / 1024 / 10e9)
    # both = restart and replicas; the table gains a side-by-side section
    assert tool.main(["--gpus", "4096", "--recovery", "both", "--reps", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index(next(line for line in out if line.startswith("recovery modes")))
    assert "restart model" in out[at + 1] and "replicas model" in out[at + 1] and "diloco" not in out[at + 1]
    assert out[at + 2].split()[0] == "4096"
    with pytest.raises(SystemExit):
        tool.main(["--recovery", "restart,elastic"])
    assert "elastic" in capsys.readouterr().err


def test_tool_slow_links_favour_diloco(capsys: pytest.CaptureFixture[str]) -> None:
    """Between sites (1 GB/s per node, 2 s of exposed gradient all-reduce per 5 s step), DiLoCo's sync every 20
    steps costs less than syncing every step."""
    args = ["--gpus", "4096", "--recovery", "all", "--reps", "0", "--peer-gbps", "1", "--cross-group-s", "2", "--json"]
    assert _tool().main(args) == 0
    modes = json.loads(capsys.readouterr().out)["rows"][0]["recovery"]
    assert replica_overhead(Replicas(**modes["replicas"]["replicas"])) == pytest.approx(2.002 / 7.002)
    assert modes["replicas"]["loss"]["overhead"] == pytest.approx(2.002 / 7.002, rel=0.01)  # of the time it trains
    assert modes["diloco"]["model"] > modes["replicas"]["model"] + 0.1
