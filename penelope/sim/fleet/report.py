"""Text of fleet results: the offered load of a trace, the fleet table of a setting (load
imbalance, utilization, saturation per policy), a table per replica, and saturation warnings."""

from __future__ import annotations

from penelope.tables import format_table
from penelope.units import format_size


def fleet_label(config) -> str:
    """` x 8 replicas, cache-aware router` for a `SimConfig` with several replicas, else ``."""
    if config is None or config.replicas == 1:
        return ""
    return f" x {config.replicas} replicas, {config.router} router"


def _replicas(n: int) -> str:
    return f"{n:,} replica{'s' if n != 1 else ''}"


def offered_load_lines(load, capacity: int, replicas: int) -> list[str]:
    """What `penelope.sim.fleet.saturation.OfferedLoad` says about servers of `capacity` tokens."""
    if load.span <= 0:
        return ["offered load: every request arrives at once (no rate); the replay is a batch job"]
    lines = [
        f"offered load: {load.load:.2f} servers' worth of work at {format_size(capacity)} KV tokens each "
        f"({load.prefill:,.0f} s prefill + {load.decode:,.0f} s decode over {load.span:,.0f} s of trace; "
        f"a lower-bound estimate: prefix reuse of a cache that never evicts {load.reuse:.0%}, decode in full batches "
        f"of {load.batch})",
        f"  stays below saturation from {_replicas(load.replicas_needed())} (80% utilization from "
        f"{load.replicas_needed(0.8):,})",
    ]
    if load.skipped:
        lines[0] += (f"; {load.requests:,} requests counted, {load.skipped:,} that can never fit the cache left out "
                     "(the replay skips them)")
    if replicas > 1 or load.load >= 1:
        share = load.load / replicas
        note = ": SATURATED, expect a queue growing without bound" if share >= 1 else ""
        lines.append(f"  {replicas} replica{'s' if replicas > 1 else ''}: {share:.2f} of each one's capacity{note}")
    return lines


def fleet_table(ensemble, per_replica: bool = False) -> str:
    """Load imbalance, utilization and saturation per policy (means over an ensemble's runs), and
    with `per_replica` a table per policy of every replica's figures (first run)."""
    config = ensemble.config
    first = ensemble.runs[0]
    routing = next(iter(first.values())).fleet.routing
    head = f"fleet: {config.replicas} replicas, {config.router} router"
    if routing:
        head += " (requests routed by " + ", ".join(f"{kind} {count:,}" for kind, count in routing.items()) + ")"
    rows = []
    for name in ensemble.policies:
        fleets = [run[name].fleet for run in ensemble.runs]
        utilization = [s.load.utilization for fleet in fleets for s in fleet.replicas]
        requests = [s.summary.requests if s.summary else 0 for s in fleets[0].replicas]
        saturated = [len(fleet.saturation.saturated) for fleet in fleets]
        rows.append((
            name,
            f"{sum(f.imbalance for f in fleets) / len(fleets):.2f}",
            f"{sum(f.request_imbalance for f in fleets) / len(fleets):.2f}",
            f"{min(requests):,}-{max(requests):,}",
            f"{min(utilization):.2f}-{max(utilization):.2f}",
            "none" if not any(saturated) else f"{max(saturated)} of {config.replicas}"
            + (f" (in {sum(n > 0 for n in saturated)} of {len(fleets)} runs)" if len(fleets) > 1 else ""),
        ))
    text = head + "\n" + format_table(
        ("policy", "imbalance (busy max/mean)", "requests max/mean", "requests per replica", "utilization",
         "saturated replicas"),
        rows,
    )
    if per_replica:
        for name in ensemble.policies:
            text += f"\n{name}, per replica" + (" (run 1)" if ensemble.repeat > 1 else "") + ":\n"
            text += replica_table(first[name].fleet)
    return text


def replica_table(fleet) -> str:
    rows = []
    for replica in fleet.replicas:
        s, load = replica.summary, replica.load
        rows.append((
            replica.replica,
            f"{s.requests:,}" if s else 0,
            f"{s.ttft_mean:.3f}" if s else "n/a",
            f"{s.ttft_p90:.3f}" if s else "n/a",
            f"{s.jct_mean:,.1f}" if s else "n/a",
            f"{s.hit_rate:.2%}" if s else "n/a",
            f"{s.recompute_cost:.3g}" if s else "n/a",
            f"{replica.busy_time:,.0f}",
            f"{load.utilization:.2f}",
            f"{load.late_wait:,.1f}",
            f"{load.drain_time:,.1f}",
            f"{load.max_waiting:,}",
            "SATURATED" if load.saturated else "",
        ))
    return format_table(
        ("replica", "requests", "TTFT mean s", "TTFT p90", "JCT mean s", "hit rate", "recompute cost", "busy s",
         "utilization", "late wait s", "drain s", "max waiting", ""),
        rows,
    )


def saturation_warnings(sweep) -> list[str]:
    """One line per (setting, policy) whose replay saturated a server; `sweep`: [((capacity,
    router), Ensemble)]."""
    lines = []
    for (capacity, _), ensemble in sweep:
        where = f"GPU cache {format_size(capacity)}{fleet_label(ensemble.config)}"
        for name in ensemble.policies:
            saturated = [run[name].fleet.saturation for run in ensemble.runs]
            hit = [s for s in saturated if s.saturated]
            if not hit:
                continue
            runs = f" ({len(hit)} of {len(saturated)} runs)" if len(saturated) > 1 else ""
            lines.append(f"warning: {where}, {name}{runs}: {hit[0].warning()}")
    return lines
