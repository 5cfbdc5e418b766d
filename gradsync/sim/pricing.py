"""Price size classes before they are needed, in a child process: rank 0's pricing off a job's critical path.

A job's first call of a size class waits while :class:`~gradsync.sim.choose.Chooser` simulates the candidate plans
(seconds on a rack fabric, docs/simulator.md), and every other rank waits for rank 0 with it. A caller that knows sizes
it will send later (``compression="auto"``: each group's payload under each codec it may try) can have them priced
beforehand by a :class:`Pricer`: a separate interpreter, beside training, that shares no GIL with the executors'
threads and takes another core where there is one.

The child builds the same chooser from plain data (:func:`chooser_spec`: the topology, cost model and options as
JSON; no pickle crosses the pipe) and runs the same code, so its choices are the bits the parent would compute (the
chooser is deterministic); :func:`chooser_spec` refuses inputs that do not survive the round trip. The parent adopts
a class the child finished (:meth:`Pricer.take`), waits for the one it is pricing, and prices any other itself: a
class asked for too late costs what it did without a child, plus the core the child uses.

A class's runtime may then time its pick's neighbours (:class:`~gradsync.comm.tuning.Explorer`: the double and half
depth, a rival algorithm, the backend's collective; :meth:`Chooser.explore_candidates
<gradsync.sim.choose.Chooser.explore_candidates>`), and each planned neighbour's executor is ordered by a simulation
of its own, on rank 0 while every rank waits, at the call that first runs it. The child prepares those too
(:func:`order_doc`): for a class the parent asks (``orders``, before anything else: its explorer has started), and,
started with ``--orders-from N``, for each class of at least N bytes it priced, once nothing else is asked.
:meth:`Pricer.order` hands them over (waiting for the one the child is on).

The wire protocol, one JSON object a line. The spec is in a file named on the child's command line; the parent
writes ``{"sizes": [...], "first": bool}``, ``{"sizes": [...], "skip": true}`` or ``{"orders": [...]}`` lines to its
stdin. The child answers ``{"start": size}`` when it begins a class and :func:`priced_doc` when it ends one;
``{"ordering": size, "digest": d}`` when it begins a neighbour's finish times and :func:`order_doc` when it ends them;
or ``{"error": why}`` before it exits. Finish times (what an executor's wait order is computed from) travel as
little-endian float64 bytes in base64, with their count.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

import numpy as np

from gradsync.errors import PlanError
from gradsync.plan.synthesizers import PlanOptions
from gradsync.sim.choose import Choice, Chooser
from gradsync.sim.cost import MAX_ORDERED_TRANSFERS, NATIVE, CostModel, size_class
from gradsync.topology.io import from_dict as topology_from_dict
from gradsync.topology.model import Topology

__all__ = ["NICE", "SPEC_TYPE", "Pricer", "adopt_priced", "chooser_from_spec", "chooser_spec", "order_doc", "priced_doc",
           "read_order"]

#: The ``type`` tag of a chooser spec file.
SPEC_TYPE = "gradsync.chooser"
#: The child's niceness increment: it takes the cores training leaves idle (waiting on the wire, or on rank 0 at a
#: class's first call, which is when the class it prices is needed), not the ones training computes on.
NICE = 10
#: Seconds :meth:`Pricer.close` waits for the terminated child to exit before it kills it.
CLOSE_WAIT_S = 2.0


# ---- the chooser as plain data -----------------------------------------------------------------------------------

def chooser_spec(chooser: Chooser) -> dict[str, Any]:
    """What builds ``chooser`` again elsewhere (:func:`chooser_from_spec`), as JSON-able data. Raises
    :class:`~gradsync.errors.PlanError` where the copy would differ (a topology attribute or option JSON cannot
    carry): a child pricing with other inputs would choose other plans."""
    doc = {"type": SPEC_TYPE, "topology": chooser.topology.to_dict(), "cost_model": chooser.model.to_dict(),
           "options": asdict(chooser.options), "algorithms": list(chooser.algorithms), "native": chooser.native,
           "margin": chooser.margin, "keep_within": chooser.keep_within}
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"the chooser for {chooser.topology.name!r} is not JSON ({exc}), so it cannot be priced in "
                        f"another process") from None
    copy = chooser_from_spec(json.loads(text))
    if not _same(copy, chooser):
        raise PlanError(f"the chooser for {chooser.topology.name!r} does not survive JSON (an attribute of its topology "
                        f"or options is not plain data), so it cannot be priced in another process")
    return doc


def _same(a: Chooser, b: Chooser) -> bool:
    return (a.topology == b.topology and _listed(a.topology.to_dict()) == _listed(b.topology.to_dict())
            and a.model == b.model and a.options == b.options and a.algorithms == b.algorithms
            and (a.native, a.margin, a.keep_within) == (b.native, b.margin, b.keep_within))


def _listed(data: Any) -> Any:
    """``data`` with tuples as lists (what JSON gives back for them), and nothing else changed: an integer key that
    JSON turns into a string still differs."""
    if isinstance(data, dict):
        return {k: _listed(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_listed(v) for v in data]
    return data


def chooser_from_spec(doc: Any) -> Chooser:
    """The chooser :func:`chooser_spec` describes, its fields checked."""
    if not isinstance(doc, dict) or doc.get("type") != SPEC_TYPE:
        raise PlanError(f'a chooser spec must be a JSON object with "type": "{SPEC_TYPE}", got {type(doc).__name__}')
    known = {"type", "topology", "cost_model", "options", "algorithms", "native", "margin", "keep_within"}
    if set(doc) != known:
        raise PlanError(f"chooser spec fields {sorted(doc)} must be exactly {sorted(known)}")
    topology: Topology = topology_from_dict(doc["topology"], "chooser spec")
    options = doc["options"]
    if not isinstance(options, dict):
        raise PlanError(f"chooser spec options={options!r} must be an object of PlanOptions fields")
    try:
        opts = PlanOptions(**options)
    except TypeError as exc:
        raise PlanError(f"chooser spec options {sorted(options)}: {exc}") from None
    algorithms = doc["algorithms"]
    if not isinstance(algorithms, list) or not all(isinstance(a, str) for a in algorithms):
        raise PlanError(f"chooser spec algorithms={algorithms!r} must be a list of synthesizer names")
    if not isinstance(doc["native"], bool):
        raise PlanError(f"chooser spec native={doc['native']!r} must be true or false")
    chooser = Chooser(topology, CostModel.from_dict(doc["cost_model"]), algorithms=algorithms, native=doc["native"],
                      options=opts, margin=float(doc["margin"]), keep_within=float(doc["keep_within"]))
    if chooser.algorithms != algorithms:
        raise PlanError(f"chooser spec algorithms {algorithms} are not all applicable here ({chooser.algorithms}): "
                        f"a synthesizer registered in the parent only cannot plan in a child")
    return chooser


# ---- one priced class --------------------------------------------------------------------------------------------

def priced_doc(chooser: Chooser, size: int) -> dict[str, Any]:
    """Price ``size``'s class and describe what :func:`adopt_priced` needs: the choice, every prediction made for the
    class (by schedule digest), and the pick's finish times."""
    choice = chooser.choose(size)
    predicted, finish = chooser.priced(choice.size_bytes)
    doc: dict[str, Any] = {"size": int(choice.size_bytes), "choice": choice.to_dict(),
                           "predicted": [[digest, t] for digest, t in predicted.items()], "finish": None}
    if finish is not None:
        digest, times = finish
        doc["finish"] = {"digest": digest, **_times_doc(times)}
    return doc


def _times_doc(times: np.ndarray) -> dict[str, Any]:
    raw = np.ascontiguousarray(times, dtype="<f8").tobytes()
    return {"dtype": "<f8", "count": int(times.size), "data": base64.b64encode(raw).decode("ascii")}


def _times_from(doc: Any, what: str) -> np.ndarray:
    """:func:`_times_doc` read back, checked: finite <f8 values, as many as it says."""
    if not isinstance(doc, dict) or doc.get("dtype") != "<f8" or not isinstance(doc.get("count"), int):
        raise PlanError(f"{what} must be <f8 with a count, got {doc!r:.200}")
    try:
        times = np.frombuffer(base64.b64decode(str(doc["data"]), validate=True), "<f8")
    except (KeyError, ValueError) as exc:
        raise PlanError(f"{what} are not base64 float64 bytes ({exc})") from None
    if times.size != doc["count"] or not np.all(np.isfinite(times)):
        raise PlanError(f"{what} hold {times.size} finite values, not {doc['count']}")
    return times.astype(np.float64)


def order_candidates(chooser: Chooser, size: int) -> list[tuple[str, int]]:
    """The planned neighbours of ``size``'s pick that a runtime's explorer builds executors of and orders (left out:
    the pick itself, whose finish times pricing keeps; the backend's collective, which has no wait order; and a
    schedule over :data:`~gradsync.sim.cost.MAX_ORDERED_TRANSFERS`, which runs in step order)."""
    choice = chooser.choose(size)
    pick = (choice.algorithm, choice.pipeline)
    return [c for c in chooser.explore_candidates(choice) if c != pick and c[0] != NATIVE
            and chooser.schedule(*c).num_transfers <= MAX_ORDERED_TRANSFERS]


def order_doc(chooser: Chooser, size: int, candidate: tuple[str, int]) -> dict[str, Any]:
    """``candidate``'s finish times for ``size``'s class (:meth:`Chooser.finish_of
    <gradsync.sim.choose.Chooser.finish_of>`), by its schedule's digest: what :func:`read_order` takes back."""
    schedule = chooser.schedule(*candidate)
    times = chooser.finish_of(schedule, size_class(size))
    return {"order": int(size_class(size)), "digest": schedule.digest, "finish": _times_doc(times)}


def read_order(doc: Any) -> tuple[int, str, np.ndarray]:
    """:func:`order_doc` read back, checked: (size class, schedule digest, finish times)."""
    if not isinstance(doc, dict) or not {"order", "digest", "finish"} <= set(doc):
        raise PlanError(f"a neighbour's finish times need order, digest and finish; got {doc!r:.200}")
    size = doc["order"]
    if isinstance(size, bool) or not isinstance(size, int) or size != size_class(size):
        raise PlanError(f"a neighbour's finish times are for {size!r} bytes, which is not a size class")
    return size, str(doc["digest"]), _times_from(doc["finish"], "a neighbour's finish times")


def adopt_priced(chooser: Chooser, doc: Any) -> Choice:
    """Record a class :func:`priced_doc` priced in an identical chooser in ``chooser`` (checked: the
    wire carries data, not trust)."""
    if not isinstance(doc, dict) or not {"size", "choice", "predicted", "finish"} <= set(doc):
        raise PlanError(f"a priced class needs size, choice, predicted and finish; got {doc!r:.200}")
    choice = Choice.from_dict(doc["choice"])
    try:
        predicted = {str(d): float(t) for d, t in doc["predicted"]}
    except (TypeError, ValueError) as exc:
        raise PlanError(f"a priced class's predictions are malformed ({exc}): {doc['predicted']!r:.200}") from None
    if choice.size_bytes != size_class(choice.size_bytes) or int(doc["size"]) != choice.size_bytes:
        raise PlanError(f"a priced class of {doc['size']!r} bytes must be a size class; got {choice.size_bytes}")
    finish = None
    if doc["finish"] is not None:
        f = doc["finish"]
        times = _times_from(f, "a priced class's finish times")
        finish = (str(f["digest"]), times)
    chooser.adopt(choice, predicted, finish)
    return choice


# ---- the child ---------------------------------------------------------------------------------------------------

def _serve(spec_path: str, orders_from: int | None = None) -> int:
    """The child's loop: build the chooser, then price the sizes asked for on stdin, each once: a batch marked
    ``"first"`` goes before those still queued (a caller that needs them now), others after; one marked ``"skip"``
    leaves the queue (the parent priced them itself). Neighbours' finish times (:func:`order_doc`) asked for with
    ``"orders"`` come before any pricing; with ``orders_from``, those of each class of at least that many bytes
    priced here come once nothing else is asked. It reads stdin between units of work (a class, a neighbour) and
    ends at its end (the parent closed: nothing waits for the rest)."""
    def say(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    try:
        os.nice(NICE)  # training's processes first; this one runs when they wait (at a class's first call, they all do)
        with open(spec_path, encoding="utf-8") as fh:
            chooser = chooser_from_spec(json.load(fh))
        fd = sys.stdin.fileno()
        queue: list[int] = []  # classes to price
        asked: list[int] = []  # classes whose neighbours the parent asked for
        idle: list[int] = []  # classes priced here whose neighbours come when nothing else waits
        sent: set[tuple[int, tuple[str, int]]] = set()
        buffer = b""

        def price(size: int) -> None:
            if chooser.chosen(size) is None:
                say({"start": size})
                say(priced_doc(chooser, size))
                if orders_from is not None and size >= orders_from:
                    idle.append(size)

        def next_order(sizes: list[int]) -> tuple[int, tuple[str, int]] | None:
            """The first neighbour of ``sizes``' classes not sent yet (classes with none left leave the list); a class
            not priced yet is priced first (and said: the parent may not have priced it either)."""
            while sizes:
                price(sizes[0])
                left = [c for c in order_candidates(chooser, sizes[0]) if (sizes[0], c) not in sent]
                if left:
                    return sizes[0], left[0]
                sizes.pop(0)
            return None

        while True:
            while True:  # take in what was asked; wait only with nothing to do
                ready, _, _ = select.select([fd], [], [], 0 if queue or asked or idle else None)
                if not ready:
                    break
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return 0
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    doc = json.loads(line)
                    if "orders" in doc:
                        sizes = [_class_of(n) for n in doc["orders"]]
                        asked = sizes + [n for n in asked if n not in sizes]
                        continue
                    sizes = [_class_of(n) for n in doc["sizes"]]
                    if doc.get("skip"):
                        queue = [n for n in queue if n not in sizes]
                    elif doc.get("first"):
                        queue = sizes + [n for n in queue if n not in sizes]
                    else:
                        queue += [n for n in sizes if n not in queue]
            unit = next_order(asked)
            if unit is None and queue:
                price(queue.pop(0))
                continue
            unit = unit or next_order(idle)
            if unit is not None:
                size, candidate = unit
                sent.add(unit)
                say({"ordering": size, "digest": chooser.schedule(*candidate).digest})
                say(order_doc(chooser, size, candidate))
    except BrokenPipeError:
        return 0  # the parent closed: nothing is waiting for what this would say
    except Exception as exc:  # every failure is reported to the parent, which prices on its own instead
        try:
            say({"error": f"{type(exc).__name__}: {exc}"})
        except BrokenPipeError:
            pass
        return 1


def _class_of(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise PlanError(f"size {nbytes!r} must be an integer >= 1 (bytes)")
    return size_class(nbytes)


# ---- the parent's handle -----------------------------------------------------------------------------------------

class Pricer:
    """A child process that prices ``chooser``'s size classes ahead of the parent; :meth:`take` adopts them.

    Its methods may be called from several threads (a hook's or optimizer's asks, the thread whose call needs a class
    takes); one runs at a time, and :meth:`take` holds the others while it waits. The child ends at :meth:`close`
    (terminated; killed after :data:`CLOSE_WAIT_S`), at the end of its stdin (the parent gone: after the class it is
    on), or when it fails (it says why, :attr:`failed` keeps it, and the parent prices every class itself).
    """

    def __init__(self, chooser: Chooser, *, python: str = sys.executable, orders_from: int | None = None) -> None:
        if orders_from is not None and (isinstance(orders_from, bool) or not isinstance(orders_from, int)
                                        or orders_from < 0):
            raise PlanError(f"orders_from={orders_from!r} must be None or a byte count >= 0 (the smallest class whose "
                            f"neighbours' finish times the child prepares unasked)")
        self.chooser = chooser
        self.orders_from = orders_from
        spec = chooser_spec(chooser)
        fd, self._spec_path = tempfile.mkstemp(prefix="gradsync-pricer-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(spec, fh)
        try:
            self._proc = self._spawn(python)
        except OSError:
            os.unlink(self._spec_path)
            raise
        self._stdin = self._proc.stdin
        self._out = self._proc.stdout.fileno()  # type: ignore[union-attr]  (a pipe: stdout=PIPE)
        os.set_blocking(self._out, False)
        self._buffer = b""
        self._asked: set[int] = set()
        self._done: dict[int, Any] = {}
        self._closed = False
        #: the class the child is pricing now (None: idle, or between classes)
        self.current: int | None = None
        #: why the child stopped early (None while it runs or after a clean close)
        self.failed: str | None = None
        #: classes the child priced, in the order it finished them; those adopted from it, in order
        self.finished: list[int] = []
        self.adopted: list[int] = []
        #: the neighbour's finish times the child is computing now, as (class, schedule digest), or None
        self.ordering: tuple[int, str] | None = None
        self._orders: dict[tuple[int, str], np.ndarray] = {}
        #: neighbours' finish times handed over (:meth:`order`), as (class, digest), in order
        self.ordered: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def _spawn(self, python: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"  # one core: the rest are training's
        extra = [] if self.orders_from is None else ["--orders-from", str(self.orders_from)]
        return subprocess.Popen([python, "-m", "gradsync.sim.pricing", self._spec_path, *extra], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)

    def ask(self, sizes: Iterable[float], *, first: bool = False) -> None:
        """Price the classes of ``sizes`` (not those chosen already) in this order: after those asked before, or before
        those still queued with ``first`` (a caller about to need them)."""
        with self._lock:
            todo: list[int] = []
            for nbytes in sizes:
                size = size_class(nbytes)
                if (first or size not in self._asked) and size not in todo and self.chooser.chosen(size) is None:
                    self._asked.add(size)
                    todo.append(size)
            self._send({"sizes": todo, "first": first})

    def skip(self, nbytes: float) -> None:
        """Take ``nbytes``'s class off the child's queue (the caller prices it: the child's core goes to the next)."""
        with self._lock:
            size = size_class(nbytes)
            if size in self._asked and size not in self.finished:
                self._send({"sizes": [size], "skip": True})

    def want_orders(self, nbytes: float) -> None:
        """Have the child prepare the finish times of ``nbytes``'s class's planned neighbours (its explorer started:
        they are built on its next calls) before anything else; it prices the class first where it has not."""
        with self._lock:
            self._send({"orders": [size_class(nbytes)]})

    def order(self, nbytes: float, digest: str, timeout_s: float = 600.0) -> np.ndarray | None:
        """The finish times of the schedule with ``digest`` for ``nbytes``'s class, if the child prepared them,
        waiting (up to ``timeout_s``) if it is on them now; None where the caller simulates them itself."""
        with self._lock:
            if self._closed:
                return None
            key = (size_class(nbytes), str(digest))
            self._wait_while(lambda: key not in self._orders and self.ordering == key, timeout_s)
            times = self._orders.pop(key, None)
            if times is not None:
                self.ordered.append(key)
            return times

    def _send(self, doc: dict[str, Any]) -> None:
        if not doc.get("sizes", doc.get("orders")) or not self.alive:
            return
        try:
            self._stdin.write((json.dumps(doc) + "\n").encode())  # type: ignore[union-attr]
            self._stdin.flush()  # type: ignore[union-attr]
        except OSError as exc:  # the child died: its error line, if any, says why
            self._read(0.0)
            self.failed = self.failed or f"its stdin closed ({exc})"

    @property
    def alive(self) -> bool:
        """Whether the child runs and can be asked (not failed, not closed)."""
        return not self._closed and self.failed is None and self._proc.poll() is None

    def take(self, nbytes: float, timeout_s: float = 600.0) -> bool:
        """Adopt ``nbytes``'s class into the chooser if the child priced it, waiting (up to ``timeout_s``) if it is
        pricing it now; False where the caller prices it (not asked, still queued, or the child failed)."""
        with self._lock:
            return self._take(size_class(nbytes), timeout_s)

    def _take(self, size: int, timeout_s: float) -> bool:
        if self._closed:
            return False
        self._wait_while(lambda: size not in self._done and self.current == size, timeout_s)
        doc = self._done.pop(size, None)
        if doc is None or self.chooser.chosen(size) is not None:
            return False
        try:
            adopt_priced(self.chooser, doc)
        except PlanError as exc:
            self.failed = str(exc)
            return False
        self.adopted.append(size)
        return True

    def _wait_while(self, busy: Callable[[], bool], timeout_s: float) -> None:
        """Read what the child says, and while ``busy()`` (it is on what the caller waits for) go on reading, up to
        ``timeout_s``, until it fails or ends."""
        self._read(0.0)
        deadline = time.monotonic() + timeout_s
        while busy() and self.failed is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                break

    def poll(self) -> None:
        """Read what the child has said so far (:attr:`current`, :attr:`finished`, :attr:`failed`), without waiting."""
        with self._lock:
            if not self._closed:
                self._read(0.0)

    def _read(self, wait_s: float) -> bool:
        """Read what the child said (waiting up to ``wait_s`` for something); False at its end of output."""
        if wait_s > 0:
            ready, _, _ = select.select([self._out], [], [], wait_s)
            if not ready:
                return True
        while True:
            try:
                chunk = os.read(self._out, 1 << 20)
            except BlockingIOError:
                return True
            if not chunk:
                if self.failed is None and self._proc.poll() not in (0, None):
                    self.failed = f"it exited with status {self._proc.returncode}"
                self.current = self.ordering = None
                return False
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self._heard(line)

    def _heard(self, line: bytes) -> None:
        try:
            doc = json.loads(line)
        except ValueError:
            self.failed = f"it wrote {line[:80]!r}, not a JSON line"
            return
        if not isinstance(doc, dict):
            self.failed = f"it wrote {doc!r:.80}, not a JSON object"
        elif "error" in doc:
            self.failed = str(doc["error"])
        elif "start" in doc:
            self.current = int(doc["start"])
        elif "ordering" in doc:
            self.ordering = (int(doc["ordering"]), str(doc["digest"]))
        elif "order" in doc:
            try:
                size, digest, times = read_order(doc)
            except PlanError as exc:
                self.failed = str(exc)
                return
            self._orders[(size, digest)] = times
            self.ordering = None
        elif "size" in doc:
            self._done[int(doc["size"])] = doc
            self.finished.append(int(doc["size"]))
            self.current = None

    def close(self) -> None:
        """End the child (terminated, killed after :data:`CLOSE_WAIT_S`) and remove its spec file."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._closed = True
        proc = self._proc
        if proc.poll() is None:
            try:
                proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            proc.terminate()
            try:
                proc.wait(CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(CLOSE_WAIT_S)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass
        try:
            os.unlink(self._spec_path)
        except FileNotFoundError:
            pass


def _main(argv: list[str]) -> int:
    usage = "usage: python -m gradsync.sim.pricing SPEC.json [--orders-from BYTES]  (sizes as JSON lines on stdin)\n"
    if len(argv) == 1:
        return _serve(argv[0])
    if len(argv) == 3 and argv[1] == "--orders-from" and argv[2].isdigit():
        return _serve(argv[0], int(argv[2]))
    sys.stderr.write(usage)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
