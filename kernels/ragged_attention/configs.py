"""Pinned tile configurations of the ragged attention kernel, one table per compile target.

There is no autotuning: a configuration tried at the first call of a serving process could differ
between processes or tensor-parallel ranks (timing noise picks the winner), and rounding depends on
the tiles, so the bitwise claims would not hold across processes. Instead the launcher looks the
configuration up here by (target, head_dim, group size), a pure function of the model's shape and
the GPU's architecture, and ``warm_up_ragged_attention`` compiles it when the plugin loads.

The tables were chosen from the compile report (``python -m penelope.kernels.compile_report
--candidates``): for each target the largest tiles that compile without a register spill, within the
target's shared memory, with tensor-core MMAs in both loops of the kernel. Configurations that the
report shows spilling are not in the tables (``microbench/README.md`` lists the figures). Speed on
a GPU was not measured when they were chosen (no GPU was available): the choice rests on
spill-free compilation and tile size, an estimate of speed, not a measurement.

Rows: the M dimension of the dots holds ``block_m`` query positions times ``group`` q heads,
``block_m = rows // group`` (so a group of 5 uses 125 of 128 rows, not 32 x 8 = 256 with 37.5%
padding as a power-of-two group would); ``rows`` is a power of two and at least the group size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INTERPRETER = "interpreter"
SM80, SM90A, SM100A = "sm_80", "sm_90a", "sm_100a"
TARGETS = (SM80, SM90A, SM100A)
# Compute capability (major * 10 + minor) each target is compiled for.
TARGET_ARCH = {SM80: 80, SM90A: 90, SM100A: 100}


class RaggedBlocks(NamedTuple):
    """Tile sizes of one launch: ``block_m`` positions x ``group`` heads in ``rows`` rows, against
    ``block_n`` keys, with ``num_warps`` warps and ``num_stages`` pipeline stages."""

    block_m: int
    block_n: int
    rows: int
    num_warps: int
    num_stages: int

    @property
    def label(self) -> str:
        """Short name for tables: ``r128 m25 n64 w8 s2``."""
        return f"r{self.rows} m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}"


class TileShape(NamedTuple):
    """A pinned entry: rows of the dots, keys per KV tile, warps, pipeline stages."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int


# (target, head_dim bucket) -> tile shape. Head dims are bucketed by their padded size (the kernel
# pads D to a power of two): 64 covers D <= 64, 128 covers 65..128, 256 covers 129..256.
PINNED: dict[tuple[str, int], TileShape] = {
    # The interpreter: small tiles keep tests fast and still give several tiles per segment.
    (INTERPRETER, 64): TileShape(64, 32, 4, 1),
    (INTERPRETER, 128): TileShape(64, 32, 4, 1),
    (INTERPRETER, 256): TileShape(64, 32, 4, 1),
    # Ampere and Ada (mma.sync, HMMA), 99 KB of shared memory on sm_86/sm_89. Candidates: 128 rows
    # x 64 keys spills at head_dim 128; 4 warps spill at 128 rows or 256 dims.
    (SM80, 64): TileShape(128, 64, 8, 2),
    (SM80, 128): TileShape(128, 32, 8, 2),
    (SM80, 256): TileShape(64, 32, 8, 2),
    # Hopper (wgmma, HGMMA; two warpgroups of 64 rows). 128 keys at head_dim 128 compiles without a
    # spill too but at 253 registers; 4 warps spill from 128 rows x 64 keys on.
    (SM90A, 64): TileShape(128, 64, 8, 2),
    (SM90A, 128): TileShape(128, 64, 8, 2),
    (SM90A, 256): TileShape(64, 64, 8, 2),
    # Blackwell datacenter (tcgen05, UTCHMMA): as Hopper; 128 x 64 with 4 warps spills here too.
    (SM100A, 64): TileShape(128, 64, 8, 2),
    (SM100A, 128): TileShape(128, 64, 8, 2),
    (SM100A, 256): TileShape(64, 64, 8, 2),
}

# fp32 inputs on a GPU (tests and references: exact fp32 dots, no tensor cores) need far smaller
# tiles: every 16-bit shape above spills with fp32 operands (the compile report's candidates). One
# shape for every target and head dim; a plan for fp32 inputs is made with dtype=torch.float32.
PINNED_FP32 = TileShape(32, 16, 8, 1)

HEAD_DIM_BUCKETS = (64, 128, 256)


def head_dim_bucket(head_dim: int) -> int:
    """The pinned table's head-dim bucket of ``head_dim``; ValueError above 256."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim {head_dim} is above the largest supported 256")


def target_of(device: torch.device | str) -> str:
    """The pinned table used on ``device``: ``interpreter`` for CPU tensors, else by architecture.

    Compute capability 9.x -> ``sm_90a``; 10.x -> ``sm_100a``; every other CUDA device (Ampere, Ada,
    consumer Blackwell 12.x, which has mma.sync and about 99 KB of shared memory) -> ``sm_80``.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return INTERPRETER
    if device.type != "cuda":
        raise ValueError(f"ragged attention runs on CUDA devices or, interpreted, on the CPU; got {device}")
    major, _ = torch.cuda.get_device_capability(device)
    return {9: SM90A, 10: SM100A}.get(major, SM80)


def ragged_attention_blocks(head_dim: int, group: int, target: str = SM90A,
                            dtype: torch.dtype | None = None) -> RaggedBlocks:
    """The pinned tile sizes for ``head_dim`` and ``group`` q heads per kv head on ``target``.

    ``target``: ``interpreter``, ``sm_80``, ``sm_90a`` or ``sm_100a`` (``target_of(device)``).
    Rows grow to the next power of two of ``group`` when the group is larger than the table's rows.
    ``dtype``: the inputs' dtype (None: 16-bit); fp32 on a GPU target uses ``PINNED_FP32``.
    """
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    key = (target, head_dim_bucket(head_dim))
    if key not in PINNED:
        raise ValueError(f"no pinned ragged-attention configuration for target {target!r}; "
                         f"targets: {INTERPRETER}, {', '.join(TARGETS)}")
    shape = PINNED[key]
    if dtype == torch.float32 and target != INTERPRETER:
        shape = PINNED_FP32
    rows = max(shape.rows, 1 << (group - 1).bit_length())
    return RaggedBlocks(rows // group, shape.block_n, rows, shape.num_warps, shape.num_stages)
