"""Token-indexed K/V pool of the reference engine (SGLang's per-layer layout).

Slot `s` of layer `l` holds the key `k_buffers[l][s]` and value `v_buffers[l][s]` of one token,
each `[Hkv, D]`. Which token lives in which slot is the cache manager's business (it hands out
slots and writes them into `req_to_token`); the pool only stores rows.

With a CPU tier (`penelope.cache.tiers.TwoTierCache`) the engine keeps a second pool of the same layout
in host memory (`host_mirror`: the CPU tier plus the swap buffer), and
`penelope.cache.swap_executor.SwapExecutor` copies rows between `buffers()` of the two.
"""
from __future__ import annotations

import torch

from penelope.engine.decoder_config import EngineModelConfig
from penelope.errors import UsageError


class KVPool:
    """K and V buffers `[capacity, Hkv, D]` for every layer of `config`.

    `capacity` is in tokens (the cache manager's capacity). Buffers start zeroed; nothing in
    the engine relies on that, and tests fill free slots with NaN to catch reads of rows that
    were never written.
    """

    def __init__(
        self,
        config: EngineModelConfig,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise UsageError(f"KV pool capacity must be a positive number of tokens, got {capacity!r}")
        self.config = config
        self.capacity = capacity
        shape = (capacity, config.num_kv_heads, config.head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
                          for _ in range(config.num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
                          for _ in range(config.num_layers)]

    def host_mirror(self, rows: int) -> KVPool:
        """A pool of `rows` token rows with this pool's layout and dtype in host memory, pinned
        when this pool is on a GPU (the swap-copy kernel reaches pinned memory only)."""
        return KVPool(self.config, rows, self.dtype, "cpu", pin_memory=self.device.type == "cuda")

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's K buffer, then every layer's V buffer (`2 * layers` tensors `[capacity,
        Hkv, D]`): the pool as `SwapExecutor` takes it. Two pools list their layers in the same
        order, so row s of list entry i means the same thing in both."""
        return [*self.k_buffers, *self.v_buffers]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_buffers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k_buffers[0].device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V buffers `[capacity, Hkv, D]` of layer `index`."""
        return self.k_buffers[index], self.v_buffers[index]

    def fill_(self, value: float, slots: torch.Tensor | None = None) -> None:
        """Set every row (or the rows of `slots`, int64 `[n]`) of every layer to `value`."""
        for buf in (*self.k_buffers, *self.v_buffers):
            if slots is None:
                buf.fill_(value)
            else:
                buf[slots] = value

    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers."""
        row = self.config.num_kv_heads * self.config.head_dim * self.k_buffers[0].element_size()
        return 2 * row * self.config.num_layers

    def nbytes(self) -> int:
        return self.bytes_per_token() * self.capacity
