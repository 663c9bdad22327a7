"""Which prefill and decode servers may pair (disagg/router/compat.py), and the weights fingerprint
behind the records (disagg/engine/loader.py)."""

import shutil

from disagg.engine.loader import weights_fingerprint
from disagg.engine_config import ModelConfig
from disagg.router.compat import compatible_pair, differences, incompatibility

RECORD = {"model": "m", "weights": "aa", "dtype": "float32", "kv_cache_dtype": "float32", "block_size": 16,
          "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "tp_size": 1, "transfer_backend": "nixl", "kv_protocol": 1}
BF16 = {**RECORD, "kv_cache_dtype": "bfloat16"}


def test_every_differing_field_is_named_and_the_tp_size_may_differ():
    assert differences(RECORD, {**RECORD, "tp_size": 2, "model": "other name"}) is None
    assert differences(RECORD, None) is None and differences(None, BF16) is None  # a server without a record
    assert differences(RECORD, {**BF16, "weights": "bb", "transfer_backend": "tcp"}) == (
        "weights 'aa' on the prefill, 'bb' on the decode; kv_cache_dtype 'float32' on the prefill, 'bfloat16' on "
        "the decode; transfer_backend 'nixl' on the prefill, 'tcp' on the decode")
    assert incompatibility("http://p", RECORD, "http://d", {**BF16, "model": "n"}) == (
        "prefill server http://p and decode server http://d cannot pair ('m' and 'n'): kv_cache_dtype 'float32' on "
        "the prefill, 'bfloat16' on the decode")


def test_a_compatible_pair_is_found_in_the_order_given_or_none():
    prefills, decodes = [(0, RECORD), (1, BF16)], [(5, BF16), (6, RECORD)]
    assert compatible_pair(0, 6, prefills, decodes) == (0, 6)  # the pick itself
    assert compatible_pair(0, 5, prefills, decodes) == (0, 6)  # a decode for the picked prefill
    assert compatible_pair(1, 6, [(1, BF16), (0, RECORD)], [(6, RECORD)]) == (0, 6)  # a prefill for the decode
    assert compatible_pair(1, 6, [(1, BF16), (2, {**BF16, "weights": "cc"})], [(6, RECORD), (7, BF16)]) == (1, 7)
    assert compatible_pair(0, 5, [(0, RECORD)], [(5, BF16)]) is None


def test_the_weights_fingerprint_changes_with_the_bytes_and_not_with_the_path(tmp_path):
    path = tmp_path / "model.gguf"
    data = bytearray(range(256)) * 4096  # 1 MiB
    path.write_bytes(bytes(data))
    first = weights_fingerprint(ModelConfig(model=str(path)))
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(path, copy / "model.gguf")
    assert weights_fingerprint(ModelConfig(model=str(copy / "model.gguf"))) == first
    data[0] ^= 1  # the first sample starts at byte 0
    path.write_bytes(bytes(data))
    assert weights_fingerprint(ModelConfig(model=str(path))) != first
    tiny = [weights_fingerprint(ModelConfig(model="tiny", seed=seed)) for seed in (0, 0, 1)]
    assert tiny[0] == tiny[1] != tiny[2] and len(tiny[0]) == 16
