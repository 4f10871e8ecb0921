"""The engine: how one optimizer step runs on this rank, whatever the layout.

The training loop hands the engine this rank's microbatches and the step's learning rate; the engine owns
the model part(s), the optimizer(s), gradient accumulation or the pipeline schedule, loss scaling, clipping
and the reductions that make the reported loss the mean over the global batch on every rank. The loop is
the same for every layout.

Layouts are applied from outside the model, in torchtitan's order, to each pipeline stage:
    stage cut (meta) -> FP8 Linears -> context-parallel attention -> activation checkpointing -> TP -> FSDP2
    -> compile -> materialise -> DDP -> PipelineStage
Weights are created after the layout (`init_weights` draws each parameter from a generator seeded by its
name), so every layout starts from exactly the single-process model's weights without a full copy.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from hpctrain import schedules
from hpctrain.config.layout import Layout, fills_buffer
from hpctrain.config.schema import Config, ModelConfig, OptimConfig, PrecisionConfig
from hpctrain.models import as_module, create_model
from hpctrain.models.common.moe import ROUTING_FIELDS, moe_layers
from hpctrain.models.registry import family_of
from hpctrain.parallel.clipping import clip_grads_, reduce_partial_grads_, squared_norm_share
from hpctrain.parallel.compile import apply_compile
from hpctrain.parallel.context_parallel import apply_context_parallel, shard_sequence
from hpctrain.parallel.data_parallel import (
    ExpertSharding,
    apply_ddp,
    apply_fsdp,
    apply_replicate,
    microbatch_sync,
    uses_fsdp,
)
from hpctrain.parallel.dims import ParallelDims
from hpctrain.parallel.expert_parallel import apply_ep
from hpctrain.parallel.float8 import apply_float8, register_scale_precompute
from hpctrain.parallel.grad_buffer import fill_as_made
from hpctrain.parallel.groups import own_group, tied_embedding_pairs
from hpctrain.parallel.moe_stats import MoEStepStats
from hpctrain.parallel.optimizer import build_optimizer, skip_if_found_inf, skips_on_device
from hpctrain.parallel.pipeline import build_schedule, stage_model, start_up
from hpctrain.parallel.pipeline import evaluate as evaluate_pipeline
from hpctrain.parallel.precision import LossScaler, autocast, enum_value
from hpctrain.parallel.recompute import apply_recompute
from hpctrain.parallel.tensor_parallel import apply_tp, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from hpctrain.models.family import FamilyModule


@dataclass
class StepStats:
    loss: float  # mean token loss over the global batch (the same on every rank)
    grad_norm: float  # global gradient norm before clipping, over all parallel dims
    skipped: bool = False  # fp16: a gradient overflowed, the step was skipped and the loss scale halved
    loss_scale: float = 1.0  # the scale this step's loss was multiplied by (1.0 without loss scaling)
    control: list[float] = field(default_factory=list)  # the caller's control values, summed over all ranks
    moe: MoEStepStats | None = None  # what the MoE layers' routing did (None: a dense model)
    committed: bool = True  # replica groups: False when the quorum's vote kept the state as it was (step again)


class AcrossReplicas(Protocol):
    """The outer data-parallel dimension across replica groups (hpctrain.distributed.replicas: torchft): the
    engine averages its gradients there and steps only when the group's vote says the average went through."""

    def average(self, tensors: list[torch.Tensor]) -> None: ...

    def commit(self) -> bool: ...

    def requorum(self) -> bool: ...


# A step whose average across replica groups failed is averaged again with this many new quorums (its gradients
# kept) before the caller trains the step again.
REPLICA_RETRIES = 3


class UnsupportedLayout(ValueError):
    """A combination the config checks accept but torch cannot run correctly; the message says what to use."""


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm is NaN/inf without loss scaling to absorb it: training cannot go on."""

    def __init__(self, step: int, last_good_step: int, loss: float, grad_norm: float, cause: str = "") -> None:
        self.step, self.last_good_step, self.loss, self.grad_norm = step, last_good_step, loss, grad_norm
        super().__init__(
            f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm} (last good step "
            f"{last_good_step}); the step was not applied. "
            + (f"Likely cause: {cause}. " if cause else "")
            + f"Resume from a checkpoint at or before step {last_good_step} with a lower optim.lr, a tighter "
            "optim.grad_clip or precision=fp32/bf16"
        )


def likely_cause(optim: OptimConfig, precision: PrecisionConfig, lr: float, grad_norm: float) -> str:
    """The usual suspects, in the order they are worth checking (the design article's section 5.1)."""
    if optim.grad_clip <= 0:
        return "gradient clipping is disabled (optim.grad_clip=0), so one bad batch can blow up the weights"
    if enum_value(precision.dtype) == "fp16":
        return "an fp16 overflow the loss scaler did not catch"
    if math.isfinite(grad_norm):
        return f"the loss overflowed with a finite gradient norm: look at the data of this step (lr {lr:g})"
    return f"the learning rate ({lr:g} at this step) is too high for this batch, or the data holds a bad sample"


def build_model(model_cfg: ModelConfig, seed: int, device: torch.device, tp: int = 1) -> FamilyModule:
    """The single-process model of model.arch: built on meta, then materialised (no layout)."""
    with torch.device("meta"):
        model = create_model(model_cfg, tp)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model


def token_loss(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy over the real vocabulary (the padding columns past `vocab_size` left out), on the
    logits as the model hands them: under TP a DTensor split by vocabulary, whose loss is computed on the shards
    (tensor_parallel.vocab_parallel_cross_entropy; one path for every layout, one process included)."""
    return vocab_parallel_cross_entropy(logits, targets, logits.shape[-1] if vocab_size is None else vocab_size)


class Engine:
    """Every layout (DP/ZeRO/HSDP x TP(+SP) x PP x CP) behind one step()."""

    def __init__(
        self,
        cfg: Config,
        layout: Layout,
        device: torch.device,
        dims: ParallelDims | None = None,
        tensors: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        """`dims`: a mesh built already (default: this world's); `tensors`: the context the engine's tensors
        are made in (hpctrain.simulate's fake tensor mode). The layout is applied on the meta device outside
        it: meshes and process groups are host-side bookkeeping, and a fake tensor mode cannot run them."""
        self.cfg, self.layout, self.device = cfg, layout, device
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.dims = dims or ParallelDims(layout, world, device.type)
        dims = self.dims
        self.dp_rank, self.dp_size = dims.dp_rank, dims.dp
        self.cp_rank = dims.cp_rank  # read by every step; the mesh's coordinates are host reads: taken once here
        # the mean losses the step's reduction sums: one per DP rank, TP peer and CP part of the sequences
        self.loss_copies = dims.dp * dims.tp * dims.cp
        # Dropout masks: different per DP rank, the same on TP peers (their replicated regions must agree).
        torch.manual_seed(cfg.train.seed + self.dp_rank)
        # CP ranks hold other parts of the same sequences: their gradients are averaged as DP ranks' are
        data_parallel = dims.distributed and dims.dp * dims.cp > 1
        self.fsdp = data_parallel and uses_fsdp(layout.zero_stage, dims.tp, dims.pp, dims.ep)
        self.ddp = data_parallel and not self.fsdp
        self.pipeline_schedule = schedules.get(layout.schedule)
        if self.fsdp and layout.zero_stage > 0 and self.pipeline_schedule.split_backward and dims.pp > 1:
            raise UnsupportedLayout(
                f"parallel.schedule={layout.schedule} with zero.stage={layout.zero_stage} and dp={dims.dp}: "
                "zero-bubble schedules compute weight gradients in a separate pass, and with FSDP2-sharded "
                "parameters torch 2.13 loses some of them (the tied embedding's gradient comes back empty, the "
                "others wrong). Use zero.stage=0 (replicated DP works with these schedules) or "
                "parallel.schedule=interleaved_1f1b"
            )

        with torch.device("meta"):
            full = create_model(cfg.model, layout.tp)
        self.tied_embeddings = full.tied_embeddings
        self.stage_ids = (
            self.pipeline_schedule.stage_ids(dims.pp_rank, dims.pp, dims.virtual_stages) if dims.pp > 1 else [0]
        )
        # the model module of each part (inside DDP when DDP wraps it), its layout applied on the meta device
        self.split = layout.layer_split(cfg.model.n_layers)
        self.stage_models: list[FamilyModule] = [
            self._apply_layout(stage_model(full, sid, self.split) if dims.pp > 1 else full) for sid in self.stage_ids
        ]
        self.pp_group = dims.pp_mesh.get_group() if dims.pp > 1 else None
        self._embedding_group = self._tied_embedding_group() if dims.pp > 1 and self.tied_embeddings else None
        self.has_first = 0 in self.stage_ids
        self.has_last = dims.n_stages - 1 in self.stage_ids
        # MoE layers this rank holds, by block index; every rank reduces a routing record for every layer
        self.moe_layers = {i: layer for m in self.stage_models for i, layer in moe_layers(as_module(m)).items()}
        self.routing_width = ROUTING_FIELDS + cfg.model.moe.n_experts if family_of(cfg.model).moe else 0
        with tensors or contextlib.nullcontext():
            self.model_parts: list[nn.Module] = [self._materialise(model) for model in self.stage_models]
            self.optimizers = [self._optimizer(part) for part in self.model_parts]
            register_scale_precompute(self.optimizers, self.model_parts)  # FP8 weight scales after each step
            self.scaler = LossScaler(cfg.precision)
            self.schedule = None
            if dims.pp > 1:
                stages = [
                    PipelineStage(part, sid, dims.n_stages, device, group=self.pp_group)
                    for part, sid in zip(self.model_parts, self.stage_ids)
                ]
                self.schedule = build_schedule(stages, layout.schedule, layout.microbatches, self._pipeline_loss)
        # ZeRO-1's gradient buffer filled as gradients are made (grad_buffer): the accumulation loop arms it
        self.buffer_fill = fill_as_made(self.model_parts[0], self.tied_embeddings) if fills_buffer(layout) else None
        self.model: nn.Module | list[nn.Module] = (
            self.model_parts[0] if len(self.model_parts) == 1 else self.model_parts
        )
        for layer in self.moe_layers.values():  # DDP's settling forward is no training step
            layer.take_routing()
        self.vocab_size = int(cfg.model.vocab_size)
        self.ranks_per_stage = dims.world_size // dims.pp
        self.steps_on_host = self.device.type != "cpu" and any(
            p.device.type == "cpu" for opt in self.optimizers for group in opt.param_groups for p in group["params"]
        )
        self.steps_done = 0
        self.last_good_step = 0
        # What must finish before the optimizer changes the state: a checkpoint's copy of it, which runs while
        # the step's forward and backward do (set by the loop: CheckpointManager.wait_for_staging).
        self.before_update: Callable[[], None] = lambda: None
        # recovery=replicas: the groups' gradient average and commit vote (set by the loop; None: one group)
        self.replicas: AcrossReplicas | None = None

    # ---- construction -------------------------------------------------------------------------------------

    def _apply_layout(self, model: FamilyModule) -> FamilyModule:
        """FP8, context parallelism, recomputation, TP, FSDP2 and compilation on the meta-device model (no memory
        yet)."""
        cfg, dims, module = self.cfg, self.dims, as_module(model)
        apply_float8(module, cfg.precision, self.layout, self.device, self.fsdp)  # FP8 Linears first (torchtitan)
        if dims.cp > 1:  # the attention core; recomputation then replays (or, selective, keeps) its gathers
            apply_context_parallel(module, dims.cp_mesh.get_group())
        # Checkpointing first: TP's input hook on the first block must run inside the checkpointed region,
        # or recomputation replays it on already-sharded input.
        apply_recompute(model, self.layout.recompute)
        if dims.tp > 1:
            keep_shards = self.layout.sp_keeps_shards and not cfg.parallel.compile
            apply_tp(model, dims.tp_mesh, self.layout.sequence_parallel, keep_shards)
        experts = None
        if dims.ep > 1:
            apply_ep(module, dims.ep_mesh)
            experts = ExpertSharding(dims.expert_fsdp_mesh)
        if self.fsdp:
            if self.layout.zero_stage == 0:
                apply_replicate(model, dims.grad_mesh, cfg.precision, experts)
            else:
                apply_fsdp(model, dims.fsdp_mesh, cfg.zero, cfg.precision, self.layout.zero_stage, experts)
        if cfg.parallel.compile:  # forwards only: every layout's hooks stay outside the graphs
            apply_compile(model, self.layout.recompute, dims.tp)
        return model

    def _materialise(self, model: FamilyModule) -> nn.Module:
        """The weights, in their layout, on their device (the host with FSDP2's offload); DDP wraps last."""
        cfg, dims = self.cfg, self.dims
        offload = self.layout.offload_optimizer or self.layout.offload_params
        model.to_empty(device=torch.device("cpu") if self.fsdp and offload else self.device)
        model.init_weights(seed=cfg.train.seed)
        module = as_module(model)
        return apply_ddp(module, dims.grad_mesh, cfg.zero, cfg.precision) if self.ddp else module

    def _optimizer(self, part: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(
            part.parameters(), self.cfg.optim, self.cfg.zero, dist.get_rank() if dist.is_initialized() else 0
        )

    def _tied_embedding_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the first or last stage with this rank's DP/TP coordinates (None: one rank has both)."""
        pp = self.dims.pp
        last_rank = next(
            r
            for r in range(pp)
            if self.dims.n_stages - 1 in self.pipeline_schedule.stage_ids(r, pp, self.dims.virtual_stages)
        )
        if last_rank == 0:
            return None
        if pp == 2:
            return self.pp_group
        return own_group(tied_embedding_pairs(self.dims.rank_grid, last_rank))

    # ---- one optimizer step -------------------------------------------------------------------------------

    def step(self, batches: torch.Tensor, lr: float, control: list[float] | tuple[float, ...] = ()) -> StepStats:
        """One optimizer step over this rank's microbatches: `batches` is [2 (inputs, targets), microbatches,
        micro_batch, seq].

        `control` rides along with the step's only reduction over all ranks (loss and gradient norm share
        one small float64 tensor on this rank's device): StepStats.control holds its sum over every rank.
        That is the whole per-step control plane: stop signals, checkpoint agreement and health probes
        cost no collective of their own."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        scale = self.scaler.scale
        inputs, targets = self._to_device(batches)
        # The MoE auxiliary losses' gradient, as if added to each micro-batch's (scaled) loss: the accumulation
        # averages micro-batch losses here, a pipeline schedule divides the gradients by their number itself.
        for layer in self.moe_layers.values():
            layer.aux_grad_scale = scale if self.schedule is not None else scale / inputs.shape[0]
        if self.schedule is not None:
            local_loss = self._pipeline_step(inputs, targets, scale)
        else:
            local_loss = self._accumulate(inputs, targets)
        self._sync_tied_embeddings()
        params: list[torch.Tensor] = [p for part in self.model_parts for p in part.parameters()]
        committed = True
        if self.replicas is not None:
            local_loss, committed = self._across_replicas(self.replicas, params, local_loss)
        self.scaler.unscale_(params)
        values = self._reduce(local_loss, control)
        if not committed:  # the state stays as it was; the caller takes this step again
            read = self._read(values)
            self._zero_grad()
            loss, grad_norm, agreed, _ = self._stats(read, len(control))
            return StepStats(
                loss=loss, grad_norm=grad_norm, skipped=True, loss_scale=scale, control=agreed, committed=False
            )
        self.steps_done += 1
        # Fused AdamW skips a non-finite step on the device (`found_inf`): the step is queued before the host
        # reads the reduced values, the step's one sync. Optimizers that cannot skip there (NVMe offload's,
        # foreach ones) are stepped after the read, and only when it says finite.
        # An optimizer stepping on the host while the step runs on a GPU (FSDP2's CPU offload, NVMe) is stepped
        # after the read, by the values read: a device value copied to the host without a sync has not landed.
        queued = not self.steps_on_host and all(skips_on_device(opt) for opt in self.optimizers)
        if queued:
            self._optimizer_step(params, values, found_inf=(~values[:2].isfinite().all()).float())
        read = self._read(values)
        loss, grad_norm, agreed, routing = self._stats(read, len(control))
        finite = math.isfinite(grad_norm) and math.isfinite(loss)
        if not finite and not self.scaler.enabled:
            self._zero_grad()
            raise TrainingDiverged(
                self.steps_done,
                self.last_good_step,
                loss,
                grad_norm,
                likely_cause(self.cfg.optim, self.cfg.precision, lr, grad_norm),
            )
        if finite and not queued:
            on_host = torch.tensor(read, dtype=torch.float64) if self.steps_on_host else values
            self._optimizer_step(params, on_host, found_inf=None)
        self.scaler.update(overflow=not finite)
        self._zero_grad()
        if finite:
            self.last_good_step = self.steps_done
        return StepStats(
            loss=loss,
            grad_norm=grad_norm,
            skipped=not finite,
            loss_scale=scale,
            control=agreed,
            moe=self._moe_stats(routing, inputs.shape[0]),
        )

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean token loss over validation batches (each shaped as step's), the same on every rank: forward
        only, dropout off, and one all-reduce of one number for the whole evaluation."""
        for part in self.model_parts:
            part.eval()
        try:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for batch in batches:
                inputs, targets = self._to_device(batch)
                total += self._eval_loss(inputs, targets)
        finally:
            for part in self.model_parts:
                part.train()
            for layer in self.moe_layers.values():  # a pipeline's evaluation may run a forward with grad on
                layer.take_routing()
        self._sum_over_ranks(total)
        return total.item() / (self.loss_copies * len(batches))

    def _eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's mean loss over one batch's microbatches (0 on pipeline ranks without the last stage)."""
        with autocast(self.cfg.precision, self.device, not self.fsdp):
            if self.schedule is None:
                model = self.model_parts[0]
                losses = [token_loss(model(x), y, self.vocab_size) for x, y in zip(inputs, targets)]
            else:
                losses = []
                kwargs: dict[str, Any] = dict(target=targets.flatten(0, 1), losses=losses) if self.has_last else {}
                evaluate_pipeline(
                    self.schedule,
                    self.pipeline_schedule.placement,
                    (inputs.flatten(0, 1),) if self.has_first else (),
                    **kwargs,
                )
                losses = [loss / self.scaler.scale for loss in losses]  # _pipeline_loss scaled them
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([loss.detach().double() for loss in losses]).mean()

    def _to_device(self, batches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[2, microbatches, micro_batch, seq] inputs and targets on the device: one copy, asynchronous from
        the data reader's pinned buffer on GPUs (hpctrain.data.loader.BatchReader); with context parallelism
        this rank's two chunks of every sequence (CP peers read the same samples)."""
        both = batches.to(self.device, non_blocking=True)
        if self.dims.cp > 1:
            both = shard_sequence(both, self.dims.cp, self.cp_rank, dim=-1)
        return both[0], both[1]

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model = self.model_parts[0]
        total = torch.zeros((), device=self.device)
        n = inputs.shape[0]
        for i in range(n):
            with self._grad_sync(model, i == n - 1), autocast(self.cfg.precision, self.device, not self.fsdp):
                loss = token_loss(model(inputs[i]), targets[i], self.vocab_size)
            if self.buffer_fill is not None:
                self.buffer_fill.arm()
            self.scaler.scale_loss(loss / n).backward()
            total += loss.detach()
        return total / n

    def _grad_sync(self, model: nn.Module, last: bool) -> Any:
        """DDP reduces after the last accumulation microbatch only; FSDP2 as its ZeRO stage says
        (data_parallel.microbatch_sync)."""
        if self.ddp and not last:
            return model.no_sync()  # type: ignore[operator]  # DDP's
        if self.fsdp:  # fully_shard made the model an FSDPModule
            microbatch_sync(model, self.layout.zero_stage, self.layout.accumulate_unsharded, last)  # type: ignore[arg-type]
        return contextlib.nullcontext()

    def _pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(token_loss(output, target, self.vocab_size))

    def start_pipeline(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The schedule's start-up (pipeline.start_up) on the step's first micro-batch (`inputs`/`targets`: the
        step's [microbatches, micro_batch, seq]); what its forward routed is no training. torch runs it before the
        first step and again after each evaluation (a switch between eval and train); a no-op otherwise."""
        with autocast(self.cfg.precision, self.device, not self.fsdp):
            start_up(self.schedule, (inputs[0],) if self.has_first else (), targets[0] if self.has_last else None)
        for layer in self.moe_layers.values():
            layer.take_routing()

    def _pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
        """All microbatches through the pipeline in one schedule step; the loss lives on the last stage."""
        self.start_pipeline(inputs, targets)
        x, y = inputs.flatten(0, 1), targets.flatten(0, 1)
        args = (x,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = dict(target=y, losses=losses) if self.has_last else {}
        assert self.schedule is not None  # a pipeline's step
        with autocast(self.cfg.precision, self.device, not self.fsdp):
            self.schedule.step(*args, return_outputs=False, **kwargs)
        if not self.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean() / scale

    @torch.no_grad()
    def _sync_tied_embeddings(self) -> None:
        """Sum the tied token embedding's gradient over the first and last stage (input lookup + output head)."""
        if self.schedule is None or not self.tied_embeddings:
            return
        grads = [_local(_grad_as_param(m.tok_emb.weight)) for m in self.stage_models if m.tok_emb is not None]
        if not grads:
            return
        total = grads[0].clone() if len(grads) == 1 else torch.stack(grads).sum(0)
        if self._embedding_group is not None:
            dist.all_reduce(total, group=self._embedding_group)
        for grad in grads:
            grad.copy_(total)

    def _across_replicas(
        self, replicas: AcrossReplicas, params: list[torch.Tensor], local_loss: torch.Tensor
    ) -> tuple[torch.Tensor, bool]:
        """Average this rank's gradients and loss with the same rank of every group in the step's quorum (the
        groups' layouts are the same: their local shards line up), then the group's vote: (the averaged loss,
        whether the step may change the state). Every rank of every group passes the same tensors in the same
        order, a missing gradient (a parameter this step did not use) the same everywhere."""
        loss = (
            local_loss.detach().double().reshape(1)
            if self.has_last
            else torch.zeros(1, dtype=torch.float64, device=self.device)
        )
        grads = [p.grad for p in params if p.grad is not None] + [loss]
        replicas.average(grads)
        committed = replicas.commit()
        for _ in range(REPLICA_RETRIES):  # a group lost during the average: the next quorum, the same gradients
            if committed or not replicas.requorum():
                break
            replicas.average(grads)
            committed = replicas.commit()
        return loss.reshape(()), committed

    def _norm_params(self) -> list[torch.Tensor]:
        """Each parameter once per pipeline: the tied embedding's copy on a stage that does not embed (the last,
        where it is the head) is left out."""
        return [
            p
            for m in self.stage_models
            for name, p in m.named_parameters()
            if not (name == "tok_emb.weight" and not m.embeds)
        ]

    def _reduce(self, local_loss: torch.Tensor, control: list[float] | tuple[float, ...]) -> torch.Tensor:
        """The step's one reduction over all ranks: [loss, squared-norm share, *control] summed on the default
        group, in float64 on this rank's device, left there (`_stats` reads it)."""
        reduce_partial_grads_(p for part in self.model_parts for p in part.parameters())
        share = squared_norm_share(self._norm_params(), self.ranks_per_stage, self.device)
        loss = (
            local_loss.detach().double() if self.has_last else torch.zeros((), dtype=torch.float64, device=self.device)
        )
        values = torch.cat(
            [
                torch.stack([loss, share]),
                torch.tensor(list(control), dtype=torch.float64).to(self.device, non_blocking=True),
                self._routing(),
            ]
        )
        self._sum_over_ranks(values)
        return values

    def _routing(self) -> torch.Tensor:
        """The step's routing records of every MoE layer of the model (zeros for the layers other stages hold),
        one float64 vector on this rank's device: they ride the step's one reduction."""
        width, n_layers = self.routing_width, self.cfg.model.n_layers
        out = torch.zeros(n_layers * width, dtype=torch.float64, device=self.device)
        for i, layer in self.moe_layers.items():
            record = layer.take_routing()
            if record is not None:
                out[i * width : (i + 1) * width] = record
        return out

    def _update_router_bias(self, values: torch.Tensor, found_inf: torch.Tensor | None) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: each sigmoid router's bias moves by the step's token counts
        over the global batch (the tail of the reduced `values`, the same on every rank), on the device; not on
        a skipped step (`found_inf` 1.0), which leaves the whole state as it was."""
        width = self.routing_width
        routing = values[values.numel() - width * self.cfg.model.n_layers :]
        for i, layer in self.moe_layers.items():
            if layer.expert_bias is not None:
                layer.update_bias(routing[i * width : (i + 1) * width - ROUTING_FIELDS], skipped=found_inf)

    def _moe_stats(self, routing: list[float], microbatches: int) -> MoEStepStats | None:
        """The reduced routing records as the user sees them: TP peers routed the same tokens (counted once),
        the losses averaged over layers, micro-batches and data-parallel ranks."""
        if not self.routing_width:
            return None
        copies, width = self.dims.tp, self.routing_width
        layers = [[v / copies for v in routing[i : i + width]] for i in range(0, len(routing), width)]
        runs = len(layers) * microbatches * self.dims.dp
        return MoEStepStats(
            tokens_per_expert=[layer[:-ROUTING_FIELDS] for layer in layers],
            balance_loss=sum(layer[-3] for layer in layers) / runs,
            z_loss=sum(layer[-2] for layer in layers) / runs,
            dropped=sum(layer[-1] for layer in layers),
        )

    def _optimizer_step(self, params: list[torch.Tensor], values: torch.Tensor, found_inf: torch.Tensor | None) -> None:
        """Clip with the coefficient computed on the device from the reduced squared norm, then step every
        optimizer and move the sigmoid routers' biases; `found_inf` (1.0: the step is not finite) makes fused
        kernels, and the biases, leave everything untouched. All after `before_update`: the bias is state a
        checkpoint's copy holds, as the weights are."""
        self.before_update()
        clip_grads_(params, self.cfg.optim.grad_clip, values[1])
        for opt in self.optimizers:
            skip_if_found_inf(opt, found_inf)
            opt.step()
            skip_if_found_inf(opt, None)
        self._update_router_bias(values, found_inf)

    def _stats(self, read: list[float], n_control: int) -> tuple[float, float, list[float], list[float]]:
        """The reduced values read on the host: loss (the mean over the global batch: the last-stage ranks' losses
        averaged over DP x TP copies and CP parts, each CP rank's the mean over its seq/cp tokens of every
        sequence), the global gradient norm, the summed control values and routing records."""
        total_loss, squared_norm, *rest = read
        return (
            total_loss / self.loss_copies,
            math.sqrt(squared_norm) if squared_norm >= 0 else math.nan,
            rest[:n_control],
            rest[n_control:],
        )

    @staticmethod
    def _read(values: torch.Tensor) -> list[float]:
        """The step's one host sync, after the optimizer step is queued where it can skip on the device (the
        control values decide stop signals and checkpoints: every step needs them). hpctrain.simulate's fake
        tensors have no values and override it."""
        return values.tolist()

    @staticmethod
    def _sum_over_ranks(values: torch.Tensor) -> None:
        """All-reduce on the default group whenever there is one, a world of one rank included: a one-GPU run
        then takes the multi-GPU path (its device tensor on NCCL), so nothing is left for a second GPU to show."""
        if dist.is_initialized():
            dist.all_reduce(values)

    def _zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    # ---- checkpoints --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter name, the same in every layout (DCP reshards).

        Model parts of one rank (virtual stages) are merged into one dict, as torchtitan's containers do.
        The optimizer's hyperparameters are configuration, not state (the learning rate is set every step
        from the schedule, the rest from `optim`): left out, they would otherwise be 11 pickled entries per
        parameter for AdamW, 73% of a checkpoint's entries and most of the time a load takes to read it.
        """
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.optimizers):  # both at once: torch maps the names once
            part_model, part_optim = get_state_dict(part, opt, options=opts)
            model.update(part_model)
            optim.update(_without_hyperparameters(part_optim))
        state: dict[str, Any] = {"model": model, "optim": optim}
        if self.scaler.enabled:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set a loaded state. A checkpoint loads into `state_dict()`'s tensors, which are this rank's parameters
        and optimizer states themselves: when every one of them was loaded that way, the state is already set,
        and torch's setters would only copy each tensor onto itself (and map every name again: a tenth of a
        resume's time on a 92M-parameter model). Any other state (tensors of its own, a part not loaded in
        place) goes through `set_model_state_dict` and `set_optimizer_state_dict`."""
        if self.scaler.enabled and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
        if _loaded_in_place(state, self.model_parts, self.optimizers):
            return
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=len(self.model_parts) == 1)
        for part, opt in zip(self.model_parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=opts)
            own = get_optimizer_state_dict(part, opt, options=opts)  # this run's hyperparameters, by parameter
            loaded = _without_hyperparameters(state["optim"])  # an older checkpoint read whole: this run's win
            set_optimizer_state_dict(part, opt, {**loaded, **_hyperparameters(own)}, options=opts)


PARAM_GROUPS = "param_groups."  # how a flattened optimizer state dict names the hyperparameters' entries


def _hyperparameters(flat: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flat.items() if k.startswith(PARAM_GROUPS)}


def _without_hyperparameters(flat: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flat.items() if not k.startswith(PARAM_GROUPS)}


def _memory(t: Any) -> tuple[int, int, int] | None:
    """Where a tensor's elements lie (address, count, element size); None for a value without plain memory (not a
    tensor, or a subclass wrapping others, as FP8's weights are)."""
    if not isinstance(t, torch.Tensor):
        return None
    t = _local(t)
    if type(t) not in (torch.Tensor, nn.Parameter):
        return None
    return t.data_ptr(), t.numel(), t.element_size()


def _loaded_in_place(state: dict[str, Any], parts: list[nn.Module], optimizers: list[Any]) -> bool:
    """Every tensor of `state` is one of this rank's parameters, buffers or optimizer states, and every
    parameter and optimizer state is one of them: a load into it has set the engine's whole state."""
    live = {_memory(p) for part in parts for p in part.parameters()}
    live |= {
        _memory(v)
        for opt in optimizers
        for per_param in opt.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    }
    buffers = {_memory(b) for part in parts for b in part.buffers()}
    loaded = {_memory(v) for key in ("model", "optim") for v in state[key].values()}
    return None not in live and None not in loaded and live <= loaded <= live | buffers


def _grad_as_param(p: torch.Tensor) -> torch.Tensor:
    """The gradient in its parameter's placements (TP's embedding backward returns a replicated gradient for
    a vocabulary-sharded weight; the two stages' copies must line up element for element)."""
    g = p.grad
    assert g is not None  # after the step's backward
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build_engine(cfg: Config, layout: Layout, device: torch.device) -> Engine:
    """The single entry point the training loop uses, for every layout the config checks accept."""
    return Engine(cfg, layout, device)
