"""The Mixture-of-Experts block (hpctrain.models.common.moe) against a per-token reference and transformers' MoE
blocks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from hpctrain.models.common import moe as moe_module
from hpctrain.models.common.moe import MoE, MoEArgs, balanced, grouped_mm_serves, run_experts

D, H = 16, 24  # d_model, expert_hidden


def block(dtype: torch.dtype = torch.float64, seed: int = 0, std: float = 0.5, **kw: object) -> MoE:
    kw = {"n_experts": 8, "top_k": 2, **kw}
    m = MoE(MoEArgs(d_model=D, expert_hidden=H, **kw))  # type: ignore[arg-type]
    m.init_weights(std, seed=seed)
    return m.to(dtype)


def tokens(dtype: torch.dtype = torch.float64, seed: int = 1, shape: tuple[int, ...] = (2, 16)) -> torch.Tensor:
    return torch.randn(*shape, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------------------------------ reference


def reference_route(m: MoE, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """One token's (chosen experts, combine weights), from its logits [E], by Python loops."""
    a = m.args
    if a.router == "softmax":
        p = logits.softmax(-1)
        chosen = sorted(range(a.n_experts), key=lambda e: -p[e].item())[: a.top_k]
        w = torch.stack([p[e] for e in chosen])
    else:
        s = logits.sigmoid()
        biased = [(s[e] + m.expert_bias[e]).item() for e in range(a.n_experts)]
        size = a.n_experts // a.n_groups
        group_score = [
            sum(sorted(biased[g * size : (g + 1) * size])[-2:]) if a.n_groups > 1 else 0.0 for g in range(a.n_groups)
        ]
        groups = sorted(range(a.n_groups), key=lambda g: -group_score[g])[: a.topk_groups]
        allowed = [e for e in range(a.n_experts) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: -biased[e])[: a.top_k]
        w = torch.stack([s[e] for e in chosen])
    if a.norm_topk_prob:
        w = w / w.sum()
    return chosen, w * a.route_scale


def expert(m: MoE, e: int, xt: torch.Tensor) -> torch.Tensor:
    return m.experts.w_down[e] @ (F.silu(m.experts.w_gate[e] @ xt) * (m.experts.w_up[e] @ xt))


def reference(m: MoE, x: torch.Tensor, capacity: int | None = None) -> tuple[torch.Tensor, int]:
    """The block token by token: (output, dropped). With `capacity`, an expert keeps its `capacity` assignments
    of highest weight (ties: token order), the rest contribute nothing."""
    h = x.reshape(-1, D)
    routes = [reference_route(m, h[t] @ m.router.weight.T) for t in range(h.shape[0])]
    kept: set[tuple[int, int]] = {(t, j) for t in range(h.shape[0]) for j in range(m.args.top_k)}
    if capacity is not None:
        for e in range(m.args.n_experts):
            mine = [(t, j) for t, (chosen, _) in enumerate(routes) for j, c in enumerate(chosen) if c == e]
            mine.sort(key=lambda tj: -routes[tj[0]][1][tj[1]].item())  # stable: token order among equals
            kept -= set(mine[capacity:])
    rows = []
    for t, (chosen, w) in enumerate(routes):
        row = sum(
            (w[j] * expert(m, e, h[t]) for j, e in enumerate(chosen) if (t, j) in kept), torch.zeros(D, dtype=x.dtype)
        )
        if m.shared is not None:
            row = row + m.shared(h[t])
        rows.append(row)
    dropped = h.shape[0] * m.args.top_k - len(kept)
    return torch.stack(rows).view(x.shape), dropped


ROUTERS = {
    "softmax-top2": {},
    "softmax-unnormalised": {"norm_topk_prob": False, "top_k": 3},
    "sigmoid-grouped-shared": {
        "router": "sigmoid",
        "n_groups": 4,
        "topk_groups": 2,
        "route_scale": 2.5,
        "n_shared_experts": 2,
    },
}


@pytest.mark.parametrize("kw", ROUTERS.values(), ids=ROUTERS.keys())
def test_dropless_equals_per_token_reference_with_gradients(kw: dict) -> None:
    m = block(**kw)
    if m.expert_bias is not None:
        m.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.1)
    x = tokens().requires_grad_()
    g = tokens(seed=2)
    params = [x, *m.parameters()]
    out, stats = m.compute(x)
    assert stats.dropped.item() == 0
    ours = torch.autograd.grad((out * g).sum(), params)
    ref, _ = reference(m, x)
    theirs = torch.autograd.grad((ref * g).sum(), params)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    for (name, _), a, b in zip([("x", x), *m.named_parameters()], ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


# ------------------------------------------------------------------------------------------ transformers


def fused(m: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    """Our stacked experts -> transformers 5's fused (gate_up_proj [E, 2H, d], down_proj [E, d, H])."""
    return torch.cat((m.experts.w_gate, m.experts.w_up), dim=1), m.experts.w_down


def load_hf(hf: torch.nn.Module, m: MoE) -> None:
    gate_up, down = fused(m)
    with torch.no_grad():
        hf.gate.weight.copy_(m.router.weight)
        hf.experts.gate_up_proj.copy_(gate_up)
        hf.experts.down_proj.copy_(down)


def check_against_hf(hf: torch.nn.Module, m: MoE) -> None:
    x = tokens(torch.float32)
    out, _ = m.compute(x)
    torch.testing.assert_close(out, hf(x), atol=1e-5, rtol=0)
    hf_logits, hf_weights, hf_experts = hf.gate(x.view(-1, D))
    logits = m.router_logits(x.view(-1, D))
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=0)
    weights, experts, _ = m.route(logits)
    assert torch.equal(experts.sort(-1).values, hf_experts.sort(-1).values)
    torch.testing.assert_close(
        weights.gather(-1, experts.argsort(-1)), hf_weights.gather(-1, hf_experts.argsort(-1)), atol=1e-6, rtol=0
    )


def test_equals_transformers_mixtral() -> None:
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    m = block(torch.float32)
    hf = MixtralSparseMoeBlock(
        MixtralConfig(hidden_size=D, intermediate_size=H, num_local_experts=8, num_experts_per_tok=2)
    ).eval()
    load_hf(hf, m)
    check_against_hf(hf, m)


@pytest.mark.parametrize("norm", [True, False])
def test_equals_transformers_qwen3_moe(norm: bool) -> None:
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    m = block(torch.float32, norm_topk_prob=norm)
    hf = Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(
            hidden_size=D, moe_intermediate_size=H, num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm
        )
    ).eval()
    load_hf(hf, m)
    check_against_hf(hf, m)


def test_equals_transformers_deepseek_v3() -> None:
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    m = block(torch.float32, router="sigmoid", n_groups=4, topk_groups=2, route_scale=2.5, n_shared_experts=1)
    m.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(3)) * 0.1)
    hf = DeepseekV3MoE(
        DeepseekV3Config(
            hidden_size=D,
            moe_intermediate_size=H,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            norm_topk_prob=True,
        )
    ).eval()
    load_hf(hf, m)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(m.expert_bias)
        hf.shared_experts.gate_proj.weight.copy_(m.shared.gate.weight)
        hf.shared_experts.up_proj.weight.copy_(m.shared.up.weight)
        hf.shared_experts.down_proj.weight.copy_(m.shared.proj.weight)
    check_against_hf(hf, m)


def test_balance_loss_equals_transformers_and_z_loss_the_formula() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    m = block(torch.float32)
    x = tokens(torch.float32)
    _, stats = m.compute(x)
    logits = m.router_logits(x.view(-1, D))
    torch.testing.assert_close(stats.balance_loss, load_balancing_loss_func((logits,), 8, 2), atol=1e-6, rtol=0)
    z = (logits.double().exp().sum(-1).log() ** 2).mean()
    torch.testing.assert_close(stats.z_loss.double(), z, atol=1e-5, rtol=0)


def test_sigmoid_balance_loss_uses_normalised_scores() -> None:
    m = block(router="sigmoid", n_groups=4, topk_groups=2)
    x = tokens()
    _, stats = m.compute(x)
    logits = m.router_logits(x.view(-1, D))
    s = logits.sigmoid()
    f = stats.tokens_per_expert.double() / logits.shape[0]
    expected = 8 * (f * (s / s.sum(-1, keepdim=True)).mean(0)).sum()
    torch.testing.assert_close(stats.balance_loss, expected, atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------ the sigmoid router


def test_group_limited_choice_stays_in_the_best_groups() -> None:
    m = block(router="sigmoid", n_groups=4, topk_groups=2, top_k=3)
    m.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.1)
    logits = m.router_logits(tokens(shape=(64,)))
    _, experts, _ = m.route(logits)
    biased = logits.sigmoid() + m.expert_bias
    best_groups = biased.view(-1, 4, 2).sum(-1).topk(2, dim=-1).indices  # groups of 2: their top-2 is all of it
    assert all(set((experts[t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(64))
    unlimited = biased.topk(3, dim=-1).indices
    assert any(not set((unlimited[t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(64))


def test_bias_changes_the_choice_not_the_weights() -> None:
    m = block(router="sigmoid", route_scale=2.0)
    logits = m.router_logits(tokens())
    scores = logits.sigmoid()
    weights0, experts0, _ = m.route(logits)

    m.expert_bias[5] = 10.0  # expert 5 is everyone's choice now
    weights, experts, _ = m.route(logits)
    assert (experts == 5).any(-1).all() and not (experts0 == 5).any(-1).all()
    chosen = scores.gather(-1, experts)
    torch.testing.assert_close(weights, 2.0 * chosen / chosen.sum(-1, keepdim=True), atol=1e-12, rtol=0)

    m.expert_bias.fill_(0.3)  # the same shift for all: same choice, same weights as without bias
    weights, experts, _ = m.route(logits)
    assert torch.equal(experts, experts0) and torch.equal(weights, weights0)


def test_update_bias_moves_toward_balance() -> None:
    m = block(router="sigmoid", n_experts=4, bias_update_rate=0.01)
    m.update_bias(torch.tensor([10, 2, 4, 0]))  # mean 4: expert 0 overloaded, 1 and 3 underloaded
    torch.testing.assert_close(m.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.01], dtype=torch.float64))
    m.update_bias(torch.tensor([10, 2, 4, 0]))
    assert m.expert_bias[0] == pytest.approx(-0.02)
    assert not m.expert_bias.requires_grad
    before = m.expert_bias.clone()
    m.update_bias(torch.tensor([10, 2, 4, 0]), skipped=torch.tensor(1.0))  # a step the optimizer skips
    assert torch.equal(m.expert_bias, before)
    m.update_bias(torch.tensor([10, 2, 4, 0]), skipped=torch.tensor(0.0))
    unmasked = block(router="sigmoid", n_experts=4, bias_update_rate=0.01)
    unmasked.expert_bias.copy_(before)
    unmasked.update_bias(torch.tensor([10, 2, 4, 0]))
    assert torch.equal(m.expert_bias, unmasked.expert_bias) and not torch.equal(m.expert_bias, before)
    with pytest.raises(RuntimeError):
        block().update_bias(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]))


# ------------------------------------------------------------------------------------------ shared experts, capacity


def test_shared_experts_add_exactly_the_shared_mlp() -> None:
    with_shared = block(n_shared_experts=2)
    routed_only = block(n_shared_experts=0)
    routed_only.load_state_dict({k: v for k, v in with_shared.state_dict().items() if not k.startswith("shared.")})
    assert with_shared.shared.gate.weight.shape == (2 * H, D)
    x = tokens()
    torch.testing.assert_close(with_shared(x) - routed_only(x), with_shared.shared(x), atol=1e-12, rtol=0)


def forced_to_expert_0(capacity_factor: float) -> tuple[MoE, torch.Tensor]:
    """Every token: expert 0 first, expert 1 second, with the same weights."""
    m = block(capacity_factor=capacity_factor)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0], m.router.weight[1, 0] = 10.0, 5.0
    x = tokens()
    x[..., 0] = 1.0
    return m, x


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0, 5.0])
def test_capacity_drops_the_overflow(capacity_factor: float) -> None:
    m, x = forced_to_expert_0(capacity_factor)
    n_tokens = 32
    capacity = math.ceil(capacity_factor * n_tokens * 2 / 8)
    assert m.args.capacity(n_tokens) == capacity
    out, stats = m.compute(x)
    assert stats.tokens_per_expert.tolist() == [32, 32, 0, 0, 0, 0, 0, 0]
    assert stats.dropped.item() == 2 * max(0, n_tokens - capacity)
    dropless, _ = forced_to_expert_0(0.0)[0].compute(x)
    kept = min(capacity, n_tokens)  # equal weights: the first tokens are kept, by both experts
    flat_out, flat_dropless = out.view(-1, D), dropless.view(-1, D)
    torch.testing.assert_close(flat_out[:kept], flat_dropless[:kept], atol=1e-12, rtol=0)
    assert torch.equal(flat_out[kept:], torch.zeros_like(flat_out[kept:]))


def test_dropless_drops_nothing_even_when_all_go_to_one_expert() -> None:
    m, x = forced_to_expert_0(0.0)
    out, stats = m.compute(x)
    assert stats.dropped.item() == 0
    torch.testing.assert_close(out, reference(m, x)[0], atol=1e-12, rtol=0)


def test_capacity_drops_the_lowest_weights_first() -> None:
    m = block(capacity_factor=1.0)
    x = tokens()
    out, stats = m.compute(x)
    ref, dropped = reference(m, x, capacity=m.args.capacity(32))
    assert dropped > 0 and stats.dropped.item() == dropped
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kw", [{}, {"router": "sigmoid", "n_groups": 4, "topk_groups": 2}, {"capacity_factor": 0.5}])
def test_tokens_per_expert_counts_every_assignment(kw: dict) -> None:
    m = block(**kw)
    x = tokens()
    _, stats = m.compute(x)
    _, experts, _ = m.route(m.router_logits(x.view(-1, D)))
    assert stats.tokens_per_expert.dtype == torch.int64 and stats.tokens_per_expert.shape == (8,)
    assert stats.tokens_per_expert.sum().item() == 32 * 2
    assert torch.equal(stats.tokens_per_expert, torch.bincount(experts.flatten(), minlength=8))


# ------------------------------------------------------------------------------------------ dtypes, meta, grouped GEMM


def test_bf16_block_routes_in_fp32() -> None:
    m = block(torch.bfloat16)
    x = tokens(torch.bfloat16)
    out, stats = m.compute(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert m.router_logits(x.view(-1, D)).dtype == torch.float32 and stats.balance_loss.dtype == torch.float32


def test_meta_build_then_init_gives_the_eager_weights() -> None:
    args = MoEArgs(d_model=D, expert_hidden=H, n_experts=8, top_k=2, router="sigmoid", n_shared_experts=1)
    with torch.device("meta"):
        lazy = MoE(args)
    assert lazy.experts.w_gate.is_meta and lazy.expert_bias.is_meta
    lazy.to_empty(device="cpu")
    lazy.init_weights(0.02, n_layers=4, seed=7, prefix="layers.1.mlp.")
    eager = MoE(args)
    eager.init_weights(0.02, n_layers=4, seed=7, prefix="layers.1.mlp.")
    for (name, a), b in zip(lazy.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(lazy.expert_bias, torch.zeros(8))
    assert lazy.experts.w_down.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert lazy.experts.w_gate.std().item() == pytest.approx(0.02, rel=0.1)
    other = MoE(args)
    other.init_weights(0.02, n_layers=4, seed=7, prefix="layers.2.mlp.")
    assert not torch.equal(other.experts.w_gate, eager.experts.w_gate)
    out, _ = lazy(tokens(torch.float32))
    assert torch.isfinite(out).all()


def test_grouped_mm_serves_only_bf16_aligned_on_sm90_and_sm100(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not grouped_mm_serves(torch.zeros(4, D, dtype=torch.bfloat16), torch.zeros(8, H, D, dtype=torch.bfloat16))
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    with FakeTensorMode():

        def serves(dtype: torch.dtype = torch.bfloat16, d: int = D, h: int = H) -> bool:
            return grouped_mm_serves(
                torch.empty(4, d, dtype=dtype, device="cuda"), torch.empty(8, h, d, dtype=dtype, device="cuda")
            )

        assert serves()
        assert not serves(torch.float32) and not serves(d=12) and not serves(h=20)
        capability[0] = (10, 0)
        assert serves()
        capability[0] = (8, 0)
        assert not serves()


def grouped_mm_runs_on_cpu() -> bool:
    try:
        torch._grouped_mm(torch.zeros(8, 8), torch.zeros(1, 8, 8), offs=torch.tensor([8], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not grouped_mm_runs_on_cpu(), reason="this torch has no CPU torch._grouped_mm")
def test_grouped_gemm_path_equals_the_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 8, 0, 1])  # empty experts too (padded to a group of zero rows)
    x = torch.randn(31, D, generator=gen).requires_grad_()
    ws = [
        torch.randn(6, H, D, generator=gen).requires_grad_(),
        torch.randn(6, H, D, generator=gen).requires_grad_(),
        torch.randn(6, D, H, generator=gen).requires_grad_(),
    ]
    g = torch.randn(31, D, generator=gen)
    results = []
    for grouped in (True, False):
        y = run_experts(x, counts, *ws, grouped=grouped)
        results.append((y, *torch.autograd.grad((y * g).sum(), [x, *ws])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    x16, ws16 = x.detach().bfloat16(), [w.detach().bfloat16() for w in ws]
    torch.testing.assert_close(
        run_experts(x16, counts, *ws16, grouped=True),
        run_experts(x16, counts, *ws16, grouped=False),
        atol=0.0625,
        rtol=0.0078,
    )


@pytest.mark.skipif(not grouped_mm_runs_on_cpu(), reason="this torch has no CPU torch._grouped_mm")
def test_block_through_the_grouped_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    m = block(torch.float32, capacity_factor=1.0)
    x = tokens(torch.float32)
    looped, stats = m.compute(x)
    monkeypatch.setattr(moe_module, "grouped_mm_serves", lambda x, weight: True)
    grouped, grouped_stats = m.compute(x)
    torch.testing.assert_close(grouped, looped, atol=1e-5, rtol=0)
    assert grouped_stats.dropped.item() == stats.dropped.item() > 0


def test_without_values_the_load_is_balanced_and_the_experts_run_grouped() -> None:
    """hpctrain.simulate's MoE: on fake CPU tensors no routing has values; the rows split evenly over the experts,
    the grouped GEMM runs as on an H100 (bf16), and nothing reads the host (a read raises on fake tensors). The
    experts take every assignment's row, a capacity's drops included, as on a GPU (static shapes)."""
    assert balanced(10, 4) == [3, 3, 2, 2] and balanced(8, 4) == [2] * 4
    for capacity_factor, kept in ((0.0, 64), (1.0, 64), (0.5, 64)):  # 32 tokens x top 2 over 8 experts
        m = block(torch.bfloat16, capacity_factor=capacity_factor, balance_coef=0.01)
        rows: list[int] = []
        m.experts.register_forward_pre_hook(lambda _, args, rows=rows: rows.append(args[0].shape[0]))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            x = mode.from_tensor(tokens(torch.bfloat16))
            assert grouped_mm_serves(x.view(-1, D), mode.from_tensor(m.experts.w_gate))
            out = m(x)
            out.float().square().sum().backward()
        assert rows == [kept] and out.shape == x.shape, (capacity_factor, rows)
        assert m.experts.w_gate.grad is not None and m.router.weight.grad is not None
