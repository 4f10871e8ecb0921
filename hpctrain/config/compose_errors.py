"""Hydra's own errors as hpctrain's: every one at once, each naming the key, what is wrong and the fix.

Hydra stops at the first thing it cannot compose (an unknown key, a value of the wrong type, a group option that
is not there, a file that is not YAML) and `hydra.main` prints it and exits 1. `python -m hpctrain` asks
`compose_problems` first, with the same overrides and search path: it composes the command line and, while that
fails, takes out the override at fault (the one the error names, else the first whose prefix of the command line
fails), keeps its problem and composes the rest again, until what is left composes. So `model.n_layer=3
parallel.tp=two model=gpt5` reports all three. In a multirun every value of a sweep is checked, each in the place
of the first. Nothing is written: composition only reads the config files.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from hpctrain.config.problems import Problem
from hpctrain.config.schema import Config
from hpctrain.config.site import VARIABLE, site_dirs

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
# Values that mean something else than what they say: (key, value) -> the fix.
HINTS = {
    ("precision.dtype", "fp8"): "FP8 is not a dtype of its own: precision=bf16 precision.fp8=tensorwise (or rowwise, "
    "rowwise_with_gw_hp) runs the blocks' GEMMs in FP8 (docs/fp8.md)",
    ("plan.simulate_device", "gpu"): "did you mean plan.simulate_device=cuda?",
    ("cluster.container.runtime", "docker"): "Slurm runs containers through pyxis (enroot, which imports docker "
    "images) or apptainer: cluster.container.runtime=pyxis",
    ("cluster.container.runtime", "enroot"): "did you mean cluster.container.runtime=pyxis?",
    ("cluster.container.runtime", "singularity"): "did you mean cluster.container.runtime=apptainer?",
}

Compose = Callable[[list[str]], DictConfig]  # the command line's overrides -> the config, or Hydra's exception


@dataclass(frozen=True)
class _Item:
    """One override of the command line: its key as named in the config, and what is composed for it (one
    override; a sweep's values one by one)."""

    text: str
    key: str
    values: tuple[str, ...]


def compose_problems(
    overrides: Sequence[str], config_dir: Path, config_name: str = "config", multirun: bool = False
) -> list[Problem]:
    """Everything Hydra would refuse in `python -m hpctrain [-m] OVERRIDES`, composed as `hydra.main` does (the
    primary config in `config_dir`, the site directories of HPCTRAIN_CONFIG_PATH through hpctrain.config.site's
    plugin, `hydra.searchpath`); [] when it composes. Writes nothing."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(version_base=None, config_dir=str(config_dir)):
        loader = GlobalHydra.instance().config_loader()
        return find_problems(
            list(overrides),
            lambda ovs: compose(config_name=config_name, overrides=ovs, return_hydra_config=True),
            search_dirs(overrides, config_dir),
            multirun,
            loader,
        )


def search_dirs(overrides: Sequence[str], config_dir: Path) -> list[Path]:
    """Where composition looks for `group/option.yaml`: conf/, the site directories, `hydra.searchpath`'s files."""
    dirs = [Path(config_dir), *site_dirs(os.environ.get(VARIABLE))]
    for text in overrides:
        if text.lstrip("+").startswith("hydra.searchpath="):
            dirs += [Path(p) for p in re.findall(r"file://([^,\]'\"\s]+)", text)]
    return dirs


def find_problems(
    overrides: list[str], compose: Compose, dirs: Sequence[Path], multirun: bool = False, config_loader: Any = None
) -> list[Problem]:
    """The problems of a command line, given how it composes (`compose` raises Hydra's exception)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create(config_loader=config_loader)
    problems: dict[int, Problem] = {}  # by the override's place on the command line
    items: list[_Item] = []
    places: list[int] = []  # each item's place
    for place, text in enumerate(overrides):
        try:
            [override] = parser.parse_overrides([text])
        except Exception as exc:  # noqa: BLE001  (OverrideParseException: not the override grammar)
            problems[place] = _parse_problem(text, exc)
            continue
        key = override.key_or_group
        if not override.is_sweep_override():
            items.append(_Item(text, key, (text,)))
            places.append(place)
            continue
        problem = _sweep_problem(text, key, override, multirun)
        if problem is None:
            try:
                element = override.get_key_element()
                items.append(_Item(text, key, tuple(f"{element}={v}" for v in override.sweep_string_iterator())))
                places.append(place)
                continue
            except Exception as exc:  # noqa: BLE001  (a glob that matches nothing, a range Hydra cannot expand)
                problem = Problem(
                    key,
                    f"the sweep {text!r} cannot be expanded: {_first_line(exc)}",
                    f"list the values: {key}=a,b,c ({GRAMMAR})",
                )
        problems[place] = problem
    bad: dict[int, Problem] = {}
    composed: DictConfig | None = None
    for _ in range(len(items) + 1):
        active = [i for i in range(len(items)) if i not in bad]
        composed, error = _attempt(compose, [items[i].values[0] for i in active])
        if error is None:
            break
        culprit = _culprit(error, items, active)
        if culprit is None:
            culprit, error = _first_failing(compose, items, active)
        if culprit is None:  # fails without any override (a broken file of conf/), or cannot be pinned down
            problems[-1] = _problem(error, None, "", dirs)
            break
        bad[culprit] = _problem(error, items[culprit].key, items[culprit].values[0], dirs)
    if composed is not None:  # the other values of each sweep, each in the place of its first
        for i, item in enumerate(items):
            scratch = copy.deepcopy(composed) if len(item.values) > 1 else composed
            for value in item.values[1:]:
                error = _check_value(compose, scratch, items, bad, i, value)
                if error is not None:
                    bad.setdefault(i, _problem(error, item.key, value, dirs))
    problems.update({places[i]: problem for i, problem in bad.items()})
    return [problems[place] for place in sorted(problems)]


def _attempt(compose: Compose, overrides: list[str]) -> tuple[DictConfig | None, BaseException | None]:
    try:
        return compose(overrides), None
    except Exception as exc:  # noqa: BLE001  (whatever Hydra, OmegaConf or YAML raise: the error to report)
        return None, exc


def _first_failing(compose: Compose, items: list[_Item], active: list[int]) -> tuple[int | None, BaseException]:
    """The override whose prefix of the command line is the shortest that fails, and its error; None when the
    config fails without any override."""
    exc: BaseException | None = None
    for n in range(len(active) + 1):
        _, exc = _attempt(compose, [items[i].values[0] for i in active[:n]])
        if exc is not None:
            return (active[n - 1] if n else None), exc
    return None, exc or RuntimeError("the command line composes one override at a time, not all at once")


def _check_value(
    compose: Compose, scratch: DictConfig, items: list[_Item], bad: dict[int, Problem], i: int, value: str
) -> BaseException | None:
    """A sweep's other value: a key's set on `scratch`, a copy of the composed config, as Hydra applies an override
    (only that key changes, so the values may follow each other); a group's (or an added key's) composed with the
    rest of the command line."""
    key = items[i].key
    if "." in key and "/" not in key and not key.startswith("hydra") and not value.startswith(("+", "~")):
        try:
            from hydra._internal.config_loader_impl import ConfigLoaderImpl
            from hydra.core.override_parser.overrides_parser import OverridesParser

            ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides([value]), scratch)
            return None
        except ImportError:  # Hydra moved it: compose instead
            pass
        except Exception as exc:  # noqa: BLE001  (the error to report)
            return exc
    line = [value if j == i else items[j].values[0] for j in range(len(items)) if j == i or j not in bad]
    return _attempt(compose, line)[1]


def _culprit(exc: BaseException, items: list[_Item], active: list[int]) -> int | None:
    """The override the error is about, when it names one (its key, its group, its whole text)."""
    from hydra.errors import MissingConfigException

    text = str(exc)
    # a file's error is the override's that chose the file: its group first, then the keys and groups named
    keys = [path.rpartition("/")[0] for path in re.findall(r"^In '([^']+)':", text, re.MULTILINE) if "/" in path]
    keys += [m.group(1) for m in re.finditer(r"(?:override|at|from config\.|delete) '([^']+)'", text)]
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        keys.append(exc.missing_cfg_file.rpartition("/")[0])
    merging = re.match(r"Error merging override (.+)", text)
    mark = getattr(_yaml_error(exc), "problem_mark", None)
    if mark is not None:
        keys.append(Path(str(mark.name)).parent.name)
    for i in reversed(active):  # the last override of a key is the one that counts
        if merging and items[i].values[0] == merging.group(1).strip():
            return i
    for key in keys:
        for i in reversed(active):
            if items[i].key == key or items[i].key == key.replace("/", "."):
                return i
    return None


def _problem(exc: BaseException, key: str | None, text: str, dirs: Sequence[Path]) -> Problem:
    """One Problem for Hydra's exception about the override `text` (of `key`); key None, text "": an error of the
    config itself, with no override at fault."""
    from hydra.errors import MissingConfigException

    error = _yaml_error(exc)
    if error is not None:
        return _yaml_problem(error, key)
    if isinstance(exc, MissingConfigException):
        return _missing_problem(exc, key, text, dirs)
    cause = _omegaconf_cause(exc)
    message = str(exc)
    inside = re.match(r"In '([^']+)': \w+ raised while composing config", message)
    where = _where(inside.group(1), cause, dirs) if inside else ""
    if cause is not None and getattr(cause, "full_key", None):
        full_key = str(cause.full_key)
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            return _unknown_key(full_key, text, where)
        if isinstance(cause, ValidationError):
            return _wrong_value(full_key, cause, where)
    name = key or "hydra"
    m = re.match(r"Could not override '([^']+)'\. No match in the defaults list", message)
    if m:
        return Problem(
            m.group(1),
            f"is a config group the defaults list does not hold, so {text!r} has nothing to replace",
            f"add it with a +: +{text}",
        )
    m = re.match(r"Could not append to config\. An item is already at '([^']+)'", message)
    if m:
        return Problem(
            m.group(1), "already has a value: + adds a key that is not there yet", f"drop the +: {text.lstrip('+')}"
        )
    m = re.match(r"Could not delete from config\. '([^']+)' does not exist", message)
    if m:
        return Problem(m.group(1), "is not in the config, so ~ has nothing to delete", suggest_key(m.group(1)))
    if isinstance(exc, OSError) and exc.filename:
        return _os_problem(exc, name, dirs)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = re.sub(r"^In '[^']+': ", "", lines[0]) if lines else type(exc).__name__
    return Problem(
        name,
        f"{first}{where}" + (f" ({text})" if text and text not in first else ""),
        " ".join(lines[1:]) or f"check it against Hydra's override grammar ({GRAMMAR}) and python -m hpctrain --help",
    )


def _unknown_key(key: str, text: str, where: str) -> Problem:
    typed = re.split(r"[=@]", text.lstrip("+~"), maxsplit=1)[0] if text and not where else ""
    if typed.startswith(key + "."):  # `paralel.tp=2`: Hydra names `paralel`; the command line said more
        key = typed
    if key == "hydra" or key.startswith("hydra."):
        return Problem(
            key,
            f"is not a key of Hydra's config{where}",
            "python -m hpctrain --hydra-help lists Hydra's own; hpctrain's: python -m hpctrain --cfg job",
        )
    parent = key.rpartition(".")[0]
    node = _schema_node(parent) if parent else None
    if OmegaConf.is_dict(node) and OmegaConf.get_type(node) is dict:  # a map of names (cluster.env, sbatch_extra)
        return Problem(
            key,
            f"is a new entry of {parent}, a map of names to values{where}",
            f"add it with a +: +{text}"
            if text and not where
            else f"write it under {parent}: in the file, or +{key}=VALUE on the command line",
        )
    return Problem(key, f"is not a key of hpctrain's config schema{where}", suggest_key(key))


def suggest_key(key: str) -> str:
    """The fix for a key the schema does not have: the same name in another section (train.lr -> optim.lr), else the
    closest name in its section, else the closest whole key (paralel.tp -> parallel.tp), else the section's keys."""
    keys = _schema_keys()
    parent, _, name = key.rpartition(".")
    elsewhere = [k for k in keys if k.rpartition(".")[2] == name and k != key]
    if elsewhere:
        return f"did you mean {elsewhere[0]}?"
    node = _schema_node(parent) if parent else _schema()
    known = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []  # noqa: SIM118 (MISSING ones too)
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"did you mean {parent + '.' if parent else ''}{close[0]}?"
    close = difflib.get_close_matches(key, keys, n=1)
    if close:
        return f"did you mean {close[0]}?"
    return f"remove it; the keys of {parent or 'the config'} are: {', '.join(known)}"


def _schema_keys() -> list[str]:
    """Every key of the schema, dotted, sections included (a MISSING value is a key too: `in` would say no)."""
    found: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for k in node.keys():  # noqa: SIM118 (the keys, MISSING ones included)
            path = f"{prefix}{k!s}"  # a schema's keys are field names: str
            found.append(path)
            child = node._get_node(k)
            if isinstance(child, DictConfig) and OmegaConf.get_type(child) is not dict:
                walk(child, path + ".")

    walk(_schema(), "")
    return found


def _wrong_value(key: str, cause: OmegaConfBaseException, where: str) -> Problem:
    """A value the schema's type refuses: the type expected, the value given, the allowed ones."""
    value = getattr(cause, "value", None)
    kind = _schema_kind(key)
    default = _schema_default(key)
    given = f"got {value!r}" + (f" ({type(value).__name__})" if value is not None else "")
    hint = HINTS.get((key, str(value)))
    if isinstance(kind, type) and issubclass(kind, Enum):
        allowed = [m.name for m in kind]
        close = difflib.get_close_matches(str(value), allowed, n=1)
        return Problem(
            key,
            f"{value!r} is not one of {', '.join(allowed)}{where}",
            hint or (f"did you mean {key}={close[0]}?" if close else f"set {key} to one of them"),
        )
    what = _describe(kind)
    if "is not Optional" in str(cause.msg):
        return Problem(key, f"cannot be null: it takes {what}{where}", f"give {what}" + _example(key, default))
    if kind is list:
        return Problem(
            key, f"takes a list, {given}{where}", f"write a list: {key}=[a,b] (quoted for the shell: '{key}=[a, b]')"
        )
    if kind is dict or (isinstance(kind, type) and kind.__module__ == Config.__module__):
        children = [f"{key}.{k}" for k in (_schema_node(key) or {})][:6]
        return Problem(
            key,
            f"is a section of the config, not one value: {given}{where}",
            f"set its keys, one by one: {', '.join(children)}" if children else f"{key}.NAME=value",
        )
    return Problem(key, f"takes {what}, {given}{where}", hint or f"give {what}" + _example(key, default))


def _describe(kind: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        kind, "a value of its type"
    )


def _example(key: str, default: Any) -> str:
    if default is None or OmegaConf.is_config(default) or default == "???":
        return ""
    shown = str(default).lower() if isinstance(default, bool) else getattr(default, "value", default)
    return f", e.g. {key}={shown}"


def _schema() -> DictConfig:
    schema: DictConfig = OmegaConf.structured(Config)
    return schema


def _schema_node(key: str) -> Any:
    try:
        return OmegaConf.select(_schema(), key, throw_on_missing=False)
    except OmegaConfBaseException:
        return None


def _schema_kind(key: str) -> Any:
    """The schema's type of `key`: int, float, bool, str, an Enum, list, dict, a section's dataclass; None."""
    parent, _, name = key.rpartition(".")
    node = _schema_node(parent) if parent else _schema()
    if not OmegaConf.is_dict(node) or name not in node.keys():  # noqa: SIM118 (`in` is False for MISSING)
        return None
    child = node._get_node(name)
    assert child is not None  # `name in node.keys()` above
    ref = child._metadata.ref_type
    origin = getattr(ref, "__origin__", None)
    if origin in (list, dict):
        return origin
    if origin is not None:  # Optional[X]
        args = [a for a in getattr(ref, "__args__", ()) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return ref if isinstance(ref, type) else None


def _schema_default(key: str) -> Any:
    parent, _, name = key.rpartition(".")
    node = _schema_node(parent) if parent else _schema()
    if not OmegaConf.is_dict(node) or name not in node.keys():  # noqa: SIM118 (`in` is False for MISSING)
        return None
    child = node._get_node(name)
    assert child is not None  # `name in node.keys()` above
    return None if OmegaConf.is_config(child) or child._is_missing() else child._value()


def _missing_problem(exc: Any, key: str | None, text: str, dirs: Sequence[Path]) -> Problem:
    """`model=gpt5`: no such option of the group; the options (conf/ and the site directories') and the closest."""
    group, _, option = str(exc.missing_cfg_file).rpartition("/")
    options = sorted(exc.options or {p.stem for d in dirs for p in (d / group).glob("*.yaml")})
    within = re.match(r"In '([^']+)':", str(exc))
    source = within.group(1) if within and within.group(1) != "config" else ""
    looked = ", ".join(str(d) for d in dirs)
    if not group:
        return Problem(key or "hydra", f"the config {option!r} is not in {looked}", "check --config-name")
    if not source and key and key != group.replace("/", ".") and "=" in text:  # from the file an override chose
        source = f"{key.replace('.', '/')}/{text.partition('=')[2]}"
    name = group.replace("/", ".") if source or not key else key
    origin = f" (named in the defaults list of {_locate(source, dirs) or source})" if source else ""
    close = difflib.get_close_matches(option, options, n=1)
    left = text.partition("=")[0] if text and not source else group
    add = f"add {group}/{option}.yaml to a site directory ({VARIABLE}, docs/site_profiles.md)"
    return Problem(
        name,
        f"{option!r} is not an option of {group}{origin}: there is no {group}/{option}.yaml in "
        f"{looked}; the options: {', '.join(options) or 'none'}",
        (f"correct that defaults list ({close[0]}?), or {add}" if close else f"correct that defaults list, or {add}")
        if source
        else f"did you mean {left}={close[0]}? Or {add}"
        if close
        else f"pick one of the options, or {add}",
    )


def _yaml_error(exc: BaseException) -> Any:
    """The YAML error under Hydra's exception, if a file did not parse."""
    import yaml

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, yaml.YAMLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _yaml_problem(error: Any, key: str | None) -> Problem:
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    path = str(mark.name) if mark is not None else "a config file"
    line = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    context_mark = getattr(error, "context_mark", None)
    opened = f" ({context} at line {context_mark.line + 1})" if context and context_mark is not None else ""
    return Problem(
        key or Path(path).parent.name,
        f"{path}{line}: not valid YAML: {problem}{opened}",
        f"correct {path} at line {mark.line + 1 if mark is not None else '?'} (key: value, one per "
        "line; a list [a, b]; quote a value holding ': ' or ' #')",
    )


def _os_problem(exc: OSError, key: str, dirs: Sequence[Path]) -> Problem:
    path = Path(str(exc.filename))
    site = site_dirs(os.environ.get(VARIABLE))
    if any(path == d or d in path.parents for d in site):
        key = VARIABLE
    return Problem(
        key,
        f"{path} cannot be read: {exc.strerror or exc}",
        f"make it readable by this user, or drop it from {VARIABLE}",
    )


def _omegaconf_cause(exc: BaseException) -> Any:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OmegaConfBaseException):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _locate(config_path: str, dirs: Sequence[Path]) -> str:
    for d in dirs:
        path = d / f"{config_path}.yaml"
        if path.is_file():
            return str(path)
    return ""


def _where(config_path: str, cause: Any, dirs: Sequence[Path]) -> str:
    """` (in FILE, line N)` for an error inside a config file."""
    path = _locate(config_path, dirs)
    if not path:
        return f" (in {config_path})"
    line = None
    full_key = str(getattr(cause, "full_key", "") or "")
    group = config_path.rpartition("/")[0].replace("/", ".")
    for candidate in ([full_key[len(group) + 1 :]] if group and full_key.startswith(group + ".") else []) + [full_key]:
        line = _line_of(Path(path), candidate.split(".")) if candidate else None
        if line:
            break
    return f" (in {path}" + (f", line {line})" if line else ")")


def _line_of(path: Path, keys: list[str]) -> int | None:
    """The line of a key (a path of names) in a YAML file, or None."""
    import yaml

    try:
        node = yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for name in keys:
        if not isinstance(node, yaml.MappingNode):
            return None
        for k, v in node.value:
            if getattr(k, "value", None) == name:
                line, node = k.start_mark.line + 1, v
                break
        else:
            return None
    return line


def _parse_problem(text: str, exc: BaseException) -> Problem:
    key = text.split("=", 1)[0].lstrip("+~") if "=" in text else text
    return Problem(
        key or text,
        f"{text!r} is not an override Hydra can read: {_first_line(exc)}",
        "key=value; quote a value holding spaces, commas, brackets or '$': "
        f"\"key='a value'\"; a list is key=[a,b] ({GRAMMAR})",
    )


def _sweep_problem(text: str, key: str, override: Any, multirun: bool) -> Problem | None:
    if not multirun:
        return Problem(
            key,
            f"{text!r} is several values: a sweep, which needs -m",
            f"add -m for one run per value (python -m hpctrain -m {text}); for a list value write "
            f"{key}=[a,b], for a string with a comma quote it: {key}='a,b'",
        )
    if override.is_hydra_override():
        return Problem(key, f"{text!r} sweeps a key of Hydra's own", "sweep hpctrain's keys only")
    if not override.is_discrete_sweep():
        return Problem(
            key,
            f"{text!r} is an interval: Hydra's basic sweeper cannot enumerate it",
            f"list the values, {key}=a,b,c, or use range(start,stop,step)",
        )
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
