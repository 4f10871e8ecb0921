"""Read what an offline W&B run recorded, from the `.wandb` file it writes, with W&B's own protobufs.

The file is a 7-byte header (":W&B", magic 0xBEE1, version 0) followed by LevelDB-log framing: 32 KiB blocks
of records, each `crc32c (4) | length (2, LE) | type (1) | data`, a record split over blocks as FIRST, MIDDLE,
LAST pieces. Each assembled record is a `wandb_internal_pb2.Record`. Used to check, without a network or a
W&B server, what a run would sync: its id, group, and history.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = 7
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:  # padding at the end of a block
            pos += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero fill of a preallocated block
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = pb.Record()  # type: ignore[attr-defined]  # the module star-imports its protobuf's version
            record.ParseFromString(pending)
            yield record


def run_info(path: Path) -> dict[str, Any]:
    """The run's id and group, its history rows (as logged, `_step` included) and its summary as last updated."""
    info: dict[str, Any] = {"history": [], "summary": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info["run_id"], info["group"] = record.run.run_id, record.run.run_group
            info["tags"] = list(record.run.tags)
        elif kind == "history":
            info["history"].append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif kind == "summary":
            info["summary"].update(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update}
            )
    return info
