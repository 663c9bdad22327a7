"""The cluster secret's proofs and the bearer check: exact formats, every refusal reason."""

import hashlib
import hmac

import pytest

from disagg.wire.auth import (
    bearer_matches, challenge_answer, challenge_answer_matches, control_proof, control_proof_refusal, control_reply,
    control_reply_matches,
)

NONCE = bytes(range(16))
NOW = 1_700_000_000.0


def mac(purpose: bytes, message: bytes) -> str:
    return hmac.new(b"s3cret", purpose + b"|" + message, hashlib.sha256).hexdigest()


def test_control_proof_is_a_timestamped_hmac_and_never_the_secret():
    proof = control_proof("s3cret", NOW + 0.7, NONCE)
    stamp = "v1.1700000000.000102030405060708090a0b0c0d0e0f"
    assert proof == f"{stamp}.{mac(b'disagg/control/decode', stamp.encode())}"
    assert "s3cret" not in proof
    assert control_proof_refusal("s3cret", proof, NOW + 299) is None
    assert control_reply("s3cret", proof) == mac(b"disagg/control/prefill", proof.encode())
    assert control_reply_matches("s3cret", proof, control_reply("s3cret", proof))
    assert not control_reply_matches("s3cret", proof, control_reply("other", proof))
    assert not control_reply_matches("s3cret", proof, None)


@pytest.mark.parametrize("proof, now, reason", [
    (None, NOW, "no cluster secret sent: this prefill requires one (set --cluster-secret on the decode)"),
    ("", NOW, "no cluster secret sent: this prefill requires one (set --cluster-secret on the decode)"),
    ("s3cret", NOW, "malformed cluster secret proof"),
    ("v2.1700000000.00.ff", NOW, "malformed cluster secret proof"),
    ("v1.-5.00.ff", NOW, "malformed cluster secret proof"),
    (control_proof("other", NOW, NONCE), NOW,
     "cluster secret mismatch: the decode's --cluster-secret differs from the prefill's"),
    (control_proof("s3cret", NOW, NONCE)[:-1] + "0", NOW,
     "cluster secret mismatch: the decode's --cluster-secret differs from the prefill's"),
    (control_proof("s3cret", NOW, NONCE), NOW + 301,
     "cluster secret proof is 301 s away from this host's clock (at most 300 s): synchronise the clocks"),
    (control_proof("s3cret", NOW, NONCE), NOW - 3600,
     "cluster secret proof is 3600 s away from this host's clock (at most 300 s): synchronise the clocks"),
])
def test_control_proof_refusals(proof, now, reason):
    assert control_proof_refusal("s3cret", proof, now) == reason


def test_challenge_answer_is_the_hmac_of_the_nonce():
    nonce = b"\x07" * 32
    answer = challenge_answer("s3cret", nonce)
    assert answer.hex() == mac(b"disagg/kv-tcp", nonce) and len(answer) == 32
    assert challenge_answer_matches("s3cret", nonce, answer)
    assert not challenge_answer_matches("other", nonce, answer)
    assert not challenge_answer_matches("s3cret", b"\x08" * 32, answer)


@pytest.mark.parametrize("header, ok", [
    ("Bearer k1", True), ("Bearer k2", False), ("k1", False), ("bearer k1", False), ("Bearer k1 ", False),
    ("", False), (None, False),
])
def test_bearer_matches_exactly(header, ok):
    assert bearer_matches(header, "k1") is ok
