"""Write docs/benchmarks.md from the measured results in benchmarks/results/*.json.

    python docs/generate_benchmarks.py            # rewrite docs/benchmarks.md
    python docs/generate_benchmarks.py --check    # exit 1 if docs/benchmarks.md is stale

Every figure in the tables comes from a results file; the page links each file and its plot. The short
notes under some sections are runs whose results were not kept as JSON (the old README's lab notes), marked
as such. tests/test_docs.py regenerates the page and compares it with the committed one.
Only the standard library is used, so the page can be rebuilt anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "benchmarks.md"


# ---- formatting ------------------------------------------------------------------------------------------
def num(x: Any, digits: int = 3) -> str:
    """A number with ``digits`` significant digits (ints stay whole); None and missing values as a dash."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 10 ** digits:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return str(x)


def pct(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f} %"


def size(nbytes: Any) -> str:
    n = float(nbytes)
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            v = n / scale
            return f"{v:g} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n:g} B"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return out + [""]


def block(lines: Iterable[str]) -> list[str]:
    return ["```text", *lines, "```", ""]


def load(rel: str) -> Any:
    return json.loads((RESULTS / rel).read_text())


def sources(*rels: str, plots: Sequence[str] = ()) -> list[str]:
    """Links to the results files and any plot beside them (same stem, .png or .svg), then ``plots``."""
    parts = []
    for rel in rels:
        parts.append(f"[`{rel}`](../benchmarks/results/{rel})")
        stem = (RESULTS / rel).with_suffix("")
        for ext in (".png", ".svg"):
            plot = stem.with_suffix(ext)
            if plot.is_file():
                prel = plot.relative_to(RESULTS).as_posix()
                parts.append(f"plot [`{prel}`](../benchmarks/results/{prel})")
    parts += [f"plot [`{p}`](../benchmarks/results/{p})" for p in plots if (RESULTS / p).is_file()]
    return ["Source: " + ", ".join(parts) + ".", ""]


def note(text: str) -> list[str]:
    return [f"> *Not from a results file (notes of earlier runs):* {text}", ""]


# ---- sections --------------------------------------------------------------------------------------------
def plan_scaling() -> list[str]:
    out = ["## Planner: `lp` time as topologies grow (`gradsync bench plan-scaling`)", "",
           *sources("plan_scaling.json")]
    j = load("plan_scaling.json")
    out += [f"Goals: {', '.join(f'`{k}` ≤ {v}' for k, v in j['goals'].items())}.", ""]
    out += table(["family", "topology", "nodes", "links", "median s", "cost", "lower bound", "gap", "trees"],
                 ([c["family"], c["name"], c["nodes"], c["links"], num(c["median_s"]), num(c["cost"], 4),
                   num(c["lower_bound"], 4), pct(c["gap"]), num(c["trees"])] for c in j["cases"]))
    out += ["### Reduce-scatter and allgather (`python -m benchmarks.plan_scaling --collectives`)", "",
            *sources("plan_collectives.json")]
    j = load("plan_collectives.json")
    out += table(["topology", "reduce-scatter cost", "cut bound", "RS GB/s", "AG GB/s", "MSCCL chunks/loop",
                  "plan s", "allreduce as RS+AG GB/s", "allreduce tree packing GB/s"],
                 ([c["name"], num(c["reduce_scatter"]["cost"], 4), num(c["reduce_scatter"]["cut_bound"], 4),
                   num(c["reduce_scatter"]["algbw_GBps"], 4), num(c["allgather"]["algbw_GBps"], 4),
                   num(c["reduce_scatter"].get("msccl_nchunksperloop")), num(c["reduce_scatter"]["plan_s"]),
                   num(c.get("allreduce", {}).get("rs_plus_ag_algbw_GBps"), 4),
                   num(c.get("allreduce", {}).get("tree_packing_algbw_GBps"), 4)] for c in j["cases"]))
    return out


def plan_fabrics() -> list[str]:
    j = load("plan_fabrics.json")
    out = ["## Planner: large fabrics (`gradsync bench plan-fabrics`)", "", *sources("plan_fabrics.json"),
           f"Fresh process per case, {j['machine']['cpus']} CPUs; the baseline column is revision "
           f"`{j['config']['baseline']}` (`--baseline REV`).", "", *block(j["summary"])]
    base = {(b["spec"], b["algorithm"]): b for b in j.get("baseline", [])}
    rows = []
    for c in j["cases"]:
        b = base.get((c["spec"], c["algorithm"]), {})
        rows.append([c["spec"], c["algorithm"], num(c["ranks"]), num(c.get("total_s")), num(c.get("peak_mb"), 4),
                     num(c.get("cost"), 4), num(c.get("lower_bound"), 4), pct(c.get("gap")),
                     c.get("method") or "–", num(b.get("total_s")), num(b.get("peak_mb"), 4)])
    out += table(["topology", "algorithm", "ranks", "total s", "peak MB", "cost", "lower bound", "gap", "method",
                  "baseline s", "baseline MB"], rows)
    out += ["Published figures the goals were set against:", ""]
    out += table(["who", "ranks", "seconds", "certified", "note"],
                 ([a["who"], num(a["ranks"]), num(a["seconds"]), num(a["certified"]), a["note"]] for a in j["anchors"]))
    out += note("`gradsync plan --topology fattree:16 --algorithm ring` went from 50 s and 1.45 GB to 1.0 s and "
                "98 MB with the compact schedule form; `lp` on `fattree:16` from 365 s and 2.1 GB to 20 s and "
                "366 MB with the symmetric method (2-core machine, load 2–5).")
    return out


def sim_scaling() -> list[str]:
    j = load("sim_scaling.json")
    out = ["## Simulator scale (`gradsync bench sim-scaling`)", "", *sources("sim_scaling.json"),
           *block([j["summary"]])]
    out += table(["case", "topology", "algorithm", "mode", "latency s", "transfers", "max active flows", "events",
                  "sim s", "GST / T_F", "planned cost"],
                 ([r["case"], r["topology"], r["algorithm"], r["mode"], num(r.get("latency_s")), num(r.get("transfers")),
                   num(r.get("max_active_flows")), num(r.get("events")), num(r.get("sim_s")),
                   num(r.get("gst_over_tf"), 4), num(r.get("planned_cost"), 4)] for r in j["runs"]))
    return out


def bml() -> list[str]:
    j = load("bml_fig5.json")
    out = ["## BML (seed 001)", "", "### Fig. 5: GST of BML/PS on BCube vs hierarchical/PS on Fat-Tree "
           "(`gradsync bench bml-fig5`)", "", *sources("bml_fig5.json"),
           f"Message of {size(j['size_bytes'])} ({num(j['size_bytes'])} bytes).", "", *block(j["summary"])]
    out += table(["servers", "case", "topology", "switches", "transfers", "planned GST/T_F", "simulated GST/T_F",
                  "closed form"],
                 ([num(c["servers"]), c["label"], c["topology"], num(c["switches"]), num(c["transfers"]),
                   num(c["planned_gst_over_tf"], 5), num(c["simulated_gst_over_tf"], 5), num(c["closed_form"], 5)]
                  for c in j["cases"]))
    j = load("bml_testbed.json")
    out += ["### On the emulated cluster (`gradsync bench bml-testbed`, root)", "", *sources("bml_testbed.json"),
            f"{num(j['rate_mbit'])} Mbit/s per link, goodput {pct(j['goodput_share'], 1)} of the shaped rate.", "",
            *block(j["summary"])]
    out += table(["size", "PS/BML measured", "PS/BML simulated", "closed form", "goal met"],
                 ([size(g["size_bytes"]), num(g["measured"]), num(g["simulated"]), num(g["closed_form"]),
                   num(g["goal_met"])] for g in j["ratios"]["gst"]))
    return out


def allreduce_loopback() -> list[str]:
    j = load("allreduce_loopback.json")
    out = ["## Runtime on loopback (`gradsync bench allreduce-loopback`)", "", *sources("allreduce_loopback.json"),
           "`auto` against gloo's `all_reduce` (ratios > 1: gradsync faster), with `gloo-again`, a second gloo "
           "series in the same call, as the noise floor:", ""]
    out += table(["processes", "size", "auto vs gloo", "gloo-again vs gloo"],
                 ([num(r["world_size"]), size(r["bytes"]), num(r["auto_vs_gloo"]), num(r["gloo_again_vs_gloo"])]
                  for r in j["auto_vs_gloo"]))
    out += ["Best fixed gradsync method per world and size:", ""]
    out += table(["processes", "size", "best gradsync", "GB/s", "vs gloo", "vs MPI"],
                 ([num(r["world_size"]), size(r["bytes"]), r["best_gradsync"], num(r["best_algbw_GBps"]),
                   num(r["vs_gloo"]), num(r["vs_mpi"])] for r in j["ratios"]))
    return out


def vs_native() -> list[str]:
    out = ["## Runtime against gloo and DDP on the emulated cluster (`gradsync bench vs-native`, root)", "",
           "Each file's own summary, as the benchmark printed it (allreduce time of the native collective and of "
           "`auto`'s choice, with the cost model's prediction; then training steps).", ""]
    for rel in ("vs_native.json", "vs_native_rerun.json", "vs_native_racks.json", "vs_native_switch.json",
                "vs_native_fattree.json"):
        j = load(rel)
        out += [f"### `{rel}` ({j['created']}, cases `{j['args']['cases']}`, {j['args']['reps']} reps)", "",
                *sources(rel), *block(j["summary"])]
    out += note("over twelve runs on four days, on hosts of different speed, `auto` measured 1.43–1.58x (4 MiB), "
                "1.51–1.67x (12.5 MiB) and 1.53–1.68x (50 MiB) gloo's time on racks:2,3,4 and 1.66–1.86x, "
                "1.72–1.92x, 1.86–1.98x on bcube:3,2; switch:8 and fattree:4 0.99–1.01x (`auto` keeps the native "
                "ring); training steps 1.34–1.70x DDP on racks and bcube. At racks 12.5 MiB gloo moved between 1.89 "
                "and 2.05 s from run to run while gradsync stayed at 1.20–1.25 s, the wire's floor (a plain gloo "
                "exchange of the same bytes across the uplink took 1.22–1.23 s). With TCP slow start after idle "
                "on, gradsync's bcube:3,2 samples at 12.5 MiB spread over 0.53–0.59 s and gloo's racks samples at "
                "4 MiB over 0.61–0.73 s; without it 0.52–0.53 and 0.59–0.65 s.")
    return out


#: ``gradsync bench vs-native --cases fabrics`` results, one file per batch of cases (twins kept together)
FABRIC_RESULTS = ("vs_native_fabrics.json", "vs_native_fabrics_4to1.json")


def vs_native_fabrics() -> list[str]:
    out = ["## Hand-written topology files against gloo (`gradsync bench vs-native --cases fabrics`, root)", "",
           "Files in `benchmarks/fabrics/` written as a user describes a cluster (no `attrs`, nominal rates in GB/s; "
           "the slowest link runs at the file case's rate on the testbed), started with `gradsync.init(topology="
           "file)` and nothing else, beside the built-in `racks:r,s,o` of the same fabric (same uplink rate). "
           "Medians of alternating calls in the same processes; `pick` is what `auto` ran after its first calls; "
           "`predicted` is the cost model's speed-up with the model `init` ended with; `from` is the smallest swept "
           "size from which gradsync stays ahead.", ""]
    for rel in FABRIC_RESULTS:
        if not (RESULTS / rel).is_file():
            continue
        j = load(rel)
        out += [f"### `{rel}` ({j['created']}, {j['args']['reps']} reps)", "", *sources(rel)]
        rows = []
        for r in j["results"]:
            for a in r["allreduce"]:
                med, pred = a["median_s"], a["predicted_s"]
                ran = a.get("ran") or [a["choice"]["algorithm"], a["choice"]["pipeline"]]
                rows.append([r["case"], r["topology"].rsplit("/", 1)[-1], r["rate"], size(a["size_bytes"]),
                             num(med["native"]), num(med["gradsync"]), f"{ran[0]}/{ran[1]}",
                             num(med["native"] / med["gradsync"]), num(pred["native"] / pred["gradsync"]),
                             num(med["gradsync"] / pred["gradsync"]),
                             size(r["advantage_from_bytes"]) if r.get("advantage_from_bytes") else "–",
                             num(r.get("init_s"), 2)])
        out += table(["case", "topology", "rate", "size", "gloo s", "gradsync s", "pick", "speed-up", "predicted",
                      "measured / predicted", "from", "init s"], rows)
        out += ["", *block(j["summary"])]
    out += ["`vs_native_fabrics.json` is every fabric case in one run (2026-11-29, code 8dae595), nothing else on "
            "the machine, priced by the cost model with token buckets (a shaper's burst, spent once per collective), "
            "the two-way loss and the per-message costs, all measured by `init`'s quick calibration (3 repetitions); "
            "the backend's ring is priced with its per-step cost overlapping the wire, and `auto` times the backend's "
            "collective beside a plan priced within 25 % of it, and holds its pick's latest time against the "
            "backend's at the end ([runtime.md](runtime.md#calibration-tuning-and-exploration)). Every speed-up goal "
            "held: the file 4:1 at 1.63x and 1.64x from 4 MiB, and no row under 0.97x (the lowest 1.00x, the "
            "slow-rack file at 256 KiB running gloo's ring through gradsync). Every gradsync row ran within 15 % of "
            "its price (0.85-1.11x). Two goals missed in one row or case each, both met in the run before (code "
            "7466eb5, a 2-repetition calibration): the three-rack file at 4 MiB ran 1.01x against its built-in "
            "twin's 1.17x (-14 %; 1.13x against 1.17x before), after its explorer timed lp/32 at 0.928 s against "
            "lp/16's 0.968 s in its first step, 0.987 s in its second and 1.066 s in the timed calls (priced "
            "0.956 s); and builtin-3racks' two-way loss κ came out 0.236 (0.06-0.10 on the other cases), which "
            "priced gloo's ring too slow (gloo 0.84-0.88x its price). The run before missed the prediction by more "
            "than 15 % in 6 rows, each after a calibration outlier (file-3to1's executor α at 2.43 ms, slow-rack's "
            "κ at 0.33). `init` took 9.1-11.2 s here, 7.3-9.6 s before (one calibration repetition fewer). "
            "`vs_native_fabrics_4to1.json` is the hand-written 4:1 file alone, run on 2026-11-27 at older code "
            "on a quiet machine. `init s` is the whole `gradsync.init` on the 2-core machine (process group, "
            "the quick calibration; each size class is priced at its first call).", ""]
    out += note("why the three-rack rows run 1.07–1.18x their prediction (2026-11-27, three-rack.yaml at 60mbit, "
                "4 MiB, plans forced with `PlanCache.executor`, 5 alternating calls, interface byte counters sampled "
                "every 20 ms). Every plan moves the bytes the cut bound says (lp/16 5.43 MiB per uplink direction "
                "against 4/3 of 4 MiB; the ring 7.0 MiB against 16/9), so the loss is time, not traffic. The ring "
                "kept the uplinks 93–95% busy; lp/16 78% (0.98 s), forest/8 69%, hierarchical/16 52%. Over one lp/16 "
                "call the uplinks ran at 0–50% for the first 0.15 s and unevenly over the last 0.2 s, and ~90–100% "
                "between. The same calls on unshaped links (10gbit: the executor alone) took 0.164 s for lp/16, "
                "0.42 s for hierarchical/16, 0.25 s for forest/8 and 0.056 s for the ring, with the 2 cores full "
                "(lp/16: 0.30 s of CPU per call over the 9 processes, 0.085 s for lp/1, the same bytes in 48 "
                "messages instead of 768: about 0.3 ms of CPU per message, kernel and executor). The measured time "
                "is close to the fluid time plus that CPU time (lp/16: 0.80 + 0.16 s against 0.98 s), as if little "
                "of it overlapped the wire: with 9 ranks on 2 cores a relay waits for a core when its chunk "
                "arrives, and the per-receiver α the model calibrates (0.8–1.3 ms) does not see nine processes "
                "contending at once. On a cluster with a core per rank that term does not arise; the model has no "
                "shared-core term (a pool of 2 cores fed the calibrated α overshot 2x in an earlier try).")
    out += note("a second look (2026-11-28, same fabric, rate and size, lp forced at each depth, 5 alternating "
                "calls, the committed cost model's prediction) puts most of the gap elsewhere than the CPU. lp/2, "
                "4, 8, 16, 32 measured 1.106, 1.058, 0.963, 0.909, 0.945 s against 0.927, 0.863, 0.835, 0.829, "
                "0.839 s predicted (1.19, 1.23, 1.15, 1.10, 1.13x), the ring 1.002 s against 1.074 (0.93x); "
                "unshaped, the same plans took 0.052, 0.063, 0.085, 0.139, 0.214 s. The gap shrinks as the CPU per "
                "call grows, so it is not the CPU. With every shaper's queue at 100 ms instead of 25 ms the ratios "
                "stayed (1.22, 1.14, 1.15, 1.08, 1.11x), and the wire's total rate holds with several flows (two "
                "700 KB flows into one 60 Mbit/s downlink 0.194 s, one flow of the same bytes 0.195 s; two each way "
                "0.215 s). It is how TCP flows share a shaped uplink over a few round trips: in one lp/2 call the "
                "six first-round sub-chunks across the core, which the model shares fairly and ends together at "
                "0.258 s, ended at 0.249, 0.255, 0.311, 0.395, 0.424 and 0.436 s, and the trees that fell behind "
                "left the uplinks idle at the end. Plans with one flow per uplink direction run at their "
                "prediction: the ring, the two-rack leader exchange, and here `hierarchical/4` (0.951 s against "
                "0.929; at depths 8, 16, 32 the per-message CPU does show: 1.08, 1.22, 1.34x). `auto`'s measured "
                "pick, lp/16, was the fastest plan in every run. The model keeps fair sharing: credit-based fabrics "
                "(RDMA) share per queue pair, and a share that depends on each connection's recent window is not "
                "something a plan can be priced on.")
    return out


def tictac() -> list[str]:
    j = load("tictac/tictac.json")
    sim = j["simulation"]
    out = ["## TicTac (seed 003, `gradsync bench tictac`)", "", *sources("tictac/tictac.json", plots=["tictac/tictac_processes.png"]),
           *block([sim["summary"]])]
    out += table(["model", "parameters", "bytes", "random makespan s", "TIC s", "TAC s", "TAC / random", "E random",
                  "E TAC", "straggler % random (max)", "straggler % TAC"],
                 ([r["model"], num(r["params"]), num(r["bytes"]), num(r["random"]["makespan_s"]),
                   num(r["tic"]["makespan_s"]), num(r["tac"]["makespan_s"]), num(r["tac_over_random"]),
                   num(r["random"]["E"]), num(r["tac"]["E"]), num(r["workers"]["random_straggler_percent_max"]),
                   num(r["workers"]["tac_straggler_percent"])] for r in sim["rows"]))
    p = j.get("processes")
    if p:
        cfg = p["config"]
        out += [f"Real processes: {cfg['workers']} workers, {cfg['servers']} server, `{cfg['model']}` "
                f"({cfg['mode']}), shaping `{cfg['shaping']}` at {cfg['rate']}, {cfg['iterations']} iterations.", ""]
        out += table(["order", "step mean s", "step p50 s", "step p95 s", "blocked mean s"],
                     ([name, num(p[name]["step"]["mean_s"]), num(p[name]["step"]["p50_s"]),
                       num(p[name]["step"]["p95_s"]), num(p[name]["blocked_mean_s"])] for name in ("random", "tac")))
        out += [f"Mean gain {pct(p['mean_gain'], 1)}, p95 gain {pct(p['p95_gain'], 1)} (goals "
                f"{pct(p['goal']['mean_gain'], 0)}, {pct(p['goal']['p95_gain'], 0)}: "
                f"{'met' if p['goal_met'] else 'not met'}).", ""]
    return out


def mxnet_mpi() -> list[str]:
    out = ["## Parameter server: MXNET-MPI's configurations (seed 002, `gradsync bench mxnet-mpi`)", ""]
    for rel, title in (("mxnet_mpi/mxnet_mpi.json", "Loopback"),
                       ("mxnet_mpi_testbed/mxnet_mpi.json", "Emulated cluster (`--testbed`)")):
        j = load(rel)
        tb = j.get("testbed")
        where = f", `{tb['topology']}` at {tb['rate']}" if tb else ""
        out += [f"### {title}", "", *sources(rel),
                f"{j['workers']} workers, {j['servers']} servers, `{j['model']}`, {j['epochs']} epochs{where}.", ""]
        out += table(["configuration", "median s / epoch", "predicted communication s", "job s", "final accuracy"],
                     ([r["label"], num(r["median_epoch_seconds"]), num(r.get("predicted_comm_s")),
                       num(r["job_seconds"]), num(r["final_accuracy"])] for r in j["results"]))
    return out


def ps_loopback() -> list[str]:
    j = load("ps_loopback/ps_loopback.json")
    out = ["## Parameter server round trip (`gradsync bench ps-loopback`)", "", *sources("ps_loopback/ps_loopback.json"),
           f"{j['statistic']} of {j['reps']} reps; MAC {j['mac']}. Methods: "
           + "; ".join(f"`{k}`: {v}" for k, v in j["methods"].items()) + ".", ""]
    out += table(["size", "ps ms", "ps_plain ms", "ps_split ms", "gloo ms", "ps / gloo", "ps_plain / gloo",
                  "ps_split / gloo"],
                 ([size(r["bytes"]), num(r["ps_ms"]), num(r["ps_plain_ms"]), num(r["ps_split_ms"]), num(r["gloo_ms"]),
                   num(r["ps_over_gloo"]), num(r["ps_plain_over_gloo"]), num(r["ps_split_over_gloo"])]
                  for r in j["rows"]))
    out += table(["method", "sizes", "worst ratio", "goal", "met"],
                 ([m, band, num(g["worst"]), num(g["goal"]), num(g["met"])]
                  for m, bands in j["goals"].items() for band, g in bands.items()))
    return out


def codecs() -> list[str]:
    j = load("codecs.json")
    out = ["## Compressors against GRACE (`gradsync bench codecs`)", "", *sources("codecs.json"),
           f"Paired time ratio: median of per-pair gradsync/GRACE times with a 95 % interval (< 1: gradsync "
           f"faster). Goals met: {', '.join(f'{k} {num(v)}' for k, v in j['goals_met'].items())}.", ""]
    out += table(["codec", "elements", "gradsync s", "GRACE s", "paired time ratio", "95 % interval", "error ratio",
                  "bytes ratio"],
                 ([r["codec"], num(r["elements"]), num(r["gradsync"]["median_s"]), num(r["grace"]["median_s"]),
                   num(r["paired_time_ratio"]), f"{num(r['paired_time_ratio_ci95'][0])}–"
                   f"{num(r['paired_time_ratio_ci95'][1])}", num(r["error_ratio"]), num(r["bytes_ratio"])]
                  for r in j["rows"]))
    return out


def hooks() -> list[str]:
    j = load("hooks.json")
    cfg = j["config"]
    out = ["## fp16 DDP hook (`gradsync bench hooks`)", "", *sources("hooks.json"),
           f"{cfg['procs']} processes on {cfg['backend']}, {cfg['steps']} steps, {num(cfg['parameters'])} parameters; "
           f"gradsync buckets summed natively: {j['gradsync_buckets']['native']} of {j['gradsync_buckets']['all']}.", ""]
    out += table(["method", "median step s", "CPU median s", "replicas identical"],
                 ([m, num(v["median_s"]), num(v["cpu_median_s"]), num(v["replicas_identical"])]
                  for m, v in j["methods"].items()))
    ci = j["paired_ratio_ci95"]
    out += [f"gradsync fp16 / torch `fp16_compress_hook`: paired ratio {num(j['paired_ratio_median'])} "
            f"(95 % {num(ci[0])}–{num(ci[1])}); goal ≤ {num(j['goal'])}: {'met' if j['goal_met'] else 'not met'}.", ""]
    out += note("six runs of 300 steps, methods in a carry-over-balanced order, gave 0.985–1.019x torch's step "
                "time (median of per-step ratios); alternating methods within a step cost ~1 ms and had given "
                "1.04–1.09x.")
    return out


def adapt() -> list[str]:
    if not (RESULTS / "adapt.json").is_file():
        return []
    j = load("adapt.json")
    cfg = j["config"]
    out = ["## The runtime's watch on an unchanging wire (`gradsync bench adapt`)", "",
           *sources("adapt.json"),
           f"{cfg['procs']} processes on {cfg['backend']} loopback, {size(cfg['size_bytes'])} `{cfg['algorithm']}` "
           f"allreduces on `{cfg['topology']}`, {cfg['rounds']} rounds after {cfg['warmup']}, `adapt=True` and "
           f"`adapt=False` alternating (ABBA) in the same processes"
           + (f", beside `adapt=AdaptOptions(every=1)` (every allreduce watched; the default watches one in "
              f"{j['every']})" if "every1_paired_ratio_median" in j else "") + ".", ""]
    out += table(["runtime", "median s", "sums exact"],
                 ([m, num(v["median_s"]), num(v["exact"])] for m, v in j["methods"].items()))
    ci = j["paired_ratio_ci95"]
    out += [f"on / off: paired ratio {num(j['paired_ratio_median'])} (95 % {num(ci[0])}–{num(ci[1])}), ratio of "
            f"medians {num(j['ratio_of_medians'])}; {j['watched']} collectives watched, {len(j['switches'])} switches, "
            f"{len(j['held'])} held; goal ≤ {num(j['goal'])} and no switch: {'met' if j['goal_met'] else 'not met'}"
            + (f". Every allreduce watched / off: {num(j['every1_paired_ratio_median'])} (95 % "
               f"{num(j['every1_paired_ratio_ci95'][0])}–{num(j['every1_paired_ratio_ci95'][1])})"
               if "every1_paired_ratio_median" in j else "") + ".", ""]
    out += block(j["switches"] + j["held"]) if j["switches"] or j["held"] else []
    return out


def price_ahead() -> list[str]:
    rel = "price_ahead/price_ahead.json"
    if not (RESULTS / rel).is_file():
        return []
    j = load(rel)
    cfg = j["config"]
    # a run before the ``started`` way (2026-12-02) has ahead against inline only
    ways = [("ahead", "")] + ([("started", "started_")] if "started" in next(iter(j["leads"].values()))["medians_s"] else [])
    started = (f", or adopted from a child started {num(cfg['started_s'])} s before it was asked, as `gradsync.init` "
               f"starts it (`started`)") if len(ways) > 1 else ""
    out = ["## A job's first calls, priced when needed or ahead (`gradsync bench price-ahead`)", "",
           *sources(rel),
           f"The first calls of the {', '.join(size(s) for s in cfg['sizes'])} classes on "
           f"`{Path(cfg['topology']).name}` with the testbed's calibrated model: priced when first needed (`inline`), "
           f"or adopted from a child asked for them that long before (`ahead`){started}, in turns in one process, "
           f"{cfg['rounds']} rounds per lead.", ""]

    def versus(r: dict[str, Any], what: str) -> list[str]:
        cells = []
        for way, prefix in ways:
            lo, hi = r[f"{prefix}{what}ratio_ci95"]
            cells += [num(r[f"{what}medians_s"][way]), num(r[f"{prefix}{what}ratio_median"]),
                      f"{num(lo)}–{num(hi)}"]
        return cells

    head = [h for way, _ in ways for h in (f"{way} median s", f"{way} / inline", "95 %")]
    out += table(["lead (s)", "inline median s", *head, "same choices"],
                 ([num(r["lead_s"]), num(r["medians_s"]["inline"]), *versus(r, ""),
                   "yes" if r["same_choices"] else "NO"] for r in j["leads"].values()))
    rows = [r for r in j["leads"].values() if "neighbours_ratio_median" in r]
    if rows:
        out += ["", f"Then each class's explorer's planned neighbours (the pick's double and half depth, a close rival), "
                    f"one a call, {num(cfg['gap_s'])} s apart: their wait orders simulated as each executor is built "
                    f"(`inline`), or prepared by the child, asked as the explorer starts, in the same rounds.", ""]
        out += table(["lead (s)", "inline median s", *head, "same orders"],
                     ([num(r["lead_s"]), num(r["neighbours_medians_s"]["inline"]), *versus(r, "neighbours_"),
                       "yes" if r["same_orders"] else "NO"] for r in rows))
    return out + [""]


def adapt_testbed() -> list[str]:
    out: list[str] = []
    for name, title in (("adapt_testbed.json", "A NIC cut mid-job on the testbed (`gradsync bench adapt-testbed`)"),
                        ("adapt_bcube/adapt_testbed.json", "A NIC cut mid-job on BCube (`gradsync bench adapt-testbed "
                                                           "--topology bcube:3,2 --rate 200mbit --slow-rank 4`)"),
                        ("adapt_testbed_late.json", "A rank late every step on the testbed (`gradsync bench "
                                                    "adapt-testbed --scenario late`)"),
                        ("adapt_testbed_dead.json", "A link that stops carrying anything on the testbed (`gradsync "
                                                    "bench adapt-testbed --scenario dead`)")):
        if (RESULTS / name).is_file():
            out += _adapt_testbed(name, title)
    return out


def _adapt_testbed(name: str, title: str) -> list[str]:
    j = load(name)
    cfg, s = j["config"], j["summary"]
    scenario = cfg.get("scenario", "nic")
    change = {"late": lambda: f"Server {cfg['slow_rank']} enters every allreduce {num(cfg['delay_s'])} s late (one "
                              f"gloo allreduce's time, its warm-up median)",
              "dead": lambda: f"Server {cfg['slow_rank']}'s link to `{cfg['peer']}` is cut (`gradsync testbed link "
                              f"down`: its NIC loses the carrier, and the testbed's routes go around the link)",
              "nic": lambda: f"Server {cfg['slow_rank']}'s NICs run at 1/{num(cfg['factor'])} of their rate"}[scenario]()
    out = [f"## {title}", "", *sources(name),
           f"`{cfg['topology']}` at {cfg['rate']} per unit link, {cfg['world']} ranks, {size(cfg['size_bytes'])} float32 "
           f"allreduces: static gradsync (`adapt=False`), gradsync watching every qualifying allreduce "
           f"(`AdaptOptions(every=1)`) and gloo's `all_reduce`, one each per round in rotating order, {cfg['rounds']} "
           f"rounds after {cfg.get('warmup_rounds') or cfg['warmup']}. {change} "
           f"from round {cfg['degrade_at']} to {cfg['restore_at'] - 1}; each phase's median leaves out the "
           f"{cfg['settle']} rounds after a change. Static ran `{j['static_plan']}`.", ""]
    out += table(["method", *s["medians_s"]["static"].keys()],
                 ([m, *(num(v) for v in s["medians_s"][m].values())] for m in s["medians_s"]))
    r, met, goals = s["ratios"], s["met"], s["goals"]
    pred = j.get("predicted_degraded_s") or {}
    if scenario == "dead":
        over = s.get("adaptive_degraded_over_predicted_at_reroute")
        out += ["", f"While cut, adaptive runs {num(r['degraded_vs_static'])}x static and {num(r['degraded_vs_gloo'])}x "
                f"gloo; every sum exact: {'yes' if s['all_exact'] else 'NO'}; the reroute logged in one line: "
                f"{'yes' if met['logged'] else 'NO'}. After the reroute adaptive ran `{pred.get('adaptive_plan')}`, "
                f"which the cost model prices at {num(pred.get('model'))} s on the surviving graph (at the reroute it "
                f"chose `{pred.get('reroute_plan')}`, priced {num(pred.get('at_reroute'))} s): measured / predicted "
                f"{num(over)} (goal within {num(100 * goals['predicted_within'])} %: "
                f"{'met' if met['predicted'] else 'not met'}); {j['watched']} collectives watched."
                + _plans_note(j), ""]
        lines = [sw["message"] for sw in j["switches"]] + j["held"]
        return out + (block(lines) if lines else [])
    out += ["", f"While degraded, adaptive runs {num(r['degraded_vs_static'])}x static (goal ≥ "
            f"{num(goals['degraded_vs_static'])}x: {'met' if met['degraded_vs_static'] else 'not met'}) and "
            f"{num(r['degraded_vs_gloo'])}x gloo (goal ≥ {num(goals['degraded_vs_gloo'])}x: "
            f"{'met' if met['degraded_vs_gloo'] else 'not met'}); after / before "
            f"{num(r['recovered'])} (goal within 5 %: {'met' if met['recovered'] else 'not met'}); every sum exact: "
            f"{'yes' if s['all_exact'] else 'NO'}; {j['watched']} collectives watched"
            + (f"; the last degraded round ran `{pred['adaptive_plan']}`, which the model prices at "
               f"{num(pred['adaptive'])} s (measured / predicted {num(s['adaptive_degraded_over_predicted'])})"
               if s.get("adaptive_degraded_over_predicted") else "") + "." + _plans_note(j), ""]
    lines = [sw["message"] for sw in j["switches"]] + j["held"]
    return out + (block(lines) if lines else [])


def _plans_note(j: dict) -> str:
    """Which plan adaptive ran before the change, and how many rounds of the change it spent settling (exploring)."""
    plans, settled, cfg = j.get("plans"), j.get("settling_rounds"), j["config"]
    if not plans or not settled:
        return ""
    during = [r for r in settled["adaptive"] if cfg["degrade_at"] <= r < cfg["restore_at"]]
    return (f" Adaptive ran `{plans['adaptive'][0]}` before the change (its own exploration's pick; static's was "
            f"`{plans['static'][0]}`); it settled something (planned, built or timed a candidate) in {len(during)} of "
            f"the {cfg['restore_at'] - cfg['degrade_at']} rounds of the change, the slow rounds of the plot.")


def mergecomp() -> list[str]:
    j = load("mergecomp/mergecomp.json")
    out = ["## MergeComp (seed 004, `gradsync bench mergecomp`)", "", *sources("mergecomp/mergecomp.json"),
           f"`--quick` {num(j['quick'])}, scale 1/{j['scale']}, {j['reps']} reps. Step time speed-up over FP32 "
           "layer-wise for each partition (`yN`: N equal groups, `alg2`: Algorithm 2, `exact`: the DP search "
           "with the fitted per-group overhead):", ""]
    for step in j["step"]:
        keys = ["layerwise", "y1", "y2", "y4", "y8", "alg2", "exact", "exact_unfitted"]
        out += [f"{step['world']} processes:", ""]
        out += table(["compressor", *keys, "best", "exact / best", "exact groups"],
                     ([c, *(num(s["speedup_over_fp32"].get(k)) for k in keys), s["best"], num(s["exact_over_best"]),
                       num(s["exact_groups"])] for c, s in step["summary"].items()))
    out += table(["training run", "accuracy", "seconds", "groups"],
                 ([name, num(a["accuracy"]), num(a["seconds"]), num(a["groups"])] for name, a in j["accuracy"].items()))
    return out


def compress_testbed() -> list[str]:
    out = ["## Compression on the emulated cluster (`gradsync bench compress-testbed`, root)", ""]
    for rel in ("compress_testbed/compress_testbed.json", "compress_testbed/same_rank/compress_testbed.json",
                "compress_testbed/compress_testbed_loopback.json"):
        j = load(rel)
        out += [f"### `{rel}` ({j['created']}, {j['result']['mode']})", "", *sources(rel), *block(j["summary"])]
        if j.get("median_note"):
            out += [j["median_note"] + ".", ""]
    out += note("against torch's `powerSGD_hook` at rank 1, gradsync's PowerSGD at rank 2 (0.6 points below DDP's "
                "accuracy; torch's rank 1 2.8) was 1.29–1.43x faster per step in five runs (goal 1.3x, met in "
                "four), rank 4 1.21–1.28x; at the same rank as torch's hook, 1.40–1.46x (rank 4) and 1.39–1.53x "
                "(rank 1).")
    return out


def gpu() -> list[str]:
    out = ["## On a GPU (`gradsync bench gpu`)", ""]
    for path in sorted(RESULTS.glob("gpu_check-*.json")):
        j = load(path.name)
        env = j["environment"]
        if not env.get("cuda_available"):
            continue
        out += [f"### {env['gpu']}: torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}", "",
                *sources(path.name)]
        if j.get("parts_from"):  # parts measured in separate runs: say which
            out += ["Parts from separate runs: " + "; ".join(f"{k}: {v}" for k, v in j["parts_from"].items()) + ".", ""]
        engines: dict[str, list[int]] = {}
        for r in j["engines"]:
            engines.setdefault(r["engine"], [0, 0])[0 if r.get("ok") else 1] += 1
        out += ["Every compressor (and `auto` under each `allow` policy, where the run had them) through "
                "`DistributedOptimizer` and through the DDP `compression_hook`, and "
                "`gradsync.allreduce` of a CUDA tensor with every synthesizer and `auto`: "
                + "; ".join(f"{e} {ok} ran, {bad} failed" for e, (ok, bad) in engines.items()) + ".", ""]
        out += ["Codec time (compress + decompress of one float32 tensor, median, device synchronised) against "
                "GRACE's formulas on the same GPU (rand-k against both GRACE variants), against one copy of the "
                "tensor, against the same codec with the fused kernels off (`GRADSYNC_FUSED=0`, where they apply), "
                "and the device operations each call launches (`kernels`; GRACE's beside it). `grace_stream` is the same "
                "ratio with 20 calls back to back between synchronisations, the two in turn (what a training step "
                "sees, where codec calls queue behind each other):", ""]
        out += table(["codec", "elements", "ms", "× a copy", "× GRACE", "× torch form", "kernels", "GRACE kernels",
                      "host syncs"],
                     ([r["codec"], num(r["elements"]), num(r["gradsync_s"] * 1e3), num(r["gradsync_s"] / r["copy_s"]),
                       ", ".join(f"{k[6:]} {num(v)}" for k, v in r.items() if k.startswith("ratio_")) or "–",
                       num(r["gradsync_s"] / r["torch_form_s"]) if "torch_form_s" in r else "–",
                       num(r.get("kernels")), num(next((v for k, v in r.items() if k.endswith("_kernels")), None)),
                       num(r.get("host_syncs"))]
                      for r in j["codecs"] if "gradsync_s" in r))
        staging = [r for r in j.get("staging", []) if "gradsync_ring/cuda" in r]
        if staging:
            out += ["gloo with CUDA tensors against host tensors of the same bytes, 2 ranks sharing the GPU, "
                    "alternating (median): gradsync's ring stages each message through pinned host memory, "
                    "gloo's own allreduce stages the whole tensor:", ""]
            out += table(["bytes", "gradsync ring, host ms", "CUDA ms", "CUDA / host", "gloo, host ms", "CUDA ms",
                          "CUDA / host"],
                         ([num(r["bytes"]), num(r["gradsync_ring/cpu"] * 1e3), num(r["gradsync_ring/cuda"] * 1e3),
                           num(r["gradsync_ring_cuda_over_host"]), num(r["gloo/cpu"] * 1e3), num(r["gloo/cuda"] * 1e3),
                           num(r["gloo_cuda_over_host"])] for r in staging))
        if j.get("launch"):
            out += ["Host time per launch, 100 back to back: "
                    + ", ".join(f"{k[:-3].replace('_', ' ')} {num(v)} µs" for k, v in j["launch"].items())
                    + ". At 1e6 elements a codec is bound by the host, so its launches set its time.", ""]
        trainers = [r for r in j.get("trainers", []) if "case" in r]
        if trainers:
            out += ["Lightning's documented GPU recipe (`DDPStrategy(ddp_comm_state=<gradsync state built before the "
                    "process group>, ddp_comm_hook=...)`, one GPU): "
                    + "; ".join(f"{r['case']} {'ran' if r.get('ok') else 'FAILED'} ({r.get('buckets', 0)} buckets)"
                                for r in trainers) + ".", ""]
        hooks = {r["method"]: r["median_s"] for r in j.get("hooks", []) if "method" in r}
        if hooks:
            out += ["Step time, NCCL with one rank (ResNet-18 at 32x32, batch 64), methods interleaved (median): DDP and "
                    "its hooks, and `DistributedOptimizer` (`optimizer_*`) on the plain model:", ""]
            out += table(["method", "ms per step"], ([m, num(v * 1e3)] for m, v in hooks.items()))
            settled = next((r for r in j["hooks"] if "settled_steps" in r), None)
            out += ["; ".join(_hook_ratio(r) for r in j["hooks"] if "ratio" in r) + "."
                    + (f" Both autos had stopped choosing before {settled['settled_steps']} of the "
                       f"{settled['timed_steps']} timed steps." if settled else "")
                    + (f" torch's own fp16 hook against DDP, from the medians: {num(hooks['torch_fp16'] / hooks['ddp'])}."
                       if {"torch_fp16", "ddp"} <= hooks.keys() else ""), ""]
            calls = next((r for r in j["hooks"] if "hook_call_us" in r), None)
            if calls:  # runs since the check timed the hook calls themselves
                out += ["Host time per hook call (median over the timed steps, µs, on the training thread: the launch, "
                        "and the callbacks that run there): " + "; ".join(
                            f"{m} {num(us)} ({num(calls['hook_calls_per_step'].get(m, 0))} a step)"
                            for m, us in calls["hook_call_us"].items()) + ".", ""]
    return out


def _hook_ratio(r: dict) -> str:
    """One ratio of the GPU hook timings, its paired medians (all steps, the settled ones) in parentheses."""
    paired = []
    if "paired_median" in r:
        paired.append(f"median of the per-step ratios {num(r['paired_median'])}")
    if "paired_median_settled" in r:
        paired.append(f"over the settled steps {num(r['paired_median_settled'])}")
    return f"{r['ratio']}: {num(r['value'])}" + (f" ({'; '.join(paired)})" if paired else "")


def compression_sweep() -> list[str]:
    """The sweep with ``allow="any"`` (every codec), then the one with ``allow="cast"`` where it was run."""
    out: list[str] = []
    for rel, title in (("compression_sweep/compression_sweep.json", "against every fixed choice"),
                       ("compression_sweep/compression_sweep_cast.json", "with `allow=\"cast\"`")):
        if (RESULTS / rel).is_file():
            out += _compression_sweep(rel, title)
    return out


def _compression_sweep(rel: str, title: str) -> list[str]:
    j = load(rel)
    a = j["args"]
    out = [f"## `compression=\"auto\"` {title} (`gradsync bench compression-sweep`, root)", "",
           f"{j['created']}" + (f" (code {j['code']})" if j.get("code") else "") + f", `--rates {a['rates']} --fabrics {a['fabrics']} --models {a['models']} --paths "
           f"{a['paths']} --methods {a['methods']}`, {a['steps']} steps ({a['warmup']} not timed)"
           + (f", more up to {a['max_steps']} while a configuration stayed under {a['budget_s']:g} s (`--budget-s`)"
              if a.get("budget_s") else "") + f", `allow={j['allow']}`"
           + ("" if j.get("complete") else " (stopped before the last cell)") + ". Every method trains from the same "
           "weights on the same batches in the same processes, alternating step by step, "
           + _sweep_runtimes(j) + ". `auto / best` and `auto / "
           f"DDP`: {j['interval']}, with its 95 % interval.", "", *sources(rel)]
    rows = []
    for r in j["configs"]:
        best, ddp = r["auto_vs_best"], r.get("auto_vs_ddp") or {}
        ci = best["ci95"]
        rows.append([r["where"], f"{r['model']}/{r['path']}", r["best_fixed"], num(r["medians_s"].get("auto")),
                     num(r["medians_s"].get(r["best_fixed"])), num(best.get("pairs")),
                     f"{num(best['median'])} [{num(ci[0])}, {num(ci[1])}]",
                     num(ddp.get("median")), num(r["wire_bound"]), num(r["accuracy_points_vs_ddp"], 2),
                     num(r["choose_share"], 2), ", ".join(f"{k} {v}" for k, v in sorted((r.get("auto_codecs") or {}).items()))])
    steps = {r.get("accuracy_steps") for r in j["configs"]} - {None}
    acc = f"acc. points vs DDP at {steps.pop()} steps" if len(steps) == 1 else "acc. points vs DDP"
    out += table(["where", "model/path", "best fixed", "auto s", "best s", "pairs", "auto / best", "auto / DDP",
                  "wire-bound", acc, "choosing share", "auto ran"], rows)
    refs = {r.get("choose_reference") for r in j["configs"]}
    out += ["", "`choosing share`: " + ("auto's first steps beyond its mean pace, less DDP's own start-up excess "
                                         "(the estimator since 26a1bee)." if "ddp" in refs else
                                         "auto's first steps beyond its median, less `none`'s excess (the estimator "
                                         "before 26a1bee, which charged the steps' skew to auto: DDP alone read 2-7 %).")]
    return out + ["", *_sweep_excess(j), *block(j["summary"])]


def _sweep_excess(j: dict) -> list[str]:
    """Each method's first steps beyond its own settled pace (seconds), per configuration: the one-time costs the
    choosing share is read from, so that what auto pays can be told from what every method on gradsync's runtime
    pays. Empty for runs that kept no per-step times."""
    methods = j["args"].get("method_list") or []
    rows = []
    for cell in j.get("cells", []):
        where = f"{cell.get('fabric')} at {cell.get('rate')}" if cell.get("rate") else str(cell.get("topology"))
        for c in cell.get("configs", []):
            got = c.get("methods", {})
            if not all(got.get(m, {}).get("first_steps_s") and got[m].get("samples_s") for m in methods):
                return []
            n = {len(got[m]["first_steps_s"]) for m in methods}
            if len(n) != 1:
                return []
            rows.append([where, f"{c['model']}/{c['path']}", *(f"{_excess_s(got[m]):+.2f}" for m in methods)])
    if not rows or not methods:
        return []
    steps = len(j["cells"][0]["configs"][0]["methods"][methods[0]]["first_steps_s"])
    return [f"First {steps} steps' time beyond each method's own settled pace (mean of its timed steps), seconds: "
            "what starting costs each method, the gradsync runtime's pricing and exploring of new sizes included.",
            "", *table(["where", "model/path", *methods], rows)]


def _excess_s(row: dict) -> float:
    """A method's first steps beyond as many steps at its settled pace: ``benchmarks.compression_sweep._excess``, the
    sweep's own estimator, restated here because this script reads results without importing the benchmarks (torch)."""
    first = row["first_steps_s"]
    return sum(first) - len(first) * statistics.fmean(row["samples_s"])


def _sweep_runtimes(j: dict) -> str:
    """How the sweep's gradsync methods shared runtimes (older runs predate the field: one runtime for all)."""
    kinds = {c.get("runtimes") for c in j.get("cells", [])}
    if kinds == {"one per method and configuration"}:
        return "each gradsync method on a runtime (and process group) of its own"
    return ("every gradsync method on the cell's one runtime (before 0954c68: a size class one method's calls "
            "explored ran settled for the others, which flattered `auto`'s choosing)")


def cast_accuracy() -> list[str]:
    rel = "cast_accuracy/cast_accuracy.json"
    if not (RESULTS / rel).is_file():
        return []
    j = load(rel)
    a = j["args"]
    out = ["## What a cast on the wire costs in accuracy (`gradsync bench cast-accuracy`)", "", *sources(rel),
           f"One process, {a['world']} emulated ranks (the compression sweep's digits, global batch {a['batch']}, SGD "
           f"lr {a['lr']} with momentum 0.9), {a['seeds']} seeds (initial weights and data order); {j['created']}"
           + (f", code {j['code']}" if j.get("code") else "") + ". Each cell: the test accuracy's mean difference "
           "from the exact float32 average over the seeds, in points, and its range over the seeds (paired: the "
           "same seed's exact run). `jitter` moves every element of the exact average by one float32 ulp: what any "
           "change to the arithmetic costs. `fp16-scaled` shares a power-of-two scale so no gradient flushes to "
           "zero.", ""]
    checkpoints = None
    rows = []
    for model, m in j["models"].items():
        summary = m["summary"]
        checkpoints = checkpoints or list(summary["exact"])
        rows.append([model, "exact (accuracy %)", *(num(100 * summary["exact"][c]["mean"], 3) for c in checkpoints)])
        for variant, cells in summary.items():
            if variant != "exact":
                rows.append([model, variant, *(f"{cells[c]['points_vs_exact']:+.1f} [{cells[c]['range_vs_exact'][0]:+.1f}, "
                                               f"{cells[c]['range_vs_exact'][1]:+.1f}]" for c in checkpoints)])
    out += table(["model", "variant", *(f"{c} steps" for c in checkpoints or [])], rows)
    return out + [*CAST_ACCURACY_TEXT, ""]


#: What the cast-accuracy run shows (written from its results; the numbers are the table's).
CAST_ACCURACY_TEXT: list[str] = [
    "Past the steep rise of training, a cast moves the accuracy no more than a one-ulp jitter does: at 200 steps the "
    "mean differences from exact are +0.7 (fp16) and +0.6 (bf16) points on LeNet-5 against +0.1 for the jitter, and "
    "+0.1 and -0.7 on the MLP against -0.7 for the jitter, while every variant's range over the seeds spans 2.2-5.3 "
    "points, the jitter's included (the test set is 360 images; one image is 0.28 points). At 40 steps LeNet-5 is "
    "mid-rise (exact 62.5 % on average, 20.1-82.2 % by seed), and a perturbation the size of a cast's rounding moves "
    "it by several points either way (-7.2 to +13.1 by seed): fp16 -2.1 on average, bf16 +2.2, though bf16 rounds "
    "coarser. fp16 with a shared scale, which flushes nothing to zero, reads like plain fp16 (-1.7 at 40 steps, -1.1 "
    "at 100), so underflow is not what moves it. The compression sweep's LeNet-5 accuracies (after 50 steps in its "
    "latest run, the fixed fp16 8.1 points below DDP to 13.9 above, by configuration) are where one trajectory stands "
    "on that rise, not a cost of the cast: "
    "the 0.5-point goal of issue 40 can only be read on runs trained past the rise over several seeds, which the "
    "sweep's timed steps are not.",
]


SECTIONS: list[Callable[[], list[str]]] = [
    plan_scaling, plan_fabrics, sim_scaling, bml, allreduce_loopback, vs_native, vs_native_fabrics, tictac, mxnet_mpi,
    adapt, adapt_testbed, price_ahead, ps_loopback, codecs, hooks, mergecomp, compress_testbed, compression_sweep, cast_accuracy,
    gpu,
]

HEADER = """<!-- GENERATED by docs/generate_benchmarks.py from benchmarks/results/*.json; do not edit by hand.
     Rebuild: python docs/generate_benchmarks.py (tests/test_docs.py fails when this file is stale). -->
# Benchmarks

Measured results of the benchmarks in `benchmarks/` (list them with `gradsync bench`; run one with
`gradsync bench NAME`, options with `gradsync bench NAME --help`). Each writes JSON (and usually a plot) under
`benchmarks/results/`; the tables below are generated from those files. Benchmarks are never part of the
tests. Most ran on a 2-core VM, under load from other jobs; the emulated-cluster runs ("root") use
`gradsync testbed` (see [runtime.md](runtime.md#the-testbed)).

"""


def render() -> str:
    lines: list[str] = []
    for section in SECTIONS:
        lines += section()
    toc = [f"- [{line[3:]}](#{anchor(line[3:])})" for line in lines if line.startswith("## ")]
    return HEADER + "\n".join(toc) + "\n\n" + "\n".join(lines).rstrip() + "\n"


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="do not write; exit 1 if the committed page differs")
    p.add_argument("-o", "--output", type=Path, default=OUT)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.output.is_file() or args.output.read_text() != text:
            print(f"{args.output} is stale; run: python docs/generate_benchmarks.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
