"""The parameter server's wire format (gradsync.ps.wire): frames, tags and MACs, fuzzed decoding; raw frames written without the client library."""

from __future__ import annotations

import hmac as hmac_lib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.ps import wire
from gradsync.ps.wire import DTYPES, HEADER, Flag, Op, WireError, decode, encode, seal


# ---- wire ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_frame_round_trip_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    frames = encode(Op.PUSH, key="layer.0", tensor=t, version=5, priority=-2, sender=3, secret=b"k")
    m = decode([bytes(f) for f in frames], secret=b"k")
    assert (m.op, m.key, m.dtype, m.shape, m.version, m.priority, m.sender) == (Op.PUSH, "layer.0", dtype, (3, 4), 5, -2, 3)
    assert torch.equal(m.tensor().reshape(3, 4), t)


def test_int_and_str_keys_stay_distinct() -> None:
    assert decode(encode(Op.PULL, key=7)).key == 7
    assert decode(encode(Op.PULL, key="7")).key == "7"
    with pytest.raises(TypeError, match="int or str"):
        encode(Op.PULL, key=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("mutate, match", [
    (lambda f: [f[0][:10], f[1]], "truncated"),
    (lambda f: [b"XXXX" + f[0][4:], f[1]], "magic"),
    (lambda f: [f[0], f[1][:-1]], "payload"),
    (lambda f: [f[0]], "2 or 3 frames"),
    (lambda f: [f[0][:5] + bytes([99]) + f[0][6:], f[1]], "op code"),
])
def test_decode_rejects_bad_frames(mutate, match) -> None:  # type: ignore[no-untyped-def]
    frames = [bytes(f) for f in encode(Op.PUSH, key="a", tensor=torch.ones(4))]
    with pytest.raises(WireError, match=match):
        decode(mutate(frames))


def test_seal_numbers_each_send_under_the_tag() -> None:
    frames = encode(Op.PUSH, key="a", tensor=torch.ones(4), job=0xAB, session=77)
    first, second = seal(frames, seq=1, secret=b"s"), seal(frames, seq=2, secret=b"s")
    m1, m2 = decode(first, secret=b"s"), decode(second, secret=b"s")
    assert (m1.job, m1.session, m1.seq, m2.seq) == (0xAB, 77, 1, 2) and first[1] is frames[1]  # payload not copied
    assert first[2] != second[2]
    forged = [second[0], first[1], first[2]]  # a new seq under an old tag
    with pytest.raises(WireError, match="tag does not match"):
        decode(forged, secret=b"s")


def test_protocol_1_peer_is_named() -> None:
    old = struct.pack("<4sBBBBHHBBHIIQQQQQiI", b"GSPS", 1, int(Op.PING), 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
    with pytest.raises(WireError, match=f"protocol version 1; this build speaks {wire.PROTO}"):
        decode([old, b""])


def test_decode_enforces_payload_limit_and_tag() -> None:
    frames = [bytes(f) for f in encode(Op.PUSH, key="a", tensor=torch.ones(64), secret=b"s")]
    with pytest.raises(WireError, match="exceeds"):
        decode(frames, secret=b"s", max_payload=100)
    with pytest.raises(WireError, match="tag does not match"):
        decode(frames, secret=b"other")
    with pytest.raises(WireError, match="no authentication tag"):
        decode(frames[:2], secret=b"s")
    tampered = [frames[0], b"\x00" * len(frames[1]), frames[2]]
    with pytest.raises(WireError, match="tag does not match"):
        decode(tampered, secret=b"s")


def test_gmac_tag_equals_aes_gcm_computed_through_the_streaming_api() -> None:
    """The tag is AES-256-GCM's over (associated data = payload, plaintext = header) under the derived key,
    recomputed here through cryptography's other (streaming) interface; every field of the frame is covered."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    frames = encode(Op.PUSH, key="w", tensor=torch.arange(1000, dtype=torch.float32), secret=b"k3y")
    head, body, tag = bytes(frames[0]), bytes(frames[1]), frames[2]
    assert tag[0] == wire.MAC_GMAC and len(tag) == 29
    key = hmac_lib.digest(b"k3y", b"gradsync-ps-gmac-v1", "sha256")
    enc = Cipher(algorithms.AES(key), modes.GCM(tag[1:13])).encryptor()
    enc.authenticate_additional_data(body)
    enc.update(head)
    enc.finalize()
    assert enc.tag == tag[13:]
    decode(frames, secret=b"k3y")
    for i in (0, 1, 2):  # header, payload, and the nonce or tag: one flipped bit anywhere is refused
        for at in (0, len(bytes(frames[i])) - 1):
            bad = [bytearray(bytes(f)) for f in frames]
            bad[i][at] ^= 1
            with pytest.raises(WireError, match="tag does not match|protocol|magic|algorithm"):
                decode([bytes(b) for b in bad], secret=b"k3y")


def test_gmac_nonces_never_repeat_in_a_process_or_a_forked_child() -> None:
    import os

    nonces = {bytes(encode(Op.PING, secret=b"s")[2][1:13]) for _ in range(2000)}
    assert len(nonces) == 2000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's first nonce (its prefix must differ from the parent's)
        os.write(write, bytes(encode(Op.PING, secret=b"s")[2][1:13]))
        os._exit(0)
    os.close(write)
    child = os.read(read, 12)
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 12 and child[:8] != next(iter(nonces))[:8] and child not in nonces


def test_hmac_sender_without_cryptography_is_accepted_and_a_gmac_tag_needs_it(monkeypatch) -> None:
    gmac = encode(Op.PUSH, key="a", tensor=torch.ones(8), secret=b"s")
    monkeypatch.setattr(wire, "AESGCM", None)
    assert wire.mac_algorithm() == wire.MAC_HMAC
    frames = encode(Op.PUSH, key="a", tensor=torch.ones(8), secret=b"s")
    assert frames[2][0] == wire.MAC_HMAC and frames[2][1:] == hmac_lib.digest(
        b"s", bytes(frames[0]) + bytes(frames[1]), "sha256")
    assert decode(frames, secret=b"s").key == "a"
    with pytest.raises(WireError, match="pip install cryptography"):
        decode(gmac, secret=b"s")
    monkeypatch.undo()
    assert decode(frames, secret=b"s").key == "a"  # a GMAC-capable receiver still takes HMAC
    with pytest.raises(WireError, match="expected 2 .AES-GMAC, 29 bytes. or 1"):
        decode([frames[0], frames[1], frames[2][:20]], secret=b"s")


def _detached_pair(secret: bytes = b"s", n: int = wire.DETACH_BYTES // 4) -> tuple[list, bytes]:
    frames = seal(encode(Op.PUSH, key="a", tensor=torch.arange(n, dtype=torch.float32), session=5), seq=1,
                  secret=secret, detach=True)
    return frames, wire.tag_frame(frames, secret)


def test_large_payloads_detach_their_mac_and_small_ones_keep_it_inline() -> None:
    frames, mac = _detached_pair()
    assert wire.is_detached(frames) and len(frames[2]) == 13 and len(mac) == 16  # prefix: algorithm + nonce
    small = seal(encode(Op.PUSH, key="a", tensor=torch.ones(8), flags=Flag.DETACHED), seq=1, secret=b"s", detach=True)
    assert not wire.is_detached(small) and len(small[2]) == 29  # a flag a caller passed is not ours to keep
    assert not decode(small, secret=b"s").flags & Flag.DETACHED
    unsecured = encode(Op.PUSH, key="a", tensor=torch.ones(1 << 17), detach=True)
    assert len(unsecured) == 2 and not wire.is_detached(unsecured)
    joined = [frames[0], frames[1], frames[2] + mac]
    assert torch.equal(decode(joined, secret=b"s").tensor(), torch.arange(wire.DETACH_BYTES // 4, dtype=torch.float32))


def test_tag_joiner_joins_checks_early_and_refuses_what_never_got_its_mac() -> None:
    frames, mac = _detached_pair()
    joiner = wire.TagJoiner(b"s")
    assert joiner.feed("p", frames) == [] and joiner.feed("q", [b"other peer"]) == [([b"other peer"], None)]
    [(joined, expected)] = joiner.feed("p", [mac])
    assert expected == mac and joiner.joined == 1  # hashed when the payload came, before the MAC
    assert decode(joined, secret=b"s", expected=expected).key == "a"
    bad = bytearray(mac)
    bad[0] ^= 1
    joiner.feed("p", frames)
    [(joined, expected)] = joiner.feed("p", [bytes(bad)])
    with pytest.raises(WireError, match="tag does not match"):
        decode(joined, secret=b"s", expected=expected)
    # the next message is not the MAC: the held one comes out untagged (refused), the new one as it is
    joiner.feed("p", frames)
    small = encode(Op.PING, secret=b"s")
    (held, none), (nxt, _) = joiner.feed("p", small)
    assert none is None and len(held) == 2 and nxt is small
    with pytest.raises(WireError, match="no authentication tag"):
        decode(held, secret=b"s")
    # bounded: the oldest waiting peer is given up on; without a secret the pair is joined and not checked
    few = wire.TagJoiner(b"s", max_peers=2)
    assert few.feed(1, frames) == few.feed(2, frames) == []
    [(evicted, _)] = few.feed(3, frames)
    assert len(evicted) == 2 and set(few.pending) == {2, 3}
    open_joiner = wire.TagJoiner(None)
    open_joiner.feed("p", frames)
    [(plain, expected)] = open_joiner.feed("p", [mac])
    assert expected is None and decode(plain).key == "a"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_fuzz_decoder_only_raises_wire_error(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=HEADER.size, max_size=HEADER.size + 40), st.binary(max_size=64))
def test_fuzz_headers_with_valid_magic(rest: bytes, body: bytes) -> None:
    head = b"GSPS\x01" + rest[5:]
    try:
        m = decode([head, body])
    except WireError:
        return
    if m.dtype is not None:  # a frame that decodes also yields a tensor of exactly its payload
        assert m.tensor().numel() == m.numel


def test_struct_header_is_documented_size() -> None:
    assert HEADER.size == 112 and struct.calcsize("<Q") == 8
