#!/usr/bin/env python3
"""Goodput at scale: checkpoint intervals and expected goodput for GPU counts 64 ... 16384.

For each GPU count: the job's MTBF, the optimal interval of the RAM (fast, node-local) and shared (durable)
tier, and the goodput of three policies, from the model (exact renewal form for one tier, `loss_split` for
two) and from a Monte-Carlo simulation (mean and 95% CI), with what dominates the loss. With --recovery, the
recovery modes side by side: restart (every rank restarts, the table's best policy) against replica groups
(recovery=replicas: one group out, healed from a peer; diloco: synced every --sync-every steps), each with
its own optimal checkpoint intervals. See docs/goodput.md.

    python tools/goodput.py                                  # 175B, 0.1%/GPU/day, default bandwidths
    python tools/goodput.py --costs costs.json --png goodput.png
    python tools/goodput.py --rate 0.005 --p-fast 0.5 --json
    python tools/goodput.py --gpus 4096,16384 --queue-wait-s 3600 --p-stay 0.3   # a busy cluster
    python tools/goodput.py --gpus 1024,16384 --recovery all --groups 4          # restart, replicas, diloco
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.entry import EntryParser
from hpctrain.goodput import costs as defaults
from hpctrain.goodput.costs import (
    MeasuredCosts,
    costs_from_bandwidths,
    heal_seconds,
    load_costs,
    node_state_bytes,
    outer_sync_seconds,
    pick_tiers,
    scale_tier,
)
from hpctrain.goodput.model import (
    CheckpointPolicy,
    Failures,
    IntervalRule,
    Replicas,
    TierCost,
    all_out_mtbf_s,
    availability,
    daly_interval,
    expected_goodput,
    loss_split,
    mtbf_s,
    optimal_policy,
    replica_loss,
    replica_policy,
    restart_cost,
    young_interval,
)
from hpctrain.goodput.simulate import simulate, simulate_replicas

POLICIES = ("ram+shared", "shared only", "fixed")
MODES = ("restart", "replicas", "diloco")
MODE_SETS = {"both": ("restart", "replicas"), "all": MODES}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = EntryParser(description=__doc__)
    p.add_argument("--rate", type=float, default=0.001, help="failures per GPU per day (0.001 = 0.1%%)")
    p.add_argument("--gpus", default=",".join(str(64 << i) for i in range(9)), help="comma-separated GPU counts")
    p.add_argument("--costs", type=Path, help="measured costs JSON (schema in hpctrain/goodput/costs.py)")
    p.add_argument("--fast-tier", help="tier of the JSON used as the fast tier (default: cheapest node-local)")
    p.add_argument("--slow-tier", help="tier of the JSON used as the durable tier (default: cheapest durable)")
    p.add_argument(
        "--restart-s", type=float, help="requeue + start + init + warm-up, without load (default: the JSON's, else 300)"
    )
    p.add_argument(
        "--p-fast", type=float, help="share of failures that leave every node usable (default: the JSON's, else 0.3)"
    )
    p.add_argument(
        "--stage-gbps", type=float, default=defaults.STAGE_GBPS, help="per node: staging to host memory (blocking)"
    )
    p.add_argument("--ram-gbps", type=float, default=defaults.RAM_GBPS, help="per node: write/read of the RAM tier")
    p.add_argument(
        "--shared-node-gbps", type=float, default=defaults.SHARED_NODE_GBPS, help="per node: to the shared file system"
    )
    p.add_argument(
        "--shared-gbps", type=float, default=defaults.SHARED_GBPS, help="file system aggregate bandwidth for the job"
    )
    p.add_argument("--params", type=float, default=175e9, help="model parameters (state scaling)")
    p.add_argument(
        "--bytes-per-param",
        type=float,
        default=defaults.BYTES_PER_PARAM,
        help="checkpoint bytes per parameter: bf16 weights 2 + fp32 master 4 + Adam 8",
    )
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--rule", choices=("daly", "young"), default="daly", help="interval rule per tier")
    p.add_argument("--fixed-min", type=float, default=30.0, help="the fixed-interval policy (shared tier only)")
    p.add_argument("--days", type=float, default=54.0, help="simulated run length")
    p.add_argument("--reps", type=int, default=200, help="simulated runs per point (0: no simulation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weibull-shape", type=float, help="Weibull times between failures (default exponential)")
    p.add_argument("--delay-s", type=float, default=0.0, help="mean of an exponential scheduler delay per restart")
    p.add_argument(
        "--queue-wait-s",
        type=float,
        default=0.0,
        help="time a job that leaves its allocation waits in the queue before it runs again",
    )
    p.add_argument(
        "--p-stay",
        type=float,
        default=0.0,
        help="share of failures recovered inside the allocation (launcher.in_allocation: a crashed or "
        "hung rank; node deaths too with hot spares); the rest are resubmitted and wait in the queue",
    )
    p.add_argument(
        "--in-allocation-s",
        type=float,
        default=defaults.IN_ALLOCATION_S,
        help="restart cost inside the allocation (bench/bench_restart.py), without the load",
    )
    r = p.add_argument_group("recovery modes (docs/goodput.md: replica groups)")
    r.add_argument(
        "--recovery",
        default="restart",
        help="comma-separated modes side by side: restart, replicas, diloco; both = restart,replicas; all",
    )
    r.add_argument("--groups", type=int, default=2, help="replica groups R (recovery.groups)")
    r.add_argument("--min-replicas", type=int, default=1, help="groups a step needs (recovery.min_replicas)")
    r.add_argument("--step-s", type=float, default=5.0, help="one training step (DiLoCo: one inner step)")
    r.add_argument(
        "--detect-s",
        type=float,
        default=1.0,
        help="the live groups' pause until their quorum drops a failed group (recovery.heartbeat_timeout_ms)",
    )
    r.add_argument(
        "--group-restart-s",
        type=float,
        help="a failed group's restart in the allocation, without load (default: --in-allocation-s)",
    )
    r.add_argument(
        "--peer-gbps", type=float, default=defaults.PEER_GBPS, help="per node: heal from a peer, DiLoCo's sync"
    )
    r.add_argument(
        "--quorum-ms", type=float, default=1e3 * defaults.QUORUM_S, help="torchft's quorum round trip per sync"
    )
    r.add_argument("--p-spare", type=float, default=1.0, help="share of node deaths that find a spare node")
    r.add_argument(
        "--requeue-s", type=float, default=21600.0, help="how long a group without a spare stays out (next requeue)"
    )
    r.add_argument(
        "--cross-group-s",
        type=float,
        default=0.0,
        help="replicas: exposed time per step of the gradients' all-reduce across groups (0: hidden; slow links)",
    )
    r.add_argument(
        "--sync-every", type=int, default=20, help="DiLoCo: inner steps per outer sync (recovery.sync_every)"
    )
    r.add_argument(
        "--sync-bytes-per-param",
        type=float,
        default=defaults.SYNC_BYTES_PER_PARAM,
        help="DiLoCo: bytes per parameter of the outer all-reduce",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--png", type=Path, help="plot goodput vs GPU count (needs matplotlib)")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.recovery.split(",") if m.strip()]
    modes = [m for name in names for m in MODE_SETS.get(name, (name,))]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        p.error(f"--recovery: unknown mode(s) {', '.join(unknown) or '(none)'}: use {', '.join(MODES)}, both or all")
    if not 1 <= args.min_replicas <= args.groups:
        p.error(f"--min-replicas must lie in 1..--groups ({args.groups})")
    args.modes = tuple(m for m in MODES if m in modes)
    return args


def rows(args: argparse.Namespace) -> list[dict]:
    measured = (
        load_costs(args.costs)
        if args.costs
        else costs_from_bandwidths(args.stage_gbps, args.ram_gbps, args.shared_node_gbps, 300.0, 0.3)
    )
    restart = args.restart_s if args.restart_s is not None else measured.restart_s
    p_fast = args.p_fast if args.p_fast is not None else (measured.p_fast if measured.p_fast is not None else 0.3)
    fast_name, slow_name = pick_tiers(measured, args.fast_tier, args.slow_tier)
    rule = daly_interval if args.rule == "daly" else young_interval
    total = args.params * args.bytes_per_param
    out = []
    for n in (int(g) for g in args.gpus.split(",")):
        node_bytes = node_state_bytes(args.params, args.bytes_per_param, n, args.gpus_per_node)
        slow, fast = _tiers(args, measured, slow_name, fast_name, n, 1)
        restart_s = restart_cost(restart, args.queue_wait_s, args.p_stay, args.in_allocation_s)
        failures = Failures(mtbf_s(args.rate, n), p_fast, restart_s + args.delay_s)
        policies = {
            "ram+shared": optimal_policy(slow, failures, fast, rule),
            "shared only": optimal_policy(slow, failures, None, rule),
            "fixed": CheckpointPolicy(slow, 60.0 * args.fixed_min),
        }
        row = {
            "gpus": n,
            "mtbf_h": failures.mtbf_s / 3600,
            "node_state_gb": node_bytes / 1e9,
            "fast": asdict(fast) if fast else None,
            "slow": asdict(slow),
            "policies": {},
        }
        for name, policy in policies.items():
            loss = loss_split(policy, failures)
            entry = {
                "tau_fast_s": policy.tau_fast_s if policy.fast else None,
                "tau_slow_s": policy.tau_slow_s,
                "model": expected_goodput(policy, failures),
                "loss": asdict(loss),
                "dominant": loss.dominant,
            }
            if args.reps > 0:
                sim = simulate(
                    policy,
                    Failures(failures.mtbf_s, p_fast, restart_s),
                    args.days * 86400.0,
                    args.reps,
                    args.seed,
                    args.weibull_shape,
                    args.delay_s,
                )
                entry["sim"] = asdict(sim)
            row["policies"][name] = entry
        row["recovery"] = {"restart": row["policies"]["ram+shared"]}
        for mode in args.modes:
            if mode != "restart":
                tiers = _tiers(args, measured, slow_name, fast_name, n, args.groups)
                row["recovery"][mode] = _replica_entry(args, mode, n, total, *tiers, failures, rule)
        out.append(row)
    return out


def _tiers(
    args: argparse.Namespace, measured: MeasuredCosts, slow: str, fast: str | None, n: int, copies: int
) -> tuple[TierCost, TierCost | None]:
    """The durable and fast tier's costs at n GPUs when `copies` groups each save a whole copy of the state
    (replica groups save their own checkpoints): each node's shard is `copies` times larger, and so is what the
    file system takes in."""
    node_bytes = node_state_bytes(args.params, args.bytes_per_param, n // copies, args.gpus_per_node)
    total = copies * args.params * args.bytes_per_param

    def cost(name: str) -> TierCost:
        return scale_tier(measured.tiers[name], measured.state_bytes_per_node, node_bytes, total, args.shared_gbps)

    return cost(slow), cost(fast) if fast else None


def _replica_entry(
    args: argparse.Namespace,
    mode: str,
    n: int,
    total: float,
    slow: TierCost,
    fast: TierCost | None,
    failures: Failures,
    rule: IntervalRule,
) -> dict:
    """One replica mode at n GPUs: its costs (the tiers' as each group saves its own copy), its optimal checkpoint
    policy (against the loss of every group), model and simulation. After the loss of every group the job
    restarts as in restart mode (failures.restart_s)."""
    nodes = max(1, n // args.gpus_per_node)
    diloco = mode == "diloco"
    rep = Replicas(
        groups=args.groups,
        step_s=args.step_s,
        detect_s=args.detect_s,
        group_restart_s=args.in_allocation_s if args.group_restart_s is None else args.group_restart_s,
        heal_s=heal_seconds(total, nodes, args.groups, args.peer_gbps),
        quorum_s=args.quorum_ms / 1e3,
        min_replicas=args.min_replicas,
        p_spare=args.p_spare,
        requeue_s=args.requeue_s,
        sync_every=args.sync_every if diloco else 1,
        sync_s=outer_sync_seconds(args.params, args.sync_bytes_per_param, nodes, args.groups, args.peer_gbps)
        if diloco
        else args.cross_group_s,
    )
    policy = replica_policy(slow, failures, rep, fast, rule)
    loss = replica_loss(policy, failures, rep)
    entry = {
        "replicas": asdict(rep),
        "availability": availability(rep, failures),
        "all_out_mtbf_h": all_out_mtbf_s(rep, failures) / 3600,
        "tau_fast_s": policy.tau_fast_s if policy.fast else None,
        "tau_slow_s": policy.tau_slow_s,
        "model": loss.goodput,
        "loss": asdict(loss),
        "dominant": loss.dominant,
    }
    if args.reps > 0:
        sim = simulate_replicas(policy, failures, rep, args.days * 86400.0, args.reps, args.seed)
        entry["sim"] = asdict(sim)
    return entry


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}"


def print_table(table: list[dict], args: argparse.Namespace) -> None:
    sim = args.reps > 0
    head = f"{'GPUs':>5} {'MTBF h':>7} {'tau ram':>8} {'tau shr':>8}"
    for name in POLICIES:
        label = f"fixed {args.fixed_min:g}m" if name == "fixed" else name
        head += f" | {label:>11} model" + ("   sim  ±ci" if sim else "")
    print(head + " | loss ram+shared: block lost restart -> dominant")
    for row in table:
        best = row["policies"]["ram+shared"]
        tau_f = f"{best['tau_fast_s'] / 60:7.1f}m" if best["tau_fast_s"] else f"{'-':>8}"
        line = f"{row['gpus']:>5} {row['mtbf_h']:7.2f} {tau_f} {best['tau_slow_s'] / 60:7.1f}m"
        for name in POLICIES:
            e = row["policies"][name]
            line += f" | {'':>11} {_pct(e['model'])}"
            if sim:
                line += f" {_pct(e['sim']['goodput'])} {100 * e['sim']['ci95']:4.2f}"
        loss = best["loss"]
        print(
            f"{line} | {_pct(loss['blocking'])} {_pct(loss['lost_work'])} {_pct(loss['restart'])} -> {best['dominant']}"
        )
    print(
        "goodput in %; model: exact renewal form for one tier, loss_split (first order per failure cycle) "
        "for two; tau ram '-': the RAM tier does not pay off; sim: mean and 95% CI half-width over "
        f"{args.reps} runs of {args.days:g} days"
    )
    if args.modes != ("restart",):
        print_modes(table, args)


def print_modes(table: list[dict], args: argparse.Namespace) -> None:
    """The recovery modes side by side: goodput of each, the replica modes' heal time and loss split."""
    sim = args.reps > 0
    shown = [m for m in MODES if m in args.modes or m == "restart"]
    replica = next((m for m in shown if m != "restart"), None)
    print(f"\nrecovery modes: {args.groups} replica groups, min {args.min_replicas}; restart = ram+shared above")
    head = f"{'GPUs':>5} {'MTBF h':>7}"
    for mode in shown:
        head += f" | {mode:>8} model" + ("   sim  ±ci" if sim else "") + ("" if mode == "restart" else " heal s")
    if replica:
        head += f" | loss {replica}: block quorum stall  out lost restart -> dominant"
    print(head)
    for row in table:
        line = f"{row['gpus']:>5} {row['mtbf_h']:7.2f}"
        for mode in shown:
            e = row["recovery"][mode]
            line += f" | {'':>8} {_pct(e['model'])}"
            if sim:
                line += f" {_pct(e['sim']['goodput'])} {100 * e['sim']['ci95']:4.2f}"
            if mode != "restart":
                line += f" {e['replicas']['heal_s']:6.1f}"
        if replica:
            e = row["recovery"][replica]
            parts = ("blocking", "overhead", "stall", "out", "lost_work", "restart")
            line += " | " + " ".join(f"{100 * e['loss'][k]:5.2f}" for k in parts) + f" -> {e['dominant']}"
        print(line)
    print(
        f"goodput in %; replica modes: model.replica_loss, checkpoints tuned to the loss of every group; "
        f"diloco syncs every {args.sync_every} steps of {args.step_s:g} s (its sample efficiency is not modelled)"
    )


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    gpus = [r["gpus"] for r in table]
    for name in POLICIES:
        entries = [r["policies"][name] for r in table]
        (line,) = ax.plot(gpus, [100 * e["model"] for e in entries], label=f"{name} (model)")
        if "sim" in entries[0]:
            ax.errorbar(
                gpus,
                [100 * e["sim"]["goodput"] for e in entries],
                yerr=[100 * e["sim"]["ci95"] for e in entries],
                fmt="o",
                ms=3,
                color=line.get_color(),
                label=f"{name} (simulated)",
            )
    for mode in MODES[1:]:
        if mode in table[0]["recovery"]:
            ax.plot(gpus, [100 * r["recovery"][mode]["model"] for r in table], "--", label=f"{mode} (model)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        table = rows(args)
    except (ValueError, OSError) as e:
        print(f"goodput: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {"inputs": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": table},
                indent=1,
            )
        )
    else:
        print_table(table, args)
    if args.png:
        try:
            plot(table, args.png)
        except ImportError:
            print("goodput: matplotlib is not installed, no plot", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
