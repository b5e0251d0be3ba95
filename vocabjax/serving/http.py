"""The HTTP endpoint: an OpenAI-style completions API over one ``LiveServer`` (FastAPI on
uvicorn, the ``serve`` extra: ``pip install 'vocabjax[serve]'``).

    POST /v1/completions   {"prompt": "def main(", "max_tokens": 16, "temperature": 0.8,
                            "top_k": 40, "seed": 1, "stream": false, "model": "auto"}
    GET  /health           {"status": "ok" | "draining", ...}
    GET  /metrics          per-head requests and tokens, running batch, staged requests,
                           windowed bits per byte, switches, queue length, memory,
                           shapes compiled, CPU seconds (the engine loop's, the process's)

``model`` is ``"auto"`` (the router picks the head; default) or one of the run's heads. A
request's fields are checked (an unknown field, a wrong type, ``max_tokens`` < 1, a prompt
longer than the run's context at a head it may get: 400 with one line saying why); with
``stream`` the text comes as server-sent events, one ``data: {...}`` chunk per piece of text
and ``data: [DONE]`` last. A client that leaves mid-stream frees its row. While the server
drains (Ctrl-C once), new requests get 503 and the running ones finish; Ctrl-C again stops at
once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from vocabjax.errors import UserError
from vocabjax.progress import Progress
from vocabjax.serving.decode import Sampling
from vocabjax.serving.live import Delta, Draining, LiveRequest, LiveServer, Outcome, fresh_seed
from vocabjax.serving.trace import TOKENS_MAX


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions (unknown fields are refused)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)  # the text to continue
    max_tokens: int = Field(16, ge=1, le=TOKENS_MAX)  # most tokens to generate
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)  # 0: greedy
    top_k: int | None = Field(None, ge=1)  # sample among the k most likely (temperature > 0)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)  # sampling seed; None: a fresh one
    stream: bool = False  # server-sent events
    model: str = "auto"  # "auto": the router's head; or one of the run's heads


FINISH = {"eos": "stop", "max_new_tokens": "length", "max_seq": "length"}


def create_app(live: LiveServer) -> FastAPI:
    """The endpoint's app over ``live`` (started and stopped by the caller)."""
    app = FastAPI(title="vocabjax", docs_url=None, redoc_url=None)
    ids = itertools.count(1)  # the handlers all run on the server's one event loop

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, "; ".join(_problem(e) for e in exc.errors()))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        m = live.metrics()
        status = "draining" if m["draining"] else "ok"
        return {"status": status, "heads": list(live.heads), "running": m["running"],
                "queue_length": m["queue_length"]}  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> dict[str, Any]:
        return live.metrics()

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> JSONResponse | StreamingResponse:
        try:
            request = _live_request(body, live)
            ticket = live.submit(request, loop=asyncio.get_running_loop())
        except Draining as exc:
            return _error(503, str(exc), kind="unavailable")
        except UserError as exc:
            return _error(400, str(exc))
        name = f"cmpl-{next(ids)}"
        created = int(time.time())
        if not body.stream:
            try:
                outcome = await _outcome(ticket)
            except asyncio.CancelledError:
                live.cancel(ticket)
                raise
            if outcome.stop == "failed":
                return _error(500, outcome.error or "the engine failed", kind="server_error")
            return JSONResponse(_completion(name, created, outcome))
        return StreamingResponse(
            _events(live, ticket, name, created), media_type="text/event-stream"
        )

    return app


def _live_request(body: CompletionRequest, live: LiveServer) -> LiveRequest:
    """The engine's request from a checked body; a UserError names what is wrong."""
    head = None
    if body.model != "auto":
        if not body.model.isdigit() or int(body.model) not in live.heads:
            heads = ", ".join(map(str, live.heads))
            raise UserError(f"model {body.model!r} must be 'auto' or one of the heads {heads}")
        head = int(body.model)
    seed = fresh_seed() if body.seed is None else body.seed
    sampling = Sampling(body.temperature, body.top_k, seed)
    return LiveRequest(body.prompt, body.max_tokens, sampling, head, body.stream)


async def _outcome(ticket) -> Outcome:
    while True:
        event = await ticket.next()
        if isinstance(event, Outcome):
            return event


async def _events(live: LiveServer, ticket, name: str, created: int) -> AsyncIterator[str]:
    """The server-sent events of a streaming request; a client that leaves cancels it."""
    done = False
    try:
        while True:
            event = await ticket.next()
            if isinstance(event, Delta):
                yield _sse(_chunk(name, created, event.text, None))
                continue
            done = True
            if event.stop == "failed":
                yield _sse({"error": {"message": event.error, "type": "server_error"}})
            else:
                yield _sse(_chunk(name, created, "", FINISH.get(event.stop, "stop"), event))
            yield "data: [DONE]\n\n"
            return
    finally:
        if not done:  # the client left (or the server stops): free its row
            live.cancel(ticket)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _chunk(
    name: str, created: int, text: str, finish: str | None, outcome: Outcome | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": name,
        "object": "text_completion",
        "created": created,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
    }
    if outcome is not None:
        out.update(_extra(outcome))
    return out


def _completion(name: str, created: int, outcome: Outcome) -> dict[str, Any]:
    finish = FINISH.get(outcome.stop, "stop")
    return {
        "id": name,
        "object": "text_completion",
        "created": created,
        "choices": [{"index": 0, "text": outcome.text, "finish_reason": finish, "logprobs": None}],
        **_extra(outcome),
    }


def _extra(outcome: Outcome) -> dict[str, Any]:
    """Usage, and what vocabjax adds: the head, why it stopped, the prompt's bits per byte."""
    n = len(outcome.tokens)
    return {
        "model": f"head-{outcome.head}",
        "usage": {
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": outcome.prompt_tokens + n,
        },
        "vocabjax": {
            "head": outcome.head,
            "stop": outcome.stop,
            "prompt_bpb": None if outcome.prompt_bpb is None else round(outcome.prompt_bpb, 4),
            "queue_s": round(outcome.queue_s, 6),
            "latency_s": round(outcome.latency_s, 6),
        },
    }


def _problem(error: dict[str, Any]) -> str:
    """One validation error as a line: ``max_tokens: Input should be greater than or equal to
    1``, ``temprature: Extra inputs are not permitted``."""
    where = ".".join(str(x) for x in error.get("loc", ()) if x != "body") or "body"
    return f"{where}: {error.get('msg', 'invalid')}"


def _error(status: int, message: str, *, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first Ctrl-C (or SIGTERM): new requests get 503 while the
    running ones finish, then it stops; a second one stops it at once."""

    def __init__(self, config: uvicorn.Config, live: LiveServer, log: Progress) -> None:
        super().__init__(config)
        self.live = live
        self.log = log

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.live.draining:
            self.force_exit = self.should_exit = True
            return
        name = signal.Signals(sig).name if sig else "stop"
        self.log(f"{name}: draining (new requests get 503); again to stop at once")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        self.live.drain()
        self.log("drained: every request finished")
        self.should_exit = True


def serve_http(live: LiveServer, *, host: str, port: int, log: Progress) -> None:
    """Run the endpoint until it is drained or stopped (blocking); ``live`` is started here."""
    with socket.socket() as probe:  # a port in use is one error line, not uvicorn's exit
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    config = uvicorn.Config(create_app(live), host=host, port=port, log_level="warning")
    server = DrainingServer(config, live, log)
    live.start()
    log(f"serving http://{host}:{port}/v1/completions (Ctrl-C drains)")
    try:
        server.run()
    finally:
        live.stop()
