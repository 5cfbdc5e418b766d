"""A reader of Chrome trace-event JSON written from the format's specification (the Trace Event Format document
that chrome://tracing and Perfetto's JSON importer follow), not from gradsync's writer: the tests load the files
our runtime and simulator write with it."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

#: Phases of the format and the fields each needs beyond ``ph`` (B/E: duration, X: complete, i: instant,
#: C: counter, M: metadata).
REQUIRED = {"B": ("name", "ts", "pid", "tid"), "E": ("ts", "pid", "tid"), "X": ("name", "ts", "dur", "pid", "tid"),
            "i": ("name", "ts", "pid"), "C": ("name", "ts", "pid", "args"), "M": ("name", "pid", "args")}
METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"}


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The events of ``path``; raises AssertionError naming the first event that breaks the format."""
    doc = json.loads(Path(path).read_text())
    events = doc if isinstance(doc, list) else doc["traceEvents"]
    assert isinstance(events, list), type(events)
    if isinstance(doc, dict):
        assert doc.get("displayTimeUnit", "ms") in ("ms", "ns"), doc.get("displayTimeUnit")
    spans: dict[tuple[Any, Any], list[tuple[float, float]]] = defaultdict(list)
    for i, e in enumerate(events):
        assert isinstance(e, dict) and e.get("ph") in REQUIRED, (i, e)
        missing = [k for k in REQUIRED[e["ph"]] if k not in e]
        assert not missing, (i, missing, e)
        for k in ("ts", "dur"):
            if k in e:
                assert isinstance(e[k], (int, float)) and not isinstance(e[k], bool), (i, k, e)
        assert isinstance(e.get("args", {}), dict), (i, e)
        if e["ph"] == "M":
            assert e["name"] in METADATA and isinstance(e["args"].get("name", ""), (str, int)), (i, e)
        if e["ph"] == "X":
            assert e["dur"] >= 0, (i, e)
            spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for track, ss in spans.items():  # a thread's spans nest or follow each other: viewers draw them as a stack
        stack: list[float] = []
        for start, end in sorted(ss, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"span [{start}, {end}] on {track} overlaps its parent's end {stack[-1]}"
            stack.append(end)
    return events


def spans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X"]


def thread_names(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
