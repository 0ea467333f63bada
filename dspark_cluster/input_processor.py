"""A request's input, checked and tokenised once: prompt (text or token ids) and sampling
parameters in, a `Sequence` for the scheduler out, or one `RequestError` naming what is wrong.
The engine holds one; the server and `LLM` reach it through the engine."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Optional, Union

from .errors import CheckpointError, PromptError, PromptTooLongError, RequestError
from .model.spec import ModelSpec, ignore_remote_code
from .sampling import SamplingParams
from .sequence import Sequence


def load_tokenizer(path) -> Optional[object]:
    """The checkpoint's tokenizer, or None when it ships none (then prompts must be token ids)."""
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    remote = ignore_remote_code(p, "tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)
    except ValueError as e:
        if not remote:
            raise CheckpointError(f"{p}: the tokenizer cannot be loaded: {e}") from None
        raise CheckpointError(
            f"{p}/tokenizer_config.json: 'auto_map' names the checkpoint's own tokenizer code and transformers has no "
            "built-in class for it; DSpark never runs remote code (trust_remote_code=False). Ship a tokenizer.json "
            "(a fast tokenizer), or set model.tokenizer to a folder with one") from None


class InputProcessor:
    """tokenizer: the checkpoint's (None: token ids only). kv_capacity: tokens the KV pool holds
    (set again when restarted workers plan a different pool)."""

    def __init__(self, tokenizer, spec: ModelSpec, max_model_len: int, kv_capacity: int):
        self.tokenizer = tokenizer
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = spec.eos_token_ids
        self.max_model_len = max_model_len
        self.kv_capacity = kv_capacity

    def encode(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("prompt: got text, but the checkpoint has no tokenizer; pass token ids (list[int])")
            return list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise PromptError(f"prompt: got {type(prompt).__name__}; expected a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def make_sequence(self, prompt, params: Optional[SamplingParams] = None,
                      request_id: Optional[str] = None, resume: Optional[list[int]] = None) -> Sequence:
        """Validation without touching the scheduler (safe from another thread). resume: output
        tokens the request already produced (and its reader received) before its engine was lost;
        the sequence continues after them (a new Router re-submits what an old one had in flight)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params: got {type(params).__name__}; expected SamplingParams")
        if params.top_k > self.vocab_size:
            raise RequestError(f"top_k: got {params.top_k}; at most the vocabulary size {self.vocab_size} "
                               "(0 = no top-k filter)")
        ids = self.encode(prompt)
        if not ids:
            raise PromptError("prompt: empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt: {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                "(prompt plus at least one new token); shorten the prompt or raise scheduler.max_model_len"
            )
        if len(ids) + 1 > self.kv_capacity:
            raise PromptError(
                f"prompt: {len(ids)} tokens do not fit the KV cache ({self.kv_capacity} tokens); "
                "raise scheduler.kv_cache_memory or num_kv_blocks"
            )
        done = self.encode(list(resume)) if resume else []
        if done and len(ids) + len(done) >= min(self.max_model_len, len(ids) + params.max_tokens):
            raise RequestError(f"resume: {len(done)} output tokens already reach the request's end "
                               f"(max_tokens {params.max_tokens}, max_model_len {self.max_model_len}); nothing to resume")
        if done and len(ids) + len(done) + 1 > self.kv_capacity:
            raise PromptError(f"resume: {len(ids)} prompt + {len(done)} output tokens do not fit the KV cache "
                              f"({self.kv_capacity} tokens)")
        return Sequence(request_id or uuid.uuid4().hex, ids + done, len(ids), params, self.eos_token_ids)
