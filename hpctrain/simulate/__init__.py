"""One rank of the real job, built and stepped on one CPU machine: `dry_run=simulate`.

The job's world is a fake process group of its full size (torch's "fake" backend: collectives return at once,
no peer exists), its tensors are fake (FakeTensorMode: shapes, dtypes and storage sizes, no data), and on them
the task's own engine (hpctrain.parallel.engine) is built for rank R and runs one training step: the same stage
cut, TP plan, FSDP2 wrapping, recomputation, optimizer and pipeline schedule. torch's FSDP-aware memory tracker
measures the rank's peak by category; the planner's figure for the same rank stands next to it.

What it cannot see, and says so: kernel speed, NCCL's own buffers, the CUDA caching allocator's fragmentation
and workspaces (cuBLAS, attention), and which attention kernel a GPU picks (CPU SDPA's kernels are not flash
attention). Values never exist: the loss and gradient norm are not computed.
"""

from typing import Any

__all__ = ["Simulation", "simulate"]


def __getattr__(name: str) -> Any:
    """Lazily: hpctrain.simulate.fake_cuda must be importable before torch is (it loads a library first)."""
    if name in __all__:
        from hpctrain.simulate import rank

        return getattr(rank, name)
    raise AttributeError(name)
