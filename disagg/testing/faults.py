"""`Faults`: the client of one server's POST /faults (the server runs `--enable-fault-injection`),
one method per fault. Each returns the fault as the server applied it; a refusal raises FaultRefused
with the server's status and message."""

from __future__ import annotations

import ssl

from disagg.testing.http import post


class FaultRefused(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class Faults:
    def __init__(self, url: str, admin_key: str | None = None, context: ssl.SSLContext | None = None):
        self.url = url
        self.admin_key = admin_key
        self.context = context  # an https server's: trusting its CA

    def stall(self, rank: int = 0, seconds: float = 5.0) -> dict:
        """The worker's process stops (SIGSTOP) for `seconds`: no step, no answer, no heartbeat."""
        return self.inject("stall", rank, seconds=seconds)

    def kill(self, rank: int = 0) -> dict:
        """kill -9 of the worker's process; the server restarts it."""
        return self.inject("kill", rank)

    def fail_requests(self, rank: int = 0, count: int = 1, status: int = 500) -> dict:
        """The next `count` requests sent to the worker answer `status`."""
        return self.inject("fail_requests", rank, count=count, status=status)

    def slow_steps(self, rank: int = 0, ms: float = 100.0) -> dict:
        """Every engine step of the worker takes `ms` longer (0: back to normal)."""
        return self.inject("slow_steps", rank, ms=ms)

    def delay_transfers(self, rank: int = 0, count: int = 1, seconds: float = 2.0) -> dict:
        """The worker's next `count` KV transfers complete `seconds` late."""
        return self.inject("delay_transfers", rank, count=count, seconds=seconds)

    def fail_transfers(self, rank: int = 0, count: int = 1) -> dict:
        """The worker's next `count` KV transfers fail."""
        return self.inject("fail_transfers", rank, count=count)

    def corrupt_transfers(self, rank: int = 0, count: int = 1) -> dict:
        """(A decode with --kv-checksum) the next `count` rooms that land get a byte flipped before the check."""
        return self.inject("corrupt_transfers", rank, count=count)

    def stop_heartbeats(self, rank: int = 0, seconds: float = 5.0) -> dict:
        """The worker sends and answers no control-plane heartbeat for `seconds`."""
        return self.inject("stop_heartbeats", rank, seconds=seconds)

    def inject(self, fault: str, rank: int, **params: float) -> dict:
        headers = {} if self.admin_key is None else {"Authorization": f"Bearer {self.admin_key}"}
        status, answer = post(self.url + "/faults", {"fault": fault, "dp_rank": rank, **params}, headers, 30, self.context)
        if status != 200:
            message = answer["error"]["message"] if isinstance(answer, dict) and "error" in answer else str(answer)
            raise FaultRefused(status, message)
        return answer
