"""The SGLang plugin: options, the cache factory, and loading through SGLang's own
``load_plugins()`` from an entry point of the ``sglang.srt.plugins`` group."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from model_configs import QWEN3_8B, UNSERVABLE_MODELS, config_folder
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang_env import Serving, sglang_config

from penelope.errors import UsageError
from penelope.integration.sglang import PenelopeOptions, PenelopeRadixCache, options_from
from penelope.integration.sglang.plugin import create_penelope_cache

ROOT = Path(__file__).resolve().parents[2]


def test_options_from_json_override_the_environment():
    env = {"PENELOPE_POLICY": "leaf-head-block", "PENELOPE_BLOCK_SIZE": "128", "PENELOPE_PHANTOMS": "off"}
    options = options_from({"policy": "sglang", "swap_buffer": 2048}, env)
    assert options == PenelopeOptions(policy="sglang", block_size=128, swap_buffer=2048, phantoms=False)
    assert options_from(None, {}) == PenelopeOptions()
    assert PenelopeOptions().resolved_block_size(1) == 1
    assert PenelopeOptions().resolved_block_size(64) == 64
    assert options_from('{"policy": "sglang"}', {}).policy == "sglang"  # the Engine API passes JSON text
    assert PenelopeOptions().resolved_block_size(128) == 128
    assert PenelopeOptions(block_size=128).resolved_block_size(64) == 128


@pytest.mark.parametrize(("config", "env", "message"), [
    ({"polcy": "penelope"}, {}, "unknown key 'polcy'"),
    ({"policy": "fifo"}, {}, "unknown policy 'fifo'"),
    ({"policy": "sglang-tlru"}, {}, "port of SGLang's own policy; serve SGLang's with --radix-eviction-policy"),
    ({"block_size": 0}, {}, "block_size must be a positive integer"),
    ({"block_size": 64, "swap_buffer": 32, "cpu_cache": 1024}, {}, "swap_buffer 32 is smaller than one block"),
    ({"block_size": 64, "cpu_cache": 32}, {}, "cpu_cache 32 is smaller than one block"),
    ({"attention": "sglang"}, {}, "set PENELOPE_ATTENTION instead"),
    ({"phantoms": "yes"}, {}, "phantoms must be true or false"),
    (None, {"PENELOPE_BLOCK_SIZE": "big"}, "PENELOPE_BLOCK_SIZE must be an integer"),
    (None, {"PENELOPE_PHANTOMS": "maybe"}, "PENELOPE_PHANTOMS must be"),
    (None, {"PENELOPE_ATTENTION": "flash"}, "attention must be one of"),
    (None, {"PENELOPE_BLOCK_SIZE": "0"}, r"block_size must be a positive integer, got 0 \(from PENELOPE_BLOCK_SIZE\)"),
    (None, {"PENELOPE_BLOCK_SIZE": "1_024"}, "PENELOPE_BLOCK_SIZE must be an integer"),
    ([1, 2], {}, "must be a JSON object"),
    ("[" * 5000, {}, "nested too deeply"),
    ('{"block_size": ' + "9" * 5000 + "}", {}, "integer of more than 4300 digits"),
    ({"block_size": 2**40}, {}, "block_size must be at most 1048576 tokens, got 1099511627776"),
    ('{"block_size": 1180591620717411303424}', {}, "block_size must be at most 1048576 tokens"),
    ({"block_size": 10**5000}, {}, "block_size must be at most 1048576 tokens, got an integer of 16610 bits"),
    ({"swap_buffer": -(10**5000)}, {}, "swap_buffer must be a positive integer, got an integer of 16610 bits"),
    ({"cpu_cache": -(10**5000)}, {}, "cpu_cache must be a non-negative integer .*, got an integer of 16610 bits"),
    ({"tool_call_token": -(10**5000)}, {}, "tool_call_token must be .*, got an integer of 16610 bits"),
    (None, {"PENELOPE_BLOCK_SIZE": "9" * 5000}, "PENELOPE_BLOCK_SIZE must be an integer of at most 18 digits"),
    (None, {"PENELOPE_BLOCK_SIZE": str(2**20 + 1)}, r"at most 1048576 tokens, got 1048577 \(from PENEL"),
])
def test_bad_options_name_the_problem(config, env, message):
    with pytest.raises(UsageError, match=message) as error:
        options_from(config, env)
    assert "\n" not in str(error.value) and len(str(error.value)) < 300


def test_a_json_key_wins_over_a_bad_variable_and_an_unused_swap_buffer_never_blocks():
    assert options_from({"block_size": 64}, {"PENELOPE_BLOCK_SIZE": "many"}).block_size == 64
    assert options_from({"block_size": 2048}, {}).block_size == 2048
    assert PenelopeOptions(block_size=2**20).block_size == 2**20


def _context(serving, config=None, **flags):
    params = CacheInitParams(disable=False, req_to_token_pool=serving.req_pool,
                             token_to_kv_pool_allocator=serving.allocator, page_size=serving.page_size,
                             eviction_policy_config=config)
    defaults = dict(is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
                    disable_radix_cache=False, is_dsa=False)
    return SimpleNamespace(params=params, **{**defaults, **flags})


def test_factory_builds_the_cache_from_the_policy_config(monkeypatch):
    for variable in ("PENELOPE_POLICY", "PENELOPE_BLOCK_SIZE", "PENELOPE_PHANTOMS"):
        monkeypatch.delenv(variable, raising=False)
    with sglang_config():
        serving = Serving(size=64 * 8, page_size=1)
        cache = create_penelope_cache(_context(serving, {"policy": "sglang", "block_size": 32}))
        assert isinstance(cache, PenelopeRadixCache)
        assert (cache.cache.policy.name, cache.block_size) == ("leaf-tail-node", 32)
        # Hooks are not applied in this process: holes are not reported for phantoms.
        assert cache.phantoms is False
        with pytest.raises(UsageError, match="--enable-hierarchical-cache"):
            create_penelope_cache(_context(serving, enable_hierarchical_cache=True))
        with pytest.raises(UsageError, match="sliding-window"):
            create_penelope_cache(_context(serving, is_hybrid_swa=True))


def test_the_policies_weigh_blocks_by_the_served_model(tmp_path, caplog):
    """The factory reads the served checkpoint's config.json into a cost model (position-dependent:
    a later block costs more); a path it cannot read gives none, with a warning."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)))
    with sglang_config():
        serving = Serving(size=64 * 8)
        cache = create_penelope_cache(_context(serving, {"policy": "penelope-agent"},
                                               server_args=SimpleNamespace(model_path=str(tmp_path))))
        model = cache.cache.policy.cost_model
        assert model is cache.cost_model and model.span_cost(64, 128) > model.span_cost(0, 64) > 0
        assert cache.stats()["cost_model"] == tmp_path.name
        cache = create_penelope_cache(_context(serving, server_args=SimpleNamespace(model_path=str(tmp_path / "no"))))
        assert cache.cost_model is None and cache.stats()["cost_model"] == "tokens"
        assert "no cost model for" in caplog.text


_LOAD = """
import json
from sglang.srt.plugins import load_plugins
load_plugins()
import sys
sys.path.insert(0, "tests")
from model_configs import QWEN3_8B, UNSERVABLE_MODELS, config_folder
from sglang_env import Serving, sglang_config
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache, registered_radix_cache_backends
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.runtime_context import get_context, get_memory
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
from penelope.integration.sglang import attention, clock, cpu_attention, hooks

override = get_context().override_server_args(
    attention_backend="torch_native", device="cpu", radix_cache_backend="penelope",
    radix_eviction_policy_config={"policy": "leaf-head-block", "block_size": 128})
override.install()
serving = Serving(size=64 * 8, page_size=64)  # for its pools
params = CacheInitParams(disable=False, req_to_token_pool=serving.req_pool,
                         token_to_kv_pool_allocator=serving.allocator, page_size=64,
                         eviction_policy_config=get_memory().radix_eviction_policy_config)
ctx = TreeCacheBuildContext(server_args=None, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
                            model_config=None, tp_size=1, tp_rank=0, tp_group=None)
cache = create_tree_cache(ctx)

# The applied hooks at work on SGLang's patched classes: a request whose history lost its front.
from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_env import blocks
holed = Serving(size=64 * 40, page_size=64)
a = blocks(1000, 2) + blocks(1, 6)
holed.prefill([a + [7]])
holed.prefill([blocks(1000, 2) + blocks(5000, 6) + [8]])
holed.cache.evict(EvictParams(num_tokens=128))
adder = PrefillAdder(64, holed.cache, holed.allocator, ScheduleBatch(reqs=[]), 0.5, 16384, 8192)
req = holed.new_request(a + [9])
req.init_next_round_input(holed.cache)
adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
batch = ScheduleBatch.init_new(adder.can_run_list, holed.req_pool, holed.allocator, holed.cache,
                               type("M", (), {"vocab_size": 50000, "is_encoder_decoder": False})(),
                               False, SpeculativeAlgorithm.NONE)
batch.prepare_for_extend()
holed.forward(batch)
holed.check_row(req)
members = [(r.prefix_len, r.extend_end) for r in batch.reqs]
batch.filter_batch()
print(json.dumps({
    "tokens": [adder.log_input_tokens, adder.log_hit_tokens, adder.log_replay_tokens, req.cached_tokens],
    "members": members, "after_filter": len(batch.reqs),
    "backends": registered_radix_cache_backends(),
    "hooks_active": hooks.hooks_active(), "clock_active": clock.hooks_active(),
    "triton_is_penelope": ATTENTION_BACKENDS["triton"] is attention.create_penelope_triton_backend,
    "prefix_backend": (ATTENTION_BACKENDS.get("torch_native_prefix") is cpu_attention.create_prefix_attention_backend
                       and "torch_native_prefix" in ATTENTION_BACKEND_CHOICES),
    "init_new_wrapped": hasattr(ScheduleBatch.init_new, "__wrapped__"),
    "cache": type(cache).__name__, "policy": cache.cache.policy.name, "block": cache.block_size,
    "phantoms": cache.phantoms,
}))
"""


def test_plugin_loads_through_sglang_load_plugins(tmp_path):
    """A distribution on the path whose entry point is the one pyproject.toml declares; SGLang's
    load_plugins() finds it, runs register() and applies the hooks; create_tree_cache then builds
    our cache for --radix-cache-backend penelope, and a request with a hole goes through the
    patched admission and batch building. In a fresh process: hooks patch SGLang classes."""
    dist = tmp_path / "penelope_plugin_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: penelope-plugin-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\npenelope = penelope.integration.sglang.plugin:register\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_PLUGINS", "PENELOPE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _LOAD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert "penelope" in report["backends"]
    assert report["hooks_active"] and report["init_new_wrapped"] and report["triton_is_penelope"]
    assert report["prefix_backend"] and report["clock_active"]
    assert report == {**report, "cache": "PenelopeRadixCache", "policy": "leaf-head-block", "block": 128,
                      "phantoms": True}
    # Through the patched PrefillAdder, ScheduleBatch.init_new / prepare_for_extend / filter_batch.
    # (new, hit, replayed) tokens of the step and the request's cached_tokens: the hole is computed.
    assert report["tokens"] == [1 + 128, 512 - 128, 0, 512 - 128]
    assert report["members"] == [[128, 256], [512, 513]] and report["after_filter"] == 1



def _resolved_server_args(model: str, **flags):
    """SGLang's ServerArgs record, resolved as ``launch_server`` and ``Engine`` resolve it."""
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=model, device="cpu", attention_backend="torch_native",
                             skip_tokenizer_init=True, radix_cache_backend="penelope", **flags)
    server_args.resolve_once()
    return server_args


def _start_up_check(server_args) -> None:
    """The start-up check as SGLang runs it: the plugin's hook around ServerArgs.check_server_args."""
    from penelope.integration.sglang.plugin import _check_server_args

    _check_server_args(type(server_args).check_server_args, server_args)


def test_the_start_up_check_reads_the_page_size_sglang_resolved(tmp_path):
    """A backend that needs pages of 64 (trtllm_mha, FA4, ...) declares page_size during
    resolution and leaves the raw field None; a block of 96 tokens is refused at start-up, not in
    the scheduler after the weights loaded."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    model = config_folder(tmp_path / "Qwen3-8B", QWEN3_8B)
    server_args = _resolved_server_args(model, radix_eviction_policy_config={"block_size": 96})
    _start_up_check(server_args)  # page 1 after resolution on CPU: 96 holds whole pages
    declare_resolution(server_args, "a backend's page-size rule", page_size=64)
    assert server_args.page_size is None
    with pytest.raises(UsageError, match="^penelope: block_size 96 is not a multiple of SGLang's page size 64$"):
        _start_up_check(server_args)


@pytest.mark.parametrize(("config", "kind"), [
    *[(config, kind) for config, _, kind in UNSERVABLE_MODELS.values()],
    (QWEN3_8B, None),
])
def test_models_the_cache_cannot_serve_are_named_from_sglangs_model_config(tmp_path, config, kind):
    """SGLang's ModelConfig (what the launching process reads before any weights) decides, with
    the tests SGLang's cache factory makes. The launch itself: tests/sglang/test_engine.py."""
    from sglang.srt.configs.model_config import ModelConfig

    from penelope.integration.sglang.startup import unsupported_model

    assert unsupported_model(ModelConfig(model_path=config_folder(tmp_path / "m", config))) == kind


def test_the_host_memory_check_counts_every_rank_of_the_node(tmp_path):
    """Eight TP ranks each build a CPU tier: a tier a quarter of the free memory fits once, not
    eight times, and is refused at start-up. Sized from SGLang's ModelConfig: Qwen3-8B at bf16,
    one of its 8 KV heads per rank."""
    import psutil

    from penelope.integration.sglang.startup import kv_bytes_per_token, served_model_config

    model = config_folder(tmp_path / "Qwen3-8B", QWEN3_8B)
    per_rank = 36 * 1 * (128 + 128) * 2
    free = psutil.virtual_memory().available

    def server(tokens: int):
        return _resolved_server_args(model, tp_size=8, radix_eviction_policy_config={"cpu_cache": tokens})

    small = server(free // 16 // per_rank)
    assert kv_bytes_per_token(served_model_config(small), "auto", 8) == per_rank
    _start_up_check(small)  # 8 x a sixteenth
    tokens = free // 4 // per_rank
    with pytest.raises(UsageError, match=r"^penelope: the CPU tier needs .* GiB of host memory \(8 ranks x "
                                         rf"{tokens + 1024:,} tokens x {per_rank:,} bytes\), only"):
        _start_up_check(server(tokens))


def test_a_tier_sized_by_hicache_ratio_is_checked_at_start_up_when_the_pool_is_given(tmp_path):
    """--hicache-ratio times --max-total-tokens is the tier's size before any weight loads: a tier
    beyond the tree's 2**31 host slots, or beyond the node's memory, stops the launch in one line
    (it failed inside the scheduler, after the weights loaded). Without the pool it is checked in
    the scheduler, which knows it."""
    model = config_folder(tmp_path / "Qwen3-8B", QWEN3_8B)
    _start_up_check(_resolved_server_args(model, max_total_tokens=4096, hicache_ratio=2.0))
    _start_up_check(_resolved_server_args(model, hicache_ratio=1e9))
    with pytest.raises(UsageError, match=r"^penelope: a CPU tier of 4,096,000,000,000 tokens \(--hicache-ratio 1e\+09 "
                                         r"x --max-total-tokens 4,096\) plus the swap buffer is beyond the 2\*\*31"):
        _start_up_check(_resolved_server_args(model, max_total_tokens=4096, hicache_ratio=1e9))
    with pytest.raises(UsageError, match=r"^penelope: the CPU tier needs .* GiB of host memory"):
        _start_up_check(_resolved_server_args(model, max_total_tokens=4096, hicache_ratio=500_000.0))


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_the_swap_copy_kernel_is_refused_at_start_up_without_a_gpu(tmp_path, monkeypatch, interpret):
    """copy 'triton' moves KV between a device pool and pinned host memory: on --device cpu (not
    interpreted) the scheduler died at the first demotion; the launch stops in one line instead."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    model = config_folder(tmp_path / "Qwen3-8B", QWEN3_8B)
    _start_up_check(_resolved_server_args(model, radix_eviction_policy_config={"copy": "triton"}))
    server_args = _resolved_server_args(model, radix_eviction_policy_config={"copy": "triton", "cpu_cache": 1024})
    if interpret == "1":
        _start_up_check(server_args)
        return
    with pytest.raises(UsageError, match=r"^penelope: copy 'triton' needs a GPU"):
        _start_up_check(server_args)


def test_a_hub_model_id_gets_its_cost_model_from_the_config_sglang_loaded(tmp_path, caplog):
    """``--model-path Qwen/Qwen3-8B``: no folder of that name here, but SGLang's ModelConfig holds
    the config it fetched; the cost model is Qwen3-8B's, and the log says so."""
    import logging

    from sglang.srt.configs.model_config import ModelConfig

    from penelope.costmodel.recompute import CostModel
    from penelope.costmodel.shapes import get_model

    model_config = ModelConfig(model_path=config_folder(tmp_path / "Qwen3-8B", QWEN3_8B))
    with sglang_config(), caplog.at_level(logging.INFO, logger="penelope.integration.sglang.plugin"):
        serving = Serving(size=64 * 8)
        cache = create_penelope_cache(_context(serving, {"policy": "penelope-agent"}, model_config=model_config,
                                               server_args=SimpleNamespace(model_path="Qwen/Qwen3-8B")))
    reference = CostModel(get_model("qwen3-8b"))
    assert cache.cost_model is not None and cache.stats()["cost_model"] == "Qwen3-8B"
    assert [cache.cost_model.span_cost(s, s + 64) for s in (0, 4096, 30000)] == [
        reference.span_cost(s, s + 64) for s in (0, 4096, 30000)]
    assert "penelope: cost model Qwen3-8B (36 layers, hidden 4096)" in caplog.text
