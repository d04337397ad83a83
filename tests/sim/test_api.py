"""The simulator's front door (`penelope.sim.api`): a spec replays exactly what `penelope
simulate` replays with the same options, and a bad field is one `UsageError` naming the field."""
import json

import pytest

from penelope.cli import main
from penelope.errors import UsageError
from penelope.sim import SimulationSpec, WorkloadSpec, prepare, simulate

SMALL = WorkloadSpec(limit_sessions=2)


def test_a_spec_replays_what_the_command_replays(tmp_path, capsys):
    setup = prepare(SimulationSpec(SMALL, gpu_cache="64K,128K", policies="sglang,penelope"))
    assert setup.capacities == [64 * 1024, 128 * 1024] and setup.policies == ["sglang", "penelope"]
    ensembles = simulate(setup)
    assert len(ensembles) == len(setup.settings) == 2
    out = tmp_path / "sim.json"
    assert main(["simulate", "--limit-sessions", "2", "--gpu-cache", "64K,128K", "--no-progress",
                 "--json", str(out)]) == 0
    capsys.readouterr()
    sweep = json.loads(out.read_text())["sweep"]
    for (capacity, _), ensemble, setting in zip(setup.settings, ensembles, sweep, strict=True):
        assert setting["gpu_cache"] == capacity
        for policy in ("sglang", "penelope"):
            summary = ensemble.runs[0][policy].summary
            # One run per setting: the command writes the run's figures as they are.
            written = setting["results"][policy]
            assert written["ttft_mean"] == pytest.approx(summary.ttft_mean, rel=1e-12)
            assert written["hit_rate"] == pytest.approx(summary.hit_rate, rel=1e-12)
            assert written["recomputed_tokens"] == summary.recomputed_tokens


def test_an_ensemble_spec_perturbs_its_runs():
    setup = prepare(SimulationSpec(SMALL, gpu_cache="64K", repeat=2, band=0.02, jobs=1))
    assert setup.repeat == 2 and setup.perturbation.band == 0.02 and setup.jobs == 1
    (ensemble,) = simulate(setup)
    assert len(ensemble.runs) == 2


@pytest.mark.parametrize("changes, field", [
    (dict(gpu_cache="abc"), "`gpu_cache`"),
    (dict(repeat=0), "`repeat`"),
    (dict(repeat="2"), "`repeat`"),
    (dict(band=0.1), "`band`"),
    (dict(repeat=2, band=2.0), "`band`"),
    (dict(router="cache-aware"), "`router`"),
    (dict(cpu_cache="64K", policies="sglang-lfu"), "`cpu_cache`"),
    (dict(swap_buffer="2K"), "`swap_buffer`"),
    (dict(cpu_cache=2**31 - 1, swap_buffer="1K"), "`cpu_cache`"),
    (dict(workload=WorkloadSpec(think_time="sometimes")), "`think_time`"),
    (dict(workload=WorkloadSpec(turns=0)), "`turns`"),
    (dict(workload=WorkloadSpec(limit_sessions=2, turns=1), prime=True), "`turns`"),
    (dict(replicas=2, policies="oracle"), "`replicas`"),
])
def test_a_bad_field_is_one_error_naming_the_field(changes, field):
    spec = SimulationSpec(**{"workload": SMALL, **changes})
    with pytest.raises(UsageError) as error:
        prepare(spec)
    assert field in str(error.value) and "--" not in str(error.value)


def test_the_command_names_the_flag_the_library_names_a_field_by(capsys):
    assert main(["simulate", "--limit-sessions", "2", "--cpu-cache", "64K", "--policies", "sglang-lfu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("penelope: error: --policies sglang-lfu:") and "without --cpu-cache" in err
    assert "`" not in err
    assert main(["analyze", "/no/such/trace.jsonl", "--format", "mooncake", "--turns", "0"]) == 2
    assert "`" not in capsys.readouterr().err
