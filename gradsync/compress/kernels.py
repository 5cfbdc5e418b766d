"""One-pass codec kernels on the GPU (Triton), for the sign and quantizer families.

Why: on a GPU the torch form of a codec is 3 to 8 memory-bound kernels, each a launch and a full pass over the
tensor (a compare, a fill, a multiply-pack; a norm, a random draw, a scaling, a conversion, a shift). Fused, a
codec reads its input once and writes its payload once: compress and decompress are one kernel each.

Each function here returns ``None`` where it does not apply (no Triton, a CPU tensor, a dtype or size it does
not take), and the codec then runs its torch form. Which is which:

* **the same bits as the torch form:** sign packing, every decode (``select_by_bits``, ``qsgd_decode``,
  ``terngrad_decode``): the same operations in the same order, each correctly rounded;
* **its own summation order:** ``sign_stats`` (the scales of EF-signSGD, 1-bit SGD and TernGrad), folded in
  float64 in block order: within rounding of torch's sums, and the same bits every run;
* **its own random numbers:** ``qsgd_encode`` and ``terngrad_encode`` draw ``u`` from Triton's Philox stream
  (seeded from the compressor's generator on the host, one integer per call: no device synchronisation; each
  Philox counter gives the numbers of four elements). They quantize by the same rule, so they have the same
  distribution, not the same draws.

On a GPU each kernel is launched through its compiled form once Triton has compiled it for such arguments
(:class:`_Launch`): a codec at 1e6 elements is bound by the host, and Triton's own launch re-binds every
argument in Python on every call.

``GRADSYNC_FUSED=0`` turns the kernels off (the torch form everywhere). ``GRADSYNC_FUSED=interpret`` also runs
them on CPU tensors through Triton's interpreter: that is how the CPU-only tests check the kernels' results.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["ENV", "enabled_for", "pack_nonnegative", "select_by_bits", "qsgd_encode", "qsgd_decode",
           "terngrad_encode", "terngrad_decode", "sign_stats", "signum_step", "randk_gather",
           "randk_place", "gather_narrow", "scatter_values"]

#: The switch: "0" off, "1" (the default) on for CUDA tensors, "interpret" on for CUDA and CPU tensors.
ENV = "GRADSYNC_FUSED"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: Offsets are int32 in the kernels: larger tensors take the torch form.
_MAX_NUMEL = 2**31 - 2**16


@functools.cache
def _kernels(interpret: bool) -> dict[str, Any] | None:
    if interpret:  # Triton picks its interpreter when it is imported, for its own library functions too
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{ENV}=interpret must be set before Triton is imported (it was imported already): "
                               f"set it in the environment that starts the process")
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from gradsync.compress import _triton_kernels as source
    except ImportError:  # no Triton (a CPU-only install): the torch forms run
        return None
    jitted = {name: source.triton.jit(fn) for name, fn in source.KERNELS.items()}
    if interpret:
        return {name: _OneAtATime(k) for name, k in jitted.items()}
    fast = _fast_launch()
    if fast is None:  # a Triton whose launch this module does not know: its own launch, every time
        return jitted
    return {name: _Launch(k, list(inspect.signature(source.KERNELS[name]).parameters), *fast)
            for name, k in jitted.items()}


def _launch_convention(source: str) -> tuple[bool, str] | None:
    """What :class:`_Launch` reads from the source of Triton's ``JITFunction.run``: whether the compiled launcher
    takes every argument (Triton 3.3 on) or the non-constexpr ones, and where the launch hooks live (``knobs`` or
    ``CompiledKernel``). None where the launch is not the one :class:`_Launch` makes."""
    if "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata" not in source:
        return None
    if "*bound_args.values())" in source:
        all_args = True
    elif "*non_constexpr_vals)" in source:
        all_args = False
    else:
        return None
    if "knobs.runtime.launch_enter_hook" in source:
        return all_args, "knobs"
    if "CompiledKernel.launch_enter_hook" in source:
        return all_args, "CompiledKernel"
    return None


def _fast_launch() -> tuple[bool, Callable[[], int], Callable[[int], int], Callable[[], bool]] | None:
    """``(all_args, device, stream, hooked)`` for :class:`_Launch` on this Triton, or None (Triton launches)."""
    try:
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        convention = _launch_convention(inspect.getsource(JITFunction.run))
        if convention is None:
            return None
        all_args, hooks = convention
        if hooks == "knobs":
            from triton import knobs

            where: Any = knobs.runtime
        else:
            from triton.compiler import CompiledKernel

            where = CompiledKernel
        active = driver.active
        device, stream = active.get_current_device, active.get_current_stream
    except Exception:  # noqa: BLE001 - any surprise here means: let Triton launch
        return None

    def hooked() -> bool:
        return _hook_set(where.launch_enter_hook) or _hook_set(where.launch_exit_hook)

    return all_args, device, stream, hooked


def _hook_set(hook: Any) -> bool:
    """A launch hook that does something: a function, or a chain of them (Triton 3.4 on) that is not empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _spec(arg: Any) -> Any:
    """What Triton specializes a kernel on for one argument: a tensor's dtype and 16-byte alignment; an
    integer's equality to 1, divisibility by 16 and width; a float's type."""
    kind = type(arg)
    if kind is Tensor:
        return arg.dtype, arg.data_ptr() % 16 == 0
    if kind is int:
        return int, arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31
    if kind is float:
        return float
    if kind is bool:
        return bool, arg
    raise TypeError(f"no launch key for a {type(arg).__name__}")


class _Launch:
    """A jitted kernel launched through its compiled form once Triton has compiled it for such arguments.

    Why: Triton's own launch binds and specializes every argument in Python on each call, host time that a codec
    at 1e6 elements (where the host, not the GPU, is the bottleneck) pays per kernel. The first call for each key
    goes through Triton, which compiles, launches and returns the compiled kernel; later calls with the same key
    call that kernel's launcher directly, as Triton's own ``run`` does after its lookup. The key holds everything
    Triton specializes on (:func:`_spec`, the constexprs, the device), so the kernel reused is the one Triton
    would pick. With a launch hook set (a profiler), every call goes through Triton, which calls it.
    """

    def __init__(self, kernel: Any, names: list[str], all_args: bool, device: Callable[[], int],
                 stream: Callable[[int], int], hooked: Callable[[], bool]) -> None:
        self._kernel = kernel
        self._names = names
        self._all_args = all_args
        self._device, self._stream, self._hooked = device, stream, hooked
        self._compiled: dict[Any, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return functools.partial(self._launch, grid)

    def _launch(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        device = self._device()
        try:
            key = (device, tuple(map(_spec, args)), tuple(constexprs.items()))
        except TypeError:
            key = None
        compiled = self._compiled.get(key) if key is not None else None
        if compiled is None or self._hooked():
            compiled = self._kernel[grid](*args, **constexprs)
            # Cached only when the constexprs come in the signature's order, after the other arguments: the
            # order the compiled launcher takes them in.
            if key is not None and compiled is not None and list(constexprs) == self._names[len(args):]:
                self._compiled[key] = compiled
            return
        g = (*grid, 1, 1)
        extra = constexprs.values() if self._all_args else ()
        compiled.run(g[0], g[1], g[2], self._stream(device), compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *extra)


class _OneAtATime:
    """A kernel whose launches take one lock: Triton's interpreter patches its language module for the length of
    a launch, so two threads interpreting at once (ranks on threads, a communication thread) break each other."""

    _lock = threading.Lock()

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        launch = self._kernel[grid]

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return launch(*args, **kwargs)

        return locked


def _mode() -> str:
    mode = os.environ.get(ENV, "1").strip().lower()
    if mode not in ("0", "1", "interpret"):
        raise ValueError(f"{ENV}={mode!r}: use 1 (fused kernels on CUDA tensors, the default), 0 (off) or interpret "
                         f"(also on CPU tensors, through Triton's interpreter: tests)")
    return mode


def enabled_for(t: Tensor) -> bool:
    """Whether the kernels run for ``t``: a CUDA tensor with Triton installed, or a CPU one in interpret mode."""
    return _for(t) is not None


def _for(t: Tensor) -> dict[str, Any] | None:
    mode = _mode()
    if mode == "0":
        return None
    if t.device.type == "cuda" and type(t) is Tensor:  # a real CUDA tensor (not a fake one of a CPU-only test)
        return _kernels(mode == "interpret")
    if t.device.type == "cpu" and mode == "interpret":
        return _kernels(True)
    return None


#: A kernel's random seed, or what draws it: called only when the kernel launches, so a call that takes the torch
#: form draws nothing (its generator, or torch's global one, is left as the torch form expects it).
Seed = int | Callable[[], int]


def _draw(seed: Seed) -> int:
    return seed() if callable(seed) else seed


def _fits(x: Tensor) -> bool:
    return x.dim() == 1 and x.is_contiguous() and x.numel() <= _MAX_NUMEL and not x.requires_grad


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pack_nonnegative(x: Tensor) -> Tensor | None:
    """``packing.pack_nonnegative`` in one pass: ``ceil(n / 8)`` bytes, bit ``i`` = ``x[i] >= 0``."""
    k = _for(x)
    if k is None or not _fits(x) or x.dtype not in _FLOATS:
        return None
    n = x.numel()
    nbytes = _cdiv(n, 8)
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        k["pack_nonnegative"][(_cdiv(nbytes, 512),)](x, out, n, nbytes, BYTES=512)
    return out


def select_by_bits(packed: Tensor, n: int, dtype: torch.dtype, *, out: Tensor | None = None,
                   hi: float = 1.0, lo: float = -1.0, values: Tensor | None = None,
                   negate: bool = False) -> Tensor | None:
    """``where(bit i, hi, lo)`` for the first ``n`` bits of ``packed``, as ``dtype`` (into ``out`` if given).

    ``values`` (on the device) replaces the numbers: ``[hi, lo]``, or ``[hi]`` with ``lo = -hi`` when ``negate``.
    """
    k = _for(packed)
    if k is None or packed.dtype != torch.uint8 or dtype not in (torch.float32, torch.float64, torch.float16) or n > _MAX_NUMEL:
        return None
    if values is not None and (values.device != packed.device or values.numel() < (1 if negate else 2)):
        return None
    if out is None:
        out = torch.empty(n, dtype=dtype, device=packed.device)
    elif out.dtype != dtype or out.numel() != n or not out.is_contiguous() or out.device != packed.device:
        return None
    mode = 0 if values is None else (1 if negate else 2)
    if n:
        v = out if values is None else values.reshape(-1).contiguous()
        k["select_by_bits"][(_cdiv(n, 4096),)](packed, out, n, v, float(hi), float(lo), MODE=mode, BYTES=512)
    return out


def _bucket_ok(bucket: int) -> bool:
    return 16 <= bucket <= 2048 and bucket & (bucket - 1) == 0


def qsgd_encode(x: Tensor, levels: int, bucket: int, seed: Seed) -> tuple[Tensor, Tensor] | None:
    """QSGD with 8-bit codes (``levels <= 127``) and power-of-two buckets: ``(norms float32, codes uint8)``."""
    k = _for(x)
    if k is None or not _fits(x) or x.dtype != torch.float32 or not 1 <= levels <= 127 or not _bucket_ok(bucket):
        return None
    n = x.numel()
    count = _cdiv(n, bucket)
    norms = torch.empty(count, dtype=torch.float32, device=x.device)
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    if n:
        rows = max(1, 2048 // bucket)
        k["qsgd_encode"][(_cdiv(count, rows),)](x, norms, codes, n, count, _draw(seed), levels, BUCKET=bucket,
                                                 ROWS=rows)
    return norms, codes


def qsgd_decode(norms: Tensor, codes: Tensor, n: int, levels: int, bucket: int, out: Tensor) -> Tensor | None:
    """The decoded QSGD values (float32) into ``out``: the torch decode's bits."""
    k = _for(codes)
    if (k is None or codes.dtype != torch.uint8 or norms.dtype != torch.float32 or out.dtype != torch.float32
            or not _bucket_ok(bucket) or not 1 <= levels <= 127 or n > _MAX_NUMEL or out.numel() != n
            or not out.is_contiguous() or codes.numel() < n):
        return None
    if n:
        k["qsgd_decode"][(_cdiv(n, 2048),)](codes, norms, out, n, levels, BUCKET=bucket, BLOCK=2048)
    return out


def terngrad_encode(x: Tensor, bound: Tensor | None, scale: Tensor, seed: Seed) -> Tensor | None:
    """TernGrad's packed 2-bit codes of ``x`` clipped to ``±bound`` (none when ``None``), kept with probability
    ``|x| / scale``; ``bound`` and ``scale`` are float32 device scalars."""
    k = _for(x)
    if k is None or not _fits(x) or x.dtype != torch.float32:
        return None
    n = x.numel()
    nbytes = _cdiv(n, 4)
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        b = scale if bound is None else bound
        k["terngrad_encode"][(_cdiv(nbytes, 512),)](x, b.reshape(1), scale.reshape(1), out, n, nbytes, _draw(seed),
                                                      CLIP=bound is not None, BYTES=512)
    return out


def terngrad_decode(packed: Tensor, scale: Tensor, n: int, dtype: torch.dtype) -> Tensor | None:
    """``((c & 1) - (c >> 1)) * scale`` per 2-bit code, as ``dtype``: the torch decode's bits."""
    k = _for(packed)
    if k is None or packed.dtype != torch.uint8 or dtype not in (torch.float32, torch.float64) or n > _MAX_NUMEL:
        return None
    out = torch.empty(n, dtype=dtype, device=packed.device)
    if n:
        k["terngrad_decode"][(_cdiv(n, 2048),)](packed, scale.reshape(1), out, n, BYTES=512)
    return out


#: ``finish_stats``'s kinds: what the folded statistics become.
_STATS_KIND = {"mean_abs": 0, "side_means": 1, "ternary": 2}
_STATS_BYTES = 512  # 4096 elements per block


def sign_stats(x: Tensor, kind: str, *, pack: bool = True,
               clip: float | None = None) -> tuple[Tensor | None, Tensor, Tensor] | None:
    """The sign bits of ``x`` (when ``pack``) and its statistics in one read, folded on the device into
    ``(bits, scalars, bound)``, ``scalars`` being:

    * ``"mean_abs"``: ``[mean |x|]`` (EF-signSGD's scale);
    * ``"side_means"``: ``[mean of x >= 0, mean of x < 0]`` (1-bit SGD's; 0 for an empty side);
    * ``"ternary"``: ``[max|clip(x)|]`` (TernGrad's scale), and ``bound = [clip * std(x)]`` (``clip=None``: no
      clipping).

    Float32 results, summed in float64 in a fixed order (other bits than torch's own sums, the same every run).
    """
    k = _for(x)
    if k is None or not _fits(x) or x.dtype not in _FLOATS or not x.numel():
        return None
    n = x.numel()
    nbytes = _cdiv(n, 8)
    blocks = _cdiv(n, 8 * _STATS_BYTES)
    code = _STATS_KIND[kind]
    # One allocation for the block partials (4 per block) and the results: the scalars, then the bound.
    scratch = torch.empty(blocks * 4 + 3, dtype=torch.float32, device=x.device)
    parts, out, bound = scratch[:-3], scratch[-3:-1] if code == 1 else scratch[-3:-2], scratch[-1:]
    bits = torch.empty(nbytes, dtype=torch.uint8, device=x.device) if pack else None
    k["sign_stats"][(blocks,)](x, parts if bits is None else bits, parts, n, nbytes, PACK=pack, KIND=code,
                               BYTES=_STATS_BYTES)
    k["finish_stats"][(1,)](parts, out, bound, blocks, n, float(clip or 0.0), KIND=code, SPAN=8 * _STATS_BYTES,
                            BLOCK=1024)
    return bits, out, bound


def signum_step(x: Tensor, previous: Tensor | None, momentum: float) -> tuple[Tensor, Tensor] | None:
    """SIGNUM's ``m = previous * momentum + x * (1 - momentum)`` (a new float32 tensor; ``previous`` None: zeros) and
    the packed bits of ``m >= 0``, in one pass. A GPU may fuse the multiply-add (one rounding fewer than the
    torch form), so ``m`` can differ from it in the last bit."""
    k = _for(x)
    if k is None or not _fits(x) or x.dtype != torch.float32:
        return None
    if previous is not None and (previous.dtype != torch.float32 or previous.shape != x.shape
                                 or not previous.is_contiguous() or previous.device != x.device):
        return None
    n = x.numel()
    nbytes = _cdiv(n, 8)
    m = torch.empty(n, dtype=torch.float32, device=x.device)
    bits = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        k["signum_pack"][(_cdiv(nbytes, 512),)](x, m if previous is None else previous, m, bits, n, nbytes,
                                                 float(momentum), float(1 - momentum), HAS_PREV=previous is not None,
                                                 BYTES=512)
    return m, bits


_K_BLOCK = 1024  # elements of k per program: the sparse kernels work on k values, not the tensor


def randk_gather(x: Tensor, k: int, seed: int, weyl: int, mix: int) -> tuple[Tensor, Tensor] | None:
    """Rand-k's ``(values, indices)`` for a signed 64-bit ``seed`` in one launch: ``Strata(n, k).draw(seed)`` and
    ``x[indices]``, the same indices (int64) and values; ``weyl`` and ``mix``: the hash's constants as signed int64
    (``sparsify``'s, where the hash is defined)."""
    kern = _for(x)
    if kern is None or not _fits(x) or x.dtype not in (*_FLOATS, torch.float64) or not 0 < k <= x.numel():
        return None
    q, r = divmod(x.numel(), k)
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    indices = torch.empty(k, dtype=torch.int64, device=x.device)
    kern["randk_gather"][(_cdiv(k, _K_BLOCK),)](x, values, indices, k, q, r, seed, weyl, mix,
                                                    BLOCK=_K_BLOCK)
    return values, indices


def randk_place(values: Tensor, indices: Tensor, n: int) -> Tensor | None:
    """The dense ``n`` elements of a rand-k payload (``values`` at ``indices``, one per ``Strata(n, k)`` block, zeros
    elsewhere) in one launch: the bits of ``zeros(n).scatter_(0, indices, values)``."""
    kern = _for(values)
    k = values.numel()
    if (kern is None or values.dtype not in (*_FLOATS, torch.float64) or not 0 < k <= n or n > _MAX_NUMEL
            or indices.dtype != torch.int64 or indices.numel() != k or indices.device != values.device
            or not values.is_contiguous() or not indices.is_contiguous()):
        return None
    q, r = divmod(n, k)
    out = torch.empty(n, dtype=values.dtype, device=values.device)
    kern["randk_place"][(_cdiv(n, 4096),)](values, indices, out, n, q, r, BLOCK=4096)
    return out


def gather_narrow(x: Tensor, indices: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(x[indices], indices as int32)`` in one launch, for int64 ``indices`` into a 1-D ``x`` of fewer than 2**31
    elements: top-k's and DGC's payload without a separate cast of the indices."""
    kern = _for(x)
    if (kern is None or not _fits(x) or x.dtype not in (*_FLOATS, torch.float64) or indices.dtype != torch.int64
            or indices.dim() != 1 or not indices.is_contiguous() or indices.device != x.device):
        return None
    k = indices.numel()
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    narrow = torch.empty(k, dtype=torch.int32, device=x.device)
    if k:
        kern["gather_narrow"][(_cdiv(k, _K_BLOCK),)](x, indices, values, narrow, k, BLOCK=_K_BLOCK)
    return values, narrow


def scatter_values(values: Tensor, indices: Tensor, n: int) -> Tensor | None:
    """``zeros(n).scatter_(0, indices, values)`` for distinct int32 or int64 ``indices``: a fill and one launch,
    without widening int32 indices first (``scatter_`` takes int64 only)."""
    kern = _for(values)
    k = values.numel()
    if (kern is None or values.dtype not in (*_FLOATS, torch.float64) or n > _MAX_NUMEL or values.dim() != 1
            or indices.dtype not in (torch.int32, torch.int64) or indices.shape != values.shape
            or indices.device != values.device or not values.is_contiguous() or not indices.is_contiguous()):
        return None
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    if k:
        kern["scatter_values"][(_cdiv(k, _K_BLOCK),)](values, indices, out, k, BLOCK=_K_BLOCK)
    return out
