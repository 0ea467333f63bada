"""Workloads: which requests arrive when. The bundled prompt set, a JSONL file, or synthetic ids."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from .config import ASSETS_DIR, WorkloadConfig, resolve_path
from .errors import ConfigError
from .sampling import SamplingParams

DEFAULT_PROMPTS = ASSETS_DIR / "prompts" / "heldout.jsonl"


@dataclass
class WorkloadRequest:
    arrival_s: float  # offset from the start of the run
    prompt: Union[str, list[int]]
    params: SamplingParams


def read_prompts(path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"workload.path: got {str(path)!r}; no such JSONL file (one {{\"prompt\": ...}} per line)")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                prompts.append(json.loads(line)["prompt"])
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"workload.path: {path}:{n} is not a JSON object with a 'prompt' key") from None
    if not prompts:
        raise ConfigError(f"workload.path: {path} holds no prompts")
    return prompts


def make_workload(cfg: WorkloadConfig, vocab_size: int) -> list[WorkloadRequest]:
    """Requests with Poisson arrivals at `request_rate` (0: all at time 0) and output lengths drawn
    uniformly from `output_len`. Synthetic prompts are random token ids with lengths from `prompt_len`."""
    rng = random.Random(cfg.seed)
    if cfg.kind == "synthetic":
        prompts = [
            [rng.randrange(2, vocab_size) for _ in range(rng.randint(*cfg.prompt_len))] for _ in range(cfg.num_requests)
        ]
    else:
        source = resolve_path(cfg.path) if cfg.path else DEFAULT_PROMPTS
        pool = read_prompts(source)
        prompts = [pool[i % len(pool)] for i in range(cfg.num_requests)]
    t = 0.0
    requests = []
    for i, prompt in enumerate(prompts):
        if cfg.request_rate > 0 and i:
            t += rng.expovariate(cfg.request_rate)
        params = SamplingParams(
            max_tokens=rng.randint(*cfg.output_len),
            temperature=cfg.temperature,
            seed=cfg.seed * 100_003 + i if cfg.temperature > 0 else None,
            ignore_eos=cfg.ignore_eos,
        )
        requests.append(WorkloadRequest(t, prompt, params))
    return requests
