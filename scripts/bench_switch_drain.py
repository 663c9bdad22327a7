"""How long a decode takes to switch to prefill with a queue behind its streams (docs/benchmarks.md, "A
switch waits for the streams, not the queue"): a decode server (tiny model, one worker, a batch of 4, every
step held to `--step-ms` by the slow_steps fault, so the figures do not depend on the CPU) has 8 streaming
requests of 48 tokens, 4 decoding and 4 waiting for a slot, when `POST /pd_role_switch` asks for the
prefill role. Each round runs twice: as shipped (the waiting 4 are handed back at once with 503
role_switching, for a router to send elsewhere) and with the hand-back replaced by a no-op in this process
(the switch waits for all 8), then switches back to decode.

    .venv/bin/python scripts/bench_switch_drain.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

import disagg.api.admin_routes as admin_routes
from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig, with_settings
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.launch import start_server

BODY = {"model": "tiny", "prompt": "hello there " * 8, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
        "stream": True}


async def _stream(session: aiohttp.ClientSession, url: str, request_id: str) -> int:
    async with session.post(url + "/v1/completions", json={**BODY, "request_id": request_id}) as r:
        async for _ in r.content:
            pass
        return r.status


async def one_round(session: aiohttp.ClientSession, url: str, name: str, hand_back: bool) -> tuple[float, list[int]]:
    """(seconds the switch took, each request's status); the server is a decode again after it."""
    shipped = admin_routes.hand_back_unanswered
    if not hand_back:
        async def nothing(state, error) -> int:
            return 0
        admin_routes.hand_back_unanswered = nothing
    try:
        streams = [asyncio.create_task(_stream(session, url, f"{name}-{i}")) for i in range(8)]
        await asyncio.sleep(1.0)  # 4 decode, 4 wait for a slot
        started = time.monotonic()
        async with session.post(url + "/pd_role_switch", json={"new_role": "prefill"}) as r:
            assert r.status == 200, await r.text()
        took = time.monotonic() - started
        statuses = [await s for s in streams]
    finally:
        admin_routes.hand_back_unanswered = shipped
    async with session.post(url + "/pd_role_switch", json={"new_role": "decode"}) as r:
        assert r.status == 200, await r.text()
    return took, statuses


async def main(rounds: int, step_ms: int) -> None:
    engine = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"), cache=CacheConfig(num_blocks=256, block_size=4),
                          scheduler=SchedulerConfig(max_num_seqs=4))
    disagg = with_settings(DisaggConfig(), transfer_backend="tcp", bootstrap_port=0, max_local_prefill_tokens=4096)
    server = ServerConfig(port=0, dp_size=1, disaggregation_mode="decode", load_balance_method="least_load",
                          enable_pd_role_switch=True, enable_fault_injection=True)
    running = await start_server(server, engine, disagg, lambda _: None)
    url = f"http://127.0.0.1:{running.port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/faults", json={"fault": "slow_steps", "dp_rank": 0, "ms": step_ms}) as r:
                assert r.status == 200, await r.text()
            print(f"| round | hand-back | switch took | answers (status x count) |\n|---|---|---|---|")
            for i in range(rounds):
                for hand_back in (False, True):
                    took, statuses = await one_round(session, url, f"r{i}-{hand_back}", hand_back)
                    counts = ", ".join(f"{s} x {statuses.count(s)}" for s in sorted(set(statuses)))
                    print(f"| {i + 1} | {'on (as shipped)' if hand_back else 'off'} | {took:.2f} s | {counts} |",
                          flush=True)
    finally:
        await running.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=int, default=60, help="each engine step held to at least this long")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.step_ms))
