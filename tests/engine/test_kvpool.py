"""Reference engine KV pool (`penelope.engine.kvpool`): layout, size in bytes and capacity checks,
together with the selection of attention backends by name and the decoder's constructor checks."""
import pytest
from engine_helpers import REFERENCE, TINY, UNTIED

from penelope.engine.attention import get_attention_backend
from penelope.engine.decoder import Qwen3Decoder
from penelope.engine.kvpool import KVPool
from penelope.engine.weights import random_weights
from penelope.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_pool_and_backend_selection():
    pool = KVPool(UNTIED, 100)
    assert pool.k_buffers[1].shape == (100, UNTIED.num_kv_heads, UNTIED.head_dim)
    assert pool.bytes_per_token() == 2 * UNTIED.num_layers * UNTIED.num_kv_heads * UNTIED.head_dim * 4
    for bad in (0, -5, 2.5, True):
        with pytest.raises(UsageError, match="capacity"):
            KVPool(UNTIED, bad)
    with pytest.raises(UsageError, match="naive"):
        get_attention_backend("flash")
    assert get_attention_backend("naive").name == "naive" and get_attention_backend("triton").name == "triton"
    assert get_attention_backend(REFERENCE) is REFERENCE
    with pytest.raises(UsageError, match="row_chunk"):
        Qwen3Decoder(TINY, random_weights(TINY), row_chunk=0)
    with pytest.raises(UsageError, match="do not match"):
        Qwen3Decoder(TINY, random_weights(UNTIED))
