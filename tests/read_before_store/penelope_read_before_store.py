"""Test-only SGLang plugin (on the Engine's PYTHONPATH with its dist-info beside it): registers
as ``flashinfer`` a variant of SGLang's ``torch_native`` backend that, like FlashInfer's ragged
prefill, reads each request's cached prefix from the pool BEFORE it stores the batch's K/V, and
attends to the request's own new tokens from the batch's K/V. A request whose prefix holds a hole
that another request of the same batch (a phantom) writes then reads the hole's stale rows.
"""
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention


class ReadBeforeStoreBackend(TorchNativeAttnBackend):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if layer.is_cross_attention or k is None or v is None or (layer.sliding_window_size or -1) > -1:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        pool = self.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        table = self.req_to_token_pool.req_to_token
        heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        queries, keys = q.view(-1, heads, dim), k.view(-1, kv_heads, dim)
        values = v.view(-1, kv_heads, layer.v_head_dim)
        # The paged pass: every request's cached prefix as the pool holds it now, before the store.
        prefixes, start = [], 0
        for row, prefix, length in zip(forward_batch.req_pool_indices.tolist(),
                                       forward_batch.extend_prefix_lens.tolist(),
                                       forward_batch.extend_seq_lens.tolist(), strict=True):
            slots = table[row, :prefix].long()
            prefixes.append((k_buffer[slots].clone(), v_buffer[slots].clone(), start, length))
            start += length
        if save_kv_cache:
            pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        out = q.new_empty((queries.shape[0], heads, layer.v_head_dim))
        for old_k, old_v, first, length in prefixes:
            own = slice(first, first + length)
            key = torch.cat([old_k, keys[own]]).movedim(0, 1)
            value = torch.cat([old_v, values[own]]).movedim(0, 1)
            prefix = old_k.shape[0]
            # Query t (absolute position prefix + t) sees keys 0 .. prefix + t.
            mask = torch.arange(prefix + length)[None, :] <= (prefix + torch.arange(length))[:, None]
            out[own] = scaled_dot_product_attention(queries[own].movedim(0, 1), key, value, attn_mask=mask,
                                                    scale=layer.scaling, enable_gqa=heads != kv_heads).movedim(0, 1)
        return out.view(q.shape[0], -1)


def register():
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend("flashinfer")(ReadBeforeStoreBackend)
