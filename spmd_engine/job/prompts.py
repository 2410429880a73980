"""The engine's input side (rank 0): prompts from the CLI or a JSONL file, tokenized and checked.

Why: one bad request must never sink a batch job, so every per-request problem becomes a
`PromptRequest.error` line (reported in the outputs) while the good requests still run.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from spmd_engine.core.requests import PromptRequest, validate_prompt  # noqa: F401 (re-exported)
from spmd_engine.core.requests import shorten as _short
from spmd_engine.job.prompt_chars import PromptCharLimit

DEFAULT_PROMPTS: list[str] = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say what makes them prime.",
]

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
CHAT_ROLES = ("system", "user", "assistant")
# per-request override -> (accepted python types, the type's name in errors); bool is never a number
OVERRIDE_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "top_k": ((int,), "an integer"),
    "max_tokens": ((int,), "an integer"),
    "ignore_eos": ((bool,), "true or false"),
    "seed": ((int, type(None)), "an integer or null"),
    "stop": ((str, list, type(None)), "a string, a list of strings or null"),
    "stop_token_ids": ((list, type(None)), "a list of integers or null"),
    "min_tokens": ((int,), "an integer"),
    "include_stop_str_in_output": ((bool,), "true or false"),
    "logprobs": ((int, type(None)), "an integer or null"),
    "prompt_logprobs": ((int, type(None)), "an integer or null"),
    "min_p": ((int, float), "a number"),
    "repetition_penalty": ((int, float), "a number"),
    "presence_penalty": ((int, float), "a number"),
    "frequency_penalty": ((int, float), "a number"),
    "n": ((int,), "an integer"),
    "structured_outputs": ((dict, type(None)), "an object or null"),
}
REQUEST_KEYS = ("chat_template_kwargs",)  # per-request keys that are neither the prompt nor sampling
NO_TOKENIZER_ERROR = "prompt text given but the checkpoint has no tokenizer; pass prompt_token_ids"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_override(key: str, value: Any) -> str | None:
    types, name = OVERRIDE_TYPES[key]
    is_bool_for_number = isinstance(value, bool) and bool not in types
    if is_bool_for_number or not isinstance(value, types):
        return f"{key!r} must be {name}, got {_type_name(value)}"
    return None


def _lone_surrogate(text: str) -> str | None:
    """Where `text` can't be UTF-8 (a lone surrogate such as JSON's "\\ud800"), or None: such text can
    neither be tokenized nor written to outputs.jsonl."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
    return None


def _problem(obj: Any) -> str | None:
    """Why a parsed request object can't run (one line), or None when it is well formed."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {_type_name(obj)}"
    unknown = [k for k in obj if k not in PROMPT_KEYS and k not in OVERRIDE_TYPES and k not in REQUEST_KEYS]
    if unknown:
        allowed = ', '.join((*PROMPT_KEYS, *OVERRIDE_TYPES, *REQUEST_KEYS))
        return f"unknown key {_short(repr(unknown[0]), 40)} (allowed: {allowed})"
    if sum(k in obj for k in PROMPT_KEYS) != 1:
        return "give exactly one of 'prompt', 'prompt_token_ids' or 'messages'"
    if "messages" in obj:
        problem = _messages_problem(obj["messages"])
        if problem:
            return problem
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return f"'chat_template_kwargs' must be a JSON object, got {_type_name(kwargs)}"
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        return f"'prompt' must be a string, got {_type_name(obj['prompt'])}"
    if "prompt" in obj and _lone_surrogate(obj["prompt"]) is not None:
        return f"'prompt' is not valid Unicode: {_lone_surrogate(obj['prompt'])}"
    if "prompt_token_ids" in obj and not _is_token_ids(obj["prompt_token_ids"]):
        return "'prompt_token_ids' must be a list of integers"
    if obj.get("prompt") == "" or obj.get("prompt_token_ids") == []:
        return "prompt is empty"
    for key in OVERRIDE_TYPES:
        error = _check_override(key, obj[key]) if key in obj else None
        if error:
            return error
    return None


def _messages_problem(messages: Any) -> str | None:
    """Why a `messages` value is not a chat (a non-empty list of {role, content} turns), or None."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects"
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            return f"messages[{i}] must be an object, got {_type_name(turn)}"
        extra = [k for k in turn if k not in ("role", "content")]
        if extra:
            return f"messages[{i}] has unknown key {_short(repr(extra[0]))} (allowed: role, content)"
        if turn.get("role") not in CHAT_ROLES:
            return f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {_short(repr(turn.get('role')))}"
        if not isinstance(turn.get("content"), str):
            return f"messages[{i}].content must be a string, got {_type_name(turn.get('content'))}"
        if _lone_surrogate(turn["content"]) is not None:
            return f"messages[{i}].content is not valid Unicode: {_lone_surrogate(turn['content'])}"
    return None


def _request_from_object(obj: Any, index: int, where: str) -> PromptRequest:
    """A request from one parsed object; a problem becomes `error` prefixed with `where`, never an exception."""
    from spmd_engine.job.openai_batch import is_batch_line, translate

    custom_id = api = None
    if is_batch_line(obj):  # the OpenAI batch format: its body in our keys, then the same checks
        obj, custom_id, api, problem = translate(obj)
        if problem:
            return PromptRequest(index, None, None, {}, f"{where}: {problem}", custom_id=custom_id, api=api)
    problem = _problem(obj)
    if problem:
        return PromptRequest(index, None, None, {}, f"{where}: {problem}", custom_id=custom_id, api=api)
    overrides = {k: v for k, v in obj.items() if k in OVERRIDE_TYPES}
    return PromptRequest(index, obj.get("prompt"), obj.get("prompt_token_ids"), overrides,
                         messages=obj.get("messages"), chat_template_kwargs=obj.get("chat_template_kwargs"),
                         custom_id=custom_id, api=api)


def _parse_line(text: str, index: int, where: str) -> PromptRequest:
    """One prompts_file line as a request; never raises, whatever the line holds (depth, size, values)."""
    try:
        return _request_from_object(json.loads(text), index, where)
    except json.JSONDecodeError as e:
        problem = f"invalid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        problem = "invalid JSON (nested too deeply to read)"
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        problem = f"invalid JSON value ({_short(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)})"
    except Exception as e:  # whatever else a line can hold: this request fails, the job goes on
        problem = f"could not be read ({type(e).__name__})"
    return PromptRequest(index, None, None, {}, f"{where}: {problem}")


READ_BLOCK_BYTES = 1 << 20  # a prompts file is read this much at a time: memory does not grow with its size
_LINE_ENDS = (b"\r\n", b"\r", b"\n")


def _strip_end(piece: bytes) -> bytes:
    for end in _LINE_ENDS:
        if piece.endswith(end):
            return piece[:-len(end)]
    return piece


def _raw_lines(path: Path) -> Iterator[bytes]:
    """Every line of `path` without its ending, read a block at a time (what `read_bytes().splitlines()`
    gives, without holding the file): lines end at LF, CRLF or CR, never inside a CRLF that a block
    boundary cuts; a UTF-8 byte order mark at the start is skipped."""
    with open(path, "rb") as f:
        carry = b""
        first = True
        while True:
            block = f.read(READ_BLOCK_BYTES)
            data = carry + block
            if first and len(data) >= len(codecs.BOM_UTF8) or not block:
                if first and data.startswith(codecs.BOM_UTF8):
                    data = data[len(codecs.BOM_UTF8):]
                first = False
            if not block:
                if data:
                    yield _strip_end(data)
                return
            pieces = data.splitlines(keepends=True)
            # the last piece may go on in the next block (no ending yet, or a CR whose LF comes next)
            carry = pieces.pop() if pieces and not pieces[-1].endswith(b"\n") else b""
            for piece in pieces:
                yield _strip_end(piece)


def iter_jsonl(path: Path) -> Iterator[PromptRequest]:
    """One request per line, each line decoded and parsed on its own as it is reached: no line can fail
    another, and a file of any size is read in bounded memory. Line N is request N - 1 (its `index`).

    Lines end at LF, CRLF or CR (never at U+2028 or U+0085, which JSON strings may hold); a UTF-8
    byte order mark at the start of the file is skipped. A blank line is an error row (so no later line
    shifts from its index), except blank lines at the end of the file, which are no lines at all.
    """
    from spmd_engine.job.openai_batch import CustomIds

    custom_ids = CustomIds()
    first_blank: int | None = None  # the first of the blank lines just read (rows once a request follows)
    for line_no, raw in enumerate(_raw_lines(path), start=1):
        if _is_blank(raw):
            first_blank = line_no if first_blank is None else first_blank
            continue
        for blank in range(first_blank or line_no, line_no):
            yield PromptRequest(blank - 1, None, None, {}, f"prompts_file line {blank}: the line is blank "
                                                           "(each line is one request)")
        first_blank = None
        yield _read_line(raw, line_no, custom_ids)


def _read_line(raw: bytes, line_no: int, custom_ids) -> PromptRequest:
    """Line `line_no` (not blank) as request `line_no - 1`; a problem is its error, prefixed with the line."""
    index, where = line_no - 1, f"prompts_file line {line_no}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return PromptRequest(index, None, None, {}, f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                                                    f"{e.start + 1}); save the file as UTF-8")
    request = _parse_line(text, index, where)
    duplicate = custom_ids.duplicate(request.custom_id, line_no)
    if duplicate is not None:
        request = PromptRequest(index, None, None, {}, f"{where}: {duplicate}", custom_id=request.custom_id,
                                api=request.api)
    return request


BLANK_CHECK_BYTES = 4096  # a longer line is never taken for blank (not decoded to look: it is an error row anyway)


def _is_blank(raw: bytes) -> bool:
    """Whether a line holds only blanks (Unicode ones such as U+00A0 too), without decoding long lines."""
    stripped = raw.strip()
    if not stripped:
        return True
    return len(stripped) <= BLANK_CHECK_BYTES and not stripped.decode("utf-8", errors="replace").strip()


def count_jsonl_requests(path: Path) -> int:
    """How many requests iter_jsonl(path) yields (the lines up to the last one that is not blank), by a
    scan of the bytes (no JSON parsing): the progress bar's total, known before the first request runs."""
    last = 0
    for line_no, raw in enumerate(_raw_lines(path), start=1):
        if not _is_blank(raw):
            last = line_no
    return last


def _read_jsonl(path: Path) -> list[PromptRequest]:
    return list(iter_jsonl(path))


def iter_prompts(prompts: Sequence[Any] | str | None, prompts_file: str | None) -> tuple[Iterator[PromptRequest], int]:
    """`read_prompts`, lazily: (the requests as an iterator, how many there are). A prompts_file is read
    and parsed as the iterator is pulled; its count comes from a byte scan up front.

    Raises ValueError only for job-level mistakes (both given, empty list, missing file).
    """
    if prompts_file is not None and prompts is None:
        path = Path(prompts_file).expanduser()
        if not path.is_file():
            raise ValueError(f"prompts_file={prompts_file!r}: no such file")
        return iter_jsonl(path), count_jsonl_requests(path)
    requests = read_prompts(prompts, prompts_file)
    return iter(requests), len(requests)


def read_prompts(prompts: Sequence[Any] | str | None, prompts_file: str | None) -> list[PromptRequest]:
    """Requests from `prompts` (CLI strings, or token-id lists) or `prompts_file` (JSONL); neither: DEFAULT_PROMPTS.

    Raises ValueError only for job-level mistakes (both given, empty list, missing file).
    """
    if prompts is not None and prompts_file is not None:
        raise ValueError("prompts and prompts_file are both set; give only one")
    if prompts_file is not None:
        path = Path(prompts_file).expanduser()
        if not path.is_file():
            raise ValueError(f"prompts_file={prompts_file!r}: no such file")
        return _read_jsonl(path)
    if prompts is None:
        prompts = DEFAULT_PROMPTS
    if isinstance(prompts, str):
        prompts = [prompts]
    if len(prompts) == 0:
        raise ValueError("prompts is an empty list; give at least one prompt (or unset it for the built-in ones)")
    requests = []
    for index, item in enumerate(prompts):
        is_ids = isinstance(item, Sequence) and not isinstance(item, str)
        obj = {"prompt_token_ids": list(item)} if is_ids else {"prompt": item}
        requests.append(_request_from_object(obj, index, f"prompts[{index}]"))
    return requests


def _encode(prompt: str, tokenizer, chat_template: bool) -> list[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(text, add_special_tokens=False))  # the template holds the specials
    return list(tokenizer.encode(prompt))


def _render_chat(request: PromptRequest, tokenizer, job_kwargs: dict[str, Any] | None) -> str:
    """The request's `messages` through the tokenizer's chat template, with the generation prompt;
    the job's `chat_template_kwargs` under the line's own."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; give 'prompt' instead of 'messages'")
    kwargs = {**(job_kwargs or {}), **(request.chat_template_kwargs or {})}
    return tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True, **kwargs)


def tokenize(requests: list[PromptRequest], tokenizer, chat_template: bool,
             chat_template_kwargs: dict[str, Any] | None = None,
             char_limit: PromptCharLimit | None = None) -> list[PromptRequest]:
    """Fill `prompt_token_ids` of text requests in place (chat template: one user turn + generation prompt;
    never for an OpenAI batch /v1/completions line, whose prompt is taken as written).

    A `messages` request is rendered by the chat template first (its `prompt` becomes the rendered
    text); a template error is that request's error. A text longer than `char_limit` allows is an error
    without being tokenized. Requests that already have ids or an error are left alone; returns
    `requests` for chaining.
    """
    for request in requests:
        if request.error is not None or request.prompt_token_ids is not None:
            continue
        if tokenizer is None:
            request.error = NO_TOKENIZER_ERROR
        elif request.messages is not None:
            try:
                request.prompt = _render_chat(request, tokenizer, chat_template_kwargs)
                request.error = char_limit.problem(request.prompt) if char_limit else None
                if request.error is None:
                    request.prompt_token_ids = list(tokenizer.encode(request.prompt, add_special_tokens=False))
            except Exception as exc:  # a template that raises (jinja's raise_exception, bad kwargs): one row
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                request.error = f"messages could not be rendered by the chat template ({type(exc).__name__}" \
                                f"{': ' if detail else ''}{_short(detail, 160)})"
        elif char_limit is not None and char_limit.problem(request.prompt):
            request.error = char_limit.problem(request.prompt)
        else:
            try:
                # an OpenAI /v1/completions line takes its prompt as written (vLLM's run-batch)
                templated = chat_template and request.api != "completions"
                request.prompt_token_ids = _encode(request.prompt, tokenizer, templated)
            except Exception as exc:  # a tokenizer bug on one odd text fails that request, not the job
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                request.error = f"prompt could not be tokenized ({type(exc).__name__}{': ' if detail else ''}" \
                                f"{_short(detail, 120)})"
    return requests
