#!/usr/bin/env python3
"""hpctrain checkpoints of a run: list per tier, verify their content, export the model.

    python tools/checkpoint.py list   RUN_DIR
    python tools/checkpoint.py verify RUN_DIR [--step N] [--tier NAME]
    python tools/checkpoint.py export RUN_DIR OUT.pt [--step N] [--tier NAME]
    python tools/checkpoint.py export RUN_DIR OUT_DIR --format hf [--max-shard-mb MB] [--step N] [--tier NAME]

`verify` reads every byte of the checkpoints it is given (default: all of the run's) and checks each file's
size and CRC32C against the manifest; for a damaged file it names the tensor records hit (each record's CRC32C
is in `.metadata`). A `.metadata` whose pickle asks for anything but DCP's metadata classes (a crafted checkpoint,
its sums updated to match) is reported, never unpickled. Exit status 1 when any checkpoint is damaged, 2 when
there is none to check.

No command unpickles anything a checkpoint holds without a restriction (`hpctrain/checkpoint/integrity.py`): a
crafted checkpoint is refused with the file and what its pickle asked for (exit status 2 for `export`).

No command ends in a traceback: a path that is not a run directory, a config.yaml that cannot be read, no
checkpoint (exit status 2); a checkpoint whose files are missing or cut short, whose `.metadata` is empty or not
DCP's (exit status 1 for `export`: `verify` says more); an export that cannot be written (a full disk: the
message says which file system; exit status 1), whose partial files are removed: an export is whole or absent.

`export` consolidates the model of a checkpoint of any layout: `--format torch` (default) into one file (torch.save
and .safetensors), `--format hf` into a Hugging Face model directory (config.json from the run's config.yaml,
safetensors weights, sharded above --max-shard-mb) that transformers.AutoModelForCausalLM.from_pretrained loads
and `model.init_from=OUT_DIR` starts a run from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path

from hpctrain.checkpoint.hf import MAX_SHARD_BYTES, export_hf, run_model_config
from hpctrain.checkpoint.inspect import (
    CheckpointError,
    DamagedCheckpoint,
    ExportFailed,
    check_readable,
    describe,
    export_model,
    find,
    list_checkpoints,
    unusable,
)
from hpctrain.checkpoint.integrity import UnsafeCheckpoint
from hpctrain.entry import EntryParser
from hpctrain.models.hf import HFMismatch


def main(argv: list[str] | None = None) -> int:
    parser = EntryParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "verify", "export"):
        p = sub.add_parser(name)
        p.add_argument("run_dir", type=Path)
        if name == "export":
            p.add_argument("out", type=Path)
            p.add_argument("--format", choices=("torch", "hf"), default="torch")
            p.add_argument(
                "--max-shard-mb",
                type=float,
                default=MAX_SHARD_BYTES / 1e6,
                help="hf: largest safetensors file before the weights are split (as save_pretrained)",
            )
        if name != "list":
            p.add_argument("--step", type=int)
            p.add_argument("--tier")
        p.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    # DCP's note that it reads in one process: what this tool does on purpose.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    try:
        if args.command == "list":
            rows = [describe(c) for c in list_checkpoints(args.run_dir)]
            if args.json:
                print(json.dumps(rows + unusable(args.run_dir), indent=1))
            else:
                print(f"{'tier':<10} {'step':>8} {'time':<19} {'MB':>9} {'ranks':>5} {'samples':>9}  status")
                for r in rows:
                    when = datetime.datetime.fromtimestamp(r["time"]).strftime("%Y-%m-%d %H:%M:%S")
                    status = "ok" if not r["problems"] else "BROKEN: " + "; ".join(r["problems"][:2])
                    print(
                        f"{r['tier']:<10} {r['step']:>8} {when:<19} {r['bytes'] / 1e6:>9.1f} {r['world_size']:>5} "
                        f"{r['consumed_samples']:>9}  {status}"
                    )
                for r in unusable(args.run_dir):
                    print(
                        f"{r['tier']:<10} {r['step']:>8} {'':<19} {'':>9} {'':>5} {'':>9}  BROKEN: {r['problems'][0]}"
                    )
            return 0
        if args.command == "verify":
            return verify(args)
        ckpt = find(args.run_dir, args.step, args.tier)
        check_readable(ckpt)
        if args.format == "hf":
            written = export_hf(ckpt, run_model_config(args.run_dir), args.out, int(args.max_shard_mb * 1e6))
        else:
            written = export_model(ckpt, args.out)
        for path in written:
            print(f"wrote {path}")
        return 0
    except (DamagedCheckpoint, ExportFailed) as err:
        print(f"checkpoint: {err}", file=sys.stderr)
        return 1
    except (FileNotFoundError, FileExistsError, HFMismatch, UnsafeCheckpoint, CheckpointError) as err:
        print(f"checkpoint: {err}", file=sys.stderr)
        return 2


def verify(args: argparse.Namespace) -> int:
    """Every matching checkpoint's content, newest first; 1 if any is damaged."""

    def wanted(row: dict) -> bool:
        return (args.step is None or row["step"] == args.step) and (args.tier is None or row["tier"] == args.tier)

    rows = [
        describe(c, content=True) for c in list_checkpoints(args.run_dir) if wanted({"step": c.step, "tier": c.tier})
    ]
    rows += [r for r in unusable(args.run_dir) if wanted(r)]
    if not rows:
        raise FileNotFoundError(
            f"no checkpoint in {args.run_dir}"
            + (f" at step {args.step}" if args.step else "")
            + (f" in tier {args.tier}" if args.tier else "")
        )
    rows.sort(key=lambda r: (-r["step"], r["tier"]))
    if args.json:
        print(json.dumps(rows, indent=1))
    for r in rows if not args.json else []:
        print(
            f"{r['tier']} step {r['step']} ({r['path']}): "
            + ("ok" if not r["problems"] else "BROKEN\n  " + "\n  ".join(r["problems"]))
        )
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
