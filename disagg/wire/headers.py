"""HTTP headers that our servers, our router and external routers exchange (one spelling each)."""

from __future__ import annotations

# Pins the DP worker of the server that receives it (the body's `routed_dp_rank`, winning over it);
# every answer carries the rank that served it under the same name.
DP_RANK_HEADER = "X-data-parallel-rank"
# The client's request id, kept through the router's legs and echoed on the answer.
REQUEST_ID_HEADER = "X-Request-Id"
# On our router's answer: how many times it sent the request again (to a fresh pair) before answering.
RETRIES_HEADER = "X-Disagg-Retries"
# A cluster secret proof on a registry write (disagg/wire/auth.py: the answer to `GET /challenge`).
CLUSTER_AUTH_HEADER = "X-Disagg-Cluster-Auth"
# Our router's leg to a server that may switch roles: the role epoch the router saw it at. A server at
# another epoch (it switched since) refuses with 503 stale_role_epoch instead of serving the wrong half.
ROLE_EPOCH_HEADER = "X-PD-Role-Epoch"
# On our router's answer: its path (pd, decode-local, retried: disagg/router/answer_path.py) and, where
# it was not pd, why.
PATH_HEADER = "X-Disagg-Path"
PATH_REASON_HEADER = "X-Disagg-Path-Reason"
# On a decode's answer whose KV came from a prefill (and passed on by our router): how long the request
# waited for its KV (arrival until admitted: the prefill's compute and the transfer, as the decode saw
# them), in milliseconds, and the bytes that moved.
KV_WAIT_HEADER = "X-Disagg-KV-Wait-Ms"
KV_BYTES_HEADER = "X-Disagg-KV-Bytes"
PASSED_HEADERS = (DP_RANK_HEADER, KV_WAIT_HEADER, KV_BYTES_HEADER)  # what our router copies from a decode's answer
