"""One streamed request against a stand-in server (`tests/loadgen_stub.py`, SGLang 0.5.23's
streaming formats): what is read from each API, and every way a request can fail, as a status."""
import asyncio

import pytest
from loadgen_stub import StubServer

from penelope.errors import UsageError
from penelope.loadgen.apis import GENERATE, OPENAI
from penelope.loadgen.client import Sampling, request_body, stream_request
from penelope.loadgen.records import RequestRecord
from penelope.loadgen.target import base_url, client_session, probe, probe_server

PROMPT = list(range(40, 60))


def record(rid="r1"):
    return RequestRecord(repeat=0, session="s", session_index=0, turn=0, turns=1, kind="tool", rid=rid, source="t",
                         sent_at=0.0, scheduled_at=None, think_time=0.0, prompt_tokens=len(PROMPT), max_new_tokens=6)


def send(stub, api, rid="r1", max_new=6, read_timeout=30.0, **probe_options):
    async def go():
        async with client_session(read_timeout) as http:
            target = await probe(http, stub.url, api, vocab=1000, **probe_options)
            body = request_body(api, ",".join(map(str, PROMPT)), max_new, Sampling(), rid=rid, session_id="s",
                                model=target.model)
            out = record(rid)
            await stream_request(http, target.endpoint, api, body, out, target.cumulative)
            return out

    return asyncio.run(go())


@pytest.mark.parametrize("api", [GENERATE, OPENAI])
@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("incremental", [False, True])
def test_a_streamed_reply_is_read_whole(api, chunk, incremental):
    with StubServer(chunk_tokens=chunk, incremental=incremental) as stub:
        stub.served.append(PROMPT[:12])
        out = send(stub, api)
        sent = stub.requests[-1]
    assert out.status == "ok", out.error
    assert out.output_ids == stub.reply(PROMPT, 6) and out.output_tokens == 6 and out.reply_ids == "server"
    assert out.cached_tokens == 12 and out.server_prompt_tokens == len(PROMPT)
    assert out.finish_reason == "length"
    assert 0 < out.ttft <= out.e2e and out.itl is not None and out.itl >= 0
    # Asked as the API wants it: ids, streaming, greedy, exactly the length asked for, the session id.
    if api == GENERATE:
        assert sent["input_ids"] == PROMPT and sent["sampling_params"]["max_new_tokens"] == 6
        assert sent["sampling_params"]["temperature"] == 0 and sent["sampling_params"]["ignore_eos"] is True
    else:
        assert sent["prompt"] == PROMPT and sent["max_tokens"] == 6 and sent["ignore_eos"] is True
        assert sent["return_token_ids"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["stream"] is True and sent["session_id"] == "s" and sent["rid"] == "r1"


def test_openai_without_a_cache_report_or_ids():
    """No --enable-cache-report: cached tokens unknown (None), not 0; no ids: the reply's length
    is kept and the record says the ids did not come from the server."""
    with StubServer(cache_report=False, token_ids=False) as stub:
        out = send(stub, OPENAI)
    assert out.status == "ok" and out.cached_tokens is None
    assert out.output_tokens == 6 and out.output_ids == [] and out.reply_ids == "none"


@pytest.mark.parametrize("api", [GENERATE, OPENAI])
@pytest.mark.parametrize(("mode", "status", "text"), [
    ("http500", "http_error", "HTTP 500: stub failure"),
    ("http400", "http_error", "HTTP 400: bad request"),
    ("error_chunk", "server_error", "stub error mid-stream"),
    ("break", "broken_stream", ""),
    ("abort", "aborted", ""),
])
def test_a_failed_request_is_a_status_not_an_exception(api, mode, status, text):
    with StubServer() as stub:
        stub.modes["bad"] = mode
        out = send(stub, api, rid="bad")
    assert out.status == status and out.failed
    assert text in out.error
    if mode in ("error_chunk", "break"):
        # The tokens before the failure were timed.
        assert out.ttft is not None and out.output_tokens == 1


def test_a_silent_server_times_out():
    with StubServer() as stub:
        stub.modes["slow"] = "slow"
        stub.slow_delay = 2.0
        out = send(stub, GENERATE, rid="slow", read_timeout=0.3)
    assert out.status == "timeout"


def test_a_server_that_is_not_sglang_is_one_line():
    """An HTTP server answering 404 to every path (another service on the port) is named as such,
    not asked for a vocabulary."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for api, vocab in ((GENERATE, None), (GENERATE, 10), (OPENAI, 10)):
            with pytest.raises(UsageError, match="answers none of /server_info, /model_info.*not an SGLang server"):
                probe_server(url, api, vocab=vocab)
    finally:
        server.shutdown()
        server.server_close()


def test_an_unreachable_server_or_a_wrong_api_is_one_line():
    with StubServer(apis=(OPENAI,)) as stub:
        url = stub.url
        with pytest.raises(UsageError, match="/generate: a one-token request failed: HTTP 404.*another `api`"):
            probe_server(stub.url, GENERATE, vocab=10)
        with pytest.raises(UsageError, match="does not say its vocabulary size .*; give `vocab` N"):
            probe_server(stub.url, OPENAI)
        with pytest.raises(UsageError, match="`api` grpc: choose from generate, openai"):
            probe_server(stub.url, "grpc", vocab=10)
    with pytest.raises(UsageError, match=f"cannot reach the server at {url}"):
        probe_server(url, GENERATE, vocab=10)
    with pytest.raises(UsageError, match="`url` localhost:30000: expected http://HOST:PORT"):
        probe_server("localhost:30000", GENERATE, vocab=10)


@pytest.mark.parametrize("url, message", [
    ("ftp://127.0.0.1:30000", "`url` ftp://127.0.0.1:30000: expected http://HOST:PORT"),
    ("http://127.0.0.1:99999", "`url` http://127.0.0.1:99999: the port is not a number in [0, 65535]"),
    ("http://127.0.0.1:30000/generate", "`url` http://127.0.0.1:30000/generate: give the server's address without a "
     "path"),
    # Malformed bracketed hosts: urllib raises ValueError on these.
    ("http://[::1", "`url` http://[::1: expected http://HOST:PORT"),
    ("http://]:9", "`url` http://]:9: expected http://HOST:PORT"),
    ("http://[zz]:9", "`url` http://[zz]:9: expected http://HOST:PORT"),
])
def test_a_bad_address_names_the_url_field(url, message):
    """The library names its parameter (`url`); `penelope load` and `calibrate` show it as --url."""
    with pytest.raises(UsageError) as err:
        base_url(url)
    assert str(err.value).startswith(message)
    assert base_url("http://127.0.0.1:30000/") == "http://127.0.0.1:30000"


def test_the_probe_reads_the_servers_limits_and_settings(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 321}')
    with StubServer(max_input=5000, session_cache=True, incremental=True, model_path=str(tmp_path)) as stub:
        target = probe_server(stub.url, GENERATE)
        given = probe_server(stub.url, OPENAI, vocab=50, context=4096)
    assert target.vocab == 321 and target.max_prompt == 4999 and target.max_total == 5005
    assert target.session_cache and not target.cumulative and target.ids_from_server
    assert (given.vocab, given.max_prompt, given.max_total, given.model) == (50, 4095, 4096, "stub")
