"""`run.resume=ID`: a resume continues the run's own config, and the command line changes only what may change.

The config of a resume starts from the run's saved `config.yaml`; the keys the command line names (`key=value`,
`~key`, a group such as `cluster=dev` for its whole section, `+experiment=NAME` for what the experiment sets)
take today's composed values on top. Every other key keeps the run's value, so `run.resume=ID` alone plans the
run as it was, and `run.resume=ID train.max_steps=14` trains on with the run's own learning rate.

A key that changed and is not in `RESUMABLE` is refused on the login node, before anything is written, naming
the key, the saved and new values and the fix. With `checkpoint.force_resume=true` (the escape hatch the job's
checkpoint check already has) every key may change except the model's shape and the run's name and id (its
directory). The model's shape is every key that changes a parameter's shape or count: `MODEL_SHAPE`, and any other
`model.*` key whose new value gives the model's family other parameter shapes (`reshaping_keys`: the family's
own shape formulas, the ones the planner counts with), so a key a family adds later is covered without a list.
The job's checkpoint manager refuses such a checkpoint too (`CheckpointManager._check_shapes`).

Resuming a run that is complete (its COMPLETED.json or its newest checkpoint at train.max_steps or past it) submits
nothing: `finished` says so, and how to train on (raise train.max_steps). A saved config.yaml that cannot be read
(empty, binary, not a mapping, a directory) is a config error of `run.resume`, never a traceback (`load_saved`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hpctrain.bounded import Unreadable, read_text
from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import Config, as_config
from hpctrain.launch.secrets import REDACTED, is_secret
from hpctrain.records.fingerprint import DIMS, config_key

# What a resume may change, and why it is safe (README "Resume"). A key matches an entry equal to it or below it.
RESUMABLE: dict[str, str] = {
    "run.resume": "names the run to continue",
    "run.root": "where the run is looked up by id",
    "dry_run": "this invocation only",
    "plan": "this invocation's plan only",
    "train.max_steps": "the length of the run: extend or shorten it (the lr decay follows the new length)",
    "train.log_every": "reporting only",
    "train.eval_every": "reporting only: validation never trains",
    "train.eval_batches": "reporting only: validation never trains",
    "train.threads_per_rank": "CPU threads only",
    "train.micro_batch": "the split of the same global batch (train.global_batch stays)",
    "train.grad_accum": "the split of the same global batch (train.global_batch stays)",
    "parallel": "the layout: DCP reshards the checkpoint into any DP, TP, PP (tests/checkpoint, RESHARD)",
    "zero": "the ZeRO stage and offload: DCP reshards the checkpoint",
    "cluster": "where and how large the job is: with parallel.dp=-1 DP follows the world size; the checks "
    "refuse a size the batch does not fit",
    "launcher": "how failures are recovered",
    "elastic": "how failures are recovered",
    "health": "monitoring only",
    "tracking": "logging only",
    "data.prefetch": "read-ahead only",
    "checkpoint.tiers": "intervals, keep_last and new tiers (a tier the run saved to keeps its path)",
    "checkpoint.when_busy": "when saves happen, not what they hold",
    "checkpoint.write_threads": "how saves are written",
    "checkpoint.verify_on_load": "how a resume reads",
    "checkpoint.save_final": "whether the last step is saved",
    "checkpoint.force_resume": "the escape hatch itself",
}
# Never, even with checkpoint.force_resume=true: the model's shape, the keys that set its family and a field of its
# hpctrain.models.family.Dims (what the checkpoint's fingerprint holds, hpctrain.records.fingerprint: a field Dims
# gains is here without a line), and ffn_mult, which sets ffn_hidden. Any other model.* key whose change gives the
# family other parameter shapes is refused as these are (`reshaping_keys`).
MODEL_SHAPE = ("model.arch", "model.ffn_mult", *(config_key(name) for name in DIMS))
RUN_DIRECTORY = ("run.name", "run.id")  # the run's directory is the one resumed
# Keys whose change alone does not make a new config worth keeping (config.yaml stays as it is).
BOOKKEEPING = ("run.resume", "dry_run", "plan")

_ABSENT = object()
SCHEMA_SECTIONS = frozenset(f.name for f in fields(Config))


def _under(key: str, prefixes: Any) -> bool:
    return any(key == p or key.startswith(p + ".") or key.startswith(p + "[") for p in prefixes)


def _tier_path(key: str) -> bool:
    """`checkpoint.tiers.<name>.path` (or the tier itself): where the run's checkpoints already are."""
    parts = key.split(".")
    return key.startswith("checkpoint.tiers.") and (len(parts) == 3 or parts[3] in ("path", "name"))


def allowed(key: str, force: bool, saved: Any = None) -> bool:
    """Whether a resume may change `key` (from `saved`, absent for a key the run did not have)."""
    if _under(key, RUN_DIRECTORY) or _under(key, MODEL_SHAPE):
        return False
    if force:
        return True
    if _tier_path(key):
        return saved is _ABSENT  # a new tier may be added; a tier the run saved to keeps its name and path
    return _under(key, RESUMABLE)


def leaves(node: Any, key: str = "") -> dict[str, Any]:
    """Dotted key -> value of a config container; lists are compared whole, except lists of named entries
    (checkpoint tiers), keyed by name."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(leaves(v, f"{key}.{k}" if key else str(k)))
        return out
    if (
        isinstance(node, list)
        and node
        and all(isinstance(v, dict) and "name" in v for v in node)
        and len({str(v["name"]) for v in node}) == len(node)
    ):
        out = {}
        for v in node:
            out.update(leaves({k: x for k, x in v.items()}, f"{key}.{v['name']}"))
        return out
    return {key: node}


def _container(node: object) -> dict[str, Any]:
    """A config or a section of one (an OmegaConf node) as plain data."""
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def _shown(key: str, value: Any) -> str:
    if value is _ABSENT:
        return "(not set)"
    if is_secret(key.rsplit(".", 1)[-1], value) and value != REDACTED:
        return REDACTED
    return repr(value)


@dataclass
class Resume:
    """The resumed run's saved config, and the config this invocation runs (saved + the command line)."""

    run_dir: Path
    saved: DictConfig
    cfg: Config
    named: dict[str, str] = field(default_factory=dict)  # key -> the override that sets it

    def source(self, key: str) -> str:
        """The override this command sets `key` with (a group or an experiment sets several)."""
        found = [line for k, line in self.named.items() if _under(key, [k])]
        return found[-1] if found else "the setting that changes it"

    def changes(self, cfg: Config) -> dict[str, tuple[Any, Any]]:
        """Every key whose value differs from the saved config: key -> (saved, new)."""
        before, after = leaves(_container(self.saved)), leaves(_container(cfg))
        return {
            k: (before.get(k, _ABSENT), after.get(k, _ABSENT))
            for k in sorted(set(before) | set(after))
            if before.get(k, _ABSENT) != after.get(k, _ABSENT)
        }

    def problems(self, cfg: Config) -> list[Problem]:
        """The changed keys a resume may not change, one problem each."""
        force = bool(cfg.checkpoint.force_resume)
        changes = self.changes(cfg)
        reshaping = reshaping_keys(
            _container(self.saved.model),
            _container(cfg.model),
            [k for k in changes if _under(k, ["model"]) and not _under(k, MODEL_SHAPE)],
        )
        out = []
        for key, (old, new) in changes.items():
            shape = _under(key, MODEL_SHAPE) or key in reshaping
            if not shape and allowed(key, force, old):
                continue
            where = (
                f"the run {self.run_dir.name} has {_shown(key, old)} (its config.yaml), this command gives "
                f"{_shown(key, new)}"
            )
            if shape:
                out.append(
                    Problem(
                        key,
                        f"{where}: a resume continues the run's checkpoint, whose weights have the "
                        "saved shapes, and this changes a parameter's shape or count, so it is refused "
                        "even with checkpoint.force_resume=true (the weights would not load, or only cut "
                        "to the new shape)",
                        f"drop {self.source(key)} to continue the run; for the new shape start a new run "
                        "(without run.resume), converting this one's weights first: tools/checkpoint.py "
                        "export RUN --format hf OUT, then model.init_from=OUT",
                    )
                )
            elif _under(key, RUN_DIRECTORY):
                out.append(
                    Problem(
                        key,
                        f"{where}: a resume continues the run in its own directory",
                        f"drop {self.source(key)} (run.resume alone names the run)",
                    )
                )
            elif _tier_path(key):
                out.append(
                    Problem(
                        key,
                        f"{where}: the run's checkpoints are in the tier it saved to, and a resume "
                        "would not find them elsewhere (it would start again from step 0)",
                        f"keep {key} as it was (new tiers may be added), start a new run, or set "
                        "checkpoint.force_resume=true",
                    )
                )
            else:
                out.append(
                    Problem(
                        key,
                        f"{where}: a resume keeps the run's settings, and {key} is not one a resume "
                        f"may change (those are: {_resumable()})",
                        f"drop {self.source(key)} to continue the run as it was; start a new "
                        "run (without run.resume) to train with the new value; or add "
                        "checkpoint.force_resume=true to continue this run's checkpoint with it (not "
                        "the same training as the run so far)",
                    )
                )
        return out

    def config_changed(self, cfg: Config) -> bool:
        """Whether config.yaml gets a new content (the older one kept as config.<time>.yaml)."""
        return any(not _under(k, BOOKKEEPING) for k in self.changes(cfg))


def _resumable() -> str:
    return ", ".join(k if "." in k or k == "dry_run" else f"{k}.*" for k in RESUMABLE)


def load_saved(run_dir: Path) -> DictConfig:
    """The run's config.yaml against today's schema. A file that cannot be read (not a regular file, binary, too
    large), is empty, is not YAML or not a mapping of config sections, lacks a required key, or holds a key this
    version no longer knows is a config error of `run.resume` naming the file, never a traceback."""
    path = run_dir / "config.yaml"
    older = sorted(run_dir.glob("config.*.yaml"))  # kept by a resume that changed the config
    fix = (
        f"restore the run's config.yaml (from {older[-1]}, the copy a resume kept, if the run's config did not "
        "change since) or start a new run (without run.resume)"
        if older
        else "restore the run's config.yaml, or start a new run (without run.resume)"
    )

    def refused(what: str, how: str = fix) -> ConfigError:
        return ConfigError(
            [Problem("run.resume", f"the run's saved config {what}: the resume has nothing to continue from", how)]
        )

    try:
        text = read_text(path)
    except Unreadable as err:
        raise refused(f"cannot be read: {err}") from None
    if not text.strip():
        raise refused(f"{path} is empty")
    try:
        data = yaml.safe_load(text)  # its shape only: OmegaConf reads the values (its floats: 1e-4 is a float)
    except yaml.YAMLError as err:
        raise refused(f"{path} is not YAML: {' '.join(str(err).split())[:300]}") from None
    if not isinstance(data, dict):
        raise refused(f"{path} holds {_kind_of(data)}, not a mapping of config sections (run:, model:, train:, ...)")
    try:
        saved = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text))
    except (OmegaConfBaseException, ValueError, TypeError) as err:
        raise refused(
            f"{path} does not fit this version's schema: {str(err).splitlines()[0]}",
            "start a new run (without run.resume), or resume with the hpctrain version that wrote it",
        ) from None
    missing = sorted(OmegaConf.missing_keys(saved))
    if missing:
        raise refused(f"{path} lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return saved  # type: ignore[return-value]


def _kind_of(data: Any) -> str:
    if isinstance(data, list):
        return f"a YAML list of {len(data)} item(s)"
    return f"a single {type(data).__name__} value"


def _parameter_shapes(model: dict[str, Any]) -> Any:
    """What decides every parameter's shape and count, by the model's family (None when the family or the sizes
    are not ones it can describe: the model checks report those): the layers, and one block's and the top's
    parameter shapes (the vocabulary unpadded: its padding rows load across paddings)."""
    from hpctrain.config.schema import ModelConfig, MoEConfig, RopeConfig
    from hpctrain.models import registry
    from hpctrain.models.family import Dims

    try:  # the dataclasses themselves, not OmegaConf's: a resume asks this once per changed key
        typed = ModelConfig(
            **{**model, "moe": MoEConfig(**model.get("moe", {})), "rope": RopeConfig(**model.get("rope", {}))}
        )
        family = registry.family_of(typed)
        dims = Dims.of(typed)
        return (
            dims.n_layers,
            sorted(family.block_shapes(dims).items()),
            sorted(family.top_shapes(dims, dims.vocab_size).items()),
        )
    except Exception:  # noqa: BLE001 -- any value a family's formulas cannot take: not a shape to compare
        return None


def reshaping_keys(saved: dict[str, Any], new: dict[str, Any], keys: list[str]) -> set[str]:
    """Which of the changed `model.*` keys change a parameter's shape or count: each alone on the saved model
    section, by its family's shape formulas; when the change as a whole does and no key alone does, all of
    them."""
    before = _parameter_shapes(saved)
    if before is None or not keys:
        return set()
    out = set()
    for key in keys:
        one, value = copy.deepcopy(saved), new
        path = key.split(".")[1:]
        for part in path:
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
        if value is _ABSENT:
            _delete(one, path)
        else:
            _set(one, path, copy.deepcopy(value))
        after = _parameter_shapes(one)
        if after is not None and after != before:
            out.add(key)
    if not out:
        whole = _parameter_shapes(new)
        if whole is not None and whole != before:
            out = set(keys)
    return out


def finished(cfg: Config, run_dir: Path) -> str | None:
    """Why a resume of `run_dir` with `cfg` has nothing to train (None when it has): the run's last step, by its
    COMPLETED.json and its newest checkpoint this machine sees, is train.max_steps or past it. Only with
    checkpoints: without them a job starts again from step 0."""
    if not cfg.checkpoint.enabled:
        return None
    from hpctrain.checks.files import newest_checkpoint
    from hpctrain.records.jobs import read_completed

    steps = []
    completed = read_completed(run_dir)
    if completed is not None and isinstance(completed.get("step"), int):
        steps.append(completed["step"])
    newest = newest_checkpoint(cfg, run_dir)
    if newest is not None:
        steps.append(int(newest[1]["step"]))
    if not steps:
        return None
    step, max_steps = max(steps), int(cfg.train.max_steps)
    if step < max_steps:
        return None
    where = (
        f"complete at step {step} (train.max_steps={max_steps})"
        if step == max_steps
        else f"at step {step}, past train.max_steps={max_steps}"
    )
    return (
        f"run {run_dir.name} is {where}; nothing was submitted ({run_dir}). To train on, raise "
        f"train.max_steps: python -m hpctrain run.resume={run_dir.name} train.max_steps=<more than {step}>"
    )


def named_keys(
    cfg: DictConfig, overrides: list[str] | None, compose: Callable[[list[str]], DictConfig] | None = None
) -> dict[str, str]:
    """The keys whose value this command line sets: `key=value`, `~key`, a schema group (`cluster=dev`: its
    whole section), and for another group (`+experiment=NAME`) the keys it changes against the same command
    line without it (`compose`). Key -> the override that names it. Without overrides (an in-process caller):
    every section of `cfg`."""
    if overrides is None:
        return {str(k): f"{k!s}.* of the config given" for k in cfg.keys()}  # the sections: str keys
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    keys: dict[str, str] = {}
    lines = {id(o): str(o.input_line) for o in parsed}  # each override as given (parsed from text: never None)
    for o in parsed:
        key, line = o.key_or_group, lines[id(o)]
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if "." in key or "/" in key or key in SCHEMA_SECTIONS or key not in _groups():
            keys[key] = line  # a key, a schema group (its section), or a top-level key (deepspeed, dry_run)
            continue
        rest = [lines[id(x)] for x in parsed if x is not o]
        if compose is None:
            keys.update(dict.fromkeys(leaves(_container(cfg)), line))  # cannot tell what it set: all
            continue
        without = leaves(_container(compose(rest)))
        keys.update({k: line for k, v in leaves(_container(cfg)).items() if without.get(k, _ABSENT) != v})
    return keys


def _groups() -> set[str]:
    conf = Path(__file__).resolve().parents[2] / "conf"
    return {p.name for p in conf.iterdir() if p.is_dir()} if conf.is_dir() else set()


def resume_config(
    cfg: DictConfig,
    overrides: list[str] | None,
    run_dir: Path,
    compose: Callable[[list[str]], DictConfig] | None = None,
) -> Resume:
    """The config of a resume: the run's saved config, with the keys the command line names taken from `cfg`."""
    saved = load_saved(run_dir)
    merged: dict[str, Any] = _container(saved)
    named = named_keys(cfg, overrides, compose)
    for key in named:
        path = key.replace("[", ".").replace("]", "").split(".")
        value = OmegaConf.select(cfg, ".".join(path), default=_ABSENT, throw_on_missing=False)
        if value is _ABSENT:
            _delete(merged, path)
        else:
            _set(
                merged,
                path,
                OmegaConf.to_container(value, resolve=True, enum_to_str=True)
                if OmegaConf.is_config(value)
                else getattr(value, "value", value),
            )
    extra = {k: merged.pop(k) for k in list(merged) if k not in SCHEMA_SECTIONS and k != "dry_run"}
    try:
        typed = OmegaConf.merge(OmegaConf.structured(Config), merged)
    except OmegaConfBaseException:
        from hpctrain.checks.config import check_schema

        check_schema(as_config(OmegaConf.create(merged)))  # an unknown key: named, with the closest one
        raise
    assert isinstance(typed, DictConfig)  # a mapping merged onto the schema's
    with open_dict(typed):  # top-level keys outside the schema (+deepspeed=FILE) stay for what reads them
        for k, v in extra.items():
            typed[k] = v
    return Resume(run_dir=run_dir, saved=saved, cfg=as_config(typed), named=named)


def _set(node: Any, path: list[str], value: Any) -> None:
    for i, part in enumerate(path[:-1]):
        child = node[int(part)] if isinstance(node, list) else node.get(part)
        if child is None:
            child = [] if path[i + 1].isdigit() else {}
            node[part] = child
        node = child
    if isinstance(node, list):
        node[int(path[-1])] = value
    else:
        node[path[-1]] = value


def _delete(node: Any, path: list[str]) -> None:
    for part in path[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.get(part)
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)
