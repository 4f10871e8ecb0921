"""Site profiles: config directories kept outside the checkout, named by `HPCTRAIN_CONFIG_PATH`.

A site's `cluster` file (partition, account, container, setup lines) belongs to the site, not to hpctrain: kept in
conf/ it is lost or conflicts at every upgrade. `HPCTRAIN_CONFIG_PATH=/site/conf:/home/me/conf` adds those
directories to Hydra's config search path, after hpctrain's own conf/, so `cluster=mysite` finds
/site/conf/cluster/mysite.yaml (docs/site_profiles.md). Hydra's own `hydra.searchpath=[file:///site/conf]` does the
same for one command. A name conf/ already has stays conf/'s: Hydra takes the first directory that holds it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin

from hpctrain.config.problems import Problem

VARIABLE = "HPCTRAIN_CONFIG_PATH"
PROVIDER = "hpctrain-site"


def site_dirs(value: str | None) -> list[Path]:
    """The directories of a colon-separated list, absolute (a relative one is read from this working directory),
    in order; empty entries (`a::b`, a trailing colon) name none. An entry that cannot be resolved (a loop of
    symbolic links) stays as written, made absolute: `site_problems` names it."""
    return [_absolute(part)[0] for part in _entries(value)]


def _entries(value: str | None) -> list[str]:
    return [part for part in (value or "").split(os.pathsep) if part.strip()]


def _absolute(part: str) -> tuple[Path, str]:
    """The entry resolved, and "" or why it cannot be (Python 3.11 raises RuntimeError on a loop, 3.13 OSError)."""
    path = Path(part).expanduser()
    try:
        return path.resolve(), ""
    except (OSError, RuntimeError) as err:
        return Path(os.path.abspath(path)), str(getattr(err, "strerror", None) or err)


FIX = (
    f"export {VARIABLE} with existing, readable directories, each holding group folders such as cluster/ "
    "(e.g. /site/conf for /site/conf/cluster/mysite.yaml)"
)


def site_problems(value: str | None) -> list[Problem]:
    """What is wrong with the listed directories, each named: one that does not exist (Hydra would skip it silently,
    and `cluster=mysite` would then fail with "Could not find 'cluster/mysite'" without saying where it was looked
    for), a loop of symbolic links, a directory that cannot be read, and a group folder inside one that cannot be
    (a loop, no permission: Hydra would skip it as silently)."""
    problems = []
    for part in _entries(value):
        directory, loop = _absolute(part)
        if loop:
            problems.append(
                Problem(
                    VARIABLE,
                    f"{directory} cannot be resolved: a loop of symbolic links ({loop})",
                    f"point the link at a real directory, or drop it from {VARIABLE}",
                )
            )
        elif not directory.is_dir():
            problems.append(Problem(VARIABLE, f"{directory} is not a directory", FIX))
        else:
            problems += _unreadable(directory)
    return problems


def _unreadable(directory: Path) -> list[Problem]:
    """The directory, or the group folders in it, that cannot be read (no permission, a loop of symbolic links):
    why, for each. A dangling link is no group folder, and left alone."""
    try:
        entries = sorted(os.listdir(directory))
    except OSError as err:
        return [
            Problem(
                VARIABLE,
                f"{directory} cannot be read: {err.strerror or err}",
                f"make it readable (and searchable: r-x) by this user, or drop it from {VARIABLE}",
            )
        ]
    found = []
    for name in entries:
        entry = directory / name
        if entry.is_symlink():
            try:
                entry.resolve(strict=True)
            except RuntimeError as err:  # Python 3.11's loop
                found.append(_loop(entry, str(err)))
                continue
            except OSError as err:
                if err.errno == errno.ELOOP:
                    found.append(_loop(entry, str(err.strerror)))
                continue
        if entry.is_dir():
            try:
                os.listdir(entry)
            except OSError as err:
                found.append(
                    Problem(
                        VARIABLE,
                        f"{entry} cannot be read: {err.strerror or err}",
                        "make it readable (and searchable: r-x) by this user, or remove it",
                    )
                )
    return found


def _loop(entry: Path, why: str) -> Problem:
    return Problem(
        VARIABLE,
        f"{entry} cannot be resolved: a loop of symbolic links ({why})",
        "point the link at a real directory, or remove it",
    )


class SiteSearchPath(SearchPathPlugin):
    """Appends `HPCTRAIN_CONFIG_PATH`'s directories, read when Hydra builds its search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for directory in site_dirs(os.environ.get(VARIABLE)):
            search_path.append(provider=PROVIDER, path=f"file://{directory}")


def register_site_path() -> None:
    """Make Hydra ask `SiteSearchPath` (it only discovers plugins installed under `hydra_plugins`); idempotent."""
    Plugins.instance().register(SiteSearchPath)
