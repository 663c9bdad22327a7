"""The cluster secret's challenge-response and the bearer check: the exact HMAC construction, the token
format, every refusal reason, and the nonce table (single use, expiry, bound)."""

import hashlib
import hmac

import pytest

from disagg.wire.auth import (
    CONTROL, KV_TCP, REGISTRY, Binding, NonceState, NonceTable, ProofRefused, answer, bearer_matches, check_proof,
    format_address, parse_proof, reply, reply_matches, request_digest,
)

SERVER_NONCE, CLIENT_NONCE = bytes(range(32)), bytes(range(32, 64))
BINDING = Binding(SERVER_NONCE, CLIENT_NONCE, "decode-0", "10.0.0.5:17001")
TARGET = "10.0.0.5:17001"


def mac(tag: bytes, *fields: bytes) -> str:
    message = b"".join(len(f).to_bytes(4, "big") + f for f in (tag, *fields))
    return hmac.new(b"s3cret", message, hashlib.sha256).hexdigest()


def table_with(*nonces: bytes, now: float = 0.0) -> NonceTable:
    table = NonceTable(ttl_s=10.0)
    for nonce in nonces:
        table.issue(nonce, now)
    return table


def check(token, nonces, plane=CONTROL, **kw):
    """The accepted binding, or the refusal's reason."""
    kw.setdefault("targets", (TARGET,))
    try:
        return check_proof("s3cret", plane, token, nonces=nonces, now=1.0, **kw)
    except ProofRefused as exc:
        return exc.reason


def test_a_proof_is_the_hmac_of_every_field_and_never_the_secret():
    token = answer("s3cret", CONTROL, BINDING)
    expected = mac(b"disagg/control/v2/decode", SERVER_NONCE, CLIENT_NONCE, b"decode-0", b"10.0.0.5:17001", b"")
    assert token == ".".join(("v2", SERVER_NONCE.hex(), CLIENT_NONCE.hex(), b"decode-0".hex(),
                              b"10.0.0.5:17001".hex(), expected))
    assert "s3cret" not in token and parse_proof(token) == (BINDING, bytes.fromhex(expected))
    assert reply("s3cret", CONTROL, BINDING) == mac(b"disagg/control/v2/prefill", SERVER_NONCE, CLIENT_NONCE,
                                                    b"decode-0", b"10.0.0.5:17001", b"")
    assert reply_matches("s3cret", CONTROL, BINDING, reply("s3cret", CONTROL, BINDING))
    assert not reply_matches("s3cret", CONTROL, BINDING, reply("other", CONTROL, BINDING))
    assert not reply_matches("s3cret", CONTROL, BINDING, None)


def test_each_plane_and_each_request_has_its_own_proof():
    tokens = {answer("s3cret", plane, BINDING) for plane in (CONTROL, KV_TCP, REGISTRY)}
    assert len(tokens) == 3
    put = Binding(SERVER_NONCE, CLIENT_NONCE, "p0", TARGET, request_digest("PUT", "/route", b"{}"))
    assert request_digest("PUT", "/route", b"{}") == hashlib.sha256(
        b"PUT\n/route\n" + hashlib.sha256(b"{}").digest()).digest()
    others = [request_digest("POST", "/route", b"{}"), request_digest("PUT", "/register_dp_rank", b"{}"),
              request_digest("PUT", "/route", b"{ }")]
    assert len({answer("s3cret", REGISTRY, put)} | {
        answer("s3cret", REGISTRY, Binding(SERVER_NONCE, CLIENT_NONCE, "p0", TARGET, d)) for d in others}) == 4


def test_an_accepted_nonce_is_used_once():
    nonces = table_with(SERVER_NONCE)
    token = answer("s3cret", CONTROL, BINDING)
    assert check(token, nonces) == BINDING
    assert check(token, nonces) == "cluster secret proof was already used: this prefill accepts each answer once"


@pytest.mark.parametrize("token, reason", [
    (None, "no cluster secret sent: this prefill requires one (set --cluster-secret on the decode)"),
    ("", "no cluster secret sent: this prefill requires one (set --cluster-secret on the decode)"),
    ("s3cret", "malformed cluster secret proof"),
    ("v1.1700000000.000102030405060708090a0b0c0d0e0f.ff", "malformed cluster secret proof"),
    (answer("s3cret", CONTROL, BINDING).upper(), "malformed cluster secret proof"),
    (answer("s3cret", CONTROL, BINDING) + "0", "malformed cluster secret proof"),
    (answer("s3cret", CONTROL, Binding(SERVER_NONCE, CLIENT_NONCE, "d", "10.0.0.6:17001")),
     "cluster secret proof was made for 10.0.0.6:17001, this prefill is 10.0.0.5:17001"),
    (answer("other", CONTROL, BINDING),
     "cluster secret mismatch: the decode's --cluster-secret differs from the prefill's"),
    (answer("s3cret", KV_TCP, BINDING),  # a proof of another plane
     "cluster secret mismatch: the decode's --cluster-secret differs from the prefill's"),
    (answer("s3cret", CONTROL, Binding(b"\x09" * 32, CLIENT_NONCE, "decode-0", TARGET)),
     "cluster secret proof answers no live challenge of this prefill (unknown or expired nonce)"),
])
def test_every_refusal_names_the_check_that_failed(token, reason):
    assert check(token, table_with(SERVER_NONCE)) == reason


def test_a_token_with_a_rewritten_field_is_a_mismatch():
    fields = answer("s3cret", CONTROL, BINDING).split(".")
    for at, value in ((1, (b"\x01" * 32).hex()), (2, (b"\x01" * 32).hex()), (3, b"decode-1".hex()), (4, b"10.0.0.6:17001".hex())):
        forged = ".".join(fields[:at] + [value] + fields[at + 1:])
        assert check(forged, table_with(SERVER_NONCE), targets=(TARGET, "10.0.0.6:17001")) == (
            "cluster secret mismatch: the decode's --cluster-secret differs from the prefill's")


def test_the_expected_client_and_any_of_the_targets():
    token = answer("s3cret", KV_TCP, BINDING)
    nonces = table_with(SERVER_NONCE)
    refused = "cluster secret proof was made for peer 'decode-0', this connection is 'decode-1'"
    assert check(token, nonces, KV_TCP, client="decode-1") == refused
    assert check(token, nonces, KV_TCP, client="decode-0", targets=("127.0.0.1:1", TARGET)) == BINDING


def test_the_nonce_table_expires_bounds_and_forgets():
    table = NonceTable(ttl_s=10.0, capacity=3)
    for i in range(3):
        table.issue(bytes([i]), float(i))
    assert table.take(bytes([0]), 9.9) is NonceState.FRESH
    assert table.take(bytes([0]), 9.9) is NonceState.USED
    assert table.take(bytes([1]), 11.0) is NonceState.UNKNOWN  # expired at 11.0
    table.issue(b"\x03", 11.5)  # full: the oldest (0, used) and the expired (1) go
    assert len(table) == 2 and table.take(bytes([0]), 11.5) is NonceState.UNKNOWN
    for i in range(4, 8):
        table.issue(bytes([i]), 12.0)
    assert len(table) == 3 and table.take(b"\x03", 12.0) is NonceState.UNKNOWN  # pushed out, never valid
    assert table.take(b"\x07", 12.0) is NonceState.FRESH and table.take(b"\x99", 12.0) is NonceState.UNKNOWN


def test_addresses_are_spelled_one_way():
    assert (format_address("10.0.0.5", 1), format_address("::1", 2), format_address("[::1]", 3)) == (
        "10.0.0.5:1", "[::1]:2", "[::1]:3")


@pytest.mark.parametrize("header, ok", [
    ("Bearer k1", True), ("Bearer k2", False), ("k1", False), ("bearer k1", False), ("Bearer k1 ", False),
    ("", False), (None, False),
])
def test_bearer_matches_exactly(header, ok):
    assert bearer_matches(header, "k1") is ok
