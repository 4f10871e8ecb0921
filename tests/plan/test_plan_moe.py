"""The Mixture-of-Experts families in the planner: total and active parameters against the published counts, per EP
rank against the model built on the meta device and split by the engine's expert parallelism, FLOPs of the active
experts, the MoE block's activations (measured on the module), expert memory per rank, the all-to-all traffic, the
layout search over ep, the checks, and the Qwen3-235B-A22B experiment's plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hpctrain.config.problems import ConfigError
from hpctrain.launch.cli import run
from hpctrain.models.params import built_dims, model_active_param_count, model_param_count, stage_param_counts
from hpctrain.plan.activations import activation_bytes_per_layer
from hpctrain.plan.comm import dp_items, ep_items
from hpctrain.plan.estimate import cluster_hardware
from hpctrain.plan.flops import flops_per_iteration, fp8_flops_per_iteration, model_flops_per_token
from hpctrain.plan.memory import memory_per_gpu, shard_params_per_gpu, stage_params_per_gpu
from hpctrain.plan.offload import offload_costs, rank_shards
from hpctrain.plan.search import search_layouts
from hpctrain.plan.step_time import estimate_step, step_range
from hpctrain.plan.types import GiB, Layout, ModelShape, hardware
from tests.plan.shapes import QWEN3_MOE, dims

# (total, active): Hugging Face's counts of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B (sum of numel over
# the safetensors; the active figure is what the model cards publish: 12.9B, 3.3B).
PUBLISHED = {"mixtral_8x7b": (46_702_792_704, 12_879_925_248), "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704)}
# Qwen/Qwen3-235B-A22B from its config.json (94 layers, d 4096, 64 heads and 4 KV heads of 128, 128 experts of 1536,
# 8 per token, vocabulary 151936, untied): the card's "235B total, 22B activated".
QWEN3_235B = (235_093_634_560, 22_190_763_520)
H100 = hardware("h100_80gb")


def _moe_counts(
    L: int, h: int, heads: int, kv: int, hd: int, e: int, k: int, f: int, v: int, qk_norm: bool
) -> tuple[int, int]:
    """Per layer: QKV h x (q + 2 kv), the projection q x h, two RMSNorms, Qwen3's per-head q/k norms, the router
    E x h and E SwiGLU experts 3 h f; embedding and untied head V x h; the final norm. Active: top_k experts."""
    q, kvd = heads * hd, kv * hd
    dense = h * (q + 2 * kvd) + q * h + 2 * h + (2 * hd if qk_norm else 0) + e * h
    top = 2 * v * h + h
    return L * (dense + 3 * e * h * f) + top, L * (dense + 3 * k * h * f) + top


def test_published_totals_and_active_parameters(compose_cfg) -> None:
    counts = {
        "mixtral_8x7b": _moe_counts(32, 4096, 32, 8, 128, 8, 2, 14336, 32000, False),
        "qwen3_30b_a3b": _moe_counts(48, 2048, 32, 4, 128, 128, 8, 768, 151936, True),
        "qwen3_235b_a22b": _moe_counts(94, 4096, 64, 4, 128, 128, 8, 1536, 151936, True),
    }
    assert counts == {**PUBLISHED, "qwen3_235b_a22b": QWEN3_235B}
    for name, (total, active) in counts.items():
        m = compose_cfg(f"model={name}").model
        assert (model_param_count(m), model_active_param_count(m)) == (total, active), name
        shape = ModelShape.of(m, 4096)
        assert (shape.params, shape.active_params) == (total, active)
        halves = (m.n_layers // 2,) * 2
        assert sum(stage_param_counts(m, halves)) == total + 2 * (shape.vocab_rows() - m.vocab_size) * m.d_model


def test_mfu_counts_the_active_parameters(compose_cfg) -> None:
    """6 N + 12 l s q with N the active count, in the training loop's MFU and in the plan's."""
    from hpctrain.parallel.metrics import flops_per_token

    cfg = compose_cfg("model=qwen3_30b_a3b", "train.seq_len=4096")
    per_token = 6 * PUBLISHED["qwen3_30b_a3b"][1] + 12 * 48 * 4096 * 32 * 128
    assert flops_per_token(cfg) == per_token
    assert model_flops_per_token(ModelShape.of(cfg.model, 4096)) == per_token
    dense = compose_cfg("model=llama3_8b", "train.seq_len=8192")
    assert flops_per_token(dense) == 6 * model_param_count(dense.model) + 12 * 32 * 8192 * 4096


def test_flops_run_the_router_and_top_k_experts_on_every_tp_rank(compose_cfg) -> None:
    """Per token and layer forward: the attention's matrices, the router E h, top_k experts 3 h f_e; TP leaves the
    MoE layer whole, so each of the t ranks runs it: the GPUs together t times. FP8 converts the attention only."""
    m = compose_cfg("model=moe_tiny").model
    shape = ModelShape.of(m, 256)
    h, q, kv, e, k, f, s, b, L = 64, 64, 32, 8, 2, 64, 256, 4, 4
    tokens = b * s
    attn, moe = h * (q + 2 * kv) + q * h, e * h + 3 * k * h * f
    core = 4 * tokens * s * q
    logits = 2 * tokens * h * shape.vocab_rows(2)
    for tp in (1, 2):
        layer = 2 * tokens * (attn + tp * moe) + core
        assert flops_per_iteration(shape, b, "none", tp) == pytest.approx(L * 3 * layer + 3 * logits)
    assert fp8_flops_per_iteration(shape, b, "full", "tensorwise") == L * 4 * 2 * tokens * attn


@pytest.mark.parametrize(
    "arch,head_dim,shared",
    [("qwen3_moe", 0, 0), ("qwen3_moe", 64, 0), ("mixtral", 0, 0), ("qwen3_moe", 0, 1)],
    ids=["qwen3_moe", "wider_heads", "mixtral", "shared_expert"],
)
def test_moe_block_saves_what_the_formula_counts(compose_cfg, arch: str, head_dim: int, shared: int) -> None:
    """The tensors autograd saves for an MoE family's block in bf16 on CPU (storages counted once, parameters left
    out): the attention as the dense family's, the MoE layer's router, routing, experts and combine
    (activations.moe_bytes_per_token), plus RoPE's cos/sin tables and the block norms' per-token fp32 1/rms."""
    from tests.plan.saved import block_saved_bytes

    d, a, g, f, e, k, s, b = 256, 8, 2, 704, 8, 2, 512, 2
    cfg = compose_cfg(
        "model=moe_tiny",
        f"model.arch={arch}",
        f"model.d_model={d}",
        f"model.n_heads={a}",
        f"model.n_kv_heads={g}",
        f"model.ffn_hidden={f}",
        f"model.moe.expert_hidden={f}",
        f"model.moe.n_experts={e}",
        f"model.moe.top_k={k}",
        f"model.moe.n_shared_experts={shared}",
        f"model.head_dim={head_dim}",
        "model.n_layers=1",
    )
    hd = head_dim or d // a
    rope_tables, inv_rms = 2 * s * hd * 2, 2 * b * s * 4
    formula = activation_bytes_per_layer(*built_dims(cfg.model), s, b)
    assert block_saved_bytes(cfg.model, b, s) == formula + rope_tables + inv_rms


def test_moe_activations_are_whole_on_every_tp_rank() -> None:
    """The MoE layer's bytes do not shrink with TP (each TP rank runs it on the full sequence); the busiest EP rank's
    experts hold `load` x the rows; full recomputation keeps the block input only."""
    s, h, a = 4096, 4096, 64
    block = dims(h, a, ffn_hidden=1536, kv_heads=4, head_dim=128, n_experts=128, top_k=8)  # Qwen3-235B-A22B's
    one = activation_bytes_per_layer(QWEN3_MOE, block, s, 1)
    rows = one - activation_bytes_per_layer(QWEN3_MOE, block, s, 1, expert_load=0.0)
    assert rows == s * 8 * (2 * h + 8 * 1536)  # each token's 8 routed rows: input and SwiGLU
    tp4 = activation_bytes_per_layer(QWEN3_MOE, block, s, 1, 4, True)
    assert tp4 - activation_bytes_per_layer(QWEN3_MOE, block, s, 1, 4, True, expert_load=0.0) == rows
    skew = activation_bytes_per_layer(QWEN3_MOE, block, s, 1, expert_load=1.25) - one
    assert skew == pytest.approx(0.25 * rows)
    assert activation_bytes_per_layer(QWEN3_MOE, block, s, 1, recompute="full") == 2 * s * h
    assert (one / (s * h)) > 100  # ~108 sbh of MoE layer + the attention's


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_per_ep_rank_counts_are_the_engines(compose_cfg, ep: int) -> None:
    """moe_tiny built on the meta device in a fake world of ep ranks, its experts split by the engine's expert
    parallelism (hpctrain.parallel.expert_parallel.apply_ep): each rank's parameters are the planner's, expert
    weights / ep on every rank."""
    import torch

    from hpctrain.models import create_model
    from hpctrain.models.common.moe import GroupedExperts
    from hpctrain.parallel.expert_parallel import apply_ep
    from hpctrain.simulate.world import fake_world

    cfg = compose_cfg("model=moe_tiny")
    with fake_world(Layout(dp=ep, tp=1, pp=1, zero_stage=1, ep=ep), 0) as dims:
        with torch.device("meta"):
            model = create_model(cfg.model)
        whole = sum(p.numel() for p in model.parameters())
        experts = {
            f"{name}.{p}"
            for name, mod in model.named_modules()
            if isinstance(mod, GroupedExperts)
            for p, _ in mod.named_parameters()
        }
        if ep > 1:
            apply_ep(model, dims.ep_mesh)
        local = {name: (p.to_local() if hasattr(p, "to_local") else p).numel() for name, p in model.named_parameters()}
    shape = ModelShape.of(cfg.model, 128)
    assert whole == model_param_count(cfg.model) + 2 * (shape.vocab_rows() - 256) * 64
    assert {n for n in local if shape.family.expert_dim(n) is not None} == experts  # the family entry's ep_dims
    assert (
        sum(local.values())
        == stage_param_counts(cfg.model, (cfg.model.n_layers,), 1, per_gpu=True, ep=ep)[0]
        == stage_params_per_gpu(shape, Layout(dp=ep, tp=1, pp=1, ep=ep, zero_stage=1), 0)
    )
    assert whole - sum(local.values()) == 4 * shape.expert_layer_params * (ep - 1) // ep


def test_expert_states_are_split_over_ep_and_sharded_over_what_it_leaves(compose_cfg) -> None:
    """Qwen3-30B-A3B on 16 GPUs, ZeRO-1: the rank's fp32 shards hold all / dp_shard parameters whatever ep is
    (dense over 16, this EP rank's experts over 16 / ep), the bf16 working copies and whole gradients the dense
    parameters and 1/ep of the experts."""
    shape = ModelShape.of(compose_cfg("model=qwen3_30b_a3b").model, 4096)
    n, experts = stage_params_per_gpu(shape, Layout(dp=1, tp=1, pp=1), 0), 48 * shape.expert_layer_params
    for ep in (1, 2, 8, 16):
        lay = Layout(
            dp=16, tp=1, pp=1, zero_stage=1, micro_batch=1, grad_accum=4, recompute="full", reduce_dtype="fp32", ep=ep
        )
        assert shard_params_per_gpu(shape, lay, 0) == pytest.approx(n / 16)
        local = n - experts * (ep - 1) / ep
        parts = {p.name: p.bytes for p in memory_per_gpu(shape, lay, H100).parts}
        assert parts[next(k for k in parts if k.startswith("fp32 parameter shard"))] == pytest.approx(4 * n / 16)
        assert parts[next(k for k in parts if k.startswith("bf16 unsharded"))] == pytest.approx(2 * local)
        assert parts[next(k for k in parts if k.startswith("unsharded fp32 gradients"))] == pytest.approx(4 * local)
    fits = [ep for ep in (1, 2, 4, 8, 16) if memory_per_gpu(shape, replace(lay, ep=ep), H100).fits]
    # the bf16 copies and whole fp32 gradients take 6 bytes per local parameter: at ep 4 that is 8.8B of them
    # (53 GB) beside the 30.5 GB of shards; ep 8 halves the experts' share again
    assert fits == [8, 16]


def test_offload_steps_the_ranks_shards_with_ep(compose_cfg) -> None:
    shape = ModelShape.of(compose_cfg("model=qwen3_30b_a3b").model, 4096)
    lay = Layout(
        dp=16,
        tp=1,
        pp=1,
        zero_stage=3,
        micro_batch=1,
        grad_accum=1,
        recompute="full",
        ep=8,
        offload_optimizer=True,
        offload_params=True,
    )
    o = offload_costs(shape, lay, H100)
    assert o.shard_params == pytest.approx(shard_params_per_gpu(shape, lay, 0))
    assert sum(n * k for n, k in rank_shards(shape, lay, 0)) == pytest.approx(o.shard_params)  # 16 experts / 2


def test_all_to_all_bytes_per_moe_layer(compose_cfg) -> None:
    """Per MoE layer and micro-batch: 4 all-to-alls (6 with recomputation) of s b top_k d in the compute dtype, the
    (ep - 1)/ep that leaves the rank, x the assumed imbalance; EP 8 stays on NVLink (tp x ep <= 8 GPUs a node)."""
    shape = ModelShape.of(compose_cfg("model=qwen3_235b_a22b").model, 4096)
    lay = Layout(dp=256, tp=1, pp=1, zero_stage=3, micro_batch=2, grad_accum=4, recompute="none", ep=8)
    (item,) = ep_items(shape, lay, H100, imbalance=1.25)
    rows = 4096 * 2 * 8 * 4096 * 2
    assert item.bytes == pytest.approx(94 * 4 * 4 * rows * 7 / 8 * 1.25)
    assert item.link == "nvlink" and item.kind == "ep"
    (full,) = ep_items(shape, replace(lay, recompute="full"), H100, imbalance=1.0)
    assert full.bytes == pytest.approx(94 * 4 * 6 * rows * 7 / 8)
    assert ep_items(shape, replace(lay, ep=16), H100)[0].link == "network"
    assert ep_items(shape, replace(lay, ep=1), H100) == []


def test_dp_traffic_of_the_experts_runs_over_the_ranks_holding_them(compose_cfg) -> None:
    """ZeRO-3's all-gathers: the dense parameters over all 256 ranks, this EP rank's experts (1/8) over 32."""
    shape = ModelShape.of(compose_cfg("model=qwen3_235b_a22b").model, 4096)
    lay = Layout(dp=256, tp=1, pp=1, zero_stage=3, micro_batch=2, grad_accum=4, recompute="full", ep=8)
    experts = 94 * shape.expert_layer_params
    dense = stage_params_per_gpu(shape, Layout(dp=1, tp=1, pp=1), 0) - experts
    gather = next(i for i in dp_items(shape, lay, H100) if i.name.startswith("param all-gather"))
    assert gather.bytes == pytest.approx(8 * (255 / 256 * 2 * dense + 31 / 32 * 2 * experts / 8))


def test_step_estimate_adds_the_all_to_alls_and_the_wait_for_the_busiest_rank(compose_cfg) -> None:
    shape = ModelShape.of(compose_cfg("model=qwen3_235b_a22b").model, 4096)
    lay = Layout(
        dp=256, tp=1, pp=1, zero_stage=3, micro_batch=2, grad_accum=4, recompute="full", ep=8, reduce_dtype="fp32"
    )
    even, skewed = estimate_step(shape, lay, H100, imbalance=1.0), estimate_step(shape, lay, H100, imbalance=2.0)
    assert even.imbalance_s == 0 and skewed.imbalance_s > 0 and skewed.ep_s == pytest.approx(2 * even.ep_s)
    assert even.step_time_s == pytest.approx(even.compute_s + even.ep_s + even.dp_exposed_s)
    assert [a.name for a in step_range(shape, lay, H100).assumptions] == [
        "matmul_efficiency",
        "dp_exposed_share",
        "expert_imbalance",
    ]
    assert len(step_range(shape, replace(lay, ep=1), H100).assumptions) == 2
    assert estimate_step(shape, replace(lay, ep=1), H100).ep_s == 0


def test_the_search_tries_ep_for_moe_models_only(compose_cfg) -> None:
    """Every candidate obeys the layout rules the checks report (config.layout.layout_rules, so the checks accept
    whatever auto picks); ep divides dp and n_experts; a dense model keeps ep = 1."""
    from hpctrain.config.layout import layout_rules
    from hpctrain.plan.search import workload

    cfg = compose_cfg("model=qwen3_30b_a3b", "cluster.gpu_type=h100_80gb", "cluster.gpus_per_node=8")
    shape = ModelShape.of(cfg.model, 4096)
    found = search_layouts(shape, 16, cluster_hardware(cfg.cluster), 64)
    assert {c.layout.ep for c in found} == {1, 2, 4, 8, 16}
    for c in found:
        assert not layout_rules(c.layout, workload(shape, cluster_hardware(cfg.cluster)))
        assert c.layout.dp_shard % c.layout.ep == 0 and 128 % c.layout.ep == 0
    dense = search_layouts(ModelShape.of(compose_cfg("model=llama3_8b").model, 4096), 16, H100, 64)
    assert {c.layout.ep for c in dense} == {1}


def test_parallel_auto_can_only_pick_an_ep_the_checks_accept(compose_cfg) -> None:
    """What `parallel=auto` would set for the fastest expert-parallel candidate of Qwen3-235B on 256 H100s (the
    fastest of all is a 32-stage pipeline without EP, 2 + 30 x 3 + 2 layers), and for the fastest of all: each
    passes the checks with the layout it names."""
    from omegaconf import OmegaConf

    from hpctrain.checks.runner import check_config
    from hpctrain.plan.auto import layout_overrides

    base = compose_cfg("+experiment=qwen3_235b_a22b", "dry_run=true")
    candidates = search_layouts(
        ModelShape.of(base.model, base.train.seq_len),
        256,
        cluster_hardware(base.cluster),
        base.train.global_batch,
        dtype="bf16",
        reduce_dtype="fp32",
    )
    fastest, with_ep = candidates[0], next(c for c in candidates if c.layout.ep > 1)
    assert (fastest.layout.pp, fastest.layout.first_stage_layers, fastest.layout.last_stage_layers) == (32, 2, 2)
    for chosen in (fastest, with_ep):
        cfg = compose_cfg("+experiment=qwen3_235b_a22b", "dry_run=true")
        for key, value in layout_overrides(chosen.layout).items():
            OmegaConf.update(cfg, key, value)
        report = check_config(cfg)
        assert report.layout.ep == chosen.layout.ep and report.estimates.memory.fits
        assert report.layout.layer_split(94) == chosen.layout.layer_split(94)


def test_the_qwen3_235b_experiment_plans_on_h100_nodes(compose_cfg, capsys) -> None:
    """32 x 8 H100-80GB: FSDP over 256 GPUs, EP 8 inside each node, full recomputation; 39.9 GiB per GPU, 4.9 of
    it the head's input, the logits and loss (14.2 before loss parallelism kept the logits in bf16 without fp32
    log-softmax copies); the plan prints the active count and the EP split."""
    assert run(compose_cfg("+experiment=qwen3_235b_a22b", "dry_run=true", "plan.format=json")).code == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["params_total"], plan["params_active"]) == QWEN3_235B
    assert plan["model"]["moe"] == {"n_experts": 128, "top_k": 8, "expert_hidden": 1536, "n_shared_experts": 0}
    lay = plan["layout"]
    assert (lay["dp"], lay["tp"], lay["pp"], lay["ep"], lay["zero_stage"]) == (256, 1, 1, 8, 3)
    mem = plan["memory_per_gpu_bytes"]
    assert mem["fits"] and mem["total"] / GiB == pytest.approx(39.92, abs=0.01)
    assert plan["params_per_gpu_before_zero"] == [
        model_param_count(compose_cfg("model=qwen3_235b_a22b").model) - 94 * 7 * 3 * 16 * 4096 * 1536
    ]
    assert plan["step_time_split_s"]["ep"] > 0 and plan["step_time_split_s"]["expert_imbalance"] > 0
    assert [a["name"] for a in plan["assumptions"]][-1] == "expert_imbalance"
    assert run(compose_cfg("+experiment=qwen3_235b_a22b", "dry_run=true")).code == 0
    text = capsys.readouterr().out
    for words in (
        "22,190,763,520 (22.19B) active per token",
        "MoE: 128 experts of 1536, top 8 per token",
        "EP 8 (experts split over 8 of the DP ranks)",
        "EP all-to-all x6/layer",
        "expert_imbalance 1.25",
        "per GPU after TP and EP",
    ):
        assert words in text, words


def test_moe_keys_on_a_dense_model_and_compile_are_refused(compose_cfg) -> None:
    from hpctrain.checks.runner import check_config

    with pytest.raises(ConfigError) as dense:
        check_config(compose_cfg("model=llama_tiny", "model.moe.n_experts=8", "model.moe.top_k=4"))
    assert [p.key for p in dense.value.problems] == ["model.moe.n_experts", "model.moe.top_k"]
    assert "model.arch=llama is a dense model" in str(dense.value) and "model=mixtral_8x7b" in str(dense.value)
    with pytest.raises(ConfigError) as compiled:
        check_config(compose_cfg("model=moe_tiny", "parallel.compile=true"))
    assert [p.key for p in compiled.value.problems] == ["parallel.compile"]
    check_config(compose_cfg("model=moe_tiny"))  # the tiny MoE as it is passes
    check_config(compose_cfg("model=moe_tiny", "cluster.gpus_per_node=4", "zero=stage1", "parallel.ep=4"))
    # FP8 converts the attention's Linears (the experts are not Linears): accepted, and timed at FP8 there only
    fp8 = check_config(compose_cfg("+experiment=qwen3_235b_a22b", "precision.fp8=tensorwise", "dry_run=true"))
    shape, lay = fp8.estimates.model, fp8.layout
    attention = shape.block_matmul_params - shape.whole_matmul_params
    assert (
        fp8_flops_per_iteration(shape, lay.global_batch, "full", "tensorwise")
        == 94 * 4 * 2 * lay.global_batch * 4096 * attention
    )
    assert attention == 4096 * (64 * 128 + 2 * 4 * 128) + 64 * 128 * 4096
