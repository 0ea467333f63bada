"""Draft proposers behind one interface: `propose(requests) -> proposals`, `free(seq_ids)`.

- `NgramProposer`: prompt lookup. The longest recent n-gram that occurred earlier in the sequence
  proposes the tokens that followed it; no model, one-hot draft law.
- `DraftModelProposer`: a small HF causal LM sharing the target's vocabulary, with its own paged KV
  cache. Its KV follows the accepted tokens: before each proposal it keeps the longest prefix of
  what it has already computed that still matches the sequence, and recomputes the rest.
  With a `comm` (a drafter tensor-parallel group) it holds one shard and runs SPMD: every rank of
  the group gets the same calls, and TP rank 0 decides each draft token for the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..errors import ConfigError
from ..kv_cache import BlockManager, allocate_kv_cache, kv_bytes_per_block, plan_num_blocks
from ..model.attention import build_metadata
from ..model.compiled import resolve_compile
from ..model.loader import _shard_dim, load_model
from ..model.spec import ModelSpec, load_spec
from ..sampling import DRAFT, filter_logits, race_sample
from .compiled_draft import draft_buckets
from .dspark_model import draft_passes_of
from .dspark_proposer import DSparkProposer
from .records import Proposal


@dataclass
class DraftRequest:
    seq_id: int
    # the sequence's tokens (prompt + accepted output) from index `start` on: the whole sequence when
    # start is 0 (what a proposer always sees), else only those the drafter has not been sent yet
    token_ids: list[int]
    k: int  # how many tokens to propose at most (a proposal never has more)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = -1
    position: int = 0  # output index of the first drafted token (for seeding)
    start: int = 0  # index in the sequence of token_ids[0]

    @property
    def length(self) -> int:
        """The sequence's tokens (committed so far: the last is the anchor a block drafts after)."""
        return self.start + len(self.token_ids)

    @property
    def anchor(self) -> int:
        return self.token_ids[-1]


class DraftHistoryError(RuntimeError):
    """A request continues a sequence from past what the drafter holds of it (its history was lost)."""


class SequenceHistory:
    """The drafter's copy of each sequence's tokens, kept up to date by incremental DraftRequests.
    The rule: a request with start 0 carries the whole sequence (a sequence the drafter has not
    seen, or one the engine sends again whole); a request with start n > 0 continues the held
    tokens from index n (held tokens from n on are replaced). One that starts past the held tokens
    raises DraftHistoryError: the engine drops the drafter group, and the restarted group is sent
    every sequence whole."""

    def __init__(self):
        self.tokens: dict[int, list[int]] = {}

    def resolve(self, requests: list[DraftRequest]) -> list[DraftRequest]:
        """Take the requests' new tokens; return the requests with the whole sequences (start 0)."""
        out = []
        for r in requests:
            if r.start == 0:
                have = self.tokens[r.seq_id] = list(r.token_ids)
            else:
                have = self.tokens.get(r.seq_id)
                if have is None or len(have) < r.start:
                    raise DraftHistoryError(
                        f"sequence {r.seq_id}: a draft request continues from token {r.start}, but this drafter "
                        f"holds {0 if have is None else len(have)} of its tokens")
                del have[r.start:]
                have.extend(r.token_ids)
            out.append(replace(r, token_ids=have, start=0))
        return out

    def free(self, seq_ids) -> None:
        for sid in seq_ids:
            self.tokens.pop(sid, None)


class NgramProposer:
    def __init__(self, vocab_size: int, max_n: int = 4, min_n: int = 1):
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self._lookup(r.token_ids, r.k)) for r in requests]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        t = torch.tensor(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = t.unfold(0, n, 1)[:-1]  # every earlier n-gram (not the suffix itself)
            hits = torch.nonzero((windows == t[-n:]).all(dim=1)).flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # the most recent occurrence
                return tokens[start : start + k]
        return []

    def free(self, seq_ids) -> None:
        pass

    def prefill(self, requests: list[DraftRequest]) -> None:
        pass  # nothing to cache


@dataclass
class _DraftState:
    fed: list[int] = field(default_factory=list)  # tokens whose KV the drafter holds, in order


class DraftModelProposer:
    def __init__(self, path, target_spec: ModelSpec, dtype: str = "auto", device="cpu", block_size: int = 16,
                 kv_cache_memory: int = 64 * 2**20, max_batch_tokens: int = 2048, comm=None):
        """comm: this rank's drafter tensor-parallel group (tp_rank, tp_size, all_reduce, all_gather,
        broadcast), or None for a whole model in one process."""
        self.spec = load_spec(path, dtype)
        if self.spec.vocab_size != target_spec.vocab_size:
            raise ConfigError(
                f"speculative.draft_model: vocabulary {self.spec.vocab_size} != the target's "
                f"{target_spec.vocab_size}; the drafter must share the target's tokenizer"
            )
        self.device = torch.device(device)
        self.comm = comm
        self.tp_size = comm.tp_size if comm is not None else 1
        # Only TP rank 0 samples; the other ranks take its tokens (see propose).
        self.decides = comm is None or comm.tp_rank == 0
        self.model = load_model(path, self.spec, comm, device=self.device)
        self.block_size = block_size
        # Every rank of a TP group holds KV of the same shape, so each plans the same number of
        # blocks and its block manager makes the same choices for the same calls.
        num_blocks = plan_num_blocks(self.model, block_size, kv_cache_memory)
        allocate_kv_cache(self.model, num_blocks, block_size, self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.state: dict[int, _DraftState] = {}
        self.max_batch_tokens = max_batch_tokens
        # the dtype its draft law travels in (a 16-bit drafter's law is drawn from and shipped in 16 bits)
        self.law_dtype = self.model.lm_head.weight.dtype if self.model.lm_head.weight.is_floating_point() \
            else torch.float32

    def free(self, seq_ids) -> None:
        for sid in seq_ids:
            self.state.pop(sid, None)
            self.blocks.free(sid)

    def memory_report(self) -> dict:
        """Parameter bytes this rank holds: split ones (column / row / vocabulary-parallel layers,
        1/tp each) and replicated ones (norms, experts, ...), and what it read from the checkpoint."""
        split = replicated = 0
        for name, p in self.model.named_parameters():
            nbytes = p.numel() * p.element_size()
            if _shard_dim(self.model, name) is None:
                replicated += nbytes
            else:
                split += nbytes
        return {"param_bytes": split + replicated, "split_param_bytes": split,
                "replicated_param_bytes": replicated, "bytes_read": self.model.bytes_read,
                "reordered_bytes": getattr(self.model, "reordered_bytes", 0),  # the CPU's oneDNN copies (gemm.py)
                "kv_blocks": self.blocks.num_blocks,
                "kv_bytes": self.blocks.num_blocks * kv_bytes_per_block(self.model, self.block_size)}

    def _forward(self, chunks: list[tuple[int, list[int], int]]):
        """chunks: (seq_id, new tokens, tokens already cached) -> logits of each chunk's last token."""
        tables = [self.blocks.block_tables[sid] for sid, _, _ in chunks]
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(chunks), width, dtype=torch.long)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t)
        q = torch.tensor([len(c[1]) for c in chunks])
        ctx = torch.tensor([c[2] + len(c[1]) for c in chunks])
        positions, meta = build_metadata(q, ctx, bt, self.block_size)
        ids = torch.tensor([t for c in chunks for t in c[1]], device=self.device)
        hidden = self.model(ids, positions.to(self.device), meta.to(self.device, self.model.lm_head.weight.dtype))
        return self.model.compute_logits(hidden[(torch.cumsum(q, 0) - 1).to(self.device)])

    @torch.inference_mode()
    def prefill(self, requests: list[DraftRequest]) -> None:
        """Cache the drafter's KV for these sequences ahead of their first proposal (the router
        runs this while the target prefills the same prompts)."""
        todo = []
        for r in requests:
            st = self.state.setdefault(r.seq_id, _DraftState())
            if st.fed or not self.blocks.can_allocate(r.seq_id, len(r.token_ids)):
                continue
            self.blocks.allocate(r.seq_id, len(r.token_ids))
            todo.append(r)
        for i in range(0, len(todo), 16):  # bounded chunks keep the padded attention small
            part = todo[i : i + 16]
            self._forward([(r.seq_id, r.token_ids, 0) for r in part])
            for r in part:
                self.state[r.seq_id].fed = list(r.token_ids)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = {r.seq_id: Proposal([], None) for r in requests}
        active = []
        for r in requests:
            if r.k <= 0:
                continue
            st = self.state.setdefault(r.seq_id, _DraftState())
            common = 0  # roll back to the longest prefix still valid
            for a, b in zip(st.fed, r.token_ids):
                if a != b:
                    break
                common += 1
            st.fed = st.fed[: min(common, len(r.token_ids) - 1)]  # always re-feed the last token
            need = len(r.token_ids) + r.k - 1
            if not self.blocks.can_allocate(r.seq_id, need):
                continue  # no room in the drafter's cache: this sequence goes without drafts
            self.blocks.allocate(r.seq_id, need)
            active.append(r)
        if not active:
            return [out[r.seq_id] for r in requests]
        # catch up: feed every token not yet cached (the prompt at first, the accepted tokens later)
        chunks = [(r.seq_id, r.token_ids[len(self.state[r.seq_id].fed):], len(self.state[r.seq_id].fed)) for r in active]
        logits = self._forward(chunks)
        for r in active:
            self.state[r.seq_id].fed = list(r.token_ids)
        drafts = {r.seq_id: [] for r in active}
        probs = {r.seq_id: [] for r in active}  # sampled rows only: a greedy row ships no law
        tops = {r.seq_id: [] for r in active}
        for step in range(max(r.k for r in active)):
            dev = logits.device
            if self.decides:
                # the per-row parameters live where the logits do (a CPU tensor beside CUDA logits raises)
                temp = torch.tensor([r.temperature for r in active], device=dev)
                top_k = torch.tensor([r.top_k for r in active], dtype=torch.long, device=dev)
                top_p = torch.tensor([r.top_p for r in active], device=dev)
                law = filter_logits(logits, temp, top_k, top_p).softmax(-1)
                if self.law_dtype != law.dtype:  # the law it ships is the law it draws from
                    law = law.to(self.law_dtype).float()
                raced = race_sample(law, [r.seed for r in active], [r.position + step for r in active], DRAFT)
                tok = torch.where(temp == 0, logits.argmax(-1), raced)
                top = law.max(-1).values
                for i, r in enumerate(active):
                    tops[r.seq_id].append(top[i])
                    if r.temperature > 0:
                        probs[r.seq_id].append(law[i])
            else:  # filled by TP rank 0's broadcast (a device tensor: NCCL moves no CPU tensors)
                tok = torch.empty(len(active), dtype=torch.long, device=dev)
            if self.tp_size > 1:
                # Unseeded noise comes from each process's own global RNG, and nothing promises that
                # all-reduced logits agree to the last bit on every rank; yet the next forward must
                # feed the same tokens on every rank (its all-reduces mix them), so rank 0's choice
                # is the group's.
                tok = self.comm.broadcast(tok)
            tok = tok.tolist()
            for i, r in enumerate(active):
                drafts[r.seq_id].append(tok[i])
            still = [r for r in active if len(drafts[r.seq_id]) < r.k]
            if not still:
                break
            chunks = [(r.seq_id, [drafts[r.seq_id][-1]], len(self.state[r.seq_id].fed)) for r in still]
            logits = self._forward(chunks)
            for r in still:
                self.state[r.seq_id].fed.append(drafts[r.seq_id][-1])
            active = still
        for sid in drafts:
            # the other TP ranks have the same tokens but not their law: only rank 0's proposals count
            if self.decides:
                law = torch.stack(probs[sid]).to(self.law_dtype).cpu() if probs[sid] else None
                # confidence: the draft law's top probability at each position. Not the probability of
                # the drafted token itself: a verify budget that reads a token's own confidence would
                # decide from that token whether to verify it, which biases the output law.
                out[sid] = Proposal(drafts[sid], law, torch.stack(tops[sid]).cpu())
            else:
                out[sid] = Proposal(drafts[sid], None)
        return [out[r.seq_id] for r in requests]


def make_proposer(cfg, target_spec: ModelSpec, device="cpu", comm=None):
    """The proposer the config asks for, or None when speculation is off. comm: the drafter
    tensor-parallel group this process belongs to (a draft model then loads only its shard)."""
    sp = cfg.speculative
    if not sp.enabled:
        return None
    if sp.method == "ngram":
        return NgramProposer(target_spec.vocab_size)
    if sp.method == "draft_model":
        return DraftModelProposer(sp.draft_model, target_spec, cfg.model.dtype, device, cfg.scheduler.block_size,
                                  comm=comm)
    if sp.method == "dspark":
        return DSparkProposer(sp.draft_model, cfg.model.path, target_spec, device, sp.num_tokens,
                              calibrate=sp.calibration.enabled, context_window=sp.context_window,
                              draft_passes=draft_passes_of(cfg),
                              compile_buckets=draft_buckets(cfg.scheduler.max_num_seqs)
                              if resolve_compile(cfg.model.compile, device) else None,
                              eager_if_compile_fails=cfg.model.compile == "auto")
    raise ConfigError(f"speculative.method: {sp.method!r} is not available; use ngram, draft_model or dspark")
