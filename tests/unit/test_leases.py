"""The prefill's lease table (pull flow): exact answers, expiry only when unclaimed."""

from prefill.leases import LeaseAnswer, LeaseTable


def test_claim_read_release():
    table = LeaseTable(lease_s=30)
    table.grant("r1", [4, 5, 6], now=100.0)
    assert table.claim("r1", "decode-a") == LeaseAnswer(True, block_ids=(4, 5, 6))
    assert table.claim("r1", "decode-a") == LeaseAnswer(True, block_ids=(4, 5, 6))  # a retry
    assert table.claim("r1", "decode-b") == LeaseAnswer(False, "the blocks of r1 are claimed by decode decode-a")
    assert table.expire(now=1000.0) == []  # claimed: the claimer's stream keeps it
    assert table.release("r1", "decode-b") == LeaseAnswer(False, "the blocks of r1 are claimed by decode decode-a")
    assert table.release("r1", "decode-a") == LeaseAnswer(True, ended=True)
    assert table.release("r1", "decode-a") == LeaseAnswer(
        False, "no blocks are leased for r1 (expired, released or never granted)")


def test_expiry_and_lost_decodes():
    table = LeaseTable(lease_s=30)
    table.grant("r1", [1], now=0.0)
    table.grant("r2", [2], now=10.0)
    table.grant("r3", [3], now=10.0)
    assert table.claim("r3", "decode-a").ok
    assert table.expire(now=30.5) == ["r1"]
    assert table.claim("r1", "decode-a") == LeaseAnswer(
        False, "no blocks are leased for r1 (expired, released or never granted)")
    assert table.drop_peer("decode-a") == ["r3"]
    assert table.release("r2", "decode-b") == LeaseAnswer(False, "r2 was released without a claim", ended=True)
    assert table.leases == {}
