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

The wire protocol, one JSON object a line. The spec is in a file named on the child's command line; the parent
writes ``{"sizes": [...], "first": bool}`` (or ``{"sizes": [...], "skip": true}``) lines to its stdin. The child
answers ``{"start": size}`` when it begins a class and :func:`priced_doc` when it ends one, or ``{"error": why}``
before it exits. A class's finish times (what the executor's wait order is computed from) travel as little-endian
float64 bytes in base64, with their count.
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
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import numpy as np

from gradsync.errors import PlanError
from gradsync.plan.synthesizers import PlanOptions
from gradsync.sim.choose import Choice, Chooser
from gradsync.sim.cost import CostModel, size_class
from gradsync.topology.io import from_dict as topology_from_dict
from gradsync.topology.model import Topology

__all__ = ["NICE", "SPEC_TYPE", "Pricer", "adopt_priced", "chooser_from_spec", "chooser_spec", "priced_doc"]

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
        raw = np.ascontiguousarray(times, dtype="<f8").tobytes()
        doc["finish"] = {"digest": digest, "dtype": "<f8", "count": int(times.size),
                         "data": base64.b64encode(raw).decode("ascii")}
    return doc


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
        if not isinstance(f, dict) or f.get("dtype") != "<f8" or not isinstance(f.get("count"), int):
            raise PlanError(f"a priced class's finish times must be <f8 with a count, got {f!r:.200}")
        times = np.frombuffer(base64.b64decode(f["data"]), "<f8")
        if times.size != f["count"] or not np.all(np.isfinite(times)):
            raise PlanError(f"a priced class's finish times hold {times.size} finite values, not {f['count']}")
        finish = (str(f["digest"]), times.astype(np.float64))
    chooser.adopt(choice, predicted, finish)
    return choice


# ---- the child ---------------------------------------------------------------------------------------------------

def _serve(spec_path: str) -> int:
    """The child's loop: build the chooser, then price the sizes asked for on stdin, each once: a batch marked
    ``"first"`` goes before those still queued (a caller that needs them now), others after; one marked ``"skip"``
    leaves the queue (the parent priced them itself). It reads stdin between
    classes and ends at its end (the parent closed: nothing waits for the rest)."""
    def say(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    try:
        os.nice(NICE)  # training's processes first; this one runs when they wait (at a class's first call, they all do)
        with open(spec_path, encoding="utf-8") as fh:
            chooser = chooser_from_spec(json.load(fh))
        fd = sys.stdin.fileno()
        queue: list[int] = []
        buffer = b""
        while True:
            while True:  # take in what was asked; wait only with nothing to do
                ready, _, _ = select.select([fd], [], [], 0 if queue else None)
                if not ready:
                    break
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return 0
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    doc = json.loads(line)
                    sizes = [_class_of(n) for n in doc["sizes"]]
                    if doc.get("skip"):
                        queue = [n for n in queue if n not in sizes]
                    elif doc.get("first"):
                        queue = sizes + [n for n in queue if n not in sizes]
                    else:
                        queue += [n for n in sizes if n not in queue]
            size = queue.pop(0)
            if chooser.chosen(size) is None:
                say({"start": size})
                say(priced_doc(chooser, size))
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

    def __init__(self, chooser: Chooser, *, python: str = sys.executable) -> None:
        self.chooser = chooser
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
        self._lock = threading.Lock()

    def _spawn(self, python: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"  # one core: the rest are training's
        return subprocess.Popen([python, "-m", "gradsync.sim.pricing", self._spec_path], stdin=subprocess.PIPE,
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

    def _send(self, doc: dict[str, Any]) -> None:
        if not doc["sizes"] or not self.alive:
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
        self._read(0.0)
        deadline = time.monotonic() + timeout_s
        while size not in self._done and self.current == size and self.failed is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                break
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
                self.current = None
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m gradsync.sim.pricing SPEC.json  (sizes as JSON lines on stdin)\n")
        raise SystemExit(2)
    raise SystemExit(_serve(sys.argv[1]))
