"""The tcp backend's cluster secret between two real processes: a peer without it cannot write into us,
and we cannot write into a peer holding another one. The contract itself runs with a secret too
(`tcp+secret` in test_kvtransfer_contract)."""

from __future__ import annotations

import pytest
from test_kvtransfer_contract import SECRET, TIMEOUT_S, Local, ProcessPeer

from kvtransfer.base import AuthenticationFailed
from kvtransfer.handshake import decode_peer_info
from kvtransfer.loopback import LoopbackFabric

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("secrets", [(SECRET, "another-secret"), (SECRET, None)],
                         ids=["wrong-secret", "no-secret"])
def test_a_peer_without_the_cluster_secret_cannot_write_into_us(secrets: tuple) -> None:
    """The peer process (the writer) holds the wrong secret or none; our listener requires ours."""
    ours, theirs = secrets
    local = Local("tcp", LoopbackFabric(), ours)
    peer = ProcessPeer("tcp", secret=theirs)
    try:
        peer.call("fill", block_ids=[1, 2], seed=5)
        before = local.checksums()
        address = f"127.0.0.1:{local.backend.address[1]}"
        reason = ("refused the connection: cluster secret mismatch" if theirs else
                  "requires a cluster secret and this endpoint has none (set --cluster-secret)")
        assert peer.try_call("add_peer", metadata=local.backend.peer_metadata().hex()) == {
            "error": f"AuthenticationFailed: peer {local.backend.agent_name!r} at {address} {reason}"}
        reply = peer.try_call("write", peer=local.backend.agent_name, local=[1, 2], remote=[60, 61], tag="00",
                              timeout_s=TIMEOUT_S)
        assert reply == {"error": f"PeerUnavailable: unknown peer {local.backend.agent_name!r}; add_peer(metadata) first"}
        assert local.checksums() == before and local.backend.notifications() == []
    finally:
        local.backend.close()
        peer.close()


def test_we_cannot_write_into_a_peer_holding_another_secret() -> None:
    peer = ProcessPeer("tcp", secret="another-secret")
    local = Local("tcp", LoopbackFabric(), SECRET)
    try:
        before = peer.call("checksums")["checksums"]
        with pytest.raises(AuthenticationFailed) as excinfo:
            local.backend.add_peer(peer.metadata)
        address = f"127.0.0.1:{decode_peer_info(peer.metadata, 'tcp').port}"
        assert str(excinfo.value) == f"peer {peer.name!r} at {address} refused the connection: cluster secret mismatch"
        assert peer.call("checksums")["checksums"] == before
    finally:
        local.backend.close()
        peer.close()

