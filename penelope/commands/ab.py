"""`penelope ab`: the same agent traffic against one SGLang server per cache configuration,
repeats interleaved, each configuration's change against a baseline paired run by run.

    penelope ab penelope sglang-lru sglang-tlru --baseline sglang-lru --model tiny --pool 4096 \\
        --sessions 2 --limit-sessions 4 --turns 6 --scale 16 --repeat 3 --out ab-out

See `penelope.loadgen.ab_configs` (the configurations), `penelope.loadgen.ab_runner` (the runs)
and docs/ab.md.
"""

from __future__ import annotations

MAX_REPEAT = 100

# Fields of the library's set-ups (named in its errors) that this command fills from an argument of
# another name: `ServerSetup`'s page, attention and extra, the runner's repeats, `TLRUParams`'.
FIELD_ARGUMENTS = {"page": "page_size", "attention": "attention_backend", "extra": "server_arg", "repeats": "repeat",
                   "threshold": "tlru_threshold", "next_prompt_estimate": "tlru_next_prompt"}


def add_parser(subparsers) -> None:
    from penelope.commands.workload_options import add_turn_arguments, add_workload_arguments, leave_scoped_unset
    from penelope.loadgen.ab_configs import DEVICES, NAMES
    from penelope.loadgen.prime import add_prime_argument

    parser = subparsers.add_parser(
        "ab",
        help="A/B: replay one workload against SGLang servers of several cache configurations, paired changes",
        description=(
            "Starts one SGLang server per configuration (same model, pool, page, chunk, seed, attention backend), "
            "one at a time on 127.0.0.1, replays the same sessions against each (as penelope load does), "
            "interleaving repeats in rotated order, and prints each configuration's change against the baseline "
            "paired run by run with 95% intervals. Configurations: " + ", ".join(NAMES)
            + "; penelope:POLICY and penelope-tier:POLICY for Penelope's other policies. Every option is checked "
            "before the first server starts; one that applies to none of the configurations named (--tlru-*, "
            "--slru-protected, --host-tokens), to no warm-up (--warmup-requests with --warmup 0) or not to the "
            "workload (--sessions, --think-time with a Mooncake trace; --overflow, --subagents, "
            "--no-shared-prefix with another than WEKA) is refused."
        ),
    )
    parser.add_argument("configs", nargs="+", metavar="CONFIG", help="configurations to compare (two or more)")
    parser.add_argument("--baseline", metavar="CONFIG", help="the configuration others are compared with "
                        "(default: the first)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output folder: server logs, records-CONFIG.jsonl, ab.json, ab.png")
    server = parser.add_argument_group("servers (the same for every configuration)")
    server.add_argument("--model", required=True,
                        help="checkpoint folder or hub id; 'tiny' (a tiny random Qwen3) or 'scale:S' (the scale "
                        "model of Qwen3-8B at scale S) are written into the output folder")
    server.add_argument("--device", default="cpu", choices=DEVICES, help="cpu (default) or cuda")
    server.add_argument("--pool", type=int, required=True, metavar="TOKENS",
                        help="KV pool in tokens (--max-total-tokens): size it below the working set to force eviction")
    server.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    server.add_argument("--chunk", type=int, default=1024, metavar="TOKENS",
                        help="--chunked-prefill-size (default 1024)")
    server.add_argument("--server-seed", type=int, default=0, help="the servers' --random-seed (default 0)")
    server.add_argument("--attention-backend", metavar="NAME",
                        help="default on CPU: torch_native_prefix (cached tokens cost no attention, as on a GPU); "
                        "on cuda: SGLang's default (FA3 on Hopper)")
    server.add_argument("--host-tokens", type=int, metavar="TOKENS",
                        help="host tier of penelope-tier and sglang-hicache (default: twice the pool)")
    server.add_argument("--tlru-threshold", type=int, metavar="TOKENS",
                        help="sglang-tlru's threshold (default: its next-prompt estimate plus one chunk)")
    server.add_argument("--tlru-next-prompt", type=int, metavar="TOKENS",
                        help="sglang-tlru's next_prompt_estimate (default: the median tokens a turn appends to its "
                        "session's history, after --scale)")
    server.add_argument("--slru-protected", type=int, metavar="N",
                        help="sglang-slru's protected_threshold (default: SGLang's, 2)")
    server.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="a further sglang.launch_server option for every server, e.g. "
                        "--server-arg=--mem-fraction-static=0.8 (repeatable)")
    server.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                        help="seconds a server may take to answer /health (default 600)")
    runs = parser.add_argument_group("runs")
    runs.add_argument("--repeat", type=int, default=1, metavar="N",
                      help="runs per configuration, interleaved in rotated order (default 1)")
    runs.add_argument("--warmup", type=int, default=1, metavar="N",
                      help="unmeasured runs of the workload after each server start, the cache flushed after "
                      "them (default 1)")
    runs.add_argument("--warmup-requests", type=int, metavar="N",
                      help="at most N requests per warm-up run (default: the whole workload)")
    kept = runs.add_mutually_exclusive_group()
    kept.add_argument("--keep-servers", action="store_true",
                      help="keep each configuration's server up across its repeats (cache flushed between runs; "
                      "faster, but a configuration's runs are then back to back, not interleaved)")
    kept.add_argument("--resident-servers", action="store_true",
                      help="start every configuration's server once and keep them all up together; the rounds stay "
                      "interleaved, each on a flushed cache (start-up paid once per configuration; needs the memory "
                      "of every server at once)")
    add_workload_arguments(runs)
    runs.set_defaults(max_context=None)
    add_turn_arguments(runs)
    add_prime_argument(runs)
    runs.add_argument("--scale", type=float, default=1.0, metavar="X",
                      help="divide every token count by X, for a scaled model (default 1)")
    runs.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                      help="every wait between requests X times as long (default 1)")
    runs.add_argument("--sessions", type=int, default=4, help="closed loop: sessions at once (default 4)")
    runs.add_argument("--max-requests", type=int, metavar="N", help="send at most N requests per run")
    runs.add_argument("--duration", type=float, metavar="S", help="stop each run after S seconds")
    runs.add_argument("--vocab", type=int, metavar="N",
                      help="ids below N (default: vocab_size of the model's config.json)")
    runs.add_argument("--hints", action="store_true",
                      help="tell the servers what each session waits for (Penelope's agent-aware policies read it)")
    runs.add_argument("--read-timeout", type=float, default=600.0, metavar="S",
                      help="a request fails after S seconds without data (default 600)")
    runs.add_argument("--no-plot", action="store_true", help="do not draw ab.png")
    runs.add_argument("--no-progress", action="store_true", help="no progress bar (the lines per run stay)")
    # After every argument: options that apply to some workloads only are None unless given.
    leave_scoped_unset(parser)


def run(args) -> int:
    import dataclasses
    import json
    import math
    import time
    from pathlib import Path

    from penelope.commands.progress import progress_bar
    from penelope.commands.simulate_json import write_json
    from penelope.commands.workload_options import (
        DEFAULT_MAX_CONTEXT,
        check_workload_options,
        fill_scoped_defaults,
        left_out_line,
        load_from_args,
        read_early,
        workload_inputs,
    )
    from penelope.errors import Interrupted, UsageError
    from penelope.jsonfile import json_ready
    from penelope.loadgen.ab_configs import CPU_ATTENTION, ServerSetup, TLRUParams, default_tlru, parse_configs
    from penelope.loadgen.ab_report import plot_ab, report_payload, report_text
    from penelope.loadgen.ab_runner import FRESH, KEPT, RESIDENT, ABRunner, run_outputs, sglang_server_factory
    from penelope.loadgen.client import Sampling
    from penelope.loadgen.models import (
        check_model,
        check_vocab,
        config_value,
        is_generated,
        model_scale,
        prepare_model,
    )
    from penelope.loadgen.prime import check_prime
    from penelope.loadgen.runner import LoadConfig, check_fits, check_scale
    from penelope.loadgen.server import CPU_ENV
    from penelope.loadgen.target import vocab_of
    from penelope.loadgen.tokens import TokenSpace
    from penelope.outputs import check_folder, check_outputs
    from penelope.sim.workloads.time_scale import check_time_scale, scale_time
    from penelope.sim.workloads.turns import parse_turns
    from penelope.units import parse_size

    given = fill_scoped_defaults(args)
    if not 1 <= args.repeat <= MAX_REPEAT:
        raise UsageError(f"--repeat must be in [1, {MAX_REPEAT}], got {args.repeat}")
    from_context, _ = parse_turns(args.from_context, args.turns)
    if args.warmup < 0:
        raise UsageError(f"--warmup must be a non-negative integer, got {args.warmup}")
    if args.warmup_requests is not None and args.warmup_requests < 1:
        raise UsageError(f"--warmup-requests must be at least 1, got {args.warmup_requests}")
    if args.warmup_requests is not None and not args.warmup:
        raise UsageError("--warmup-requests applies to warm-up runs: give --warmup N > 0")
    servers = RESIDENT if args.resident_servers else KEPT if args.keep_servers else FRESH
    if args.vocab is not None and args.vocab < 2:
        raise UsageError(f"--vocab must be at least 2, got {args.vocab}")
    if not (math.isfinite(args.startup_timeout) and args.startup_timeout > 0):
        raise UsageError(f"--startup-timeout must be a positive number of seconds, got {args.startup_timeout}")
    if args.model.startswith("scale:"):
        model_scale(args.model)
    check_time_scale(args.time_scale)
    TokenSpace(vocab=args.vocab or 2, seed=args.seed, scale=args.scale)
    if not is_generated(args.model):
        check_model(args.model, args.vocab)
    load = LoadConfig(sessions=args.sessions, max_requests=args.max_requests, duration=args.duration,
                      read_timeout=args.read_timeout, sampling=Sampling(temperature=0.0), hints=args.hints,
                      prime=args.prime)
    attention = args.attention_backend or (CPU_ATTENTION if args.device == "cpu" else None)
    tlru = None
    if args.tlru_threshold is not None and args.tlru_next_prompt is not None:
        tlru = TLRUParams(args.tlru_threshold, args.tlru_next_prompt)

    setup = ServerSetup(model=args.model, pool=args.pool, device=args.device, page=args.page_size, chunk=args.chunk,
                        server_seed=args.server_seed, attention=attention, host_tokens=args.host_tokens,
                        tlru=tlru or TLRUParams(1, 0), slru_protected=args.slru_protected,
                        extra=tuple(args.server_arg))
    # One T-LRU value alone: the other comes from the workload, read later; what is known is checked now.
    if tlru is None and args.tlru_threshold is not None:
        # The estimate is at least 0: the threshold must exceed 0 already.
        TLRUParams(args.tlru_threshold, 0)
    if tlru is None and args.tlru_next_prompt is not None:
        # The threshold will be the estimate plus one chunk.
        TLRUParams(args.tlru_next_prompt + setup.chunk, args.tlru_next_prompt)
    # Names and combinations are checked before any model is written or workload read.
    named, _ = parse_configs(args.configs, setup, args.baseline)
    check_configs_options(args, [config.name for config in named])
    out = check_folder("--out", args.out)
    # Nothing the run writes may be an input (a trace, a calibration, a model's config) or a
    # .json inside the trace folder.
    written = [out / "ab.json", out / "ab.png", *run_outputs(out, named, args.repeat, servers)]
    check_outputs({f"--out {args.out}: {path.name}": str(path) for path in written},
                  workload_inputs(args, args.trace), plots=())

    # The workload's options, and the trace itself, before a model is written (the model's context
    # may set --max-context: a trace is then read whole here and again below).
    check_workload_options(args, args.trace, given)
    early = read_early(args, args.trace)
    if early is not None:
        check_prime(early[0], prime=args.prime, sessions=args.sessions, max_requests=None)
        check_scale(early[0], TokenSpace(vocab=2, scale=args.scale))
    model = str(prepare_model(args.model, out / "model")) if is_generated(args.model) else args.model
    if is_generated(args.model):
        check_vocab(args.model, args.vocab, vocab_of(model))
    if early is not None and early[2]:
        workload, description, _ = early
    else:
        # The model's context in the trace's tokens (at most the workloads' usual 128K), not the
        # pool's: the pool must not change the workload. Requests the pool cannot hold are named
        # before any server starts.
        context = config_value(model, "max_position_embeddings")
        args.max_context = min(parse_size(DEFAULT_MAX_CONTEXT, "--max-context"),
                               int((context - 7) * args.scale)) if context else DEFAULT_MAX_CONTEXT
        workload, description = load_from_args(args, args.trace)
    check_prime(workload, prime=args.prime, sessions=args.sessions, max_requests=args.max_requests)
    left_out = left_out_line(workload, from_context)
    workload = scale_time(workload, args.time_scale)
    space = TokenSpace(vocab=args.vocab or 2, seed=args.seed, scale=args.scale)
    check_scale(workload, space)
    # What every server will take at most: SGLang's longest request is below its KV pool
    # (`penelope.loadgen.target`); its context may bound it further, checked once it runs.
    try:
        check_fits(workload, space, pool_target(args.pool), args.max_requests)
    except UsageError as err:
        raise UsageError(f"--pool {args.pool}: {err}") from None
    if tlru is None:
        estimate = args.tlru_next_prompt
        if estimate is None:
            estimate = default_tlru(setup, appended_tokens(workload, space)).next_prompt_estimate
        tlru = TLRUParams(args.tlru_threshold if args.tlru_threshold is not None else estimate + setup.chunk, estimate)
    setup = dataclasses.replace(setup, model=model, tlru=tlru)
    configs, baseline = parse_configs(args.configs, setup, args.baseline)

    print(f"servers: {model} on {args.device}, pool {args.pool:,} tokens, pages of {args.page_size}, chunks of "
          f"{args.chunk}, seed {args.server_seed}, attention {attention or 'SGLang default'}")
    for config in configs:
        print(f"  {config.name}: {' '.join(config.args) or '(defaults)'}")
    print(f"workload: {description['format']} {description['trace'] or ''}".rstrip()
          + f": {len(workload.sessions):,} sessions, {workload.num_requests:,} requests, {args.sessions} at once; "
          f"token counts / {args.scale:g}; {args.repeat} run{'s' if args.repeat > 1 else ''} per configuration"
          + {FRESH: ", a fresh server per run", KEPT: ", servers kept up across runs",
             RESIDENT: ", every server up at once, rounds interleaved"}[servers], flush=True)
    if left_out:
        print(left_out, flush=True)

    per_run = workload.num_requests if args.max_requests is None else min(args.max_requests, workload.num_requests)
    bar = progress_bar(per_run * args.repeat * len(configs), args.no_progress)

    def say(line: str) -> None:
        if bar is not None:
            bar.write(line)
        else:
            print(line, flush=True)

    env = {**CPU_ENV} if args.device == "cpu" else {}
    runner = ABRunner(configs, baseline, workload, load, scale=args.scale, seed=args.seed, page=args.page_size,
                      out=out, start_server=sglang_server_factory(setup, env, args.startup_timeout),
                      repeats=args.repeat, servers=servers, warmup=args.warmup,
                      warmup_requests=args.warmup_requests,
                      vocab=args.vocab or config_value(model, "vocab_size"),
                      say=say, on_record=(lambda name, record: bar.update(1)) if bar is not None else None)
    began = time.perf_counter()
    try:
        result = runner.run()
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - began

    print()
    print(report_text(result))
    payload = report_payload(result)
    payload["setup"] = {**dataclasses.asdict(setup), "model_spec": args.model, "tlru": dataclasses.asdict(tlru)}
    payload["workload"] = {**description, "turns": args.turns, "scale": args.scale,
                           "time_scale": args.time_scale,
                           "sessions": args.sessions, "requests": workload.num_requests}
    payload["load"] = json.loads(json.dumps(dataclasses.asdict(load), default=str))
    payload["elapsed_s"] = elapsed
    write_json(str(out / "ab.json"), json_ready(payload))
    print(f"wrote {out / 'ab.json'} and records-CONFIG.jsonl, server logs in {out} ({elapsed:.0f} s)")
    if not args.no_plot and result.runs:
        try:
            plot_ab(str(out / "ab.png"), result, f"{Path(args.model).name}, {description['format']}, scale "
                    f"{args.scale:g}, pool {args.pool:,}")
            print(f"wrote {out / 'ab.png'}")
        except ImportError:
            print("matplotlib is not installed: no plot")
    if result.error is not None:
        raise result.error
    if result.interrupted:
        error = Interrupted(f"interrupted after {len(result.runs)} runs; kept in {out}")
        # The CLI tells SIGTERM (exit 143) from Ctrl-C (130) by what was being handled.
        error.__context__ = result.stop
        raise error
    return 0


def appended_tokens(workload, space) -> list[int]:
    """Tokens each turn after a session's first adds to its history (prompt less the previous
    prompt and reply), as served; every first prompt's length when no session has a second turn."""
    from penelope.loadgen.tokens import planned_lengths

    added, firsts = [], []
    for session in workload.sessions:
        lengths = planned_lengths(space, workload.block_size, session, workload.closed_loop)
        firsts += [prompt for prompt, _ in lengths[:1]]
        for (prompt, reply), (after, _) in zip(lengths, lengths[1:], strict=False):
            added.append(max(0, after - prompt - reply))
    return added or firsts


def check_configs_options(args, names: list[str]) -> None:
    """UsageError for an option given for a configuration that is not among `names`."""
    from penelope.errors import UsageError
    from penelope.loadgen.ab_configs import PENELOPE_TIER, SGLANG_HICACHE

    bases = {name.partition(":")[0] for name in names}
    for flag, value, wanted in (("--tlru-threshold", args.tlru_threshold, ("sglang-tlru",)),
                                ("--tlru-next-prompt", args.tlru_next_prompt, ("sglang-tlru",)),
                                ("--slru-protected", args.slru_protected, ("sglang-slru",)),
                                ("--host-tokens", args.host_tokens, (PENELOPE_TIER, SGLANG_HICACHE))):
        if value is not None and not bases & set(wanted):
            raise UsageError(f"{flag} applies to {' or '.join(wanted)} only; the configurations are "
                             f"{', '.join(names)}")


def pool_target(pool: int):
    """A stand-in `Target` for `check_fits` before any server starts: SGLang takes requests of at
    most `pool - 1` tokens, prompts below that less 5 (`penelope.loadgen.target`'s margin)."""
    from penelope.loadgen.target import SGLANG_INPUT_MARGIN, Target

    # SGLang's max_req_len is pool - 1 at most, its max_req_input_len 5 fewer.
    max_input = pool - 1 - (SGLANG_INPUT_MARGIN - 1)
    return Target(url="", api="generate", vocab=2, max_prompt=max_input - 1,
                  max_total=max_input + SGLANG_INPUT_MARGIN - 1)
