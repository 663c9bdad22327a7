"""A throwaway CA (trustme) and the PEM files signed by it that the TLS tests hand to servers, the
router and clients: a server certificate for 127.0.0.1 and localhost, and a client certificate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class TlsFiles:
    ca: str  # the CA certificate: what clients (and servers checking client certificates) trust
    certfile: str
    keyfile: str
    client_certfile: str
    client_keyfile: str
    other_ca: str  # a CA that signed nothing here: trusting it alone must fail


def write_tls_files(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TlsFiles:
    """The files, the server certificate naming `hosts` (addresses or names)."""
    ca = trustme.CA()
    server = ca.issue_cert(*hosts)
    client = ca.issue_cert("router.disagg.test")
    paths = {name: str(directory / f"{name}.pem") for name in TlsFiles.__dataclass_fields__}
    ca.cert_pem.write_to_path(paths["ca"])
    server.cert_chain_pems[0].write_to_path(paths["certfile"])
    server.private_key_pem.write_to_path(paths["keyfile"])
    client.cert_chain_pems[0].write_to_path(paths["client_certfile"])
    client.private_key_pem.write_to_path(paths["client_keyfile"])
    trustme.CA().cert_pem.write_to_path(paths["other_ca"])
    return TlsFiles(**paths)
