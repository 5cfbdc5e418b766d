"""The torch transport's p2p starts: a backend error names the peer as a failed wait does."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm.transport import TorchTransport
from gradsync.errors import PeerError


def _transport() -> TorchTransport:
    """A transport's p2p fields without a process group: ranks 0-2 of a group whose global ranks are 10-12."""
    t = TorchTransport.__new__(TorchTransport)
    t._global, t.group = [10, 11, 12], None
    t._device = torch.device("cpu")
    return t


@pytest.mark.parametrize("start", ["isend", "irecv"])
def test_a_send_or_receive_to_a_peer_whose_connection_closed_raises_a_peer_error_naming_it(start: str) -> None:
    """gloo raises at once, not at the wait, where the peer died between two calls (a survivor of a killed rank in
    the middle of an allreduce, seen in CI): that is a PeerError naming the peer, as the wait's would be."""
    called = []

    class Gloo:
        @staticmethod
        def isend(tensor, dst, group=None, tag=0):  # type: ignore[no-untyped-def]
            called.append(dst)
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:42919. This is "
                               "typically caused by a remote worker crashing.")

        irecv = isend

    t = _transport()
    t._dist = Gloo()
    with pytest.raises(PeerError, match=r"rank 2 closed its connection \(the process exited or crashed\)") as info:
        getattr(t, start)(torch.ones(3), 2, 7)
    assert info.value.peer == 2 and called == [12]
