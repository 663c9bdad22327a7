"""Credentials on the wire: the bearer check of HTTP routes and the cluster secret's challenge-response.

Pure (no I/O; time and random bytes are passed in), so both ends of every plane and the tests share
one definition of each proof. Every comparison is constant-time (hmac.compare_digest).

The cluster secret never crosses the network. On each plane the server first issues a fresh random
nonce (its challenge); the client answers with a proof token carrying

    HMAC-SHA256(secret, len|plane tag, len|server nonce, len|client nonce, len|client identity,
                len|target "host:port" the client dialed, len|request digest (HTTP writes; empty elsewhere))

The server recomputes it against its own view of the target (the address it is bound to), accepts
each nonce once and only while it is fresh (NonceTable), and on the control stream proves itself
back with the same fields under the plane's reply tag (the client nonce makes that reply fresh).
So a captured proof cannot be replayed (single use), redirected (the target), moved to another
client identity, or, on the registry, to another method, path or body.

Planes: CONTROL (gRPC: a `Challenge` RPC, then the proof in the `Connect` metadata under
CONTROL_AUTH_KEY and the reply in the server's initial metadata), KV_TCP (the tcp listener's
CHALLENGE and AUTH frames), REGISTRY (`GET /challenge`, then the proof in an HTTP header on writes).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

CONTROL_AUTH_KEY = "x-disagg-cluster-auth"  # gRPC metadata keys are lowercase ASCII
NONCE_BYTES = 32
MAX_NAME_BYTES = 256  # a client identity or a target in a proof (hex in the token: two digits a byte)
MAX_CHALLENGES = 1024  # nonces a server remembers; the oldest go first
PROOF_VERSION = "v2"
_TOKEN = re.compile(rf"{PROOF_VERSION}\.([0-9a-f]{{64}})\.([0-9a-f]{{64}})\.((?:[0-9a-f]{{2}}){{0,{MAX_NAME_BYTES}}})\."
                    rf"((?:[0-9a-f]{{2}}){{1,{MAX_NAME_BYTES}}})\.([0-9a-f]{{64}})")


@dataclass(frozen=True)
class Plane:
    """One authenticated plane: its HMAC tags and the words of its refusals."""

    answer_tag: str  # what the client's proof is for
    reply_tag: str  # what the server's proof back is for
    server: str  # names the server in refusals ("this prefill")
    missing: str  # refusal when no proof came
    mismatch: str  # refusal when the HMAC differs: another secret


CONTROL = Plane("disagg/control/v2/decode", "disagg/control/v2/prefill", "prefill",
                "no cluster secret sent: this prefill requires one (set --cluster-secret on the decode)",
                "cluster secret mismatch: the decode's --cluster-secret differs from the prefill's")
KV_TCP = Plane("disagg/kv-tcp/v2/connect", "disagg/kv-tcp/v2/listener", "listener",
               "cluster secret required: answer the challenge before any other frame", "cluster secret mismatch")
REGISTRY = Plane("disagg/registry/v2/write", "disagg/registry/v2/registry", "registry",
                 "no proof sent", "cluster secret mismatch")
MALFORMED = "malformed cluster secret proof"


@dataclass(frozen=True)
class Binding:
    """Everything a proof is bound to: the server's challenge, the client's own nonce, who answers,
    which server it meant ("host:port" as dialed) and, for an HTTP write, `request_digest(...)`."""

    server_nonce: bytes
    client_nonce: bytes
    client: str
    target: str
    request: bytes = b""


class ProofRefused(ValueError):
    """A proof the server does not accept; `reason` names the check that failed, nothing more."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def format_address(host: str, port: int) -> str:
    """host:port, with brackets around an IPv6 host: the spelling of every target."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bearer_matches(authorization: str | None, key: str) -> bool:
    """True when the Authorization header is exactly `Bearer <key>`."""
    sent = (authorization or "").encode()
    return hmac.compare_digest(sent, f"Bearer {key}".encode())


def request_digest(method: str, path: str, body: bytes) -> bytes:
    """What an HTTP write's proof binds: its method, its path and the SHA-256 of its body."""
    return hashlib.sha256(b"\n".join((method.upper().encode(), path.encode(), hashlib.sha256(body).digest()))).digest()


def _mac(secret: str, tag: str, binding: Binding) -> bytes:
    fields = (tag.encode(), binding.server_nonce, binding.client_nonce, binding.client.encode(),
              binding.target.encode(), binding.request)
    message = b"".join(len(field).to_bytes(4, "big") + field for field in fields)
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def answer(secret: str, plane: Plane, binding: Binding) -> str:
    """The client's proof token: `v2.<server nonce>.<client nonce>.<client>.<target>.<HMAC>`, each
    field hex (client and target as UTF-8 bytes). The request digest is not in it: the server has it."""
    return ".".join((PROOF_VERSION, binding.server_nonce.hex(), binding.client_nonce.hex(), binding.client.encode().hex(),
                     binding.target.encode().hex(), _mac(secret, plane.answer_tag, binding).hex()))


def parse_proof(token: str, request: bytes = b"") -> tuple[Binding, bytes]:
    """The binding a token claims and its HMAC; ProofRefused(MALFORMED) when it is not a token."""
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise ProofRefused(MALFORMED)
    server_nonce, client_nonce, client, target, mac = match.groups()
    try:
        names = bytes.fromhex(client).decode(), bytes.fromhex(target).decode()
    except UnicodeDecodeError:
        raise ProofRefused(MALFORMED) from None
    return Binding(bytes.fromhex(server_nonce), bytes.fromhex(client_nonce), *names, request), bytes.fromhex(mac)


def reply(secret: str, plane: Plane, binding: Binding) -> str:
    """The server's proof back (hex) for an accepted binding: it holds the secret too."""
    return _mac(secret, plane.reply_tag, binding).hex()


def reply_matches(secret: str, plane: Plane, binding: Binding, sent: str | None) -> bool:
    return sent is not None and hmac.compare_digest(sent.encode(), reply(secret, plane, binding).encode())


class NonceState(enum.Enum):
    FRESH = "fresh"
    USED = "used"
    UNKNOWN = "unknown"  # never issued here, expired, or pushed out by newer ones


class NonceTable:
    """The challenges one server issued. Each is answered at most once, within `ttl_s` of its issue;
    at most `capacity` are kept (the oldest go first: a flood of challenges can make a nonce unknown,
    never valid). Thread-safe: the tcp listener takes nonces from one thread per connection."""

    def __init__(self, ttl_s: float, capacity: int = MAX_CHALLENGES) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._expiry: OrderedDict[bytes, tuple[float, bool]] = OrderedDict()  # nonce -> (expires at, used)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expiry)

    def issue(self, nonce: bytes, now: float) -> bytes:
        """Remember `nonce` (fresh random bytes) as issued at `now`; returns it."""
        with self._lock:
            while self._expiry and (len(self._expiry) >= self.capacity or next(iter(self._expiry.values()))[0] <= now):
                self._expiry.popitem(last=False)
            self._expiry[nonce] = (now + self.ttl_s, False)
        return nonce

    def take(self, nonce: bytes, now: float) -> NonceState:
        """The nonce's state before this call; a FRESH one is USED from now on (atomically)."""
        with self._lock:
            expires_at, used = self._expiry.get(nonce, (now, False))
            if expires_at <= now:
                return NonceState.UNKNOWN
            if used:
                return NonceState.USED
            self._expiry[nonce] = (expires_at, True)
            return NonceState.FRESH


def check_proof(secret: str, plane: Plane, token: str | None, *, targets: Sequence[str], nonces: NonceTable,
                now: float, client: str | None = None, request: bytes = b"") -> Binding:
    """The binding of an accepted proof (its nonce is used from now on), else ProofRefused naming the
    first check that failed: present, well-formed, made for one of `targets` (the first is how the
    server names itself) and for `client` (when given), the right HMAC, a fresh nonce of `nonces`."""
    if not token:
        raise ProofRefused(plane.missing)
    binding, mac = parse_proof(token, request)
    if binding.target not in targets:
        raise ProofRefused(f"cluster secret proof was made for {binding.target}, this {plane.server} is {targets[0]}")
    if client is not None and binding.client != client:
        raise ProofRefused(f"cluster secret proof was made for peer {binding.client!r}, this connection is {client!r}")
    if not hmac.compare_digest(mac, _mac(secret, plane.answer_tag, binding)):
        raise ProofRefused(plane.mismatch)
    state = nonces.take(binding.server_nonce, now)
    if state is NonceState.USED:
        raise ProofRefused(f"cluster secret proof was already used: this {plane.server} accepts each answer once")
    if state is NonceState.UNKNOWN:
        raise ProofRefused(f"cluster secret proof answers no live challenge of this {plane.server} "
                           "(unknown or expired nonce)")
    return binding
