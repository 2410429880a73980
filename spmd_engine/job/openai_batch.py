"""The OpenAI batch format: input lines ({custom_id, method, url, body}) and output objects.

Why: offline users (and vLLM's run-batch) already hold request files in this format; a line is
recognised by its `body` and translated into our own request keys, so one validation path serves
both. A body field we cannot honour is named in that line's error (never silently dropped).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
BATCH_KEYS = ("custom_id", "method", "url", "body")

# body field -> our request key (None: accepted and ignored, e.g. the model is the job's model.path)
_COMMON = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "stop": "stop",
           "seed": "seed", "model": None, "user": None,
           # vLLM's extra sampling fields, accepted in bodies as vLLM's server does
           "top_k": "top_k", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
           "include_stop_str_in_output": "include_stop_str_in_output", "prompt_logprobs": "prompt_logprobs",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
           "repetition_penalty": "repetition_penalty", "min_p": "min_p", "n": "n",
           "structured_outputs": "structured_outputs"}
CHAT_FIELDS = {**_COMMON, "messages": "messages", "max_completion_tokens": "max_tokens",
               "chat_template_kwargs": "chat_template_kwargs"}
COMPLETION_FIELDS = {**_COMMON, "prompt": "prompt"}
# fields whose value is accepted only when it asks for nothing we would have to ignore
_NEUTRAL = {"stream": False, "echo": False}


def _neutral(key: str, value: Any) -> bool:
    """A field set to the value that changes nothing (stream=false, echo=false)."""
    if key not in _NEUTRAL:
        return False
    want = _NEUTRAL[key]
    if isinstance(want, bool):
        return value is want
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == want


def is_batch_line(obj: Any) -> bool:
    """A JSON object in the OpenAI batch format (it has a `body`, or a `url` and `method`)."""
    return isinstance(obj, dict) and ("body" in obj or ("url" in obj and "method" in obj))


def _kind(url: Any) -> str | None:
    return {CHAT_URL: "chat", COMPLETIONS_URL: "completions"}.get(url) if isinstance(url, str) else None


def translate(obj: dict) -> tuple[dict | None, str | None, str | None, str | None]:
    """(our request object, custom_id, api kind "chat" | "completions", error) of one batch line."""
    custom_id = obj.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    unknown = [k for k in obj if k not in BATCH_KEYS]
    if unknown:
        return None, custom_id, None, f"unknown batch key {unknown[0]!r} (allowed: {', '.join(BATCH_KEYS)})"
    if "custom_id" in obj and custom_id is None:
        return None, None, None, "'custom_id' must be a string"
    if obj.get("method", "POST") != "POST":
        return None, custom_id, None, f"'method' must be POST, got {obj.get('method')!r}"
    kind = _kind(obj.get("url"))
    if kind is None:
        return None, custom_id, None, f"'url' must be {CHAT_URL} or {COMPLETIONS_URL}, got {str(obj.get('url'))[:80]!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return None, custom_id, kind, "'body' must be a JSON object"
    fields = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    request: dict[str, Any] = {}
    unsupported = []
    for key, value in body.items():
        if _neutral(key, value):
            continue
        if key in fields:
            if fields[key] is not None:
                request[fields[key]] = value
        elif key not in ("logprobs", "top_logprobs", "response_format"):
            unsupported.append(key)
    if unsupported:
        return None, custom_id, kind, f"body field(s) not supported by this engine: {', '.join(unsupported)} " \
                                      f"(url {obj['url']})"
    error = _logprobs(kind, body, request) or _response_format(body, request)
    if error:
        return None, custom_id, kind, error
    if kind == "completions" and isinstance(request.get("prompt"), list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in request["prompt"]):
        request["prompt_token_ids"] = request.pop("prompt")  # a completions prompt may be token ids
    return request, custom_id, kind, None


@dataclass
class CustomIds:
    """The custom_ids seen so far in one batch file: the format requires them unique, so a line that
    repeats one is an error row (its output could not be told from the first's). Holds one entry per
    distinct id (the ids of a file, not its requests)."""

    first_line: dict[str, int] = field(default_factory=dict)

    def duplicate(self, custom_id: str | None, line_no: int) -> str | None:
        """Why line `line_no` may not use `custom_id` (one line), or None; the first use is remembered."""
        if custom_id is None:
            return None
        first = self.first_line.setdefault(custom_id, line_no)
        if first == line_no:
            return None
        shown = custom_id if len(custom_id) <= 80 else custom_id[:80] + "..."
        return f"duplicate custom_id {shown!r} (first on line {first}); custom_ids must be unique in a batch file"


def _response_format(body: dict, request: dict) -> str | None:
    """`response_format` -> our `structured_outputs`: {"type": "json_object"} (any JSON object), {"type":
    "json_schema", "json_schema": {"schema": {...}}} (that schema), {"type": "text"} (nothing)."""
    if "response_format" not in body or body["response_format"] is None:
        return None
    form = body["response_format"]
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return None
    if "structured_outputs" in request:
        return "body.response_format and body.structured_outputs both constrain the output: give one"
    if kind == "json_object":
        request["structured_outputs"] = {"json_object": True}
    elif kind == "json_schema":
        spec = form.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, str)):
            return "body.response_format.json_schema.schema must be a JSON schema object"
        request["structured_outputs"] = {"json": schema}
    else:
        return "body.response_format.type must be text, json_object or json_schema, got " \
               f"{str(kind)[:40]!r}"
    return None


def _logprobs(kind: str, body: dict, request: dict) -> str | None:
    """Chat: logprobs (bool) + top_logprobs (int); completions: logprobs (int) -> our `logprobs: k`."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            return "body.logprobs must be true or false for chat completions"
        if top is not None and not logprobs:
            return "body.top_logprobs needs body.logprobs: true"
        if logprobs:
            request["logprobs"] = top if top is not None else 0
    else:
        if top is not None:
            return "body.top_logprobs is a chat completions field; completions take logprobs: k"
        if logprobs is not None:
            request["logprobs"] = logprobs
    return None


def batch_output(rows: list[dict], kind: str | None, model: str) -> dict:
    """One OpenAI batch output object for one request's rows (its n completions, in order; an error
    row becomes `error`, no response)."""
    row = rows[0]
    custom_id = row.get("custom_id")
    if row.get("finish_reason") == "error":
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                "error": {"code": "invalid_request", "message": row.get("error")}}
    prompt_tokens = len(row.get("prompt_token_ids") or [])
    completion_tokens = sum(len(r.get("token_ids") or []) for r in rows)
    choices = [_choice(r, kind) for r in rows]
    obj = "text_completion" if kind == "completions" else "chat.completion"
    request_id = f"req_{uuid.uuid4().hex}"
    body = {"id": f"{'chatcmpl' if kind != 'completions' else 'cmpl'}-{uuid.uuid4().hex}", "object": obj,
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def _choice(row: dict, kind: str | None) -> dict[str, Any]:
    """One completion as a `choices` entry (its `index`: the row's sample_index)."""
    choice: dict[str, Any] = {"index": row.get("sample_index") or 0, "finish_reason": row.get("finish_reason"),
                              "stop_reason": row.get("stop_reason")}
    logprobs = row.get("logprobs")
    if kind == "completions":
        choice["text"] = row.get("text")
        choice["logprobs"] = None if logprobs is None else {
            "tokens": [e["token"] for e in logprobs], "token_logprobs": [e["logprob"] for e in logprobs],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in logprobs]}
    else:
        choice["message"] = {"role": "assistant", "content": row.get("text")}
        choice["logprobs"] = None if logprobs is None else {"content": [
            {"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in logprobs]}
    return choice
