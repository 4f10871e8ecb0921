"""The config read as its schema's dataclass and as the OmegaConf node it is at run time (hpctrain.config.schema:
`as_config`, `as_node`, `to_plain`): the code types a config as `Config` (Hydra's structured configs), and these
are the one place that says a node is one, or needs the node back."""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, OmegaConf, open_dict

from hpctrain.config.schema import Config, as_config, as_node, to_plain


def test_a_merged_node_reads_as_the_schema_and_gives_its_node_back() -> None:
    node = OmegaConf.merge(OmegaConf.structured(Config), {"train": {"max_steps": 7}})
    cfg = as_config(node)
    assert cfg is node and cfg.train.max_steps == 7
    back = as_node(cfg)
    with open_dict(back):  # what the launcher does with a key outside the schema (+deepspeed=FILE)
        back["deepspeed"] = "ds.json"
    assert "deepspeed" in as_node(cfg) and isinstance(back, DictConfig)


def test_what_is_no_config_node_is_refused() -> None:
    with pytest.raises(TypeError, match="mapping of sections"):
        as_config(OmegaConf.create([1, 2]))
    with pytest.raises(TypeError, match="DictConfig"):
        as_node(Config())  # the dataclass itself has no node for OmegaConf's functions


def test_plain_data_has_its_interpolations_resolved() -> None:
    cfg = as_config(OmegaConf.merge(OmegaConf.structured(Config), {"run": {"name": "r-${train.seed}"}}))
    plain = to_plain(cfg)
    assert plain["run"]["name"] == f"r-{cfg.train.seed}"
    assert type(plain) is dict and type(plain["train"]) is dict
