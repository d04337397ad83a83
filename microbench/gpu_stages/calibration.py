"""Last stage: the simulator's calibration file, from the points the other stages left.

``calibration_gpu.json`` (``calibration_reduced.json`` for a reduced run) holds the keys of
``penelope.sim.timemodel`` that this run measured, so ``penelope simulate --calibration`` keeps its
documented estimate for every other key. Whatever stages completed count: a stage killed at its
limit contributes the points it had written.

- ``sec_per_linear_unit``, ``sec_per_attention_pair``, ``batch_overhead``: fitted to the cost
  curve's timed batches (``penelope.sim.calibration.fit_calibration``);
- ``decode_overhead``, ``hbm_bandwidth`` (``bench_decode.fit_decode``) and the bytes a decode step
  reads (``weight_bytes``, ``embedding_row_bytes``, ``kv_bytes_per_token``): the decode steps;
- ``load_bandwidth``: host-to-device GB/s of the faster way the swap executor moves scattered
  64-token blocks (the copy engines block by block, or the Triton kernel);
- ``triton_pair_ratio``: our kernel's time over the fastest FA-class SDPA provider's on the same
  front (phantom) batches, the median over contexts.

``source`` names the device, the commit (or the tree's fingerprint) and, key by key, which were
measured and which stay the simulator's estimates; the ``calibration`` point says the same. A
measured value outside the time model's ranges is left out and named.
"""

from __future__ import annotations

import statistics

from bench_cost_curve import calibration_points
from bench_decode import DecodeBytes, fit_decode
from machine import gpu_kind

from penelope.costmodel.shapes import get_model, shape_from_config
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS
from penelope.sim.calibration import fit_calibration
from penelope.sim.timemodel import CALIBRATION_KEYS, RANGES, TimeModel, write_calibration

from .context import CHECK_FAILED, PASSED, StageContext
from .files import calibration_file
from .points import POINTS_FILE, read_points

FA_CLASS = ("sdpa_flash", "sdpa_cudnn", "sdpa_math")
LOAD_PROVIDERS = ("memcpy_blocks", "triton")


def prefill_constants(points: list[dict]) -> dict:
    rows = [p for p in points if p["stage"] == "cost_curve" and p["kind"] == "context"]
    if not rows:
        return {}
    fit = fit_calibration(calibration_points(rows, rows[0]["c_lin"]), model=rows[0]["model"], gpu=None, source="")
    return {key: value for key, value in fit.items() if key in CALIBRATION_KEYS}


def decode_constants(points: list[dict], model: str | None) -> dict:
    steps = [p for p in points if p["stage"] == "decode" and p["kind"] == "step"
             and (model is None or p["model"] == model)]
    if not steps:
        return {}
    first = steps[0]
    values = {key: float(first[key]) for key in ("weight_bytes", "embedding_row_bytes", "kv_bytes_per_token")}
    read = DecodeBytes(values["weight_bytes"], values["embedding_row_bytes"], values["kv_bytes_per_token"])
    try:
        fit = fit_decode([(p["batch"], p["kv_tokens"], p["seconds"]) for p in steps], read)
    except ValueError:
        return values
    values["decode_overhead"] = fit["decode_overhead"]
    if "hbm_bandwidth" in fit:
        values["hbm_bandwidth"] = fit["hbm_bandwidth"]
    return values


def load_bandwidth(points: list[dict]) -> dict:
    rates = [p["gb_per_s"] for p in points if p["stage"] == "swap" and p["kind"] == "copy"
             and p["direction"] == "h2d" and p["provider"] in LOAD_PROVIDERS]
    return {"load_bandwidth": max(rates) * 1e9} if rates else {}


def triton_pair_ratio(points: list[dict]) -> dict:
    speeds = [p for p in points if p["stage"] == "attention" and p["kind"] == "speed" and p["layout"] == "front"]
    ratios = []
    for context in sorted({p["context"] for p in speeds}):
        here = [p for p in speeds if p["context"] == context]
        ours = [p["seconds"] for p in here if p["provider"] == "penelope"]
        references = [p["seconds"] for p in here if p["provider"] in FA_CLASS and p.get("matches_ours")]
        if ours and references:
            ratios.append(ours[0] / min(references))
    return {"triton_pair_ratio": statistics.median(ratios)} if ratios else {}


def build(points: list[dict]) -> tuple[dict, dict, dict]:
    """The calibration's values, the stage each measured key came from, and the keys left out
    (with why)."""
    curve = [p for p in points if p["stage"] == "cost_curve" and p["kind"] == "context"]
    steps = [p for p in points if p["stage"] == "decode" and p["kind"] == "step"]
    model = curve[0]["model"] if curve else steps[0]["model"] if steps else None
    parts = {"cost_curve": prefill_constants(points), "decode": decode_constants(points, model),
             "swap": load_bandwidth(points), "attention": triton_pair_ratio(points)}
    values, origin, dropped = {}, {}, {}
    for stage, found in parts.items():
        for key, value in found.items():
            low, high = RANGES[key]
            if not low <= value <= high or (value == 0 and key in ("hbm_bandwidth", "load_bandwidth")):
                dropped[key] = f"{value:g} is outside the time model's range [{low:g}, {high:g}]"
                continue
            values[key], origin[key] = value, stage
    if steps and model is not None and any(p["model"] != model for p in steps):
        dropped["decode"] = f"decode steps of another model than the cost curve's {model!r} were left out"
    if model is not None:
        values["model"] = model
    return values, origin, dropped


def model_shape(name: str):
    if name in BUILTIN_ENGINE_CONFIGS:
        return shape_from_config(BUILTIN_ENGINE_CONFIGS[name].to_hf(), name=name)
    return get_model(name)


def run(ctx: StageContext) -> int:
    points = read_points(ctx.out / POINTS_FILE)
    environment = next((p for p in points if p["kind"] == "environment"), {})
    device = (next((p for p in points if p["kind"] == "device"), {}).get("cuda_device") or {}).get("name")
    values, origin, dropped = build(points)
    gpu = gpu_kind(device)
    if gpu is not None:
        values["gpu"] = gpu
    estimates = [key for key in CALIBRATION_KEYS if key not in origin]
    identity = environment.get("commit") or f"tree {str(environment.get('tree_fingerprint'))[:12]}"
    if environment.get("commit_dirty"):
        identity += " with uncommitted changes"
    measured = ", ".join(f"{key} ({stage})" for key, stage in origin.items()) or "nothing"
    values["source"] = (f"microbench/run_gpu.py on {device or 'cpu'} at {identity}, "
                        f"{'full' if ctx.full else 'reduced'} shapes: measured {measured}; "
                        f"simulator estimates kept: {', '.join(estimates)}")
    path = ctx.out / calibration_file(ctx.full)
    path.unlink(missing_ok=True)
    write_calibration(path, values)
    readable = None
    if "model" in values:
        TimeModel.from_json(path, model=model_shape(values["model"]), gpu=gpu or "h100")
        readable = True
    ctx.log.write("calibration", file=path.name, values=values, measured=origin, estimates=estimates,
                  left_out=dropped, read_back=readable)
    return PASSED if origin else CHECK_FAILED
