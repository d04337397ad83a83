"""`penelope analyze`: what a trace says about KV caching before any policy is chosen.

Request lengths, the shared prefix, the hit rate of a cache that never evicts, the reuse
distance, and the estimated Penelope gain at one capacity from a quick replay (SGLang vs
Penelope, the same server model as `penelope simulate`). See `penelope.sim.analysis`.
"""

from __future__ import annotations

from penelope.report import format_table
from penelope.units import format_size


def add_parser(subparsers) -> None:
    from penelope.sim.options import add_workload_arguments
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
    parser.add_argument("path", nargs="?", help="WEKA trace folder or file, or Mooncake JSONL")
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
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from penelope.commands.simulate import percent, prepare, progress_bar, write_json
    from penelope.errors import UsageError
    from penelope.outputs import check_outputs
    from penelope.sim.analysis import reuse_distances, reuse_summary, shared_prefix, unbounded_hit_rate
    from penelope.sim.options import workload_inputs
    from penelope.sim.run import baseline_of, json_ready, run_policies
    from penelope.sim.workloads import workload_stats

    if args.path is None and args.format != "synthetic":
        raise UsageError("analyze needs a trace PATH (or --format synthetic)")
    if args.gpu_cache and "," in args.gpu_cache:
        raise UsageError("--gpu-cache: analyze estimates the gain at one capacity")
    args.cpu_cache = "0"
    check_outputs({"--json": args.json}, workload_inputs(args, args.path))
    setup = prepare(args)
    workload = setup["workload"]
    capacity = setup["capacities"][0]
    stats = workload_stats(workload)
    prefix = shared_prefix(workload)
    unbounded = unbounded_hit_rate(workload)

    policies = ["sglang", "penelope"]
    bar = progress_bar(workload.num_requests * len(policies), args.no_progress)
    try:
        results = run_policies(
            workload, policies, setup["make_config"](capacity), setup["time_model"], setup["cost"], progress=bar
        )
    finally:
        if bar is not None:
            bar.close()
    base = baseline_of(results)
    shared = int(prefix["all_sessions"])
    reuse = reuse_summary(reuse_distances(base.replay.records, shared), shared, capacity)

    describe = setup["config"]["workload"]
    print(f"workload: {describe['format']} {describe['trace'] or ''}".rstrip()
          + f": {stats['sessions']} sessions, {stats['requests']:,} requests")
    print(format_table(
        ("tokens", "p10", "p50", "p90", "max"),
        [("input", *(_tokens(stats[f"input_{q}"]) for q in ("p10", "p50", "p90", "max")))],
    ))
    print(f"output tokens: p50 {stats['output_p50']:,.0f}, mean {stats['output_mean']:,.0f}")
    print(f"turns: {stats['extension_fraction']:.0%} extend the previous input, "
          f"{stats['compaction_fraction']:.1%} compactions; tool waits p50 {stats['tool_wait_p50']:.0f} s, "
          f"p90 {stats['tool_wait_p90']:.0f} s; human turns {stats['human_fraction']:.0%}")
    print(f"shared prefix: {_tokens(prefix['all_sessions'])} tokens common to all sessions; "
          f"longest shared with another session p50 {_tokens(prefix['pairwise_p50'])}, "
          f"max {_tokens(prefix['pairwise_max'])}")
    print(f"hit rate under an unbounded cache: {unbounded['hit_rate']:.1%}")
    print(f"reuse distance ({args.sessions} sessions at once): p50 {_tokens(reuse['p50'])}, "
          f"p90 {_tokens(reuse['p90'])}, max {_tokens(reuse['max'])} tokens; "
          f"an LRU cache of {format_size(capacity)} keeps the history for {reuse['lru_fit']:.0%} of reuses")
    penelope = results["penelope"]
    change = penelope.changes
    print(
        f"estimated gain at {format_size(capacity)} ({setup['shape'].name}, {args.scheduler.upper()}): "
        f"hit rate SGLang {base.summary.hit_rate:.1%} -> Penelope {penelope.summary.hit_rate:.1%}; "
        f"TTFT mean {percent(change['ttft_mean'])}, p90 {percent(change['ttft_p90'])}, "
        f"JCT mean {percent(change['jct_mean'])}"
    )

    if args.json:
        payload = {
            "config": {**setup["config"], "gpu_cache": capacity},
            "lengths": stats,
            "shared_prefix": prefix,
            "unbounded": unbounded,
            "reuse_distance": reuse,
            "estimate": {name: result.as_dict() for name, result in results.items()},
        }
        write_json(args.json, json_ready(payload))
        print(f"wrote {args.json}")
    return 0


def _tokens(value: float) -> str:
    return "n/a" if value != value else f"{value / 1024:,.1f}K"

