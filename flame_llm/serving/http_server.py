"""Our engine standalone behind an OpenAI-style HTTP API, one process per GPU (the bench's `engine`
system and the reference the service is measured against).

POST /v1/completions takes token-id prompts (a list of ids, or a list of such lists) or text when the
model dir has a tokenizer, and answers with each choice's `token_ids`, `usage.prompt_tokens_details.
cached_tokens` and a `flame` block (device, prompt digests, engine timings). GET /health (with the
engine's limits) and /v1/models. Requests are checked against the engine's limits on entry (the protocol's
checks); bad input answers 400 with an OpenAI-style error whose `param` names the field. Started by
`flame-llm serve-http --model DIR --port N [--gpu-uuid GPU-...]` or `python -m flame_llm.serving.http_server`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid

import numpy as np
from aiohttp import web

from flame_llm.protocol.types import EngineLimits, ErrorCode, RequestError, prompt_digest, sampling_from_map
from flame_llm.sampling_params import SamplingParams

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 << 20
ENGINE = web.AppKey("engine", object)
INFO = web.AppKey("info", dict)
LIMITS = web.AppKey("limits", EngineLimits)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def parse_request(body: object, limits: EngineLimits, tokenize=None) -> tuple[list[np.ndarray], SamplingParams]:
    """(prompts as token-id arrays, sampling) from a completions body, checked against the engine's limits;
    RequestError names the offending field. `tokenize(text) -> ids` serves text prompts."""
    if not isinstance(body, dict):
        raise RequestError(ErrorCode.BAD_REQUEST, f"the request body must be a JSON object; got "
                                                  f"{type(body).__name__}", "body")
    prompt = body.get("prompt")
    one = prompt if isinstance(prompt, str) else _token_array(prompt)
    if one is not None:
        prompts = [one]
    elif isinstance(prompt, list) and prompt:
        prompts = [p if isinstance(p, str) else _token_array(p) for p in prompt]
    else:
        prompts = [None]
    if any(p is None for p in prompts):
        raise RequestError(ErrorCode.BAD_PROMPT, "field 'prompt' must be a non-empty list of token ids (integers "
                           f">= 0), a list of such lists, or text; got {json.dumps(prompt)[:80]}", "prompt")
    for name, want in (("n", 1), ("best_of", 1), ("stream", False), ("echo", False)):
        if body.get(name) not in (None, want):
            raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be {json.dumps(want)} (not supported "
                                                      f"otherwise); got {json.dumps(body[name])[:40]}", name)
    sp = {"max_tokens": body.get("max_tokens", 16)}
    sp.update({k: body[k] for k in ("temperature", "top_p", "top_k", "ignore_eos", "seed", "stop_token_ids")
               if body.get(k) is not None})
    sampling = sampling_from_map(sp)
    ids = [_tokenized(p, tokenize) if isinstance(p, str) else p for p in prompts]
    for p in ids:
        limits.check_prompt(p)
    return ids, sampling


def _tokenized(text: str, tokenize) -> np.ndarray:
    try:
        if tokenize is None:
            raise ValueError("this server takes token-id prompts only")
        return np.asarray(tokenize(text), dtype=np.int64)
    except ValueError as e:
        raise RequestError(ErrorCode.BAD_PROMPT, f"field 'prompt': {e}", "prompt") from None


def _token_array(p: object) -> np.ndarray | None:
    """p as an int64 array when it is a non-empty list of ints >= 0 (bools are not ints here), else None.
    C-level passes only: an 8K-token prompt costs ~0.4 ms of the event loop's GIL, not ~1.5 ms."""
    if not isinstance(p, list) or not p or set(map(type, p)) != {int} or min(p) < 0:
        return None
    return np.fromiter(p, dtype=np.int64, count=len(p))


async def completions(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    t0 = time.perf_counter()
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(400, f"the request body is not valid JSON: {e}", "body")
    try:
        prompts, sp = parse_request(body, request.app[LIMITS], engine.engine.to_token_ids)
        if len(prompts) > 1:  # the engine's own checks (KV pool) for all before admitting any
            for p in prompts:
                engine.engine.check_request(p, sp)
    except RequestError as e:
        return _error(400, str(e), e.field)
    except ValueError as e:  # the engine's own checks: the request needs more KV blocks than the pool has
        return _error(400, f"field 'prompt': {e}", "prompt")
    rid = f"cmpl-{uuid.uuid4().hex[:16]}"
    try:
        outs = await asyncio.gather(*(engine.generate(p, sp, request_id=f"{rid}-{k}") for k, p in enumerate(prompts)))
    except ValueError as e:  # raised by the submission checks, before the request reached the engine
        if engine._error is not None:
            return _error(500, f"engine loop failed: {engine._error!r}", None, "server_error")
        return _error(400, f"field 'prompt': {e}", "prompt")
    except Exception as e:
        log.exception("request %s failed", rid)
        return _error(500, f"{type(e).__name__}: {e}", None, "server_error")
    return web.json_response(_response(rid, request.app[INFO], prompts, outs, time.perf_counter() - t0))


def _response(rid: str, info: dict, prompts: list[np.ndarray], outs: list, server_s: float) -> dict:
    choices = [{"index": k, "text": o.text or "", "token_ids": o.output_token_ids, "logprobs": None,
                "finish_reason": o.finish_reason} for k, o in enumerate(outs)]
    n_prompt = sum(o.num_prompt_tokens for o in outs)
    n_out = sum(len(o.output_token_ids) for o in outs)
    metrics = outs[0].metrics if len(outs) == 1 else {}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": info["model_name"],
            "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                      "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}},
            "flame": {"device": info["device"], "node": info["node"],
                      "prompt_digests": [prompt_digest(p) for p in prompts], "server_s": server_s,
                      "ttft": metrics.get("ttft"), "tpot": metrics.get("tpot")}}


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine._error is not None:
        return _error(503, f"engine loop failed: {engine._error!r}", None, "server_error")
    return web.json_response({"status": "ok", **request.app[INFO]})


async def models(request: web.Request) -> web.Response:
    info = request.app[INFO]
    return web.json_response({"object": "list", "data": [{"id": info["model_name"], "object": "model",
                                                         "owned_by": "flame-llm", "max_model_len":
                                                         info["max_model_len"]}]})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].stats())


def build_app(engine, gpu_uuid: str | None = None, device_name: str = "cpu",
              model_name: str | None = None) -> web.Application:
    """The aiohttp app around a running AsyncEngine (the caller owns the engine's life). Its device is the
    GPU UUID it is pinned to, else device_name."""
    mc = engine.config.model_config
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[LIMITS] = EngineLimits.of(mc.hf_config.vocab_size, mc.max_model_len)
    app[INFO] = {"model": mc.model, "model_name": model_name or os.path.basename(os.path.normpath(mc.model)),
                 "model_revision": mc.model_revision, "device": gpu_uuid or device_name,
                 "node": os.uname().nodename, "pid": os.getpid(), **app[LIMITS].to_dict()}
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    return app


# (flags, add_argument kwargs): the `flame-llm serve-http` options
ARGUMENTS = [
    (("--model",), {"required": True, "help": "model directory, or 'tiny' for the embedded default"}),
    (("--host",), {"default": "127.0.0.1"}),
    (("--port",), {"type": int, "default": 8000}),
    (("--gpu-uuid",), {"default": None, "help": "pin to this GPU (CUDA_VISIBLE_DEVICES=UUID, verified)"}),
    (("--device-name",), {"default": "cpu", "help": "what responses report as device without a GPU"}),
    (("--served-model-name",), {"default": None}),
    (("--load-format",), {"default": "auto", "choices": ("auto", "dummy")}),
    (("--engine-json",), {"default": "{}", "help": "extra flame_llm.config.Config fields as a JSON object"}),
    (("--torch-threads",), {"type": int, "default": 0, "help": "CPU intra-op threads (0: torch's default)"}),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags, kwargs in ARGUMENTS:
        p.add_argument(*flags, **kwargs)


def serve(args: argparse.Namespace) -> int:
    """Load the engine (pinned and verified when --gpu-uuid is given) and serve until SIGINT/SIGTERM."""
    from actors.host import EngineHost
    from flame_llm.config import engine_fields_from_json

    kwargs = engine_fields_from_json(args.engine_json)
    host = EngineHost.start(args.model, {"load_format": args.load_format, **kwargs}, args.gpu_uuid,
                            args.device_name, args.torch_threads)
    app = build_app(host.engine, args.gpu_uuid, args.device_name, args.served_model_name)

    async def _close(_app: web.Application) -> None:
        await asyncio.to_thread(host.stop)

    app.on_cleanup.append(_close)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None, handle_signals=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flame-llm serve-http", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
