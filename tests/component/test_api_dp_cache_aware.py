"""cache_aware through the real HTTP API: the front passes each request's prompt to the engine's
pick, so a prompt sharing a long prefix with an earlier one lands on the same DP rank, and /metrics
counts the controller's cache hits and misses."""

from component.fake_engine import FakeEngine, api_client

SYSTEM = "You are a helpful assistant that answers in one short sentence. Question: "


async def completion_rank(client, prompt: str) -> int:
    resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert resp.status == 200
    return (await resp.json())["dp_rank"]


async def test_shared_prefix_lands_on_the_same_rank_and_counts_a_hit():
    engine = FakeEngine(dp_size=2, load_balance_method="cache_aware")
    async with api_client(engine) as client:
        first = await completion_rank(client, SYSTEM + "why is the sky blue?")
        unrelated = await completion_rank(client, "Translate to French: good morning")
        second = await completion_rank(client, SYSTEM + "why is grass green?")
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": SYSTEM + "what is rain?"}], "max_tokens": 2})
        chat_rank = (await chat.json())["dp_rank"]
        metrics = await (await client.get("/metrics")).text()
    assert (first, unrelated, second, chat_rank) == (0, 1, 0, 0)
    assert "disagg_dp_cache_hits_total 2.0" in metrics.splitlines()
    assert "disagg_dp_cache_misses_total 2.0" in metrics.splitlines()


async def test_two_requests_sharing_a_prefix_count_one_hit():
    engine = FakeEngine(dp_size=2, load_balance_method="cache_aware")
    async with api_client(engine) as client:
        ranks = [await completion_rank(client, SYSTEM + q) for q in ("why is the sky blue?", "why is grass green?")]
        metrics = (await (await client.get("/metrics")).text()).splitlines()
    assert ranks == [0, 0]
    assert "disagg_dp_cache_hits_total 1.0" in metrics
    assert "disagg_dp_cache_misses_total 1.0" in metrics


async def test_round_robin_counts_no_cache_picks():
    async with api_client(FakeEngine(dp_size=2)) as client:
        ranks = [await completion_rank(client, SYSTEM + q) for q in ("a?", "b?")]
        metrics = (await (await client.get("/metrics")).text()).splitlines()
    assert ranks == [0, 1]
    assert "disagg_dp_cache_hits_total 0.0" in metrics
