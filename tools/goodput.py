#!/usr/bin/env python3
"""Goodput at scale: checkpoint intervals and expected goodput for GPU counts 64 ... 16384.

For each GPU count: the job's MTBF, the optimal interval of the RAM (fast, node-local) and shared (durable)
tier, and the goodput of three policies, from the model (exact renewal form for one tier, `loss_split` for
two) and from a Monte-Carlo simulation (mean and 95% CI), with what dominates the loss. See docs/goodput.md.

    python tools/goodput.py                                  # 175B, 0.1%/GPU/day, default bandwidths
    python tools/goodput.py --costs costs.json --png goodput.png
    python tools/goodput.py --rate 0.005 --p-fast 0.5 --json
    python tools/goodput.py --gpus 4096,16384 --queue-wait-s 3600 --p-stay 0.3   # a busy cluster
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.entry import EntryParser
from hpctrain.goodput.costs import (
    costs_from_bandwidths,
    load_costs,
    node_state_bytes,
    pick_tiers,
    scale_tier,
)
from hpctrain.goodput.model import (
    CheckpointPolicy,
    Failures,
    daly_interval,
    expected_goodput,
    loss_split,
    mtbf_s,
    optimal_policy,
    restart_cost,
    young_interval,
)
from hpctrain.goodput.simulate import simulate

POLICIES = ("ram+shared", "shared only", "fixed")


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
    p.add_argument("--stage-gbps", type=float, default=4.0, help="per node: staging to host memory (blocking)")
    p.add_argument("--ram-gbps", type=float, default=10.0, help="per node: write/read of the RAM tier")
    p.add_argument("--shared-node-gbps", type=float, default=2.0, help="per node: to the shared file system")
    p.add_argument("--shared-gbps", type=float, default=40.0, help="file system aggregate bandwidth for the job")
    p.add_argument("--params", type=float, default=175e9, help="model parameters (state scaling)")
    p.add_argument(
        "--bytes-per-param",
        type=float,
        default=14.0,
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
        default=10.0,
        help="restart cost inside the allocation (bench/bench_restart.py), without the load",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--png", type=Path, help="plot goodput vs GPU count (needs matplotlib)")
    return p.parse_args(argv)


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
        scaled = {
            name: scale_tier(tier, measured.state_bytes_per_node, node_bytes, total, args.shared_gbps)
            for name, tier in measured.tiers.items()
        }
        slow = scaled[slow_name]
        fast = scaled[fast_name] if fast_name else None
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
        out.append(row)
    return out


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
