"""The simulator against the real server: replay an `ab.json`'s workload in the simulator and put
its figures beside the server's.

    python scripts/sim_vs_server.py --calibration CAL.json                  # docs/ab-table/ab.json
    python scripts/sim_vs_server.py --ab OUT/ab.json --calibration CAL.json --json sim-vs-server.json

Reads from `ab.json` (`penelope ab`'s output) what the simulator needs: the servers' pool, page
and chunk and T-LRU's and SLRU's settings (`setup`), the trace, `--from-context`, `--turns`,
`--scale`, think times and time scale (`workload`), sessions at once and `--prime` (`load`); a
missing or malformed one (and a malformed configuration, run or estimate) is one line, exit 2, as
is a `--json` that cannot be written or names an input (checked before the run); Ctrl-C is one
line, exit 130. The workload is loaded as `penelope ab` loaded it and scaled as
its load generator scales it (`penelope.sim.workloads.scale`: the prompts the servers got, token for
token). Each configuration is replayed once, in SGLang's default FCFS order, its policy the
simulator's port of the server's (`penelope` -> the policy Penelope's plugin applied,
`sglang-tlru` -> `sglang-tlru:threshold=T:next_prompt_estimate=Q`, ...); `penelope-tier` and
`sglang-hicache` have no simulated counterpart here and are left out, said so.

Per configuration: the server's TTFT mean and p90 (mean over rounds [95% interval]) beside the
simulator's, cached fraction against hit rate (both over the measured turns), prefill tokens
recomputed (the server's counters less a never-evicting cache's, over the whole run, priming
turns included; the simulator's recomputed tokens over every request, priming ones included) and
whether the simulator's lies within 5% of the server's; then Penelope's TTFT mean change against
each configuration: the server's paired change with its interval, the simulator's change, and
whether the simulator's lies inside that interval. The calibration's `source` is printed above
the table: a calibration written with `--accept-poor-fit` names its poor fit there.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from penelope.errors import UsageError  # noqa: E402

DEFAULT_AB = ROOT / "docs" / "ab-table" / "ab.json"
SHARED_TRACES = ROOT.parent / "shared" / "traces" / "weka-claude-code"
# SGLang 0.5.23's default --schedule-policy.
SCHEDULER = "fcfs"
RECOMPUTED_WITHIN = 0.05
UNSIMULATED = ("penelope-tier", "sglang-hicache")


def _field(data: dict, path: str):
    """`data[a][b]...` for `path` "a.b...", UsageError naming the path when it is missing."""
    value = data
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise UsageError(f"ab.json has no {path}: cannot build the simulator's workload without it")
        value = value[key]
    return value


def _count(data: dict, path: str, minimum: int = 1) -> int:
    """`_field(data, path)`, UsageError unless an integer of at least `minimum`."""
    value = _field(data, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"ab.json's {path} is {value!r}: expected an integer of at least {minimum}")
    return value


def _optional_count(data: dict, key: str, path: str) -> int | None:
    """`data[key]` (ab.json's `path`) when given: None or a positive integer."""
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UsageError(f"ab.json's {path} is {value!r}: expected a positive integer or null")
    return value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _estimate(data: dict, path: str, required: bool = True) -> dict | None:
    """ab.json's estimate at `path` (an object with a numeric mean); None when optional and absent."""
    value = _field(data, path) if required else data.get(path.rpartition(".")[2])
    if value is None and not required:
        return None
    if not isinstance(value, dict) or not _number(value.get("mean")) \
            or not all(value.get(k) is None or _number(value[k]) for k in ("low", "high")):
        raise UsageError(f"ab.json's {path} is {value!r}: expected an estimate (an object with a numeric mean, "
                         "low and high)")
    return value


def check_ab(data: dict) -> None:
    """UsageError naming the first entry of ab.json's configs, runs and estimates that is not what
    `penelope ab` writes (the parts this script reads)."""
    configs, runs, estimates = data["configs"], data["runs"], data["estimates"]
    if not isinstance(configs, list):
        raise UsageError(f"ab.json's configs is {type(configs).__name__}: expected a list of configurations")
    names = set()
    for i, entry in enumerate(configs):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not isinstance(entry.get("applied") or {}, dict):
            raise UsageError(f"ab.json's configs[{i}] is {entry!r}: expected an object with a name")
        if entry["name"] in names:
            raise UsageError(f"ab.json's configs[{i}] repeats the configuration {entry['name']!r}")
        names.add(entry["name"])
    if not isinstance(runs, list):
        raise UsageError(f"ab.json's runs is {type(runs).__name__}: expected a list of runs")
    for i, run in enumerate(runs):
        if not (isinstance(run, dict) and isinstance(run.get("config"), str) and isinstance(run.get("round"), int)
                and not isinstance(run.get("round"), bool) and _number(run.get("ttft_mean"))
                and math.isfinite(run["ttft_mean"]) and run["ttft_mean"] > 0):
            raise UsageError(f"ab.json's runs[{i}] is not a run (an object with config, round and a positive "
                             "ttft_mean)")
    if not isinstance(estimates, dict) or not all(isinstance(e, dict) for e in estimates.values()):
        raise UsageError("ab.json's estimates: expected an object of estimates per configuration")


def read_ab(path: Path) -> dict:
    if not path.is_file():
        raise UsageError(f"{path}: no such ab.json (penelope ab --out DIR writes DIR/ab.json)")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise UsageError(f"{path}: not JSON (or nested too deeply)") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: not an ab.json (a JSON object with setup, workload, load, configs, runs)")
    for key in ("setup", "workload", "load", "configs", "runs", "estimates"):
        _field(data, key)
    check_ab(data)
    return data


def think_time_text(think: dict) -> str:
    items = [str(_field({"think_time": think}, "think_time.mode"))]
    if think.get("scale", 1.0) != 1.0:
        items.append(f"scale:{think['scale']!r}")
    if think.get("cap") is not None:
        items.append(f"cap:{think['cap']!r}")
    return ",".join(items)


def model_of(setup: dict) -> str:
    """The served model's config.json: the recorded checkpoint folder's when it is here, else,
    for a checkpoint `penelope ab` generated (`setup.model_spec` `scale:S` or `tiny`), that
    checkpoint's config written into a temporary folder of the recorded folder's name."""
    folder = _field({"setup": setup}, "setup.model")
    if (Path(str(folder)) / "config.json").is_file():
        return str(folder)
    spec = setup.get("model_spec")
    if not isinstance(spec, str) or not spec:
        raise UsageError(f"the model of ab.json ({folder}) is not here and ab.json has no setup.model_spec: "
                         "give --model")
    import atexit
    import shutil
    import tempfile

    from penelope.loadgen.models import SCALE, TINY, model_scale

    # Named as the recorded folder: a calibration names the model it was measured on by it.
    scratch = tempfile.mkdtemp(prefix="sim-vs-server-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    target = Path(scratch) / Path(str(folder)).name
    target.mkdir()
    if spec.startswith(SCALE):
        from penelope.engine.scale_model import scale_model_config

        config = scale_model_config(model_scale(spec)).to_hf()
        (target / "config.json").write_text(json.dumps(config) + "\n")
        return str(target)
    if spec == TINY:
        from penelope.integration.sglang.verify import tiny_model

        return str(tiny_model(target))
    raise UsageError(f"the model of ab.json ({folder}, --model {spec}) is not here: give --model")


def trace_of(workload: dict, given: str | None):
    """The trace files the servers' load generator read: `--trace`, else the loader's sources
    when they all exist, else files of the same names in the shared WEKA traces, else the
    recorded trace folder."""
    if given:
        return given
    loader = workload.get("loader") or {}
    sources = loader.get("sources") if isinstance(loader, dict) else None
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        sources = []
    if sources and all(Path(s).is_file() for s in sources):
        return sources
    shared = [SHARED_TRACES / Path(s).name for s in sources]
    if shared and all(path.is_file() for path in shared):
        return [str(path) for path in shared]
    trace = _field(workload, "workload.trace") if "trace" not in workload else workload["trace"]
    if not isinstance(trace, str) or not Path(trace).exists():
        raise UsageError(f"the trace of ab.json ({trace}) is not here: give --trace")
    return trace


def load_workload(ab: dict, trace: str | None):
    """The workload `penelope ab` replayed, scaled as its load generator scaled it."""
    from penelope.commands.workload_options import load_from_args
    from penelope.sim.workloads.scale import check_scale, scale_workload
    from penelope.sim.workloads.time_scale import check_time_scale, scale_time

    work = {"workload": ab["workload"]}
    fmt = _field(work, "workload.format")
    scale = check_scale(_field(work, "workload.scale"))
    from_context = _field(work, "workload.from_context")
    _field(work, "workload.turns")
    turns = _optional_count(ab["workload"], "turns", "workload.turns")
    seed = ab["workload"].get("seed") or 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"ab.json's workload.seed is {seed!r}: expected an integer")
    args = argparse.Namespace(
        format=fmt, max_context=str(_field(work, "workload.max_context")), seed=seed,
        limit_sessions=_optional_count(ab["workload"], "limit_sessions", "workload.limit_sessions"),
        think_time=think_time_text(_field(work, "workload.think_time")),
        from_context=None if from_context is None else str(from_context), turns=turns,
        no_shared_prefix=not ab["workload"].get("shared_prefix", True),
        subagents=ab["workload"].get("subagents", "skip"), overflow=ab["workload"].get("overflow", "truncate"))
    workload, _ = load_from_args(args, trace_of(ab["workload"], trace) if fmt != "synthetic" else None)
    workload = scale_time(workload, check_time_scale(ab["workload"].get("time_scale", 1.0)))
    return scale_workload(workload, scale), scale


def sim_policy(name: str, config: dict, setup: dict) -> str:
    """The simulator's policy for configuration `name` of ab.json."""
    if name == "penelope" or name.startswith("penelope:"):
        applied = (config.get("applied") or {}).get("policy")
        return applied or (name.partition(":")[2] or "penelope")
    if name == "sglang-tlru":
        need = {"setup": setup}
        threshold = _count(need, "setup.tlru.threshold", minimum=0)
        estimate = _count(need, "setup.tlru.next_prompt_estimate", minimum=0)
        return f"sglang-tlru:threshold={threshold}:next_prompt_estimate={estimate}"
    if name == "sglang-slru" and setup.get("slru_protected") is not None:
        return f"sglang-slru:protected_threshold={_count({'setup': setup}, 'setup.slru_protected', minimum=0)}"
    return name


def server_change(ab: dict, name: str, metric: str) -> dict | None:
    """Penelope's paired change of `metric` against `name` on the server (mean, low, high)."""
    from penelope.sim.stats import Estimate, paired_changes

    runs: dict[str, dict[int, dict]] = {}
    for run in ab["runs"]:
        runs.setdefault(run["config"], {})[run["round"]] = run
    mine, theirs = runs.get("penelope", {}), runs.get(name, {})
    rounds = sorted(set(mine) & set(theirs))
    if len(rounds) < 2:
        return None
    e = Estimate.of(paired_changes([mine[r][metric] for r in rounds], [theirs[r][metric] for r in rounds]))
    return {"mean": e.mean, "low": e.low, "high": e.high, "rounds": len(rounds)}


def compare(ab: dict, calibration: str, model: str | None, trace: str | None) -> dict:
    from penelope.costmodel.recompute import CostModel
    from penelope.costmodel.shapes import get_model
    from penelope.sim.run import SimConfig, run_policy
    from penelope.sim.timemodel import TimeModel

    setup, load = ab["setup"], ab["load"]
    need = {"setup": setup, "load": load}
    pool, page, chunk = (_count(need, f"setup.{k}") for k in ("pool", "page", "chunk"))
    sessions, prime = _count(need, "load.sessions"), _field(need, "load.prime")
    if not isinstance(prime, bool):
        raise UsageError(f"ab.json's load.prime is {prime!r}: expected true or false")
    model = model or model_of(setup)
    shape = get_model(model)
    time_model = TimeModel.from_json(calibration, shape)
    source = str(json.loads(Path(calibration).read_text()).get("source", ""))
    workload, scale = load_workload(ab, trace)
    sent = ab["workload"].get("requests")
    if isinstance(sent, int) and not isinstance(sent, bool) and workload.num_requests != sent:
        raise UsageError(f"the trace gives {workload.num_requests:,} requests, the servers got {sent:,} "
                         "(ab.json's workload.requests): give the trace files the servers read")
    config = SimConfig(gpu_cache=pool, block_size=page, page_size=page, chunk_size=chunk, sessions=sessions,
                       scheduler=SCHEDULER, prime=prime)
    cost = CostModel(shape)
    rows, left_out = [], []
    started = time.perf_counter()
    simulated = {}
    for entry in ab["configs"]:
        name = entry["name"]
        if name.partition(":")[0] in UNSIMULATED:
            left_out.append(f"{name} (no simulated counterpart)")
            continue
        if name not in ab["estimates"]:
            left_out.append(f"{name} (no estimates in ab.json)")
            continue
        policy = sim_policy(name, entry, setup)
        result = run_policy(workload, policy, config, time_model, cost)
        summary = result.summary
        if not summary.requests:
            raise UsageError(f"no request of the workload fits ab.json's setup.pool of {pool:,} tokens: "
                             "nothing simulated")
        simulated[name] = summary
        est = {"estimates": {name: ab["estimates"][name]}}
        for key in ("ttft_mean", "ttft_p90", "cached_fraction"):
            _estimate(est, f"estimates.{name}.{key}")
        recomputed = _estimate(est["estimates"][name], f"estimates.{name}.recomputed", required=False)
        est = est["estimates"][name]
        server_recomputed = recomputed and recomputed["mean"]
        sim_recomputed = sum(r.recomputed_tokens for r in result.replay.records)
        rows.append({
            "config": name, "policy": policy,
            "server": {"ttft_mean": est["ttft_mean"], "ttft_p90": est["ttft_p90"],
                       "cached_fraction": est["cached_fraction"]["mean"], "recomputed": recomputed},
            "sim": {"ttft_mean": summary.ttft_mean, "ttft_p90": summary.ttft_p90, "hit_rate": summary.hit_rate,
                    "recomputed": sim_recomputed, "requests": summary.requests},
            "recomputed_within_5pct": (None if not server_recomputed else bool(
                abs(sim_recomputed - server_recomputed) <= RECOMPUTED_WITHIN * server_recomputed)),
        })
    elapsed = time.perf_counter() - started
    if not rows:
        raise UsageError(f"no configuration of ab.json ({', '.join(left_out) or 'none'}) has a simulated counterpart "
                         "and the server's estimates: nothing to compare")
    mine = simulated.get("penelope")
    for row in rows:
        if row["config"] == "penelope" or mine is None:
            continue
        theirs = simulated[row["config"]]
        change = (mine.ttft_mean - theirs.ttft_mean) / theirs.ttft_mean if theirs.ttft_mean else math.nan
        server = server_change(ab, row["config"], "ttft_mean")
        inside = None if server is None else bool(server["low"] <= change <= server["high"])
        row["penelope_ttft_change"] = {"server": server, "sim": change, "inside": inside}
    return {"ab": None, "calibration": calibration, "calibration_source": source,
            "poor_fit": _poor_fit(source), "model": model, "scale": scale, "pool": pool, "page": page,
            "chunk": chunk, "sessions": sessions, "prime": prime, "scheduler": SCHEDULER,
            "requests": workload.num_requests, "rows": rows, "left_out": left_out, "replay_seconds": elapsed}


def _poor_fit(source: str) -> bool:
    from penelope.commands.calibrate import POOR_FIT

    return POOR_FIT in source


def _interval(e: dict | None, digits: int = 2, percent: bool = False) -> str:
    if not e:
        return "-"
    f = (lambda x: f"{x:+.1%}") if percent else (lambda x: f"{x:,.{digits}f}")
    if e.get("low") is None or e.get("high") is None or any(math.isnan(e[k]) for k in ("low", "high")):
        return f(e["mean"])
    return f"{f(e['mean'])} [{f(e['low'])}, {f(e['high'])}]"


def _yes(flag) -> str:
    return "-" if flag is None else ("yes" if flag else "no")


def render(result: dict) -> str:
    lines = []
    if result["poor_fit"]:
        lines.append(f"**Calibration: a POOR FIT** ({result['calibration_source']}).")
    else:
        lines.append(f"Calibration: {result['calibration_source'] or result['calibration']}.")
    lines += ["",
              "| configuration | TTFT mean s, server [95% CI] | sim | TTFT p90 s, server [95% CI] | sim | "
              "hit rate, server | sim | recomputed tokens, server [95% CI] | sim | within 5% | "
              "Penelope's TTFT change vs it, server [95% CI] | sim | inside |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        server, sim = row["server"], row["sim"]
        change = row.get("penelope_ttft_change")
        lines.append(
            f"| {row['config']} | {_interval(server['ttft_mean'])} | {sim['ttft_mean']:.2f} | "
            f"{_interval(server['ttft_p90'])} | {sim['ttft_p90']:.2f} | {server['cached_fraction']:.1%} | "
            f"{sim['hit_rate']:.1%} | {_interval(server['recomputed'], digits=0)} | {sim['recomputed']:,} | "
            f"{_yes(row['recomputed_within_5pct'])} | "
            + (f"{_interval(change['server'], percent=True)} | {change['sim']:+.1%} | {_yes(change['inside'])} |"
               if change else "- | - | - |"))
    if result["left_out"]:
        lines.append(f"\nNot simulated here: {', '.join(result['left_out'])}.")
    return "\n".join(lines)


class OneLineParser(argparse.ArgumentParser):
    """A bad option is one line on stderr, exit 2, as every other bad input."""

    def error(self, message: str):
        self.exit(2, f"sim_vs_server: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ab", type=Path, default=DEFAULT_AB, help=f"penelope ab's ab.json (default {DEFAULT_AB})")
    parser.add_argument("--calibration", required=True, metavar="FILE", help="the server's calibration JSON")
    parser.add_argument("--model", help="the served model's config.json or folder (default: ab.json's setup.model)")
    parser.add_argument("--trace", help="the WEKA trace folder or file (default: the sources ab.json names)")
    parser.add_argument("--json", metavar="FILE", help="write the comparison as JSON")
    args = parser.parse_args(argv)
    try:
        from penelope.outputs import check_outputs, write_text

        # Before the run: a bad --json costs nothing, and never writes over an input.
        check_outputs({"--json": args.json}, {"--ab": str(args.ab), "--calibration": args.calibration,
                                              "--model": args.model, "--trace": args.trace})
        started = time.perf_counter()
        ab = read_ab(args.ab)
        # The trace and model ab.json names (when the flags do not) are inputs too.
        model = args.model or model_of(ab["setup"])
        trace = args.trace
        if ab["workload"].get("format") != "synthetic":
            trace = trace_of(ab["workload"], args.trace)
        traces = [trace] if isinstance(trace, str) else trace or []
        named = {"--trace": args.trace} if args.trace else {
            f"ab.json's trace ({i} of {len(traces)})": path for i, path in enumerate(traces, 1)}
        config = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
        check_outputs({"--json": args.json}, {"--model": str(config), **named})
        result = compare(ab, args.calibration, model, trace)
        ab_path = args.ab.resolve()
        result["ab"] = str(ab_path.relative_to(ROOT) if ab_path.is_relative_to(ROOT) else ab_path)
        result["seconds"] = time.perf_counter() - started
    except UsageError as err:
        print(f"sim_vs_server: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sim_vs_server: interrupted", file=sys.stderr)
        return 130
    print(render(result))
    print(f"\n{result['requests']} requests per configuration, {len(result['rows'])} configurations replayed in "
          f"{result['replay_seconds']:.1f} s ({result['seconds']:.1f} s in all)")
    if args.json:
        try:
            write_text(args.json, json.dumps(result, indent=2, default=float) + "\n")
        except OSError as err:
            print(f"sim_vs_server: --json {args.json}: cannot write ({err.strerror})", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
