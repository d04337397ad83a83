"""`penelope reproduce`: the main job on the built-in defaults, in a few minutes on a laptop.

Runs, one after the other, the cost curve of the paper's position experiment (`penelope cost`),
and trace replays of the embedded synthetic Claude Code workload (`penelope simulate`): SGLang vs
Penelope over a capacity sweep, then the six-policy ablation grid under pressure. Every replay is
an ensemble of DEFAULT_REPEAT seeded, perturbed runs (`--repeat`), so every figure comes with its
95% interval. Every step writes its JSON and plot into the output folder and prints its table."""
from __future__ import annotations

# Runs per replay setting: intervals narrow enough to tell the policies apart, and the whole job
# within a few minutes on a 2-core machine.
DEFAULT_REPEAT = 6
# What the steps write into --out.
RESULT_FILES = ("cost.json", "cost.png", "simulate.json", "simulate.png", "ablation.json", "ablation.png")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "reproduce",
        help="cost curve + trace replays on the built-in defaults (JSON and plots in --out)",
        description=__doc__.split("\n\n")[1].replace("DEFAULT_REPEAT", str(DEFAULT_REPEAT)),
    )
    parser.add_argument("--out", default="results", help="folder for the JSON files and plots")
    parser.add_argument("--model", default="qwen3-8b", help="built-in model name or a config.json path")
    parser.add_argument("--sweep", default="128K,192K,256K", help="GPU cache capacities of the replay")
    parser.add_argument("--ablation-cache", default="192K", help="GPU cache capacity of the ablation grid")
    parser.add_argument("--limit-sessions", metavar="N", help="replay only the first N sessions (quick look)")
    parser.add_argument(
        "--repeat", type=int, default=DEFAULT_REPEAT, metavar="N",
        help=f"runs per replay setting, seeded and perturbed (default {DEFAULT_REPEAT}; 1: one unperturbed run)",
    )
    parser.add_argument("--band", help="time-model perturbation per run (see penelope simulate --help)")
    parser.add_argument("--jitter", help="wait perturbation per run (see penelope simulate --help)")
    parser.add_argument("--perturb-seed", help="seed of the perturbations")
    parser.add_argument("--jobs", help="worker processes of each ensemble (default: the CPU cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args) -> int:
    from penelope.cli import build_parser, main
    from penelope.commands.fields import as_flags
    from penelope.commands.spec import simulation_spec
    from penelope.commands.workload_options import fill_scoped_defaults
    from penelope.costmodel.shapes import get_model, model_path
    from penelope.errors import UsageError
    from penelope.outputs import check_folder, check_outputs
    from penelope.sim.api import prepare
    from penelope.units import parse_size, parse_size_list

    # Every input is checked before the first step, so a bad one costs nothing and no step's
    # results are replaced before the run stops.
    get_model(args.model)
    parse_size_list(args.sweep, "--sweep")
    parse_size(args.ablation_cache, "--ablation-cache")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {args.repeat}")
    out = check_folder("--out", args.out)
    check_outputs({f"--out {args.out}: {name}": str(out / name) for name in RESULT_FILES},
                  {"--model": model_path(args.model)})
    replay = ["--no-progress"] if args.no_progress else []
    if args.limit_sessions:
        replay += ["--limit-sessions", str(args.limit_sessions)]
    replay += ["--repeat", str(args.repeat)]
    for flag, value in (("--band", args.band), ("--jitter", args.jitter), ("--perturb-seed", args.perturb_seed),
                        ("--jobs", args.jobs)):
        if value is not None:
            replay += [flag, str(value)]
    steps = [
        ("cost curve", ["cost", "--model", args.model, "--json", str(out / "cost.json"),
                        "--plot", str(out / "cost.png")], None),
        ("SGLang vs Penelope, capacity sweep", ["simulate", "--model", args.model, "--gpu-cache", args.sweep,
                                                "--json", str(out / "simulate.json"),
                                                "--plot", str(out / "simulate.png"), *replay], "--sweep"),
        ("ablation grid", ["simulate", "--model", args.model, "--gpu-cache", args.ablation_cache,
                           "--policies", "ablation", "--json", str(out / "ablation.json"),
                           "--plot", str(out / "ablation.png"), *replay], "--ablation-cache"),
    ]
    parser = build_parser()
    # Each step: its title, its command line, and the option of reproduce that gives a replay's
    # `gpu_cache` (named in its errors).
    for _, argv, capacity_flag in steps:
        try:
            parsed = parser.parse_args(argv)
        except SystemExit as error:
            # The parser has said what is wrong, in one line.
            return error.code if isinstance(error.code, int) else 2
        if parsed.command == "simulate":
            # The replay's whole set-up (capacities against the workload, ranges, memory), checked
            # before the first step writes anything.
            if parsed.limit_sessions is not None and parsed.limit_sessions < 1:
                raise UsageError(f"--limit-sessions must be at least 1, got {parsed.limit_sessions}")
            fill_scoped_defaults(parsed)
            try:
                prepare(simulation_spec(parsed))
            except UsageError as error:
                raise UsageError(as_flags(str(error), {"gpu_cache": capacity_flag})) from None
    for number, (title, argv, _) in enumerate(steps, 1):
        print(f"\n== {number}/{len(steps)} {title}: penelope {' '.join(argv)}", flush=True)
        rc = main(argv)
        if rc:
            return rc
    print(f"\nall results in {out}/")
    return 0
