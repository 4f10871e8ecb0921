"""Topology-aware NCCL settings decided on captured node outputs (nvidia-smi topo -m, /sys/class/infiniband,
ibstat): compute HCAs only (active, not storage), exact names with their port, the rank's nearest first, RoCE's
GID index only on an all-RoCE selection, NCCL's own socket choice unless configured, and the user's values kept."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from hpctrain.config.schema import Config
from hpctrain.distributed.nccl_env import Port, apply, compute_ports, nccl_environment, selects
from hpctrain.distributed.task_env import task_environment
from hpctrain.health.node import ib_report
from hpctrain.health.node_parse import parse_ibstat, parse_topo_matrix

FIXTURES = Path(__file__).parent / "health" / "fixtures" / "node"
DGX_A100 = "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1,mlx5_6:1,mlx5_7:1,mlx5_8:1,mlx5_9:1"


def nccl(**values: object) -> object:
    return OmegaConf.merge(OmegaConf.structured(Config), {"cluster": {"nccl": values}}).cluster.nccl


def topo(name: str) -> dict:
    return parse_topo_matrix((FIXTURES / name).read_text())


def dgx_a100_ib() -> dict:
    """8 compute HDR HCAs next to the GPUs; storage: mlx5_4 (Ethernet) and mlx5_10 (an IB storage fabric)
    active, their second ports mlx5_5 and mlx5_11 down."""
    return ib_report(FIXTURES / "sysfs_ib_dgx_a100_storage")


def test_the_nearest_hca_comes_first_in_exact_names_with_their_port() -> None:
    env = nccl_environment(nccl(), 2, topo("topo_m_dgx_a100_ucx.txt"), dgx_a100_ib())  # GPU2: mlx5_2, mlx5_3
    assert env["NCCL_IB_HCA"] == "=mlx5_2:1,mlx5_3:1,mlx5_0:1,mlx5_1:1,mlx5_6:1,mlx5_7:1,mlx5_8:1,mlx5_9:1"
    assert "NCCL_IB_GID_INDEX" not in env  # InfiniBand needs no GID index
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env  # torch's default, 3: end the process, no abort that can hang


def test_a_bare_name_is_a_prefix_to_nccl_so_the_list_uses_exact_names() -> None:
    ib = parse_ibstat((FIXTURES / "ibstat_roce_one_down.txt").read_text())  # mlx5_0, mlx5_1 up; mlx5_10 down
    env = nccl_environment(nccl(), 0, None, ib)
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    down = Port("mlx5_10", "1", "Ethernet")
    assert selects("mlx5_0,mlx5_1", down)  # the old form: mlx5_1 also selects mlx5_10 (and mlx5_11...)
    assert not selects(env["NCCL_IB_HCA"], down)
    assert selects("^=mlx5_0", down) and not selects("mlx5_10:2", down)


def test_storage_nics_are_left_out() -> None:
    ports, dropped = compute_ports(dgx_a100_ib(), topo("topo_m_dgx_a100_ucx.txt"))
    assert "=" + ",".join(f"{p.hca}:{p.port}" for p in ports) == DGX_A100
    assert dropped["mlx5_4"].startswith("Ethernet port on an InfiniBand node")
    assert dropped["mlx5_10"].startswith("not the nearest NIC of any GPU")  # IB too: only the topology tells
    assert "mlx5_5" not in dropped and "mlx5_11" not in dropped  # down: never candidates


def test_without_a_topology_storage_hcas_come_from_the_config() -> None:
    ib = dgx_a100_ib()
    assert nccl_environment(nccl(), 0, {"status": "not present"}, ib)["NCCL_IB_HCA"] == DGX_A100 + ",mlx5_10:1"
    env = nccl_environment(nccl(exclude_hca="mlx5_10,mlx5_11"), 0, {"status": "not present"}, ib)
    assert env["NCCL_IB_HCA"] == DGX_A100


def test_a_topology_that_names_nics_differently_is_not_used_to_exclude() -> None:
    t = topo("topo_m_dgx_a100_nccl1505.txt")  # NIC0..NIC11 without a legend: names unknown
    assert nccl_environment(nccl(), 0, t, ib_report(FIXTURES / "sysfs_ib_healthy"))["NCCL_IB_HCA"] == (
        "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"
    )


def test_a_port_that_is_down_is_left_out() -> None:
    env = nccl_environment(nccl(), 0, None, ib_report(FIXTURES / "sysfs_ib_degraded"))
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1,mlx5_3:1"  # mlx5_2 is DOWN


def test_the_gid_index_only_when_every_selected_hca_is_roce() -> None:
    roce = parse_ibstat((FIXTURES / "ibstat_roce_one_down.txt").read_text())
    assert nccl_environment(nccl(), 0, None, roce)["NCCL_IB_GID_INDEX"] == "3"
    mixed = dgx_a100_ib()  # IB compute HCAs and an Ethernet storage port
    assert "NCCL_IB_GID_INDEX" not in nccl_environment(nccl(), 0, None, mixed)
    assert "NCCL_IB_GID_INDEX" not in nccl_environment(nccl(ib_hca="mlx5"), 0, None, mixed)
    assert nccl_environment(nccl(ib_hca="=mlx5_4"), 0, None, mixed)["NCCL_IB_GID_INDEX"] == "3"


def test_nccl_chooses_the_socket_interface_unless_configured() -> None:
    env = nccl_environment(nccl(), 0, None, ib_report(FIXTURES / "sysfs_ib_healthy"))
    assert "NCCL_SOCKET_IFNAME" not in env  # NCCL skips lo and docker* itself, and uses lo when it is all
    assert nccl_environment(nccl(socket_ifname="=ib0"), 0, None, None)["NCCL_SOCKET_IFNAME"] == "=ib0"


def test_the_config_wins_and_nothing_set_by_the_user_is_overridden() -> None:
    env = nccl_environment(
        nccl(
            ib_hca="=mlx5_4",
            ib_gid_index=1,
            socket_ifname="ib0",
            topo_file="/etc/topo.xml",
            debug="INFO",
            debug_subsys="INIT,NET",
        ),
        0,
        topo("topo_m_dgx_a100_ucx.txt"),
        ib_report(FIXTURES / "sysfs_ib_healthy"),
    )
    assert env["NCCL_IB_HCA"] == "=mlx5_4" and env["NCCL_IB_GID_INDEX"] == "1" and env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env["NCCL_TOPO_FILE"] == "/etc/topo.xml" and env["NCCL_DEBUG"] == "INFO"
    assert apply(env, {"NCCL_DEBUG": "WARN"}).get("NCCL_DEBUG") is None


def test_no_gpu_no_ib_sets_only_the_safe_defaults() -> None:
    env = nccl_environment(nccl(), 0, {"status": "not present"}, ib_report(FIXTURES / "does-not-exist"))
    assert env == {}


def test_the_plan_shows_the_nccl_environment(compose_cfg) -> None:
    env = task_environment(compose_cfg("+experiment=175b", "cluster.nccl.debug=INFO"))  # TP 8
    assert env["NCCL_DEBUG"] == "INFO" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
    # NCCL's heartbeat monitor must not end a stuck rank before hpctrain's watchdog has left its record
    assert int(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) == 1800 > 600 + 120
    assert "NCCL_SOCKET_IFNAME" not in env
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env  # Megatron's setting: it only serialises FSDP/PP overlap


def test_every_executor_keeps_a_flight_recorder_and_dumps_it_on_a_timeout(compose_cfg) -> None:
    for overrides in ((), ("+experiment=175b",)):  # local, Slurm
        env = task_environment(compose_cfg(*overrides))
        assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # deprecated: torch 2.13 warns in every task's stderr


def test_gpu_tasks_get_expandable_segments_unless_the_site_sets_the_allocator(compose_cfg) -> None:
    assert task_environment(compose_cfg("+experiment=175b"))["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in task_environment(compose_cfg())  # the CPU default has no CUDA allocator
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # a site's own setting, either name, wins
        env = task_environment(compose_cfg("+experiment=175b", f"+cluster.env.{name}=max_split_size_mb:512"))
        assert env[name] == "max_split_size_mb:512"
        assert {n for n in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if n in env} == {name}
