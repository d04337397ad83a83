"""`penelope load` against SGLang 0.5.23's real HTTP server on CPU (`python -m sglang.launch_server`,
the tiny Qwen3 with real random weights, `--radix-cache-backend penelope`), started and stopped by
`penelope.loadgen.server.SGLangServer`: 2 synthetic sessions x 3 turns at scale 16, through
`/generate` and then (the cache flushed) through `/v1/completions`.

Every request finishes with the reply length asked for; the server counts the prompt sent; and
from the second turn on it reports as cached exactly the previous turn's prompt and reply, cut to
whole pages (16 tokens) and less the reply's last token (whose KV is never computed): the reply
ids the client put into the next prompt are the server's own. Both APIs get the same greedy
replies, so they send the same prompts. The pool holds the whole workload, so nothing is evicted
and a longer or shorter match would be a bug in the client or the server.
"""
import dataclasses
from pathlib import Path

from penelope.integration.sglang.verify import tiny_model
from penelope.loadgen.models import word_level_tokenizer
from penelope.loadgen.runner import LoadConfig, check_fits, run_load
from penelope.loadgen.server import CPU_ARGS, CPU_ENV, ServerSpec, SGLangServer
from penelope.loadgen.summary import summarize
from penelope.loadgen.target import probe_server
from penelope.loadgen.tokens import TokenSpace
from penelope.sim.workloads.load import load_workload
from penelope.sim.workloads.types import ThinkTime

STUB = Path(__file__).parent.parent / "engine_stub"
PAGE = 16


def server_spec(model: Path, log: Path) -> ServerSpec:
    return ServerSpec(model=str(model), log=log, startup_timeout=300,
                      args=(*CPU_ARGS, "--page-size", str(PAGE), "--max-total-tokens", "8192", "--chunked-prefill-size",
                            "1024", "--enable-cache-report", "--radix-cache-backend", "penelope"),
                      env={**CPU_ENV, "PYTHONPATH": str(STUB)})


def check_records(records) -> None:
    for r in records:
        assert r.ok, r.error
        assert r.output_tokens == r.max_new_tokens == len(r.output_ids) and r.reply_ids == "server"
        assert r.server_prompt_tokens == r.prompt_tokens and 0 < r.ttft <= r.e2e
    for before, after in zip(records, records[1:], strict=False):
        if before.session != after.session:
            continue
        reused = before.prompt_tokens + before.output_tokens - 1
        assert after.cached_tokens == reused // PAGE * PAGE, (before, after)


def test_two_sessions_of_three_turns_on_the_real_server(tmp_path):
    model = tiny_model(tmp_path / "tiny-qwen3")
    word_level_tokenizer(model, 1000)
    workload = ThinkTime(cap=0.0).apply(load_workload("synthetic"))
    workload = dataclasses.replace(workload, sessions=tuple(
        dataclasses.replace(s, requests=s.requests[:3]) for s in workload.sessions[:2]))
    runs = {}
    with SGLangServer(server_spec(model, tmp_path / "server.log")) as server:
        for api in ("generate", "openai"):
            target = probe_server(server.url, api)
            assert target.vocab == 1000 and target.info["radix_cache_backend"] == "penelope"
            assert target.cache_report and target.ids_from_server
            space = TokenSpace(vocab=target.vocab, scale=16)
            check_fits(workload, space, target)
            [runs[api]] = run_load(target, workload, space, LoadConfig(sessions=2))
    by_api = {api: sorted(result.records, key=lambda r: (r.session, r.turn)) for api, result in runs.items()}
    for records in by_api.values():
        assert [(r.session, r.turn) for r in records] == [(f"synthetic-00{s}#0", t) for s in (0, 1) for t in range(3)]
        check_records(records)
        assert summarize(runs["generate"]).finished == 6
    # Greedy replies: both APIs got the same replies, so they sent the same prompts.
    assert [r.output_ids for r in by_api["generate"]] == [r.output_ids for r in by_api["openai"]]
    assert [r.prompt_tokens for r in by_api["generate"]] == [r.prompt_tokens for r in by_api["openai"]]
    # The check can tell the server's reply ids from others: at least one turn's reply crosses
    # a page boundary past its prompt's last whole page.
    records = by_api["generate"]
    assert any((b.prompt_tokens + b.output_tokens - 1) // PAGE > b.prompt_tokens // PAGE
               for b, a in zip(records, records[1:], strict=False) if b.session == a.session)
