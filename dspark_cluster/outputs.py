"""What a request gives back, and how its text is made. One shape crosses every boundary on the way
out: `StreamPiece`, what one step added to one request, made in the engine's step thread where the
tokens are produced (text, stop strings, log-probability token texts: once). Each step's pieces go
to a reader's event loop as one batch, and over Ray as one object per client. `RequestOutput` (a
whole request) is its pieces folded (`request_output`). Before them, `TokenEvent` is the engine's
record of a step's tokens; it holds the engine's Sequence, so it never leaves the engine's thread.

Text costs O(1) per token (tokenizers' `DecodeStream` over the fast tokenizer) instead of a decode
of the whole output at every step; the last piece flushes what the stream held back (an incomplete
UTF-8 sequence), so the full text equals `tokenizer.decode(output_ids, skip_special_tokens=True)`.
A stop string ends the request in the step that completed it (no abort round trip from a client):
the text is cut before it, and the last `len(longest stop) - 1` characters are held back until
they cannot begin one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenizers.decoders import DecodeStream


@dataclass
class TokenEvent:
    """What one request gained in one step (the engine's output, before detokenisation)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]
    seq: object  # the engine's Sequence
    logprobs: Optional[list] = None  # a TokenLogprob per new token (SamplingParams.logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely alternatives at its position, best first."""

    token_id: int
    logprob: float
    top: tuple = ()  # ((token_id, logprob), ...)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    metrics: dict = field(default_factory=dict)
    logprobs: Optional[list] = None  # SamplingParams.logprobs: a TokenLogprob per output token
    prompt_logprobs: Optional[list] = None  # SamplingParams.prompt_logprobs: per prompt token (None first)


@dataclass
class StreamPiece:
    """New tokens of one request, as they are made; the last piece has `finished` set."""

    request_id: str
    token_ids: list[int]
    text: str  # text delta (complete characters only; a stop string and what follows it never appear)
    finished: bool = False
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None  # a TokenLogprob per token of this piece (SamplingParams.logprobs)
    prompt_logprobs: Optional[list] = None  # on the first piece, with SamplingParams.prompt_logprobs
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # with SamplingParams.logprobs and a fast tokenizer: the text each token adds to the output's
    # (one DecodeStream step each; "" for a token that ends inside a character), for log-probability
    # entries, so that no reader decodes the tokens again
    token_texts: Optional[list] = None
    # on the last piece: what a whole RequestOutput holds beyond its pieces
    prompt_token_ids: Optional[list] = None
    metrics: Optional[dict] = None


def request_output(pieces: list[StreamPiece]) -> RequestOutput:
    """A whole request from its pieces, in order (the last one finished)."""
    first, last = pieces[0], pieces[-1]
    # a request that asked for log-probabilities has a list on every piece (maybe empty)
    logprobs = None if first.logprobs is None else [e for p in pieces for e in p.logprobs or ()]
    return RequestOutput(request_id=last.request_id, prompt_token_ids=list(last.prompt_token_ids or ()),
                         token_ids=[t for p in pieces for t in p.token_ids], text="".join(p.text for p in pieces),
                         finish_reason=last.finish_reason, metrics=dict(last.metrics or {}), logprobs=logprobs,
                         prompt_logprobs=first.prompt_logprobs)


class Detokenizer:
    """Incremental text of one output. With a fast tokenizer each token is one DecodeStream step;
    otherwise (a slow tokenizer) the whole output is decoded again, as before."""

    def __init__(self, tokenizer, token_texts: bool = False):
        self.tokenizer = tokenizer
        self.emitted = ""  # the text given out so far
        # token_texts: keep each token's own piece of text (the last add()'s, in `token_texts`)
        self.want_token_texts = token_texts
        self.token_texts: Optional[list] = None
        self._ids: list[int] = []
        self._stream = None
        backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' fast tokenizers have one
        if backend is not None:
            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)

    def full(self, ids) -> str:
        if self.tokenizer is None:
            return ""
        # as DecodeStream makes it (no clean-up of spaces before punctuation), so the pieces add up to it
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int], final: bool) -> str:
        """The text these new tokens complete (the rest of the text, on the last call)."""
        if self.tokenizer is None:
            return ""
        self._ids += token_ids
        steps = None
        if self._stream is not None and (not final or self.want_token_texts):
            steps = [self._stream.step(self._backend, t) or "" for t in token_ids]
        self.token_texts = steps if self.want_token_texts else None
        if steps is not None and not final:
            new = "".join(steps)
        else:  # the last piece, or a slow tokenizer: from the whole output
            text = self.full(self._ids)
            if not final and text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                return ""
            new = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted += new
        return new


class StopStrings:
    """Stop strings over a request's text as it grows: `feed(new_text)` -> (text safe to give out
    now, whether a stop string ended the output)."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything received
        self.sent = 0  # characters of it given out

    def feed(self, new: str, final: bool) -> tuple[str, bool]:
        start = max(0, len(self.text) - self.hold)  # a stop may begin in the held-back tail
        self.text += new
        if self.stops:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i != -1]
            if hits:
                cut = min(hits)
                out, self.sent = self.text[self.sent : cut], cut
                return out, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], end
        return out, False


class OutputProcessor:
    """One request's output, fed by the engine's step thread: text deltas, and whether a stop
    string ended it."""

    def __init__(self, tokenizer, stops=(), token_texts: bool = False):
        self.detok = Detokenizer(tokenizer, token_texts)
        self.stops = StopStrings(stops) if stops else None
        self.text = ""  # the text given out (the output's, cut at a stop string)

    def add(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """-> (text delta, stopped by a stop string)."""
        new = self.detok.add(token_ids, final)
        stopped = False
        if self.stops is not None:
            new, stopped = self.stops.feed(new, final)
        self.text += new
        return new, stopped

    @property
    def token_texts(self) -> Optional[list]:
        """Each token's own text, of the last add() (with token_texts=True and a fast tokenizer)."""
        return self.detok.token_texts
