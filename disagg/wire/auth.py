"""Credentials on the wire: the bearer check of HTTP routes and the cluster secret's HMAC proofs.

Pure (no I/O; time and nonces are passed in), so both ends of each plane and the tests share one
definition. Every comparison is constant-time (hmac.compare_digest).

- HTTP: `Authorization: Bearer <key>` (API key, admin key, and the cluster secret on registry writes).
- KV control stream (gRPC): the decode sends `control_proof(secret, now, nonce)` in the call metadata
  under CONTROL_AUTH_KEY; the prefill checks it (`control_proof_refusal`) and answers, in its initial
  metadata, `control_reply(secret, proof)`, which the decode checks (`control_reply_matches`). Neither
  side ever sends the secret itself, and each proves it to the other.
- KV listener (tcp backend): the listener sends a random nonce; the connecting side answers
  `challenge_answer(secret, nonce)`.
"""

from __future__ import annotations

import hashlib
import hmac

CONTROL_AUTH_KEY = "x-disagg-cluster-auth"  # gRPC metadata keys are lowercase ASCII
PROOF_MAX_AGE_S = 300.0  # how far the two hosts' clocks may disagree, and how long a proof can be replayed
NONCE_BYTES = 16
_VERSION = "v1"


def bearer_matches(authorization: str | None, key: str) -> bool:
    """True when the Authorization header is exactly `Bearer <key>`."""
    sent = (authorization or "").encode()
    return hmac.compare_digest(sent, f"Bearer {key}".encode())


def _mac(secret: str, purpose: str, message: str | bytes) -> str:
    data = message.encode() if isinstance(message, str) else message
    return hmac.new(secret.encode(), purpose.encode() + b"|" + data, hashlib.sha256).hexdigest()


def control_proof(secret: str, now: float, nonce: bytes) -> str:
    """`v1.<unix seconds>.<nonce hex>.<HMAC-SHA256 hex>`: what a decode sends when opening a control stream."""
    stamp = f"{_VERSION}.{int(now)}.{nonce.hex()}"
    return f"{stamp}.{_mac(secret, 'disagg/control/decode', stamp)}"


def control_proof_refusal(secret: str, proof: str | None, now: float) -> str | None:
    """Why a control stream carrying `proof` is refused by a prefill holding `secret`; None to accept."""
    if not proof:
        return "no cluster secret sent: this prefill requires one (set --cluster-secret on the decode)"
    parts = proof.split(".")
    if len(parts) != 4 or parts[0] != _VERSION or not parts[1].isdigit():
        return "malformed cluster secret proof"
    if not hmac.compare_digest(parts[3].encode(), _mac(secret, "disagg/control/decode", ".".join(parts[:3])).encode()):
        return "cluster secret mismatch: the decode's --cluster-secret differs from the prefill's"
    if abs(now - int(parts[1])) > PROOF_MAX_AGE_S:
        return (f"cluster secret proof is {abs(now - int(parts[1])):.0f} s away from this host's clock "
                f"(at most {PROOF_MAX_AGE_S:g} s): synchronise the clocks")
    return None


def control_reply(secret: str, proof: str) -> str:
    """The prefill's answer to an accepted proof: shows the decode that the prefill holds the secret too."""
    return _mac(secret, "disagg/control/prefill", proof)


def control_reply_matches(secret: str, proof: str, reply: str | None) -> bool:
    return reply is not None and hmac.compare_digest(reply.encode(), control_reply(secret, proof).encode())


def challenge_answer(secret: str, nonce: bytes) -> bytes:
    """A KV-listener client's answer to the listener's nonce (32 bytes)."""
    return bytes.fromhex(_mac(secret, "disagg/kv-tcp", nonce))


def challenge_answer_matches(secret: str, nonce: bytes, answer: bytes) -> bool:
    return hmac.compare_digest(answer, challenge_answer(secret, nonce))
