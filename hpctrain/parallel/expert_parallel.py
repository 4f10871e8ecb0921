"""Expert parallelism: each MoE layer's experts split over the EP ranks, tokens sent to them with all-to-all.

Applied to the meta-device model like TP (before FSDP2): each expert weight becomes a DTensor sharded on its
expert dim over the EP mesh, and the layer's GroupedExperts gets the EP group, which its forward dispatches over
(hpctrain.models.common.moe.GroupedExperts._dispatch). FSDP2 then shards each rank's experts over the DP ranks an
EP group leaves (`expert_fsdp_mesh`, hpctrain.parallel.data_parallel), the rest of the block over every DP rank.

An expert's gradient sums the contributions of the tokens every rank of the EP group sent it, whose losses are
each their rank's mean, and FSDP2 averages it over the ranks it reduces over only: GroupedExperts scales the
gradient of its local weights by 1 / ep where it is made. (FSDP2's set_gradient_divide_factor would do it in the
reduction, but with NCCL's PREMUL_SUM, which gloo lacks: the CPU tests could not run what the GPUs would.)
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from hpctrain.models.common.moe import moe_layers


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over `ep_mesh` (dim 0 of w_gate, w_up, w_down), in place on meta."""
    for layer in moe_layers(model).values():
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.ep_group = ep_mesh.get_group()
