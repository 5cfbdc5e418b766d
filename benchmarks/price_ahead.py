"""What pricing ahead saves a job's first calls: ``gradsync bench price-ahead``.

A size class's first call waits while rank 0 prices it (:meth:`gradsync.sim.choose.Chooser.choose`), and every rank
waits with it. :class:`gradsync.sim.pricing.Pricer` prices classes a caller anticipates in a child process meanwhile
(``compression="auto"``'s optimizer anticipates every class its groups may fall in before its two calibration steps).
Here, in one process, each round times the stall of a job's first calls of ``--sizes`` three ways, in a
carry-over-balanced order (:func:`gradsync.sim.bench.balanced_orders`):

* ``inline``: each class priced when it is first needed, as without a child;
* ``ahead``: a child started and asked for the classes, ``--leads`` seconds of other work (the steps before the first
  call; a sleep here), then the same first calls, which adopt what the child priced;
* ``started``: the same, with the child started ``--started-s`` seconds before it is asked, as ``gradsync.init``
  starts it (:meth:`gradsync.comm.runtime.Runtime.start_pricing`): the interpreter's start and imports are then over
  when the model's optimizer or hook asks for its sizes.

Then, as a class's explorer does (:class:`gradsync.comm.tuning.Explorer`), each class's planned neighbours (the pick's
double and half depth, a close rival) are ordered one a call, ``--gap-s`` apart (a training step between two calls):
``inline`` simulates each as its executor is built, ``ahead`` asks the child as the class's explorer starts and takes
what it prepared (the child started with ``orders_from``, as on an exploring runtime). That stall is reported apart,
and each order is checked equal to the inline one.

Both price on the two-tier file (``benchmarks/fabrics/two-tier-4to1.yaml``) with the cost model the testbed calibrated
at 300 Mbit/s (embedded; ``--cost-model FILE`` for another). Each choice a child made is checked equal, bit for bit, to
the ``inline`` one. Reported per lead: medians of the stall, and the median of the per-round ratios to ``inline`` of
each way with a child, with a bootstrap 95 % interval. ``--leads 0`` is a call that needs its class at once (a DDP hook's first bucket): a child
started then can only cost there, one started at init has had its own start. Writes ``price_ahead.{json,png}`` to ``--out``::

    gradsync bench price-ahead                       # about 5 minutes on 2 cores
    .venv/bin/python -m benchmarks.price_ahead --rounds 2 --leads 0,1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

RESULT_TYPE = "gradsync.bench.price_ahead"
METHODS = ("inline", "ahead", "started")
#: The methods held against ``inline``, each with its ratios in a lead's row (``ahead``'s unprefixed).
CHILD = {"ahead": "", "started": "started_"}
_ROOT = Path(__file__).resolve().parents[1]
FABRIC = _ROOT / "benchmarks" / "fabrics" / "two-tier-4to1.yaml"
#: The testbed's calibration of the two-tier file at 300 Mbit/s (compression sweep of 2026-12-01).
COST_MODEL = {"type": "gradsync.cost_model", "message_s": 0.0018415025426150068,
              "native_message_s": 0.0017036132812500002, "goodput": 0.9588416666666666,
              "reverse_share": 0.06361802925181803, "burst_s": 0.004263517038312239, "link_GBps": {"link": 0.0375},
              "pipelines": [1, 2, 4, 8, 16, 32, 64], "source": "two-tier-4to1 testbed at 300 Mbit/s, 6 ranks"}


def _chooser(topology: Any, model: Any) -> Any:
    from gradsync.sim.choose import EXPLORE_RIVAL, Chooser

    return Chooser(topology, model, native=True, keep_within=EXPLORE_RIVAL)  # the runtime's allreduce chooser


def one_round(method: str, topology: Any, model: Any, sizes: list[int], lead_s: float,
              gap_s: float = 0.0, started_s: float = 0.0) -> tuple[float, float, list[Any], list[bytes]]:
    """The stall of the first calls of ``sizes`` (seconds), that of ordering their explorers' neighbours, the choices
    made and the wait orders (as bytes)."""
    from gradsync.sim.pricing import Pricer, order_candidates

    chooser = _chooser(topology, model)
    pricer = None
    if method in CHILD:
        pricer = Pricer(chooser, orders_from=min(sizes))
        if method == "started":
            time.sleep(started_s)  # gradsync.init started it; the model, its data and its optimizer come next
        pricer.ask(sizes)
        time.sleep(lead_s)
    try:
        t0 = time.perf_counter()
        choices = []
        for size in sizes:
            if pricer is not None and not pricer.take(size):
                pricer.skip(size)
            choices.append(chooser.choose(size))
        first = time.perf_counter() - t0
        neighbours, orders = 0.0, []
        for size in sizes:
            if pricer is not None:
                pricer.want_orders(size)  # the class's explorer starts at its first call
            for candidate in order_candidates(chooser, size):
                time.sleep(gap_s)  # the call before: a training step
                t0 = time.perf_counter()
                schedule = chooser.schedule(*candidate)
                known = None if pricer is None else pricer.order(size, schedule.digest)
                orders.append(model.wait_order(schedule, topology, size, known).astype("<f8").tobytes())
                neighbours += time.perf_counter() - t0
        return first, neighbours, choices, orders
    finally:
        if pricer is not None:
            pricer.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from gradsync.sim.bench import balanced_orders, bootstrap_median_ci, paired_ratios
    from gradsync.sim.cost import CostModel
    from gradsync.topology.io import get_topology

    topology = get_topology(str(args.topology))
    model = CostModel.from_dict(json.loads(args.cost_model.read_text()) if args.cost_model else COST_MODEL)
    sizes = [int(s) for s in args.sizes.split(",")]
    leads = [float(x) for x in args.leads.split(",")]
    where = args.topology.resolve()
    label = where.relative_to(_ROOT).as_posix() if where.is_file() and where.is_relative_to(_ROOT) else str(args.topology)
    out: dict[str, Any] = {"type": RESULT_TYPE, "config": {"topology": label, "cost_model": model.to_dict(),
                                                            "sizes": sizes, "rounds": args.rounds}, "leads": {}}
    orders = balanced_orders(METHODS)
    out["config"]["gap_s"] = args.gap_s
    out["config"]["started_s"] = args.started_s
    for lead in leads:
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        near: dict[str, list[float]] = {m: [] for m in METHODS}
        same = same_orders = True
        for r in range(args.rounds):
            got = {}
            for method in orders[r % len(orders)]:
                took, ordering, choices, waits = one_round(method, topology, model, sizes, lead, args.gap_s,
                                                           args.started_s)
                times[method].append(took)
                near[method].append(ordering)
                got[method] = (choices, waits)
            same = same and all(got[m][0] == got["inline"][0] for m in CHILD)
            same_orders = same_orders and all(got[m][1] == got["inline"][1] for m in CHILD)
            print(f"lead {lead:g} s, round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{m} {times[m][-1]:.2f} + {near[m][-1]:.2f} s" for m in METHODS), flush=True)
        row: dict[str, Any] = {
            "lead_s": lead, "samples_s": times, "medians_s": {m: statistics.median(v) for m, v in times.items()},
            "same_choices": same, "neighbours_samples_s": near, "same_orders": same_orders,
            "neighbours_medians_s": {m: statistics.median(v) for m, v in near.items()}}
        for method, prefix in CHILD.items():
            ratios = paired_ratios(times[method], times["inline"])
            row[f"{prefix}ratio_median"] = statistics.median(ratios)
            row[f"{prefix}ratio_ci95"] = list(bootstrap_median_ci(ratios))
            if min(near["inline"]) > 0:
                ratios = paired_ratios(near[method], near["inline"])
                row[f"{prefix}neighbours_ratio_median"] = statistics.median(ratios)
                row[f"{prefix}neighbours_ratio_ci95"] = list(bootstrap_median_ci(ratios))
        out["leads"][f"{lead:g}"] = row
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    leads = list(out["leads"].values())
    fig, ax = plt.subplots(figsize=(8.5, 3.5))
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        xs = [j + (i - (len(METHODS) - 1) / 2) * width for j in range(len(leads))]
        first = [row["medians_s"][method] for row in leads]
        ax.bar(xs, first, width, label=f"{method}: first calls", color=f"C{i}")
        ax.bar(xs, [row.get("neighbours_medians_s", {}).get(method, 0.0) for row in leads], width, bottom=first,
               label=f"{method}: explorer's neighbours", color=f"C{i}", alpha=0.45)
    ax.set_xticks(range(len(leads)), [f"lead {row['lead_s']:g} s" for row in leads])
    ax.set_ylabel("stall, median (s)")
    sizes = ", ".join(f"{s / 2**20:g}" for s in out["config"]["sizes"])
    ax.set_title(f"pricing {sizes} MiB on {Path(out['config']['topology']).stem}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not on them
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gradsync bench price-ahead", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", type=Path, default=FABRIC, help="topology file or name (default the two-tier file)")
    p.add_argument("--cost-model", type=Path, default=None, help="cost model JSON (default the testbed's, embedded)")
    p.add_argument("--sizes", default=f"{16 << 20},{8 << 20}", help="bytes, comma-separated (default 16 and 8 MiB)")
    p.add_argument("--leads", default="3,1,0",
                   help="seconds between asking for the classes and their first calls, comma-separated (default 3,1,0)")
    p.add_argument("--started-s", type=float, default=3.0,
                   help="seconds the 'started' child runs before it is asked (default 3: init, then the model)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per lead (default 6)")
    p.add_argument("--gap-s", type=float, default=0.5,
                   help="seconds between an explorer's calls, one neighbour built a call (default 0.5: a training step)")
    p.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results" / "price_ahead")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be >= 1")
    if not args.gap_s >= 0:
        p.error(f"--gap-s {args.gap_s} must be >= 0")
    if not args.started_s >= 0:
        p.error(f"--started-s {args.started_s} must be >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    out = run(args)
    (args.out / "price_ahead.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out, args.out / "price_ahead.png")
    for lead, row in out["leads"].items():
        vs = ", ".join(f"{m} {row['medians_s'][m]:.2f} s (x{row[p + 'ratio_median']:.2f} "
                       f"[{row[p + 'ratio_ci95'][0]:.2f}, {row[p + 'ratio_ci95'][1]:.2f}])" for m, p in CHILD.items())
        near = ", ".join(f"{m} {row['neighbours_medians_s'][m]:.2f} s" for m in METHODS)
        print(f"lead {lead} s: inline {row['medians_s']['inline']:.2f} s, {vs}, same choices: {row['same_choices']}; "
              f"neighbours' orders: {near}, same orders: {row['same_orders']}")
    print(f"wrote {args.out / 'price_ahead.json'} and {args.out / 'price_ahead.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
