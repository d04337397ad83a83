"""`penelope analyze`: what a trace says about KV caching before any policy is chosen.

Request lengths, the shared prefix, the hit rate of a cache that never evicts, the reuse
distance, for an open-loop trace its offered load and the replicas it needs to stay below
saturation (`penelope.sim.fleet.saturation`), and the estimated Penelope gain at one capacity from a
quick replay (SGLang vs Penelope, the same server model as `penelope simulate`, on that many
replicas). See `penelope.sim.analysis`.
"""

from __future__ import annotations

from penelope.tables import format_table
from penelope.units import format_size

# The workload's `trace` field is this command's PATH (the library's errors name fields).
FIELD_ARGUMENTS = {"trace": "path"}


def add_parser(subparsers) -> None:
    from penelope.commands.fleet_options import add_fleet_arguments
    from penelope.commands.workload_options import add_workload_arguments, leave_scoped_unset
    from penelope.sim.timemodel import GPUS

    parser = subparsers.add_parser(
        "analyze",
        help="request lengths, shared prefix, unbounded hit rate, reuse distance, estimated gain",
        description=(
            "Summarize a trace for KV caching: request length distribution, shared prefix, hit rate "
            "under an unbounded cache, reuse distance, and the estimated Penelope gain at one GPU "
            "capacity (a quick replay of SGLang and Penelope)."
        ),
    )
    parser.add_argument("path", nargs="?", metavar="PATH", help="WEKA trace folder or file, or Mooncake JSONL")
    add_workload_arguments(parser, trace_flag=False)
    parser.add_argument("--model", default="qwen3-8b", help="built-in model name or a config.json path")
    parser.add_argument("--gpu", default="h100", help=f"GPU of the time model's estimates: {' | '.join(GPUS)}")
    parser.add_argument("--calibration", metavar="FILE", help="calibration JSON overriding the time model")
    parser.add_argument("--gpu-cache", help="capacity of the gain estimate (default: the paper's for the model)")
    parser.add_argument("--sessions", type=int, default=4, help="sessions active at once (closed loop)")
    parser.add_argument(
        "--scheduler", default="lpm", help="waiting-queue order: lpm (longest prefix match first) | fcfs"
    )
    parser.add_argument("--chunk-size", default="8K", help="prefill tokens per batch")
    add_fleet_arguments(
        parser, sweep=False,
        replicas_help="default: 1 for closed-loop workloads; for open-loop traces the replicas the offered load "
        "needs at 80%% utilization",
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    leave_scoped_unset(parser)


def run(args) -> int:
    import dataclasses

    from penelope.commands.progress import progress_bar
    from penelope.commands.simulate_json import write_json
    from penelope.commands.spec import simulation_spec
    from penelope.commands.workload_options import check_workload_options, fill_scoped_defaults, workload_inputs
    from penelope.errors import UsageError
    from penelope.memory import check_memory
    from penelope.outputs import check_outputs
    from penelope.sim.analysis import reuse_distances, reuse_summary, shared_prefix, unbounded_hit_rate
    from penelope.sim.api import prepare
    from penelope.sim.fleet.report import fleet_label, offered_load_lines
    from penelope.sim.fleet.saturation import MIN_SATURATED_WAIT, offered_load
    from penelope.sim.replay import replay_memory
    from penelope.sim.run import baseline_of, json_ready, run_policies
    from penelope.sim.workloads.types import workload_stats
    from penelope.tables import percent

    given = fill_scoped_defaults(args)
    if args.path is None and args.format != "synthetic":
        raise UsageError("analyze needs a trace PATH (or --format synthetic)")
    check_workload_options(args, args.path, given)
    if args.gpu_cache and "," in args.gpu_cache:
        raise UsageError("--gpu-cache: analyze estimates the gain at one capacity")
    check_outputs({"--json": args.json}, workload_inputs(args, args.path))
    chosen = args.replicas
    if chosen is not None and chosen < 1:
        raise UsageError(f"--replicas must be at least 1, got {chosen}")
    args.replicas = chosen or 1
    setup = prepare(simulation_spec(args, args.path), sweep_routers=False, replicas_chosen_later=chosen is None)
    workload = setup.workload
    capacity = setup.capacities[0]
    stats = workload_stats(workload)
    prefix = shared_prefix(workload)
    unbounded = unbounded_hit_rate(workload)
    load = None
    if not workload.closed_loop:
        load = offered_load(workload, setup.time_model, setup.cost, capacity)
        if chosen is None and load.span > 0:
            args.replicas = load.replicas_needed(0.8)
            # `prepare` checked one replica's memory; every replica holds its own cache.
            check_memory(replay_memory(workload, capacity, 64) * args.replicas,
                         f"replaying {workload.num_requests:,} requests in a cache of {format_size(capacity)} tokens "
                         f"on each of {args.replicas} replicas")
    if args.replicas == 1:
        given = [flag for flag, value in (("--router", args.router), ("--cache-threshold", args.cache_threshold),
                                          ("--balance-abs-threshold", args.balance_abs_threshold),
                                          ("--balance-rel-threshold", args.balance_rel_threshold)) if value is not None]
        if given:
            loop = "closed" if workload.closed_loop else "open"
            raise UsageError(f"{given[0]} applies to replicas behind a router: this {loop}-loop workload is "
                             "replayed on one server (give --replicas N > 1)")
    config = dataclasses.replace(setup.make_config(capacity), replicas=args.replicas)

    policies = ["sglang", "penelope"]
    bar = progress_bar(workload.num_requests * len(policies), args.no_progress)
    try:
        results = run_policies(workload, policies, config, setup.time_model, setup.cost, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    base = baseline_of(results)
    shared = int(prefix["all_sessions"])
    reuse = reuse_summary(reuse_distances(base.replay.records, shared), shared, capacity)

    describe = setup.config["workload"]
    print(f"workload: {describe['format']} {describe['trace'] or ''}".rstrip()
          + f": {stats['sessions']:,} sessions, {stats['requests']:,} requests")
    print(format_table(
        ("tokens", "p10", "p50", "p90", "max"),
        [("input", *(_tokens(stats[f"input_{q}"]) for q in ("p10", "p50", "p90", "max")))],
    ))
    print(f"output tokens: p50 {stats['output_p50']:,.0f}, mean {stats['output_mean']:,.0f}")
    if stats["extension_fraction"] == stats["extension_fraction"]:
        turns = f"turns: {stats['extension_fraction']:.0%} extend the previous input, " \
            f"{stats['compaction_fraction']:.1%} compactions; "
    else:
        # NaN: no session has a second turn (an open-loop trace without --conversations prefix).
        turns = "turns: every session is a single request; "
    if workload.closed_loop:
        print(turns + f"tool waits p50 {stats['tool_wait_p50']:.0f} s, p90 {stats['tool_wait_p90']:.0f} s; "
              f"human turns {stats['human_fraction']:.0%}")
    else:
        print(turns + "open loop: requests sent at their recorded arrival times")
    print(f"shared prefix: {_tokens(prefix['all_sessions'])} tokens common to all sessions; "
          f"longest shared with another session p50 {_tokens(prefix['pairwise_p50'])}, "
          f"max {_tokens(prefix['pairwise_max'])}")
    print(f"hit rate under an unbounded cache: {unbounded['hit_rate']:.1%}")
    traffic = f"{args.sessions} sessions at once" if workload.closed_loop else "every request in send order"
    if args.replicas > 1:
        traffic += f", all {args.replicas} replicas' traffic together"
    if reuse["reuses"]:
        print(f"reuse distance ({traffic}): p50 {_tokens(reuse['p50'])}, "
              f"p90 {_tokens(reuse['p90'])}, max {_tokens(reuse['max'])} tokens; "
              f"an LRU cache of {format_size(capacity)} keeps the history for {reuse['lru_fit']:.0%} of reuses")
    else:
        print("reuse distance: none to measure, no session sends a second request")
    if load is not None:
        for line in offered_load_lines(load, capacity, args.replicas):
            print(line)
    if args.replicas > 1:
        how = "given" if chosen else "the offered load's count at 80% utilization"
        print(f"replayed on {args.replicas} replicas behind the {config.router} router ({how})")
    saturation = base.fleet.saturation
    if saturation.open_loop:
        worst = max(s.late_wait for s in saturation.servers)
        calm = f"none: every replica kept up (requests sent in the trace's last 10% waited {worst:.1f} s on average " \
            "on the busiest replica)"
        if load is not None and load.load / args.replicas >= 1 and not saturation.saturated:
            # The estimate says overloaded, the replay saw no backlog past its floor: say why both can hold.
            calm += (f"; the offered-load estimate says overloaded, but a backlog counts as saturation only once "
                     f"late requests wait over {MIN_SATURATED_WAIT:.0f} s and 5% of the trace: a trace this "
                     "short may end before it shows")
        print("saturation: " + (saturation.warning() or calm))
    penelope = results["penelope"]
    change = penelope.changes
    print(
        f"estimated gain at {format_size(capacity)}{fleet_label(config)} ({setup.shape.name}, "
        f"{args.scheduler.upper()}): "
        f"hit rate SGLang {base.summary.hit_rate:.1%} -> Penelope {penelope.summary.hit_rate:.1%}; "
        f"TTFT mean {percent(change['ttft_mean'])}, p90 {percent(change['ttft_p90'])}, "
        f"JCT mean {percent(change['jct_mean'])}"
    )

    if args.json:
        payload = {
            "config": {**setup.config, "gpu_cache": capacity},
            "lengths": stats,
            "shared_prefix": prefix,
            "unbounded": unbounded,
            "reuse_distance": reuse,
            "offered_load": load.as_dict() if load is not None else None,
            "replicas": args.replicas,
            "estimate": {name: result.as_dict() for name, result in results.items()},
        }
        write_json(args.json, json_ready(payload))
        print(f"wrote {args.json}")
    return 0


def _tokens(value: float) -> str:
    return "n/a" if value != value else f"{value / 1024:,.1f}K"

