"""Soak of SGLang's real HTTP server on CPU with Penelope's cache, under eviction pressure and faults.

``python scripts/sglang_soak.py --minutes 5 --out results/soak`` saves the tests' tiny Qwen3 (real
random weights, a one-word-per-id tokenizer beside it) and, per configuration (``--configs``):

- ``gpu``: Penelope's radix cache on the device pool only;
- ``two-tiers``: plus Penelope's CPU tier of the same size;

starts ``python -m sglang.launch_server`` on 127.0.0.1 (its own process group, killed at the end,
on an error and on Ctrl-C) with SGLang's strict memory checks on (every step: free + evictable +
protected + request-owned == total; no page both owned and free, none freed twice; a leak when idle
raises) and runs ``penelope.loadgen.soak`` against it: ``--sessions`` closed-loop sessions for
``--minutes``, clients disconnecting mid-stream, ``/abort_request``, ``/flush_cache`` during load,
prompts longer than the context, malformed requests. Then it asks the server for a generation
(``/health_generate``), flushes its cache and reads Penelope's counters: nothing may stay cached
or held. Last, a reference server (SGLang's own ``torch_native`` attention, no radix cache: every
prompt computed whole) replays every completed request: the reply ids must be identical.

Pool: ``--pool`` tokens in pages of 16, chunks of ``--chunk`` (smaller than most holes, so holes
are refilled over several chunks as well as by phantoms), context 4,096, histories up to 3,072.
Exit status 0 when every check held, 1 otherwise (the table says which), 2 on bad arguments; Ctrl-C
or SIGTERM stops the servers, prints and writes what finished (``interrupted`` in soak.json) and
exits 130 or 143.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from penelope.integration.sglang.verify import tiny_model
from penelope.loadgen.models import word_level_tokenizer
from penelope.loadgen.runner import run_until_signal
from penelope.loadgen.server import CPU_ARGS, CPU_ENV, ServerSpec, SGLangServer
from penelope.loadgen.soak import SoakConfig, SoakReport, check_replies, reply_problems, server_faults, soak
from penelope.tables import format_table

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "engine_stub"
PAGE = 16
CONTEXT = 4096
MAX_CONTEXT = 3072
VOCAB = 1000
CONFIGS = ("gpu", "two-tiers")
# SGLang's strict memory checks (docs: tests/sglang/test_engine.py).
NO_END = {"generates": False, "flushed": False, "held_after_flush": {}, "plugin_active": False, "counters": {}}
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
          "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


def server_spec(model: Path, log: Path, config: str, pool: int, chunk: int) -> ServerSpec:
    path = os.pathsep.join(p for p in (str(STUB), os.environ.get("PYTHONPATH", "")) if p)
    common = ("--page-size", str(PAGE), "--context-length", str(CONTEXT), "--random-seed", "0")
    if config == "reference":
        args = (*CPU_ARGS, *common, "--max-total-tokens", str(4 * pool), "--disable-radix-cache")
    else:
        options = {"cpu_cache": pool} if config == "two-tiers" else {}
        # The prefix-aware CPU attention: cached tokens are not computed again, as on a GPU backend.
        args = (*CPU_ARGS, *common, "--attention-backend", "torch_native_prefix", "--max-total-tokens", str(pool),
                "--chunked-prefill-size", str(chunk), "--radix-cache-backend", "penelope",
                "--radix-eviction-policy-config", json.dumps(options))
    return ServerSpec(model=str(model), log=log, args=args, startup_timeout=600,
                      env={**CPU_ENV, **STRICT, "PYTHONPATH": path})


def get_json(url: str, timeout: float = 120) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def penelope_counters(url: str) -> dict:
    return (get_json(url + "/server_info").get("internal_states") or [{}])[0].get("penelope") or {}


def after_load(url: str) -> dict:
    """Once the load has ended: the server still generates, its cache flushes, and afterwards
    Penelope holds nothing (no cached tokens, no host rows in use). `counters`: Penelope's counters
    before the flush (which resets the cache's own)."""
    with urllib.request.urlopen(url + "/health_generate", timeout=300) as response:
        generates = response.status == 200
    counters = penelope_counters(url)
    request = urllib.request.Request(url + "/flush_cache?timeout=120", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        flushed = response.status == 200 and b"Cache flushed" in response.read()
    after = penelope_counters(url)
    held = {k: after.get(k) for k in ("cached_tokens", "tier_host_cached_tokens") if after.get(k)}
    return {"generates": generates, "flushed": flushed, "held_after_flush": held, "plugin_active": bool(after),
            "counters": counters}


def run_config(model: Path, out: Path, config: str, args, runs: list[dict]) -> None:
    """Soak one configuration's server; its run (a dict) is appended to `runs` as it starts."""
    log = out / f"server-{config}.log"
    settings = SoakConfig(vocab=VOCAB, max_context=MAX_CONTEXT, context_length=CONTEXT, sessions=args.sessions,
                          duration=args.minutes * 60, max_requests=args.max_requests, seed=args.seed)
    started = time.monotonic()

    def progress(report) -> None:
        done = len(report.completed)
        if done % 50 == 0:
            print(f"  {config}: {done} completed, {report.counts['sent']} sent, "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    run = {"config": config, "report": SoakReport(), "end": NO_END, "alive": False, "faults": [], "log": str(log)}
    runs.append(run)
    with SGLangServer(server_spec(model, log, config, args.pool, args.chunk)) as server:
        print(f"{config}: server up at {server.url} after {time.monotonic() - started:.0f} s", file=sys.stderr)
        try:
            # Ctrl-C or SIGTERM cancels the soak; `run` keeps what it did so far.
            run_until_signal(soak(server.url, settings, progress, run["report"]))
        except BaseException:
            run["interrupted"] = True
            run["faults"] = server_faults(log)
            raise
        try:
            run["end"] = after_load(server.url)
        except OSError as error:
            run["end"] = {**NO_END, "error": str(error)}
        run["alive"] = server.process is not None and server.process.poll() is None
        # Read before the server is stopped: its scheduler's exit on SIGTERM is logged as a crash.
        run["faults"] = server_faults(log)


def verdict(run: dict) -> list[str]:
    """What went wrong in one configuration's run (empty: every check held)."""
    report, end, problems = run["report"], run["end"], []
    counts = report.counts
    if not run["alive"] or not end["generates"]:
        problems.append("server not serving at the end")
    if run["faults"]:
        problems.append(f"{len(run['faults'])} scheduler fault lines in the log, the first: {run['faults'][0]}")
    if report.unexpected:
        problems.append(f"{len(report.unexpected)} unexpected answers")
    if not end["flushed"] or end["held_after_flush"] or not end["plugin_active"]:
        problems.append(f"cache not empty after flush: {end['held_after_flush']}")
    if run.get("mismatches"):
        problems.append(f"{len(run['mismatches'])} replies differ from the reference")
    if counts["completed"] == 0:
        problems.append("no request completed")
    wrong = reply_problems(report.completed)
    if wrong:
        problems.append(f"{len(wrong)} replies with a wrong prompt or cached-token count, e.g. {wrong[0]}")
    return problems


def not_exercised(run: dict) -> list[str]:
    """The faults and refill paths a run did not reach (too short, or too little pressure)."""
    counts, counters = run["report"].counts, run["end"]["counters"]
    reached = {"disconnects": counts["disconnected"], "aborts": counts["aborted"],
               "quiet flushes": counts["flushes_done"],
               "oversize prompts": counts["oversize_refused"], "malformed requests": counts["malformed_refused"],
               "evictions": counters.get("evicted_tokens", 0) + counters.get("tier_demoted_tokens", 0),
               "hole refills": counters.get("phantom_tokens", 0) + counters.get("chunk_refill_tokens", 0)}
    return [name for name, count in reached.items() if not count]


def table(runs: list[dict]) -> str:
    rows = []
    for run in runs:
        c, counters = run["report"].counts, run["end"]["counters"]
        rows.append([run["config"], c["sent"], c["completed"] + c["completed_before_abort"], c["disconnected"],
                     f"{c['aborted']}/{c['abort_requests']}", f"{c['flushes_done']}/{c['flushes']}",
                     f"{c['oversize_refused']}/{c['oversize_sent']}", f"{c['malformed_refused']}/{c['malformed_sent']}",
                     counters.get("evicted_tokens", 0), counters.get("phantoms", 0),
                     counters.get("chunk_refill_tokens", 0), len(run["report"].unexpected), len(run["faults"]),
                     "-" if run.get("mismatches") is None else len(run["mismatches"]),
                     "interrupted" if run.get("interrupted") else "ok" if not verdict(run) else "FAIL"])
    head = ["config", "sent", "completed", "disconnects", "aborts", "flushes", "oversize 4xx", "malformed 4xx",
            "evicted", "phantoms", "hole chunks", "unexpected", "faults", "differ", "result"]
    return format_table(head, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--pool", type=int, default=16384, help="device pool tokens (and CPU tier tokens)")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for logs and soak.json")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.sessions < 1 or args.max_requests < 1:
        parser.error("--minutes, --sessions and --max-requests must be positive")
    if args.pool < MAX_CONTEXT + PAGE or args.chunk < PAGE or args.chunk % PAGE:
        parser.error(f"--pool must be at least {MAX_CONTEXT + PAGE} tokens, --chunk a multiple of the page ({PAGE})")
    out = args.out or Path(tempfile.mkdtemp(prefix="penelope-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    stopped = None
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        model = tiny_model(out / "tiny-qwen3")
        word_level_tokenizer(model, VOCAB)
        for config in args.configs:
            run_config(model, out, config, args, runs)
        with SGLangServer(server_spec(model, out / "server-reference.log", "reference", args.pool,
                                      args.chunk)) as ref:
            for run in runs:
                run["mismatches"] = run_until_signal(check_replies(ref.url, run["report"].completed))
    except (KeyboardInterrupt, Stopped) as signalled:
        stopped = signal.SIGTERM if isinstance(signalled, Stopped) else signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)
    return conclude(runs, out, args, stopped)


class Stopped(Exception):
    """SIGTERM: the runs end as on Ctrl-C (servers stopped, what finished kept)."""


def _stop(signum, frame) -> None:
    raise Stopped()


def conclude(runs: list[dict], out: Path, args, stopped) -> int:
    """Print the table and what failed, write soak.json; the exit status."""
    if runs:
        print(table(runs))
    failed = False
    for run in runs:
        for problem in verdict(run) if not stopped else ():
            failed = True
            print(f"{run['config']}: {problem}")
        missed = not_exercised(run)
        if missed:
            print(f"{run['config']}: not exercised (a longer run or a smaller pool reaches them): {', '.join(missed)}")
    summary = [{"config": r["config"], **r["report"].as_dict(), "end": r["end"], "alive": r["alive"],
                "faults": r["faults"], "mismatches": r.get("mismatches"), "problems": verdict(r),
                "not_exercised": not_exercised(r)} for r in runs]
    (out / "soak.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "interrupted": stopped.name if stopped else None, "runs": summary},
                                              indent=1))
    if stopped:
        print(f"interrupted by {stopped.name}: {len(runs)} configuration(s) started, replies not checked "
              f"against the reference where the table shows none")
        print(f"logs and soak.json in {out}")
        return 128 + stopped
    print(f"logs and soak.json in {out}")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
