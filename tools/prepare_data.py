#!/usr/bin/env python3
"""Tokenise a corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx): hpctrain.data.prepare's command.

    python tools/prepare_data.py --input PATH [PATH ...] --output PREFIX [--tokenizer tokenizer.json] [--workers N]

`--help` lists the options. Exit status 2 when the input, the tokenizer or the output cannot make a dataset.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without an install too

from hpctrain.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
