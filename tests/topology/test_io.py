"""Topology files and specs (gradsync.topology.io): the minimal YAML form, save/load round trips, bad specs and files named."""
from __future__ import annotations

import json

import pytest

from gradsync.errors import TopologyError
from gradsync.topology import get_topology, load, save


def test_minimal_yaml_form_and_unit_default(tmp_path):
    f = tmp_path / "box.yaml"
    f.write_text(
        "name: my-box\n"
        "devices: [{name: gpu0, kind: gpu}, {name: gpu1, kind: gpu}, {name: plx0, kind: switch}]\n"
        "links: [{a: gpu0, b: plx0, bandwidth_GBps: 12, latency_s: 0.0}, {a: gpu1, b: plx0, bandwidth_GBps: 12}]\n"
    )
    t = get_topology(str(f))
    assert t.ranks == ("gpu0", "gpu1") and t.unit_bandwidth_GBps == 12 and t.has_forwarders


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_save_load_roundtrip(tmp_path, suffix):
    for spec in ["p2.16xlarge", "minsky:2", "dgx1"]:
        t = get_topology(spec)
        back = load(save(t, tmp_path / f"t{suffix}"))
        assert back == t and back.to_dict() == t.to_dict()


@pytest.mark.parametrize("spec, message", [
    ("nosuch", "unknown topology 'nosuch'; known:"),
    ("ring", "takes 1 argument"),
    ("ring:1", "n >= 2"),
    ("dgx1[0,9]", "out of range"),
    ("ring:4[1,1]", "names a rank twice"),
    ("ring:4:3", "cannot read topology spec"),
])
def test_bad_specs(spec, message):
    with pytest.raises(TopologyError, match=message.replace("[", r"\[")):
        get_topology(spec)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TopologyError, match="not valid JSON"):
        load(bad)
    with pytest.raises(TopologyError, match="does not exist"):
        load(tmp_path / "missing.yaml")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"type": "gradsync.schedule"}))
    with pytest.raises(TopologyError, match="expected 'gradsync.topology'"):
        load(other)
