"""Qwen3-architecture decoder of the reference engine, running ragged batches over a KV pool.

Usage (one request, full prefill of `n` tokens into pool slots `0..n-1`)::

    config = BUILTIN_ENGINE_CONFIGS["tiny"]
    model = Qwen3Decoder(config, random_weights(config, seed=0), attention="naive")
    pool = KVPool(config, capacity=4096)
    batch = EngineBatch.build(tokens, req_to_token, segments)   # or EngineBatch.single_segment
    logits = model.forward(batch, pool)                          # [T, vocab]

The batch format is described in `EngineBatch`. Per layer the decoder computes q, k, v of every
token, applies the q/k RMSNorm and RoPE at the tokens' ABSOLUTE positions, stores k and v into
the pool at the tokens' slots, and only then attends through `req_to_token`. A query therefore
sees every key of its request up to its own position, whether it was cached before the batch or
written by another segment of the same batch in the same layer (a phantom's hole refill).

Deterministic mode computes every token-wise operation (norms, linear layers, RoPE, MLP, LM
head) in fixed-size row chunks, so a token's result does not depend on which other tokens share
the batch. With `row_chunk=1` (the default) every matmul is a one-row product of the same shape
whatever the batch; larger chunks are faster and were batch-invariant in the tests on CPU, but
only one row per product is shape-independent by construction. Together with a batch-invariant
attention (both named backends tile queries at absolute positions) a phantom batch reproduces a
full prefill bitwise.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from penelope.engine.attention import AttentionBackend, get_attention_backend, to_device
from penelope.engine.decoder_config import EngineModelConfig
from penelope.engine.kvpool import KVPool
from penelope.engine.weights import LayerWeights, ModelWeights
from penelope.errors import UsageError


@dataclass(frozen=True)
class EngineBatch:
    """One prefill launch: flattened query tokens described by ragged segments.

    - `tokens` int64 `[T]`: the query tokens of every request of the batch, flattened.
    - `segments` int32 `[N, 4]`, rows `(req_row, q_start, pos_start, length)`: tokens
      `q_start .. q_start+length-1` are the absolute positions `pos_start .. pos_start+length-1`
      of request `req_row`. A request may have several segments (phantom holes and its new
      tokens), in any order; every token belongs to exactly one segment.
    - `req_to_token` int32 `[R, max_len]`: pool slot of (request row, absolute position) for
      every position a query attends to, cached ones as well as the batch's own.
    - `positions` int64 `[T]` and `slots` int64 `[T]`: each token's absolute position and the
      pool slot its K/V is stored in, derived from the above by `build`.

    Build it with `EngineBatch.build` or `EngineBatch.single_segment`, which validate it.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    req_to_token: torch.Tensor
    segments: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def build(cls, tokens, req_to_token: torch.Tensor, segments) -> EngineBatch:
        """Check a batch and derive its positions and slots.

        `tokens`: ints `[T]`, T >= 1; `req_to_token`: int32 `[R, max_len]`; `segments`: ints
        `[N, 4]` (stored as int32; empty segments allowed). Raises `UsageError` when a token
        belongs to no segment or to two, when a request's segments repeat a position, when a
        segment leaves `req_to_token`, when a slot is negative, or when two tokens share a slot.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device="cpu").reshape(-1)
        segments = torch.as_tensor(segments, dtype=torch.int32, device="cpu").reshape(-1, 4)
        if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2:
            raise UsageError(
                f"req_to_token must be int32 [R, max_len], got {req_to_token.dtype} {tuple(req_to_token.shape)}"
            )
        num_tokens = tokens.shape[0]
        if num_tokens == 0:
            raise UsageError("a batch needs at least one token")
        table = req_to_token.to("cpu")
        num_rows, max_len = table.shape
        positions = torch.full((num_tokens,), -1, dtype=torch.int64)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64)
        covered: dict[int, list[tuple[int, int]]] = {}
        for req_row, q_start, pos_start, length in segments.tolist():
            segment = (req_row, q_start, pos_start, length)
            if min(q_start, pos_start, length) < 0:
                raise UsageError(f"segment {segment} has a negative field")
            if not 0 <= req_row < num_rows:
                raise UsageError(f"segment {segment}: request row outside req_to_token's {num_rows} rows")
            if q_start + length > num_tokens:
                raise UsageError(f"segment {segment}: rows beyond the batch's {num_tokens} tokens")
            if pos_start + length > max_len:
                raise UsageError(f"segment {segment}: positions beyond req_to_token's width {max_len}")
            if length == 0:
                continue
            rows = slice(q_start, q_start + length)
            if (positions[rows] >= 0).any():
                raise UsageError(f"segment {segment}: rows already belong to another segment")
            for start, end in covered.get(req_row, []):
                if pos_start < end and start < pos_start + length:
                    raise UsageError(f"segment {segment}: positions already in another segment of the request")
            covered.setdefault(req_row, []).append((pos_start, pos_start + length))
            positions[rows] = torch.arange(pos_start, pos_start + length)
            slots[rows] = table[req_row, pos_start : pos_start + length].to(torch.int64)
            if (slots[rows] < 0).any():
                raise UsageError(f"segment {segment}: req_to_token has a negative slot for a batch token")
        if (positions < 0).any():
            raise UsageError(f"batch row {int((positions < 0).nonzero()[0])} belongs to no segment")
        if torch.unique(slots).numel() != num_tokens:
            raise UsageError("two tokens of the batch would be stored in the same pool slot")
        return cls(tokens, positions, slots, req_to_token, segments)

    @classmethod
    def single_segment(cls, tokens, slots, pos_start: int = 0) -> EngineBatch:
        """One request whose `tokens` `[T]` are its positions `pos_start .. pos_start+T-1`.

        `slots` `[pos_start+T]`: the pool slots of positions `0 ..`, the cached prefix (already
        in the pool) first, then the slots the new tokens' K/V go to.
        """
        table = torch.as_tensor(slots, dtype=torch.int32).reshape(1, -1)
        num_tokens = torch.as_tensor(tokens).numel()
        return cls.build(tokens, table, [[0, 0, pos_start, num_tokens]])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back before the weight (as HF)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` fp32: theta ** (-2i / head_dim)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, H, D]` by the angles `positions[t] * inv_freq[i]` (absolute positions,
    int64 `[T]`), pairing dim i with dim i + D/2 (the "rotate half" convention of Qwen3)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Qwen3Decoder:
    """Qwen3 decoder (embeddings, RMSNorm, q/k norm, RoPE, GQA, SwiGLU, tied or untied head).

    `attention`: "naive", "triton" or an `AttentionBackend`. `deterministic`: compute token-wise
    work in chunks of `row_chunk` rows (the last chunk zero-padded), so results do not depend on
    the batch's composition. Inference only: no autograd.
    """

    def __init__(
        self,
        config: EngineModelConfig,
        weights: ModelWeights,
        attention: str | AttentionBackend = "naive",
        deterministic: bool = False,
        row_chunk: int = 1,
    ) -> None:
        if len(weights.layers) != config.num_layers or tuple(weights.embed.shape) != (
            config.vocab_size,
            config.hidden_size,
        ):
            raise UsageError(f"weights do not match engine config {config.name!r}")
        if row_chunk < 1:
            raise UsageError(f"row_chunk must be >= 1, got {row_chunk}")
        self.config = config
        self.weights = weights
        self.attention = get_attention_backend(attention)
        self.deterministic = deterministic
        self.row_chunk = row_chunk
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta).to(weights.device)
        self.sm_scale = config.head_dim**-0.5

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @torch.inference_mode()
    def forward(self, batch: EngineBatch, pool: KVPool, logits_rows=None,
                layer_ready: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run `batch`, store its K/V into `pool`, return logits `[n, vocab]` of `logits_rows`
        (indices into the batch's `[T]` tokens; all rows when None) in the model's dtype.
        `layer_ready(l)` is called before layer l touches the pool (e.g. `SwapHandle.wait_layer`:
        layer l's KV copies must be done, later layers' may still run)."""
        hidden = self.hidden_states(batch, pool, layer_ready)
        if logits_rows is not None:
            hidden = hidden[torch.as_tensor(logits_rows, dtype=torch.int64, device=hidden.device)]
        return self.logits(hidden)

    __call__ = forward

    @torch.inference_mode()
    def hidden_states(self, batch: EngineBatch, pool: KVPool,
                      layer_ready: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run `batch` through every layer, writing its K/V into `pool` at `batch.slots`;
        return the final-normed hidden states `[T, hidden]`. `layer_ready`: as in `forward`."""
        self._check(batch, pool)
        device = self.device
        # Host -> device uploads that never wait for the GPU; segments stay on the host, where the
        # backend's plan reads them.
        positions = to_device(batch.positions, device)
        req_to_token = to_device(batch.req_to_token, device)
        segments = batch.segments
        cfg = self.config
        # The backend's per-batch work (checks of slots and segments, query tiles) runs once, not
        # per layer, and no layer reads anything back from the GPU.
        slots, store_kwargs = self.attention.store_args(batch.slots, pool.capacity, device)
        attend_kwargs = self.attention.attend_kwargs(
            req_to_token, segments, num_tokens=batch.num_tokens, num_slots=pool.capacity,
            num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=self.dtype,
        )

        hidden = self.weights.embed[to_device(batch.tokens, device)]
        for index, lw in enumerate(self.weights.layers):
            q, k, v = self._rowwise(lambda h, p, lw=lw: self._qkv(lw, h, p), hidden, positions)
            k_buffer, v_buffer = pool.layer(index)
            if layer_ready is not None:
                layer_ready(index)
            # Store first: a query may read keys written by another segment of this batch.
            self.attention.store_kv(k_buffer, v_buffer, slots, k, v, **store_kwargs)
            attn = self.attention.attend(
                q, k_buffer, v_buffer, req_to_token, segments, sm_scale=self.sm_scale, **attend_kwargs
            ).reshape(-1, cfg.q_size)
            (hidden,) = self._rowwise(lambda h, a, lw=lw: (self._mlp_block(lw, h, a),), hidden, attn)
        (hidden,) = self._rowwise(
            lambda h: (rms_norm(h, self.weights.final_norm, cfg.rms_norm_eps),), hidden
        )
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: hidden `[n, hidden]` (final-normed) -> logits `[n, vocab]`."""
        (out,) = self._rowwise(lambda h: (F.linear(h, self.weights.lm_head),), hidden)
        return out

    def _qkv(self, lw: LayerWeights, hidden: torch.Tensor, positions: torch.Tensor):
        """Token-wise part before attention: hidden `[r, H]` -> q `[r, Hq, D]`, k and v `[r, Hkv, D]`."""
        cfg = self.config
        rows = hidden.shape[0]
        x = rms_norm(hidden, lw.input_norm, cfg.rms_norm_eps)
        q = F.linear(x, lw.q_proj, lw.q_bias).view(rows, cfg.num_q_heads, cfg.head_dim)
        k = F.linear(x, lw.k_proj, lw.k_bias).view(rows, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, lw.v_proj, lw.v_bias).view(rows, cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, lw.q_norm, cfg.rms_norm_eps), positions, self.inv_freq)
        k = apply_rope(rms_norm(k, lw.k_norm, cfg.rms_norm_eps), positions, self.inv_freq)
        return q, k, v

    def _mlp_block(self, lw: LayerWeights, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Token-wise part after attention: o_proj + residual, then the SwiGLU MLP + residual."""
        hidden = hidden + F.linear(attn, lw.o_proj, lw.o_bias)
        x = rms_norm(hidden, lw.post_attention_norm, self.config.rms_norm_eps)
        return hidden + F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj)

    def _rowwise(self, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor):
        """Apply the token-wise `fn` to all rows at once, or, in deterministic mode, to chunks of
        exactly `row_chunk` rows so every kernel sees the same shape whatever the batch."""
        if not self.deterministic:
            return fn(*inputs)
        size = self.row_chunk
        num_rows = inputs[0].shape[0]
        pieces = []
        for start in range(0, num_rows, size):
            chunk = [t[start : start + size] for t in inputs]
            pad = size - chunk[0].shape[0]
            if pad:
                chunk = [torch.cat((t, t.new_zeros((pad, *t.shape[1:])))) for t in chunk]
            out = fn(*chunk)
            pieces.append([o[: size - pad] for o in out])
        return tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))

    def _check(self, batch: EngineBatch, pool: KVPool) -> None:
        cfg = self.config
        pool_cfg = pool.config
        if (pool_cfg.num_layers, pool_cfg.num_kv_heads, pool_cfg.head_dim) != (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise UsageError(f"KV pool shape does not fit engine config {cfg.name!r}")
        if pool.dtype != self.dtype or pool.device != self.device:
            raise UsageError(
                f"KV pool is {pool.dtype} on {pool.device}, the model {self.dtype} on {self.device}"
            )
        # Every position a query attends to (0 .. its own) must map to a slot of this pool.
        table = batch.req_to_token.to("cpu")
        for req_row, _, pos_start, length in batch.segments.tolist():
            attended = table[req_row, : pos_start + length]
            if length and (int(attended.min()) < 0 or int(attended.max()) >= pool.capacity):
                raise UsageError(
                    f"request row {req_row}: req_to_token[:{pos_start + length}] has slots outside "
                    f"[0, {pool.capacity}) (a missing slot in the cached prefix?)"
                )
        if int(batch.tokens.min()) < 0 or int(batch.tokens.max()) >= cfg.vocab_size:
            raise UsageError(f"token ids must be in [0, {cfg.vocab_size})")
