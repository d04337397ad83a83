"""Load generator for a running server: agent traces replayed against SGLang's `/generate` or an
OpenAI-compatible `/v1/completions`, streamed and timed (`penelope load`).

- `tokens.py`: workload requests -> token ids, deterministic per session, the server's replies
  in the history;
- `apis.py`: the API names and paths; `client.py`: one streamed request, timed (TTFT, ITL, E2E)
  and read (reply ids, cached tokens);
- `target.py`: what the server is asked before and between runs (context, vocabulary, settings,
  cache flush, session close);
- `runner.py`: closed-loop and open-loop replay within bounds (`replay`, `run_load`);
- `records.py`: per-request records and their JSONL file; `summary.py`: per-run figures and their
  intervals over repeats; `report.py`: tables and plots;
- `server.py`: starting and stopping an SGLang server (`SGLangServer`);
- `soak.py`: a soak with faults (disconnects, aborts, flushes, bad requests) and the check of its
  replies against a reference server.

A library user probes a server, then replays:

    target = probe_server("http://127.0.0.1:30000", "generate")
    check_fits(workload, space := TokenSpace(target.vocab, scale=8), target)
    results = run_load(target, workload, space, LoadConfig(sessions=4), repeats=3)
    summaries = [summarize(r) for r in results]

Errors are `UsageError`s that name the fields and parameters the library takes in backquotes
(`url`, `max_requests`); the commands show them as their flags (`penelope.commands.fields`).
"""
