"""The real ``gradsync`` command, run as a subprocess in a temporary directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradsync.plan import SYNTHESIZERS


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def plan_json(*args: str) -> dict:
    p = run("plan", *args, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_plan_dgx1_lp_json():
    out = plan_json("--topology", "p3.16xlarge", "--algorithm", "lp", "--size", "1000000000")
    assert out["type"] == "gradsync.plan"
    assert out["cost"] == pytest.approx(7 / 24, abs=1e-6) and out["lower_bound"] == pytest.approx(7 / 24, abs=1e-6)
    assert out["algbw_GBps"] == pytest.approx(85.714, abs=1e-3)
    assert out["time_s"] == pytest.approx(1e9 / (85.714285714e9), rel=1e-6)
    assert out["trees"] and sum(t["weight"] for t in out["trees"]) == pytest.approx(1.0)
    assert all(len(t["edges"]) == 7 for t in out["trees"])


def test_plan_skips_runtime_model_on_big_multitree_plans():
    # fattree:8 lp has 16,256 transfers in 64 concurrent trees (fattree:6's 5,724 in 54 trees took the event
    # simulation over a minute; its symmetric packing now needs only 27 trees, under the 4000-transfer limit).
    out = plan_json("--topology", "fattree:8", "--algorithm", "lp")
    assert out["transfers"] > 4000 and out["runtime_model"]["time_s"] is None
    assert out["gap"] == pytest.approx(0.0, abs=1e-9)  # certified by the cut bound
    small = plan_json("--topology", "bcube:3,2", "--algorithm", "bml", "--size", "1000000")
    assert small["runtime_model"]["time_s"] > small["time_s"]  # store-and-forward with message costs


def test_plan_tree_and_p3_8xlarge():
    assert plan_json("--topology", "p3.16xlarge", "--algorithm", "tree")["cost"] == pytest.approx(0.5)
    out = plan_json("--topology", "p3.8xlarge", "--algorithm", "lp")
    assert out["cost"] == pytest.approx(1 / 3, abs=1e-6) and out["algbw_GBps"] == pytest.approx(75.0, abs=1e-6)


def test_plan_p2_reports_link_classes_and_writes_schedule(tmp_path):
    out_file = tmp_path / "s.json"
    out = plan_json("--topology", "p2.16xlarge", "--algorithm", "lp", "-o", str(out_file))
    assert set(out["link_classes"]) == {"pcie-card", "pcie-board", "pcie-central"}
    saved = json.loads(out_file.read_text())
    assert saved["type"] == "gradsync.schedule" and saved["topology"] == "p2.16xlarge"


def test_plan_from_yaml_file_and_latency(tmp_path):
    f = tmp_path / "box.yaml"
    f.write_text(
        "name: my-box\n"
        "devices: [{name: gpu0, kind: gpu}, {name: gpu1, kind: gpu}, {name: plx0, kind: switch}]\n"
        "links: [{a: gpu0, b: plx0, bandwidth_GBps: 12, latency_s: 0.0}, {a: gpu1, b: plx0, bandwidth_GBps: 12}]\n"
    )
    base = plan_json("--topology", str(f), "--algorithm", "ps", "--size", "12GB")
    assert base["cost"] == pytest.approx(1.0) and base["time_s"] == pytest.approx(1.0)
    lat = plan_json("--topology", str(f), "--algorithm", "ps", "--size", "12GB", "--latency", "0.5")
    assert lat["time_s"] == pytest.approx(1.0 + 2 * 2 * 0.5)  # two steps, two hops each


def test_human_output_mentions_bounds():
    p = run("plan", "-t", "dgx1", "-a", "lp")
    assert p.returncode == 0 and "Lemma 2.1" in p.stdout and "85.71" in p.stdout


@pytest.mark.parametrize("args, message", [
    (["plan", "-t", "nosuch"], "unknown topology 'nosuch'"),
    (["plan", "-t", "ring:4", "--size", "lots"], "cannot read size 'lots'"),
    (["plan", "-t", "ring:4", "--pipeline", "0"], "pipeline=0"),
    (["topo", "show"], "needs a topology"),
])
def test_errors_are_one_line_with_exit_2(args, message):
    p = run(*args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error:") and message in lines[0]


def test_bad_files_exit_2(tmp_path):
    disconnected = tmp_path / "d.yaml"
    disconnected.write_text("name: d\ndevices: [{name: a}, {name: b}]\nlinks: []\n")
    malformed = tmp_path / "m.json"
    malformed.write_text("{oops")
    for f, message in [(disconnected, "disconnected"), (malformed, "not valid JSON")]:
        p = run("plan", "-t", str(f))
        assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_topo_list_show_export_draw(tmp_path):
    p = run("topo", "list")
    assert p.returncode == 0 and "p3.16xlarge" in p.stdout and "dgx1" in p.stdout and "minsky:2" in p.stdout
    shown = json.loads(run("topo", "show", "dgx1", "--json").stdout)
    assert shown["type"] == "gradsync.topology" and len(shown["links"]) == 16
    p = run("topo", "export", "p2.8xlarge", "-o", "p2.yaml", cwd=tmp_path)
    assert p.returncode == 0 and (tmp_path / "p2.yaml").exists()
    again = plan_json("-t", str(tmp_path / "p2.yaml"), "-a", "lp")
    assert again["cost"] == pytest.approx(plan_json("-t", "p2.8xlarge", "-a", "lp")["cost"])
    p = run("topo", "draw", "p2.16xlarge", "-o", "p2.png", cwd=tmp_path)
    assert p.returncode == 0 and (tmp_path / "p2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_trains_on_workers(tmp_path, monkeypatch):
    """The main job's training part, shortened: 2 workers, ``auto`` (calibrated), two algorithms and the torch
    baseline."""
    monkeypatch.setenv("GRADSYNC_CACHE", str(tmp_path / "cache"))
    p = run("demo", "--no-train", cwd=tmp_path)
    assert p.returncode == 0
    p = run("demo", "--workers", "2", "--steps", "40", "--algorithms", "torch.all_reduce,auto,ring,lp", "-o", "d.json",
            "--plot", "d.png", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    train = json.loads((tmp_path / "d.json").read_text())["training"]
    res = train["results"]
    assert list(res) == ["torch.all_reduce", "auto", "ring", "lp"]
    # auto ran calibrated (the calibration and the tuned small sizes are cached) and says what it ran for
    # every gradient group; the groups hold every parameter's gradient once
    assert {f.name.split("-")[0] for f in (tmp_path / "cache").iterdir()} == {"cost_model", "tuned"}
    auto = res["auto"]
    assert sum(auto["groups"]) == 4 * train["params"]
    assert set(auto["plans"]) == {str(n) for n in auto["groups"]}
    known = set(SYNTHESIZERS.names()) | {"native"}
    assert all(plan.split("/")[0] in known and int(plan.split("/")[1]) >= 1 for plan in auto["plans"].values())
    assert "auto (calibrated on this wire) ran, per gradient group:" in p.stdout
    for name, r in res.items():
        assert r["replicas_identical"], name
        # same data, same initial weights: the algorithms differ only in summation order
        assert abs(r["accuracy"] - res["torch.all_reduce"]["accuracy"]) <= 0.03, (name, r["accuracy"])
        assert r["accuracy"] > 0.7, (name, r)
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "replicas equal" in p.stdout


def test_demo_runs(tmp_path):
    p = run("demo", "--no-train", "-o", "demo.json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "demo.json").read_text())["rows"]
    dgx = next(r for r in rows if r["topology"] == "p3.16xlarge")
    assert dgx["cost"]["lp"] == pytest.approx(7 / 24, abs=1e-6)
    assert all(r["cost"]["lp"] <= min(r["cost"].values()) + 1e-9 for r in rows)


def test_models_lists_the_registry(tmp_path):
    p = run("models", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)["models"]}
    assert rows["lenet5"]["params"] == 61706 and rows["resnet50"]["params"] == 25557032
    assert "vgg16" in run("models", cwd=tmp_path).stdout


def test_run_starts_workers_with_torchrun_env(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(
        "import os, torch, gradsync\n"
        "rt = gradsync.init(algorithm='ring', timeout_s=30)\n"
        "x = torch.full((5,), float(rt.rank + 1)); gradsync.allreduce(x)\n"
        "print('topo', rt.topology.name, 'sum', x.tolist(), os.environ['LOCAL_RANK'])\n"
    )
    p = run("run", "-n", "3", "--topology", "ring:3", "--timeout", "120", "--", sys.executable, str(script), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(3):
        assert f"[rank {r}] topo ring:3 sum [6.0, 6.0, 6.0, 6.0, 6.0] {r}" in p.stdout
    bad = run("run", "-n", "2", "--", sys.executable, "-c", "import sys; sys.exit(3)", cwd=tmp_path)
    assert bad.returncode == 3


def test_compress_list_prices_every_compressor(tmp_path):
    p = run("compress", "list", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)["rows"]}
    d = 1024 * 1024
    assert rows["none"]["payload_bytes_1Mi_fp32"] == 4 * d and rows["fp16"]["ratio"] == 2.0
    assert rows["signsgd"]["payload_bytes_1Mi_fp32"] == d // 8  # really one bit per element
    assert rows["topk"]["communicator"] == "allgather" and rows["randk"]["communicator"] == "allreduce"


# ---- hostile input (issue 19): a one-line error and exit 2, never a traceback ------------------------------
def _one_line_error(p: subprocess.CompletedProcess, message: str) -> None:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("gradsync: error:") and message in lines[0], p.stderr


@pytest.mark.parametrize("algorithm", ["lp", "ring", "tree", "ps", "multiring", "auto"])
def test_single_rank_topology_plans_a_no_op(tmp_path, algorithm):
    """One rank has nothing to exchange: a schedule with no transfers and cost 0 (it used to crash in the
    bound's numpy max over zero links); --json stays valid JSON (no Infinity)."""
    one = tmp_path / "one.yaml"
    one.write_text("name: one\ndevices: [{name: gpu0, kind: gpu}]\nlinks: []\n")
    for topo in ("p3.16xlarge[3]", str(one)):
        p = run("plan", "-t", topo, "-a", algorithm, "--json")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        assert out["transfers"] == 0 and out["cost"] == 0 and out["time_s"] == 0 and out["lower_bound"] == 0
    p = run("simulate", "-t", "p3.16xlarge[3]", "-a", algorithm, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["time_s"] == 0, p.stderr


def test_binary_topology_schedule_and_dag_files_exit_2(tmp_path):
    blob = bytes(range(256)) * 4
    for name in ("t.yaml", "t.json", "t.bin"):
        (tmp_path / name).write_bytes(blob)
        _one_line_error(run("plan", "-t", str(tmp_path / name)), "is not a text file")
    _one_line_error(run("topo", "show", str(tmp_path / "t.yaml")), "is not a text file")
    _one_line_error(run("simulate", "-t", "ring:4", "--schedule", str(tmp_path / "t.json")),
                    "schedule file")
    _one_line_error(run("order", str(tmp_path / "t.json")), "DAG file")


@pytest.mark.parametrize("args, option", [
    (["plan", "-t", "ring:4", "-o", "{missing}/s.json"], "-o/--output"),
    (["topo", "export", "ring:4", "-o", "{missing}/t.yaml"], "-o/--output"),
    (["topo", "export", "ring:4", "-o", "{tmp}"], "is a directory"),
    (["demo", "--no-train", "-o", "{missing}/d.json"], "-o/--output"),
    (["order", "lenet", "--save-dag", "{missing}/d.json"], "--save-dag"),
])
def test_unwritable_outputs_exit_2_before_any_work(tmp_path, args, option):
    args = [a.format(missing=tmp_path / "no" / "such", tmp=tmp_path) for a in args]
    _one_line_error(run(*args), option)
    assert not (tmp_path / "no").exists()


def test_library_save_into_a_missing_directory_names_the_file(tmp_path):
    from gradsync.errors import ScheduleError, TopologyError
    from gradsync.plan import synthesize
    from gradsync.topology import get_topology, save

    topo = get_topology("ring:4")
    with pytest.raises(TopologyError, match="cannot write topology file .*no/t.yaml"):
        save(topo, tmp_path / "no" / "t.yaml")
    with pytest.raises(ScheduleError, match="cannot write schedule file .*no/s.json"):
        synthesize("ring", topo).save(tmp_path / "no" / "s.json")


def test_topology_too_large_for_the_lp_exits_2_naming_what_fits():
    p = run("plan", "-t", "switch:100000")
    _one_line_error(p, "at least 112 GiB")
    assert "'ring' fits" in p.stderr and "use --algorithm ring" in p.stderr  # the compact ring: 0.02 GiB


def test_every_command_module_is_registered_and_answers_help(capsys):
    """One module per subcommand in gradsync/commands/, named after it, each in the CLI's list; ``--help``
    works for every one (and for the testbed's actions)."""
    import argparse
    import pkgutil

    import gradsync.commands
    from gradsync.cli import COMMAND_NAMES, build_parser, main

    modules = sorted(m.name for m in pkgutil.iter_modules(gradsync.commands.__path__) if not m.name.startswith("_"))
    registered = list(COMMAND_NAMES)
    assert sorted(registered) == modules
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == registered
    for argv in [[name] for name in registered] + [["testbed", a] for a in ("up", "run", "down", "probe", "status")]:
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0, argv
        assert capsys.readouterr().out.startswith(f"usage: gradsync {' '.join(argv)} [-h]"), argv


def _help_in_a_fresh_interpreter(argvs: list[list[str]], modules: tuple[str, ...]) -> tuple[str, list[str]]:
    """What ``main(argv + ["--help"])`` prints for each of ``argvs`` in one fresh interpreter, and which of ``modules``
    it had imported by then."""
    code = ("import json, sys\nfrom gradsync.cli import main\n"
            f"for argv in {argvs!r}:\n    try:\n        main(argv + ['--help'])\n    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            f"print(json.dumps([m for m in {modules!r} if m in sys.modules]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout, json.loads(p.stdout.splitlines()[-1])


def test_help_lists_every_command_and_loads_no_heavy_package():
    out, loaded = _help_in_a_fresh_interpreter([[]], ("torch", "zmq", "mpi4py", "matplotlib"))
    assert loaded == []
    for name in ("topo", "plan", "simulate", "bench", "testbed", "launch", "order", "run", "compress", "models", "demo"):
        assert f"    {name} " in out, name


def test_a_command_line_builds_its_own_subcommand_alone_with_the_same_help_and_imports_no_planner():
    """``gradsync run`` (or ``launch``) starts jobs: it need not import the planner, networkx or SciPy that ``plan``'s
    and ``simulate``'s choices come from, and its help is the one the full parser shows."""
    import argparse

    from gradsync.cli import COMMAND_NAMES, build_parser

    def helps(parser: argparse.ArgumentParser) -> dict[str, str]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {name: child.format_help() for name, child in sub.choices.items()}

    full = helps(build_parser())
    for name in COMMAND_NAMES:
        assert helps(build_parser(name)) == {name: full[name]}, name
    out, loaded = _help_in_a_fresh_interpreter([["run"], ["launch"]], ("gradsync.plan", "networkx", "scipy", "torch"))
    assert loaded == []
    assert "usage: gradsync run [-h]" in out and "usage: gradsync launch [-h]" in out
    with pytest.raises(ValueError, match="unknown gradsync command 'nope'; the commands are topo, plan"):
        build_parser("nope")


def test_every_subcommand_help_shows_defaults_and_two_examples_that_parse(capsys, monkeypatch):
    """Each subcommand's help in process (``main([name, "--help"])``: the same parser a command builds, without
    a fresh interpreter per subcommand); one real ``gradsync plan --help`` checks the command path itself."""
    import shlex

    from gradsync.cli import COMMAND_NAMES, EXAMPLES, build_parser, main

    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width; a captured subprocess gets 80
    names = set(COMMAND_NAMES)
    assert set(EXAMPLES) == names
    helps = {}
    for name in sorted(names):
        with pytest.raises(SystemExit) as exited:
            main([name, "--help"])
        assert exited.value.code == 0, name
        out = helps[name] = capsys.readouterr().out
        tail = out.split("examples:\n", 1)[1].strip().splitlines()
        assert len(tail) == 2, (name, tail)
        for line in tail:  # each example is a command line the parser accepts
            words = [w for w in shlex.split(line.split("#")[0]) if w != "sudo" and "=" not in w.split("-")[0]]
            assert words[0] == "gradsync", line
            build_parser().parse_args(words[1:])
    plan = subprocess.run([sys.executable, "-m", "gradsync", "plan", "--help"], capture_output=True, text=True,
                          timeout=60).stdout
    assert plan == helps["plan"]  # the command prints what main() printed in process
    plan = " ".join(plan.split())  # argparse wraps lines
    assert "(default: 100MB)" in plan and "the synthesizer" in plan and "(default: lp)" in plan


def test_bench_marks_the_benchmarks_that_need_a_checkout():
    from gradsync.sim.bench import BENCHMARKS

    out = subprocess.run([sys.executable, "-m", "gradsync", "bench"], capture_output=True, text=True, timeout=60).stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line and line.split()[0] in BENCHMARKS.names()}
    assert set(rows) == set(BENCHMARKS.names())
    for name, line in rows.items():
        assert (line.split()[1] == "*") == BENCHMARKS.get(name).checkout, line
    assert "* needs a gradsync source checkout" in out


def test_simulate_with_a_burst_is_faster_below_its_bucket_and_refuses_a_negative_one():
    """switch:2, ring, 1 MB store-and-forward: each direction sends 0.5 MB once per phase; a bucket of 1 s of
    the link's rate covers every message (1/100 of the time), a negative one is one clear line."""
    base = run("simulate", "-t", "switch:2", "-a", "ring", "--size", "1MB", "--store-and-forward", "--json")
    bursty = run("simulate", "-t", "switch:2", "-a", "ring", "--size", "1MB", "--store-and-forward", "--json",
                 "--burst-s", "1")
    assert base.returncode == 0 and bursty.returncode == 0, (base.stderr, bursty.stderr)
    plain, fast = json.loads(base.stdout), json.loads(bursty.stdout)
    assert fast["burst_s"] == 1.0 and "burst_s" not in plain
    assert fast["time_s"] == pytest.approx(plain["time_s"] / 100, rel=1e-6)
    _one_line_error(run("simulate", "-t", "switch:2", "--burst-s", "-1"), "--burst-s -1.0 must be >= 0")
