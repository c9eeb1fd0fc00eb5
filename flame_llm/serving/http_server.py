"""Our engine standalone behind the OpenAI HTTP API, one process per GPU (the bench's `engine` system and the
reference the service is measured against). The routes, limits, streaming and errors are the service front
door's (flame_llm/serving/http_app.py, openai_api.py); here the backend is the process's own AsyncEngine.

Responses carry each choice's `token_ids`, `usage.prompt_tokens_details.cached_tokens` and a `flame` block
(device, prompt digests, engine timings). Started by `flame-llm serve-http --model DIR --port N
[--gpu-uuid GPU-...]` or `python -m flame_llm.serving.http_server`."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import time
import uuid

from flame_llm.models.tokenizer import has_tokenizer
from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.types import EngineLimits, Result, prompt_digest
from flame_llm.serving.http_app import KEYS, HttpConfig, build_app
from flame_llm.serving.http_auth import exposure_warning, key_from_env
from flame_llm.serving.pending import StreamChunk

log = logging.getLogger(__name__)


class EngineBackend:
    """The http_app backend over one AsyncEngine or ProcessEngine (the caller owns the engine's life)."""

    def __init__(self, engine, device: str = "cpu", model_name: str | None = None) -> None:
        self.engine, self.device = engine, device
        mc = engine.config.model_config
        self.limits = EngineLimits.of(mc.hf_config.vocab_size, mc.max_model_len)
        # the `tokenizer` field's, else the model directory's (errors, a bad field or too many ids, propagate);
        # None: the model directory has none, token-id prompts only
        self.tokenizer = engine.tokenizer if mc.tokenizer or has_tokenizer(mc.model) else None
        self.model_names = (model_name or os.path.basename(os.path.normpath(mc.model)), mc.model)
        self.info = {"model": mc.model, "model_name": self.model_names[0], "model_revision": mc.model_revision,
                     "device": device, "node": os.uname().nodename, "pid": os.getpid(), **self.limits.to_dict()}
        self._ids = (f"http-{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self.counters = {"requests": 0, "errors": 0}

    def _result(self, rid: str, prompt, out=None, error: ErrorInfo | None = None, t0: float = 0.0) -> Result:
        if out is not None:
            return Result.from_output(out, prompt, {"total_s": time.perf_counter() - t0}, device=self.device,
                                      node=self.info["node"])
        return Result(rid, prompt_tokens=len(prompt), device=self.device, node=self.info["node"], error=error,
                      prompt_digest=prompt_digest(prompt))

    async def _one(self, prompt, sp) -> Result:
        rid, t0 = next(self._ids), time.perf_counter()
        self.counters["requests"] += 1
        try:
            out = await self.engine.generate(prompt, sp, request_id=rid, checked=True)  # generate() checked it
        except ValueError as e:  # the engine's own checks (the KV pool), or this request failed alone
            self.counters["errors"] += 1
            return self._result(rid, prompt, error=ErrorInfo(ErrorCode.INVALID_REQUEST, str(e)))
        except RuntimeError as e:  # the step loop failed
            self.counters["errors"] += 1
            return self._result(rid, prompt, error=ErrorInfo(ErrorCode.ENGINE_ERROR, str(e)))
        return self._result(rid, prompt, out, t0=t0)

    async def generate(self, prompts: list, sampling: list, user: str = "") -> list[Result]:
        """All prompts are checked against the engine's KV pool before any is admitted. `user` takes no turn here
        (one engine, no client credit queue)."""
        try:
            for p, sp in zip(prompts, sampling, strict=True):
                self.engine.check_request(p, sp)
        except ValueError as e:
            err = ErrorInfo(ErrorCode.INVALID_REQUEST, str(e))
            return [self._result("", p, error=err) for p in prompts]
        return list(await asyncio.gather(*(self._one(p, sp) for p, sp in zip(prompts, sampling, strict=True))))

    async def stream(self, prompt, sp, user: str = ""):
        rid, t0 = next(self._ids), time.perf_counter()
        self.counters["requests"] += 1
        agen = self.engine.stream_chunks(prompt, sp, rid)
        try:
            async for x in agen:
                if isinstance(x, list):
                    yield StreamChunk(x)
                else:
                    r = self._result(rid, prompt, x, t0=t0)
                    r.output_token_ids = []  # the chunks carried them
                    yield StreamChunk([], r)
        except (ValueError, RuntimeError) as e:
            self.counters["errors"] += 1
            code = ErrorCode.ENGINE_ERROR if isinstance(e, RuntimeError) else ErrorCode.INVALID_REQUEST
            yield StreamChunk([], self._result(rid, prompt, error=ErrorInfo(code, str(e))))
        finally:
            await agen.aclose()

    async def health(self) -> dict:
        if self.engine.failed:
            return {"status": "failed", "message": f"engine loop failed: {self.engine.error!r}"}
        return {"status": "ok", **self.info}

    async def metrics(self) -> bytes:
        from flame_llm.serving.metrics import render_engine

        return render_engine(self.info, self.engine.stats(), self.counters)


_HTTP = HttpConfig()  # the defaults
# (flags, add_argument kwargs): the `flame-llm serve-http` options
ARGUMENTS = [
    (("--model",), {"required": True, "help": "model directory, or 'tiny' for the embedded default"}),
    (("--host",), {"default": _HTTP.host}),
    (("--port",), {"type": int, "default": _HTTP.port}),
    (("--gpu-uuid",), {"default": None, "help": "pin to this GPU (CUDA_VISIBLE_DEVICES=UUID, verified)"}),
    (("--device-name",), {"default": "cpu", "help": "what responses report as device without a GPU"}),
    (("--served-model-name",), {"default": None, "help": "the model name clients send (default: the directory's)"}),
    (("--load-format",), {"default": "auto", "choices": ("auto", "dummy")}),
    (("--tokenizer",), {"default": None, "help": "an HF tokenizer directory or 'tiny' (the engine field tokenizer; "
                                                 "unset: the model directory's)"}),
    (("--quantization",), {"default": None, "choices": ("fp8",),
                           "help": "fp8: W8A8 FP8 projections (the engine field quantization)"}),
    (("--engine-json",), {"default": "{}", "help": "extra flame_llm.config.Config fields as a JSON object"}),
    (("--engine-process",), {"action": "store_true", "help": "run the engine's step loop in a child process of its "
                                                              "own (the engine field engine_process)"}),
    (("--torch-threads",), {"type": int, "default": 0, "help": "CPU intra-op threads (0: torch's default)"}),
    (("--api-key",), {"default": None, "help": "require 'Authorization: Bearer <key>' on /v1/* and /metrics (shows "
                                               "in `ps`: prefer --api-key-file or FLAME_API_KEY)"}),
    (("--api-key-file",), {"default": None, "help": "a file of accepted keys, one a line (unset: --api-key, else "
                                                    "the FLAME_API_KEY environment variable)"}),
    (("--max-prompts-per-request",), {"type": int, "default": _HTTP.max_prompts_per_request,
                                      "help": "prompts x n of one request (more: 413)"}),
    (("--max-tokens-per-request",), {"type": int, "default": _HTTP.max_tokens_per_request,
                                     "help": "prompt plus max output tokens over one request's completions (413)"}),
]


def engine_fields(args: argparse.Namespace) -> dict:
    """The engine's fields from the flags: --load-format, --quantization, --tokenizer and --engine-process, then
    --engine-json's over them."""
    from flame_llm.config import engine_fields_from_json

    named = {"load_format": args.load_format}
    for name in ("quantization", "tokenizer"):
        if getattr(args, name, None) is not None:
            named[name] = getattr(args, name)
    if getattr(args, "engine_process", False):
        named["engine_process"] = True
    return {**named, **engine_fields_from_json(args.engine_json)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags, kwargs in ARGUMENTS:
        p.add_argument(*flags, **kwargs)


def serve(args: argparse.Namespace, announce=None) -> int:
    """Load the engine (pinned and verified when --gpu-uuid is given) and serve until SIGINT/SIGTERM;
    announce(line) is called with the "listening on" line once the port is open."""
    from aiohttp import web

    from actors.host import EngineHost

    cfg = HttpConfig(host=args.host, port=args.port, api_key=key_from_env(args.api_key, args.api_key_file),
                     api_key_file=args.api_key_file, served_model_name=args.served_model_name,
                     max_prompts_per_request=args.max_prompts_per_request,
                     max_tokens_per_request=args.max_tokens_per_request)
    host = EngineHost.start(args.model, engine_fields(args), args.gpu_uuid,
                            args.device_name, args.torch_threads)
    app = build_app(EngineBackend(host.engine, args.gpu_uuid or args.device_name, args.served_model_name), cfg)

    async def _close(_app: web.Application) -> None:
        await asyncio.to_thread(host.stop)

    app.on_cleanup.append(_close)
    say = announce or log.info
    warning = exposure_warning(args.host, bool(app[KEYS]))
    if warning:
        log.warning(warning)
    web.run_app(app, host=args.host, port=args.port, access_log=None, handle_signals=True,
                print=lambda _: say(f"listening on http://{args.host}:{args.port}"),
                handler_cancellation=True, keepalive_timeout=cfg.header_timeout_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flame-llm serve-http", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(p.parse_args(argv), announce=lambda line: print(line, flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
