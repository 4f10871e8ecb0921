"""FP8 training through torchao (`Float8Linear`), as torchtitan does it.

`precision.fp8` names a torchao recipe: "tensorwise" (one dynamic scale per tensor, cuBLAS's FP8 GEMM; the
fastest) or "rowwise" (one scale per row, power-of-two scales; more accurate, CUTLASS kernels). "none" leaves
the model alone. torchao's third recipe, rowwise_with_gw_hp, is not offered: its high-precision weight-gradient
GEMM mixes dtypes under CPU autocast (the emulation tests cannot cover it) and torchao's own layer filter
does not support it.

What converts: the Linear layers of the transformer blocks (`layers.*`) whose two dimensions are multiples of
16 (torch._scaled_mm's requirement). The embeddings and the output head stay in high precision (torchtitan's
Llama configs filter `output` out too): the head's error would go straight into the logits. The config checks
refuse shapes where a block Linear (or its TP shard) would fall out of FP8, so on an accepted config every
block Linear converts.

Order (torchtitan's): conversion first, on the meta-device model, then recomputation, TP and FSDP2; weights are
created afterwards, so a Float8Linear holds the very parameter its nn.Linear had (same name, same init).

With FSDP2 sharding (ZeRO-1/2/3) and the tensorwise recipe, FSDP2 all-gathers the weights already cast to FP8
(half of bf16's bytes; `enable_fsdp_float8_all_gather`), and the weights' scales are computed for all of them in
one all-reduce after each optimizer step (`precompute_float8_dynamic_scale_for_fsdp`, registered as an optimizer
step post-hook). torchao allows the FP8 all-gather for tensorwise weight scaling only. Under TP the tensorwise
recipe uses torchao's float8 TP styles, which cast activations to FP8 before TP's all-gather (`float8_tp_plan`).

On a GPU the FP8 GEMMs run on the tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); on a
CPU torchao emulates them (`emulate=True`: the same casts and scales, the products in high precision), which is
what the tests check the numerics with.

torchao is imported here only, through `_torchao()`: with a torch built without CUDA it logs, at import, that its CUDA
kernels' libraries (`_C_*.so`) do not load and that Triton is missing (per rank, six lines for two ranks), all
expected there and none of them about the emulation; those are filtered out. Its other warnings, and all of
them with a CUDA build, stay.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)

from hpctrain.config.schema import PrecisionConfig

if TYPE_CHECKING:
    from hpctrain.config.layout import Layout

RECIPES = ("tensorwise", "rowwise")  # torchao recipes (Float8LinearRecipeName values)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0)
DIM_MULTIPLE = 16  # torch._scaled_mm: both dimensions of an FP8 GEMM operand are multiples of 16


# torchao's import-time warnings that only say a CUDA machine's parts are absent (torchao/__init__.py,
# torchao/kernel/intmm.py): expected without CUDA.
_CPU_EXPECTED = re.compile(r"Failed to load .*_C[^/]*\.so\b|Detected no triton")
_TORCHAO_LOGGERS = ("torchao", "torchao.kernel.intmm")


class _ExpectedOnCPU(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _CPU_EXPECTED.search(record.getMessage())


def _torchao() -> None:
    """Before any torchao import: with a torch built without CUDA, its import's warnings about the CUDA libraries
    and Triton it cannot load are dropped (once per process; its other warnings stay). Asked of the build, not the
    device: `torch.cuda.is_available()` would count as CUDA's first touch in a process that may fork later."""
    if "torchao" in sys.modules or torch.backends.cuda.is_built():
        return
    for name in _TORCHAO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedOnCPU) for f in logger.filters):
            logger.addFilter(_ExpectedOnCPU())


def fp8_recipe(precision: PrecisionConfig) -> str | None:
    """The torchao recipe precision.fp8 names, or None when FP8 is off."""
    recipe = str(getattr(precision, "fp8", "none") or "none")
    if recipe == "none":
        return None
    if recipe not in RECIPES:
        raise ValueError(f"precision.fp8={recipe!r}: expected none or one of {', '.join(RECIPES)}")
    return recipe


def fsdp_float8_all_gather(recipe: str | None, layout: Layout, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers FP8 weights: tensorwise weight scaling (torchao's only supported case) and
    parameters sharded by FSDP2 (ZeRO-1/2/3; `replicate` gathers nothing)."""
    return recipe == "tensorwise" and fsdp and layout.zero_stage > 0


def float8_config(recipe: str, emulate: bool, all_gather: bool) -> Any:
    """torchao's Float8LinearConfig for the recipe; `emulate` off a GPU, the FP8 all-gather where it applies."""
    _torchao()
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe), emulate=emulate, enable_fsdp_float8_all_gather=all_gather
    )


def converts(module: nn.Module, fqn: str) -> bool:
    """torchtitan's module filter: a Linear inside a transformer block whose dimensions are multiples of 16, but
    not an MoE router (it routes in fp32: hpctrain.models.common.moe)."""
    if not isinstance(module, nn.Linear) or not (fqn.startswith("layers.") or ".layers." in fqn):
        return False
    if fqn.endswith(".router"):
        return False
    out_features, in_features = module.weight.shape
    return out_features % DIM_MULTIPLE == 0 and in_features % DIM_MULTIPLE == 0


def apply_float8(
    model: nn.Module, precision: PrecisionConfig, layout: Layout, device: torch.device, fsdp: bool
) -> nn.Module:
    """Swap the block Linears of `model` (meta device, no layout yet) for torchao's Float8Linear, in place.

    Real FP8 GEMMs on CUDA devices (refused below compute capability 8.9), torchao's emulation elsewhere."""
    recipe = fp8_recipe(precision)
    if recipe is None:
        return model
    emulate = device.type != "cuda"
    if not emulate:
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(index)
        if capability < MIN_CAPABILITY:
            raise RuntimeError(
                f"precision.fp8={recipe}: {torch.cuda.get_device_name(index)} has compute capability "
                f"{capability[0]}.{capability[1]}; FP8 tensor cores need 8.9 or newer (Ada, Hopper, Blackwell). "
                "Set precision.fp8=none or run on H100/H200-class GPUs"
            )
    _torchao()
    from torchao.float8 import convert_to_float8_training

    config = float8_config(recipe, emulate, fsdp_float8_all_gather(recipe, layout, fsdp))
    convert_to_float8_training(model, module_filter_fn=converts, config=config)
    return model


def float8_linears(model: nn.Module) -> list[Any]:  # torchao's Float8Linear (torchao ships no types)
    """The Float8Linear modules of a model (none, without importing torchao, when nothing imported it: a model
    cannot hold one then, and a run without FP8 does not pay torchao's import)."""
    if "torchao.float8" not in sys.modules:
        return []
    from torchao.float8.float8_linear import Float8Linear

    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def _tensorwise(module: nn.Module) -> bool:
    """A Float8Linear whose input, weight and gradient all take one dynamic scale per tensor: what torchao's
    float8 TP styles handle (they cast before TP's collectives, tensorwise)."""
    _torchao()
    from torchao.float8 import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return False
    casts = (module.config.cast_config_input, module.config.cast_config_weight, module.config.cast_config_grad_output)
    return all(
        c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts
    )


def float8_tp_plan(block: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """A block's TP plan with torchao's float8 styles where they apply (torchtitan's float8 tensorwise TP):
    Float8ColwiseParallel / Float8RowwiseParallel for tensorwise Float8Linears, PrepareFloat8ModuleInput for a
    sub-layer whose Linears are all tensorwise Float8Linears (its input is cast to FP8 once, before the
    sequence-parallel all-gather). Layouts and local-output settings are kept; the rest is returned as is."""
    if not any(_tensorwise(m) for m in float8_linears(block)):
        return plan
    _torchao()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    out: dict[str, Any] = {}
    for name, style in plan.items():
        module = block.get_submodule(name)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and _tensorwise(module):
            cls = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            style = cls(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        elif type(style) is PrepareModuleInput and _all_tensorwise(module):
            style = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts,
                use_local_output=style.use_local_output,
            )
        out[name] = style
    return out


def _all_tensorwise(module: nn.Module) -> bool:
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(_tensorwise(m) for m in linears)


def register_scale_precompute(optimizers: list[torch.optim.Optimizer], model_parts: list[nn.Module]) -> None:
    """After each optimizer step, compute the FP8 scales of every FSDP2-sharded Float8Linear weight of the
    optimizer's model part in one all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp), instead of
    one per weight at its next all-gather. Only where the FP8 all-gather is on; a no-op otherwise.

    The hook runs on the main thread right after `step()`, which every rank of the part's mesh runs (a skipped
    step is skipped on all of them): the all-reduce is issued in the same order everywhere, on the device."""
    for opt, part in zip(optimizers, model_parts):
        if not any(m.config.enable_fsdp_float8_all_gather for m in float8_linears(part)):
            continue
        _torchao()
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any, part: nn.Module = part) -> None:
            precompute_float8_dynamic_scale_for_fsdp(part)

        opt.register_step_post_hook(hook)
