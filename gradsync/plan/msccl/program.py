"""An MSCCL algorithm as plain data, its XML form, and the executor limits it must fit.

The format is the one the MSCCL executor parses (``src/misc/msccl/msccl_parser.cc`` in
Azure/msccl-executor-nccl, the executor RCCL and MSCCL build in; msccl-tools writes it from
``msccl/language/ir.py:ir_to_xml``)::

    <algo name proto nchannels nchunksperloop ngpus coll inplace outofplace minBytes maxBytes>
      <gpu id i_chunks o_chunks s_chunks>
        <tb id send recv chan>
          <step s type srcbuf srcoff dstbuf dstoff cnt depid deps hasdep/>

* A buffer of ``count`` elements is cut into ``nchunksperloop`` equal chunks (the executor runs only where
  ``count % nchunksperloop == 0``: ``msccl_lifecycle.cc``); offsets and ``cnt`` are in chunks.
* A thread block (``tb``) runs its steps in order, on one channel, with at most one send peer and one
  receive peer: the connection ``(sender, receiver, channel)`` is a FIFO, so the k-th sending step on it
  meets the k-th receiving step on it.
* ``depid``/``deps``: before starting, wait until thread block ``depid`` of the same GPU has completed a
  step ``>= deps`` whose ``hasdep`` is 1 (``msccl_kernel.cu``: a flag per thread block, set to the step
  index after a step with ``hasDependence``, compared with ``>=``). More than one dependency is written as
  ``nop`` steps before the step, each carrying one (the parser folds them into the next step and refuses a
  chain that does not end in a step with its own ``depid``).
* Step types (``msccl_struct.h``): ``s`` send, ``r`` receive, ``rcs`` receive-copy-send, ``rrs``
  receive-reduce-send, ``rrc`` receive-reduce-copy, ``rrcs`` receive-reduce-copy-send, ``cpy`` local copy,
  ``re`` local reduce (``dst += src``), ``nop``.

Parsing rejects DTDs and entity declarations (no entity expansion is ever needed for this format).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field

from gradsync.errors import MscclError

__all__ = ["BUFFERS", "DEFAULT_LIMITS", "MscclLimits", "MscclProgram", "MscclGpu", "MscclStep", "MscclThreadBlock", "STEP_KINDS",
           "StepKind", "parse_msccl_xml"]

#: Buffer names: input, output, scratch.
BUFFERS = ("i", "o", "s")


@dataclass(frozen=True)
class StepKind:
    """What a step type does with the network and the local buffers (``msccl_kernel.cu``'s ``prims`` calls)."""

    recv: bool = False
    send: bool = False
    #: Reads ``src`` locally (send, copy, the reduce operand).
    reads_src: bool = False
    #: Reads ``dst`` locally (``re`` adds into it).
    reads_dst: bool = False
    writes_dst: bool = False
    #: The value produced (written or sent) is a reduction of two operands.
    reduce: bool = False


#: Registry of step types by their XML name.
STEP_KINDS: Mapping[str, StepKind] = {
    "s": StepKind(send=True, reads_src=True),
    "r": StepKind(recv=True, writes_dst=True),
    "rcs": StepKind(recv=True, send=True, writes_dst=True),
    "rrs": StepKind(recv=True, send=True, reads_src=True, reduce=True),
    "rrc": StepKind(recv=True, reads_src=True, writes_dst=True, reduce=True),
    "rrcs": StepKind(recv=True, send=True, reads_src=True, writes_dst=True, reduce=True),
    "cpy": StepKind(reads_src=True, writes_dst=True),
    "re": StepKind(reads_src=True, reads_dst=True, writes_dst=True, reduce=True),
    "nop": StepKind(),
}


@dataclass(frozen=True)
class MscclLimits:
    """Executor limits, the smallest over the executors in use (each cited where it is defined).

    * ``max_steps``: ``MSCCL_MAX_NUM_STEPS`` steps per thread block, nops included: 64 in
      Azure/msccl-executor-nccl (``makefiles/common.mk``) and RCCL, 256 in microsoft/msccl (``src/include/msccl.h``).
    * ``max_thread_blocks``: ``MSCCL_MAX_NUM_THREAD_BLOCKS`` per GPU: 216 in microsoft/msccl (108 SMs x 2),
      32 x MAXCHANNELS = 1024 in msccl-executor-nccl.
    * ``max_channels``: ``MAXCHANNELS`` = 32 (``src/include/device.h``); the communicator must also have at
      least ``nchannels`` channels at run time (``msccl_setup.cc``; raise it with ``NCCL_MIN_NCHANNELS``).
    * ``max_tbs_per_channel``: ``MSCCL_MAX_NUM_THREAD_BLOCKS_PER_CHANNEL`` = 32 sending (and as many
      receiving) thread blocks per channel.
    * ``max_count``: ``cnt`` must be below ``MSCCL_MAX_COUNT`` = 72.
    * ``max_dep_tb``: ``dependentBid`` is an ``int8_t``, so a depended-on thread block id is at most 127.
    * ``max_chunks``: offsets are ``int16_t`` (``mscclTransmission``), so at most 32767 chunks per buffer.
    * ``max_subs``: the parser holds at most ``MAX_SUBS`` = 1024 children per element (``msccl_parser.h``).
    """

    max_steps: int = 64
    max_thread_blocks: int = 216
    max_channels: int = 32
    max_tbs_per_channel: int = 32
    max_count: int = 71
    max_dep_tb: int = 127
    max_chunks: int = 32767
    max_subs: int = 1024


#: The limits every function here checks unless given others.
DEFAULT_LIMITS = MscclLimits()


@dataclass(frozen=True)
class MscclStep:
    s: int
    type: str
    srcbuf: str
    srcoff: int
    dstbuf: str
    dstoff: int
    cnt: int
    depid: int = -1
    deps: int = -1
    hasdep: int = 0

    @property
    def kind(self) -> StepKind:
        return STEP_KINDS[self.type]


@dataclass(frozen=True)
class MscclThreadBlock:
    id: int
    send: int
    recv: int
    chan: int
    steps: tuple[MscclStep, ...] = ()


@dataclass(frozen=True)
class MscclGpu:
    id: int
    i_chunks: int
    o_chunks: int
    s_chunks: int
    tbs: tuple[MscclThreadBlock, ...] = ()

    def chunks(self, buf: str) -> int:
        return {"i": self.i_chunks, "o": self.o_chunks, "s": self.s_chunks}[buf]


@dataclass(frozen=True)
class MscclProgram:
    """One MSCCL algorithm file (see the module docstring)."""

    name: str
    proto: str
    nchunksperloop: int
    nchannels: int
    ngpus: int
    coll: str
    inplace: bool
    outofplace: bool
    gpus: tuple[MscclGpu, ...]
    min_bytes: int = 0
    #: 0 means no upper limit (``msccl_lifecycle.cc``).
    max_bytes: int = 0
    #: Attributes the file lacked and that were defaulted (msccl-tools omits ``outofplace``, ``minBytes``, ``maxBytes``).
    defaulted: tuple[str, ...] = field(default=(), compare=False)

    def to_xml(self) -> str:
        """The XML text, attributes in msccl-tools' order, indented two spaces.

        Written directly (ElementTree's ``indent`` + ``tostring`` gives the same text, byte for byte, but
        takes seconds on a 128-GPU program's 30,000 steps); attribute values are escaped as ElementTree does.
        """
        out: list[str] = []
        algo = _open("", "algo", (("name", self.name), ("proto", self.proto), ("nchannels", self.nchannels),
                                  ("nchunksperloop", self.nchunksperloop), ("ngpus", self.ngpus), ("coll", self.coll),
                                  ("inplace", int(self.inplace)), ("outofplace", int(self.outofplace)),
                                  ("minBytes", self.min_bytes), ("maxBytes", self.max_bytes)))
        if not self.gpus:
            return algo + " />\n"
        out.append(algo + ">")
        for g in self.gpus:
            ge = _open("  ", "gpu", (("id", g.id), ("i_chunks", g.i_chunks), ("o_chunks", g.o_chunks),
                                     ("s_chunks", g.s_chunks)))
            if not g.tbs:
                out.append(ge + " />")
                continue
            out.append(ge + ">")
            for tb in g.tbs:
                te = f'    <tb id="{tb.id}" send="{tb.send}" recv="{tb.recv}" chan="{tb.chan}"'
                if not tb.steps:
                    out.append(te + " />")
                    continue
                out.append(te + ">")
                out.extend(
                    f'      <step s="{st.s}" type={_quote(st.type)} srcbuf={_quote(st.srcbuf)} srcoff="{st.srcoff}" '
                    f'dstbuf={_quote(st.dstbuf)} dstoff="{st.dstoff}" cnt="{st.cnt}" depid="{st.depid}" '
                    f'deps="{st.deps}" hasdep="{st.hasdep}" />' for st in tb.steps)
                out.append("    </tb>")
            out.append("  </gpu>")
        out.append("</algo>\n")
        return "\n".join(out)


_ESCAPES = (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ('"', "&quot;"), ("\r", "&#13;"), ("\n", "&#10;"),
            ("\t", "&#09;"))


def _quote(value: object) -> str:
    """An attribute value in double quotes, escaped as ElementTree's serializer does."""
    text = str(value)
    for raw, esc in _ESCAPES:
        if raw in text:
            text = text.replace(raw, esc)
    return f'"{text}"'


def _open(indent: str, tag: str, attrs: tuple[tuple[str, object], ...]) -> str:
    """``<tag a="..." b="..."`` after ``indent``, left open for ``>`` or `` />``."""
    return f"{indent}<{tag} " + " ".join(f"{k}={_quote(v)}" for k, v in attrs)


_FORBIDDEN = re.compile(r"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)


def _int(elem: ET.Element, attr: str, where: str, default: int | None = None, defaulted: list[str] | None = None) -> int:
    text = elem.get(attr)
    if text is None:
        if default is not None:
            if defaulted is not None:
                defaulted.append(attr)
            return default
        raise MscclError(f"{where} lacks the attribute {attr!r}, which the MSCCL executor requires")
    try:
        return int(text.strip(), 0)
    except ValueError:
        raise MscclError(f"{where} has {attr}={text!r}; it must be an integer") from None


def _where(gpu: int, tb: int | None = None, step: int | None = None) -> str:
    out = f"GPU {gpu}"
    if tb is not None:
        out += f", thread block {tb}"
    if step is not None:
        out += f", step {step}"
    return out


def _step_fast(a: dict[str, str]) -> MscclStep | None:
    """The step of attributes ``a`` if all are present and valid, else ``None`` (the slow path then names the
    fault): a 128-GPU program has 30,000 steps, and one call per attribute took most of the parse."""
    try:
        typ, src, dst = a["type"], a["srcbuf"], a["dstbuf"]
        if typ not in STEP_KINDS or src not in BUFFERS or dst not in BUFFERS:
            return None
        return MscclStep(int(a["s"], 0), typ, src, int(a["srcoff"], 0), dst, int(a["dstoff"], 0), int(a["cnt"], 0),
                         int(a["depid"], 0), int(a["deps"], 0), int(a["hasdep"], 0))
    except (KeyError, ValueError):
        return None


def parse_msccl_xml(text: str) -> MscclProgram:
    """Read an MSCCL algorithm file's text into an :class:`MscclProgram` (structure only; see the checker).

    Raises :class:`MscclError` on a DTD or entity declaration, malformed XML, a missing or non-integer
    attribute, an unknown step type or buffer name.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_msccl_xml takes the XML text as str, got {type(text).__name__}")
    if _FORBIDDEN.search(text):
        raise MscclError("MSCCL XML must not contain a DTD or entity declarations (<!DOCTYPE, <!ENTITY); remove them")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise MscclError(f"not well-formed XML: {exc}") from None
    if root.tag != "algo":
        raise MscclError(f"the root element is <{root.tag}>; an MSCCL algorithm file starts with <algo>")
    defaulted: list[str] = []
    ngpus = _int(root, "ngpus", "<algo>")
    inplace = _int(root, "inplace", "<algo>")
    outofplace = _int(root, "outofplace", "<algo>", 1 - inplace, defaulted)
    gpus = []
    for ge in root.findall("gpu"):
        gid = _int(ge, "id", "<gpu>")
        tbs = []
        for te in ge.findall("tb"):
            tid = _int(te, "id", _where(gid) + " <tb>")
            steps = []
            for se in te.findall("step"):
                fast = _step_fast(se.attrib)
                if fast is not None:  # the common case: every attribute present and an integer where it must be
                    steps.append(fast)
                    continue
                where = _where(gid, tid) + " <step>"
                s = _int(se, "s", where)
                typ = se.get("type", "")
                if typ not in STEP_KINDS:
                    raise MscclError(f"{_where(gid, tid, s)} has type {typ!r}; known: {', '.join(STEP_KINDS)}", gid, tid, s)
                bufs = [se.get("srcbuf", "i"), se.get("dstbuf", "o")]
                for b in bufs:
                    if b not in BUFFERS:
                        raise MscclError(f"{_where(gid, tid, s)} names buffer {b!r}; buffers are i, o, s", gid, tid, s)
                steps.append(MscclStep(
                    s, typ, bufs[0], _int(se, "srcoff", where, -1), bufs[1], _int(se, "dstoff", where, -1),
                    _int(se, "cnt", where, 1), _int(se, "depid", where, -1), _int(se, "deps", where, -1),
                    _int(se, "hasdep", where, 0),
                ))
            tbs.append(MscclThreadBlock(tid, _int(te, "send", _where(gid, tid)), _int(te, "recv", _where(gid, tid)),
                                        _int(te, "chan", _where(gid, tid), 0), tuple(steps)))
        gpus.append(MscclGpu(gid, _int(ge, "i_chunks", _where(gid)), _int(ge, "o_chunks", _where(gid)),
                             _int(ge, "s_chunks", _where(gid), 0), tuple(tbs)))
    return MscclProgram(
        name=root.get("name", ""), proto=root.get("proto", "Simple"),
        nchunksperloop=_int(root, "nchunksperloop", "<algo>"),
        nchannels=_int(root, "nchannels", "<algo>", 1 + max((tb.chan for g in gpus for tb in g.tbs), default=0), defaulted),
        ngpus=ngpus, coll=root.get("coll", ""), inplace=bool(inplace), outofplace=bool(outofplace), gpus=tuple(gpus),
        min_bytes=_int(root, "minBytes", "<algo>", 0, defaulted), max_bytes=_int(root, "maxBytes", "<algo>", 0, defaulted),
        defaulted=tuple(defaulted),
    )
