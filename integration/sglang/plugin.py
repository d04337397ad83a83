"""SGLang plugin entry point: registers the radix-cache backend ``penelope`` and its scheduler hooks.

SGLang 0.5.23 runs every function of the entry-point group ``sglang.srt.plugins`` early in each of
its processes (``sglang.srt.plugins.load_plugins``), then applies the hooks they registered. The
user then launches with ``--radix-cache-backend penelope``.

The backend's options are ``options.PenelopeOptions``, read by ``options.options_from``.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from penelope.errors import UsageError

from .backends import prefill_backend
from .options import BACKEND_NAME, options_from
from .patching import register_around

logger = logging.getLogger(__name__)

_SERVER_ARGS_CHECK = "sglang.srt.server_args.ServerArgs.check_server_args"


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: registers the ``penelope`` radix-cache
    backend, the scheduler hooks (and, with ``PENELOPE_TIME_CACHE=1``, the timing of the
    scheduler's cache, ``cache_timer``), the start-up check of Penelope's options, the prefix-aware CPU
    attention backend ``torch_native_prefix`` (``cpu_attention``) and, unless
    ``PENELOPE_ATTENTION=sglang``, the Triton attention backend subclass that runs phantom batches
    through Penelope's ragged kernel. Never raises: SGLang would log the error and start without
    the plugin; a bad option stops the server at start-up instead (``check_server_args``).
    Safe to call more than once in a process."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from . import cache_timer, clock, cpu_attention, hooks

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_penelope_cache)
    hooks.register_hooks()
    clock.register_hooks()
    cache_timer.register_hooks()
    register_around({_SERVER_ARGS_CHECK: _check_server_args})
    cpu_attention.register()
    try:
        attention = options_from(None).attention
    except UsageError:
        attention = "sglang"  # reported by the start-up check when the backend is selected
    if attention == "ragged":
        from sglang.srt.layers.attention.attention_registry import register_attention_backend

        from .attention import create_penelope_triton_backend

        # Overwrites the "triton" entry: --attention-backend triton then builds the subclass, which
        # hands every batch without phantoms to SGLang's own code.
        register_attention_backend("triton")(create_penelope_triton_backend)


def _check_server_args(original, server_args, *args, **kwargs):
    # After SGLang's own check, on the resolved arguments (``startup.py``).
    from .startup import check_server_args

    result = original(server_args, *args, **kwargs)
    try:
        check_server_args(server_args)
    except UsageError as error:
        if Path(sys.argv[0]).name in ("launch_server.py", "sglang"):
            # The command line: one line and a non-zero exit, no traceback.
            raise SystemExit(str(error)) from None
        raise
    return result


def create_penelope_cache(ctx):
    """Radix-cache factory (`TreeCacheBuildContext` -> `PenelopeRadixCache`)."""
    from . import clock, hooks
    from .radix_cache import PenelopeRadixCache

    unsupported = [flag for flag, on in (
        ("a hybrid sliding-window model", ctx.is_hybrid_swa),
        ("a model with mamba state", ctx.is_hybrid_ssm),
        ("--enable-hierarchical-cache", ctx.enable_hierarchical_cache),
        ("--disable-radix-cache", ctx.disable_radix_cache),
        ("a DSA model", ctx.is_dsa),
    ) if on]
    if unsupported:
        raise UsageError(f"penelope: --radix-cache-backend penelope does not support {unsupported[0]}")
    options = options_from(ctx.params.eviction_policy_config)
    phantoms = options.phantoms and hooks.hooks_active()
    if options.phantoms and not phantoms:
        logger.warning("penelope: scheduler hooks are not applied (was the plugin loaded through "
                       "load_plugins?); holes are recomputed with everything after them")
    if not clock.hooks_active():
        logger.warning("penelope: the clock hooks are not applied (was the plugin loaded through load_plugins?); "
                       "the agent-aware policies see no time pass")
    server_args = getattr(ctx, "server_args", None)
    # The CPU tier's copies are ordered against the stream SGLang's forwards run on.
    forward_stream = getattr(getattr(getattr(ctx, "tp_worker", None), "model_runner", None), "forward_stream", None)
    try:
        # hicache_size / hicache_ratio as the user gave them (resolution defaults the ratio for HiCache).
        return PenelopeRadixCache(ctx.params, options, phantoms=phantoms,
                                  backend=prefill_backend(getattr(ctx, "tp_worker", None), server_args),
                                  hicache_size_gb=getattr(server_args, "hicache_size", 0) or 0,
                                  hicache_ratio=getattr(server_args, "hicache_ratio", None),
                                  cost_model=served_cost_model(getattr(ctx, "model_config", None), server_args),
                                  forward_stream=forward_stream)
    except UsageError as error:
        message = str(error)
        raise UsageError(message if message.startswith("penelope:") else f"penelope: {message}") from None


def served_cost_model(model_config, server_args=None):
    """The recompute cost model of the served model, which the cost-aware policies weigh blocks by:
    from the HF config SGLang loaded (`model_config.hf_config`, whatever `--model-path` named: a
    folder or a hub id), else from the config.json at `server_args.model_path`; None (every token
    costs the same) when neither can be read. Logs which one is used."""
    from penelope.costmodel.recompute import CostModel
    from penelope.costmodel.shapes import get_model, shape_from_config

    hf_config = getattr(model_config, "hf_config", None)
    path = str(getattr(model_config, "model_path", None) or getattr(server_args, "model_path", None))
    name = Path(path).name or path
    try:
        if hf_config is not None:
            shape = shape_from_config(hf_config.to_dict(), name=name, where=f"the config of {path}")
        else:
            shape = get_model(path)
    except (UsageError, OSError, ValueError) as error:
        logger.warning("penelope: no cost model for %s (%s); the policies weigh every token the same", path, error)
        return None
    logger.info("penelope: cost model %s (%d layers, hidden %d) from the served model's config", shape.name,
                shape.num_layers, shape.hidden_size)
    return CostModel(shape)
