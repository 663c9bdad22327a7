"""The harness's one HTTP call: a JSON POST, for the cluster's requests and the fault routes."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any


def post(url: str, body: dict, headers: dict[str, str] | None = None, timeout_s: float = 120.0,
         context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    """(status, JSON body, or the text of a stream or of a body that is not JSON); `context` for https."""
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw
