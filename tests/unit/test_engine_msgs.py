"""The worker <-> front-door messages on the wire: states cross as Enums, encoded by their values."""

import msgspec
import pytest

from disagg.types import FinishReason
from disagg.wire.engine_msgs import OutputMsg, decode_from_worker, encode


@pytest.mark.parametrize("reason", list(FinishReason))
def test_a_finish_reason_crosses_as_its_value_and_comes_back_a_member(reason):
    data = encode(OutputMsg("r1", new_token_ids=[5], finish_reason=reason))
    assert data == (b"\xde\x00\x04\xa4type\xa6output\xaarequest_id\xa2r1\xadnew_token_ids\x91\x05"
                    b"\xadfinish_reason" + bytes([0xA0 + len(reason.value)]) + reason.value.encode())
    assert decode_from_worker(data).finish_reason is reason


def test_a_finish_reason_outside_the_enum_is_refused():
    data = encode(OutputMsg("r1", finish_reason=FinishReason.LENGTH)).replace(b"length", b"lenxth")
    with pytest.raises(msgspec.ValidationError, match=r"^Invalid enum value 'lenxth' - at `\$.finish_reason`$"):
        decode_from_worker(data)
