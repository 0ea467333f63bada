"""What the simulation draws instead of computing: the requests (the config's workload, or a trace
of arrivals and lengths with shared-prefix groups), the experts each step's tokens are routed to
(Zipf per layer with a skew, hot sets that drift, or the loads a real run recorded), and how many
drafts survive verification (a survival curve by position, with a spread between rows)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..workload import make_workload


@dataclass
class SimRequest:
    arrival_s: float
    prompt_ids: list[int]
    params: SamplingParams
    prompt: object = None  # the workload's prompt, when it is text (tokenised by the engine's tokenizer)


def _ids(rng, n: int, vocab: int) -> list[int]:
    if isinstance(rng, np.random.Generator):
        return rng.integers(2, vocab, max(0, n)).tolist()
    return [rng.randrange(2, vocab) for _ in range(n)]


def read_trace(path, vocab_size: int, seed: int = 0, temperature: float = 0.0) -> list[SimRequest]:
    """A JSONL trace, one request a line: {"arrival_s", "prompt_len", "output_len"} and optionally
    {"prefix_group", "prefix_len"}: requests of one group share their first prefix_len tokens (a
    system prompt, a conversation's history), which is what prefix caching reuses."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace: got {str(path)!r}; no such JSONL file")
    rng = np.random.default_rng(seed)  # numpy: a trace's millions of prompt tokens in a second
    prefixes: dict = {}
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            arrival, plen, olen = float(r["arrival_s"]), int(r["prompt_len"]), int(r["output_len"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"trace: {path}:{n} needs arrival_s, prompt_len and output_len") from None
        ids = []
        group = r.get("prefix_group")
        if group is not None:
            k = min(int(r.get("prefix_len", plen)), plen)
            base = prefixes.setdefault(group, _ids(rng, k, vocab_size))
            ids = base[:k] + _ids(rng, k - len(base[:k]), vocab_size)
        ids += _ids(rng, plen - len(ids), vocab_size)
        out.append(SimRequest(arrival, ids, SamplingParams(max_tokens=olen, temperature=temperature, ignore_eos=True)))
    out.sort(key=lambda q: q.arrival_s)
    return out


def workload_requests(cfg, vocab_size: int, tokenizer=None, encode=None) -> list[SimRequest]:
    """The config's workload as a real run draws it (workload.make_workload: the same seeds, lengths
    and arrivals); text prompts are tokenised by `encode` (the engine's InputProcessor.encode), or
    without a tokenizer (a config.json alone) stand in as ~4 characters a token."""
    out = []
    rng = random.Random(cfg.workload.seed + 1)
    for w in make_workload(cfg.workload, vocab_size):
        if isinstance(w.prompt, str):
            ids = encode(w.prompt) if encode is not None else _ids(rng, max(1, len(w.prompt) // 4), vocab_size)
        else:
            ids = list(w.prompt)
        out.append(SimRequest(w.arrival_s, ids, w.params, w.prompt))
    return out


class ExpertTraffic:
    """Token-expert assignments per MoE layer and step: counts [L, E] drawn multinomially from
    per-layer expert probabilities. kind zipf: expert of rank i (a random order per layer) has
    weight 1 / (i + 1)^skew (skew 0: uniform); drift_every_steps > 0 re-draws the order of a
    drift_share of the experts that often (hot sets that move). kind report: the probabilities of
    a run's recorded loads (report.json experts.expert_load_total)."""

    def __init__(self, num_layers: int, num_experts: int, kind: str = "zipf", skew: float = 0.0,
                 drift_every_steps: int = 0, drift_share: float = 0.25, report: Optional[str] = None,
                 hot_experts=(), hot_bias: float = 0.0, seed: int = 0):
        self.L, self.E = num_layers, num_experts
        self.rng = np.random.default_rng(seed)
        self.kind, self.skew = kind, skew
        self.drift_every, self.drift_share = drift_every_steps, drift_share
        self.steps = 0
        if kind == "report":
            if not report:
                raise ConfigError("expert_load.report: kind 'report' needs the path of a run's report.json")
            total = np.asarray(json.loads(Path(report).read_text())["experts"]["expert_load_total"], dtype=np.float64)
            if total.shape[1] != num_experts:
                raise ConfigError(f"expert_load.report: {report} has {total.shape[1]} experts; the model has "
                                  f"{num_experts}")
            reps = -(-num_layers // total.shape[0])  # a smaller model's layers repeat over a larger one's
            self.probs = np.tile(total, (reps, 1))[:num_layers] + 1e-9
        else:
            self.weights = 1.0 / np.arange(1, num_experts + 1) ** skew
            self.order = np.argsort(self.rng.random((num_layers, num_experts)), axis=1)
            self.probs = np.empty((num_layers, num_experts))
            np.put_along_axis(self.probs, self.order, np.broadcast_to(self.weights, self.order.shape), axis=1)
        if hot_experts and hot_bias:  # workload.hot_experts: a gate-logit bias, so e^bias more weight
            self.probs[:, list(hot_experts)] *= math.exp(hot_bias)
        self.probs /= self.probs.sum(axis=1, keepdims=True)

    def _drift(self) -> None:
        n = max(2, int(self.drift_share * self.E))
        for layer in range(self.L):
            pick = self.rng.choice(self.E, n, replace=False)
            self.probs[layer, pick] = self.probs[layer, self.rng.permutation(pick)]

    def sample(self, assignments: int) -> np.ndarray:
        """[L, E] int64 counts of `assignments` token-expert pairs per layer (tokens x top_k)."""
        self.steps += 1
        if self.drift_every and self.kind == "zipf" and self.steps % self.drift_every == 0:
            self._drift()
        if assignments <= 0:
            return np.zeros((self.L, self.E), dtype=np.int64)
        if assignments < 64 * self.E:
            return self.rng.multinomial(int(assignments), self.probs)
        # many tokens per expert: the multinomial's normal limit (mean n p, variance n p (1 - p)), ~10x
        # cheaper than the exact draw at DeepSeek-V3 scale (58 layers x 256 experts, 10^5 assignments a step)
        mean = assignments * self.probs
        counts = np.rint(mean + np.sqrt(mean * (1 - self.probs)) * self.rng.standard_normal(mean.shape))
        return np.maximum(counts, 0).astype(np.int64)


class Acceptance:
    """Draft survival: survival[j] = P(drafts 1..j+1 are all accepted). Each verify row draws its own
    conditional acceptance per position, logit(c_j) + N(0, spread) (easy and hard continuations);
    the drafter's confidence is that probability (a calibrated drafter), and the row's drafts are
    accepted up to the first failure. With sequence_spread, each sequence also carries an offset
    N(0, sequence_spread) in logit space that its confidences do not show (`truth`): a sequence harder
    or easier throughout than its drafts look, as live rounds are (the verify planner's sequence
    offsets learn it). Either noise moves the mean survival off `survival` (an average in logit space is not one
    in probability): the curve is the drafter's typical row, not the stream's mean."""

    def __init__(self, survival, spread: float = 0.5, seed: int = 0, sequence_spread: float = 0.0):
        s = np.clip(np.asarray(survival, dtype=np.float64), 1e-4, 1 - 1e-4)
        if s.ndim != 1 or not len(s) or np.any(np.diff(s) > 1e-9):
            raise ConfigError(f"acceptance.survival: got {list(survival)}; expected a non-increasing list in (0, 1)")
        # P(j accepted | all before it were); a flat stretch of the curve (s[j] = s[j-1]) is a certain
        # acceptance, kept just below 1 so that its logit stays finite
        self.cond = np.clip(np.concatenate([[s[0]], s[1:] / s[:-1]]), 1e-4, 1 - 1e-4)
        self.logit = np.log(self.cond) - np.log1p(-self.cond)
        self.spread = spread
        self.sequence_spread = sequence_spread
        self.offsets: dict[int, float] = {}  # seq_id -> its hidden offset (drawn at its first round; `forget`)
        self.rng = np.random.default_rng(seed)

    def draw(self, num_rows: int, k: int) -> np.ndarray:
        """[rows, k] conditional acceptance probabilities as the drafter's confidences read them (past the curve:
        its last position's)."""
        idx = np.minimum(np.arange(k), len(self.logit) - 1)
        z = self.logit[idx][None, :] + self.spread * self.rng.standard_normal((num_rows, k))
        return 1.0 / (1.0 + np.exp(-z))

    def truth(self, confidences: np.ndarray, seq_ids) -> np.ndarray:
        """confidences [rows, k] (`draw`), seq_ids [rows] -> the rows' true conditional acceptances: each row's moved
        by its sequence's offset in logit space (the confidences themselves where sequence_spread is 0)."""
        if not self.sequence_spread:
            return confidences
        for sid in seq_ids:
            if sid not in self.offsets:  # drawn at the sequence's first round
                self.offsets[sid] = float(self.sequence_spread * self.rng.standard_normal())
        d = np.array([self.offsets[sid] for sid in seq_ids])
        c = np.clip(confidences, 1e-9, 1 - 1e-9)
        return 1.0 / (1.0 + np.exp(-(np.log(c) - np.log1p(-c) + d[:, None])))

    def forget(self, seq_ids) -> None:
        for sid in seq_ids:
            self.offsets.pop(sid, None)

    def accepted(self, cond: np.ndarray, verified: np.ndarray) -> np.ndarray:
        """cond [rows, k], verified [rows] -> drafts accepted per row (the run of successes)."""
        ok = self.rng.random(cond.shape) < cond
        ok &= np.arange(cond.shape[1])[None, :] < verified[:, None]
        return np.where(ok.all(axis=1), verified, np.argmin(ok, axis=1)).astype(np.int64)


def survival_from_report(path) -> list[float]:
    """The acceptance by position a real run measured (report.json summary.speculative)."""
    spec = (json.loads(Path(path).read_text()).get("summary") or {}).get("speculative") or {}
    acc = spec.get("acceptance_by_position")
    if not acc:
        raise ConfigError(f"acceptance.report: {path} has no summary.speculative.acceptance_by_position")
    out, prev = [], 1.0
    for a in acc:  # accepted / proposed at each position; kept non-increasing (a survival curve)
        a = prev if a is None or (isinstance(a, float) and math.isnan(a)) else min(prev, float(a))
        out.append(a)
        prev = a
    return out
