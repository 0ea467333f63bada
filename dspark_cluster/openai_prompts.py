"""A request body read into token ids (in the HTTP thread pool: big bodies, chat templates and
tokenisation take a while): JSON checked and validated, the model and the unsupported fields
refused, text tokenised (a chat message's control strings as text: `PromptReader.template`), and
each choice's max_tokens fitted to the context. The prompt itself (empty, ids outside the
vocabulary, too long) is checked once, by the engine's InputProcessor; here only what must be
refused before that work: token-id lists and texts far over the context length."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Optional

from .openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_json, clip, load_json,
                              validate)
from .sampling import INT64_MAX

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def _can_sanitize(tokenizer_class: type) -> bool:
    """transformers' apply_chat_template(sanitize_control_tokens=True): control tokens in messages as text."""
    return "sanitize_control_tokens" in inspect.signature(tokenizer_class.apply_chat_template).parameters


class PromptReader:
    """For one served model: `completion(body)` and `chat(body)` give the validated request and its
    prompts as token ids, or raise an APIError."""

    def __init__(self, client, served_model_name: str, max_model_len: int):
        self.client, self.served_model_name, self.max_model_len = client, served_model_name, max_model_len

    def parse(self, body: bytes, model_cls):
        """JSON -> a validated request body (in the pool: big bodies take a while)."""
        data = load_json(body)
        p = data.get("prompt")
        if isinstance(p, list) and len(p) >= self.max_model_len and type(p[0]) is int:
            raise self.too_long(str(len(p)), "prompt")  # token ids: no need to look at each
        check_json(data, max_items=max(self.max_model_len, 4096))
        req = validate(model_cls, data)
        if req.model != self.served_model_name:
            raise APIError(404, f"the model '{clip(req.model)}' does not exist; this server serves "
                                f"'{self.served_model_name}'", code="model_not_found", param="model")
        if req.logit_bias:
            raise APIError(400, "logit_bias: not supported by this server; leave it out", param="logit_bias",
                           code="unsupported_parameter")
        if req.presence_penalty or req.frequency_penalty:
            param = "presence_penalty" if req.presence_penalty else "frequency_penalty"
            raise APIError(400, f"{param}: not supported by this server; leave it at 0", param=param,
                           code="unsupported_parameter")
        if req.seed is not None and req.seed > INT64_MAX - (req.n - 1):
            raise APIError(400, f"seed: {req.seed} with n={req.n}: choice i samples with seed + i, which must stay "
                                f"at most 2**63 - 1; use a seed of at most {INT64_MAX - (req.n - 1)}",
                           param="seed", code="invalid_value")
        return req

    def tokenizer_or_400(self, what: str):
        tok = self.client.tokenizer
        if tok is None:
            raise APIError(400, f"{what} needs a tokenizer, but the checkpoint ships none; "
                                "send token ids to /v1/completions instead", param="prompt")
        return tok

    def too_long(self, n: str, param: str) -> APIError:
        return APIError(
            400,
            f"{param}: {n} tokens, but this model's maximum context length is {self.max_model_len} "
            "(the prompt plus at least one new token); shorten the prompt",
            code="context_length_exceeded", param=param,
        )

    def max_tokens(self, requested: Optional[int], param: str, num_prompt_tokens: int,
                   default: Optional[int] = None) -> int:
        """A choice's max_tokens, as vLLM's server gives it: when asked for, it must fit the context
        with the prompt (else a 400 naming both numbers); when not, `default` (None: no bound) capped
        to what the context has left. A prompt that leaves no room is the engine's to refuse."""
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            return max(1, room if default is None else min(default, room))
        if room >= 1 and requested > room:
            raise APIError(
                400, f"{param}: {requested} is too large: this model's maximum context length is {self.max_model_len} "
                     f"tokens and the prompt has {num_prompt_tokens} ({num_prompt_tokens} + {requested} > "
                     f"{self.max_model_len}); ask for at most {room}, or leave {param} out to get what remains",
                code="context_length_exceeded", param=param)
        return requested

    def encode(self, tok, text: str, **kw) -> list[int]:
        try:
            return list(tok(text, **kw)["input_ids"])
        except RuntimeError as e:  # a fast tokenizer used from two threads while one reconfigures it
            if "borrow" not in str(e):
                raise
            return list(tok(text, **kw)["input_ids"])

    def refuse_far_too_long(self, tok, text: str, param: str, **kw) -> None:
        """A text far over the context length is refused after tokenising only its head (a token
        never spans the cut by more than a few ids; 16 are allowed)."""
        head_chars = max(64 * self.max_model_len, 1 << 16)
        if len(text) > head_chars:
            head = self.encode(tok, text[:head_chars], **kw)
            if len(head) >= self.max_model_len + 16:
                raise self.too_long(f"more than {len(head) - 16}", param)

    def tokenize(self, tok, text: str, param: str, **kw) -> list[int]:
        """Token ids of `text` (refused early when it is far over the context length)."""
        self.refuse_far_too_long(tok, text, param, **kw)
        return self.encode(tok, text, **kw)


    def completion(self, body: bytes) -> tuple[CompletionRequest, list[list[int]]]:
        """(in the pool) the validated request and its prompts as token ids."""
        req: CompletionRequest = self.parse(body, CompletionRequest)
        if req.suffix is not None:
            raise APIError(400, "suffix: not supported by this server", param="suffix", code="unsupported_parameter")
        if req.best_of not in (None, 1, req.n):
            raise APIError(400, "best_of: not supported by this server (use n)", param="best_of",
                           code="unsupported_parameter")
        p = req.prompt
        num_prompts = len(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else 1
        if num_prompts * req.n > 256:
            raise APIError(400, f"{num_prompts} prompts x n={req.n}: at most 256 choices per request", param="n")
        if isinstance(p, str):
            texts = [p]
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)
        else:
            texts = None
        if texts is not None:
            tok = self.tokenizer_or_400("a text prompt")
            prompts = [self.tokenize(tok, t, "prompt" if len(texts) == 1 else f"prompt.{k}")
                       for k, t in enumerate(texts)]
        elif p and isinstance(p[0], list):
            prompts = [list(x) for x in p]
        else:
            prompts = [list(p)]
        return req, prompts


    def chat(self, body: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        """(in the pool) the validated request and its templated prompt as token ids."""
        req: ChatCompletionRequest = self.parse(body, ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: set logprobs to true to use it", param="top_logprobs",
                           code="invalid_value")
        if req.tools:
            raise APIError(400, "tools: not supported by this server", param="tools", code="unsupported_parameter")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format: only {'type': 'text'} is supported", param="response_format",
                           code="unsupported_parameter")
        tok = self.tokenizer_or_400("chat")
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt",
                           param="messages", code="no_chat_template")
        messages = []
        for k, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages.{k}.content: only text parts are supported, "
                                            f"got {clip(part.type)!r}",
                                       param=f"messages.{k}.content", code="unsupported_content")
                    texts.append(part.text)
                content = "".join(texts)
            msg = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        text = self.template(tok, messages, tokenize=False)
        self.refuse_far_too_long(tok, text, "messages", add_special_tokens=False)
        return req, self.template(tok, messages, tokenize=True)

    @staticmethod
    def template(tok, messages: list[dict], tokenize: bool):
        """The chat template over `messages`: its text, or its token ids with every message string
        tokenised as text. A control token (the tokenizer's special tokens, and the added tokens the
        template writes: `<|endoftext|>`, `<|im_start|>`...) written in a message is encoded as the
        ordinary tokens of its text, so a client cannot forge a turn; the template's own control
        tokens stay control tokens (transformers' apply_chat_template(sanitize_control_tokens=True):
        it marks them in the messages before rendering and encodes the marked ones as text)."""
        if tokenize and not _can_sanitize(type(tok)):
            raise APIError(500, "this server's transformers cannot keep chat messages apart from the template's "
                                "control tokens; upgrade transformers", type="server_error", code="internal_error")
        kw = {"tokenize": True, "return_dict": False, "sanitize_control_tokens": True} if tokenize else \
            {"tokenize": False}
        try:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, **kw)
        except Exception as e:  # noqa: BLE001 -- a template that refuses these messages
            logger.info("the chat template refused a request: %s: %s", type(e).__name__, e)
            raise APIError(400, f"messages: the chat template refused them: {clip(str(e), 200)}",
                           param="messages") from None
        return list(out) if tokenize else out

