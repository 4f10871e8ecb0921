"""The plan as a picture: per-GPU memory breakdown and step-time split (needs matplotlib). Login side."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_chart(plan: dict[str, Any], path: Path) -> Path:
    """Two bar charts side by side; the usable GPU memory is drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = plan["memory_per_gpu_bytes"]
    split = plan["step_time_split_s"]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["params", "grads", "optimizer", "buffers", "activations"]
    gib = [mem[n] / 2**30 for n in names]
    ax_mem.bar(names, gib, color=["#4c72b0", "#55a868", "#c44e52", "#ccb974", "#8172b2"])
    ax_mem.axhline(
        mem["usable"] / 2**30, color="black", linestyle="--", label=f"usable {mem['usable'] / 2**30:.0f} GiB"
    )
    ax_mem.set_ylabel("GiB per GPU")
    ax_mem.set_title(f"memory, most loaded GPU: {mem['total'] / 2**30:.1f} GiB")
    ax_mem.legend()
    parts = list(split)
    ax_time.bar(parts, [split[p] for p in parts], color="#4c72b0")
    ax_time.set_ylabel("seconds per step")
    span = plan.get("est_range")
    spread = (
        f" ({span['fastest']['step_time_s']:.1f}-{span['slowest']['step_time_s']:.1f} s over the assumptions)"
        if span
        else ""
    )
    ax_time.set_title(f"step {plan['est_step_time_s']:.2f} s{spread}, MFU {plan['est_mfu']:.0%}")
    lay = plan["layout"]
    cp = f" x CP {lay['cp']}" if lay.get("cp", 1) > 1 else ""
    fig.suptitle(
        f"{plan['model']['name']}: DP {lay['dp']} x TP {lay['tp']} x PP {lay['pp']}{cp}, ZeRO-{lay['zero_stage']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
