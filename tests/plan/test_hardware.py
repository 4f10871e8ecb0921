"""The GPU types beyond A100/H100/H200 (issue 49: H800, B200, GB200, MI300X) with their datasheet figures, and the
cluster's own figures in their place (cluster.gpu_peak_tflops, .intra_node_gb_s, .inter_node_gb_s): the plan, its
JSON and the task's MFU use the same ones, and the plan says which are whose."""

from __future__ import annotations

import json

import pytest

from hpctrain.config.cluster import cluster_hardware
from hpctrain.config.layout import resolve_layout
from hpctrain.hardware import GB, GiB, hardware
from hpctrain.launch.cli import run
from hpctrain.parallel.metrics import flops_per_token, mfu
from hpctrain.plan.estimate import as_json, estimate

# (name, dense BF16 TFLOP/s, dense FP8 TFLOP/s, GiB, NVLink GB/s each way, GPUs on one NVLink fabric, GPUs a node)
PUBLISHED = [
    ("h800", 989, 1979, 80, 200, 8, 8),  # H800 SXM: H100's compute, NVLink 400 GB/s in both directions
    ("b200", 2250, 4500, 180, 900, 8, 8),  # DGX B200: 72 PF FP8 sparse / 8 GPUs / 2; 1,440 GB / 8
    ("gb200", 2500, 5000, 186, 900, 72, 4),  # GB200 NVL72: 360 PF BF16 sparse / 72 / 2; 13.4 TB / 72
    ("mi300x", 1307.4, 2614.9, 192, 448, 8, 8),  # AMD MI300X data sheet; 7 Infinity Fabric links x 64 GB/s
]


@pytest.mark.parametrize("name,bf16,fp8,gib,nvlink,domain,per_node", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_the_new_gpu_types_carry_their_published_figures(
    name: str, bf16: float, fp8: float, gib: int, nvlink: int, domain: int, per_node: int
) -> None:
    hw = hardware(name)
    assert (hw.peak_flops, hw.fp8_flops) == (pytest.approx(bf16 * 1e12), pytest.approx(fp8 * 1e12))
    assert hw.gpu_mem_bytes == gib * GiB and hw.intra_node_bw == nvlink * GB and hw.inter_node_bw == 50 * GB
    assert (hw.nvlink_gpus, hw.gpus_per_node, hw.has_fp8, hw.overridden) == (domain, per_node, True, ())


def test_the_cluster_s_own_figures_replace_the_datasheet_s_and_are_named(compose_cfg) -> None:
    cfg = compose_cfg("+experiment=175b", "cluster.gpu_type=h100_80gb", "cluster.gpu_peak_tflops=700")
    capped = cluster_hardware(cfg.cluster)
    assert capped.peak_flops == pytest.approx(700e12) and capped.fp8_flops == pytest.approx(1979e12 * 700 / 989)
    assert capped.intra_node_bw == 450 * GB and capped.overridden == ("cluster.gpu_peak_tflops",)
    links = compose_cfg("+experiment=175b", "cluster.intra_node_gb_s=370", "cluster.inter_node_gb_s=20")
    measured = cluster_hardware(links.cluster)
    assert (measured.intra_node_bw, measured.inter_node_bw) == (370 * GB, 20 * GB)
    assert measured.peak_flops == 312e12 and measured.overridden == (
        "cluster.intra_node_gb_s",
        "cluster.inter_node_gb_s",
    )
    # the estimate: a lower peak is a slower step and a higher MFU for the same work; slower links cost time
    base = estimate(compose_cfg("+experiment=175b"), resolve_layout(compose_cfg("+experiment=175b")))
    slow = estimate(links, resolve_layout(links))
    assert slow.step.step_time_s > base.step.step_time_s
    assert as_json(slow)["hardware"]["from_cluster"] == ["cluster.intra_node_gb_s", "cluster.inter_node_gb_s"]
    assert as_json(base)["hardware"] | {"from_cluster": []} == as_json(base)["hardware"]


def test_the_task_s_mfu_is_against_the_peak_the_plan_used(compose_cfg) -> None:
    cfg = compose_cfg("+experiment=175b", "cluster.gpu_type=h100_80gb")
    tokens = 1e6
    assert mfu(cfg, tokens, 64) == pytest.approx(tokens * flops_per_token(cfg) / (64 * 989e12))
    capped = compose_cfg("+experiment=175b", "cluster.gpu_type=h100_80gb", "cluster.gpu_peak_tflops=700")
    assert mfu(capped, tokens, 64) == pytest.approx(mfu(cfg, tokens, 64) * 989 / 700)


def test_gb200_times_groups_inside_its_nvl72_domain_at_nvlink_bandwidth(compose_cfg) -> None:
    """16 trays of 4 GB200 (64 GPUs, TP 4 inside a tray, DP 16 across trays): the gradients' reduce-scatter
    spans 64 GPUs, inside the 72-GPU NVLink domain: NVLink, where B200 nodes of 4 would use the network."""
    overrides = ("+experiment=gpt3_13b_16node", "cluster.nodes=16", "cluster.gpus_per_node=4", "parallel.tp=4")
    links = {}
    for gpu in ("gb200", "b200"):
        cfg = compose_cfg(
            *overrides, f"cluster.gpu_type={gpu}", "parallel.pp=1", "parallel.virtual_stages=1", "parallel.dp=-1"
        )
        items = as_json(estimate(cfg, resolve_layout(cfg)))["comm_per_gpu_per_step"]
        links[gpu] = {i["link"] for i in items if i["name"].startswith(("grad", "param"))}
    assert links == {"gb200": {"nvlink"}, "b200": {"network"}}


def test_the_plan_says_which_figures_are_the_cluster_s(compose_cfg, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(compose_cfg("+experiment=175b", "cluster.gpu_type=b200", "dry_run=true")).code == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  hardware"))
    assert "b200: 2250 TFLOP/s dense BF16, NVLink 900 GB/s" in line and "all from the datasheets" in line
    overrides = ("+experiment=175b", "cluster.gpu_peak_tflops=250", "dry_run=true")
    assert run(compose_cfg(*overrides)).code == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  hardware"))
    assert "250 TFLOP/s dense BF16 (cluster.gpu_peak_tflops)" in line and "in brackets are the cluster's" in line
    assert run(compose_cfg(*overrides, "plan.format=json")).code == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["peak_flops"] == pytest.approx(250e12)
    bad = run(compose_cfg("+experiment=175b", "cluster.inter_node_gb_s=-5", "dry_run=true"))
    assert bad.code == 2 and "cluster.inter_node_gb_s: must be >= 0 GB/s" in bad.error
