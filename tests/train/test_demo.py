"""The demo's plot (issue 37): methods whose training curves are identical share one labelled line."""

from __future__ import annotations

from gradsync.train.demo import plot_results, results_figure


def _report() -> dict:
    same = [[0, 0.1], [10, 0.5], [20, 0.8]]
    timing = {"step_ms": 10.0, "wait_ms": 2.0, "comm_ms": 3.0}
    return {"workers": 2, "batch": 64, "topology": "switch:2",
            "results": {"ring": {"curve": same, **timing}, "tree": {"curve": same, **timing},
                        "fp16": {"curve": [[0, 0.1], [10, 0.4], [20, 0.7]], **timing}}}


def test_identical_curves_are_one_line_named_for_every_method(tmp_path):
    left = results_figure(_report()).axes[0]
    labels = [line.get_label() for line in left.get_lines()]
    assert labels == ["ring, tree (identical: exact sums)", "fp16"]
    path = plot_results(_report(), tmp_path / "demo.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
