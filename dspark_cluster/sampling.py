"""Per-request sampling parameters, and batched sampling over them.

Seeded requests draw their noise from a generator keyed by (seed, output position), so a token
depends only on the request and where it is, not on batch composition, preemption or replays.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import RequestError

INT64_MAX = 2**63 - 1  # seeds, top_k and token ids travel to the workers as int64 tensors
MAX_TOKENS_LIMIT = 2**31


MAX_STOP_STRINGS, MAX_STOP_CHARS = 32, 2048  # stop strings are checked against the text at every token
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's top_logprobs bound)

# A temperature below this is greedy: sampling at T is computed as its limit T -> 0, the argmax. Why this
# bound: logits / T overflows fp32 (3.4e38) once T is below ~1e-37 for ordinary logits, and softmax of
# inf - inf is NaN; long before that the law is already the argmax's in fp32: at T = 1e-5 a logit gap of
# 1e-3 (below bf16's resolution of logits near 10) weighs the runner-up by exp(-100) ~ 4e-44, under fp32's
# smallest normal number. 1e-5 is also vLLM's _SAMPLING_EPS, so clients see the same rule there and here.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(BaseModel):
    """How one request samples. temperature 0 is greedy (so is any temperature below GREEDY_TEMPERATURE,
    stored as 0); top_k 0 and top_p 1 disable the filters; the top token is always in the nucleus,
    however small top_p."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # floats must be finite

    # every bound is what the engine can represent: the step input carries these as int64 / fp32
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=INT64_MAX)
    seed: Optional[int] = Field(None, ge=0, le=INT64_MAX)
    stop_token_ids: tuple[Annotated[int, Field(ge=0, le=INT64_MAX)], ...] = ()
    # stop strings: the output ends at the first one (not included), checked as its text is made
    stop: tuple[Annotated[str, Field(max_length=MAX_STOP_CHARS)], ...] = Field((), max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    speculative: bool = True  # per-request switch for speculative decoding
    calibrate: bool = True  # this request's verify rounds may teach the drafter (online calibration)
    # log-probabilities (of the target's law after temperature, before top-k / top-p): each output token's, with
    # the `logprobs` most likely alternatives; prompt_logprobs: the same for each prompt token after the first
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # per-request k (capped by the config's)
    num_speculative_tokens: Optional[int] = Field(None, ge=0, le=MAX_TOKENS_LIMIT)

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, t: float) -> float:
        # stored as 0.0, so every part that reads it (the step, the drafters, verification) is greedy alike
        return 0.0 if t < GREEDY_TEMPERATURE else t

    def __init__(self, **kwargs):
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            problems = []
            for err in e.errors():
                field = ".".join(str(x) for x in err["loc"])
                problems.append(f"SamplingParams.{field}: got {err.get('input')!r}; {err['msg']}")
            raise RequestError("; ".join(problems)) from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def greedy_rows(temperature: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows whose temperature is greedy (below GREEDY_TEMPERATURE, 0 included)."""
    return temperature < GREEDY_TEMPERATURE


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Temperature, top-k and top-p applied per row. logits [B, V] fp32; temperature/top_p [B]
    float, top_k [B] long (0 = off), all three on the logits' device (a CPU tensor beside CUDA
    logits raises). Greedy rows (`greedy_rows`) are left unscaled. The nucleus always keeps each
    row's top token (a top_p that rounds to 0 in fp32 keeps just that one). Returns the processed
    logits, -inf outside each row's nucleus; softmax of them is the sampling law."""
    temp = torch.where(greedy_rows(temperature), torch.ones_like(temperature), temperature)
    logits = logits / temp[:, None]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
        remove |= torch.arange(V, device=logits.device)[None, :] >= k[:, None]
    if need_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        remove[:, 0] = False  # the most likely token is always in the nucleus (top_p may be 0 in fp32)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


# What a seeded draw is for: each (seed, output position, purpose) has its own stream, so a request's
# draws do not depend on the batch, and no two draws of one request share a stream.
SAMPLE, ACCEPT, RESIDUAL, DRAFT = 0, 1, 2, 3  # target sampling; verification's uniforms, its residual /
# bonus token; a drafter's proposal (the draft-model and DSpark proposers)


def seeded_generator(seed: int, position: int, purpose: int, device) -> torch.Generator:
    """The generator for one draw of a seeded request: keyed by a hash of (seed, position, purpose),
    so distinct keys get unrelated streams. torch's CPU generator keeps only a seed's low 32 bits
    (CUDA's keeps all 64): the hash mixes every input bit into those too."""
    key = b"".join(int(v).to_bytes(8, "little", signed=True) for v in (seed, position, purpose))
    digest = hashlib.blake2b(key, digest_size=8, person=b"dspark-seed").digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest, "little") & INT64_MAX)
    return g


def race_sample(probs: torch.Tensor, seeds=(), positions=(), purpose: int = SAMPLE) -> torch.Tensor:
    """One index per row of probs [N, V], drawn exactly from the row: the exponential race
    argmax(p / E), E ~ Exp(1). seeds, positions: per-row Python ints (seed -1: unseeded; empty: none
    seeded); a seeded row's noise comes from `seeded_generator(seed, position, purpose)`, unseeded
    rows' from the global generator. Every tensor lives on probs' device. Returns [N] long."""
    noise = torch.empty_like(probs).exponential_()
    for i, seed in enumerate(seeds):
        if seed >= 0:
            g = seeded_generator(seed, positions[i], purpose, probs.device)
            noise[i] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def sample(logits, temperature, top_k, top_p, seeds, positions):
    """Sample one token per row. logits [B, V] fp32; seeds [B] long (-1 = unseeded); positions [B]
    long (index of the token being generated, for seeding); every argument on the logits' device.
    Greedy rows (`greedy_rows`) take the argmax; the others `race_sample`. Returns token ids [B] long."""
    greedy = greedy_rows(temperature)
    argmax = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return argmax
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    any_seeded = bool((seeds >= 0).any())
    # one read of the seeds and positions (on a GPU each element read is a sync)
    seed_of, pos_of = (seeds.tolist(), positions.tolist()) if any_seeded else ((), ())
    sampled = race_sample(probs, seed_of, pos_of, SAMPLE)
    return torch.where(greedy, argmax, sampled)
