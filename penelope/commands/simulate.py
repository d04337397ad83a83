"""`penelope simulate`: replay agent sessions through the real KV cache under several eviction
policies and compare TTFT, session completion time (JCT) and hit rate against SGLang.

With no arguments it replays the embedded synthetic workload (24 sessions, about 4,800
requests, the paper's Claude Code statistics) on Qwen3-8B with a 256K-token GPU cache, 4
sessions at a time, longest-prefix-first, SGLang vs Penelope: about 20 s on a 2-core machine.
With `--repeat N` every setting is replayed N times with seeded perturbations
(`penelope.sim.ensemble`), in parallel, and every figure is reported with its 95% interval.
"""

from __future__ import annotations

import sys

from penelope.errors import UsageError
from penelope.tables import format_table, percent
from penelope.units import format_size


def add_parser(subparsers) -> None:
    from penelope.commands.fleet_options import add_fleet_arguments
    from penelope.commands.workload_options import add_turn_arguments, add_workload_arguments, leave_scoped_unset
    from penelope.loadgen.prime import add_prime_argument
    from penelope.sim.timemodel import GPUS

    parser = subparsers.add_parser(
        "simulate",
        help="replay agent sessions through the cache under several eviction policies",
        description=(
            "Closed-loop trace replay through Penelope's cache manager with a serving-time model. "
            "Prints TTFT, JCT and hit rate per policy and each policy's change against SGLang; "
            "SGLang's hit rate shows how much pressure the cache is under."
        ),
    )
    add_workload_arguments(parser)
    add_turn_arguments(parser)
    add_prime_argument(parser)
    parser.add_argument("--scale", type=float, metavar="X",
                        help="replay the prompts penelope load --scale X sends: every token count of the trace "
                        "(blocks, prompts, replies) divided by X, each turn the previous prompt, its reply and new "
                        "tokens; the cache then keeps --page-size pages, as the server does (default: the trace's own "
                        "blocks, unscaled, cached in blocks of 64 tokens)")
    parser.add_argument("--model", default="qwen3-8b", help="built-in model name or a config.json path")
    parser.add_argument("--gpu", default="h100", help=f"GPU of the time model's estimates: {' | '.join(GPUS)}")
    parser.add_argument("--calibration", metavar="FILE", help="calibration JSON overriding the time model")
    parser.add_argument(
        "--phantom-kernel",
        default="fa3",
        help="attention kernel costing prefill batches that refill holes: fa3 (as fast as SGLang's contiguous "
        "prefill) | triton (the project's ragged kernel, slower by the time model's triton_pair_ratio)",
    )
    parser.add_argument(
        "--gpu-cache",
        help="GPU KV capacity in tokens, or a comma-separated sweep (default: the paper's, 256K for Qwen3-8B)",
    )
    parser.add_argument(
        "--cpu-cache",
        default="0",
        help="CPU tier in tokens (0: GPU only); sglang then runs HiCache-like, the other policies the unified "
        "two-tier cache",
    )
    parser.add_argument(
        "--swap-buffer", help="two-tier: host tokens reserved for loads when both tiers are full (default 1K)"
    )
    parser.add_argument("--sessions", type=int, default=4, help="sessions active at once (closed loop)")
    parser.add_argument(
        "--scheduler", default="lpm", help="waiting-queue order: lpm (longest prefix match first) | fcfs"
    )
    parser.add_argument("--chunk-size", default="8K", help="prefill tokens per batch (chunked prefill)")
    parser.add_argument("--page-size", type=int, default=1, help="tokens per KV page (SGLang's --page-size)")
    parser.add_argument("--max-prefill-tokens", default="16K", help="prefill tokens per batch (SGLang's)")
    parser.add_argument("--max-running-requests", type=int, default=2048, help="request rows (SGLang's)")
    parser.add_argument(
        "--policies",
        default="sglang,penelope",
        help="comma-separated eviction policies, 'ablation' for the paper's six-policy grid, or 'all' for every "
        "registered policy (the grid, ttl, flop-recency, penelope-agent and the offline oracle); SGLang's own "
        "sglang-lru, sglang-lfu, sglang-slru, sglang-tlru and sglang-session by name, settings as "
        "name:key=value (e.g. sglang-tlru:threshold=4096:next_prompt_estimate=512)",
    )
    add_fleet_arguments(parser)
    parser.add_argument("--per-replica", action="store_true", help="with --replicas N > 1: a table per replica")
    add_ensemble_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="write the configuration and results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw TTFT and hit rate per policy")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    leave_scoped_unset(parser)


def add_ensemble_arguments(parser) -> None:
    """--repeat and the perturbation of its runs (shared with `penelope reproduce`)."""
    from penelope.sim.perturb import DEFAULT_BAND

    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="replay each setting N times with seeded perturbations and report means with 95%% intervals "
        "(default 1: one unperturbed replay)",
    )
    parser.add_argument(
        "--band",
        type=float,
        metavar="X",
        help=f"with --repeat: each time-model constant is scaled by a factor in [1-X, 1+X] per run "
        f"(default {DEFAULT_BAND})",
    )
    parser.add_argument(
        "--jitter",
        type=float,
        metavar="X",
        help="with --repeat: each wait between requests is scaled by a factor in [1-X, 1+X] per run (default 0)",
    )
    parser.add_argument("--perturb-seed", type=int, help="with --repeat: seed of the perturbations (default 0)")
    parser.add_argument(
        "--jobs", type=int, metavar="J",
        help="worker processes replaying settings in parallel, results identical to one process (default: the "
        "CPU cores for an ensemble or a sweep of capacities or routers, 1 for a single setting)",
    )


def run(args) -> int:
    from penelope.commands.progress import progress_bar
    from penelope.commands.simulate_json import interrupted, setting_results, sweep_payload, write_json
    from penelope.commands.spec import simulation_spec
    from penelope.commands.workload_options import check_workload_options, fill_scoped_defaults, workload_inputs
    from penelope.outputs import check_outputs
    from penelope.sim.api import prepare, simulate
    from penelope.sim.fleet.report import saturation_warnings

    given = fill_scoped_defaults(args)
    if args.per_replica and args.replicas == 1:
        raise UsageError("--per-replica applies to --replicas N > 1 (one server has one table)")
    check_workload_options(args, args.trace, given)
    spec = simulation_spec(args, args.trace)
    check_outputs({"--json": args.json, "--plot": args.plot}, workload_inputs(args, args.trace))
    setup = prepare(spec)
    workload, config_json, policies = setup.workload, setup.config, setup.policies
    config_json["policies"] = policies
    capacities, settings, jobs = setup.capacities, setup.settings, setup.jobs
    repeat, perturbation = setup.repeat, setup.perturbation
    config_json["gpu_cache"] = capacities if len(capacities) > 1 else capacities[0]
    time_model = setup.time_model
    print_config(config_json, time_model)
    fleet = args.replicas > 1
    if repeat > 1:
        config_json["ensemble"] = ensemble_json(repeat, perturbation, jobs)
        print(f"ensemble: {repeat} runs of every setting, {perturbation.describe()}, {jobs} worker processes")
    elif len(settings) > 1:
        print(f"sweep: {len(settings)} settings x {len(policies)} policies, {jobs} worker processes")
    print_offered_load(setup)
    bar = progress_bar(workload.num_requests * len(policies) * len(settings) * repeat, args.no_progress)
    finished: dict[int, object] = {}
    try:
        ensembles = simulate(setup, progress=bar, on_ensemble=finished.__setitem__)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
            bar = None
        # The settings that finished are shown, as they would have been (and kept in --json).
        print_tables([(settings[i], finished[i]) for i in sorted(finished)], repeat, fleet, args.per_replica)
        done = [(settings[i], setting_results(finished[i], policies)) for i in sorted(finished)]
        raise interrupted(args.json, config_json, settings, done, fleet) from None
    finally:
        if bar is not None:
            bar.close()
    sweep = list(zip(settings, ensembles, strict=True))
    print_tables(sweep, repeat, fleet, args.per_replica)
    print(
        "\ntimes in seconds of simulated time; recompute cost in attention-pair units of the cost model; "
        + ("a change is a win or a loss only when its interval excludes zero" if repeat > 1 else
           "changes are relative to sglang, hit rate in percentage points")
    )
    for line in saturation_warnings(sweep):
        print(line, file=sys.stderr)
    if args.json:
        done = [(setting, setting_results(ensemble, policies)) for setting, ensemble in sweep]
        write_json(args.json, sweep_payload(config_json, settings, done, fleet))
        print(f"wrote {args.json}")
    if args.plot:
        if len({router for _, router in settings}) > 1:
            print("--plot draws the capacity sweep of one router: drawing the first router's")
        first = [(c, e) for (c, r), e in sweep if r == settings[0][1]]
        if repeat > 1:
            from penelope.sim.ensemble_report import plot_ensembles

            plot_ensembles(args.plot, first, setup.shape.name)
        else:
            plot_results(args.plot, [(c, e.runs[0]) for c, e in first], setup.shape.name)
        print(f"wrote {args.plot}")
    return 0


def print_tables(sweep: list, repeat: int, fleet: bool, per_replica: bool) -> None:
    """Each finished setting's table: ((capacity, router), ensemble) pairs."""
    from penelope.sim.fleet.report import fleet_table

    for (capacity, _), ensemble in sweep:
        print()
        if repeat > 1:
            from penelope.sim.ensemble_report import ensemble_tables

            print(ensemble_tables(capacity, ensemble))
        else:
            print(results_table(capacity, ensemble.runs[0], ensemble.config))
        if fleet:
            print(fleet_table(ensemble, per_replica))


def ensemble_json(repeat: int, perturbation, jobs: int) -> dict:
    from penelope.sim.stats import CONFIDENCE

    return {
        "repeat": repeat,
        "jobs": jobs,
        "confidence": CONFIDENCE,
        "interval": "Student t over runs; changes paired run by run",
        **perturbation.as_dict(),
    }


def print_config(config: dict, time_model) -> None:
    work = config["workload"]
    loader = work["loader"]
    source = f"{work['format']} {work['trace']}" if work["trace"] else loader["sources"][0]
    dropped = ", ".join(f"{k} {v}" for k, v in loader["dropped"].items()) or "none"
    skipped = ", ".join(f"{k} {v}" for k, v in loader["sessions_skipped"].items()) or "none"
    print(
        f"workload: {source}: {work['sessions']:,} sessions, {work['requests']:,} requests "
        f"(requests left out: {dropped}; sessions left out: {skipped})"
    )
    think = work["think_time"]
    closed = work.get("closed_loop", True)
    print(
        f"  max context {format_size(work['max_context'])}, "
        + (f"think time {think['mode']}" + (f" x{think['scale']:g}" if think["scale"] != 1 else "")
           + (f" capped at {think['cap']:g} s" if think["cap"] is not None else "")
           if closed else "open loop: requests sent at their recorded arrival times")
    )
    print(
        f"model {config['model']} on {config['num_gpus']}x {config['gpu'].upper()} "
        f"({'calibrated from ' + config['calibration'] if config['calibration'] else 'estimated time model'}), "
        f"c_lin {time_model.c_lin:,.0f}"
    )
    print(f"  prefill attention: {kernel_statement(time_model)}")
    gpu_cache = config["gpu_cache"]
    sizes = ", ".join(format_size(c) for c in gpu_cache) if isinstance(gpu_cache, list) else format_size(gpu_cache)
    print(
        f"server: GPU cache {sizes} tokens, CPU cache {format_size(config['cpu_cache'])}, "
        + (f"{config['sessions']} sessions at once, " if closed else "")
        + f"{config['scheduler'].upper()} scheduler, "
        f"{config['chunk_size']} prefill tokens per batch"
        + (f", {config['replicas']} replicas behind {' | '.join(config['routers'])}" if config["replicas"] > 1 else "")
    )
    if work.get("scale") is not None:
        print(f"  token counts / {work['scale']:g}: the prompts penelope load --scale {work['scale']:g} sends")
    if work.get("prime"):
        print("  --prime: each session's first request primes the cache, left out of every figure")
    if work.get("time_scale", 1.0) != 1.0:
        print(f"  time scale x{work['time_scale']:g}: every wait between requests {work['time_scale']:g} times as long")


def kernel_statement(time_model) -> str:
    """Which attention kernel each prefill batch is costed with, in words."""
    text = "contiguous batches on FA3"
    if time_model.phantom_kernel == "triton":
        return (
            text + f"; batches refilling holes on the Triton ragged kernel at {time_model.triton_pair_ratio:g}x "
            "FA3's seconds per attention pair"
        )
    return text + ", batches refilling holes too (--phantom-kernel triton: the Triton ragged kernel)"


def print_offered_load(setup) -> None:
    """For an open-loop trace: its offered load against the servers (`penelope.sim.fleet.saturation`)."""
    from penelope.sim.fleet.report import offered_load_lines
    from penelope.sim.fleet.saturation import offered_load

    if setup.workload.closed_loop:
        return
    capacity = min(setup.capacities)
    load = offered_load(setup.workload, setup.time_model, setup.cost, capacity)
    setup.config["offered_load"] = load.as_dict()
    for line in offered_load_lines(load, capacity, setup.config["replicas"]):
        print(line)


def results_table(capacity: int, results: dict, config=None) -> str:
    """The per-policy table of one capacity (of `config`, a `SimConfig`), with SGLang's hit rate as
    the pressure."""
    from penelope.sim.fleet.report import fleet_label
    from penelope.sim.run import baseline_of

    base = baseline_of(results)
    skipped = base.replay.skipped
    head = (
        f"GPU cache {format_size(capacity)}{fleet_label(config)}: pressure = SGLang hit rate "
        f"{base.summary.hit_rate:.1%}, "
        f"{base.summary.requests:,} requests"
        + (f" ({skipped} never fit the cache and were skipped)" if skipped else "")
    )
    rows = []
    for name, result in results.items():
        s, change = result.summary, result.changes
        rows.append(
            (
                name,
                f"{s.ttft_mean:.3f}",
                f"{s.ttft_p50:.3f}",
                f"{s.ttft_p90:.3f}",
                f"{s.jct_mean:,.1f}",
                f"{s.hit_rate:.2%}",
                f"{s.recomputed_tokens:,}",
                f"{s.recompute_cost:.3g}",
                s.swap_loads,
                percent(change["ttft_mean"]),
                percent(change["ttft_p90"]),
                percent(change["jct_mean"]),
                f"{change['hit_rate_points']:+.2f}",
            )
        )
    headers = (
        "policy",
        "TTFT mean s",
        "TTFT p50",
        "TTFT p90",
        "JCT mean s",
        "hit rate",
        "recomputed tok",
        "recompute cost",
        "swap loads",
        "TTFT vs sglang",
        "p90 vs sglang",
        "JCT vs sglang",
        "hit pts vs sglang",
    )
    return head + "\n" + format_table(headers, rows) + oracle_table(results)


def oracle_table(results: dict) -> str:
    """The oracle bracket and every policy's distance to the oracle's run; empty without an oracle."""
    from penelope.sim.bracket import oracle_of

    oracle = oracle_of(results)
    if oracle is None:
        return ""
    head = (
        f"\noracle bracket: the optimal recompute cost lies in [{oracle.bound:.3g} (lower bound), "
        f"{oracle.summary.recompute_cost:.3g} (oracle)]; distance = excess over the oracle's run"
    )
    rows = [
        (name, percent(r.to_oracle["recompute_cost"]), percent(r.to_oracle["cost_over_bound"]),
         percent(r.to_oracle["ttft_mean"]), percent(r.to_oracle["jct_mean"]))
        for name, r in results.items()
    ]
    headers = ("policy", "cost vs oracle", "cost vs bound", "TTFT vs oracle", "JCT vs oracle")
    return head + "\n" + format_table(headers, rows)


def plot_results(path: str, sweep: list, model: str) -> None:
    """TTFT mean and hit rate per policy against the GPU capacity (one point per capacity); with an
    oracle, also the recompute cost with the oracle bracket shaded."""
    from penelope.plotting import capacity_axis, pyplot, save, shade_oracle_bracket
    from penelope.sim.bracket import oracle_of

    plt = pyplot()
    oracles = [oracle_of(results) for _, results in sweep]
    fig, axes = plt.subplots(1, 3 if oracles[0] else 2, figsize=(16 if oracles[0] else 11, 4))
    left, right = axes[:2]
    labels = [format_size(capacity) for capacity, _ in sweep]
    x = list(range(len(sweep)))
    if oracles[0]:
        # Recompute cost per policy, the oracle bracket (lower bound to oracle) shaded.
        for name in sweep[0][1]:
            axes[2].plot(x, [results[name].summary.recompute_cost for _, results in sweep], "o-", label=name)
        shade_oracle_bracket(axes[2], x, [o.bound for o in oracles], [o.summary.recompute_cost for o in oracles],
                             labels)
    for name in sweep[0][1]:
        left.plot(x, [results[name].summary.ttft_mean for _, results in sweep], "o-", label=name)
        right.plot(x, [100 * results[name].summary.hit_rate for _, results in sweep], "o-", label=name)
    for axis, label in ((left, "mean TTFT (s)"), (right, "hit rate (%)")):
        capacity_axis(axis, x, labels, label)
    left.legend(fontsize=8)
    save(fig, path, f"{model}: trace replay by eviction policy")
