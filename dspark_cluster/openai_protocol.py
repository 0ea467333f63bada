"""OpenAI's side of the HTTP API, without the app: the request bodies (pydantic models), the error
body every refusal is answered with, and the checks an untrusted JSON body passes before it is
validated (size of lists, nesting depth, text UTF-8 can carry).

The bodies type-check what clients send (strict: "5" is not 5; floats finite). The bounds of the
sampling fields are `SamplingParams`' own (taken from its fields, so each is written once): the
HTTP layer checks them only to name the field the client sent (`max_completion_tokens`, not the
engine's `max_tokens`).
"""

from __future__ import annotations

import json
import typing
from typing import Annotated, Any, Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .sampling import MAX_STOP_STRINGS, SamplingParams

MAX_JSON_DEPTH = 64  # nesting levels a request body may have (OpenAI bodies need about 6)
MAX_STOP_TOKEN_IDS = 1024  # checked by the engine on every token

# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: Optional[dict] = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return AsciiJSON(self.body(), status_code=self.status, headers=headers or None)


def json_text(obj: Any) -> str:
    """Strict JSON, the one encoder of every body and SSE event: every non-ASCII character escaped
    (a message quoting the client's input cannot fail to encode: a lone surrogate is legal in JSON
    but not in UTF-8), and no NaN / Infinity (not JSON; strict clients refuse them): a non-finite
    number is a bug, so it raises ValueError here and shows as an error, never as invalid JSON."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


class AsciiJSON(JSONResponse):
    """A JSON response encoded by `json_text`."""

    def render(self, content: Any) -> bytes:
        return json_text(content).encode("ascii")



def clip(text: str, limit: int = 80) -> str:
    """A client-supplied string, short enough to quote in an error message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _param_of(loc) -> Optional[str]:
    """('messages', 0, 'content', 'str') -> 'messages.0.content' (union-branch tags dropped)."""
    parts = []
    for x in loc:
        if isinstance(x, int):
            parts.append(str(x))
        elif isinstance(x, str) and x.isidentifier() and x.lower() not in _TYPE_TAGS and x != "body":
            parts.append(x)
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> APIError:
    problems, params = [], []
    for err in errors[:8]:
        param = _param_of(err.get("loc", ()))
        if param not in params:
            params.append(param)
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        problems.append(f"{param or 'body'}: {err.get('msg')} (got {got})")
    kind = str(errors[0].get("type", "")) if errors else ""
    code = "invalid_type" if kind.endswith("_type") else \
        "missing_required_parameter" if kind == "missing" else "invalid_value"
    # a union reports one error per branch; the first few say enough
    return APIError(400, "; ".join(problems[:4]), code=code, param=params[0] if params else None)


# ---------------------------------------------------------------------------------------------
# request bodies
# ---------------------------------------------------------------------------------------------


def _engine_bound(name: str, kind: type) -> Any:
    """`kind` with SamplingParams' constraints on its field `name` (the bound is written there)."""
    return Annotated[(kind, *SamplingParams.model_fields[name].metadata)]


_Temperature = _engine_bound("temperature", float)
_TopP = _engine_bound("top_p", float)
_Seed = _engine_bound("seed", int)  # choice i samples with seed + i (checked when parsed)
_TopK = _engine_bound("top_k", int)  # the engine also refuses top_k > vocabulary
_MaxTokens = _engine_bound("max_tokens", int)
_Logprobs = _engine_bound("logprobs", int)
_TokenId = typing.get_args(SamplingParams.model_fields["stop_token_ids"].annotation)[0]
_StopString = typing.get_args(SamplingParams.model_fields["stop"].annotation)[0]
_StopStrings = Annotated[(list[_StopString], *SamplingParams.model_fields["stop"].metadata)]


class _Body(BaseModel):
    """Unknown fields are ignored; known ones must have the right JSON type (strict: "5" is not 5);
    floats must be finite (Python's json accepts NaN and Infinity)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _lift_extra_body(cls, data: Any) -> Any:
        # the openai client merges `extra_body` into the top level; raw clients may nest it
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            data = {**data["extra_body"], **{k: v for k, v in data.items() if k != "extra_body"}}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str
    temperature: Optional[_Temperature] = None
    top_p: Optional[_TopP] = None
    n: int = Field(1, ge=1, le=64)
    stop: Union[_StopString, _StopStrings, None] = None
    seed: Optional[_Seed] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None  # refused unless empty (not applied by this server)
    user: Optional[str] = None
    # extensions (vLLM-style)
    speculative: bool = True
    calibrate: bool = True  # false: this request's verify rounds never teach the drafter (online calibration)
    top_k: Optional[_TopK] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[_TokenId]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)


class DrafterRollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: Optional[int] = Field(None, ge=0)  # None: the original, uncalibrated weights


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[_MaxTokens] = None  # not given: 16, capped to what the context has left
    logprobs: Optional[_Logprobs] = None  # the top alternatives per token
    echo: bool = False  # the prompt before the completion (with its log-probabilities when logprobs is set)
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[_MaxTokens] = None
    max_completion_tokens: Optional[_MaxTokens] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[_Logprobs] = None
    tools: Optional[list] = None
    response_format: Optional[dict] = None


# ---------------------------------------------------------------------------------------------
# parsing untrusted bodies
# ---------------------------------------------------------------------------------------------


def _path(parts) -> Optional[str]:
    return ".".join(clip(str(p), 40) for p in parts) or None


def _utf8_ok(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" is legal JSON)
        return False
    return True


# lists with a bound of their own, smaller than the body's (top level, or inside extra_body): a list over it is
# refused naming that bound, the one the engine applies
FIELD_MAX_ITEMS = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS}


def _max_items(where: tuple, max_items: int) -> int:
    top = len(where) == 1 or (len(where) == 2 and where[0] == "extra_body")
    return min(FIELD_MAX_ITEMS.get(where[-1], max_items), max_items) if top else max_items


def check_json(data: Any, max_items: int, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Bound the nesting depth and the length of lists (FIELD_MAX_ITEMS: the fields with a bound of
    their own), and refuse strings UTF-8 cannot carry, naming the field. Iterative: no recursion,
    whatever the input."""
    stack = [(data, 1, ())]
    while stack:
        node, depth, where = stack.pop()
        if depth > max_depth:
            raise APIError(400, f"the request body nests deeper than {max_depth} levels (at {_path(where)})",
                           code="invalid_json", param=_path(where))
        if isinstance(node, list) and len(node) > (limit := _max_items(where, max_items)):
            raise APIError(400, f"{_path(where) or 'body'}: {len(node)} items; at most {limit}",
                           code="invalid_value", param=_path(where))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and not _utf8_ok(key):
                raise APIError(400, f"{_path(where) or 'body'}: a key is not valid Unicode (a lone surrogate "
                                    "such as \\ud800); send UTF-8 text", code="invalid_value", param=_path(where))
            if isinstance(value, str):
                if not _utf8_ok(value):
                    param = _path((*where, key))
                    raise APIError(400, f"{param}: not valid Unicode (it holds a lone surrogate such as \\ud800); "
                                        "send UTF-8 text", code="invalid_value", param=param)
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, (*where, key)))


def load_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, f"the request body nests too deeply; at most {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError:  # e.g. an integer literal of more than 4300 digits
        raise APIError(400, "the request body holds a number too long to read", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_type")
    return data


def _truncate_lists(node: Any, keep: int) -> Any:
    """A copy with every list cut to its first `keep` items (the body is at most 64 levels deep)."""
    if isinstance(node, dict):
        return {k: _truncate_lists(v, keep) for k, v in node.items()}
    if isinstance(node, list):
        return [_truncate_lists(v, keep) for v in node[:keep]]
    return node


def validate(model_cls, data: dict):
    """model_cls.model_validate, with a 400 naming the first problems. Listing every problem of a
    list with hundreds of thousands of bad items takes seconds: past 20,000 problems, the first
    ones are found again in a copy with short lists."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        count = e.error_count()
        if count <= 20_000:
            raise validation_error(e.errors(include_url=False)) from None
    try:
        model_cls.model_validate(_truncate_lists(data, 8))
    except ValidationError as e:
        first = validation_error(e.errors())
        raise APIError(400, f"{count} problems, among them: {first.message}", code=first.code,
                       param=first.param) from None
    raise APIError(400, f"the request body has {count} invalid values (deep inside a list); check the types "
                        "of the list items", code="invalid_value")


