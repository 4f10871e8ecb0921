"""Build rank R of the job with the task's own engine on fake tensors, run one training step, measure it.

The step is the steady state's: the optimizer's state exists already (as after the first step: a step on zero
gradients makes it, untracked) and the memory tracker and the collective counter see only the step itself.
Without pipeline parallelism, micro-batches past the second repeat the second's allocations exactly (the first
makes the accumulated gradients, each later one adds into them, the last reduces them), so at most two run:
`Simulation.microbatches` says how many of the step's ran. A pipeline runs its whole schedule: which micro-batch
is in flight where is the schedule's own business.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import pickle
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining.stage import extract_tensor_meta

from hpctrain.config.layout import Layout
from hpctrain.config.schema import Config, to_plain
from hpctrain.models import create_model
from hpctrain.parallel.engine import Engine
from hpctrain.parallel.pipeline import stage_model
from hpctrain.parallel.precision import autocast
from hpctrain.simulate.collectives import CollectiveCounter
from hpctrain.simulate.memory import category_peaks, column_peaks, columns, peak_by_category, step_tracker
from hpctrain.simulate.peers import pipeline_peers
from hpctrain.simulate.world import counting_group_calls, fake_world, groups_held

UNSEEN = (
    "kernel speed",
    "NCCL's own buffers",
    "the CUDA caching allocator's fragmentation and workspaces (cuBLAS, attention)",
)
UNSEEN_ON_CPU = ("which attention kernel a GPU runs (CPU SDPA is not flash attention)",)
FAKE_CUDA = "cuda (fake)"


@dataclass(frozen=True)
class Simulation:
    """What one rank held and did in one step, as torch measured it on fake tensors."""

    rank: int
    world_size: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    cp_rank: int | None  # None without context parallelism
    stages: tuple[int, ...]  # the pipeline stages (model chunks) this rank holds
    categories: dict[str, int]  # torch's peak snapshot by its categories, bytes
    category_peaks: dict[str, int]  # the most each of torch's categories held at any point of the step
    column_peaks: dict[str, int]  # the most each planner column held at any point of the step (its own worst case)
    peak: int  # bytes at the peak
    microbatches: int  # micro-batches the simulated step ran
    step_microbatches: int  # ... of the real step's
    groups_held: int  # process groups this rank is a member of (the default group included)
    group_calls: int  # new_group/split_group calls the engine made beyond the mesh
    collectives: dict[str, int]  # "op over N ranks" -> count in the step
    world_collectives: int  # collectives over every rank in the step (the control plane)
    seconds: float
    unseen: tuple[str, ...] = field(default=UNSEEN + UNSEEN_ON_CPU)
    device: str = "cpu"  # "cuda (fake)": the step ran on fake CUDA with the GPU's attention kernels
    why_cpu: str = ""  # why a simulation that could have run on fake CUDA ran on the CPU
    attention: dict[str, int] = field(default_factory=dict)  # on fake CUDA: SDPA kernel -> calls in the step

    @property
    def columns(self) -> dict[str, int]:
        return columns(self.categories)


class SimulatedEngine(Engine):
    """The task's engine; fake tensors hold no values, so the step's one host read gives zeros."""

    @staticmethod
    def _read(values: torch.Tensor) -> list[float]:
        values.to("cpu")  # the step's one host read as a GPU makes it (counted on fake CUDA), of no values
        return [0.0] * values.numel()

    def stage_zero_sends(self, mode: FakeTensorMode, tokens: torch.Tensor) -> tuple[Any, ...]:
        """What pipeline stage 0 sends forward, from a stand-in built as its own rank builds it (a rank
        without stage 0 needs it for the schedule's start-up: hpctrain.simulate.peers)."""
        with torch.device("meta"):
            full = create_model(self.cfg.model, self.layout.tp)
        stand_in = self._apply_layout(stage_model(full, 0, self.split))
        with mode:
            part = self._materialise(stand_in)
            with autocast(self.cfg.precision, self.device, not self.fsdp):
                out = part(tokens)
            metas = (extract_tensor_meta(out),)
        del part, out, stand_in
        gc.collect()
        return metas


def simulate(
    cfg: Config | dict[str, Any], layout: Layout, rank: int, microbatches: int | None = None, device: str = "cpu"
) -> Simulation:
    """Rank `rank` of `layout`'s job (cfg: the run's config), built and stepped once on fake tensors, in a process
    of its own: a fake world leaves state in torch that the caller must not inherit (DTensor's sharding cache keeps
    the fake world's meshes, whose groups are gone with it). The child rebuilds the config from a plain dict, as a
    task does (hpctrain.train.loop.load_config). `microbatches`: how many of the step's micro-batches run (default:
    all under a pipeline, else at most 3, which peak as the whole step does). `device`: "cuda" runs on fake CUDA
    (hpctrain.simulate.fake_cuda: the GPU's attention kernels, so a GPU's activations), "cpu" on the CPU, "auto"
    on fake CUDA where it can be built here (g++), else on the CPU, saying why."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is not a rank of a {layout.world_size}-rank job")
    config = cfg if isinstance(cfg, dict) else to_plain(cfg)
    why_cpu = ""
    if device != "cpu":
        from hpctrain.simulate import fake_cuda

        why_cpu = not_on_fake_cuda(config, layout) or fake_cuda.unavailable_reason() or ""
        if why_cpu and device == "cuda":
            raise SimulationError(
                f"plan.simulate_device=cuda: fake CUDA cannot run this here: {why_cpu}\n"
                "    fix: plan.simulate_device=auto (on the CPU where fake CUDA cannot run, saying why)"
            )
    if device != "cpu" and not why_cpu:
        return _on_fake_cuda(config, layout, rank, microbatches)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        sim = pool.apply(_simulate_config, (config, layout, rank, microbatches))
    return replace(sim, why_cpu=why_cpu)


def not_on_fake_cuda(config: dict[str, Any], layout: Layout) -> str | None:
    """Why this job's step cannot run on fake CUDA (None: it can). torch's DDP Reducer reads tensors' bytes in C++
    and times iterations with a CUDA timer of libtorch_cuda; Inductor generates Triton kernels for CUDA, which
    need the device. Both run on gloo ranks in the tests and on a GPU in gpu_check (the checks refuse both for
    dry_run=simulate)."""
    from hpctrain.parallel.data_parallel import uses_fsdp

    if (
        layout.world_size > 1
        and layout.dp * layout.cp > 1
        and not uses_fsdp(layout.zero_stage, layout.tp, layout.pp, layout.ep)
    ):
        return (
            "torch's DDP (zero.stage=0 without TP or PP): its C++ Reducer reads tensors' bytes (the shape check "
            "across ranks, the bucket rebuild), which fake tensors do not have"
        )
    if config.get("parallel", {}).get("compile"):
        return "parallel.compile: Inductor's CUDA kernels are Triton code, which needs a GPU"
    return None


def _on_fake_cuda(config: dict[str, Any], layout: Layout, rank: int, microbatches: int | None) -> Simulation:
    """`simulate` in a new process that loaded fake CUDA before torch (hpctrain.simulate.fake_cuda.child)."""
    from hpctrain.simulate import fake_cuda

    with tempfile.TemporaryDirectory(prefix="hpctrain-simulate-") as tmp:
        request, answer = Path(tmp) / "request.pkl", Path(tmp) / "answer.pkl"
        request.write_bytes(pickle.dumps((config, layout, rank, microbatches)))
        done = fake_cuda.run_module("hpctrain.simulate.fake_cuda.child", ["simulate", str(request), str(answer)])
        if done.returncode != 0 or not answer.is_file():
            raise SimulationError(
                f"the simulation on fake CUDA failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
            )
        outcome = pickle.loads(answer.read_bytes())
    if isinstance(outcome, str):
        raise SimulationError(outcome)
    return outcome


def _simulate_config(config: dict[str, Any], layout: Layout, rank: int, microbatches: int | None) -> Simulation:
    from hpctrain.train.loop import load_config

    torch.set_num_threads(1)
    try:
        return simulate_here(load_config(config), layout, rank, microbatches)
    except Exception as exc:  # torch's exceptions can hold unpicklable objects: the pool could not send them back
        raise SimulationError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from None


class SimulationError(RuntimeError):
    """A simulation that failed in its process, with that process's traceback as text."""


def simulate_here(
    cfg: Config,
    layout: Layout,
    rank: int,
    microbatches: int | None = None,
    device: str = "cpu",
    step_modes: Callable[[], Sequence[Any]] = tuple,
) -> Simulation:
    """`simulate` in this process (which must not have torch.distributed initialised; it is left polluted).
    `device` "cuda" needs fake CUDA loaded and installed (hpctrain.simulate.fake_cuda.child does both);
    `step_modes()`: more dispatch modes for the step alone, entered inside the fake mode (fake_cuda.rules)."""
    started = time.perf_counter()
    cuda = device == "cuda"
    if cuda:
        from hpctrain.simulate import fake_cuda

        if not fake_cuda.loaded():
            raise SimulationError("device='cuda' simulates on fake CUDA: run it through hpctrain.simulate.simulate")
    on = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with fake_world(layout, rank, on.type) as dims, warnings.catch_warnings():
        # Under fake tensors a functional collective's result is its wait's alias, a view; on a real group it is
        # a fresh tensor, so FSDP2's warning of a unit returning a view (EP's experts) would be the simulation's own
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with counting_group_calls() as calls, _sharding_under(mode if cuda else None):
            engine = SimulatedEngine(cfg, layout, on, dims, tensors=mode)
        step_microbatches = layout.microbatches
        if microbatches is None:
            microbatches = step_microbatches if dims.pp > 1 else min(step_microbatches, 3)
        with mode:  # the whole step's batch, as the data reader hands it over, of which the slice runs
            step = torch.zeros(2, step_microbatches, layout.micro_batch, cfg.train.seq_len, dtype=torch.long)
            batches = step[:, :microbatches]
        kernels = _gpu_attention() if cuda else None
        boundary = None
        if dims.pp > 1 and not engine.has_first:
            with kernels or contextlib.nullcontext():
                boundary = engine.stage_zero_sends(mode, batches[0, 0])
        with mode:
            _make_optimizer_state(engine)
        tracker = step_tracker(engine.model_parts, engine.optimizers, on.type)
        counter = CollectiveCounter()
        peers = pipeline_peers(boundary) if dims.pp > 1 else contextlib.nullcontext()
        with mode, peers, kernels or contextlib.nullcontext():
            if engine.schedule is not None:
                engine.start_pipeline(*engine._to_device(batches))  # on the device, as the step will
            with tracker, counter, contextlib.ExitStack() as modes:
                for extra in step_modes():
                    modes.enter_context(extra)
                engine.step(batches, float(cfg.optim.lr))
        categories = peak_by_category(tracker)
        return Simulation(
            rank=rank,
            world_size=layout.world_size,
            pp_rank=dims.pp_rank,
            dp_rank=dims.dp_rank,
            tp_rank=dims.tp_rank,
            cp_rank=dims.cp_rank if dims.cp > 1 else None,
            stages=tuple(engine.stage_ids),
            categories=categories,
            category_peaks=category_peaks(tracker),
            column_peaks=column_peaks(tracker),
            peak=sum(categories.values()),
            microbatches=microbatches,
            step_microbatches=step_microbatches,
            groups_held=groups_held(),
            group_calls=len(calls),
            collectives=counter.summary(),
            world_collectives=counter.on_world(),
            seconds=time.perf_counter() - started,
            unseen=UNSEEN if cuda else UNSEEN + UNSEEN_ON_CPU,
            device=FAKE_CUDA if cuda else "cpu",
            attention=dict(kernels.kernels) if kernels else {},
        )


@contextlib.contextmanager
def _sharding_under(mode: FakeTensorMode | None) -> Iterator[None]:
    """FSDP2's fully_shard under the fake mode on fake CUDA: on a "cuda" mesh it makes device tensors at once,
    which only the mode can make on a CPU build (the engine applies its layout outside it)."""
    if mode is None:
        yield
        return
    from hpctrain.parallel import data_parallel

    fully_shard = data_parallel.fully_shard

    def under_the_mode(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return fully_shard(*args, **kwargs)

    data_parallel.fully_shard = under_the_mode
    try:
        yield
    finally:
        data_parallel.fully_shard = fully_shard


def _gpu_attention() -> Any:
    from hpctrain.simulate.fake_cuda.attention import GpuAttention

    return GpuAttention()


def _make_optimizer_state(engine: Engine) -> None:
    """The optimizer's state as after a first step: one step on zero gradients creates it (AdamW's moments)."""
    for part, optimizer in zip(engine.model_parts, engine.optimizers):
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def most_loaded_rank(layout: Layout, stage: int) -> int:
    """The first rank (DP 0, TP 0) of pipeline rank `stage`: the mesh puts PP outermost."""
    return stage * (layout.world_size // layout.pp)
