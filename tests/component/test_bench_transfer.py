"""`disagg bench transfer --checked`: the checksum timed as the product runs it, against a real peer
process over tcp. The peer digests each piece as it lands and a round fails unless its digest is
the sender's, so a run that finishes checked every round's bytes end to end."""

import json

import pytest

from disagg.bench.transfer import main

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("piece_kib", [None, 720, 0])
def test_checked_rounds_digest_alike_on_both_sides(tmp_path, piece_kib):
    """None: tcp's 2 MiB (2 blocks of SmolLM2's float32 KV, 720 KiB each); 720: one block a piece; 0: whole."""
    out = tmp_path / "transfer.json"
    argv = ["--backends", "tcp", "--dtypes", "float32", "--tokens", "128,1024", "--min-time-s", "0",
            "--latency-iters", "2", "--checked", "--out", str(out)]
    assert main(argv + ([] if piece_kib is None else ["--piece-kib", str(piece_kib)])) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["tokens"], r["size_bytes"], r["rounds"]) for r in rows] == [
        ("tcp", 128, 8 * 737280, 3), ("tcp", 1024, 64 * 737280, 3)]
    assert all(r["checked"] is True and isinstance(r["checked_cost"], float) and isinstance(r["pieces_cost"], float)
               for r in rows)


def test_a_round_whose_digests_differ_fails_the_run(monkeypatch):
    """The check above can fail: a sender digest one off from what the peer read stops the run."""
    from disagg.bench import transfer
    from kvtransfer.checksum import KVDigest

    class OneOff(KVDigest):
        def value(self) -> int:
            return super().value() ^ 1

    monkeypatch.setattr(transfer, "KVDigest", OneOff)
    with pytest.raises(RuntimeError, match=r"^the peer's digest [0-9a-f]{16} is not the sender's [0-9a-f]{16}$"):
        main(["--backends", "tcp", "--dtypes", "float32", "--tokens", "128", "--min-time-s", "0",
              "--latency-iters", "2", "--checked"])
