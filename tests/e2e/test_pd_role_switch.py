"""A live role switch (`--enable-pd-role-switch`, `POST /pd_role_switch`): a whole server, every DP
worker, becomes a decode and a prefill again without restarting a worker or reloading a weight.
Two prefills (A with two DP workers, B with one) and a decode D; every P/D answer equals the unified
server's greedy tokens, the work in flight during a switch finishes, new requests meanwhile get a 503
a router sends elsewhere, and every block is free afterwards."""

import asyncio
import itertools
import random

import aiohttp
import pytest
import pytest_asyncio

from disagg.config import ServerConfig
from disagg.launch import start_server
from pd_cluster import TINY, pd_config

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
GREEDY = {"temperature": 0, "ignore_eos": True}
NUM_BLOCKS = 96


async def start(mode: str, dp_size: int, switch: bool = True):
    server = ServerConfig(port=0, dp_size=dp_size, disaggregation_mode=mode, enable_pd_role_switch=switch,
                          load_balance_method="follow_bootstrap_room" if mode == "prefill" else "least_load",
                          enable_fault_injection=True)  # slow_steps holds requests in flight during a switch
    return await start_server(server, TINY, pd_config("tcp"), lambda _: None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers():
    a, b, d = await asyncio.gather(start("prefill", 2), start("prefill", 1), start("decode", 1))
    async with aiohttp.ClientSession() as session:
        yield {"A": a, "B": b, "D": d, "session": session}
    await asyncio.gather(a.close(), b.close(), d.close())


def url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


async def post(session, target: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with session.post(target, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def pd(servers, prefill: str, decode: str, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], int]:
    """Both legs at once, as a router sends them: (the decode's token ids, the decode's status)."""
    p, d, session = servers[prefill], servers[decode], servers["session"]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, **GREEDY},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    (_, _), (status, answer) = await asyncio.gather(post(session, url(p) + "/generate", body),
                                                    post(session, url(d) + "/generate", body))
    return (answer.get("output_ids") if status == 200 else answer), status


async def reference(servers, unified_url: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, **GREEDY}}
    status, answer = await post(servers["session"], unified_url + "/generate", body)
    assert status == 200, answer
    return answer["output_ids"]


async def info(servers, name: str) -> dict:
    async with servers["session"].get(url(servers[name]) + "/server_info") as r:
        return await r.json()


async def switch(servers, name: str, new_role: str) -> tuple[int, dict]:
    return await post(servers["session"], url(servers[name]) + "/pd_role_switch", {"new_role": new_role})


async def free_blocks(servers) -> dict[str, list[int]]:
    out = {}
    for name in ("A", "B", "D"):
        states = (await info(servers, name))["internal_states"]
        out[name] = [s["num_free_blocks"] for s in states]
    return out


async def settled(servers, timeout_s: float = 5.0) -> dict[str, list[int]]:
    expected = {"A": [NUM_BLOCKS] * 2, "B": [NUM_BLOCKS], "D": [NUM_BLOCKS]}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (blocks := await free_blocks(servers)) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    return blocks


def prompt_of(seed: str, n: int = 23) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


async def test_a_prefill_becomes_a_decode_and_a_prefill_again(servers, unified_url):
    first = await info(servers, "A")
    assert (first["disaggregation_mode"], first["pd_role_epoch"], first["pd_role_switch_state"]) == ("prefill", 0, "serving")
    prompt = prompt_of("before")
    assert await pd(servers, "A", "D", prompt) == (await reference(servers, unified_url, prompt), 200)

    status, answer = await switch(servers, "A", "decode")
    assert (status, answer) == (200, {"success": True, "switched": True, "disaggregation_mode": "decode",
                                      "pd_role_epoch": 1})
    now = await info(servers, "A")
    assert (now["disaggregation_mode"], now["pd_role_epoch"], now["load_balance_method"],
            now["max_local_prefill_tokens"]) == ("decode", 1, "least_load", 0)
    assert [s["num_restarts"] for s in now["internal_states"]] == [0, 0]  # the same workers
    for seed in ("as-decode-1", "as-decode-2", "as-decode-3"):
        prompt = prompt_of(seed)
        assert await pd(servers, "B", "A", prompt) == (await reference(servers, unified_url, prompt), 200)

    status, answer = await switch(servers, "A", "prefill")
    assert (status, answer["disaggregation_mode"], answer["pd_role_epoch"]) == (200, "prefill", 2)
    again = await info(servers, "A")
    assert (again["load_balance_method"], "max_local_prefill_tokens" in again) == ("follow_bootstrap_room", False)
    for seed in ("after-1", "after-2"):
        prompt = prompt_of(seed)
        assert await pd(servers, "A", "D", prompt) == (await reference(servers, unified_url, prompt), 200)
    assert await settled(servers) == {"A": [NUM_BLOCKS] * 2, "B": [NUM_BLOCKS], "D": [NUM_BLOCKS]}


async def test_the_work_in_flight_finishes_and_new_requests_get_a_503_meanwhile(servers, unified_url):
    prompts = [prompt_of(f"flight-{i}") for i in range(4)]
    expected = [await reference(servers, unified_url, p, 24) for p in prompts]
    slow = {"fault": "slow_steps", "dp_rank": 0}
    assert (await post(servers["session"], url(servers["D"]) + "/faults", {**slow, "ms": 40}))[0] == 200
    flights = [asyncio.create_task(pd(servers, "B", "D", p, 24)) for p in prompts]
    await asyncio.sleep(0.3)  # the requests decode on D, a token every 40 ms or more
    switching = asyncio.create_task(switch(servers, "D", "prefill"))
    await asyncio.sleep(0.05)
    status, refused = await post(servers["session"], url(servers["D"]) + "/generate",
                                 {"input_ids": [40, 41], "sampling_params": {"max_new_tokens": 2}})
    assert (status, refused["error"]["code"]) == (503, "role_switching")
    assert refused["error"]["message"] == (
        "this server is switching its role to prefill: send the request to another server")
    assert [await f for f in flights] == [(e, 200) for e in expected]
    assert (await post(servers["session"], url(servers["D"]) + "/faults", {**slow, "ms": 0}))[0] == 200
    status, answer = await switching
    assert (status, answer["disaggregation_mode"], answer["pd_role_epoch"]) == (200, "prefill", 1)
    status, answer = await switch(servers, "D", "decode")
    assert (status, answer["switched"], answer["pd_role_epoch"]) == (200, True, 2)
    prompt = prompt_of("after-flight")
    assert await pd(servers, "A", "D", prompt) == (await reference(servers, unified_url, prompt), 200)
    assert await settled(servers) == {"A": [NUM_BLOCKS] * 2, "B": [NUM_BLOCKS], "D": [NUM_BLOCKS]}


async def test_a_decode_leaving_its_role_hands_back_what_sent_nothing_yet(servers, unified_url):
    """D's request still waiting for its KV (B prefills slowly) has sent nothing: the switch ends it at once
    with the switch's 503, which a router sends elsewhere; the one already decoding finishes; no block is lost."""
    waiting, decoding = prompt_of("handed-back"), prompt_of("decoding")
    expected = await reference(servers, unified_url, decoding, 24)
    slow = {"fault": "slow_steps", "dp_rank": 0}
    assert (await post(servers["session"], url(servers["D"]) + "/faults", {**slow, "ms": 40}))[0] == 200
    streaming = asyncio.create_task(pd(servers, "A", "D", decoding, 24))
    await asyncio.sleep(0.3)  # decoding on D, a token every 40 ms or more
    assert (await post(servers["session"], url(servers["B"]) + "/faults", {**slow, "ms": 1500}))[0] == 200
    handed = asyncio.create_task(pd(servers, "B", "D", waiting, 24))
    await asyncio.sleep(0.3)  # its KV is being computed on B
    switched = await switch(servers, "D", "prefill")
    answer, status = await handed
    assert (status, answer["error"]["code"], answer["error"]["message"]) == (
        503, "role_switching", "this server is switching its role to prefill: send the request to another server")
    assert await streaming == (expected, 200)
    assert (switched[0], switched[1]["disaggregation_mode"]) == (200, "prefill")
    for name in ("B", "D"):
        assert (await post(servers["session"], url(servers[name]) + "/faults", {**slow, "ms": 0}))[0] == 200
    assert (await switch(servers, "D", "decode"))[0] == 200
    assert await pd(servers, "B", "D", waiting) == (await reference(servers, unified_url, waiting), 200)
    assert await settled(servers) == {"A": [NUM_BLOCKS] * 2, "B": [NUM_BLOCKS], "D": [NUM_BLOCKS]}


async def test_what_a_switch_refuses(servers):
    status, answer = await switch(servers, "B", "prefill")  # already one: nothing happens
    assert (status, answer["switched"], answer["pd_role_epoch"]) == (200, False, 0)
    status, answer = await switch(servers, "B", "unified")
    assert (status, answer["error"]["message"], answer["error"]["param"]) == (
        400, "new_role must be prefill or decode, got 'unified'", "new_role")
    status, answer = await post(servers["session"], url(servers["B"]) + "/pd_role_switch", {"role": "decode"})
    assert status == 400
    plain = await start("decode", 1, switch=False)
    try:
        status, answer = await post(servers["session"], url(plain) + "/pd_role_switch", {"new_role": "prefill"})
        assert (status, answer["error"]["message"]) == (400, "this server runs without --enable-pd-role-switch")
    finally:
        await plain.close()


async def routed(servers, router_url: str, prompt: list[int], max_tokens: int = 24,
                 request_id: str | None = None) -> tuple[int, object]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, **GREEDY}}
    headers = None if request_id is None else {"X-Request-Id": request_id}  # our router sends it on to both legs
    status, answer = await post(servers["session"], router_url + "/generate", body, headers)
    return status, answer.get("output_ids") if status == 200 else answer


async def roles_seen(servers, router_url: str) -> dict[str, tuple]:
    """What our router's /workers says of each server: (its role there, its role epoch), admitting ones."""
    async with servers["session"].get(router_url + "/workers") as r:
        listing = await r.json()
    names = {url(servers[n]): n for n in ("A", "B", "D")}
    return {names[w["url"]]: (role, w.get("pd_role_epoch")) for role in ("prefill", "decode")
            for w in listing[role] if not w.get("draining")}


async def followed(servers, router_url: str, expected: dict, limit_s: float = 2.0) -> float:
    """Seconds until our router's /workers reads `expected` (fails past `limit_s`)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while (seen := await roles_seen(servers, router_url)) != expected:
        assert loop.time() - start < limit_s, f"the router still sees {seen} after {limit_s} s"
        await asyncio.sleep(0.05)
    return loop.time() - start


async def test_our_router_follows_a_prefill_that_becomes_a_decode_and_back(servers, unified_url):
    from disagg.router.config import PrefillEndpoint, RouterConfig
    from disagg.router.server import RouterServer

    a, b, d = servers["A"], servers["B"], servers["D"]
    router = RouterServer(RouterConfig(
        port=0, health_check_interval_s=5.0, decode=(url(d),),
        prefill=(PrefillEndpoint(url(a), a.bootstrap_port), PrefillEndpoint(url(b), b.bootstrap_port))))
    await router.start()
    slow = {"fault": "slow_steps", "dp_rank": 0}
    try:
        epochs = {n: (await info(servers, n))["pd_role_epoch"] for n in ("A", "B", "D")}
        await followed(servers, router.url, {"A": ("prefill", epochs["A"]), "B": ("prefill", epochs["B"]),
                                             "D": ("decode", epochs["D"])})
        prompts = [prompt_of(f"routed-{i}") for i in range(48)]
        expected = [(200, await reference(servers, unified_url, p, 24)) for p in prompts]
        for new_role, batch in (("decode", prompts[:16]), ("prefill", prompts[32:48])):
            await post(servers["session"], url(d) + "/faults", {**slow, "ms": 30})  # 16 stay in flight a while
            flights = [asyncio.create_task(routed(servers, router.url, p)) for p in batch]
            await asyncio.sleep(0.2)
            status, answer = await switch(servers, "B", new_role)
            assert (status, answer["disaggregation_mode"]) == (200, new_role)
            epochs["B"] = answer["pd_role_epoch"]
            await post(servers["session"], url(d) + "/faults", {**slow, "ms": 0})
            took_s = await followed(servers, router.url, {"A": ("prefill", epochs["A"]), "B": (new_role, epochs["B"]),
                                                          "D": ("decode", epochs["D"])})
            assert took_s < 2.0
            assert [await f for f in flights] == [expected[prompts.index(p)] for p in batch]
            if new_role == "decode":  # 16 more while B decodes: the router sends it decode legs
                after = await asyncio.gather(*(routed(servers, router.url, p) for p in prompts[16:32]))
                assert list(after) == expected[16:32]
        assert await settled(servers) == {"A": [NUM_BLOCKS] * 2, "B": [NUM_BLOCKS], "D": [NUM_BLOCKS]}
    finally:
        await router.close()


async def test_a_soak_of_30_switches_under_load_through_our_router(servers, unified_url):
    """B switches 30 times (decode, prefill, ...) while four clients send requests through our router
    without pause: every answer is unified's, none is lost, every block is free afterwards."""
    from disagg.router.config import PrefillEndpoint, RouterConfig
    from disagg.router.server import RouterServer

    a, b, d = servers["A"], servers["B"], servers["D"]
    router = RouterServer(RouterConfig(
        port=0, health_check_interval_s=5.0, decode=(url(d),),
        prefill=(PrefillEndpoint(url(a), a.bootstrap_port), PrefillEndpoint(url(b), b.bootstrap_port))))
    await router.start()
    prompts = [prompt_of(f"soak-{i}") for i in range(8)]
    expected = [(200, await reference(servers, unified_url, p, 16)) for p in prompts]
    answers: list[tuple[int, tuple, tuple]] = []
    stop = asyncio.Event()

    async def client(seed: int) -> None:  # each request with an id of its own, as a client that traces sends
        rng = random.Random(seed)
        for n in itertools.count():
            if stop.is_set():
                return
            i = rng.randrange(len(prompts))
            answers.append((i, await routed(servers, router.url, prompts[i], 16, request_id=f"soak-{seed}-{n}")))

    try:
        clients = [asyncio.create_task(client(seed)) for seed in range(4)]
        for n in range(30):
            new_role = "decode" if (await info(servers, "B"))["disaggregation_mode"] == "prefill" else "prefill"
            status, answer = await switch(servers, "B", new_role)
            assert (status, answer["switched"]) == (200, True), answer
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*clients)
        assert (await info(servers, "B"))["disaggregation_mode"] == "prefill"  # an even number of switches
        assert len(answers) >= 30
        assert [(i, answer) for i, answer in answers if answer != expected[i]] == []
        assert await settled(servers) == {"A": [NUM_BLOCKS] * 2, "B": [NUM_BLOCKS], "D": [NUM_BLOCKS]}
    finally:
        stop.set()
        await router.close()


async def test_the_planner_moves_an_idle_prefill_to_a_decode_over_its_itl_objective(servers, unified_url):
    """`--planner auto` on real servers: an ITL objective of 10 us that every real decode step misses (0.5 ms
    did not: the tiny model's step takes less on an AVX-512 core), prefills that idle; the planner switches
    one prefill to decode, the router follows, answers stay right."""
    from disagg.router.config import PlannerConfig, PrefillEndpoint, RouterConfig
    from disagg.router.server import RouterServer

    a, b, d = servers["A"], servers["B"], servers["D"]
    router = RouterServer(RouterConfig(
        port=0, health_check_interval_s=5.0, decode=(url(d),),
        prefill=(PrefillEndpoint(url(a), a.bootstrap_port), PrefillEndpoint(url(b), b.bootstrap_port)),
        planning=PlannerConfig(planner="auto", planner_interval_s=0.5, itl_slo_ms=0.01)))
    prompts = [prompt_of(f"planned-{i}") for i in range(4)]
    expected = [(200, await reference(servers, unified_url, p, 16)) for p in prompts]
    await router.start()
    try:
        answers = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while (await info(servers, "A"))["disaggregation_mode"] == "prefill" and \
                (await info(servers, "B"))["disaggregation_mode"] == "prefill":
            assert loop.time() < deadline, "the planner switched nothing in 20 s"
            answers += await asyncio.gather(*(routed(servers, router.url, p, 16) for p in prompts))
        assert answers == expected * (len(answers) // len(prompts))
        moved = "A" if (await info(servers, "A"))["disaggregation_mode"] == "decode" else "B"
        async with servers["session"].get(router.url + "/metrics") as r:
            metrics = await r.text()
        assert 'disagg_planner_decisions_total{action="prefill_to_decode",confirmed="true"} 1.0' in metrics
        after = await asyncio.gather(*(routed(servers, router.url, p, 16) for p in prompts))
        assert list(after) == expected
    finally:
        await router.close()
    status, _ = await switch(servers, moved, "prefill")  # as the other tests found it
    assert status == 200
    assert await settled(servers) == {"A": [NUM_BLOCKS] * 2, "B": [NUM_BLOCKS], "D": [NUM_BLOCKS]}
