"""Reading checkpoints outside a run: list them per tier, verify one, export a consolidated model state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.checkpoint.integrity import check_files
from hpctrain.checkpoint.layout import CORRUPT, Committed, broken_in, committed_in, step_of, tier_path, verify
from hpctrain.records.fingerprint import ModelShape
from hpctrain.records.paths import RunPaths


def run_tiers(run_dir: Path) -> list[tuple[str, Path]]:
    """The tiers a run was configured with, resolved to directories (from its config.yaml)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(RunPaths(run_dir).config)
    return [(t.name, tier_path(t.path, run_dir, str(cfg.run.id))) for t in cfg.checkpoint.tiers]


def list_checkpoints(run_dir: Path) -> list[Committed]:
    return [c for name, path in run_tiers(run_dir) for c in committed_in(path, name)]


def find(run_dir: Path, step: int | None = None, tier: str | None = None) -> Committed:
    """A committed checkpoint of a run: the newest, or the one at `step` (in `tier` if given)."""
    found = [c for c in list_checkpoints(run_dir) if (tier is None or c.tier == tier)
             and (step is None or c.step == step)]
    if not found:
        raise FileNotFoundError(f"no committed checkpoint in {run_dir}" + (f" at step {step}" if step else "")
                                + (f" in tier {tier}" if tier else ""))
    return max(found, key=lambda c: c.step)


def describe(c: Committed, content: bool = False) -> dict[str, Any]:
    """A checkpoint's facts and problems: structural ones (files missing or of the wrong size), and with
    `content` every byte against its CRC32C, naming the records a damaged file holds."""
    m = c.manifest
    problems = verify(c) + ([str(d) for d in check_files(c.path, m)] if content else [])
    return {"tier": c.tier, "step": c.step, "time": m.get("time"), "bytes": sum(m.get("files", {}).values()),
            "world_size": m.get("world_size"), "consumed_samples": m.get("consumed_samples"),
            "path": str(c.path), "problems": list(dict.fromkeys(problems))}


def unusable(run_dir: Path) -> list[dict[str, Any]]:
    """Checkpoints no resume will load: a manifest that cannot be trusted, or quarantined by a resume."""
    rows = []
    for name, path in run_tiers(run_dir):
        rows += [{"tier": name, "step": step_of(sub), "path": str(sub), "problems": [why]}
                 for sub, why in broken_in(path)]
        rows += [{"tier": name, "step": step_of(sub), "path": str(sub),
                  "problems": ["quarantined: a resume found it damaged"]} for sub in sorted(path.glob(f"*{CORRUPT}"))]
    return rows


def export_model(c: Committed, out: Path) -> list[Path]:
    """Consolidate the model weights into one file (torch.save; also .safetensors if installed)."""
    import torch

    from hpctrain.checkpoint.reshard import load_state
    from hpctrain.models.gpt import GPT, GPTArgs

    m = ModelShape.from_value(c.manifest["fingerprint"]["model"])
    with torch.device("meta"):  # the tokenizer's vocabulary: the padding rows are not exported
        model = GPT(GPTArgs(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, vocab_size=m.vocab_size,
                            seq_len=m.context, ffn_hidden=m.ffn_mult * m.d_model))
    model.to_empty(device="cpu")
    state = {name: p.detach() for name, p in model.state_dict().items()}
    load_state({"train": {"model": state}}, str(c.path), None, no_dist=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    written = [out]
    try:
        from safetensors.torch import save_file
    except ImportError:
        return written
    safe = out.with_suffix(".safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, str(safe), metadata={"step": str(c.step)})
    written.append(safe)
    return written
