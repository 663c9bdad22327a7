"""A decode reads a piece's tag (`room:R:start:end`) from any peer: malformed ones are other
notifications, never an exception in the worker's loop."""

from kvtransfer.checksum import piece_of, piece_tag


def test_a_pieces_tag_and_everything_else():
    assert piece_of(b"room:9223372036854775807:0:4") == (9223372036854775807, 0, 4)
    assert piece_of(b"room:42:3:5") == (42, 3, 5) == piece_of(piece_tag(42, 3, 5))
    for tag in (b"bench", b"room:42:3", b"room:42:3:5:6", b"rooms:42:3:5", b"room:-1:0:1", b"room:4x:0:1",
                b"room::0:1", b"room:" + b"9" * 5000 + b":0:1", b"room:1:" + b"9" * 21 + b":1", b"\xff:1:2:3"):
        assert piece_of(tag) is None, tag
