"""The cheap step (issue 20): decode-and-sum, in-place error feedback and reused buffers give the same bits as
the plain definitions -- ``aggregate([decompress(p) ...])``, ``x - decompress(p)``, fresh tensors every step."""

from __future__ import annotations

import pytest
import torch

from gradsync.compress import COMPRESSORS, Compressor, Partition, TensorInfo, create, create_memory
from gradsync.compress.base import shares_memory
from tests.compress.seeded import seeded

NAMES = COMPRESSORS.names()
SHAPES = [(1,), (13,), (1000,), (40, 25), (17, 241), (8, 4, 3, 3)]

pytestmark = pytest.mark.usefixtures("single_intraop_thread")


def _tensor(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values with exact zeros and negative zeros sprinkled in (sign codecs treat them specially)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    flat = x.view(-1)
    flat[::7] = 0.0
    flat[3::11] = -0.0
    return x.to(dtype)


def _reference_aggregate(c: Compressor, payloads: list[list[torch.Tensor]], ctx) -> torch.Tensor:  # type: ignore[no-untyped-def]
    decoded = [c.decompress(p, ctx) for p in payloads]
    if type(c).aggregate is not Compressor.aggregate:
        return c.aggregate(decoded)
    return torch.stack(decoded).sum(dim=0)  # the sum, added in worker order


#: Compressors whose in-place residual is one fused multiply-add (PowerSGD's ``addmm_``): its last bit depends
#: on whether the BLAS fuses, so it is compared within a rounding, not bit for bit.
FUSED_RESIDUAL = {"powersgd"}

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_combine_is_the_aggregate_of_the_decoded_payloads_bit_for_bit(name: str, shape, dtype, world: int) -> None:
    workers = [seeded(name) for _ in range(world)]
    info = TensorInfo("w", shape, dtype)
    rounds = [c.compress(_tensor(shape, 10 * w + 1, dtype), info) for w, c in enumerate(workers)]
    payloads = [p for p, _ in rounds]
    before = [[t.clone() for t in p] for p in payloads]
    receiver, ctx = workers[0], rounds[0][1]
    got = receiver.combine(payloads, ctx)
    want = _reference_aggregate(receiver, payloads, ctx)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), (name, shape, dtype, world)
    # the caller owns the result (it is averaged in place) and the payloads are untouched
    assert not any(shares_memory(got, p) for p in payloads)
    assert all(torch.equal(a, b) for p, q in zip(payloads, before) for a, b in zip(p, q))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
def test_subtract_decoded_is_tensor_minus_decompress_in_place_or_not(name: str, shape, dtype) -> None:
    c = seeded(name)
    info = TensorInfo("w", shape, dtype)
    x = _tensor(shape, 5, dtype)
    payload, ctx = c.compress(x, info)
    want = x - c.decompress(payload, ctx)
    kept = x.clone()
    out = c.subtract_decoded(x, payload, ctx)
    assert torch.equal(out, want) and torch.equal(x, kept)  # not in place: x untouched
    before = [t.clone() for t in payload]
    out = c.subtract_decoded(x, payload, ctx, inplace=True)
    if name in FUSED_RESIDUAL:  # a fused multiply-add: within a rounding of the separate product and subtraction
        torch.testing.assert_close(out, want, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
    else:
        assert torch.equal(out, want), (name, shape, dtype)
    # in place only where no payload tensor is x itself ('none' sends x): the payload still holds what was sent
    assert all(torch.equal(a, b) for a, b in zip(payload, before))
    if not shares_memory(kept, payload):
        assert out.data_ptr() == x.data_ptr() or shares_memory(x, payload)


def test_subtract_decoded_of_a_sparse_payload_touches_only_the_sent_elements() -> None:
    c = create("topk", ratio=0.1)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    info = TensorInfo("w", (1000,), torch.float32)
    payload, ctx = c.compress(x, info)
    indices, values = c.sparse(payload, ctx)
    keep = x.clone()
    out = c.subtract_decoded(x, payload, ctx, inplace=True)
    assert out is x
    sent = torch.zeros(1000, dtype=torch.bool)
    sent[indices.long()] = True
    assert torch.equal(out[~sent], keep[~sent]) and not out[sent].any()
    assert torch.equal(values, keep[indices.long()])


def _gradients(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + step))


@pytest.mark.parametrize("name", ["topk", "dgc", "randk", "efsignsgd", "onebit", "powersgd", "none", "fp16"])
def test_residual_memory_in_place_gives_the_out_of_place_recursion(name: str) -> None:
    """e_t = (g_t + e_{t-1}) - decompress(compress(g_t + e_{t-1})), computed here with fresh tensors, against
    the memory that keeps e in one buffer; the caller's gradients are never written."""
    shape = (24, 50)
    info = TensorInfo("w", shape, torch.float32)
    kwargs = {"ratio": 0.05} if name in ("topk", "dgc", "randk") else {}
    c, ref_c = seeded(name, **kwargs), seeded(name, **kwargs)
    memory = create_memory("residual")
    e = None
    buffers = set()
    for step in range(5):
        g = _gradients(step, shape)
        g_copy = g.clone()
        x = memory.compensate(g, info)
        payload, ctx = c.compress(x, info)
        memory.update(x, info, c, payload, ctx)
        assert torch.equal(g, g_copy)
        ref_x = g_copy if e is None else g_copy + e
        ref_payload, ref_ctx = ref_c.compress(ref_x, info)
        e = ref_x - ref_c.decompress(ref_payload, ref_ctx)
        if name in FUSED_RESIDUAL:  # within roundings: the fused residual's last bits feed the next step
            for a, b in zip(payload, ref_payload):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(memory.residual("w"), e, rtol=1e-5, atol=1e-6)
        else:
            assert all(torch.equal(a, b) for a, b in zip(payload, ref_payload))
            assert torch.equal(memory.residual("w"), e), (name, step)
        buffers.add(memory.residual("w").data_ptr())
    if name not in ("none", "fp16"):  # these send x itself: the residual cannot live in x
        assert len(buffers) <= 2  # the first residual is new; after that it stays in its buffer


def test_dgc_memory_in_place_gives_the_out_of_place_recursion() -> None:
    """u <- m u + g; v <- v + u; send top-k of v; u masked where a non-zero was sent; v keeps what was not."""
    m, shape = 0.9, (30, 40)
    info = TensorInfo("w", shape, torch.float32)
    c, ref_c = create("dgc", ratio=0.05, seed=0), create("dgc", ratio=0.05, seed=0)
    memory = create_memory("dgc", momentum=m)
    u = v = torch.zeros(shape)
    for step in range(5):
        g = _gradients(step, shape)
        g_copy = g.clone()
        x = memory.compensate(g, info)
        payload, ctx = c.compress(x, info)
        memory.update(x, info, c, payload, ctx)
        assert torch.equal(g, g_copy)
        u = u * m + g_copy
        v = v + u
        ref_payload, ref_ctx = ref_c.compress(v, info)
        sent = ref_c.decompress(ref_payload, ref_ctx)
        u, v = u.masked_fill(sent != 0, 0), v - sent
        assert torch.equal(memory.momentum_buffer("w"), u) and torch.equal(memory.velocity("w"), v), step


@pytest.mark.parametrize("name", [n for n in NAMES if COMPRESSORS.get(n).payload_shapes_fixed])
@pytest.mark.parametrize("shape", [(1,), (1000,), (17, 241)], ids=str)
def test_fixed_payload_shapes_follow_from_the_info_alone(name: str, shape) -> None:
    """What lets the allgather skip its sizes round: any two tensors of one info give payloads of equal shapes
    and dtypes, of exactly payload_bytes."""
    info = TensorInfo("w", shape, torch.float32)
    a = seeded(name).compress(_tensor(shape, 1), info)[0]
    b = seeded(name).compress(torch.zeros(shape) if len(shape) == 1 else 1e6 * _tensor(shape, 2), info)[0]
    assert [(t.shape, t.dtype) for t in a] == [(t.shape, t.dtype) for t in b]
    assert sum(t.numel() * t.element_size() for t in a) == seeded(name).payload_bytes(shape, torch.float32)


def test_merged_groups_reuse_their_flat_buffer() -> None:
    """The merged group's concatenation goes into one buffer kept across steps and given to the step to reuse;
    single-tensor groups (the gradient itself) are never offered."""
    from gradsync.train.grouped import MergedGroups

    offered: list[tuple[int, bool]] = []
    closed: list[int] = []

    class Step:  # the CompressionStep surface MergedGroups uses: the aggregate is the tensor itself
        def step_async(self, tensors, infos, *, reuse=False):  # type: ignore[no-untyped-def]
            offered.append((tensors[0].data_ptr(), reuse))
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result([tensors[0]])

            class Work:
                def wait(self):  # type: ignore[no-untyped-def]
                    return fut.wait()

            return Work()

        def close_step(self) -> None:  # wait() ends the training step (issue 42)
            closed.append(len(offered))

    shapes = [(3, 4), (5,), (2, 2)]
    groups = MergedGroups(Step(), ["a", "b", "c"], shapes, torch.float32, Partition(3, (2,)))  # type: ignore[arg-type]
    for step in range(3):
        grads = [torch.full(s, float(step + i)) for i, s in enumerate(shapes)]
        for i, g in enumerate(grads):
            groups.add(i, g)
        out = groups.wait()
        assert all(torch.equal(o, g) for o, g in zip(out, grads))
        assert out[2].data_ptr() == grads[2].data_ptr()  # alone: the gradient itself, not copied
    merged = [ptr for ptr, reuse in offered if reuse]
    assert len(merged) == 3 and len(set(merged)) == 1 and merged[0] == groups._flat[0].data_ptr()
    assert [reuse for _, reuse in offered].count(False) == 3
    assert closed == [2, 4, 6]  # each wait() closed its step after both groups were sent


class _Immediate:
    """A runtime of two ranks whose submitted work runs at once, on the caller's thread."""

    world_size = 2

    def submit(self, fn, name=""):  # type: ignore[no-untyped-def]
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(fn())
        return type("W", (), {"wait": lambda self: fut.wait()})()


def test_the_step_writes_the_aggregate_into_a_given_up_buffer_only_when_nothing_needs_it() -> None:
    """reuse=True: top-k with error feedback (the memory holds its own copy) decodes into the caller's buffer
    from the second step on; qsgd without memory gives its buffer up too, but its own sum decodes into a new tensor."""
    from gradsync.train.communicator import AllgatherCommunicator, CompressionStep

    class Runtime(_Immediate):
        def run_allgather(self, t, equal_sizes=False):  # type: ignore[no-untyped-def]
            return [t.clone(), t.clone()]

    comm = object.__new__(AllgatherCommunicator)
    comm.runtime = Runtime()  # type: ignore[assignment]
    info = TensorInfo("g", (4000,), torch.float32)
    for name, memory, reused in (("topk", "residual", [False, True, True]), ("qsgd", "none", [False] * 3)):
        step, ref = CompressionStep(seeded(name), memory, comm), CompressionStep(seeded(name), memory, comm)
        for s in range(3):
            g = _gradients(s, (4000,))
            buf = g.clone()
            got = step.step_async([buf], [info], reuse=True).wait()[0]
            want = ref.step_async([g], [info]).wait()[0]
            assert torch.equal(got, want), (name, s)
            assert (got.data_ptr() == buf.data_ptr()) == reused[s], (name, s)


class _Summing(_Immediate):
    """Two ranks whose peer sent what this one did: an allreduce doubles in place."""

    def run_allreduce(self, tensors, op="sum"):  # type: ignore[no-untyped-def]
        for t in tensors:
            t.mul_(2)
        return tensors


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_casts_sum_is_decoded_into_the_buffer_given_up_from_the_first_step(name: str) -> None:
    """A cast without memory keeps nothing of its input once the payload is made: with reuse=True the summed payload
    is cast back into the caller's buffer from the first step (no new d-element tensor, no copy back), the same bits
    as a step that keeps its input; with error feedback, from the step its memory first copies the input."""
    from gradsync.train.communicator import AllreduceCommunicator, CompressionStep

    comm = object.__new__(AllreduceCommunicator)
    comm.runtime = _Summing()  # type: ignore[assignment]
    info = TensorInfo("g", (50, 80), torch.float32)
    for memory, reused in (("none", [True] * 3), ("residual", [False, True, True])):
        step, ref = CompressionStep(create(name), memory, comm), CompressionStep(create(name), memory, comm)
        for s in range(3):
            g = _gradients(s, info.shape)
            buf = g.clone()
            got = step.step_async([buf], [info], reuse=True).wait()[0]
            want = ref.step_async([g], [info]).wait()[0]
            assert torch.equal(got, want) and got.shape == info.shape, (name, memory, s)
            assert (got.data_ptr() == buf.data_ptr()) == reused[s], (name, memory, s)
            assert torch.equal(g, _gradients(s, info.shape))  # a step that keeps its input leaves it as it was


@pytest.mark.parametrize("name", ["fp16", "bf16", "qsgd", "none"])
def test_decompress_writes_into_out_only_where_it_casts_back(name: str) -> None:
    """``decompress(..., out)`` casts a payload of another dtype back into ``out`` (the same values as without it);
    a payload decoded in the input's dtype already is returned as it is, ``out`` untouched (copying it there would be
    a pass more), as is an ``out`` of another size or dtype."""
    c = create(name)
    info = TensorInfo("g", (30, 40), torch.float32)
    payload, ctx = c.compress(_gradients(1, info.shape), info)
    want = c.decompress(payload, ctx)
    out = torch.full(info.shape, 7.0)
    got = c.decompress(payload, ctx, out)
    assert torch.equal(got, want) and got.shape == info.shape
    casts = payload[0].dtype != torch.float32
    assert (got.data_ptr() == out.data_ptr()) == casts, name
    if not casts:
        assert torch.equal(out, torch.full(info.shape, 7.0))
    for wrong in (torch.zeros(info.numel + 1), torch.zeros(info.shape, dtype=torch.float64)):
        assert c.decompress(payload, ctx, wrong).data_ptr() != wrong.data_ptr()


def test_workspaces_are_per_thread() -> None:
    """A step compresses its next group on the caller's thread while the communication thread decodes the last
    one: a scratch buffer shared between them would mix two groups' values (replicas then differ)."""
    import threading

    c = create("efsignsgd")
    here = c._workspace("decoded", 100, torch.float32, torch.device("cpu"))
    assert c._workspace("decoded", 50, torch.float32, torch.device("cpu")).data_ptr() == here.data_ptr()
    there: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: there.append(c._workspace("decoded", 100, torch.float32, torch.device("cpu"))))
    t.start()
    t.join()
    assert there[0].data_ptr() != here.data_ptr()


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("shape", [(40, 25), (17, 241), (8, 4, 3, 3)], ids=str)
def test_powersgd_products_in_place_and_into_a_given_buffer(rank: int, shape) -> None:
    """The thin products (times, transposed_times) are m @ q and m^T @ p; error feedback's M - P Q^T in place
    and finish's P (sum Q)^T written into a given buffer are the plain results."""
    from gradsync.compress.lowrank import times, transposed_times

    gen = torch.Generator().manual_seed(rank)
    m = torch.randn(shape[0], int(torch.Size(shape[1:]).numel()), generator=gen)
    q = torch.randn(m.shape[1], rank, generator=gen)
    p = torch.randn(m.shape[0], rank, generator=gen)
    torch.testing.assert_close(times(m, q), m @ q)
    torch.testing.assert_close(transposed_times(m, p), m.T @ p)
    assert times(m, q).is_contiguous() and transposed_times(m, p).is_contiguous()
    info = TensorInfo("w", shape, torch.float32)
    workers = [create("powersgd", rank=rank, min_compression_rate=0) for _ in range(2)]
    grads = [_tensor(shape, 30 + w) for w in range(2)]
    firsts = [c.first_round(g, info) for c, g in zip(workers, grads)]
    rounds = [c.second_round(g, info, firsts[0] + firsts[1]) for c, g in zip(workers, grads)]
    x = grads[0].clone()
    eps = 4 * torch.finfo(torch.float32).eps  # a fused multiply-add (FUSED_RESIDUAL): within a rounding
    torch.testing.assert_close(workers[0].subtract_decoded(x, *rounds[0], inplace=True),
                               grads[0] - workers[0].decompress(*rounds[0]), rtol=eps, atol=eps)
    summed = [rounds[0][0][0] + rounds[1][0][0]]
    plain = workers[0].finish(summed, rounds[0][1])
    out = torch.full(shape, float("nan"))
    into = workers[1].finish(summed, rounds[1][1], out)
    assert torch.equal(into, plain) and into.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("n", [0, 1, 1000])
def test_allgather_of_equal_sizes_skips_the_sizes_round_point_to_point(world: int, n: int) -> None:
    """equal_sizes: one round of messages (no sizes round) brings every rank's tensor, in rank order."""
    from gradsync.comm.collectives import gather_p2p
    from gradsync.comm.local import run_ranks

    def body(transport):  # type: ignore[no-untyped-def]
        mine = torch.arange(n, dtype=torch.int64) * 10 + transport.rank
        sent = []
        isend = transport.isend
        transport.isend = lambda t, peer, tag: sent.append(tag) or isend(t, peer, tag)
        return gather_p2p(mine, transport, 10.0, equal_sizes=True), sent

    for result in run_ranks(world, body):
        assert not isinstance(result, BaseException), result
        got, tags = result
        assert [torch.equal(g, torch.arange(n, dtype=torch.int64) * 10 + r) for r, g in enumerate(got)] == [True] * world
        assert 0 not in tags  # tag 0 carries the sizes
