"""The router's two legs of a P/D request (disagg/router/legs.py): the first failure is raised and cancels the
other, except a prefill its decode gave up (`aborted_by_decode`), whose decode's own answer is waited for."""

import asyncio

import msgspec
import pytest

from disagg.router.errors import ServerDraining, ServerError
from disagg.router.legs import await_unless_other_fails, both_or_first_error, for_its_decode
from disagg.types import ErrorCode

pytestmark = pytest.mark.asyncio


def error(role: str, status: int, code: str | None) -> ServerError:
    raw = msgspec.json.encode({"error": {"message": "m", "type": "t", "param": None, "code": code}})
    if status == 503 and code == "role_switching":
        return ServerDraining(role, 0, "http://d", raw, "application/json", ErrorCode.ROLE_SWITCHING)
    return ServerError(role, "http://p", status, raw, "application/json")


async def after(delay_s: float, result=None, exc: BaseException | None = None):
    await asyncio.sleep(delay_s)
    if exc is not None:
        raise exc
    return result


async def test_a_prefill_its_decode_gave_up_waits_for_the_decodes_answer():
    given_up, switching = error("prefill", 500, "aborted_by_decode"), error("decode", 503, "role_switching")
    assert for_its_decode(given_up) and not for_its_decode(error("prefill", 500, None))
    assert not for_its_decode(error("decode", 500, "aborted_by_decode"))
    legs = asyncio.create_task(after(0.0, exc=given_up)), asyncio.create_task(after(0.05, exc=switching))
    with pytest.raises(ServerDraining) as caught:
        await both_or_first_error(*legs)
    assert caught.value is switching
    decode, prefill = asyncio.create_task(after(0.05, exc=switching)), asyncio.create_task(after(0.0, exc=given_up))
    with pytest.raises(ServerDraining):
        await await_unless_other_fails(decode, prefill)


async def test_any_other_prefill_failure_is_raised_at_once_and_cancels_the_decode():
    failed = error("prefill", 500, None)
    decode = asyncio.create_task(after(5.0, result="late"))
    with pytest.raises(ServerError) as caught:
        await both_or_first_error(asyncio.create_task(after(0.0, exc=failed)), decode)
    assert caught.value is failed and decode.cancelled()


async def test_a_decode_that_answered_anyway_leaves_the_prefills_error():
    given_up = error("prefill", 500, "aborted_by_decode")
    with pytest.raises(ServerError) as caught:
        await both_or_first_error(asyncio.create_task(after(0.0, exc=given_up)),
                                  asyncio.create_task(after(0.02, result="answer")))
    assert caught.value is given_up
