"""Log-probabilities in OpenAI's shapes (/v1/completions' and /v1/chat/completions'), with each
token's text as it adds to the choice's text."""

from __future__ import annotations

import functools
from typing import Optional

from tokenizers.decoders import DecodeStream

# The floor of a log-probability in a response: a token of probability 0 (log -inf) is shown as -9999.0,
# as vLLM's OpenAI server does (JSON has no -Infinity; clients read -9999.0 as "impossible"). A NaN is
# left as it is: the encoder refuses it (openai_protocol.json_text), so a bug shows as an error.
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    """A log-probability as a response shows it: at least MIN_LOGPROB."""
    return MIN_LOGPROB if logprob < MIN_LOGPROB else logprob


class LogprobFormat:
    """Over the client's tokenizer (None: tokens are shown as token_id:N)."""

    def __init__(self, client):
        self.client = client
        self.token_str = functools.lru_cache(maxsize=1 << 16)(self._token_str)

    def _token_str(self, token_id: int) -> str:
        """A token's text on its own (the alternatives in top_logprobs), decoded once per id."""
        tok = self.client.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    def token_texts(self):
        """For one choice: ids -> the text each token adds to the choice's text so far (a DecodeStream
        kept across calls, so the pieces concatenate to the text; a token that ends inside a
        multi-byte character adds "", the next one the character)."""
        backend = getattr(self.client.tokenizer, "backend_tokenizer", None)  # transformers' fast tokenizers
        if backend is None:
            return lambda ids: [self.token_str(t) for t in ids]
        stream = DecodeStream(skip_special_tokens=True)
        return lambda ids: [stream.step(backend, t) or "" for t in ids]

    @staticmethod
    def made_texts(made: Optional[list], own):
        """The tokens' texts as the output path made them (its DecodeStream over the output, where
        the tokens were produced: StreamPiece.token_texts), or else (a slow tokenizer) `own`."""
        return own if made is None else (lambda ids: made)

    def completion(self, texts, token_ids: list[int], entries: list, offset: int = 0) -> dict:
        """/v1/completions' logprobs: tokens, token_logprobs, top_logprobs (the top alternatives and
        the chosen token, as vLLM gives them), text_offset. texts: the choice's token_texts();
        entries: a TokenLogprob per token, None for a prompt's first (nothing predicts it)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e, s in zip(token_ids, entries, texts(token_ids)):
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            out["token_logprobs"].append(None if e is None else finite(e.logprob))
            top = None if e is None else {**{self.token_str(t): finite(lp) for t, lp in e.top}, s: finite(e.logprob)}
            out["top_logprobs"].append(top)
        return out

    def chat(self, texts, entries: list) -> dict:
        """/v1/chat/completions' logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def one(s: str, logprob: float) -> dict:
            return {"token": s, "logprob": finite(logprob), "bytes": list(s.encode("utf-8"))}

        return {"content": [{**one(s, e.logprob), "top_logprobs": [one(self.token_str(t), lp) for t, lp in e.top]}
                            for e, s in zip(entries, texts([e.token_id for e in entries]))]}
