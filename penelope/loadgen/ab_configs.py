"""The configurations an A/B run compares, by name, and the SGLang server options of each.

Every server of one A/B run shares `ServerSetup` (model, device, KV pool, page, chunk, seed,
attention backend, further options); a configuration adds only its cache's options:

- `penelope[:POLICY]`: `--radix-cache-backend penelope --radix-eviction-policy-config
  {"policy": POLICY}` (default policy `penelope`; its ablations and agent-aware policies by name);
- `penelope-tier[:POLICY]`: the same with Penelope's CPU tier of `host_tokens` (`"cpu_cache"`);
- `sglang-lru`, `sglang-lfu`, `sglang-slru`: `--radix-eviction-policy lru / lfu / slru` (SLRU's
  `{"protected_threshold": N}` when `slru_protected` is set);
- `sglang-tlru`: `--radix-eviction-policy tlru --radix-eviction-policy-config
  {"threshold": T, "next_prompt_estimate": Q}` (`TLRUParams`);
- `sglang-session`: `--enable-session-radix-cache` (unreferenced KV evicted first, LRU within);
- `sglang-hicache`: `--enable-hierarchical-cache --hicache-ratio host_tokens / pool` (GPU only).

After start-up each server's `/server_info` is read back (`check_applied`): the settings SGLang
resolved must be the configuration's, and Penelope's cache must report the policy asked for, so a
configuration that was silently ignored fails before its traffic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from penelope.errors import UsageError

PENELOPE, PENELOPE_TIER = "penelope", "penelope-tier"
SGLANG_POLICIES = ("lru", "lfu", "slru", "tlru")
SGLANG_SESSION, SGLANG_HICACHE = "sglang-session", "sglang-hicache"
NAMES = (PENELOPE, PENELOPE_TIER, *(f"sglang-{p}" for p in SGLANG_POLICIES), SGLANG_SESSION, SGLANG_HICACHE)
# Runs only where SGLang's HiCache can: a CUDA device (it moves KV between device and host memory).
GPU_ONLY = (SGLANG_HICACHE,)
DEVICES = ("cpu", "cuda")
CPU_ATTENTION = "torch_native_prefix"
# Penelope's offline policy needs the future; the plugin refuses it.
REFUSED_POLICIES = ("oracle",)
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class TLRUParams:
    """SGLang's Tail-Optimized LRU (`TLRUStrategy`): a conversation of L cached tokens keeps its
    first L + next_prompt_estimate - threshold tokens; its tokens past that are evicted first.
    Both in tokens of the served model; SGLang requires threshold > next_prompt_estimate >= 0."""

    threshold: int
    next_prompt_estimate: int

    def __post_init__(self) -> None:
        for name in ("threshold", "next_prompt_estimate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"sglang-tlru: `{name}` must be a non-negative integer, got {value!r}")
        if self.threshold <= self.next_prompt_estimate:
            raise UsageError(f"sglang-tlru: `threshold` ({self.threshold}) must exceed `next_prompt_estimate` "
                             f"({self.next_prompt_estimate}), else T-LRU is plain LRU (SGLang refuses it)")


@dataclass(frozen=True)
class ServerSetup:
    """What every server of an A/B run shares. pool: KV tokens (`--max-total-tokens`); page,
    chunk: `--page-size`, `--chunked-prefill-size`; server_seed: `--random-seed`; attention: the
    attention backend (None: SGLang's default, FA3 on Hopper); host_tokens: the host tier of
    `penelope-tier` and `sglang-hicache`; extra: further `sglang.launch_server` options."""

    model: str
    pool: int
    device: str = "cpu"
    page: int = 16
    chunk: int = 1024
    server_seed: int = 0
    attention: str | None = CPU_ATTENTION
    host_tokens: int | None = None
    tlru: TLRUParams | None = None
    slru_protected: int | None = None
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise UsageError(f"`device` {self.device}: choose from {', '.join(DEVICES)}")
        for name, value, low in (("pool", self.pool, 2), ("page", self.page, 1), ("chunk", self.chunk, 1),
                                 ("host_tokens", self.host_tokens, 1), ("slru_protected", self.slru_protected, 1)):
            if value is None and name in ("host_tokens", "slru_protected"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UsageError(f"`{name}` must be an integer of at least {low}, got {value!r}")
        if self.pool < 2 * self.page:
            raise UsageError(f"`pool` {self.pool} holds fewer than two pages of {self.page} tokens")
        seed = self.server_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise UsageError(f"`server_seed` must be in [0, 2**31), got {seed!r}")
        if self.attention == CPU_ATTENTION and self.device != "cpu":
            raise UsageError(f"`attention` {CPU_ATTENTION} runs on CPU only (`device` {self.device})")
        taken = {"--host", "--port", "--model-path", "--max-total-tokens", "--page-size", "--chunked-prefill-size",
                 "--random-seed", "--attention-backend", "--radix-cache-backend", "--radix-eviction-policy",
                 "--radix-eviction-policy-config", "--enable-session-radix-cache", "--enable-hierarchical-cache",
                 "--device"}
        clash = sorted(taken & {a.split("=")[0] for a in self.extra})
        if clash:
            raise UsageError(f"`extra` {clash[0]}: set by the A/B runner (an option of its own, or a "
                             "configuration's)")

    def common_args(self) -> tuple[str, ...]:
        """The options every server of the run gets (CPU settings on CPU)."""
        from penelope.loadgen.server import CPU_ARGS

        args: list[str] = []
        if self.device == "cpu":
            # CPU_ARGS names torch_native; this run's backend replaces it.
            cpu = list(CPU_ARGS)
            at = cpu.index("--attention-backend")
            del cpu[at:at + 2]
            args += cpu
        args += ["--max-total-tokens", str(self.pool), "--page-size", str(self.page),
                 "--chunked-prefill-size", str(self.chunk), "--random-seed", str(self.server_seed)]
        if self.attention:
            args += ["--attention-backend", self.attention]
        return (*args, *self.extra)

    @property
    def host(self) -> int:
        """Host-tier tokens: `host_tokens`, by default twice the pool."""
        return self.host_tokens if self.host_tokens is not None else 2 * self.pool


@dataclass(frozen=True)
class ABConfig:
    """One configuration: its name, its own server options, the `/server_info` settings that show
    it was applied, and (Penelope's cache) the policy its counters must name."""

    name: str
    args: tuple[str, ...]
    expect: Mapping[str, object] = field(default_factory=dict)
    penelope_policy: str | None = None
    # Penelope's CPU tier, in tokens (its counters' `host_tokens`); None: none.
    host_tokens: int | None = None

    @property
    def slug(self) -> str:
        """The name as it appears in file names."""
        return _SAFE.sub("_", self.name)


def _penelope(name: str, policy: str | None, setup: ServerSetup, tier: bool) -> ABConfig:
    from penelope.cache.policies import get_policy

    policy = policy or "penelope"
    if policy in REFUSED_POLICIES:
        raise UsageError(f"{name}: the {policy!r} policy needs the future; a server cannot run it")
    canonical = get_policy(policy).name  # UsageError naming the known policies
    options: dict[str, object] = {"policy": policy}
    if tier:
        options["cpu_cache"] = setup.host
    return ABConfig(name, ("--radix-cache-backend", "penelope", "--radix-eviction-policy-config",
                           json.dumps(options, separators=(",", ":"))),
                    expect={"radix_cache_backend": "penelope"}, penelope_policy=canonical,
                    host_tokens=setup.host if tier else None)


def make_config(name: str, setup: ServerSetup) -> ABConfig:
    """The configuration called `name` (see the module docstring) on `setup`; UsageError with one
    line for an unknown name or one that cannot run there."""
    if not isinstance(name, str) or not name.strip():
        raise UsageError("a configuration name is empty")
    base, _, policy = name.partition(":")
    if base in (PENELOPE, PENELOPE_TIER):
        if _ and not policy:
            raise UsageError(f"{name}: give a policy after the colon ({base}:POLICY) or none")
        return _penelope(name, policy or None, setup, tier=base == PENELOPE_TIER)
    if _:
        raise UsageError(f"{name}: only penelope and penelope-tier take a :POLICY")
    if base in GPU_ONLY and setup.device != "cuda":
        raise UsageError(f"{name} needs a GPU (SGLang's HiCache moves KV between device and host memory); "
                         f"this run is on `device` {setup.device}")
    if base == SGLANG_HICACHE:
        ratio = setup.host / setup.pool
        if ratio <= 1:
            raise UsageError(f"{name}: `host_tokens` ({setup.host}) must exceed the pool ({setup.pool}); "
                             "SGLang's host pool is larger than the device pool")
        return ABConfig(name, ("--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:g}"),
                        expect={"enable_hierarchical_cache": True})
    if base == SGLANG_SESSION:
        return ABConfig(name, ("--enable-session-radix-cache",),
                        expect={"enable_session_radix_cache": True, "radix_eviction_policy": "lru"})
    policy = base.removeprefix("sglang-")
    if not base.startswith("sglang-") or policy not in SGLANG_POLICIES:
        raise UsageError(f"unknown configuration {name!r} (known: {', '.join(NAMES)}; penelope:POLICY for "
                         "another Penelope policy)")
    args: tuple[str, ...] = ("--radix-eviction-policy", policy)
    config: dict[str, object] | None = None
    if policy == "tlru":
        if setup.tlru is None:
            raise UsageError("sglang-tlru needs its threshold and next-prompt estimate")
        config = {"threshold": setup.tlru.threshold, "next_prompt_estimate": setup.tlru.next_prompt_estimate}
    elif policy == "slru" and setup.slru_protected is not None:
        config = {"protected_threshold": setup.slru_protected}
    expect: dict[str, object] = {"radix_eviction_policy": policy, "enable_session_radix_cache": False}
    if config is not None:
        args += ("--radix-eviction-policy-config", json.dumps(config, separators=(",", ":")))
        expect["radix_eviction_policy_config"] = config
    return ABConfig(name, args, expect=expect)


def parse_configs(names: Sequence[str], setup: ServerSetup, baseline: str | None) -> tuple[list[ABConfig], str]:
    """The configurations named (at least two, each once) and the baseline's name (default: the
    first); UsageError with one line otherwise."""
    names = [n.strip() for text in names for n in text.split(",")]
    if len(names) < 2:
        raise UsageError(f"an A/B run compares at least two configurations, got {len(names)}")
    seen = set()
    for name in names:
        if name in seen:
            raise UsageError(f"configuration {name!r} is named twice")
        seen.add(name)
    configs = [make_config(name, setup) for name in names]
    baseline = names[0] if baseline is None else baseline
    if baseline not in seen:
        raise UsageError(f"`baseline` {baseline!r} is not one of the configurations ({', '.join(names)})")
    return configs, baseline


def default_tlru(setup: ServerSetup, appended_tokens: Sequence[int]) -> TLRUParams:
    """T-LRU's parameters when not given: the next prompt's estimate is the median of the tokens
    the workload's turns append to their session's history (as served: after --scale), and the
    threshold that estimate plus one prefill chunk (what one prefill step computes)."""
    ordered = sorted(appended_tokens)
    estimate = int(ordered[len(ordered) // 2]) if ordered else 0
    return TLRUParams(threshold=estimate + setup.chunk, next_prompt_estimate=estimate)


def check_applied(config: ABConfig, info: Mapping[str, object]) -> dict:
    """What the server's `/server_info` says of `config`'s settings; UsageError naming the first
    setting it did not apply. Returns the settings read back (for reports)."""
    counters = penelope_counters(info)
    found = {key: info.get(key) for key in config.expect}
    for key, wanted in config.expect.items():
        value = info.get(key)
        same = value == wanted or (isinstance(wanted, bool) and bool(value) == wanted)
        if not same:
            raise UsageError(f"{config.name}: the server reports {key} = {value!r}, not {wanted!r}: the "
                             "configuration was not applied")
    if config.penelope_policy is not None:
        policy = (counters or {}).get("policy")
        if policy != config.penelope_policy:
            raise UsageError(f"{config.name}: the server's cache reports policy {policy!r}, not "
                             f"{config.penelope_policy!r}")
        found["policy"] = policy
        host = (counters or {}).get("host_tokens", 0)
        if (config.host_tokens or 0) != host:
            raise UsageError(f"{config.name}: the server's cache reports a CPU tier of {host} tokens, not "
                             f"{config.host_tokens or 0}")
        if host:
            found["host_tokens"] = host
    elif counters and "policy" in counters:
        raise UsageError(f"{config.name}: the server runs Penelope's cache ({counters['policy']}), not SGLang's")
    return found


def penelope_counters(info: Mapping[str, object]) -> dict | None:
    """The plugin's counters in `/server_info` (`internal_states[0]["penelope"]`): prefill tokens
    computed by every cache, Penelope's own figures with its cache; None without the plugin."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        counters = states[0].get("penelope")
        return counters if isinstance(counters, dict) else None
    return None


def prefill_tokens(info: Mapping[str, object], key: str = "prefill_tokens") -> int | None:
    """A prefill counter of the server so far, None when it reports none: `prefill_tokens`, every
    forward's new tokens (prompts, chunks, Penelope's hole refills); `prefill_positions`, the
    query-key pairs their attention computed (`sum n * p + n * (n - 1) / 2` over requests of `n`
    new tokens after `p` cached ones)."""
    value = (penelope_counters(info) or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
