"""A request's state inside the scheduler."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from .sampling import SamplingParams

_ids = itertools.count()


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by the output so far
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple = ()
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or is being computed by a step in flight)
    # tokens sampled by a step in flight, not yet known here (async scheduling: at most 1); they count
    # in num_tokens so that the next step can be scheduled before they arrive
    num_pending: int = 0
    finish_reason: Optional[str] = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_times: list = field(default_factory=list)  # time each output token was produced
    finish_time: Optional[float] = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # SamplingParams.logprobs: one TokenLogprobs per output token; prompt_logprobs: one per prompt token
    # (None for the first, which nothing predicts), filled by position (a recomputed chunk rewrites the same)
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: Optional[list] = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append(self, token: int, max_model_len: int, now: float) -> bool:
        """Add a generated token; returns True when the request is finished by it."""
        self.token_ids.append(token)
        self.token_times.append(now)
        p = self.params
        if not p.ignore_eos and token in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token in p.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_output_tokens >= p.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def done_when_pending_arrive(self, max_model_len: int) -> bool:
        """The tokens in flight will end this request by length: nothing more to schedule for it."""
        return self.num_pending > 0 and (self.num_output_tokens + self.num_pending >= self.params.max_tokens
                                         or self.num_tokens >= max_model_len)

    def metrics(self) -> dict:
        first = self.token_times[0] if self.token_times else None
        end = self.finish_time or (self.token_times[-1] if self.token_times else None)
        n = len(self.token_times)
        return {
            "arrival_time": self.arrival_time,
            "ttft_s": (first - self.arrival_time) if first is not None else None,
            "tpot_s": ((self.token_times[-1] - first) / (n - 1)) if n > 1 else 0.0,
            "e2e_s": (end - self.arrival_time) if end is not None else None,
            "itl_s": [b - a for a, b in zip(self.token_times, self.token_times[1:])],
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_preemptions": self.num_preemptions,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
        }
