"""The start-up check of ``--radix-cache-backend penelope``: what the scheduler processes would
only trip over once the weights are loaded, refused in the launching process with one line.

SGLang 0.5.23 resolves its arguments (``ServerArgs.resolve_once``, before ``check_server_args``)
into declarations laid over the raw record: a backend's page size, a radix cache that a model or a
feature turns off. The raw fields keep what the user typed (``page_size`` stays None where the
backend picks 64), so every value here is read through SGLang's ``resolving_view``. The model is
SGLang's own ``ModelConfig`` (``model_config_of``: the checkpoint's config.json, or the hub's, read
before any weights load, memoized on the record), so a hub id is checked like a local folder.

Two options are read raw on purpose: ``hicache_size`` and ``hicache_ratio`` size Penelope's CPU
tier only when the user gave them (resolution defaults the ratio to 2.0 for SGLang's HiCache).
"""
from __future__ import annotations

import logging
import os

from penelope.cache.host_tier import MAX_HOST_SLOTS
from penelope.errors import UsageError

from .backends import phantoms_allowed, prefill_backend
from .host_tier import check_fits
from .options import BACKEND_NAME, PenelopeOptions, options_from

logger = logging.getLogger(__name__)
_GB = 1 << 30
# Bytes per element of SGLang's --kv-cache-dtype values ("auto": the model's dtype).
_KV_ELEMENT_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "mxfp8": 1, "bf16": 2, "bfloat16": 2}


def check_server_args(server_args) -> None:
    """Raise UsageError (one line) for a Penelope configuration the scheduler process would only
    trip over later: options from ``--radix-eviction-policy-config`` and the environment, features
    and models the backend does not support, a block that does not hold whole pages, a CPU tier
    the node's memory cannot hold."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    if cfg.radix_cache_backend != BACKEND_NAME:
        return
    options = options_from(cfg.radix_eviction_policy_config)
    for flag, on in (("--enable-hierarchical-cache", cfg.enable_hierarchical_cache),
                     ("--disable-radix-cache", cfg.disable_radix_cache),
                     ("speculative decoding", cfg.speculative_algorithm is not None),
                     ("--enable-streaming-session", getattr(cfg, "enable_streaming_session", False)),
                     ("--enable-session-radix-cache", getattr(cfg, "enable_session_radix_cache", False)),
                     ("pipeline parallelism", (getattr(cfg, "pp_size", 1) or 1) > 1),
                     ("PD disaggregation", getattr(cfg, "disaggregation_mode", "null") not in (None, "null"))):
        if on:
            raise UsageError(f"penelope: --radix-cache-backend penelope does not support {flag}")
    policy = getattr(cfg, "radix_eviction_policy", "lru")
    if policy not in (None, "lru"):
        raise UsageError(f"penelope: --radix-eviction-policy {policy} applies to SGLang's own radix cache; choose "
                         "Penelope's policy with --radix-eviction-policy-config '{\"policy\": ...}'")
    model = served_model_config(server_args)
    if model is not None and (kind := unsupported_model(model)) is not None:
        raise UsageError(f"penelope: --radix-cache-backend penelope does not support {kind}")
    page = cfg.page_size or 1
    block = options.resolved_block_size(page)
    pool = getattr(cfg, "max_total_tokens", None)
    if pool and block > pool:
        raise UsageError(f"penelope: block_size {block} is larger than the KV pool (--max-total-tokens {pool})")
    if options.phantoms and options.refill == "phantoms":
        # The backend SGLang resolved (the one named, or its default for this machine); the
        # scheduler checks again with the one its model runner built (create_penelope_cache).
        backend = prefill_backend(server_args=cfg)
        if backend is not None:
            phantoms_allowed(options.refill, backend)
    check_host_memory(options, block, server_args, cfg, model)


def served_model_config(server_args):
    """SGLang's ModelConfig of the served model (None for ``--model-path dummy``)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view

    if str(resolving_view(server_args).model_path).lower() in ("none", "dummy"):
        return None
    return model_config_of(server_args)


def unsupported_model(model_config) -> str | None:
    """What makes the model unservable by Penelope's cache (the same tests SGLang's cache factory
    makes: sliding-window layers with their own pool, recurrent state, DSA), or None."""
    from sglang.srt.configs.model_config import is_deepseek_dsa
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

    if model_config.is_hybrid_swa:
        return "a hybrid sliding-window model"
    if uses_ssm_state(model_config):
        return "a model with mamba state"
    if is_deepseek_dsa(model_config.hf_config):
        return "a DSA model"
    return None


def kv_bytes_per_token(model_config, kv_cache_dtype: str, attention_tp: int) -> int | None:
    """K and V bytes per token of one rank's KV pool, as SGLang sizes it (heads per attention-TP
    rank, every layer); None for a KV dtype whose size is not a whole byte per element."""
    if kv_cache_dtype == "auto":
        element = model_config.dtype.itemsize
    elif kv_cache_dtype in _KV_ELEMENT_BYTES:
        element = _KV_ELEMENT_BYTES[kv_cache_dtype]
    else:
        return None
    layers = getattr(model_config, "num_attention_layers", None) or model_config.num_hidden_layers
    head_dim = model_config.head_dim
    v_head_dim = getattr(model_config, "v_head_dim", None) or head_dim
    return layers * model_config.get_num_kv_heads(attention_tp) * (head_dim + v_head_dim) * element


def device_type(cfg) -> str:
    """The device SGLang serves on ("cuda", "cpu", ...); None resolves to CUDA."""
    return str(getattr(cfg, "device", None) or "cuda")


def local_ranks(cfg) -> int:
    """Scheduler processes on this node, each with a CPU tier of its own: TP x PP ranks of every
    data-parallel replica, over the nodes."""
    ranks = (cfg.tp_size or 1) * (cfg.pp_size or 1) * (cfg.dp_size or 1)
    return max(ranks // max(cfg.nnodes or 1, 1), 1)


def check_host_memory(options: PenelopeOptions, block: int, server_args, cfg, model) -> None:
    """The CPU tiers of every rank on this node (``cpu_cache`` tokens, or ``--hicache-size`` GB
    per rank) must fit the free host memory together. Sized from SGLang's ModelConfig; a tier set
    by ``--hicache-ratio`` depends on the device pool, which only the scheduler knows: it is
    checked there, per rank, when it is built, and here too when ``--max-total-tokens`` gives the
    pool. The swap-copy kernel (``copy`` ``triton``) is refused without a GPU."""
    from sglang.srt.runtime_context import attn_tp_size_of

    size_gb = server_args.hicache_size or 0
    ratio, pool = server_args.hicache_ratio, getattr(cfg, "max_total_tokens", None)
    # A tier sized by --hicache-ratio is known here only when the device pool is given.
    by_ratio = int(ratio * pool) if not options.cpu_cache and size_gb <= 0 and ratio and ratio > 0 and pool else 0
    if not options.cpu_cache and size_gb <= 0 and not by_ratio:
        return
    swap = max(options.swap_buffer, block)
    if by_ratio + swap >= MAX_HOST_SLOTS:
        raise UsageError(f"penelope: a CPU tier of {by_ratio:,} tokens (--hicache-ratio {ratio:g} x --max-total-tokens "
                         f"{pool:,}) plus the swap buffer is beyond the 2**31 slots the tree can address")
    if device_type(cfg) == "cpu" and options.copy == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError("penelope: copy 'triton' needs a GPU (the swap-copy kernel moves KV between the device "
                         "pool and pinned host memory); use 'auto' or 'naive' with --device cpu")
    ranks = local_ranks(cfg)
    per_token = None if model is None else kv_bytes_per_token(model, cfg.kv_cache_dtype, attn_tp_size_of(cfg))
    if per_token is None:
        if options.cpu_cache or by_ratio:
            return
        need, what = int(size_gb * _GB), f"{ranks} x {size_gb:g} GB"
    else:
        tokens = options.cpu_cache or by_ratio or int(size_gb * _GB // per_token)
        need = (tokens + swap) * per_token
        what = f"{ranks} rank{'s' if ranks > 1 else ''} x {tokens + swap:,} tokens x {per_token:,} bytes"
    check_fits(ranks * need, what)
