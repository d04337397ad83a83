"""`penelope calibrate`: time a running server's prefill batches and decode steps, fit the
simulator's time model to them and write the calibration JSON `penelope simulate --calibration`
reads.

    penelope calibrate --url http://127.0.0.1:30000 --model MODEL_DIR --out calibration.json --points points.json
    penelope calibrate --from-points points.json --model MODEL_DIR --out calibration.json   # the fits again

A fit written with `--accept-poor-fit` says so in its `source`: `POOR_FIT` and each poor fit's R^2.

See `penelope.loadgen.calibrate` (what is sent and timed) and `penelope.sim.calibration` (the fits).
"""

from __future__ import annotations

import os

# A fit worse than this is refused unless --accept-poor-fit: the simulator would then predict
# times the server does not take.
MIN_R2 = 0.9
# In the `source` of a calibration written with --accept-poor-fit, beside each poor fit's R^2.
POOR_FIT = "poor fit"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="time a running server's prefill and decode and write the simulator's calibration JSON",
        description=(
            "Times prefill batches (new tokens after cached prefixes) and decode steps (batch sizes at several "
            "contexts) on a running server (SGLang's /generate or an OpenAI /v1/completions, token ids), fits the "
            "simulator's time model to the fastest repeat of each point (prefill: overhead + per linear unit + per "
            "attention pair; decode: overhead + per request + KV read growing with the context), prints the fits' "
            "R^2 and largest relative error, and writes the calibration JSON for penelope simulate --calibration. "
            "--from-points refits the points a run saved with --points, without a server."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="the server, http://HOST:PORT")
    source.add_argument("--from-points", metavar="FILE.json",
                        help="fit the points a run wrote with --points instead of measuring (no server)")
    parser.add_argument("--api", default="generate", choices=("generate", "openai"),
                        help="generate: SGLang's /generate with input_ids (default); openai: /v1/completions")
    parser.add_argument("--model", required=True,
                        help="the served model's config.json (or its folder) or a built-in model name: its linear "
                        "cost per token and KV bytes per token; the simulator is then run with the same --model")
    parser.add_argument("--out", required=True, metavar="FILE.json", help="the calibration JSON to write")
    parser.add_argument("--points", metavar="FILE.json", help="also write every measured point and the fits' quality")
    parser.add_argument("--prefixes", default="0,1K,2K,4K,8K,16K",
                        help="cached prefix lengths of the prefill points (default 0,1K,2K,4K,8K,16K)")
    parser.add_argument("--new-tokens", default="64,256,1K",
                        help="new tokens per prefill point, each at most one chunk (default 64,256,1K)")
    parser.add_argument("--batches", default="1,2,4", help="decode batch sizes (default 1,2,4)")
    parser.add_argument("--contexts", default="1K,4K,8K,16K",
                        help="decode contexts per request (default 1K,4K,8K,16K)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode point (default 32)")
    parser.add_argument("--repeat", type=int, default=2, help="times each point is measured (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token ids sent")
    parser.add_argument("--vocab", type=int, metavar="N", help="ids below N (default: the served model's vocabulary)")
    parser.add_argument("--accept-poor-fit", action="store_true",
                        help=f"write the calibration even when a fit's R^2 is below {MIN_R2}")


def run(args) -> int:
    from penelope.commands.simulate_json import write_json
    from penelope.costmodel.recompute import CostModel
    from penelope.costmodel.shapes import get_model, model_path
    from penelope.errors import Interrupted, PenelopeError, UsageError
    from penelope.loadgen.calibrate import CalibrationPlan, Points, parse_counts, read_points, run_measure
    from penelope.loadgen.target import base_url, probe_server
    from penelope.loadgen.tokens import MAX_VOCAB
    from penelope.outputs import check_outputs

    shape = get_model(args.model)
    cost = CostModel(shape)
    if args.from_points is not None:
        # The config.json and the points are inputs: never written over.
        check_outputs({"--out": args.out, "--points": args.points},
                      {"--model": model_path(args.model), "--from-points": args.from_points})
        points, saved = read_points(args.from_points)
        if saved.get("c_lin") != cost.c_lin:
            raise UsageError(f"--from-points {args.from_points}: measured for a model of {saved.get('c_lin')!r} linear "
                             f"units per token, --model {args.model} has {cost.c_lin:g}: give the model the points "
                             "were measured with")
        print(f"refitting {len(points.prefill)} prefill and {len(points.decode)} decode points of "
              f"{args.from_points} for {shape.name}", flush=True)
        return fit_and_write(args, shape, cost, points, saved.get("server") or {},
                             f"penelope calibrate --from-points {args.from_points}")
    plan = CalibrationPlan(prefixes=parse_counts(args.prefixes, "--prefixes", allow_zero=True),
                           new_tokens=parse_counts(args.new_tokens, "--new-tokens"),
                           batches=parse_counts(args.batches, "--batches"),
                           contexts=parse_counts(args.contexts, "--contexts"),
                           decode_tokens=args.decode_tokens, repeat=args.repeat, seed=args.seed)
    if args.vocab is not None and not 3 <= args.vocab <= MAX_VOCAB:
        raise UsageError(f"--vocab must be in [3, 2**31], got {args.vocab}")
    base_url(args.url)
    # The model's config.json (also when --model names its folder) is an input: never written over.
    check_outputs({"--out": args.out, "--points": args.points}, {"--model": model_path(args.model)})
    target = probe_server(args.url, args.api, vocab=args.vocab)
    chunk = (target.info or {}).get("chunked_prefill_size")
    if isinstance(chunk, int) and chunk > 0 and max(plan.new_tokens) > chunk:
        raise UsageError(f"--new-tokens: {max(plan.new_tokens):,} is more than the server's chunk ({chunk:,}): "
                         "a point must be one prefill batch")
    print(f"calibrating {target.url} ({args.api}) for {shape.name}: {len(plan.prefixes)} prefixes x "
          f"{len(plan.new_tokens)} sizes x {plan.repeat} prefill points, {len(plan.contexts)} contexts x "
          f"{len(plan.batches)} batches x {plan.repeat} decode points", flush=True)
    points = Points()

    def keep_points(why: str) -> str:
        if not args.points or not (points.prefill or points.decode):
            return ""
        write_json(args.points, {"server": target.as_dict(), "model": shape.name, "c_lin": cost.c_lin,
                                 "prefill": [list(p) for p in points.prefill],
                                 "decode": [list(d) for d in points.decode], "stopped": why})
        return f"; the points measured are in {args.points}"

    try:
        run_measure(target, plan, points, say=lambda line: print(line, flush=True))
    except KeyboardInterrupt as stop:
        error = Interrupted(f"interrupted: no calibration written{keep_points('interrupted')}")
        # The CLI tells SIGTERM (exit 143) from Ctrl-C (130) by what was being handled.
        error.__context__ = stop
        raise error from None
    except PenelopeError as err:
        raise type(err)(f"{err}; no calibration written{keep_points(str(err))}") from None
    return fit_and_write(args, shape, cost, points, target.as_dict(), f"penelope calibrate {target.url}")


# The prefill constants a calibration fits (`fit_calibration`).
PREFILL_CONSTANTS = ("batch_overhead", "sec_per_linear_unit", "sec_per_attention_pair")


def fit_and_write(args, shape, cost, points, server: dict, source: str) -> int:
    """Fit the time model to the fastest repeat of each of `points`, print the fits' quality,
    write `--points` (every point, the fits, their quality) and, unless a fit is poor, `--out`."""
    import numpy as np

    from penelope.commands.simulate_json import write_json
    from penelope.errors import UsageError
    from penelope.sim.calibration import (
        decode_prediction,
        fastest_repeats,
        fit_calibration,
        fit_decode,
        fit_quality,
        prefill_prediction,
        repeat_spread,
    )
    from penelope.sim.timemodel import TimeModel

    estimate = TimeModel.estimate(shape)
    try:
        with np.errstate(all="ignore"):
            measured = {"prefill": [(cost.c_lin * tokens, pairs, seconds)
                                    for tokens, pairs, seconds, _ in points.prefill if tokens > 0],
                        "decode": list(points.decode)}
            prefill, steps = fastest_repeats(measured["prefill"]), fastest_repeats(measured["decode"])
            fit = fit_calibration(prefill, model=shape.name, gpu=None, source=source)
            quality = {}
            if len(prefill) >= 3:
                # Scored with the constants the simulator will use: a constant the points leave at
                # zero is not written (the time model needs it positive), so it keeps its estimate.
                used = {key: fit.get(key, getattr(estimate, key)) for key in PREFILL_CONSTANTS}
                quality["prefill"] = fit_quality(
                    prefill_prediction(used, [p[0] for p in prefill], [p[1] for p in prefill]),
                    [p[2] for p in prefill])
            decode = fit_decode(steps, estimate.kv_bytes_per_token)
            if decode:
                quality["decode"] = fit_quality(
                    decode_prediction(decode, [d[0] for d in steps], [d[1] for d in steps]), [d[2] for d in steps])
                fit.update(decode)
    except (OverflowError, np.linalg.LinAlgError) as err:
        raise UsageError(f"the measured points cannot be fitted ({err}): times or token counts out of "
                         "any plausible range") from None
    for name, q in quality.items():
        spread = repeat_spread(measured[name])
        repeats = "" if spread is None else (f" (the fastest of each point's repeats, which differ by {spread[0]:.0%} "
                                             f"in the median, {spread[1]:.0%} at most)")
        print(f"{name}: R^2 {q['r2']:.3f}, largest relative error {q['max_relative_error']:.1%} over "
              f"{q['points']} points{repeats}")
    if not decode:
        print("decode: fewer than 3 timed steps, or steps that do not grow with the KV held; the decode constants "
              "keep their estimates")
    for key in PREFILL_CONSTANTS:
        if len(prefill) >= 3 and key not in fit:
            print(f"  {key}: the points leave it at zero; the simulator keeps its estimate "
                  f"{getattr(estimate, key):.4g}, and the fit above is scored with it")
    for key in ("batch_overhead", "sec_per_linear_unit", "sec_per_attention_pair", "decode_overhead",
                "hbm_bandwidth", "embedding_row_bytes", "kv_read_growth"):
        if key in fit:
            print(f"  {key} = {fit[key]:.4g}")
    if args.points:
        write_json(args.points, {"server": server, "model": shape.name, "c_lin": cost.c_lin,
                                 "prefill": [list(p) for p in points.prefill],
                                 "decode": [list(d) for d in points.decode], "fit": fit, "quality": quality})
        print(f"wrote {args.points}")
    if len(prefill) < 3:
        # No fit at all, poor or not: --accept-poor-fit would write a calibration without constants.
        kept = f" (the points are in {args.points})" if args.points else ""
        raise UsageError(f"{len(prefill)} prefill points with new tokens and a positive time (repeats counted once, "
                         f"of {len(points.prefill)} measured): the fit of 3 constants needs at least 3; no "
                         f"calibration written{kept}")
    poor = [name for name, q in quality.items() if not q["r2"] >= MIN_R2]
    if poor and not args.accept_poor_fit:
        kept = f" (the points are in {args.points})" if args.points else ""
        raise UsageError(f"the {' and '.join(poor)} fit is poor (R^2 below {MIN_R2}): the server's times do not "
                         f"follow the time model (a loaded machine? too few points?); no calibration written{kept} "
                         "(--accept-poor-fit writes it anyway)")
    if poor:
        figures = ", ".join(f"{name} R^2 {quality[name]['r2']:.3f}" for name in poor)
        fit["source"] = f"{fit['source']}; {POOR_FIT}: {figures} (below {MIN_R2}), written with --accept-poor-fit"
        print(f"{POOR_FIT}: {figures} (below {MIN_R2}); written as asked (--accept-poor-fit), labelled in its source")
    write_json(args.out, fit)
    # Checked the way the simulator reads it; a device (/dev/null) cannot be read back.
    if os.path.isfile(args.out):
        TimeModel.from_json(args.out, shape)
    print(f"wrote {args.out}: penelope simulate --model {args.model} --calibration {args.out}")
    return 0
