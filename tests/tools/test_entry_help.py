"""Every command-line entry point answers `--help`, and its first line says what it does (issue 34): the scripts in
tools/ and bench/, and every module of hpctrain that runs as `python -m` (found, not listed by hand)."""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.conftest import REPO


def _runs_as_main(path: Path) -> bool:
    """A script or module with an `if __name__ == "__main__":` block, or a package's __main__.py."""
    if path.name == "__main__.py":
        return True
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def entry_points() -> dict[str, list[str]]:
    """Name -> the command that prints its help."""
    out = {}
    for folder in ("tools", "bench"):
        for path in sorted((REPO / folder).glob("*.py")):
            if _runs_as_main(path) or path.name == "bench_plan_search.py":  # a script run top to bottom
                out[f"{folder}/{path.name}"] = [sys.executable, str(path), "--help"]
    for path in sorted((REPO / "hpctrain").rglob("*.py")):
        if _runs_as_main(path):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            module = module.removesuffix(".__main__")
            out[module] = [sys.executable, "-m", module, "--help"]
    return out


def _help(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_every_entry_point_says_what_it_does_first() -> None:
    entries = entry_points()
    assert {
        "tools/checkpoint.py",
        "bench/bench_engine.py",
        "hpctrain",
        "hpctrain.status",
        "hpctrain.launch.supervise",
        "hpctrain.health.node",
        "hpctrain.data.prepare",
    } <= set(entries)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(entries, pool.map(_help, entries.values())))
    for name, proc in results.items():
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        first = proc.stdout.splitlines()[0] if proc.stdout else ""
        assert first.strip() and not first.lower().startswith("usage"), (name, proc.stdout[:300])
        assert len(first.split()) >= 4, (name, first)  # a sentence, not a name
