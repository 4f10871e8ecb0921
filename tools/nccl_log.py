#!/usr/bin/env python3
"""Analyze a job's NCCL_DEBUG=INFO output: versions, network, transports per link, topology, env, warnings.

    python tools/nccl_log.py LOG [LOG...]          # files, or directories of per-rank logs (submitit's
    python tools/nccl_log.py LOGDIR --json         #   <job>_<rank>_log.out/.err: *.out *.err *.log *.txt)

Errors (exit 1):
  version-mismatch     hosts run different NCCL versions (from version lines and "Mismatched NCCL version" WARNs)
  socket-fallback      a host uses NCCL's TCP socket transport on a multi-node job (a warning with --allow-socket,
                       for Ethernet-only clusters, and on a single-node job, where NCCL does not use the network)
Warnings (reported, exit 0):
  intra-node-slow-path an intra-node hop goes through SHM or the NIC instead of P2P (NVLink/PCIe, direct or IPC)
  no-gdrdma            an inter-node IB link without GPUDirect RDMA while other inter-node links have it
  nccl-warn            every NCCL WARN line, with host and rank
Exit 2: a path is unreadable, a directory holds no log files, or no NCCL line was found (NCCL_DEBUG=INFO unset?).
"""

from __future__ import annotations

import json
import sys

from hpctrain.entry import EntryParser
from hpctrain.health.nccl_log import analyze
from hpctrain.health.nccl_report import format_text


def main(argv: list[str] | None = None) -> int:
    parser = EntryParser(description=__doc__)
    parser.add_argument("logs", nargs="+", help="log files or directories of per-rank logs")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--allow-socket",
        action="store_true",
        help="the socket transport on a multi-node job is a warning, not an error",
    )
    args = parser.parse_args(argv)
    try:
        report = analyze(args.logs, allow_socket=args.allow_socket)
    except OSError as err:
        print(f"nccl_log: {err}", file=sys.stderr)
        return 2
    if not report.stats["nccl_lines"] and not report.versions:
        print(f"nccl_log: no NCCL output in {', '.join(args.logs)} (was NCCL_DEBUG=INFO set?)", file=sys.stderr)
        return 2
    print(
        json.dumps({**report.to_dict(), "exit_code": report.exit_code}, indent=1) if args.json else format_text(report)
    )
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
