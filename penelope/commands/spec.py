"""The `SimulationSpec` (`penelope.sim.api`) a command's options describe: `simulate`, `analyze`
and `reproduce` fill one from their options, each field from the option of its name."""

from __future__ import annotations


def simulation_spec(args, trace: str | None = None):
    """The `SimulationSpec` of a command's options (each field from the option of its name, where
    the command has one; `trace`: the workload's path)."""
    import dataclasses

    from penelope.commands.workload_options import workload_spec
    from penelope.sim.api import SimulationSpec

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimulationSpec)
             if f.name != "workload" and hasattr(args, f.name)}
    workload = workload_spec(args, trace) if hasattr(args, "max_context") else None
    return SimulationSpec(**given, **({"workload": workload} if workload is not None else {}))
