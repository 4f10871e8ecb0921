"""Topology-aware NCCL settings decided on captured node outputs (nvidia-smi topo -m, /sys/class/infiniband,
ibstat): active HCAs only, the rank's nearest HCA first, RoCE's GID index, and the user's values kept."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from hpctrain.config.schema import Config
from hpctrain.distributed.nccl_env import apply, nccl_environment
from hpctrain.distributed.task_env import task_environment
from hpctrain.health.node import ib_report, parse_ibstat, parse_topo_matrix

FIXTURES = Path(__file__).parent / "health" / "fixtures" / "node"


def nccl(**values: object) -> object:
    return OmegaConf.merge(OmegaConf.structured(Config), {"cluster": {"nccl": values}}).cluster.nccl


def topo(name: str) -> dict:
    return parse_topo_matrix((FIXTURES / name).read_text())


def test_active_hcas_with_the_nearest_first() -> None:
    ib = ib_report(FIXTURES / "sysfs_ib_healthy")
    t = topo("topo_m_dgx2_nccltests78.txt")  # GPU2's nearest NIC is mlx5_1
    env = nccl_environment(nccl(), 2, t, ib)
    assert env["NCCL_IB_HCA"] == "mlx5_1,mlx5_0,mlx5_2,mlx5_3"
    assert "NCCL_IB_GID_INDEX" not in env  # InfiniBand needs no GID index
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_SOCKET_IFNAME"].startswith("^lo")


def test_a_port_that_is_down_is_left_out() -> None:
    env = nccl_environment(nccl(), 0, topo("topo_m_dgx2_nccltests78.txt"), ib_report(FIXTURES / "sysfs_ib_degraded"))
    assert env["NCCL_IB_HCA"].split(",") == ["mlx5_0", "mlx5_1", "mlx5_3"]  # mlx5_2 is DOWN


def test_roce_gets_the_rocev2_gid_index() -> None:
    ib = parse_ibstat((FIXTURES / "ibstat_roce_one_down.txt").read_text())
    env = nccl_environment(nccl(), 0, None, ib)
    assert env["NCCL_IB_GID_INDEX"] == "3" and env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"  # mlx5_10 is down


def test_the_config_wins_and_nothing_set_by_the_user_is_overridden() -> None:
    env = nccl_environment(nccl(ib_hca="=mlx5_4", ib_gid_index=1, socket_ifname="ib0", topo_file="/etc/topo.xml",
                                debug="INFO", debug_subsys="INIT,NET"), 0, topo("topo_m_dgx_a100_ucx.txt"),
                           ib_report(FIXTURES / "sysfs_ib_healthy"))
    assert env["NCCL_IB_HCA"] == "=mlx5_4" and env["NCCL_IB_GID_INDEX"] == "1" and env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env["NCCL_TOPO_FILE"] == "/etc/topo.xml" and env["NCCL_DEBUG"] == "INFO"
    assert apply(env, {"NCCL_DEBUG": "WARN"}).get("NCCL_DEBUG") is None


def test_no_gpu_no_ib_sets_only_the_safe_defaults() -> None:
    env = nccl_environment(nccl(), 0, {"status": "not present"}, ib_report(FIXTURES / "does-not-exist"))
    assert "NCCL_IB_HCA" not in env and "NCCL_IB_GID_INDEX" not in env


def test_the_plan_shows_the_nccl_environment(compose_cfg) -> None:
    env = task_environment(compose_cfg("+experiment=175b", "cluster.nccl.debug=INFO"))
    assert env["NCCL_DEBUG"] == "INFO" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
