"""Load and save topologies as JSON or YAML, and resolve ``--topology`` specs.

The file format (documented in the README) is the minimal form

    name: my-box
    devices: [{name: gpu0, kind: gpu}, {name: gpu1, kind: gpu}, {name: plx0, kind: switch}]
    links: [{a: gpu0, b: plx0, bandwidth_GBps: 12, latency_s: 0.0}, {a: gpu1, b: plx0, bandwidth_GBps: 12}]

plus optional ``ranks``, ``unit_bandwidth_GBps``, per-link ``kind`` and per-device ``attrs``. An asymmetric link
gives ``bandwidth_up_GBps`` (``a -> b``) and ``bandwidth_down_GBps`` (``b -> a``) instead of ``bandwidth_GBps``. YAML is read
with ``safe_load`` (no code execution); unknown keys are errors so typos do not pass silently.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from gradsync.errors import TopologyError
from gradsync.paths import parse_json, parse_yaml, read_input, write_text
from gradsync.topology.builders import BUILDERS
from gradsync.topology.model import Device, Link, Topology

__all__ = ["from_dict", "load", "save", "get_topology", "parse_spec", "MAX_TOPOLOGY_BYTES"]

#: Largest topology file read (GRADSYNC_MAX_INPUT_BYTES overrides): a 4 MiB file already describes some
#: 50,000 devices, more than the planners handle in reasonable time
MAX_TOPOLOGY_BYTES = 4 << 20

_TOP_KEYS = {"type", "version", "name", "devices", "links", "ranks", "unit_bandwidth_GBps", "attrs"}
_DEVICE_KEYS = {"name", "kind", "attrs"}
_LINK_KEYS = {"a", "b", "bandwidth_GBps", "bandwidth_up_GBps", "bandwidth_down_GBps", "latency_s", "kind"}
_SPEC = re.compile(r"^(?P<name>[A-Za-z][\w.\-]*)(?::(?P<args>[0-9,\s]+))?(?:\[(?P<sel>[0-9,\s]*)\])?$")


def _where(source: str) -> str:
    return f" in {source}" if source else ""


def _check_keys(obj: Any, allowed: set[str], what: str, source: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise TopologyError(f"{what}{_where(source)} must be a mapping, got {type(obj).__name__}: {obj!r}")
    extra = sorted(set(obj) - allowed)
    if extra:
        raise TopologyError(f"{what}{_where(source)} has unknown field(s) {extra}; allowed: {sorted(allowed)}")
    return obj


def _link_bandwidths(lk: dict[str, Any], where: str) -> tuple[Any, Any]:
    """``bandwidth_GBps`` (both directions) or ``bandwidth_up_GBps`` (a -> b) with ``bandwidth_down_GBps`` (b -> a)."""
    directed = [k for k in ("bandwidth_up_GBps", "bandwidth_down_GBps") if k in lk]
    if "bandwidth_GBps" in lk:
        if directed:
            raise TopologyError(f"{where} gives bandwidth_GBps and {directed[0]}; give bandwidth_GBps for both "
                                f"directions or bandwidth_up_GBps and bandwidth_down_GBps, not both")
        return lk["bandwidth_GBps"], None
    if len(directed) == 1:
        missing = ({"bandwidth_up_GBps", "bandwidth_down_GBps"} - set(directed)).pop()
        raise TopologyError(f"{where} gives only {directed[0]}: one-way links are not supported (they can "
                            f"disconnect the reduce or the broadcast); give {missing} too")
    if not directed:
        raise TopologyError(f"{where} is missing 'bandwidth_GBps' (or bandwidth_up_GBps and bandwidth_down_GBps)")
    for key in directed:
        bw = lk[key]
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0 or bw == float("inf"):
            raise TopologyError(f"{where} has {key}={bw!r}; it must be a positive number of GB/s (one-way links "
                                f"are not supported: give both directions a bandwidth)")
    return lk["bandwidth_up_GBps"], lk["bandwidth_down_GBps"]


def from_dict(data: Any, source: str = "") -> Topology:
    """Build a validated :class:`Topology` from the documented plain-data form.

    A field of the wrong type deep inside (a list where a name or a number belongs) is a
    :class:`TopologyError` naming the file, as every other malformed input is, never a bare TypeError."""
    try:
        return _from_dict(data, source)
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        if isinstance(exc, TopologyError):
            raise
        raise TopologyError(f"malformed topology{_where(source)}: {type(exc).__name__}: {exc}") from None


def _from_dict(data: Any, source: str = "") -> Topology:
    data = _check_keys(data, _TOP_KEYS, "topology", source)
    if data.get("type", "gradsync.topology") != "gradsync.topology":
        raise TopologyError(f"file{_where(source)} has type {data['type']!r}, expected 'gradsync.topology'")
    for key in ("name", "devices", "links"):
        if key not in data:
            raise TopologyError(f"topology{_where(source)} is missing the required field {key!r}")
    if not isinstance(data["devices"], list) or not isinstance(data["links"], list):
        raise TopologyError(f"topology{_where(source)}: 'devices' and 'links' must be lists")
    devices = []
    for i, d in enumerate(data["devices"]):
        d = _check_keys(d, _DEVICE_KEYS, f"devices[{i}]", source)
        if "name" not in d:
            raise TopologyError(f"devices[{i}]{_where(source)} has no 'name'")
        devices.append(Device(str(d["name"]), d.get("kind", "gpu"), dict(d.get("attrs") or {})))
    links = []
    for i, lk in enumerate(data["links"]):
        lk = _check_keys(lk, _LINK_KEYS, f"links[{i}]", source)
        for key in ("a", "b"):
            if key not in lk:
                raise TopologyError(f"links[{i}]{_where(source)} is missing {key!r}")
        up, down = _link_bandwidths(lk, f"links[{i}] ({lk['a']}-{lk['b']}){_where(source)}")
        links.append(Link(str(lk["a"]), str(lk["b"]), up, lk.get("latency_s", 0.0), lk.get("kind", "link"), down))
    ranks = data.get("ranks") or ()
    if not isinstance(ranks, (list, tuple)):
        raise TopologyError(f"topology{_where(source)}: 'ranks' must be a list of device names")
    return Topology(
        str(data["name"]),
        tuple(devices),
        tuple(links),
        ranks=tuple(str(r) for r in ranks),
        unit_bandwidth_GBps=data.get("unit_bandwidth_GBps"),
        attrs=dict(data.get("attrs") or {}),
    )


def load(path: str | Path) -> Topology:
    """Read a ``.json``, ``.yaml`` or ``.yml`` topology file."""
    p = Path(path)
    if not p.is_file():
        raise TopologyError(f"topology file {str(p)!r} does not exist")
    try:
        text = read_input(p, "topology file", TopologyError, MAX_TOPOLOGY_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TopologyError(f"topology file {str(p)!r} is not a text file (byte {exc.object[exc.start]:#04x} at "
                            f"offset {exc.start} is not UTF-8); give a .json or .yaml topology, e.g. from "
                            f"'gradsync topo export p3.16xlarge -o box.yaml'") from None
    except OSError as exc:
        raise TopologyError(f"cannot read topology file {str(p)!r}: {exc.strerror}") from None
    try:
        what = f"topology file {str(p)!r}"
        data = parse_json(text, what, TopologyError) if p.suffix == ".json" else parse_yaml(text, what, TopologyError)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0]
        raise TopologyError(f"topology file {str(p)!r} is not valid {p.suffix[1:].upper() or 'YAML'}: {first}") from None
    return from_dict(data, source=str(p))


def save(topology: Topology, path: str | Path) -> Path:
    """Write JSON (``.json``) or YAML (anything else) in the documented format."""
    p = Path(path)
    data = topology.to_dict()
    text = json.dumps(data, indent=2) + "\n" if p.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
    return write_text(p, text, "topology file", TopologyError)


def parse_spec(spec: str) -> tuple[str, tuple[int, ...], tuple[int, ...] | None]:
    """Split ``name[:a,b][[i,j]]`` into (name, args, selection)."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise TopologyError(
            f"cannot read topology spec {spec!r}; write NAME, NAME:ARGS or NAME[RANKS] "
            f"(e.g. 'ring:8', 'p3.16xlarge[0,1,2,3,7]') or give a .json/.yaml file"
        )
    args = tuple(int(a) for a in (m["args"] or "").split(",") if a.strip())
    sel = None if m["sel"] is None else tuple(int(a) for a in m["sel"].split(",") if a.strip())
    return m["name"], args, sel


def get_topology(spec: str | Topology) -> Topology:
    """Resolve a registry spec (``p3.16xlarge``, ``switch:9``, ``dgx1[0,1,2,3,7]``) or a file path."""
    if isinstance(spec, Topology):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"topology must be a spec string or a Topology, got {type(spec).__name__}")
    if spec.endswith((".json", ".yaml", ".yml")) or Path(spec).is_file():
        return load(spec)
    name, args, sel = parse_spec(spec)
    entry = BUILDERS.get(name)
    topo = entry.build(args)
    if sel is not None:
        base = topo.name
        topo = topo.select(sel, name=f"{base}[{','.join(map(str, sel))}]")
    return topo
