"""The cluster's GPUs as the planner and the MFU metric see them: the GPU type's datasheet figures
(hpctrain.hardware) with the job's GPUs per node and the cluster's own measured or capped figures."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from hpctrain.hardware import GB, Hardware, hardware

if TYPE_CHECKING:
    from hpctrain.config.schema import ClusterConfig


def cluster_hardware(cluster: ClusterConfig) -> Hardware:
    """`cluster.gpu_type`'s figures, with `cluster.gpus_per_node` (TP and DP links depend on it) and each of
    cluster.gpu_peak_tflops / intra_node_gb_s / inter_node_gb_s that is set in place of the datasheet's;
    `overridden` names those keys. ValueError for an unknown GPU type (the checks say it first)."""
    hw = replace(hardware(cluster.gpu_type), gpus_per_node=cluster.gpus_per_node)
    scale = cluster.gpu_peak_tflops * 1e12 / hw.peak_flops if cluster.gpu_peak_tflops > 0 else 1.0
    return replace(
        hw,
        peak_flops=hw.peak_flops * scale,
        fp8_flops=hw.fp8_flops * scale,
        intra_node_bw=cluster.intra_node_gb_s * GB if cluster.intra_node_gb_s > 0 else hw.intra_node_bw,
        inter_node_bw=cluster.inter_node_gb_s * GB if cluster.inter_node_gb_s > 0 else hw.inter_node_bw,
        overridden=tuple(
            f"cluster.{key}"
            for key in ("gpu_peak_tflops", "intra_node_gb_s", "inter_node_gb_s")
            if getattr(cluster, key) > 0
        ),
    )
