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


# ---- hostile or huge files (issue 42): refused at once, the limit named, exit 2 from the CLI --------------------
_RING = ("name: r\ndevices: [{name: g0}, {name: g1}]\n"
         "links: [{a: g0, b: g1, bandwidth_GBps: 1}]\n")


def _laughs(levels: int = 9) -> str:
    """A "billion laughs": 9 aliases per level, 9 levels: 9^9 values once expanded, a few hundred bytes here."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return _RING + "attrs:\n" + "".join(f"  {line}\n" for line in lines)


def _cli(tmp_path, name: str, text: str, *args: str):  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    path = tmp_path / name
    path.write_text(text)
    root = Path(__file__).resolve().parents[2]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gradsync", *args[:2], str(path), *args[2:]], capture_output=True, text=True,
                       timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    return p, time.monotonic() - t0


@pytest.mark.parametrize("name, text, limit", [
    ("laughs.yaml", _laughs(), "more than 2000000 values once its YAML aliases"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "more than 64 deep"),
    ("deep.yaml", "name: x\nattrs: {a: " + "[" * 100_000 + "]" * 100_000 + "}\n", "more than 64 deep"),
    ("huge.json", json.dumps({"name": "big", "devices": [{"name": f"gpu{i}"} for i in range(240_000)],
                              "links": []}), "more than the limit of 4194304 bytes"),
])
def test_hostile_topology_files_exit_2_within_10_s_naming_the_limit(tmp_path, name, text, limit):
    p, took = _cli(tmp_path, name, text, "topo", "export", "-o", str(tmp_path / "out.yaml"))
    assert len(text) > 5_000_000 or name != "huge.json"
    assert p.returncode == 2 and limit in p.stderr, p.stderr[-2000:]
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr and "GRADSYNC_MAX_INPUT_" in p.stderr
    assert took < 10, took
    assert not (tmp_path / "out.yaml").exists()


def test_yaml_limits_allow_ordinary_aliases_and_can_be_raised(tmp_path, monkeypatch):
    from gradsync.paths import parse_yaml

    shared = _RING + "attrs: {base: &b {x: 1, y: [1, 2]}, again: *b, twice: [*b, *b]}\n"
    f = tmp_path / "shared.yaml"
    f.write_text(shared)
    assert load(f).attrs["twice"] == [{"x": 1, "y": [1, 2]}] * 2
    small = _laughs(levels=3)  # 9^3 lols: fine by default, refused under a limit of 500 values
    assert parse_yaml(small, "t", TopologyError)["attrs"]["a2"][0][0] == ["lol"] * 9
    monkeypatch.setenv("GRADSYNC_MAX_INPUT_VALUES", "500")
    with pytest.raises(TopologyError, match="more than 500 values.*GRADSYNC_MAX_INPUT_VALUES=N"):
        parse_yaml(small, "t", TopologyError)
    with pytest.raises(TopologyError, match="more than 500 values"):  # a recursive alias never ends
        parse_yaml("a: &a [1, *a]\n", "t", TopologyError)
    monkeypatch.setenv("GRADSYNC_MAX_INPUT_DEPTH", "200")
    assert parse_yaml("[" * 150 + "]" * 150, "t", TopologyError) == _nested(150)


def _nested(depth: int) -> list:  # type: ignore[type-arg]
    out: list = []  # type: ignore[type-arg]
    for _ in range(depth - 1):
        out = [out]
    return out


def test_size_limit_can_be_raised(tmp_path, monkeypatch):
    f = tmp_path / "ring.yaml"
    f.write_text(_RING + "#" * 5000 + "\n")
    monkeypatch.setenv("GRADSYNC_MAX_INPUT_BYTES", "1000")
    with pytest.raises(TopologyError, match=r"is 5\d{3} bytes, more than the limit of 1000 bytes.*"
                                            r"GRADSYNC_MAX_INPUT_BYTES=5\d{3}"):
        load(f)
    monkeypatch.setenv("GRADSYNC_MAX_INPUT_BYTES", "100000")
    assert load(f).name == "r"
