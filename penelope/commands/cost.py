"""`penelope cost`: the cost model's predicted speedup of front over tail eviction."""
from __future__ import annotations

import json

from penelope.costmodel.recompute import CostModel, predict_speedup
from penelope.costmodel.shapes import get_model, model_path
from penelope.outputs import check_outputs, write_text
from penelope.tables import format_table
from penelope.units import format_size, parse_size, parse_size_list

DEFAULT_CONTEXTS = "8K,16K,32K,64K,128K"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "cost",
        help="predicted speedup of evicting the front of a history instead of its tail",
        description=(
            "The paper's experiment in the cost model: cache a context, evict a fraction of it either "
            "as one span starting at --evict-start or from the tail, append new tokens, and compare "
            "the cost of the next request (tail / front)."
        ),
    )
    parser.add_argument("--model", default="qwen3-8b", help="built-in name or path to a config.json")
    parser.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="comma-separated context sizes")
    parser.add_argument("--evict-frac", type=float, default=0.3, help="fraction of the context evicted")
    parser.add_argument("--evict-start", default="2K", help="first position of the front eviction")
    parser.add_argument("--append", default="512", help="new tokens of the next request")
    parser.add_argument("--json", metavar="FILE", help="write the table as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the predicted curve")


def run(args) -> int:
    check_outputs({"--json": args.json, "--plot": args.plot}, {"--model": model_path(args.model)})
    shape = get_model(args.model)
    cost = CostModel(shape)
    contexts = parse_size_list(args.contexts, "--contexts")
    start = parse_size(args.evict_start, "--evict-start", allow_zero=True)
    append = parse_size(args.append, "--append", allow_zero=True)
    predictions = [predict_speedup(cost, n, args.evict_frac, start, append) for n in contexts]

    print(f"model {shape.name}: c_lin = {cost.c_lin:,.0f} attention-pair units per token")
    print(
        f"evict {args.evict_frac:.0%} of the context from position {format_size(start)} (front) "
        f"or from the tail, then append {append} tokens"
    )
    rows = [
        (
            format_size(p.context),
            f"{p.predicted_speedup:.3f}x",
            f"{p.tail_cost:.4g}",
            f"{p.front_cost:.4g}",
            p.evicted,
        )
        for p in predictions
    ]
    print(format_table(("context", "predicted speedup", "tail cost", "front cost", "evicted"), rows))

    if args.json:
        payload = {
            "model": shape.name,
            "c_lin": cost.c_lin,
            "evict_frac": args.evict_frac,
            "evict_start": start,
            "append": append,
            "rows": [
                {
                    "context": p.context,
                    "evicted": p.evicted,
                    "predicted_speedup": p.predicted_speedup,
                    "tail_cost": p.tail_cost,
                    "front_cost": p.front_cost,
                }
                for p in predictions
            ],
        }
        write_text(args.json, json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        _plot(args.plot, shape.name, predictions)
        print(f"wrote {args.plot}")
    return 0


def _plot(path: str, model: str, predictions) -> None:
    from penelope.plotting import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.context / 1024 for p in predictions], [p.predicted_speedup for p in predictions], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("predicted speedup, tail / front eviction")
    ax.set_title(f"{model}: recompute cost of the next request")
    ax.grid(True, alpha=0.3)
    save(fig, path)
