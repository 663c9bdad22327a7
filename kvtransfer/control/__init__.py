"""The P/D control plane between a decode worker and a prefill worker, over gRPC (proto/kv_control.proto).

Peer registration, TransferInfo, status, abort, leases and heartbeats, on one long-lived stream per
(decode worker, prefill worker) pair: server.py (the prefill side, ControlServer, and the errors both
sides raise), client.py (the decode side, ControlClient), checks.py (what the server refuses, pure),
endpoint.py (a worker's backend with its cache registered, and the PeerMsg that introduces it).

The one part of kvtransfer that knows rooms and request ids. It builds on the request-agnostic
backends (kvtransfer.base, kvtransfer.factory); no backend imports it.
"""
