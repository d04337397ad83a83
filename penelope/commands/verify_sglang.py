"""`penelope verify --engine sglang`: the check on the user's SGLang 0.5.23 install.

SGLang's real Engine with Penelope's plugin on a pool of `--cache-tokens` that must evict, against
the same Engine on a pool that never evicts, and SGLang's default radix cache on the small pool for
the recomputation count (`penelope.integration.sglang.verify`). Every option is checked here
before SGLang is imported or an Engine starts: ranges, the page and chunk sizes, a pool that can
hold the longest request, and each `--engine-arg` against SGLang's `ServerArgs`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from penelope.errors import UsageError
from penelope.outputs import write_text

# Engine arguments the check sets itself, and the option that sets each.
OWN_ENGINE_ARGS = {"model_path": "--model", "max_total_tokens": "--cache-tokens", "page_size": "--page-size",
                   "chunked_prefill_size": "--chunk", "max_running_requests": "--rows", "device": "--device",
                   "radix_cache_backend": "--engine", "radix_eviction_policy_config": "--policy and --cpu-cache",
                   "skip_tokenizer_init": None}
# Log-probability tolerance per dtype when --atol is not given: fp32 differs between batch shapes by
# rounding only; 16-bit kernels by their precision (bf16 keeps 8 significant bits), while wrong KV
# moves log-probabilities by units and changes tokens.
DEFAULT_ATOL = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}


def check_sglang_options(args) -> None:
    """Ranges of the `--engine sglang` options (before SGLang is imported)."""
    for flag, value, low, high in (("--page-size", args.page_size, 1, 1 << 16), ("--rows", args.rows, 1, 4096),
                                   ("--sessions", args.sessions, 1, 4096), ("--turns", args.turns, 1, 4096),
                                   ("--cache-tokens", args.cache_tokens, 1, 2**31 - 1),
                                   ("--seed", args.seed, 0, 2**63 - 1),
                                   ("--system-tokens", args.system_tokens, 0, 2**31 - 1),
                                   ("--message-tokens", args.message_tokens, 1, 2**31 - 1),
                                   ("--reply-tokens", args.reply_tokens, 1, 2**31 - 1)):
        if not low <= value <= high:
            raise UsageError(f"{flag} must be in [{low}, {high}], got {value}")
    if args.chunk != -1 and not 1 <= args.chunk <= 2**31 - 1:
        raise UsageError(f"--chunk must be -1 (off) or a positive number of tokens, got {args.chunk}")
    if args.atol is not None and not 0 <= args.atol < math.inf:
        raise UsageError(f"--atol must be a finite non-negative number, got {args.atol}")
    if args.chunk != -1 and args.chunk % args.page_size:
        raise UsageError(f"--chunk {args.chunk} is not a multiple of --page-size {args.page_size}")
    if args.device not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: --engine sglang runs on cpu or cuda; pick the GPU with "
                         "--engine-arg base_gpu_id=N")
    from penelope.cache.policies import get_policy

    if get_policy(args.policy).uses_foresight:
        raise UsageError(f"--policy {args.policy} is an offline reference that must be told the future: a server "
                         "cannot run it; use --engine reference")
    if args.cpu_cache < 0:
        raise UsageError(f"--cpu-cache must be a non-negative number of tokens, got {args.cpu_cache}")
    if args.cpu_cache and args.cpu_cache % args.page_size:
        raise UsageError(f"--cpu-cache {args.cpu_cache} is not a multiple of --page-size {args.page_size}")
    longest = (args.system_tokens + args.message_tokens
               + (args.turns - 1) * (args.message_tokens + args.reply_tokens) + args.reply_tokens)
    need = -(-longest // args.page_size) * args.page_size + args.page_size
    if args.cache_tokens < need:
        raise UsageError(f"--cache-tokens {args.cache_tokens} cannot hold the longest request ({longest} tokens "
                         f"with its reply); use at least {need}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model}: not a checkpoint folder (no config.json in it)")


def check_engine_arg_keys(extra: dict) -> None:
    """Every `--engine-arg` is a field of SGLang's ServerArgs the check does not set itself, with
    a value of the field's plain type (int, float, bool, str; None where optional). SGLang checks
    the rest when the Engine starts."""
    for key in extra:
        if key in OWN_ENGINE_ARGS:
            flag = OWN_ENGINE_ARGS[key]
            raise UsageError(f"--engine-arg {key}: the check sets it" + (f"; use {flag}" if flag else ""))
    if not extra:
        return
    server_args = _server_args_class()
    hints = _field_types(server_args)
    for key, value in extra.items():
        if key not in hints:
            raise UsageError(f"--engine-arg {key}: not an argument of sglang.Engine (ServerArgs)")
        _check_plain_type(key, value, hints[key])


def _server_args_class():
    import warnings

    try:
        with warnings.catch_warnings():
            # SGLang warns on import about quantizations a CPU lacks; nothing the user asked about.
            warnings.simplefilter("ignore")
            from sglang.srt.server_args import ServerArgs
    except ImportError as error:
        raise UsageError(f"--engine sglang needs SGLang 0.5.23 installed ({error})") from None
    return ServerArgs


def _field_types(server_args) -> dict:
    """ServerArgs field -> annotation (a msgspec Struct in 0.5.23; a dataclass before)."""
    import typing

    try:
        return typing.get_type_hints(server_args)
    except Exception:  # an annotation that does not resolve: names only
        return dict.fromkeys(getattr(server_args, "__annotations__", {}), typing.Any)


def _check_plain_type(key: str, value, hint) -> None:
    import types
    import typing

    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    plain = [t for t in options if t in (int, float, bool, str, type(None))]
    if len(plain) != len(options):
        return  # lists, dicts, literals: SGLang checks them
    if isinstance(value, bool):
        ok = bool in plain
    elif isinstance(value, int):
        ok = int in plain or float in plain
    elif isinstance(value, float):
        ok = float in plain and math.isfinite(value)
    else:
        ok = any(t is not bool and isinstance(value, t) for t in plain) or (value is None and type(None) in plain)
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in plain)
        raise UsageError(f"--engine-arg {key}: expected {names}, got {json.dumps(value)}")


def engine_precision(device: str, extra: dict, atol: float | None) -> tuple[str, float]:
    """(dtype, atol) of the check: `--engine-arg dtype=...` if given, else bf16 on CUDA (SGLang's
    FA3 and trtllm_mha have no fp32 kernels, and the ragged kernel needs 16-bit inputs for tensor
    cores) and fp32 on CPU; `--atol` if given, else the dtype's DEFAULT_ATOL."""
    dtype = extra.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
    dtype = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        dtype, dtype)
    if dtype not in DEFAULT_ATOL:
        raise UsageError(f"--engine-arg dtype={dtype}: the check runs float32, bfloat16 or float16")
    return dtype, DEFAULT_ATOL[dtype] if atol is None else atol


def engine_args(items: list[str]) -> dict:
    """`--engine-arg KEY=JSON` options as a dict (a value that is not JSON is taken as text)."""
    extra = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--engine-arg {item!r}: expected KEY=JSON")
        try:
            extra[key] = json.loads(value)
        except RecursionError:
            raise UsageError(f"--engine-arg {key}: JSON nested too deeply") from None
        except ValueError:
            # Not JSON: the text itself.
            extra[key] = value
    return extra


def run_sglang(args) -> int:
    """`--engine sglang`: three Engines (two with --no-default), compared; exit 1 on a difference."""
    check_sglang_options(args)
    extra = engine_args(args.engine_arg)
    check_engine_arg_keys(extra)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device on this machine")
    if args.device == "cpu":
        import importlib.util

        if importlib.util.find_spec("sgl_kernel") is None:
            raise UsageError("--engine sglang --device cpu needs SGLang's CPU kernel package sgl_kernel, which PyPI "
                             "does not have (build it from SGLang's sgl-kernel sources); on a GPU use --device cuda")
    import sys
    import tempfile

    from penelope.integration.sglang.engine_check import AgentTraffic, EngineSetup
    from penelope.integration.sglang.verify import EngineCheck, check, tiny_model

    device = args.device
    dtype, atol = engine_precision(device, extra, args.atol)
    extra = {key: value for key, value in extra.items() if key != "dtype"}
    traffic = AgentTraffic(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                           first_tokens=args.message_tokens, growth_tokens=args.message_tokens,
                           max_new_tokens=args.reply_tokens, seed=args.seed)
    setup = EngineSetup(pool_tokens=args.cache_tokens, page_size=args.page_size, chunk=args.chunk, rows=args.rows,
                        policy=args.policy, cpu_cache=args.cpu_cache, dtype=dtype, device=device, extra=extra)
    spec = EngineCheck(traffic, setup, atol=atol, with_default=not args.no_default)
    with tempfile.TemporaryDirectory(prefix="penelope-model-") as tmp:
        model = args.model or str(tiny_model(tmp, seed=args.seed))
        try:
            report = check(model, spec, progress=lambda step: print(f"penelope verify: running {step} ...",
                                                                     file=sys.stderr, flush=True))
        except RuntimeError as error:
            # An Engine failed to start or serve: its own last lines say why.
            print(f"penelope: error: {error}", file=sys.stderr)
            return 1
    print(sglang_summary(report))
    if args.json:
        write_text(args.json, json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0 if report["passed"] else 1


def sglang_summary(report: dict) -> str:
    """A few lines for people about an `--engine sglang` check."""
    setup, traffic, comparison = report["setup"], report["traffic"], report["comparison"]
    lines = [f"SGLang Engine, {traffic['sessions']} sessions x {traffic['turns']} turns, pool "
             f"{setup['pool_tokens']} tokens, page {setup['page_size']}, chunk {setup['chunk']}, {setup['rows']} rows, "
             f"policy {setup['policy']}, {setup['dtype']} on {setup['device']}"]
    for name, run in report["runs"].items():
        lines.append(f"  {name:9s}: {run['prefill_tokens']} prefill tokens, {run['recomputed_tokens']} recomputed "
                     f"(cost {run['recomputed_cost']:.3g}), phantoms {run['phantom_tokens']}, hole chunks "
                     f"{run['chunk_refill_tokens']}, ragged-kernel batches {run.get('ragged_batches') or 0}; start "
                     f"{run['start_s']} s, serve {run['serve_s']} s")
        tiers = run.get("tiers") or {}
        if tiers:
            lines.append(f"  {'':9s}  CPU tier: {tiers['loads']} loads ({tiers['loaded_tokens']} tokens), "
                         f"{tiers['swap_loads']} through the swap buffer ({tiers['swapped_tokens']} tokens), "
                         f"{tiers['demotions']} demotions ({tiers['demoted_tokens']} tokens), {tiers['copy']} copies")
    tokens = "identical" if comparison["identical_tokens"] else f"DIFFERENT in {comparison['different']}"
    lines.append(f"{comparison['requests']} requests, {comparison['unfinished']} unfinished; tokens {tokens}; "
                 f"max |logprob diff| {comparison['max_logprob_diff']:.3g} (atol {report['atol']})")
    if not report.get("evicted_tokens"):
        lines.append("the small pool never evicted, so nothing was refilled or loaded: lower --cache-tokens")
    if not report["probe_outputs_differ"]:
        lines.append("the model's outputs do not depend on early tokens: this check cannot see wrong KV")
    lines.append("PASS" if report["passed"] else "FAIL")
    return "\n".join(lines)
