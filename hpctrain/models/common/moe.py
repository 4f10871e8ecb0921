"""A Mixture-of-Experts feed-forward block that knows nothing of parallelism: a router picks top_k of n_experts
SwiGLU experts per token, optionally plus shared experts every token goes through.

Two routers:
- "softmax" (Mixtral, Qwen3-MoE): softmax over all experts in fp32, the top_k, renormalised when norm_topk_prob.
- "sigmoid" (DeepSeek-V3): sigmoid scores in fp32; a per-expert bias (a buffer, moved by `update_bias`, the
  auxiliary-loss-free balancing) is added only to choose experts; group-limited: the experts are split into
  n_groups groups, a group scores the sum of its two best biased scores, the topk_groups best groups are kept and
  the top_k experts are chosen among them. The combine weights are the chosen experts' unbiased scores.
Both multiply the weights by route_scale.

The experts' weights are stacked, [n_experts, ...] in three parameters (`experts.w_gate`, `w_up`, `w_down`), so one
grouped GEMM per projection runs every expert (`torch._grouped_mm`, where it has a fast kernel) and expert
parallelism can shard dim 0. Tokens are routed dropless by default: the (token, slot) assignments are sorted by
expert, so each expert's tokens form one contiguous segment of the sorted rows. With capacity_factor > 0 each
expert keeps at most ceil(capacity_factor * tokens * top_k / n_experts) assignments, those with the highest router
weight (ties: token order); a dropped assignment contributes nothing (the others' weights are not renormalised).
The shapes stay static (no host sync): the dropped assignments are sorted after the kept ones, outside every
expert's count, and weighted zero.

On fake tensors (hpctrain.simulate) no routing has values: the load is taken as balanced (`balanced`): the split
sizes expert parallelism reads on the host are those of an even routing (which a capacity of 1 or more keeps
whole), and the experts run the path an H100 runs (`grouped_mm_serves`).

Hugging Face equivalents (transformers 5): router.weight is `mlp.gate.weight`; the in-memory fused experts are
`gate_up_proj` = cat(w_gate, w_up, dim=1) and `down_proj` = w_down; on disk (what save_pretrained writes back)
expert e is `experts.{e}.w1/w3/w2.weight` (Mixtral) or `experts.{e}.gate_proj/up_proj/down_proj.weight` (Qwen3-MoE,
DeepSeek-V3): w_gate[e], w_up[e], w_down[e]. DeepSeek-V3's bias is `mlp.gate.e_score_correction_bias`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from hpctrain.models.common.host_reads import record_host_read, replayed_host_read
from hpctrain.models.common.init import assign_param, stable_hash

GROUP_ROWS = 8  # grouped GEMM: each expert's rows padded to a multiple (16 bytes of bf16), at least one multiple


def balanced(total: int, parts: int) -> list[int]:
    """`total` rows split over `parts` as evenly as they go: the load a routing without values (fake tensors) is
    taken to have."""
    quotient, remainder = divmod(total, parts)
    return [quotient + (i < remainder) for i in range(parts)]


@dataclass(frozen=True)
class MoEArgs:
    d_model: int
    expert_hidden: int  # each expert's SwiGLU hidden size
    n_experts: int
    top_k: int
    router: str = "softmax"  # "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the top_k weights to sum 1 (Mixtral and DeepSeek-V3 always do)
    n_groups: int = 1  # sigmoid router: expert groups ...
    topk_groups: int = 1  # ... of which each token may use the best topk_groups
    route_scale: float = 1.0  # combine weights multiplied by it (DeepSeek-V3: 2.5)
    n_shared_experts: int = 0  # a SwiGLU of n_shared_experts * expert_hidden every token goes through
    capacity_factor: float = 0.0  # 0: dropless
    bias_update_rate: float = 1e-3  # sigmoid router: update_bias's step
    balance_coef: float = 0.0  # the load-balancing loss's weight in the training loss (forward attaches it)
    z_loss_coef: float = 0.0  # the router z-loss's weight

    def __post_init__(self) -> None:
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', not {self.router!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, n_experts = {self.n_experts}]")
        if self.n_groups < 1 or self.n_experts % self.n_groups or not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(
                f"n_groups {self.n_groups} must divide n_experts {self.n_experts} and "
                f"topk_groups {self.topk_groups} be in [1, n_groups]"
            )
        if self.n_groups > 1:
            group_size = self.n_experts // self.n_groups
            if self.router != "sigmoid" or group_size < 2 or self.top_k > self.topk_groups * group_size:
                raise ValueError(
                    "expert groups need the sigmoid router, at least 2 experts a group (a group "
                    "scores its top 2) and top_k <= topk_groups * experts per group"
                )
        if self.capacity_factor < 0:
            raise ValueError(f"capacity_factor must be >= 0, not {self.capacity_factor}")

    def capacity(self, tokens: int) -> int:
        """The most (token, slot) assignments one expert takes from `tokens` tokens (capacity_factor > 0)."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)


@dataclass
class MoEStats:
    """What one forward reports next to its output. The losses keep their graph (the model adds them to its loss,
    scaled as it likes); the counts are plain integers (no graph)."""

    tokens_per_expert: torch.Tensor  # int64 [n_experts]: assignments routed to each expert, before capacity drops
    balance_loss: torch.Tensor  # fp32 scalar: Switch/Mixtral load balancing, n_experts * sum_e f_e * P_e
    z_loss: torch.Tensor  # fp32 scalar: ST-MoE router z-loss, mean over tokens of logsumexp(logits)^2
    dropped: torch.Tensor  # int64 scalar: assignments dropped for capacity (0 when dropless)


@contextlib.contextmanager
def full_fp32_matmul(device_type: str) -> Iterator[None]:
    """fp32 matmuls run in fp32 inside: not in TF32, which hpctrain.parallel.precision sets for GPUs (matmul
    precision "high"), nor in autocast's dtype; both restored after. Eager only: dynamo traces neither the
    precision's getter nor its setter, and the MoE families do not compile (hpctrain.checks.config)."""
    before = torch.get_float32_matmul_precision()
    no_autocast = (
        torch.autocast(device_type, enabled=False)
        if torch.amp.is_autocast_available(device_type)
        else contextlib.nullcontext()
    )
    torch.set_float32_matmul_precision("highest")
    try:
        with no_autocast:
            yield
    finally:
        torch.set_float32_matmul_precision(before)


class SwiGLU(nn.Module):
    """The shared experts: Llama's MLP (same names: gate, up, proj) of a given hidden size."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.silu(self.gate(x)) * self.up(x))
        return out


def grouped_mm_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs its fast kernel for rows `x` [N, d] and stacked weights `weight`
    [n_experts, out, in]: torch 2.13 (aten/src/ATen/native/cuda/GroupedBlas.cpp, `_grouped_mm_cuda`) takes the
    CUTLASS path only for bf16 operands on compute capability 9.x/10.x (H100/H200, B200); elsewhere it falls back
    to a loop of mm that copies the offsets to the host, no better than ours. Its TMA loads need every row stride
    16-byte aligned (d_model and expert_hidden multiples of 8 in bf16), and its meta function (torch.compile, fake
    tensors) accepts only bf16. Reads only metadata. Fake tensors on the CPU (hpctrain.simulate) take the path an
    H100 would."""
    if weight.dim() != 3 or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    align = 16 // x.element_size()
    if x.shape[-1] % align or weight.shape[-1] % align or weight.shape[-2] % align:
        return False
    if is_fake(x) and x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or weight.device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (9, 10)


def _fake_host_read(values: torch.Tensor) -> None:
    """The host read of sizes that fake tensors cannot give (the caller assumes an even routing instead), made
    all the same: a blocking copy to the host, the GPU's sync that fake CUDA counts; replayed, as the real read
    is, in a recomputation (none there)."""
    if replayed_host_read() is None:
        record_host_read(values.cpu())


def run_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    grouped: bool | None = None,
) -> torch.Tensor:
    """Rows `x` [N, d] sorted by expert, counts[e] of them for expert e -> each row through its expert's SwiGLU,
    [N, d]. The rows past sum(counts) (what a capacity drops) are no expert's: the caller weights their output
    zero (the loop leaves it zero, the grouped GEMM runs them in the last expert's padding, which it computes
    anyway). One grouped GEMM per projection where `grouped_mm_serves` (or `grouped`=True), else a loop over the
    experts' segments (which reads the counts on the host; a recomputation replays the forward's read).

    Under autocast the operands are cast to its dtype first, as autocast casts a matmul's: with fp32 parameters
    (one GPU, DDP: no FSDP2 mixed precision) the grouped GEMM then serves as with bf16 ones."""
    if torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w_gate, w_up, w_down = (t if t.dtype == torch.float64 else t.to(dtype) for t in (x, w_gate, w_up, w_down))
    if grouped is None:
        grouped = grouped_mm_serves(x, w_gate)
    if grouped:
        return _experts_grouped(x, counts, w_gate, w_up, w_down)
    if is_fake(counts):
        _fake_host_read(counts)
        sizes = balanced(x.shape[0], counts.numel())
    else:
        sizes = replayed_host_read() or record_host_read(counts.tolist())
    dropped = x.shape[0] - sum(sizes)
    outs = [
        F.linear(F.silu(F.linear(xe, wg)) * F.linear(xe, wu), wd)  # zip ends with the experts: not the dropped
        for xe, wg, wu, wd in zip(torch.split(x, [*sizes, dropped]), w_gate, w_up, w_down)
    ]
    return torch.cat([*outs, x.new_zeros(dropped, w_down.shape[1])] if dropped else outs)


def _experts_grouped(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """run_experts with torch._grouped_mm, without a host sync. Each expert's segment is padded with zero rows to
    a multiple of GROUP_ROWS, at least GROUP_ROWS (torchtitan does the same): CUTLASS's grouped GEMM hung in the
    backward on an empty group (pytorch issue 152668, the weight gradient's K = 0). The padded rows sit in a
    buffer of static size N + GROUP_ROWS * n_experts, the last expert's group running to its end, so that every
    output row is written (_grouped_mm leaves rows past offs[-1] uninitialised). The rows no expert has (past
    sum(counts)) go to that tail, after the last expert's padding: it has room for them, as each expert pads by
    at most GROUP_ROWS."""
    n, n_experts = x.shape[0], counts.numel()
    rows = n + GROUP_ROWS * n_experts
    padded = (counts.clamp(min=1) + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    ends = padded.cumsum(0)
    offs = torch.cat((ends[:-1], ends.new_full((1,), rows))).to(torch.int32)
    counts = torch.cat((counts, (n - counts.sum()).view(1)))  # the rows of no expert, as one more segment
    starts = torch.cat((ends - padded, ends[-1:]))  # each segment's padded start
    expert_of_row = torch.repeat_interleave(torch.arange(n_experts + 1, device=x.device), counts, output_size=n)
    shift = starts - (counts.cumsum(0) - counts)  # padded start - packed start, per segment
    dest = torch.arange(n, device=x.device) + shift[expert_of_row]
    xp = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x)
    hidden = F.silu(torch._grouped_mm(xp, w_gate.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
        xp, w_up.transpose(-2, -1), offs=offs
    )
    return torch._grouped_mm(hidden, w_down.transpose(-2, -1), offs=offs)[dest]


class GroupedExperts(nn.Module):
    """n_experts SwiGLUs, their weights stacked on dim 0: forward(rows sorted by expert, counts per expert) -> each
    row through its expert.

    Under expert parallelism (hpctrain.parallel.expert_parallel) the weights are DTensors sharded on dim 0 over the
    EP mesh and `ep_group` is set: the rows are sent to the rank holding their expert and back with all-to-all
    (`_dispatch`). It is a module of its own so that FSDP2 can shard the experts over the DP ranks an EP group
    leaves while the rest of the block is sharded over all of them."""

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w_gate, w_up, w_down = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w_gate, self.w_up, self.w_down)
        )
        group = self.ep_group
        if group is None:
            return run_experts(rows, counts, w_gate, w_up, w_down)
        # Each EP rank's loss is its own tokens' mean and the data-parallel reduction averages over the ranks
        # holding these experts only: 1 / ep makes the gradient the global batch's mean (expert_parallel.py).
        scale = 1.0 / dist.get_world_size(group)
        return self._dispatch(group, rows, counts, *(_ScaleGrad.of(w, scale) for w in (w_gate, w_up, w_down)))

    def _dispatch(
        self,
        group: dist.ProcessGroup,
        rows: torch.Tensor,
        counts: torch.Tensor,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> torch.Tensor:
        """Expert parallelism: this rank's rows, sorted by global expert (counts [n_experts]), go to the ranks
        holding their experts (rank r holds experts r * local .. (r + 1) * local - 1), run there, and come back
        in the same order; the rows past sum(counts) (a capacity's drops) stay, their output zero. Three
        all-to-alls (the counts, the rows, the results; backward two) and one host read of the split sizes, which
        all_to_all_single needs as lists (torchtitan reads them too), replayed in a recomputation."""
        ep, local = dist.get_world_size(group), w_gate.shape[0]
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)  # [source rank, my local expert]
        per_source = received_counts.view(ep, local)
        sizes = torch.stack((counts.view(ep, local).sum(1), per_source.sum(1)))
        if is_fake(counts):  # no values: every rank sends each the same share, so receives what it sends
            _fake_host_read(sizes)
            send = receive = balanced(rows.shape[0], ep)
        else:
            send, receive = replayed_host_read() or record_host_read(sizes.tolist())
        routed = sum(send)
        received = funcol.all_to_all_single_autograd(rows[:routed], receive, send, group)
        # Rows arrive source by source, each source's sorted by expert: regroup them expert by expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(ep), per_source.flatten(), output_size=received.shape[0]
        )
        order = torch.argsort(expert_of_row, stable=True)
        out = run_experts(received[order], per_source.sum(0), w_gate, w_up, w_down)
        back = torch.zeros_like(out).index_copy(0, order, out)  # the arrival order again
        returned = funcol.all_to_all_single_autograd(back, send, receive, group)
        return F.pad(returned, (0, 0, 0, rows.shape[0] - routed)) if routed < rows.shape[0] else returned


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward, the gradient times `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None

    @classmethod
    def of(cls, x: torch.Tensor, scale: float) -> torch.Tensor:
        """`apply` with its types."""
        out: torch.Tensor = cls.apply(x, scale)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
        return out


class _AttachAuxLoss(torch.autograd.Function):
    """Megatron's MoEAuxLossAutoScaler: a tensor of the layer unchanged forward; backward, the auxiliary loss gets
    gradient `scale` (the engine's loss scale over the micro-batches it averages), as if it had been added to the
    loss. The loss a pipeline schedule sees stays the token loss, and no stage has to carry it."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None

    @classmethod
    def of(cls, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        """`apply` with its types."""
        attached: torch.Tensor = cls.apply(out, aux, scale)  # type: ignore[no-untyped-call]  # as _ScaleGrad's
        return attached


ROUTING_FIELDS = 3  # after the per-expert counts in a layer's routing record: balance loss, z-loss, dropped


class MoE(nn.Module):
    """The block: forward(x [..., d]) -> output [..., d]; `compute` also returns the MoEStats.

    forward attaches the weighted auxiliary losses to the combine weights' backward (`aux_grad_scale`, set by the
    engine each step) and adds what the micro-batch routed to `routing` (the step's record, which the engine reads and
    clears: counts per expert, then ROUTING_FIELDS sums), outside recomputation and evaluation."""

    expert_bias: torch.Tensor | None  # a buffer (register_buffer): the sigmoid router's, None for the softmax's

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        e, h, d = args.n_experts, args.expert_hidden, args.d_model
        self.router = nn.Linear(d, e, bias=False)
        self.experts = GroupedExperts(e, d, h)
        # Persistent (DeepSeek-V3's checkpoints hold it). Keep it fp32: `.to(torch.bfloat16)` on the model would
        # cast it too, and a 1e-3 step rounds away in bf16 once |bias| >= 0.5 (FSDP2's mixed precision casts
        # parameters only).
        self.register_buffer("expert_bias", torch.zeros(e) if args.router == "sigmoid" else None)
        self.shared = SwiGLU(d, args.n_shared_experts * h) if args.n_shared_experts else None
        self.aux_grad_scale = 1.0
        self.routing: torch.Tensor | None = None

    def router_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, d] -> [T, n_experts] in fp32 (input and weight cast; fp64 stays fp64), whatever the activations'
        dtype, autocast and the global matmul precision (`full_fp32_matmul`): near-ties between experts are decided
        in fp32, and the logits are what the z-loss penalises."""
        dtype = torch.promote_types(h.dtype, torch.float32)
        with full_fp32_matmul(h.device.type):
            return F.linear(h.to(dtype), self.router.weight.to(dtype))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 logits [T, E] -> (combine weights [T, top_k] fp32, chosen experts [T, top_k] int64, the
        per-expert probabilities [T, E] the balance loss averages: the softmax, or the sigmoid scores normalised
        over the experts as in DeepSeek-V3's sequence-wise balance loss)."""
        a = self.args
        if a.router == "softmax":
            probs = logits.softmax(dim=-1)
            weights, experts = probs.topk(a.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            assert self.expert_bias is not None  # the sigmoid router's
            biased = scores.detach() + self.expert_bias
            if a.n_groups > 1:
                per_group = torch.unflatten(biased, -1, (a.n_groups, -1))
                group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
                kept = group_scores.topk(a.topk_groups, dim=-1).indices
                keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
                biased = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
            experts = biased.topk(a.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if a.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * a.route_scale, experts, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, stats = self.compute(x, self.aux_grad_scale)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # not recomputing in a backward
            self._record(stats)
        return out

    @torch.no_grad()
    def _record(self, stats: MoEStats) -> None:
        record = torch.cat(
            (
                stats.tokens_per_expert.double(),
                torch.stack((stats.balance_loss.double(), stats.z_loss.double(), stats.dropped.double())),
            )
        )
        self.routing = record if self.routing is None else self.routing + record

    def take_routing(self) -> torch.Tensor | None:
        """The step's routing record so far (None: nothing routed), and a fresh one for the next step."""
        record, self.routing = self.routing, None
        return record

    def compute(self, x: torch.Tensor, aux_grad_scale: float | None = None) -> tuple[torch.Tensor, MoEStats]:
        """x [..., d] -> (output [..., d], what the routing did). aux_grad_scale: the auxiliary losses reach the
        gradients with this scale (_AttachAuxLoss), attached to the combine weights every output row goes
        through (on the output itself, the layer would return a view, which FSDP2 warns of)."""
        a = self.args
        h = x.reshape(-1, a.d_model)
        tokens = h.shape[0]
        logits = self.router_logits(h)
        weights, experts, probs = self.route(logits)

        flat = experts.flatten()  # assignment i: token i // top_k, slot i % top_k
        counts = torch.zeros(a.n_experts, dtype=torch.int64, device=h.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host sync on CUDA
        # f_e as Hugging Face's load_balancing_loss_func: assignments / tokens (sums to top_k).
        balance_loss = a.n_experts * (counts.float() / tokens * probs.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        if aux_grad_scale is not None and torch.is_grad_enabled() and (a.balance_coef > 0 or a.z_loss_coef > 0):
            aux = a.balance_coef * balance_loss + a.z_loss_coef * z_loss
            weights = _AttachAuxLoss.of(weights, aux, aux_grad_scale)

        if a.capacity_factor > 0:
            # Within an expert, highest weight first (a stable sort by weight, then a stable one by expert).
            order = torch.argsort(weights.detach().flatten(), descending=True, stable=True)
            order = order[torch.argsort(flat[order], stable=True)]
            capacity = a.capacity(tokens)
            seg_start = counts.cumsum(0) - counts
            rank = torch.arange(order.numel(), device=h.device) - seg_start[flat[order]]
            # Static shapes, so no host sync (a boolean mask's nonzero would be one): the dropped assignments
            # sorted after the kept ones, outside every expert's count, weighted zero.
            over, moved = (rank >= capacity).to(torch.uint8).sort(stable=True)
            order = order[moved]
            combine = weights.flatten()[order].masked_fill(over.bool(), 0.0)
            kept = counts.clamp(max=capacity)
            dropped = counts.sum() - kept.sum()
        else:
            order = torch.argsort(flat, stable=True)
            combine = weights.flatten()[order]
            kept = counts
            dropped = torch.zeros((), dtype=torch.int64, device=h.device)

        token = order // a.top_k
        y = self.experts(h[token], kept)
        # fp32 accumulation, in a tensor of x's shape: FSDP2 warns of a unit returning a view
        out = torch.zeros(x.shape, dtype=weights.dtype, device=h.device)
        out.view(tokens, a.d_model).index_add_(0, token, y.to(weights.dtype) * combine.unsqueeze(-1))
        out = out.to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        return out, MoEStats(counts, balance_loss, z_loss, dropped)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, skipped: torch.Tensor | None = None) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step: bias_e += rate * sign(mean load
        - load_e), so an overloaded expert is chosen less. Pass the step's counts summed over micro-batches and
        all-reduced over data-parallel ranks, so that every rank applies the same update. `skipped` (a device
        scalar, 1.0 for a step the optimizer skips) cancels the update without reading it on the host."""
        if self.expert_bias is None:
            raise RuntimeError("update_bias needs the sigmoid router (the softmax router has no bias)")
        load = tokens_per_expert.to(device=self.expert_bias.device, dtype=torch.float32)
        direction = torch.sign(load.mean() - load)
        if skipped is not None:
            direction = direction * (1 - skipped.to(direction))
        self.expert_bias.add_(direction, alpha=self.args.bias_update_rate)

    @torch.no_grad()
    def init_weights(self, std: float, n_layers: int = 1, seed: int | None = None, prefix: str = "") -> None:
        """hpctrain.models.common.init.init_by_name's scheme: N(0, std), the residual output projections (`w_down`,
        `shared.proj`) N(0, std / sqrt(2 n_layers)); each parameter from a generator seeded by (seed, prefix +
        name), `prefix` the block's name in the model ("layers.3.moe."), so every layout (an expert-parallel
        shard materialised from meta) gets the single-process weights. The bias buffer is zeroed."""
        resid_std = std / math.sqrt(2 * n_layers)
        base = 0 if seed is None else seed
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(stable_hash(f"{base}:{prefix}{name}"))
            scale = resid_std if name in ("experts.w_down", "shared.proj.weight") else std
            assign_param(p, torch.randn(p.shape, generator=gen) * scale)
        if self.expert_bias is not None:
            assign_param(self.expert_bias, torch.zeros(self.expert_bias.shape))


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """A model's (or pipeline stage's) MoE layers by block index in the whole model: each block's `mlp` that is
    an MoE (hpctrain.models.mixtral.model); empty for a dense model."""
    return {
        int(i): block.mlp
        for i, block in getattr(model, "layers", {}).items()
        if isinstance(getattr(block, "mlp", None), MoE)
    }
