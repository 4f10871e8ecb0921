"""What the Mixture-of-Experts families' entries are made of (Mixtral: hpctrain.models.mixtral, Qwen3-MoE:
hpctrain.models.qwen3_moe), torch-free: the login node plans and checks an HF directory with them.

Each is its dense relative's block (Llama's for Mixtral, Qwen3's with per-head q/k norms for Qwen3-MoE) with the
SwiGLU MLP replaced by hpctrain.models.common.moe.MoE under the same name, `mlp`: a router `mlp.router` (E x h,
kept in fp32 for the routing) and E experts stacked in three parameters, `mlp.experts.w_gate`/`w_up` [E, f_e, h]
and `mlp.experts.w_down` [E, h, f_e] (f_e = model.moe.expert_hidden), plus optional shared experts `mlp.shared.*`.
Per block: the attention's parameters + E h + 3 E h f_e (+ 3 h f_s); each token runs top_k of the E experts, so
the active parameters count 3 top_k h f_e of them. Expert parallelism splits dim 0 of the expert weights; TP
leaves the MoE layer whole (each TP rank runs it on the full sequence; expert-tensor parallelism is not built).

Their Hugging Face counterparts (MixtralForCausalLM, Qwen3MoeForCausalLM) are their dense relative's config.json
(Llama's, Qwen3's) with the experts' keys added, and their checkpoints hold each expert apart, as save_pretrained
writes them (transformers 5 fuses the experts in memory only). Their routers are hpctrain's softmax router (no
groups, no scale, no shared experts). An MoE family's MLP width is its experts', read into both model.ffn_hidden
and model.moe.expert_hidden and compared as the expert width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hpctrain.models.family import BlockActivations, Dims, HFMismatch, ShapeProblem, Shapes

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig

ROUTERS = ("softmax", "sigmoid")

EXPERT_WEIGHTS = {"mlp.experts.w_gate": 0, "mlp.experts.w_up": 0, "mlp.experts.w_down": 0}  # EP splits the experts

MOE_ACTIVATIONS = BlockActivations(gated_mlp=True, rope=True, norm_fp32_copy=True, moe=True)


def moe_shapes(d: Dims) -> Shapes:
    """The MoE layer's parameters (names under `layers.<i>.`)."""
    h, e, f = d.d_model, d.n_experts, d.expert_hidden
    out: Shapes = {
        "mlp.router.weight": (e, h),
        "mlp.experts.w_gate": (e, f, h),
        "mlp.experts.w_up": (e, f, h),
        "mlp.experts.w_down": (e, h, f),
    }
    if d.n_shared_experts:
        fs = d.n_shared_experts * f
        out.update(
            {"mlp.shared.gate.weight": (fs, h), "mlp.shared.up.weight": (fs, h), "mlp.shared.proj.weight": (h, fs)}
        )
    return out


def with_moe(dense: Shapes, d: Dims) -> Shapes:
    return {**{k: v for k, v in dense.items() if not k.startswith("mlp.")}, **moe_shapes(d)}


def moe_problems(m: ModelConfig) -> list[ShapeProblem]:
    """The router's rules, besides the dense relative's: experts to route to, top_k within them, groups that
    divide them, sizes and coefficients that are not negative."""
    out: list[ShapeProblem] = []
    moe = m.moe
    if moe.n_experts < 1:
        out.append(
            (
                "model.moe.n_experts",
                f"model.arch={m.arch} is a Mixture of Experts, but model.moe.n_experts={moe.n_experts}",
                "set model.moe.n_experts (Mixtral 8, Qwen3-MoE 128), or a dense arch (llama, qwen3)",
            )
        )
        return out
    if not 1 <= moe.top_k <= moe.n_experts:
        out.append(
            (
                "model.moe.top_k",
                f"each token must go through 1 to n_experts={moe.n_experts} experts, got top_k={moe.top_k}",
                f"set model.moe.top_k between 1 and {moe.n_experts}",
            )
        )
    if moe.router not in ROUTERS:
        out.append(("model.moe.router", f"unknown router {moe.router!r}", f"use one of {', '.join(ROUTERS)}"))
    if moe.n_groups < 1 or moe.n_experts % moe.n_groups or not 1 <= moe.topk_groups <= moe.n_groups:
        out.append(
            (
                "model.moe.n_groups",
                f"n_groups={moe.n_groups} must divide n_experts={moe.n_experts} and "
                f"topk_groups={moe.topk_groups} be between 1 and n_groups",
                "set model.moe.n_groups=1",
            )
        )
    elif moe.n_groups > 1 and (
        moe.router != "sigmoid"
        or moe.n_experts // moe.n_groups < 2
        or moe.top_k > moe.topk_groups * moe.n_experts // moe.n_groups
    ):
        out.append(
            (
                "model.moe.n_groups",
                "expert groups need the sigmoid router, at least 2 experts a group and "
                "top_k <= topk_groups x experts per group",
                "set model.moe.n_groups=1",
            )
        )
    if moe.capacity_factor < 0:
        out.append(
            (
                "model.moe.capacity_factor",
                f"must be >= 0 (0: dropless), got {moe.capacity_factor}",
                "set model.moe.capacity_factor=0",
            )
        )
    for key in ("balance_coef", "z_loss_coef"):
        if getattr(moe, key) < 0:
            out.append(
                (
                    f"model.moe.{key}",
                    f"a loss coefficient must be >= 0, got {getattr(moe, key)}",
                    f"set model.moe.{key}=0 to turn it off",
                )
            )
    if moe.expert_hidden < 0 or moe.n_shared_experts < 0:
        out.append(
            (
                "model.moe.expert_hidden",
                "expert sizes must be >= 0 (expert_hidden 0: model.ffn_hidden)",
                "set model.moe.expert_hidden and model.moe.n_shared_experts to non-negative values",
            )
        )
    return out


# ---------------------------------------------------------------- Hugging Face


def moe_fields(
    hf: Mapping[str, Any],
    dense: dict[str, Any],
    dense_arch: str,
    *,
    n_experts: int,
    top_k: int,
    expert_hidden: int,
    norm_topk_prob: bool,
) -> dict[str, Any]:
    """The dense fields with the MLP width set to the experts' and model.moe filled in (the values are the HF
    class's, its defaults where config.json leaves a key out)."""
    if n_experts < 1:
        raise HFMismatch(
            f"this {dense['arch']} model has no experts (num_experts={n_experts}): a dense model is "
            f"model.arch={dense_arch}"
        )
    return {
        **dense,
        "ffn_hidden": expert_hidden,
        "moe": {
            "n_experts": n_experts,
            "top_k": top_k,
            "expert_hidden": expert_hidden,
            "n_shared_experts": 0,
            "router": "softmax",
            "norm_topk_prob": norm_topk_prob,
            "n_groups": 1,
            "topk_groups": 1,
            "route_scale": 1.0,
            "balance_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        },
    }


def n_experts(hf: Mapping[str, Any], default: int) -> int:
    """transformers reads either key (its configs map num_experts to num_local_experts) and writes
    num_local_experts; the hub's Qwen3-MoE files say num_experts."""
    count: int = hf.get("num_local_experts", hf.get("num_experts", default))
    return count


def exportable(m: ModelConfig, class_name: str, norm_topk_prob: tuple[bool, ...]) -> None:
    """HFMismatch naming each model.moe setting the HF class has no counterpart for (its router is the plain
    softmax one: no groups, no scale, no shared experts). capacity_factor, balance_coef and z_loss_coef shape
    training only: the model is HF's dropless forward whatever they were."""
    moe = m.moe
    wanted = {
        "router": (moe.router, ("softmax",)),
        "n_groups": (moe.n_groups, (1,)),
        "route_scale": (float(moe.route_scale), (1.0,)),
        "n_shared_experts": (moe.n_shared_experts, (0,)),
        "norm_topk_prob": (bool(moe.norm_topk_prob), norm_topk_prob),
    }
    bad = [
        f"model.moe.{k}={v!r} ({class_name} has only {', '.join(map(repr, ok))})"
        for k, (v, ok) in wanted.items()
        if v not in ok
    ]
    if bad:
        raise HFMismatch(f"this model cannot be written as {class_name}: " + "; ".join(bad))


def router_config(m: ModelConfig) -> dict[str, Any]:
    return {
        "num_experts_per_tok": m.moe.top_k,
        "router_aux_loss_coef": m.moe.balance_coef,
        "output_router_logits": False,
    }


def moe_compared(m: ModelConfig) -> dict[str, Any]:
    """What an MoE family compares besides its dense relative's keys: the MLP width as the experts' and the
    router's settings; balance_coef is a training choice and is not compared."""
    d, moe = Dims.of(m), m.moe
    return {
        "ffn_hidden": d.expert_hidden,
        "moe": {
            "n_experts": d.n_experts,
            "top_k": d.top_k,
            "expert_hidden": d.expert_hidden,
            "n_shared_experts": moe.n_shared_experts,
            "router": moe.router,
            "norm_topk_prob": moe.norm_topk_prob,
            "n_groups": moe.n_groups,
            "route_scale": float(moe.route_scale),
        },
    }


def expert_weight_shapes(
    dense: Callable[[Dims], Shapes], router: str, experts: str, names: tuple[str, str, str]
) -> Callable[[Dims], Shapes]:
    """The dense family's tensors with each layer's MLP replaced by the router `<layer>.<router>` [E, h] and
    expert e's gate, up and down (`names`) under `<layer>.<experts>.<e>.`."""

    def shapes(d: Dims) -> Shapes:
        h, f = d.d_model, d.expert_hidden
        out = {k: v for k, v in dense(d).items() if ".mlp." not in k}
        for i in range(d.n_layers):
            p = f"model.layers.{i}."
            out[f"{p}{router}.weight"] = (d.n_experts, h)
            for e in range(d.n_experts):
                gate, up, down = (f"{p}{experts}.{e}.{n}.weight" for n in names)
                out.update({gate: (f, h), up: (f, h), down: (h, f)})
        return out

    return shapes
