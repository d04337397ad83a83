"""`penelope verify`: phantom batches give the outputs of a cache that never evicts, bit for bit.

The same agent-like workload (`penelope.engine.session.AgentWorkload`: a shared system prompt,
sessions whose histories grow turn by turn, served round-robin) runs twice through the reference
engine in deterministic mode: once with a small cache under the chosen policy, so histories lose
KV and phantoms refill the holes in the same batch as the real request, and once with a cache
large enough never to evict. Compared:

- the generated (greedy) tokens of every turn;
- the log-probability of the next token at every position of every session (see
  `penelope.engine.session`): each value the small-cache run computed, whether the position
  was new, recomputed by a phantom or after a tail eviction, against the never-evicting run's.
  Reused positions are covered by the value computed when their KV was written.

With `--cpu-cache TOKENS` the small cache is a `penelope.cache.tiers.TwoTierCache` (GPU tier
`--cache-tokens`, CPU tier TOKENS, swap buffer `--swap-buffer`): requests load their CPU spans
back (through the swap buffer when both tiers are full), other KV is demoted to make room, and
every copy runs on the engine's real K/V pools (`--copy`: the Triton swap-copy kernel or torch
indexed copies). A copy that is skipped or lands in the wrong row changes the outputs.

With `--engine sglang` the same kind of check runs on the user's SGLang 0.5.23 install: SGLang's
real Engine with Penelope's plugin on a pool of `--cache-tokens` that must evict, against the same
Engine on a pool that never evicts, and SGLang's default radix cache on the small pool for the
recomputation count (`penelope.integration.sglang.verify`). Tokens must be identical and
log-probabilities agree within `--atol`.

Exit code 0 when both agree exactly, 1 when they differ, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass

from penelope.errors import UsageError
from penelope.memory import check_memory
from penelope.outputs import write_text

ATTENTION_CHOICES = ("naive", "triton")
# Range of every integer option: the tiny model runs on a CPU in seconds; beyond these a run
# takes hours (sessions, turns) or cannot be held by any cache (token counts).
_TOKENS = 2**31 - 1
OPTION_RANGES = {
    "sessions": (1, 4096),
    "turns": (1, 4096),
    "cache_tokens": (1, _TOKENS),
    "seed": (0, 2**63 - 1),
    "block_size": (1, 1 << 16),
    "system_tokens": (0, _TOKENS),
    "message_tokens": (1, _TOKENS),
    "reply_tokens": (1, _TOKENS),
    "cpu_cache": (0, _TOKENS),
    "swap_buffer": (0, _TOKENS),
}


def check_device(device: str) -> None:
    """Raise UsageError unless `device` is `cpu`, `cuda` or `cuda:N` (torch's spelling)."""
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (index and not (index.isdigit() and kind == "cuda")):
        raise UsageError(f"--device {device}: not a device the engine runs on (cpu, cuda, cuda:N)")
COPY_CHOICES = ("triton", "naive")
ENGINE_CHOICES = ("reference", "sglang")


@dataclass(frozen=True)
class VerifyOptions:
    """One verification: workload shape, the small cache, and the engine.

    `cache_tokens`: capacity of the evicting cache (tokens; its GPU tier when `cpu_cache` > 0);
    `block_size`: its block; `policy`: an eviction policy name; `attention`: "naive" or "triton";
    `device`: where the tiny model runs. `cpu_cache`: tokens of a CPU tier (0: GPU only);
    `swap_buffer`: host tokens reserved for exchanges; `copy`: "triton" or "naive" tier copies.
    """

    sessions: int = 4
    turns: int = 6
    cache_tokens: int = 2048
    policy: str = "penelope"
    attention: str = "naive"
    seed: int = 0
    block_size: int = 64
    system_tokens: int = 256
    message_tokens: int = 128
    reply_tokens: int = 8
    model: str = "tiny"
    device: str = "cpu"
    cpu_cache: int = 0
    swap_buffer: int = 1024
    copy: str = "triton"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CHOICES:
            raise UsageError(f"unknown attention {self.attention!r}; choose from {list(ATTENTION_CHOICES)}")
        for name, (low, high) in OPTION_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "positive" if low == 1 else "non-negative"
                raise UsageError(f"--{name.replace('_', '-')} must be a {kind} integer, got {value!r}")
            if value > high:
                raise UsageError(f"--{name.replace('_', '-')} must be at most {high}, got {value}")
        check_device(self.device)
        if self.copy not in COPY_CHOICES:
            raise UsageError(f"unknown copy function {self.copy!r}; choose from {list(COPY_CHOICES)}")
        if self.cpu_cache:
            # TwoTierCache says the same, but only after the model is built.
            if self.cpu_cache < self.block_size:
                raise UsageError(f"cpu_cache of {self.cpu_cache} tokens is smaller than one block of "
                                 f"{self.block_size} tokens (0 turns the CPU tier off)")
            if self.swap_buffer < self.block_size:
                raise UsageError(f"swap_buffer of {self.swap_buffer} tokens is smaller than one block of "
                                 f"{self.block_size} tokens")


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of `verify` (the first nine fields are the JSON contract of `penelope verify`).

    Tier figures (zero without a CPU tier): `loads` requests that loaded CPU spans,
    `swap_buffer_loads` of them through the swap buffer, `demotions` GPU -> CPU moves (operations);
    `loaded_tokens`, `swapped_tokens`, `demoted_tokens` the same in tokens; `plans_run` and
    `bytes_moved` what the executor did on the real pools."""

    identical_tokens: bool
    bitwise_identical_logprobs: bool
    max_abs_logprob_diff: float
    requests: int
    phantom_tokens: int
    holes_refilled: int
    loads: int
    swap_buffer_loads: int
    demotions: int
    generated_tokens: int
    positions_compared: int
    values_compared: int
    recomputed_values: int
    missing_positions: int
    evicted_tokens: int
    hit_rate: float
    reference_hit_rate: float
    reference_cache_tokens: int
    cpu_cache_tokens: int = 0
    loaded_tokens: int = 0
    swapped_tokens: int = 0
    demoted_tokens: int = 0
    plans_run: int = 0
    bytes_moved: int = 0

    @property
    def identical(self) -> bool:
        return self.identical_tokens and self.bitwise_identical_logprobs

    def as_dict(self) -> dict:
        return asdict(self)


def compare_runs(small, reference) -> dict:
    """Compare two `RunRecord`s of the same workload: tokens, then log-probs position by position.

    The log-prob at position p of a session is the entry for its token p + 1 in a log-softmax
    row computed at p, by this session or by any session whose history agrees up to p (the
    shared system prompt is computed once and reused). Compared where the two runs' histories
    agree (everywhere when the tokens are identical): every value of the small run, and every
    recomputation in the reference, must equal the reference's first value bitwise. A position
    before the last that a run never computed counts as missing (and not identical)."""
    identical_tokens = all(a.replies == b.replies for a, b in zip(small.sessions, reference.sessions, strict=True))
    positions = values = recomputed = missing = 0
    max_diff, bitwise = 0.0, True
    small_shared, reference_shared = _shared_prefixes(small), _shared_prefixes(reference)
    for session, (ours, theirs) in enumerate(zip(small.sessions, reference.sessions, strict=True)):
        common = _common_prefix(ours.history, theirs.history)
        for position in range(common - 1):
            target = int(theirs.history[position + 1])
            expected = _values_at(reference, reference_shared[session], position, target)
            got = _values_at(small, small_shared[session], position, target)
            if not expected or not got:
                missing += 1
                bitwise = False
                continue
            positions += 1
            recomputed += len(got) - 1
            for value in (*got, *expected[1:]):
                values += 1
                if value != expected[0]:
                    bitwise = False
                    diff = abs(value - expected[0])
                    max_diff = max(max_diff, diff if math.isfinite(diff) else math.inf)
    return dict(identical_tokens=identical_tokens, bitwise_identical_logprobs=bitwise, max_abs_logprob_diff=max_diff,
                positions_compared=positions, values_compared=values, recomputed_values=recomputed,
                missing_positions=missing)


def _shared_prefixes(record) -> list[list[int]]:
    """`[s][t]`: length of the common prefix of session s's and session t's histories."""
    histories = [state.history for state in record.sessions]
    return [[_common_prefix(a, b) for b in histories] for a in histories]


def _values_at(record, shared: list[int], position: int, target: int) -> list[float]:
    """Log-probs of `target` in every row a run computed at `position` in a session whose history
    agrees with this one's up to `position` (the row depends on tokens 0..position only)."""
    return [float(row[target]) for other, length in zip(record.sessions, shared, strict=True)
            if length > position for row in other.logprobs.get(position, ())]


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()[0]
    return int(differ[0]) if len(differ) else n


def reference_capacity(workload, block_size: int) -> int:
    """A cache size that never evicts: every session's longest history, whole blocks, plus one block."""
    blocks = -(-workload.max_sequence() // block_size)
    return (workload.sessions * blocks + 1) * block_size


def verify(options: VerifyOptions, layout_fn=None) -> VerifyReport:
    """Run the workload with the small cache and with a never-evicting one; compare.

    `layout_fn`: how request plans become batches (default `penelope.cache.phantom.build_batch`; tests
    pass a broken one to show that the comparison catches it)."""
    import torch

    from penelope.cache.manager import KVCache
    from penelope.cache.phantom import build_batch
    from penelope.cache.tiers import TwoTierCache
    from penelope.engine.decoder import Qwen3Decoder
    from penelope.engine.decoder_config import get_engine_config
    from penelope.engine.kvpool import KVPool
    from penelope.engine.session import AgentWorkload, Server, run_workload
    from penelope.engine.weights import random_weights
    from penelope.errors import InvariantError

    config = get_engine_config(options.model)
    workload = AgentWorkload(options.sessions, options.turns, options.system_tokens, options.message_tokens,
                             options.reply_tokens, config.vocab_size, options.seed)
    longest = workload.max_sequence()
    if longest > options.cache_tokens:
        raise UsageError(f"a session grows to up to {longest} tokens, more than --cache-tokens {options.cache_tokens}")
    if longest > config.max_position_embeddings:
        raise UsageError(f"a session grows to up to {longest} tokens, beyond the model's "
                         f"{config.max_position_embeddings} positions")
    big = reference_capacity(workload, options.block_size)
    # Both runs' K/V pools (the small cache with its CPU tier, the never-evicting one) in the
    # weights' dtype (fp32): check them against memory before allocating.
    row_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    rows = options.cache_tokens + options.cpu_cache + options.swap_buffer + big
    check_memory(rows * row_bytes, f"K/V pools of {rows:,} token rows (--cache-tokens, --cpu-cache, --swap-buffer "
                 "and a never-evicting reference)")
    device = torch.device(options.device)
    weights = random_weights(config, seed=options.seed, device=device)
    model = Qwen3Decoder(config, weights, attention=options.attention, deterministic=True)

    def run(capacity: int, cpu_capacity: int = 0):
        pool = KVPool(config, capacity, dtype=weights.dtype, device=device)
        if cpu_capacity:
            cache = TwoTierCache(capacity, cpu_capacity, block_size=options.block_size, policy=options.policy,
                                 swap_buffer=options.swap_buffer)
            server = Server(model, cache, pool, layout_fn or build_batch, host_pool=pool.host_mirror(cache.host_rows),
                            copy=options.copy)
        else:
            cache = KVCache(capacity, block_size=options.block_size, policy=options.policy)
            server = Server(model, cache, pool, layout_fn or build_batch)
        record = run_workload(server, workload, logprobs=True)
        cache.check_invariants()
        if cpu_capacity and cache.take_plans():
            raise InvariantError("the cache queued tier plans that the engine never ran")
        return record, cache, server

    small, small_cache, small_server = run(options.cache_tokens, options.cpu_cache)
    reference, reference_cache, _ = run(big)
    if reference_cache.stats.evicted_tokens:
        raise InvariantError(f"the reference cache of {big} tokens evicted {reference_cache.stats.evicted_tokens}")
    compared = compare_runs(small, reference)
    tiers = small_cache.counters if options.cpu_cache else None
    moved = small_server.executor.counters if options.cpu_cache else None
    return VerifyReport(
        loads=tiers.loads if tiers else 0,
        swap_buffer_loads=tiers.swap_loads if tiers else 0,
        demotions=tiers.demotions if tiers else 0,
        cpu_cache_tokens=options.cpu_cache,
        loaded_tokens=tiers.loaded_tokens if tiers else 0,
        swapped_tokens=tiers.swapped_tokens if tiers else 0,
        demoted_tokens=tiers.demoted_tokens if tiers else 0,
        plans_run=moved.plans if moved else 0,
        bytes_moved=moved.bytes_moved if moved else 0,
        requests=small.requests,
        phantom_tokens=small.phantom_tokens,
        holes_refilled=small.holes_refilled,
        generated_tokens=sum(len(reply) for s in small.sessions for reply in s.replies),
        evicted_tokens=small_cache.stats.evicted_tokens,
        hit_rate=small_cache.stats.hit_rate,
        reference_hit_rate=reference_cache.stats.hit_rate,
        reference_cache_tokens=big,
        **compared,
    )


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="check that phantom batches reproduce a never-evicting cache bit for bit",
        description=(
            "Run a multi-session agent-like workload on a tiny Qwen3 model in deterministic mode twice: "
            "with a small cache under --policy (phantoms refill evicted holes in the same batch as the "
            "real request) and with a cache that never evicts. Compare generated tokens and prompt "
            "log-probabilities; exit 1 when they differ."
        ),
    )
    defaults = VerifyOptions()
    parser.add_argument("--sessions", type=int, default=defaults.sessions, help="concurrent agent sessions")
    parser.add_argument("--turns", type=int, default=defaults.turns, help="requests per session")
    parser.add_argument("--cache-tokens", type=int, default=defaults.cache_tokens,
                        help="capacity of the evicting cache, in tokens")
    parser.add_argument("--policy", default=defaults.policy, help="eviction policy of the small cache")
    parser.add_argument("--attention", default=defaults.attention, choices=ATTENTION_CHOICES,
                        help="engine attention backend (triton runs interpreted without a GPU)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the weights and the workload")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="cache block, in tokens")
    parser.add_argument("--system-tokens", type=int, default=defaults.system_tokens,
                        help="shared system prompt length")
    parser.add_argument("--message-tokens", type=int, default=defaults.message_tokens,
                        help="mean length of the message each turn appends")
    parser.add_argument("--reply-tokens", type=int, default=defaults.reply_tokens,
                        help="greedy tokens generated per turn")
    parser.add_argument("--device", default=defaults.device, help="torch device of the tiny model (cpu, cuda)")
    parser.add_argument("--cpu-cache", type=int, default=defaults.cpu_cache, metavar="TOKENS",
                        help="CPU tier of the small cache, in tokens (0: GPU only); --cache-tokens is its GPU tier")
    parser.add_argument("--swap-buffer", type=int, default=defaults.swap_buffer, metavar="TOKENS",
                        help="host tokens reserved for swap-buffer exchanges (with --cpu-cache)")
    parser.add_argument("--copy", default=defaults.copy, choices=COPY_CHOICES,
                        help="how tier moves copy K/V rows: the Triton swap-copy kernel (interpreted without a "
                             "GPU) or torch indexed copies")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    sglang = parser.add_argument_group(
        "--engine sglang", "SGLang's real Engine with Penelope's plugin (needs SGLang 0.5.23; on CPU, SGLang's CPU "
        "build); --cache-tokens is its KV pool, --message-tokens what each turn adds")
    sglang.add_argument("--engine", default="reference", choices=ENGINE_CHOICES,
                        help="reference: this package's engine, bitwise; sglang: SGLang's Engine, within --atol")
    sglang.add_argument("--model", metavar="DIR", help="HF checkpoint to serve (when not given: a tiny random Qwen3)")
    sglang.add_argument("--page-size", type=int, default=64, help="SGLang's page size")
    sglang.add_argument("--chunk", type=int, default=128, help="chunked prefill size (-1: off)")
    sglang.add_argument("--rows", type=int, default=8, help="max running requests (request rows)")
    sglang.add_argument("--atol", type=float, default=None,
                        help="log-probability tolerance; None: 1e-3 for float32, 0.1 for bfloat16, 0.05 for "
                             "float16")
    sglang.add_argument("--no-default", action="store_true",
                        help="skip SGLang's default cache (two Engines, not three)")
    sglang.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                        help="one more sglang.Engine argument, e.g. attention_backend=\"triton\" (repeatable)")


def run(args) -> int:
    from penelope.cache.policies import policy_names
    from penelope.outputs import check_outputs

    check_outputs({"--json": args.json}, {"--model": args.model})
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("verify runs a model and needs torch: pip install 'penelope-kv[torch]'") from None
    if args.policy not in policy_names(aliases=True):
        raise UsageError(f"unknown policy {args.policy!r}; choose from {policy_names(aliases=True)}")
    check_device(args.device)
    check_engine_options(args)
    if args.engine == "sglang":
        from penelope.commands.verify_sglang import run_sglang

        return run_sglang(args)
    options = VerifyOptions(
        sessions=args.sessions, turns=args.turns, cache_tokens=args.cache_tokens, policy=args.policy,
        attention=args.attention, seed=args.seed, block_size=args.block_size, system_tokens=args.system_tokens,
        message_tokens=args.message_tokens, reply_tokens=args.reply_tokens, device=args.device,
        cpu_cache=args.cpu_cache, swap_buffer=args.swap_buffer, copy=args.copy,
    )
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device is available")
    index = args.device.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA devices")
    triton_copy = args.copy == "triton" and args.cpu_cache > 0
    if (args.attention == "triton" or triton_copy) and not args.device.startswith("cuda"):
        # Triton kernels on CPU tensors only run in the interpreter; it must be chosen before the
        # kernel package is first imported (the engine imports it on the first triton call).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tiny model's one-row products gain nothing from intra-op threads; on a busy machine
    # extra threads only wait for each other (measured: 10x slower with 2 threads on 2 shared cores).
    torch.set_num_threads(1)
    report = verify(options)
    print(summary(options, report))
    if args.json:
        write_text(args.json, json.dumps(report.as_dict(), indent=2))
        print(f"wrote {args.json}")
    return 0 if report.identical else 1


# Options only one engine reads, with their defaults: setting one for the other engine is an error,
# not silently ignored.
REFERENCE_ONLY = {"attention": "--attention", "block_size": "--block-size", "swap_buffer": "--swap-buffer",
                  "copy": "--copy"}
SGLANG_ONLY = {"model": ("--model", None), "page_size": ("--page-size", 64), "chunk": ("--chunk", 128),
               "rows": ("--rows", 8), "atol": ("--atol", None), "no_default": ("--no-default", False),
               "engine_arg": ("--engine-arg", [])}
def check_engine_options(args) -> None:
    """Refuse an option of one engine given with the other (it would be ignored)."""
    if args.engine == "sglang":
        defaults = VerifyOptions()
        for name, flag in REFERENCE_ONLY.items():
            if getattr(args, name) != getattr(defaults, name):
                raise UsageError(f"{flag} applies to --engine reference only (verify --engine sglang does not set it)")
        return
    for name, (flag, default) in SGLANG_ONLY.items():
        if getattr(args, name) != default:
            raise UsageError(f"{flag} applies to --engine sglang only")


def summary(options: VerifyOptions, report: VerifyReport) -> str:
    """A few lines for people: what ran, what was compared, PASS or FAIL."""
    tokens = "identical" if report.identical_tokens else "DIFFERENT"
    logprobs = "bitwise identical" if report.bitwise_identical_logprobs else "DIFFERENT"
    tier = []
    if options.cpu_cache:
        tier = [f"CPU tier {options.cpu_cache} tokens (swap buffer {options.swap_buffer}, {options.copy} copy): "
                f"{report.loads} loads ({report.loaded_tokens} tokens), {report.swap_buffer_loads} through the swap "
                f"buffer ({report.swapped_tokens} tokens), {report.demotions} demotions ({report.demoted_tokens} "
                f"tokens); {report.plans_run} plans run, {report.bytes_moved / 2**20:.1f} MiB moved"]
    gpu = " GPU tier" if options.cpu_cache else ""
    return "\n".join([
        f"{options.sessions} sessions x {options.turns} turns, model {options.model}, {options.attention} attention, "
        "deterministic",
        f"small cache{gpu} {options.cache_tokens} tokens ({options.policy}): {report.requests} requests, "
        f"{report.evicted_tokens} tokens evicted, hit rate {report.hit_rate:.1%}, "
        f"{report.holes_refilled} holes refilled by phantoms ({report.phantom_tokens} tokens)",
        *tier,
        f"reference cache {report.reference_cache_tokens} tokens: never evicts, hit rate "
        f"{report.reference_hit_rate:.1%}",
        f"generated tokens: {tokens} ({report.generated_tokens} tokens)",
        f"prompt log-probs: {logprobs} at {report.positions_compared} positions "
        f"({report.values_compared} values, {report.recomputed_values} from recomputations; "
        f"max |diff| {report.max_abs_logprob_diff:.3g}; {report.missing_positions} missing)",
        "PASS" if report.identical else "FAIL: outputs differ",
    ])
