"""hpctrain/train/faults.py's own example (and any in the README) is a command line Hydra accepts, and the
value it gives is the fault it describes (issue 29: `+cluster.env.HPCTRAIN_INJECT_FAULT=raise:step=15:rank=1`,
unquoted, is refused by Hydra's override grammar: the `=` inside the value)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from hpctrain.train import faults
from hpctrain.train.faults import VARIABLE, Fault

REPO = Path(__file__).resolve().parents[1]


def documented() -> list[str]:
    """Every example of the variable in faults.py's docstring and the README, as Hydra receives it: a
    `python -m hpctrain ...` line or a `...` span, the shell's quoting removed."""
    text = (faults.__doc__ or "") + (REPO / "README.md").read_text()
    found = []
    for line in text.splitlines():
        if f"+cluster.env.{VARIABLE}=" not in line:
            continue
        if "python -m hpctrain" in line:
            words = shlex.split(line[line.index("python -m hpctrain") :], comments=True)
        else:
            words = [
                w
                for span in re.findall(r"`([^`]+)`", line)
                for w in (shlex.split(span) if span.startswith(("'", '"')) else [span])
            ]
        found += [w for w in words if w.startswith(f"+cluster.env.{VARIABLE}=")]
    return found


def test_the_documented_fault_examples_parse_with_hydra(
    compose_cfg: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    examples = documented()
    assert examples, "faults.py documents an example"
    parser = OverridesParser.create()
    for example in examples:
        (override,) = parser.parse_overrides([example])  # raises OverrideParseException when not valid Hydra
        value = override.value()
        assert override.key_or_group == f"cluster.env.{VARIABLE}" and isinstance(value, str), example
        monkeypatch.setenv(VARIABLE, value)
        fault = Fault.from_env()
        assert fault is not None and (fault.kind, fault.step, fault.rank) == ("raise", 15, 1), example
    cfg = compose_cfg(examples[0])
    assert cfg.cluster.env[VARIABLE] == "raise:step=15:rank=1"


def test_the_unquoted_form_is_what_hydra_refuses() -> None:
    """What the docstring said before: not a command line Hydra runs."""
    from hydra.errors import OverrideParseException

    with pytest.raises(OverrideParseException):
        OverridesParser.create().parse_overrides([f"+cluster.env.{VARIABLE}=raise:step=15:rank=1"])


def test_a_stall_sleeps_its_seconds_and_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`stall` (a straggler) returns after its seconds, at its step and rank only; without seconds it is refused."""
    import time

    monkeypatch.setenv(VARIABLE, "stall:step=3:rank=1:seconds=0.2")
    fault = Fault.from_env()
    assert fault is not None and (fault.kind, fault.step, fault.rank, fault.seconds) == ("stall", 3, 1, 0.2)
    started = time.monotonic()
    fault.maybe_fire(3, 0, tmp_path)
    fault.maybe_fire(2, 1, tmp_path)
    assert time.monotonic() - started < 0.1
    fault.maybe_fire(3, 1, tmp_path)
    assert time.monotonic() - started >= 0.2
    monkeypatch.setenv(VARIABLE, "stall:step=3")
    with pytest.raises(ValueError, match="stall needs seconds"):
        Fault.from_env()
