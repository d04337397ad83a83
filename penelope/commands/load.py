"""`penelope load`: replay agent sessions against a running server and measure what it serves.

Closed-loop replay of WEKA traces or the embedded synthetic sessions (open loop for Mooncake
JSONL, at the recorded times) against SGLang's `/generate` or an OpenAI-compatible
`/v1/completions`, prompts as token ids, replies streamed: TTFT, ITL, end-to-end latency, JCT,
throughput and the cached tokens the server reports, each with a 95% interval over `--repeat`
runs, beside the client's own overhead. See `penelope.loadgen` and docs/loadgen.md.
"""

from __future__ import annotations

import sys

MAX_REPEAT = 1000

# `run_load`'s repeats is this command's --repeat (the library's errors name fields).
FIELD_ARGUMENTS = {"repeats": "repeat"}


def add_parser(subparsers) -> None:
    from penelope.commands.workload_options import add_turn_arguments, add_workload_arguments, leave_scoped_unset
    from penelope.loadgen.apis import APIS, GENERATE
    from penelope.loadgen.prime import add_prime_argument

    parser = subparsers.add_parser(
        "load",
        help="replay agent sessions against a running server (SGLang or OpenAI API) and measure TTFT",
        description=(
            "Load generator: replays a workload against a running server, streamed, prompts as token ids that "
            "carry the server's own replies into the next turn. Prints TTFT, ITL, E2E, JCT, throughput, the "
            "cached fraction the server reports and errors, with 95%% intervals over --repeat runs. Options "
            "that do not apply to the workload are refused: --sessions and --think-time with an open-loop "
            "(Mooncake) trace, --overflow, --subagents and --no-shared-prefix with a workload other than WEKA."
        ),
    )
    parser.add_argument("--url", required=True, help="the server, http://HOST:PORT")
    parser.add_argument("--api", default=GENERATE, choices=APIS,
                        help="generate: SGLang's /generate with input_ids (default); openai: /v1/completions")
    add_workload_arguments(parser)
    parser.set_defaults(max_context=None)
    add_turn_arguments(parser)
    add_prime_argument(parser)
    parser.add_argument("--scale", type=float, default=1.0, metavar="X",
                        help="divide every token count by X (prompts, replies, blocks), for a scaled model (default 1)")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                        help="every wait between requests X times as long: open-loop arrivals, closed-loop think "
                        "times (default 1)")
    parser.add_argument("--sessions", type=int, default=4, help="closed loop: sessions at once (default 4)")
    parser.add_argument("--max-requests", type=int, metavar="N", help="send at most N requests per run")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="stop each run after S seconds (requests in flight are cut)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="runs, one after the other, the server's cache flushed before each (default 1)")
    parser.add_argument("--no-flush", action="store_true", help="do not flush the server's prefix cache before a run")
    parser.add_argument("--vocab", type=int, metavar="N",
                        help="ids below N (default: vocab_size of the server's model folder, when readable here)")
    parser.add_argument("--context", type=int, metavar="N",
                        help="the server's context in tokens (default: what the server reports)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--hints", action="store_true",
                        help="tell the server what each session waits for after a reply (tool or human), as "
                        "Penelope's agent-aware policies read it")
    parser.add_argument("--read-timeout", type=float, default=600.0, metavar="S",
                        help="a request fails after S seconds without data (default 600)")
    parser.add_argument("--records", metavar="FILE.jsonl", help="write every request's record, as it finishes")
    parser.add_argument("--json", metavar="FILE", help="write the configuration and results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw TTFT's distribution, TTFT by prompt length, "
                        "reuse by turn")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    # After every argument: options that apply to some workloads only are None unless given.
    leave_scoped_unset(parser)


def run(args) -> int:
    import dataclasses

    from penelope.commands.progress import progress_bar
    from penelope.commands.simulate_json import write_json
    from penelope.commands.workload_options import (
        check_workload_options,
        fill_scoped_defaults,
        left_out_line,
        load_from_args,
        read_early,
        workload_inputs,
    )
    from penelope.errors import Interrupted, UsageError
    from penelope.jsonfile import json_ready
    from penelope.loadgen.client import Sampling
    from penelope.loadgen.prime import check_prime
    from penelope.loadgen.records import RecordWriter
    from penelope.loadgen.report import counts_line, overhead_line, plot_runs, results_table
    from penelope.loadgen.runner import LoadConfig, check_fits, check_scale, run_load
    from penelope.loadgen.summary import estimates, summarize
    from penelope.loadgen.target import base_url, probe_server
    from penelope.loadgen.tokens import TokenSpace
    from penelope.outputs import check_outputs
    from penelope.sim.workloads.time_scale import check_time_scale, scale_time
    from penelope.sim.workloads.turns import parse_turns
    from penelope.units import MAX_SIZE

    given = fill_scoped_defaults(args)
    config = LoadConfig(sessions=args.sessions, max_requests=args.max_requests, duration=args.duration,
                        read_timeout=args.read_timeout, sampling=Sampling(temperature=args.temperature),
                        hints=args.hints, prime=args.prime)
    if not 1 <= args.repeat <= MAX_REPEAT:
        raise UsageError(f"--repeat must be in [1, {MAX_REPEAT}], got {args.repeat}")
    from_context, _ = parse_turns(args.from_context, args.turns)
    for flag, value in (("--vocab", args.vocab), ("--context", args.context)):
        if value is not None and value < 2:
            raise UsageError(f"{flag} must be at least 2, got {value}")
    TokenSpace(vocab=args.vocab or 2, seed=args.seed, scale=args.scale)
    check_time_scale(args.time_scale)
    base_url(args.url)
    check_outputs({"--records": args.records, "--json": args.json, "--plot": args.plot},
                  workload_inputs(args, args.trace))

    # The workload's options, and the trace itself, before the server is contacted (its context
    # may set --max-context; a trace is then read whole here and again below).
    check_workload_options(args, args.trace, given)
    early = read_early(args, args.trace)
    if early is not None:
        check_prime(early[0], prime=args.prime, sessions=args.sessions, max_requests=None)
        check_scale(early[0], TokenSpace(vocab=2, scale=args.scale))
    target = probe_server(args.url, args.api, vocab=args.vocab, context=args.context)
    if early is not None and early[2]:
        workload, description, _ = early
    else:
        if target.max_prompt:
            # The longest prompt the server takes, in the trace's (unscaled) tokens.
            bound = int(target.max_prompt * args.scale)
            if bound > MAX_SIZE:
                raise UsageError(f"--scale {args.scale:g}: the server's longest prompt, {target.max_prompt:,} tokens, "
                                 f"is {bound:,} trace tokens at this scale, beyond the longest context "
                                 f"({MAX_SIZE:,}); give a smaller --scale, or --max-context")
            args.max_context = bound
        else:
            args.max_context = "128K"
        workload, description = load_from_args(args, args.trace)
    check_prime(workload, prime=args.prime, sessions=args.sessions, max_requests=args.max_requests)
    left_out = left_out_line(workload, from_context)
    workload = scale_time(workload, args.time_scale)
    space = TokenSpace(vocab=target.vocab, seed=args.seed, scale=args.scale)
    check_scale(workload, space)
    check_fits(workload, space, target, args.max_requests)

    print_header(target, workload, description, args)
    if left_out:
        print(left_out)
    per_run = workload.num_requests if args.max_requests is None else min(args.max_requests, workload.num_requests)
    bar = progress_bar(per_run * args.repeat, args.no_progress)
    writer = RecordWriter(args.records)

    def on_record(record):
        writer.write(record)
        if bar is not None:
            bar.update(1)

    try:
        results = run_load(target, workload, space, config, repeats=args.repeat, flush=not args.no_flush,
                           on_record=on_record)
    except KeyboardInterrupt:
        kept = f"; wrote the {writer.written:,} requests that ended to {args.records}" if args.records else ""
        raise Interrupted(f"interrupted{kept}") from None
    finally:
        writer.close()
        if bar is not None:
            bar.close()

    summaries = [summarize(r) for r in results]
    print()
    print(results_table(summaries))
    print(overhead_line(summaries))
    print(counts_line(summaries))
    for result in results:
        if result.flush_error:
            print(f"run {result.repeat}: the server's cache was not flushed before it: {result.flush_error}",
                  file=sys.stderr)
    if args.records:
        print(f"wrote {args.records}")
    if args.json:
        payload = {
            "config": {"url": target.url, "api": args.api, "scale": args.scale, "seed": args.seed,
                       "time_scale": args.time_scale, "turns": args.turns,
                       "repeat": args.repeat,
                       "flush": not args.no_flush, **dataclasses.asdict(config), "workload": description},
            "server": target.as_dict(),
            "runs": [s.as_dict() for s in summaries],
            "estimates": {name: e.as_dict() for name, e in estimates(summaries).items()},
            "records": args.records,
        }
        write_json(args.json, json_ready(payload))
        print(f"wrote {args.json}")
    if args.plot:
        records = [record for result in results for record in result.records]
        plot_runs(args.plot, records, f"{target.url} ({args.api}), {description['format']}, scale {args.scale:g}")
        print(f"wrote {args.plot}")
    return 0


def print_header(target, workload, description: dict, args) -> None:
    server = dict(target.info)
    if server.get("radix_cache_backend"):
        # A plugged-in cache (Penelope's) takes its policy from its own config, not this option.
        server.pop("radix_eviction_policy", None)
    settings = ", ".join(f"{k} {v}" for k, v in server.items() if v not in (None, False)) or "not reported"
    print(f"server: {target.endpoint}, vocab {target.vocab:,}, context "
          + (f"{target.max_total:,}" if target.max_total else "unknown") + f" ({settings})")
    if not target.ids_from_server:
        print("  the API sends no reply ids: deterministic ids of each reply's length stand for them in the next "
              "prompt")
    if not target.cache_report:
        print("  the server does not report cached tokens (SGLang's OpenAI API: --enable-cache-report)")
    loop = f"closed loop, {args.sessions} sessions at once" if workload.closed_loop else \
        "open loop at the recorded arrival times"
    think = description["think_time"]
    print(f"workload: {description['format']} {description['trace'] or ''}".rstrip()
          + f": {len(workload.sessions):,} sessions, {workload.num_requests:,} requests, {loop}; token counts / "
          f"{args.scale:g}, think time {think['mode']}"
          + (f" x{think['scale']:g}" if think["scale"] != 1 else "")
          + (f" capped at {think['cap']:g} s" if think["cap"] is not None else "")
          + (f", waits x{args.time_scale:g}" if args.time_scale != 1 else ""))
    bounds = [f"at most {args.max_requests:,} requests" if args.max_requests else "",
              f"at most {args.duration:g} s" if args.duration else ""]
    bounds = " and ".join(b for b in bounds if b)
    print(f"{args.repeat} run{'s' if args.repeat > 1 else ''}" + (f", each {bounds}" if bounds else ""))
