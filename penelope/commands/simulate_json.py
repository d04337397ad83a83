"""The JSON `penelope simulate --json` writes: one setting's `results`, or a `sweep` with one
entry per (GPU capacity, router) setting, and after Ctrl-C the settings that finished."""

from __future__ import annotations

import json

from penelope.units import format_size


def setting_results(ensemble, policies: list[str]) -> dict:
    """Results by policy of one setting: each policy's `PolicyResult.as_dict()` for a single run,
    its `Ensemble.policy_dict` (means, intervals, every run) for an ensemble."""
    if ensemble.repeat > 1:
        return {name: ensemble.policy_dict(name) for name in policies}
    return {name: result.as_dict() for name, result in ensemble.runs[0].items()}


def sweep_payload(config: dict, settings: list[tuple[int, str]], finished: list, fleet: bool) -> dict:
    """The JSON of a run over `settings` ((capacity, router) pairs): one setting's `results`, or a
    `sweep` of every finished one (`finished`: [((capacity, router), results)], in settings order),
    each entry naming its router when the servers are a fleet."""
    payload = {"config": config}
    if len(settings) == 1:
        payload["results"] = finished[0][1]
    else:
        payload["sweep"] = [
            {"gpu_cache": capacity, **({"router": router} if fleet else {}), "results": results}
            for (capacity, router), results in finished
        ]
    return payload


def write_json(path: str, payload: dict) -> None:
    from penelope.outputs import write_text

    write_text(path, json.dumps(payload, indent=2))


def interrupted(path: str | None, config: dict, settings: list[tuple[int, str]], finished: list, fleet: bool):
    """Ctrl-C during the replays: write the settings that finished (with `interrupted` saying which
    did not: capacities, or [capacity, router] pairs for a fleet) to `path`, and return the
    one-line `Interrupted` to raise."""
    from penelope.errors import Interrupted

    if not path:
        return Interrupted("interrupted")
    noun = "settings" if fleet else "capacities"
    if not finished:
        return Interrupted(f"interrupted before any of the {noun} finished; {path} not written"
                           if fleet else f"interrupted before any capacity finished; {path} not written")
    done = [setting for setting, _ in finished]

    def name(setting):
        return list(setting) if fleet else setting[0]

    payload = sweep_payload(config, settings, sorted(finished, key=lambda item: settings.index(item[0])), fleet)
    payload["interrupted"] = {"finished": [name(s) for s in done],
                              "not_run": [name(s) for s in settings if s not in done]}
    write_json(path, payload)
    labels = ", ".join(format_size(c) + (f" {r}" if fleet else "") for c, r in done)
    return Interrupted(f"interrupted; wrote the {len(done)} of {len(settings)} {noun} that finished "
                       f"({labels}) to {path}")
