"""Node report parsers and decisions on real captured outputs (tests/health/fixtures/node/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.health import node
from hpctrain.health.node import compare_nodes, ib_report
from hpctrain.health.node_parse import (
    parse_ibstat,
    parse_nvidia_smi_xml,
    parse_nvlink_status,
    parse_topo_matrix,
    parse_xid_lines,
)
from hpctrain.health.node_problems import gpu_problems, ib_problems, nvlink_problems, xid_problems

FIX = Path(__file__).parent / "fixtures" / "node"


def read(name: str) -> str:
    return (FIX / name).read_text()


# ------------------------------------------------------------------------------------------ GPU


def test_real_a100_mig_capture_parses() -> None:
    gpu = parse_nvidia_smi_xml(read("nvidia_smi_q_x_a100_80gb_mig.xml"))
    assert (gpu["driver_version"], gpu["cuda_version"], gpu["count"], gpu["attached_gpus"]) == (
        "535.54.03",
        "12.2",
        1,
        4,
    )
    g = gpu["gpus"][0]
    assert g["uuid"] == "GPU-513536b6-7d19-9063-b049-1e69664bb298"
    assert g["pci_bus_id"] == "00000000:01:00.0"
    assert g["product_name"] == "NVIDIA A100-SXM4-80GB" and g["ecc_mode"] == "Enabled"
    assert g["ecc_uncorrectable"] == {"volatile": {"sram": 0, "dram": 0}, "aggregate": {"sram": 0, "dram": 0}}
    assert g["retired_pages"] == {"single_bit": None, "double_bit": None, "pending": None}
    assert g["remapped_rows"] is None  # "N/A" in this capture (MIG enabled)
    assert (g["sm_clock_mhz"], g["sm_clock_max_mhz"]) == (1275, 1410)
    assert (g["power_draw_w"], g["power_limit_w"], g["temperature_c"]) == (67.03, 500.0, 27.0)
    assert gpu_problems(gpu, 0, None) == []
    json.dumps(gpu)


def test_healthy_8_gpu_a100_node_has_no_problems() -> None:
    gpu = parse_nvidia_smi_xml(read("nvidia_smi_q_x_a100x8_healthy.xml"))
    assert gpu["count"] == 8 and gpu["product_names"] == ["NVIDIA A100-SXM4-80GB"]
    assert [g["pci_bus_id"][9:11] for g in gpu["gpus"]] == ["07", "0F", "47", "4E", "87", "90", "B7", "BD"]
    assert gpu["gpus"][5]["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
    assert gpu_problems(gpu, 8, "A100") == []


def test_ecc_and_pending_remap_are_found_on_gpu_3_only() -> None:
    gpu = parse_nvidia_smi_xml(read("nvidia_smi_q_x_a100x8_ecc_gpu3.xml"))
    assert gpu["gpus"][3]["ecc_uncorrectable"]["volatile"] == {"sram": 0, "dram": 4}
    assert gpu_problems(gpu, 8, "A100") == [
        "GPU 3 (00000000:4E:00.0): uncorrectable ECC errors since boot (dram 4)",
        "GPU 3 (00000000:4E:00.0): row remapping pending (reset the GPU)",
    ]


def test_count_and_model_mismatch_against_the_request() -> None:
    gpu = parse_nvidia_smi_xml(read("nvidia_smi_q_x_a100_80gb_mig.xml"))
    assert gpu_problems(gpu, 8, "H100") == [
        "GPU count 1 != expected 8",
        "GPU 0 (00000000:01:00.0): model NVIDIA A100-SXM4-80GB, expected H100",
    ]


def test_pre_ampere_pending_retirement_and_double_bit_counts() -> None:
    text = (
        read("nvidia_smi_q_x_a100_80gb_mig.xml")
        .replace("<pending_retirement>N/A</pending_retirement>", "<pending_retirement>Yes</pending_retirement>")
        .replace("<volatile>", "<volatile><double_bit><total>1</total></double_bit>", 1)
    )
    gpu = parse_nvidia_smi_xml(text)
    assert gpu["gpus"][0]["ecc_uncorrectable"]["volatile"]["double_bit"] == 1
    assert gpu_problems(gpu, 1, None) == [
        "GPU 0 (00000000:01:00.0): uncorrectable ECC errors since boot (double_bit 1)",
        "GPU 0 (00000000:01:00.0): page retirement pending (reset the GPU)",
    ]


def test_low_idle_sm_clock_is_not_a_problem() -> None:
    text = read("nvidia_smi_q_x_a100_80gb_mig.xml").replace(
        "<sm_clock>1275 MHz</sm_clock>", "<sm_clock>210 MHz</sm_clock>"
    )
    gpu = parse_nvidia_smi_xml(text)
    assert gpu["gpus"][0]["sm_clock_mhz"] == 210 and gpu_problems(gpu, 1, "A100") == []


def test_xid_lines() -> None:
    xids = parse_xid_lines(read("dmesg_xid.txt"))
    assert [(e["pci"], e["xid"]) for e in xids] == [
        ("0000:cb:00", 13),
        ("0000:cb:00", 13),
        ("0000:cb:00", 13),
        ("0000:cb:00", 109),
        ("0000:dc:00", 45),
        ("0000:ed:00", 45),
        ("0000:44:00", 79),
        ("0000:01:00", 32),
    ]
    assert xids[3] == {
        "pci": "0000:cb:00",
        "xid": 109,
        "pid": "1797828",
        "name": "pt_main_thread",
        "message": "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
    }
    assert xids[0]["pid"] == "<unknown>"
    assert xids[6]["pid"] is None and xids[6]["message"] == "GPU has fallen off the bus"
    assert xid_problems(xids) == ["GPU 0000:44:00: Xid 79 in the kernel log (1x)"]


# --------------------------------------------------------------------------------------- NVLink


def test_nvlink_inactive_links_are_named() -> None:
    nvlink = parse_nvlink_status(read("nvlink_s_v100_two_inactive.txt"))
    links = nvlink["gpus"]["3"]["links"]
    assert nvlink["gpus"]["3"]["name"] == "Tesla V100-SXM2-32GB"
    assert links == {"0": 25.781, "1": 25.781, "2": 25.781, "3": None, "4": 25.781, "5": None}
    assert nvlink_problems(nvlink) == ["GPU 3: NVLink link(s) 3, 5 inactive (4 of 6 active)"]


def test_nvlink_all_inactive_means_no_nvlink_not_a_fault() -> None:
    nvlink = parse_nvlink_status("GPU 0: NVIDIA A10 (UUID: x)\n\t Link 0: <inactive>\n\t Link 1: <inactive>\n")
    assert nvlink_problems(nvlink) == []


# ------------------------------------------------------------------------------------- topology


def test_topology_dgx_a100_nearest_nics() -> None:
    topo = parse_topo_matrix(read("topo_m_dgx_a100_ucx.txt"))
    assert topo["nics"] == [f"mlx5_{i}" for i in range(12)]
    assert topo["gpus"]["GPU0"] == {
        "nearest_nics": ["mlx5_0", "mlx5_1"],
        "nic_path": "PXB",
        "cpu_affinity": "112-127,240-255",
        "numa_affinity": "6-7",
    }
    assert topo["gpus"]["GPU7"]["nearest_nics"] == ["mlx5_8", "mlx5_9"]


def test_topology_pix_preferred_over_pxb_and_node() -> None:
    topo = parse_topo_matrix(read("topo_m_dgx2_nccltests78.txt"))
    assert topo["gpus"]["GPU0"]["nearest_nics"] == ["mlx5_0"] and topo["gpus"]["GPU0"]["nic_path"] == "PIX"
    assert topo["gpus"]["GPU2"]["nearest_nics"] == ["mlx5_1"]
    assert topo["gpus"]["GPU0"]["numa_affinity"] is None


def test_topology_nic_columns_and_legend() -> None:
    text = read("topo_m_dgx_a100_nccl1505.txt")
    topo = parse_topo_matrix(text)
    assert topo["gpus"]["GPU2"] == {
        "nearest_nics": ["NIC2", "NIC3"],
        "nic_path": "PXB",
        "cpu_affinity": "16-31,144-159",
        "numa_affinity": "1",
    }
    legend = "\nNIC Legend:\n\n" + "".join(f"  NIC{i}: mlx5_{i}\n" for i in range(12))
    assert parse_topo_matrix(text + legend)["gpus"]["GPU2"]["nearest_nics"] == ["mlx5_2", "mlx5_3"]


# ----------------------------------------------------------------------------------- InfiniBand


def test_ib_sysfs_healthy() -> None:
    ib = ib_report(FIX / "sysfs_ib_healthy")
    assert sorted(ib["devices"]) == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    dev = ib["devices"]["mlx5_0"]
    assert (dev["hca_type"], dev["fw_ver"], dev["board_id"]) == ("MT4129", "28.41.1000", "MT_0000000838")
    assert dev["ports"]["1"] == {
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate": "400 Gb/sec (4X NDR)",
        "rate_gbps": 400.0,
        "link_layer": "InfiniBand",
    }
    assert ib_problems(ib) == []


def test_ib_sysfs_port_down_and_port_at_lower_rate() -> None:
    assert ib_problems(ib_report(FIX / "sysfs_ib_degraded")) == [
        "mlx5_2 port 1: state 1: DOWN (3: Disabled), not ACTIVE",
        "mlx5_1 port 1: rate 200 Gb/sec (2X NDR) below the node's other ports (400 Gb/sec)",
    ]


def test_ib_missing_directory_is_not_present(tmp_path: Path) -> None:
    assert ib_report(tmp_path / "nope") == {"status": "not present", "devices": {}}


def test_ibstat_roce_with_a_disabled_port() -> None:
    ib = parse_ibstat(read("ibstat_roce_one_down.txt"))
    assert ib["devices"]["mlx5_0"] == {
        "hca_type": "MT4129",
        "fw_ver": "28.39.1002",
        "board_id": None,
        "ports": {
            "1": {
                "state": "Active",
                "phys_state": "LinkUp",
                "rate": "200",
                "rate_gbps": 200.0,
                "link_layer": "Ethernet",
            }
        },
    }
    assert ib["devices"]["mlx5_10"]["ports"]["1"]["state"] == "Down"
    # MT4125 is not compared with the MT4129 ports: only the Down port is a problem.
    assert ib_problems(ib) == ["mlx5_10 port 1: state Down (Disabled), not ACTIVE"]


def test_ibstat_ib_port_down_with_link_up() -> None:
    ib = parse_ibstat(read("ibstat_ib_down_linkup.txt"))
    port = ib["devices"]["mlx5_7"]["ports"]["1"]
    assert (port["state"], port["phys_state"], port["link_layer"]) == ("Down", "LinkUp", "InfiniBand")
    assert ib_problems(ib) == ["mlx5_7 port 1: state Down (LinkUp), not ACTIVE"]


# ------------------------------------------------------------------------------ the whole node


def test_node_report_on_this_machine_says_not_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "_run", lambda cmd: None)  # as on a machine without nvidia-smi
    monkeypatch.setattr(
        node, "ib_report", lambda root="/sys/class/infiniband": {"status": "not present", "devices": {}}
    )
    report = node.node_report(0, None)
    assert report["gpu"]["status"] == report["nvlink"]["status"] == report["topology"]["status"] == "not present"
    assert report["ib"]["status"] == "not present"
    assert report["problems"] == []
    assert report["software"]["python"] and report["software"]["nccl"] is None
    json.dumps(report)
    assert node.gpu_problems(report["gpu"], 8, None) == ["expected 8 GPUs, nvidia-smi not present"]


def test_node_report_for_real_here() -> None:
    if node.shutil.which("nvidia-smi") or Path("/sys/class/infiniband").is_dir():
        pytest.skip("this machine has GPUs or IB: the plain 'not present' case does not apply")
    report = node.node_report(0, None)
    assert report["gpu"]["status"] == "not present" and report["ib"]["status"] == "not present"
    assert report["problems"] == []


# ---------------------------------------------------------------------------------- across nodes


def _report(fw: str | Path, gpu_fixture: str = "nvidia_smi_q_x_a100x8_healthy.xml", torch: str = "2.6.0") -> dict:
    gpu = parse_nvidia_smi_xml(read(gpu_fixture))
    return {
        "gpu": gpu,
        "ib": ib_report(FIX / fw),
        "software": {"driver": gpu["driver_version"], "cuda": "12.4", "nccl": "2.21.5", "torch": torch},
    }


def test_compare_nodes_names_the_node_with_other_ib_firmware() -> None:
    reports = {f"n{i}": _report("sysfs_ib_healthy") for i in range(16)}
    reports["n7"] = _report("sysfs_ib_old_fw")
    assert compare_nodes(reports) == [
        f"IB firmware of mlx5_{i} differs: n7 has 28.39.2048, 15 others have 28.41.1000" for i in range(4)
    ]


def test_compare_nodes_gpu_count_model_and_torch() -> None:
    reports = {f"n{i}": _report("sysfs_ib_healthy") for i in range(4)}
    reports["n2"] = _report("sysfs_ib_healthy", "nvidia_smi_q_x_a100_80gb_mig.xml", torch="2.5.1")
    assert compare_nodes(reports) == [
        "torch version differs: n2 has 2.5.1, 3 others have 2.6.0",
        "GPU count differs: n2 has 1, 3 others have 8",
    ]


def test_compare_nodes_without_a_majority_names_everyone() -> None:
    reports = {"a": _report("sysfs_ib_healthy"), "b": _report("sysfs_ib_old_fw")}
    assert compare_nodes(reports)[0] == "IB firmware of mlx5_0 differs: b has 28.39.2048; a has 28.41.1000"


def test_compare_identical_nodes_is_quiet() -> None:
    assert compare_nodes({f"n{i}": _report("sysfs_ib_healthy") for i in range(3)}) == []
