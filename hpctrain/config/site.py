"""Site profiles: config directories kept outside the checkout, named by `HPCTRAIN_CONFIG_PATH`.

A site's `cluster` file (partition, account, container, setup lines) belongs to the site, not to hpctrain: kept in
conf/ it is lost or conflicts at every upgrade. `HPCTRAIN_CONFIG_PATH=/site/conf:/home/me/conf` adds those
directories to Hydra's config search path, after hpctrain's own conf/, so `cluster=mysite` finds
/site/conf/cluster/mysite.yaml (docs/site_profiles.md). Hydra's own `hydra.searchpath=[file:///site/conf]` does the
same for one command. A name conf/ already has stays conf/'s: Hydra takes the first directory that holds it.
"""

from __future__ import annotations

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
    in order; empty entries (`a::b`, a trailing colon) name none."""
    return [Path(part).expanduser().resolve() for part in (value or "").split(os.pathsep) if part.strip()]


def site_problems(value: str | None) -> list[Problem]:
    """Each listed directory that does not exist: Hydra would skip it silently, and `cluster=mysite` would then
    fail with "Could not find 'cluster/mysite'" without saying where it was looked for."""
    return [Problem(VARIABLE, f"{d} is not a directory", f"export {VARIABLE} with existing directories, each "
                    "holding group folders such as cluster/ (e.g. /site/conf for /site/conf/cluster/mysite.yaml)")
            for d in site_dirs(value) if not d.is_dir()]


class SiteSearchPath(SearchPathPlugin):
    """Appends `HPCTRAIN_CONFIG_PATH`'s directories, read when Hydra builds its search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for directory in site_dirs(os.environ.get(VARIABLE)):
            search_path.append(provider=PROVIDER, path=f"file://{directory}")


def register_site_path() -> None:
    """Make Hydra ask `SiteSearchPath` (it only discovers plugins installed under `hydra_plugins`); idempotent."""
    Plugins.instance().register(SiteSearchPath)
