"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (SSE streaming too),
/v1/models and /health, served as the coordinator's Ray Serve ingress, and the playground page
at / (playground.html: each streamed token marked by its source, the rounds' stats).

Each request body is read as a pydantic model (CompletionBody, ChatBody: strict types, errors
naming the field) and becomes one GenerateRequest run through the same CoordinatorServicer as
the gRPC API (same validation, concurrency limit and decoding), so the text is the gRPC API's. The
speculation settings ride in the extension field `speculation` (GenerateRequest's names:
num_draft_tokens, tree, adaptive, overlap, steering); `top_k` is accepted as vLLM does.
Structured outputs: OpenAI's `response_format` (json_object, json_schema), and beside it the
extension field `structured_outputs` (as vLLM names it: one of json, regex, grammar, choice)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Iterator, Literal, Union

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool

from specdec.core.prompts import chat_ids
from specdec.serving.rpc import ServiceError, bearer_accepted
from specdec.v1 import common_pb2, coordinator_pb2

PLAYGROUND = (Path(__file__).parent / "playground.html").read_text()  # the page at /: one file, no build step
DISCONNECT_POLL_S = 0.05  # how often a running request checks that its HTTP client is still there
SPECULATION_FIELDS = ("num_draft_tokens", "tree", "adaptive", "overlap", "steering")
CHAT_ROLES = ("system", "user", "assistant")
ONE_OF = {  # the fields that take one of several forms, and how an error names them
    "prompt": "a string, a list of one string, or a list of token ids",
    "stop": "a string or a list of strings",
    "temperature": "a number",
    "top_p": "a number",
}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class ApiError(Exception):
    """An OpenAI-style error answer: HTTP status, message and type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    @classmethod
    def from_service(cls, err: ServiceError) -> ApiError:
        status = HTTP_STATUS.get(err.code, 500)
        kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
        return cls(status, err.message, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class ForwardedCall:
    """A call that reached the coordinator through Ray Serve (its HTTP or gRPC proxy) instead
    of the coordinator's own gRPC server: what CoordinatorServicer asks of a gRPC context.
    `abort` raises ServiceError (and records the status on Serve's gRPC context, if any)."""

    def __init__(self, metadata: list[tuple[str, str]], serve_context=None):
        self.metadata = metadata
        self.serve_context = serve_context
        self.gone = threading.Event()  # set when the client goes away: the rounds stop

    @classmethod
    def of_headers(cls, headers) -> ForwardedCall:
        """A call over HTTP: its headers are its metadata."""
        return cls([(k.lower(), v) for k, v in headers.items()])

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def time_remaining(self) -> None:
        return None  # the proxies keep their own request timeouts

    def is_active(self) -> bool:
        return not self.gone.is_set()

    def abort(self, code: grpc.StatusCode, details: str):
        if self.serve_context is not None:
            self.serve_context.set_code(code)
            self.serve_context.set_details(details)
        raise ServiceError(code, details)

    def authorize(self, tokens: set[str]) -> None:
        if tokens and not bearer_accepted(dict(self.metadata).get("authorization", ""), tokens):
            self.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token: send 'authorization: Bearer <token>'")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr
    description: StrictStr | None = None
    json_schema: dict = Field(alias="schema")
    strict: StrictBool | None = None  # every schema is enforced exactly, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's extension field: exactly one of these."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    grammar: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None


class _Body(BaseModel):
    """What this server reads of a completions request (OpenAI's clients send more: ignored).
    Strict: a string is not a number, nor a boolean an integer."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    n: StrictInt = 1
    max_tokens: Annotated[StrictInt, Field(ge=1, lt=2**31)] | None = None
    temperature: StrictFloat | StrictInt = 1.0  # OpenAI's default
    top_p: StrictFloat | StrictInt | None = None
    top_k: Annotated[StrictInt, Field(ge=0, lt=2**31)] | None = None  # as vLLM accepts it
    seed: Annotated[StrictInt, Field(ge=0, lt=2**64)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    speculation: dict | None = None  # GenerateRequest's fields, parsed by protobuf below
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    stream: StrictBool = False
    stream_options: dict | None = None


class CompletionBody(_Body):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal[CHAT_ROLES]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatBody(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, lt=2**31)] | None = None  # the newer name of max_tokens


@dataclass
class Completion:
    """One parsed request: what to run and how to answer."""

    request: coordinator_pb2.GenerateRequest
    prompt_tokens: int
    chat: bool
    stream: bool
    include_usage: bool
    include_rounds: bool  # each chunk's text spans by source, and its rounds (the playground's marks)


class OpenAIFrontend:
    def __init__(self, servicer, model_name: str, tokens: set[str]):
        """servicer: the coordinator's CoordinatorServicer; tokens: accepted bearer tokens (none = open)."""
        self.servicer = servicer
        self.coordinator = servicer.coordinator
        self.model_name = model_name
        self.tokens = tokens

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}

    def parse(self, body, chat: bool) -> Completion:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            parsed = (ChatBody if chat else CompletionBody).model_validate(body)
        except ValidationError as err:
            first = err.errors()[0]
            field = str(first["loc"][0])
            if field in ONE_OF:  # pydantic would name each alternative it tried
                raise ApiError(400, f"{field} must be {ONE_OF[field]}", param=field) from None
            where = ".".join(str(part) for part in first["loc"])
            raise ApiError(400, f"{where}: {first['msg']}", param=field) from None
        if parsed.model not in (None, self.model_name):
            raise ApiError(404, f"the model '{parsed.model}' does not exist; this server serves '{self.model_name}'", param="model")
        if parsed.n != 1:
            raise ApiError(400, "n: only one choice per request is served", param="n")
        ids = self._chat_prompt(parsed.messages) if chat else self._text_prompt(parsed.prompt)
        limit = parsed.max_completion_tokens if chat and parsed.max_completion_tokens is not None else parsed.max_tokens
        request = coordinator_pb2.GenerateRequest(
            prompt_token_ids=ids, temperature=parsed.temperature, top_k=parsed.top_k or 0, seed=parsed.seed or 0,
            stop=[parsed.stop] if isinstance(parsed.stop, str) else parsed.stop or [],
        )
        if limit is not None:
            request.max_new_tokens = limit
        if parsed.top_p is not None:
            request.top_p = parsed.top_p
        speculation = parsed.speculation or {}
        if unknown := sorted(set(speculation) - set(SPECULATION_FIELDS)):
            raise ApiError(400, f"speculation: unknown field {unknown[0]}; allowed: {', '.join(SPECULATION_FIELDS)}", param="speculation")
        try:
            ParseDict(speculation, request)
        except ParseError as err:
            raise ApiError(400, f"speculation: {err}", param="speculation") from None
        constraint = _constraint(parsed.response_format, parsed.structured_outputs)
        if constraint is not None:
            request.constraint.CopyFrom(constraint)
        options = parsed.stream_options or {}
        return Completion(request, len(ids), chat, parsed.stream, bool(options.get("include_usage")), bool(options.get("include_rounds")))

    def _text_prompt(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return self.coordinator.prompt_ids(coordinator_pb2.GenerateRequest(prompt_token_ids=prompt))
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string, a list of one string, or a list of token ids", param="prompt")
        return self.coordinator.prompt_ids(coordinator_pb2.GenerateRequest(prompt=prompt))

    def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        turns = [{"role": message.role, "content": message.text()} for message in messages]
        tokenizer = self.coordinator.tokenizer
        if not tokenizer.chat_template:
            raise ApiError(400, "the model's tokenizer has no chat template: use /v1/completions", param="messages")
        chars = sum(len(t["content"]) for t in turns)
        if chars > self.coordinator.max_prompt_chars:
            raise ApiError(
                400,
                f"the messages have {chars} characters, more than the model's context of {self.coordinator.max_context} tokens can hold",
            )
        return self.coordinator.prompt_ids(coordinator_pb2.GenerateRequest(prompt_token_ids=chat_ids(tokenizer, turns)))

    def respond(self, completion: Completion, call: ForwardedCall):
        """The JSON answer, or (streaming) an iterator of SSE events; errors before the first
        token raise ApiError, later ones end the stream with an error event."""
        names = ("chatcmpl" if completion.chat else "cmpl") + "-" + uuid.uuid4().hex, int(time.time())
        if not completion.stream:
            reply = self.servicer.Generate(completion.request, call)
            return self._body(completion, names, reply.text, reply.finish_reason, reply.stats)
        parts = self.servicer.GenerateStream(completion.request, call)
        first = next(parts)  # validation errors surface here, as an HTTP status
        return self._events(completion, names, first, parts)

    def _events(self, completion: Completion, names, first, parts) -> Iterator[str]:
        if completion.chat:
            yield _event(self._chunk(completion, names, {"role": "assistant", "content": ""}, None))
        generated, last = 0, None
        try:
            for last in _chain(first, parts):
                generated += len(last.token_ids)
                if last.text or last.finish_reason or (completion.include_rounds and last.rounds):
                    delta = {"content": last.text} if completion.chat else last.text
                    chunk = self._chunk(completion, names, delta, last.finish_reason or None)
                    if completion.include_rounds:
                        chunk["choices"][0]["spans"] = [_fields(span) for span in last.spans]
                        chunk["rounds"] = [_fields(info) for info in last.rounds]
                    yield _event(chunk)
        except ServiceError as err:
            yield _event(ApiError.from_service(err).body())
        if completion.include_usage and last is not None and last.finish_reason:
            chunk = self._chunk(completion, names, None, None) | {"choices": [], "usage": _usage(completion, generated)}
            yield _event(chunk | {"speculation": _speculation(last.stats)})
        yield "data: [DONE]\n\n"

    def _chunk(self, completion: Completion, names, delta, finish_reason) -> dict:
        kind = "chat.completion.chunk" if completion.chat else "text_completion"
        choice = {"index": 0, "finish_reason": finish_reason}
        choice |= {"delta": delta or {}} if completion.chat else {"text": delta or "", "logprobs": None}
        chunk = {"id": names[0], "object": kind, "created": names[1], "model": self.model_name, "choices": [choice]}
        return chunk | ({"usage": None} if completion.include_usage else {})

    def _body(self, completion: Completion, names, text: str, finish_reason: str, stats) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason}
        if completion.chat:
            choice |= {"message": {"role": "assistant", "content": text}}
        else:
            choice |= {"text": text, "logprobs": None}
        return {
            "id": names[0],
            "object": "chat.completion" if completion.chat else "text_completion",
            "created": names[1],
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(completion, stats.generated_tokens),
            "speculation": _speculation(stats),
        }


def openai_app(frontend: OpenAIFrontend) -> FastAPI:
    app = FastAPI(title="specdec", description="OpenAI-compatible API over distributed speculative decoding")

    def answer(call: ForwardedCall, body, chat: bool):
        try:
            call.authorize(frontend.tokens)
            reply = frontend.respond(frontend.parse(body, chat), call)
        except ServiceError as err:
            return _error(ApiError.from_service(err))
        except ApiError as err:
            return _error(err)
        if isinstance(reply, dict):
            return JSONResponse(reply)
        return StreamingResponse(reply, media_type="text/event-stream")

    async def run(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError:
            return _error(ApiError(400, "the request body is not valid JSON"))
        # Decoding blocks: a worker thread runs it (a streamed answer's iterator too), while this
        # task watches the client: once it goes away (or Serve cancels the request for it), the
        # rounds stop at the next one and free their slot and sessions.
        call = ForwardedCall.of_headers(request.headers)
        work = asyncio.ensure_future(run_in_threadpool(answer, call, body, chat))
        try:
            while not (await asyncio.wait({work}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    call.gone.set()
            return work.result()
        except asyncio.CancelledError:
            call.gone.set()
            raise

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    @app.get("/v1/models")
    def models(request: Request):
        try:
            ForwardedCall.of_headers(request.headers).authorize(frontend.tokens)
        except ServiceError as err:
            return _error(ApiError.from_service(err))
        return frontend.models()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    def playground():
        return PLAYGROUND  # open, as /health is: the page holds no answers; its API calls send the key typed into it

    return app


def _constraint(response_format: ResponseFormat | None, structured: StructuredOutputs | None) -> common_pb2.Constraint | None:
    """The request's one constraint (GenerateRequest.constraint), from either field."""
    wants_format = response_format is not None and response_format.type != "text"
    named = [name for name, value in (structured or StructuredOutputs()) if value is not None]
    if wants_format and named:
        raise ApiError(400, "set response_format or structured_outputs, not both", param="structured_outputs")
    if len(named) > 1:
        raise ApiError(400, f"structured_outputs: set one of json, regex, grammar, choice, not {len(named)}", param="structured_outputs")
    if wants_format:
        if response_format.type == "json_object":
            return common_pb2.Constraint(json_object=True)
        if response_format.json_schema is None:
            raise ApiError(400, "response_format: type json_schema needs its json_schema (name, schema)", param="response_format")
        return common_pb2.Constraint(json_schema=json.dumps(response_format.json_schema.json_schema))
    if not named:
        return None
    value = getattr(structured, named[0])
    if named[0] == "json_schema":
        return common_pb2.Constraint(json_schema=value if isinstance(value, str) else json.dumps(value))
    if named[0] == "choice":
        return common_pb2.Constraint(choice=common_pb2.Choices(options=value))
    return common_pb2.Constraint(**{named[0]: value})


def _usage(completion: Completion, generated: int) -> dict:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": generated, "total_tokens": completion.prompt_tokens + generated}


def _speculation(stats) -> dict:
    """The request's RoundStats, plus acceptance under the names vLLM reports."""
    out = {}
    for field, value in stats.ListFields():
        if hasattr(value, "items"):
            out[field.name] = dict(value)
        elif isinstance(value, (bool, int, float, str)):
            out[field.name] = value
        elif hasattr(value, "ListFields"):  # a message: the round anatomies
            out[field.name] = _fields(value)
        else:
            out[field.name] = list(value)
    out["acceptance_rate"] = stats.accepted_draft_tokens / stats.drafted_tokens if stats.drafted_tokens else 0.0
    out["mean_acceptance_length"] = 1 + stats.accepted_draft_tokens / stats.speculative_rounds if stats.speculative_rounds else 1.0
    return out


def _fields(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _chain(first, rest):
    yield first
    yield from rest
