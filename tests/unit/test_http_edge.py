"""disagg.http_edge's pure parts: the JSON body decoder's limits and words, and the error body."""

import msgspec
import pytest

from disagg.http_edge import BadRequest, HttpError, decode_json, http_exception_error

DEEP = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


class Room(msgspec.Struct):
    room: int


def refusal(raw: bytes, kind=object, **words) -> tuple[int, str, str | None]:
    with pytest.raises(BadRequest) as info:
        decode_json(raw, kind, **{"malformed": "bad body", **words})
    return info.value.status, info.value.message, info.value.param


def test_each_limit_is_a_400_in_the_servers_own_words():
    assert decode_json(b'{"a": [1]}', malformed="bad body") == {"a": [1]}
    assert refusal(b"{") == (400, "bad body: Input data was truncated", None)
    assert refusal(DEEP) == (400, "bad body: it is nested too deeply", None)
    assert refusal(b'{"a": "\xff"}') == (400, "bad body: it is not valid UTF-8", None)


def test_a_wrong_shape_names_the_field_and_strict_false_takes_numbers_as_strings():
    assert refusal(b'{"room": "7"}', Room) == (400, "invalid request body: Expected `int`, got `str` - at `$.room`", "room")
    assert refusal(b"[]", Room, invalid="invalid PUT /route body") == (
        400, "invalid PUT /route body: Expected `object`, got `array`", None)
    assert decode_json(b'{"room": "7"}', Room, malformed="bad body", strict=False) == Room(7)


def test_errors_are_openai_shaped_and_aiohttp_errors_name_the_route():
    assert msgspec.json.decode(BadRequest("n must be 1", "n").body()) == {
        "error": {"message": "n must be 1", "type": "BadRequestError", "param": "n", "code": None}}
    assert HttpError(418, "teapot").error()["error"]["type"] == "APIError"
    err = http_exception_error(404, "404: Not Found", "GET", "/nope")
    assert (err.status, err.message, err.code) == (404, "Not Found: GET /nope", "route_not_found")
    err = http_exception_error(413, "Maximum request body size 64 exceeded.", "POST", "/generate")
    assert (err.status, err.message, err.error_type) == (
        413, "request body too large: Maximum request body size 64 exceeded.", "RequestTooLargeError")
