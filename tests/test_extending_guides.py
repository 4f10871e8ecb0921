"""The guides in docs/extending/ quote the code as it is: each quoted block (the model family's are checked by
tests/models/test_family_guide.py) appears in its source, and each line a "real" diff adds is in its file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GUIDES = REPO / "docs" / "extending"

# guide -> its quoted python/yaml blocks, in order, and the file each is taken from
QUOTED = {
    "scheduler.md": ["hpctrain/scheduler/local.py", "conf/cluster/local.yaml"],
    "checkpoint_tier.md": ["conf/checkpoint/default.yaml"],
    "data_source.md": ["hpctrain/data/sampler.py", "conf/data/tokens.yaml"],
}
# guide -> its diffs that show code as it is now (the others sketch a change not made: a `pbs` backend)
REAL_DIFFS = {"checkpoint_tier.md": 1, "data_source.md": 1, "scheduler.md": 0, "model_family.md": 0}


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.mark.parametrize("guide", sorted(QUOTED))
def test_quoted_blocks_are_in_their_source(guide: str) -> None:
    text = (GUIDES / guide).read_text()
    blocks = [b for lang in ("python", "yaml") for b in _blocks(text, lang)]
    assert len(blocks) == len(QUOTED[guide])
    for block, source in zip(blocks, QUOTED[guide]):
        assert block in (REPO / source).read_text(), f"{guide}: a block is no longer in {source}:\n{block}"


@pytest.mark.parametrize("guide", sorted(REAL_DIFFS))
def test_real_diffs_are_in_the_tree(guide: str) -> None:
    diffs = _blocks((GUIDES / guide).read_text(), "diff")
    for diff in diffs[: REAL_DIFFS[guide]]:
        target = None
        for line in diff.splitlines():
            if line.startswith("+++ b/"):
                target = (REPO / line[6:]).read_text().splitlines()
            elif line.startswith("--- a/"):
                continue
            elif line[:1] in ("+", " ") and line[1:].strip():
                assert target is not None and line[1:] in target, f"{guide}: {line[1:]!r} is not in the file"


def test_every_guide_is_covered() -> None:
    assert {p.name for p in GUIDES.glob("*.md")} == set(REAL_DIFFS)
