"""A stand-in HTTP server for load-generator tests: SGLang's `/generate` and the OpenAI
`/v1/completions` streaming formats (as SGLang 0.5.23 writes them), answering at once or slowly,
failing on request.

Replies are deterministic: reply id i of a prompt is `(sum of the prompt's last 3 ids + 7 i) %
vocab`. Cached tokens are the longest prefix the prompt shares with a prompt + reply served before
(`track_cache`), as a radix cache that never evicts would report. Every request's JSON is kept in
`requests`; `apis` names the APIs served (the others answer 404).

Failure modes, per request id (`modes[rid]`) or for all (`mode`): `ok`, `http500`, `http400`,
`error_chunk` (an error chunk after the first token), `break` (the connection closed after the
first token), `abort` (finish reason abort), `slow` (`slow_delay` seconds before every chunk).

In a thread of the test process: `with StubServer() as stub: stub.url`. As a process (for the
benchmark): `python tests/loadgen_stub.py --port-file F [--no-cache]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from pathlib import Path

from aiohttp import web


class StubServer:
    def __init__(self, vocab: int = 1000, max_input: int = 100_000, chunk_tokens: int = 1,
                 session_cache: bool = False, cache_report: bool = True, incremental: bool = False,
                 track_cache: bool = True, model_path: str | None = None, token_ids: bool = True,
                 apis: tuple[str, ...] = ("generate", "openai")):
        self.vocab = vocab
        self.max_input = max_input
        self.chunk_tokens = chunk_tokens
        self.session_cache = session_cache
        self.cache_report = cache_report
        self.incremental = incremental
        self.track_cache = track_cache
        self.model_path = model_path
        self.token_ids = token_ids
        self.apis = apis
        self.mode = "ok"
        self.modes: dict[str, str] = {}
        self.slow_delay = 0.05
        self.requests: list[dict] = []
        self.closed: list[str] = []
        self.flushes = 0
        self.served: list[list[int]] = []
        self.port = None
        self._loop = None
        self._thread = None
        self._runner = None

    # --- the application -------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/flush_cache", self.flush)
        app.router.add_post("/close_session", self.close_session)
        if "generate" in self.apis:
            app.router.add_post("/generate", self.generate)
        if "openai" in self.apis:
            app.router.add_post("/v1/completions", self.completions)
        return app

    async def server_info(self, request):
        return web.json_response({"max_req_input_len": self.max_input, "model_path": self.model_path,
                                  "enable_session_radix_cache": self.session_cache,
                                  "enable_cache_report": self.cache_report,
                                  "incremental_streaming_output": self.incremental, "version": "stub"})

    async def model_info(self, request):
        return web.json_response({"model_path": self.model_path, "served_model_name": "stub"})

    async def models(self, request):
        return web.json_response({"data": [{"id": "stub"}]})

    async def health(self, request):
        return web.Response(text="")

    async def flush(self, request):
        self.flushes += 1
        self.served.clear()
        return web.Response(text="Cache flushed.\n")

    async def close_session(self, request):
        self.closed.append((await request.json())["session_id"])
        return web.Response(text="")

    def reply(self, prompt: list[int], n: int) -> list[int]:
        base = sum(prompt[-3:])
        return [(base + 7 * i) % self.vocab for i in range(n)]

    def cached(self, prompt: list[int]) -> int:
        best = 0
        for seen in self.served:
            n = min(len(seen), len(prompt))
            i = 0
            while i < n and seen[i] == prompt[i]:
                i += 1
            best = max(best, i)
        return best

    async def _prepare(self, request, key: str, max_key: str):
        body = json.loads(await request.read())
        self.requests.append(body)
        mode = self.modes.get(body.get("rid"), self.mode)
        prompt = body[key]
        if mode == "http500":
            return body, mode, prompt, 0, web.json_response({"object": "error", "message": "stub failure"},
                                                             status=500)
        if mode == "http400" or max(prompt, default=0) >= self.vocab or len(prompt) >= self.max_input:
            return body, mode, prompt, 0, web.json_response({"error": {"message": "bad request"}}, status=400)
        params = body.get("sampling_params", body)
        return body, mode, prompt, int(params[max_key]), None

    async def _stream(self, request, mode, prompt, max_new, chunk, usage=None):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        reply = self.reply(prompt, max_new)
        cached = self.cached(prompt) if self.track_cache else 0
        if self.track_cache:
            self.served.append(prompt + reply)
        sent = 0
        while sent < max_new:
            if mode == "slow":
                await asyncio.sleep(self.slow_delay)
            new = reply[sent: sent + self.chunk_tokens]
            sent += len(new)
            if sent > len(new) and mode == "error_chunk":
                await response.write(b'data: {"error": {"message": "stub error mid-stream"}}\n\n')
                break
            if sent > len(new) and mode == "break":
                request.transport.close()
                return response
            await response.write(b"data: " + json.dumps(chunk(reply, new, sent, cached, mode)).encode() + b"\n\n")
        else:
            if usage is not None:
                await response.write(b"data: " + json.dumps(usage(sent, cached)).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def generate(self, request):
        body, mode, prompt, max_new, failed = await self._prepare(request, "input_ids", "max_new_tokens")
        if failed is not None:
            return failed

        def chunk(reply, new, sent, cached, mode):
            finish = None
            if sent == len(reply):
                finish = {"type": "abort", "message": "stub abort"} if mode == "abort" else \
                    {"type": "length", "length": sent}
            ids = new if self.incremental else reply[:sent]
            return {"output_ids": ids, "meta_info": {"id": body.get("rid"), "finish_reason": finish,
                                                     "prompt_tokens": len(prompt), "completion_tokens": sent,
                                                     "cached_tokens": cached}}

        return await self._stream(request, mode, prompt, max_new, chunk)

    async def completions(self, request):
        body, mode, prompt, max_new, failed = await self._prepare(request, "prompt", "max_tokens")
        if failed is not None:
            return failed
        wants_ids = self.token_ids and body.get("return_token_ids")

        def chunk(reply, new, sent, cached, mode):
            finish = ("abort" if mode == "abort" else "length") if sent == len(reply) else None
            choice = {"index": 0, "text": "x" * len(new), "finish_reason": finish}
            if wants_ids:
                choice["token_ids"] = new
            return {"id": body.get("rid"), "object": "text_completion", "choices": [choice]}

        def usage(sent, cached):
            numbers = {"prompt_tokens": len(prompt), "completion_tokens": sent, "total_tokens": len(prompt) + sent}
            if self.cache_report:
                numbers["prompt_tokens_details"] = {"cached_tokens": cached}
            return {"id": body.get("rid"), "object": "text_completion", "choices": [], "usage": numbers}

        wants_usage = (body.get("stream_options") or {}).get("include_usage")
        return await self._stream(request, mode, prompt, max_new, chunk, usage if wants_usage else None)

    # --- running it ----------------------------------------------------------------------------
    async def _serve(self, port: int = 0):
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StubServer:
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def main():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._serve())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port-file", required=True, help="write the port here once listening")
    parser.add_argument("--no-cache", action="store_true", help="report 0 cached tokens (answer at once)")
    parser.add_argument("--vocab", type=int, default=1000)
    args = parser.parse_args()
    stub = StubServer(vocab=args.vocab, track_cache=not args.no_cache)

    async def serve():
        await stub._serve()
        Path(args.port_file).write_text(str(stub.port))
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
