"""The HTTP server both front doors run (aiohttp): the OpenAI routes over a backend, server-sent events, vLLM's
/tokenize and /detokenize, errors as OpenAI error objects (404, 405, 413 and 500 too), an optional bearer token,
and the hardening a public port needs: a connection that has not sent a whole request head within
header_timeout_s is closed, a body must arrive within body_timeout_s (else 408), a Content-Length over
max_body_bytes is refused before the body is read (413), JSON nested too deep is a 400, a text prompt longer than
could fit in max_model_len is a 400 before it is tokenized, and text is tokenized off the event loop (one bounded
pool), so a large prompt holds up no other request. A client that disconnects cancels its handler, which aborts
its requests on the engines.

A backend is any object with: `limits` (EngineLimits), `tokenizer` (or None), `model_names` (served name
first), `async generate(prompts, sampling) -> [result dict]`, `stream(prompt, sampling)` (an async iterator of
StreamChunk), `async health() -> dict`, `async metrics() -> bytes` (Prometheus text). The service's front door
holds a Client (flame_llm/serving/frontdoor.py); serve-http an engine (flame_llm/serving/http_server.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web

from flame_llm.serving import openai_api as api
from flame_llm.serving import openai_tokenize
from flame_llm.serving.http_auth import Keys, caller_of, exposure_warning
from flame_llm.serving.http_stream import collect, stream_events
from flame_llm.serving.metrics import HttpMetrics
from flame_llm.validate import check_bool, check_int, check_number, check_str

log = logging.getLogger(__name__)
BACKEND = web.AppKey("backend", object)
CONFIG = web.AppKey("config", object)
OBSERVE = web.AppKey("observe", object)
HTTP_METRICS = web.AppKey("http_metrics", HttpMetrics)
KEYS = web.AppKey("keys", Keys)
LIMITS = web.AppKey("limits", api.RequestLimits)
TOKENIZE = web.AppKey("tokenize", ThreadPoolExecutor)
TOKENIZE_THREADS = 2  # text requests tokenized at once; more wait their turn (each is bounded by max_text_chars)
CALLER = web.RequestKey("flame_caller", object)  # the caller id of the API key a request carries (None: none)


@dataclass(slots=True)
class HttpConfig:
    """The HTTP front door (the service YAML's `http` section; serve-http takes the same limits)."""
    enabled: bool = True  # flame-llm serve opens the front door (--no-http: not)
    host: str = "127.0.0.1"  # the address it binds (0.0.0.0: every interface)
    port: int = 8000  # the front door's port (--http-port; 0: any free port)
    api_key: str | None = None  # when set, /v1/* and /metrics need "Authorization: Bearer <api_key>" (it shows in
    # `ps` when given as --api-key: prefer api_key_file or the FLAME_API_KEY environment variable)
    api_key_file: str | None = None  # a file of keys, one a line, each accepted (and each its own user for fairness)
    served_model_name: str | None = None  # the model name clients send (default: the model directory's name)
    max_prompts_per_request: int = 256  # prompts x n of one request; more is a 413
    max_tokens_per_request: int = 1 << 20  # prompt plus max output tokens over one request's completions (413)
    # a larger body (by its Content-Length, or as it arrives) is a 413, unread. 8 MiB: about a million prompt token
    # ids as JSON (ids of up to 6 digits and their separator, 7-8 bytes each: max_tokens_per_request's prompt side),
    # or a text of 8 M characters, past any context below 2 M tokens; 16 MiB let a 15 MB text in
    max_body_bytes: int = 8 << 20
    header_timeout_s: float = 10.0  # a connection idle or mid-head this long is closed
    body_timeout_s: float = 30.0  # a body that has not arrived whole by then is a 408
    # a streamed response: events waiting for a client that reads slower than they come, at most (past it the
    # client is dropped and its requests aborted: ~0.3 kB an event, ~1.2 MB a response at 4096), and how long one
    # write may wait for the client to read (a client that stops reading is dropped after it)
    stream_buffer_events: int = 4096
    stream_drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        w = "http field"
        check_bool("enabled", self.enabled, where=w)
        check_str("host", self.host, what="a host name or address", where=w)
        check_int("port", self.port, 0, 65535, limit="an integer in [0, 65535] (0: any free)", where=w)
        check_str("api_key", self.api_key, optional=True, where=w)
        check_str("api_key_file", self.api_key_file, optional=True, where=w)
        check_str("served_model_name", self.served_model_name, optional=True, empty=True, where=w)
        check_int("max_prompts_per_request", self.max_prompts_per_request, 1, where=w)
        check_int("max_tokens_per_request", self.max_tokens_per_request, 2, where=w)
        check_int("max_body_bytes", self.max_body_bytes, 1024, where=w)
        check_number("header_timeout_s", self.header_timeout_s, 0, low_open=True, where=w)
        check_number("body_timeout_s", self.body_timeout_s, 0, low_open=True, where=w)
        check_int("stream_buffer_events", self.stream_buffer_events, 1, where=w)
        check_number("stream_drain_timeout_s", self.stream_drain_timeout_s, 0, low_open=True, where=w)

    def request_limits(self, max_text_chars: int | None = None) -> api.RequestLimits:
        return api.RequestLimits(self.max_prompts_per_request, self.max_tokens_per_request, max_text_chars)


def _json_error(e: api.ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error as an OpenAI error object; the bearer token checked first when keys are configured (/health
    answers without one, with less: see `health`)."""
    cfg: HttpConfig = request.app[CONFIG]
    keys = request.app[KEYS]
    try:
        if keys:
            request[CALLER] = keys.match(request.headers.get("Authorization", ""))
            if request[CALLER] is None and request.path != "/health":
                raise api.ApiError(401, "missing or incorrect API key: send \"Authorization: Bearer <key>\"", None,
                                   "invalid_request_error", "invalid_api_key")
        return await handler(request)
    except api.ApiError as e:
        return _json_error(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        what = {404: f"no route {request.path}", 405: f"method {request.method} is not allowed on {request.path}",
                413: f"the body is larger than max_body_bytes ({cfg.max_body_bytes})"}.get(e.status, e.reason)
        return _json_error(api.ApiError(e.status, what, "body" if e.status == 413 else None))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        return _json_error(api.ApiError(500, f"{type(e).__name__}: {e}", None, "server_error"))


async def read_json(request: web.Request) -> object:
    """The body as JSON, within the body limits and timeout."""
    cfg: HttpConfig = request.app[CONFIG]
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        raise api.ApiError(413, f"the body is {request.content_length} bytes (Content-Length); max_body_bytes is "
                                f"{cfg.max_body_bytes}", "body")
    try:
        raw = await asyncio.wait_for(request.read(), cfg.body_timeout_s)
    except asyncio.TimeoutError:
        raise api.ApiError(408, f"the body did not arrive within body_timeout_s ({cfg.body_timeout_s:g}s)",
                           "body") from None
    except web.HTTPRequestEntityTooLarge:
        raise api.ApiError(413, f"the body is larger than max_body_bytes ({cfg.max_body_bytes})", "body") from None
    try:
        return json.loads(raw)
    except RecursionError:
        raise api.ApiError(400, "the request body is JSON nested too deeply", "body") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise api.ApiError(400, f"the request body is not valid JSON: {e}", "body") from None


async def _openai(request: web.Request, kind: str) -> web.StreamResponse:
    t0 = time.perf_counter()
    backend, cfg = request.app[BACKEND], request.app[CONFIG]
    body = await read_json(request)
    args = (kind, body, backend.limits, request.app[LIMITS], backend.tokenizer, backend.model_names)
    if api.has_text(kind, body):  # tokenizing: off the loop that serves every other request
        req = await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZE], api.parse, *args)
    else:
        req = api.parse(*args)
    # the users who take turns at the client's credit and in the shards' fair queue
    req.user = caller_of(request.get(CALLER), req.user, request.remote)
    observe = request.app[OBSERVE]
    if req.stream:
        return await stream_events(request, req, backend, t0, observe, cfg.stream_buffer_events,
                                   cfg.stream_drain_timeout_s)
    results, texts = await collect(req, backend, t0, observe)
    failed = [r for r in results if r["error"] is not None]
    if failed:
        raise api.result_error(failed[0])
    return web.json_response(api.response(req, backend.model_names[0], results, texts, time.perf_counter() - t0))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, "chat")


async def _off_loop(request: web.Request, fn, limit: int) -> web.Response:
    """One of openai_tokenize's routes, run in the tokenizer's executor (a long text never stalls the loop)."""
    backend = request.app[BACKEND]
    body = await read_json(request)
    out = await asyncio.get_running_loop().run_in_executor(
        request.app[TOKENIZE], fn, body, backend.tokenizer, backend.limits, limit, backend.model_names)
    return web.json_response(out)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize (vllm bench serve checks its tokenizer against the server's with it)."""
    return await _off_loop(request, openai_tokenize.tokenize, request.app[LIMITS].max_text_chars)


async def detokenize(request: web.Request) -> web.Response:
    return await _off_loop(request, openai_tokenize.detokenize, request.app[LIMITS].max_tokens)


async def models(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    return web.json_response({"object": "list", "data": [
        {"id": backend.model_names[0], "object": "model", "created": 0, "owned_by": "flame-llm",
         "max_model_len": backend.limits.max_model_len}]})


HEALTH_OPEN_FIELDS = ("status", "shards", "shards_up")  # what /health shows a keyed door's callers without a key


async def health(request: web.Request) -> web.Response:
    """The backend's health: a 503 when it cannot serve. On a door with keys, a request without one (a load
    balancer's probe) sees only the status and shard counts, not the model's path, limits or namespace."""
    info = await request.app[BACKEND].health()
    if info.get("status") != "ok":
        raise api.ApiError(503, info.get("message", "unhealthy"), None, "server_error")
    if request.app[KEYS] and request.get(CALLER) is None:
        info = {k: info[k] for k in HEALTH_OPEN_FIELDS if k in info}
    return web.json_response(info)


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    body = await request.app[BACKEND].metrics() + request.app[HTTP_METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(backend, cfg: HttpConfig, observe=None) -> web.Application:
    """The app over `backend`. observe(name, seconds): records ttft_s and e2e_s of each HTTP request."""
    http_metrics = HttpMetrics()  # outermost: it counts the status the error middleware answered with
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[http_metrics.middleware, errors])
    app[BACKEND], app[CONFIG], app[OBSERVE] = backend, cfg, observe or (lambda name, seconds: None)
    app[HTTP_METRICS] = http_metrics
    app[KEYS] = Keys(cfg.api_key, cfg.api_key_file)
    text_limit = None
    if backend.tokenizer is not None:
        from flame_llm.serving.openai_prompts import max_text_chars
        text_limit = max_text_chars(backend.limits.max_model_len, backend.tokenizer)
    app[LIMITS] = cfg.request_limits(text_limit)
    app[TOKENIZE] = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="flame-tokenize")

    async def _close_pool(app: web.Application) -> None:
        app[TOKENIZE].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_close_pool)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start(app: web.Application, cfg: HttpConfig, host: str | None = None,
                port: int | None = None) -> tuple[web.AppRunner, str]:
    """Serve `app` on the running loop; (runner, "http://host:port"). A client's disconnect cancels its handler;
    a connection idle or mid-head for header_timeout_s is closed (aiohttp's keep-alive timer, which runs from
    the connection's start and is not extended by a partial head)."""
    warning = exposure_warning(host or cfg.host, bool(app[KEYS]) if KEYS in app else bool(cfg.api_key
                                                                                          or cfg.api_key_file))
    if warning:
        log.warning(warning)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, keepalive_timeout=cfg.header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host or cfg.host, cfg.port if port is None else port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        where = f"{host or cfg.host}:{cfg.port if port is None else port}"
        raise RuntimeError(f"cannot listen on {where}: {e.strerror or e} (choose another port: --http-port, "
                           "http.port)") from None
    bound = runner.addresses[0]
    return runner, f"http://{bound[0]}:{bound[1]}"
