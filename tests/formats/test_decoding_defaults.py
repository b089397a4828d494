"""A model's decoding defaults (formats.decoding_defaults): typed, versioned, written and read in config.json; a
malformed block refuses the model directory naming it; each option is a DecodingOptions field."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from transduce.errors import CheckpointError, ConfigError
from transduce.formats.decoding_defaults import DEFAULTS_KEY, DecodingDefaults
from transduce.formats.model_dir import ModelDir


def test_round_trip_and_refusals():
    d = DecodingDefaults(source="generation_config.json", beam_size=6, max_len_b=511, forced_eos=True,
                         suppress=[[101]])
    assert DecodingDefaults.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    assert d.overrides() == {"beam_size": 6, "max_len_b": 511, "forced_eos": True, "suppress": ((101,),)}
    for bad, match in (({"version": 2, "options": {}}, "version 2"),
                       ({"version": 1, "options": {"beams": 4}}, "unknown option"),
                       ({"version": 1, "options": {"beam_size": "4"}}, "beam_size must be int"),
                       ({"version": 1, "options": {"forced_eos": 1}}, "forced_eos must be bool"),
                       ({"version": 1, "options": {"suppress": [101]}}, "suppress must be a list")):
        with pytest.raises(ConfigError, match=match):
            DecodingDefaults.from_dict(bad)


def test_every_option_is_a_decoding_option():
    from transduce.runtime.decoding import DecodingOptions

    names = {f.name for f in dataclasses.fields(DecodingDefaults)} - {"source"}
    assert names <= set(DecodingOptions.names())


def test_a_malformed_block_refuses_the_model_directory(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, DEFAULTS_KEY: {"version": 1, "options": {"beam_size": -1.5}}}))
    with pytest.raises(CheckpointError, match="beam_size must be int"):
        ModelDir.load(d)
