"""The simulator's front door: describe a simulation (`SimulationSpec`, with its `WorkloadSpec`),
`prepare` it (every field checked before the workload is loaded, the memory the replays may
reach checked before they start) and `simulate` it. `penelope simulate` and `penelope analyze`
are this module plus their options and tables.

    from penelope.sim import SimulationSpec, WorkloadSpec, prepare, simulate

    setup = prepare(SimulationSpec(WorkloadSpec(trace="traces/"), gpu_cache="128K,192K", repeat=6))
    for (capacity, router), ensemble in zip(setup.settings, simulate(setup)):
        print(capacity, ensemble.change("penelope", "ttft_mean"))

Errors are `UsageError`s that name the spec's fields in backquotes (`gpu_cache`); the CLI shows
them as its flags (`penelope.commands.fields`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from penelope.cache.host_tier import check_host_slots
from penelope.cache.policies import get_policy
from penelope.cache.sglang_policies import SGLangPolicy
from penelope.cache.tiers import DEFAULT_SWAP_BUFFER
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import ModelShape, get_model
from penelope.errors import UsageError
from penelope.loadgen.prime import check_prime
from penelope.memory import check_memory
from penelope.sim.ensemble import Ensemble, default_jobs, run_ensembles
from penelope.sim.fleet.router import THRESHOLDS, RouterConfig, choose_routers
from penelope.sim.perturb import DEFAULT_BAND, Perturbation
from penelope.sim.replay import replay_memory
from penelope.sim.run import SimConfig, check_fleet_policies, default_gpu_cache, parse_policies
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads import conversations
from penelope.sim.workloads.load import WorkloadSpec, load
from penelope.sim.workloads.scale import check_scale, scale_workload
from penelope.sim.workloads.time_scale import check_time_scale, scale_time
from penelope.sim.workloads.types import Workload
from penelope.units import format_size, parse_size, parse_size_list

# Ranges of the ensemble fields: 10,000 runs per setting narrow an interval 40x below 6 runs'
# already; each worker process holds the whole workload and its own caches.
MAX_REPEAT = 10_000
MAX_JOBS = 256


@dataclass(frozen=True)
class SimulationSpec:
    """One simulation: a workload, the servers that replay it (sizes as numbers or K/M/G text;
    `gpu_cache` a comma-separated sweep, None for the model's default), the policies compared
    (comma-separated, `ablation` or `all`) and the runs of each setting (`repeat` >= 2: an
    ensemble of seeded perturbed runs, `band`, `jitter` and `perturb_seed` set its perturbation;
    `jobs`: worker processes, None for every core on an ensemble or a sweep)."""

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    model: str = "qwen3-8b"
    gpu: str = "h100"
    calibration: str | None = None
    phantom_kernel: str = "fa3"
    gpu_cache: str | int | None = None
    cpu_cache: str | int = 0
    swap_buffer: str | int | None = None
    sessions: int = 4
    scheduler: str = "lpm"
    chunk_size: str | int = "8K"
    page_size: int = 1
    max_prefill_tokens: str | int = "16K"
    max_running_requests: int = 2048
    replicas: int = 1
    router: str | None = None
    cache_threshold: float | None = None
    balance_abs_threshold: int | None = None
    balance_rel_threshold: float | None = None
    conversations: str = "none"
    time_scale: float = 1.0
    scale: float | None = None
    prime: bool = False
    policies: str = "sglang,penelope"
    repeat: int = 1
    band: float | None = None
    jitter: float | None = None
    perturb_seed: int | None = None
    jobs: int | None = None


@dataclass
class Setup:
    """A prepared simulation: the loaded workload, the models, the settings to replay
    ((capacity, router) pairs), the policies, the runs of each setting and the worker processes,
    and `config`: a JSON-ready description of all of it."""

    workload: Workload
    config: dict
    shape: ModelShape
    time_model: TimeModel
    cost: CostModel
    capacities: list[int]
    settings: list[tuple[int, str]]
    policies: list[str]
    repeat: int
    perturbation: Perturbation | None
    jobs: int
    make_config: Callable[..., SimConfig]

    def configs(self) -> list[SimConfig]:
        """The server configuration of every setting, in order."""
        return [self.make_config(capacity, router) for capacity, router in self.settings]


def ensemble_runs(spec: SimulationSpec) -> tuple[int, Perturbation | None]:
    """(repeat, the perturbation of its runs or None for a single run); perturbation fields need
    `repeat` >= 2."""
    repeat = spec.repeat
    for name in ("repeat", "sessions", "replicas", "page_size", "max_running_requests"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"`{name}` must be an integer, got {value!r}")
    if repeat < 1:
        raise UsageError(f"`repeat` must be at least 1, got {repeat}")
    if repeat > MAX_REPEAT:
        raise UsageError(f"`repeat` must be at most {MAX_REPEAT:,}, got {repeat:,}")
    if spec.jobs is not None and spec.jobs < 1:
        raise UsageError(f"`jobs` must be at least 1, got {spec.jobs}")
    if spec.jobs is not None and spec.jobs > MAX_JOBS:
        raise UsageError(f"`jobs` must be at most {MAX_JOBS}, got {spec.jobs:,} (each worker holds the whole workload)")
    given = [name for name in ("band", "jitter", "perturb_seed") if getattr(spec, name) is not None]
    if repeat == 1:
        if given:
            raise UsageError(f"`{given[0]}` applies to the runs of an ensemble: give `repeat` N with N >= 2")
        return 1, None
    return repeat, Perturbation(
        band=DEFAULT_BAND if spec.band is None else spec.band,
        jitter=0.0 if spec.jitter is None else spec.jitter,
        seed=0 if spec.perturb_seed is None else spec.perturb_seed,
    )


def check_tier_policies(policies: list[str], cpu_cache: int) -> None:
    """SGLang's own policies (ported) model its GPU radix cache only: refuse them with a CPU tier."""
    ported = [name for name in policies if isinstance(get_policy(name), SGLangPolicy)]
    if ported and cpu_cache:
        raise UsageError(f"`policies` {','.join(ported)}: SGLang's own policies model its GPU radix cache; "
                         "run them without `cpu_cache` (the two tiers' baseline is sglang, HiCache-like)")


def _capacities(gpu_cache: str | int | Sequence[int] | None) -> list[int]:
    if gpu_cache is None:
        return []
    if isinstance(gpu_cache, (list, tuple)):
        gpu_cache = ",".join(str(c) for c in gpu_cache)
    return parse_size_list(gpu_cache, "`gpu_cache`")


def prepare(spec: SimulationSpec, *, sweep_routers: bool = True, replicas_chosen_later: bool = False,
            jobs: int | None = None) -> Setup:
    """Check every field of `spec`, load its workload (waits scaled by `time_scale`, conversations
    recovered, tokens scaled by `scale`), build the time and cost models and the settings, and
    check the memory the replays may reach. `sweep_routers`: a comma-separated `router` sweeps;
    `replicas_chosen_later`: the replica count may still change (`penelope analyze` picks it from
    the offered load); `jobs`: worker processes (None: `spec.jobs`)."""
    policies = parse_policies(spec.policies)
    if spec.replicas is not None and spec.replicas > 1:
        check_fleet_policies(policies, spec.replicas)
    cpu_cache = parse_size(spec.cpu_cache, "`cpu_cache`", allow_zero=True)
    check_tier_policies(policies, cpu_cache)
    repeat, perturbation = ensemble_runs(spec)
    shape = get_model(spec.model)
    if spec.calibration:
        time_model = TimeModel.from_json(spec.calibration, shape, spec.gpu)
    else:
        time_model = TimeModel.estimate(shape, spec.gpu)
    time_model = dataclasses.replace(time_model, phantom_kernel=spec.phantom_kernel)
    capacities = _capacities(spec.gpu_cache)
    if spec.swap_buffer is not None and not cpu_cache:
        raise UsageError("`swap_buffer` applies to the two tiers: give `cpu_cache` too")
    swap_buffer = parse_size(spec.swap_buffer or DEFAULT_SWAP_BUFFER, "`swap_buffer`")
    if cpu_cache:
        check_host_slots(cpu_cache, swap_buffer, "`cpu_cache`", "`swap_buffer`")
    chunk_size = parse_size(spec.chunk_size, "`chunk_size`")
    if spec.scale is not None:
        check_scale(spec.scale)
    limits = dict(page_size=spec.page_size, max_running_requests=spec.max_running_requests,
                  max_prefill_tokens=parse_size(spec.max_prefill_tokens, "`max_prefill_tokens`"))
    # A scaled replay names every token by a key of its own (penelope.sim.workloads.scale): the
    # cache then keeps SGLang's pages, as the server it replays does; otherwise blocks of 64 tokens.
    block_size = spec.page_size if spec.scale is not None else 64
    thresholds = tuple(name for name in THRESHOLDS if getattr(spec, name) is not None)
    routers = choose_routers(spec.router, spec.replicas, sweep=sweep_routers, thresholds=thresholds,
                             replicas_chosen_later=replicas_chosen_later)
    routing = RouterConfig(**{name: getattr(spec, name) for name in thresholds})
    time_scale = check_time_scale(spec.time_scale)
    if spec.conversations not in conversations.MODES:
        conversations.apply(None, spec.conversations)

    def make_config(capacity: int, router: str = routers[0]) -> SimConfig:
        return SimConfig(gpu_cache=capacity, cpu_cache=cpu_cache, swap_buffer=swap_buffer, sessions=spec.sessions,
                         scheduler=spec.scheduler, chunk_size=chunk_size, block_size=block_size,
                         replicas=spec.replicas, **limits, router=router, routing=routing, prime=spec.prime)

    capacities = capacities or [default_gpu_cache(shape)]
    # With one replica the router has nothing to choose: one setting per capacity.
    settings = [(c, router) for c in capacities for router in (routers if spec.replicas > 1 else routers[:1])]
    # Every field is checked before the (slow) workload load and replays.
    for capacity, router in settings:
        make_config(capacity, router)
    workload, description = load(spec.workload)
    if spec.conversations != "none":
        workload = conversations.apply(workload, spec.conversations)
        description["sessions"] = len(workload.sessions)
    description["conversations"] = spec.conversations
    description["closed_loop"] = workload.closed_loop
    workload = scale_time(workload, time_scale)
    description["time_scale"] = time_scale
    check_prime(workload, prime=spec.prime, sessions=spec.sessions, max_requests=None)
    description["prime"] = spec.prime
    if spec.scale is not None:
        # After the turns and the waits are chosen, as the load generator scales (they count trace tokens).
        workload = scale_workload(workload, spec.scale)
    description["scale"] = spec.scale
    check_fits(workload, capacities, spec.prime)
    workers = spec.jobs if jobs is None else jobs
    if workers is None:
        workers = default_jobs() if repeat > 1 or len(settings) > 1 else 1
    check_replay_memory(workload, max(capacities) + cpu_cache, spec.sessions, spec.replicas,
                        min(workers, repeat * len(policies) * len(settings)))
    config = {
        "workload": description,
        "model": shape.name,
        "gpu": time_model.gpu,
        "num_gpus": time_model.num_gpus,
        "calibration": spec.calibration,
        "cpu_cache": cpu_cache,
        "swap_buffer": swap_buffer if cpu_cache else None,
        "sessions": spec.sessions,
        "scheduler": spec.scheduler,
        "chunk_size": chunk_size,
        **limits,
        "block_size": block_size,
        "replicas": spec.replicas,
        "time_model": time_model.as_dict(),
    }
    if spec.replicas > 1:
        config["routers"] = routers
        config["routing"] = dataclasses.asdict(routing)
    return Setup(workload=workload, config=config, shape=shape, time_model=time_model, cost=CostModel(shape),
                 capacities=capacities, settings=settings, policies=policies, repeat=repeat,
                 perturbation=perturbation, jobs=workers, make_config=make_config)


def check_fits(workload: Workload, capacities: list[int], prime: bool) -> None:
    """Every capacity holds at least one request (one that `prime` measures, when it is set)."""
    smallest = min(r.input_tokens + r.output_tokens for _, _, r in workload.requests())
    # `prime` leaves each session's first request out of the figures: one of the others must fit.
    measured = min(r.input_tokens + r.output_tokens for _, i, r in workload.requests() if i > 0) if prime else 0
    for capacity in capacities:
        if capacity < smallest:
            raise UsageError(f"`gpu_cache` {format_size(capacity)}: no request of the workload fits in it (the "
                             f"smallest needs {smallest:,} tokens of input and output)")
        if capacity < measured:
            raise UsageError(f"`gpu_cache` {format_size(capacity)}: no request `prime` measures fits in it (the "
                             f"smallest needs {measured:,} tokens of input and output; the first turns it leaves "
                             "out are smaller)")


def check_replay_memory(workload: Workload, capacity: int, sessions: int, replicas: int, workers: int) -> None:
    """Caches grow as they fill: what the largest one may reach must fit, in every replica of every
    worker process."""
    concurrent = sessions if workload.closed_loop else 64
    need = replay_memory(workload, capacity, max(1, concurrent)) * replicas * workers
    where = f" in {workers} processes" if workers > 1 else ""
    on = f" on each of {replicas} replicas" if replicas > 1 else ""
    check_memory(need, f"replaying {workload.num_requests:,} requests in a cache of {format_size(capacity)} "
                 f"tokens{on}{where}")


def simulate(setup: Setup, *, progress=None, on_ensemble=None) -> list[Ensemble]:
    """Replay every setting of `setup` (`setup.repeat` runs of each policy), in `setup.jobs`
    worker processes; one `Ensemble` per setting, in order. `progress`: a tqdm-like bar updated
    per replayed request; `on_ensemble(i, ensemble)`: called as each setting finishes."""
    return run_ensembles(setup.workload, setup.policies, setup.configs(), setup.time_model, setup.cost,
                         repeat=setup.repeat, perturbation=setup.perturbation, jobs=setup.jobs, progress=progress,
                         on_ensemble=on_ensemble)
