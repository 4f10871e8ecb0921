#!/usr/bin/env python3
"""hpctrain checkpoints of a run: list per tier, verify one against its manifest, export the model.

    python tools/checkpoint.py list   RUN_DIR
    python tools/checkpoint.py verify RUN_DIR [--step N] [--tier NAME]
    python tools/checkpoint.py export RUN_DIR OUT.pt [--step N] [--tier NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from hpctrain.checkpoint.inspect import describe, export_model, find, list_checkpoints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "verify", "export"):
        p = sub.add_parser(name)
        p.add_argument("run_dir", type=Path)
        if name == "export":
            p.add_argument("out", type=Path)
        if name != "list":
            p.add_argument("--step", type=int)
            p.add_argument("--tier")
        p.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            rows = [describe(c) for c in list_checkpoints(args.run_dir)]
            if args.json:
                print(json.dumps(rows, indent=1))
            else:
                print(f"{'tier':<10} {'step':>8} {'time':<19} {'MB':>9} {'ranks':>5} {'samples':>9}  status")
                for r in rows:
                    when = datetime.datetime.fromtimestamp(r["time"]).strftime("%Y-%m-%d %H:%M:%S")
                    status = "ok" if not r["problems"] else "BROKEN: " + "; ".join(r["problems"][:2])
                    print(f"{r['tier']:<10} {r['step']:>8} {when:<19} {r['bytes'] / 1e6:>9.1f} {r['world_size']:>5} "
                          f"{r['consumed_samples']:>9}  {status}")
            return 0
        ckpt = find(args.run_dir, args.step, args.tier)
        if args.command == "verify":
            info = describe(ckpt)
            print(json.dumps(info, indent=1) if args.json else
                  f"{ckpt.path}: step {ckpt.step}, {len(ckpt.manifest['files'])} files, "
                  + ("ok" if not info["problems"] else "BROKEN:\n  " + "\n  ".join(info["problems"])))
            return 0 if not info["problems"] else 1
        for path in export_model(ckpt, args.out):
            print(f"wrote {path}")
        return 0
    except FileNotFoundError as err:
        print(f"checkpoint: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
