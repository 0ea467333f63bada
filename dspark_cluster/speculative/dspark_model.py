"""The DSpark drafter (DeepSeek's DSpark; reference design: deepseek-ai/DeepSpec `modeling/dspark`).

A small transformer that drafts a whole block in one forward, conditioned on the target:
- context: the target's raw hidden states after a few chosen decoder layers, for every committed
  token, concatenated ([n_layers * H_target]) and fused by `fc` + RMSNorm; each drafter layer reads
  them as extra keys/values (they are never queries);
- block: slot 0 holds the anchor token (the last committed token, which the target has not run yet),
  slots 1.. a mask token; the slots attend to each other both ways and to the context before the
  anchor. Slot j proposes the token at anchor + j + 1;
- low-rank Markov head: slot j's logits get the bias `W1[x_{j-1}] W2` of the token before it, so the
  block is sampled left to right through this cheap head while the backbone ran once;
- confidence head: `c_j = sigmoid(w . [h_j ; W1[x_{j-1}]] + b)`, trained toward 1 - TV(q_j, p_j),
  the chance that slot j is accepted given that slot j-1 was;
- a second pass (`draft_passes: 2`, ours): slot 0 is drafted from the block above; the block runs again
  with that draft in slot 1, and slots 1.. are drafted from the second forward, so they read the sampled
  token through the backbone (at temperature 1 it is often not the one the first forward expected).

Our size (the bundled assets must stay small): the embedding and LM head are the target's, frozen
and not stored; the drafter runs at a narrower width `hidden_size` with projections to and from the
target's width, and the Markov factors are factored through the target's tables
(W1 = E_in P [V, r], W2 = Q E_out^T [r, V]); they are materialised once for serving.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..model.gemm import Linear, linear
from ..model.layers import RMSNorm, apply_rope, rope_cos_sin
from ..model.spec import rope_frequencies


@dataclass
class DSparkConfig:
    target_hidden_size: int
    vocab_size: int
    target_layer_ids: list[int]  # decoder layers of the target whose outputs are the context
    hidden_size: int = 128
    num_layers: int = 1
    num_heads: int = 2
    intermediate_size: int = 256
    block_size: int = 6  # slots per block = most tokens one forward proposes
    markov_rank: int = 64  # 0: no Markov head
    # the Markov head's transition read in the slot's context: W1[prev] scaled by (1 + G h) per factor, G
    # [r, d] from the slot's final row h, so the bias a sampled token adds depends on what the block reads
    # (a plain low-rank Markov head adds the same bigram bias in every context)
    markov_gate: bool = False
    confidence_head: bool = True
    # block forwards a draft takes: 1, or 2 (slot 0 drafted from the first; slots 1.. from a second whose slot 1
    # holds that draft, so they read it through the backbone, not only through the Markov head; trained with
    # train_dspark.py --second-pass-share)
    draft_passes: int = 1
    mask_token_id: int = 1
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    target: dict = field(default_factory=dict)  # name, num_layers, fingerprints of the shared tables
    context_window: Optional[int] = None  # context rows a block reads (None: speculative.context_window's default)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def save(self, path: Path) -> None:
        raw = {k: v for k, v in asdict(self).items() if not (k == "context_window" and v is None)}
        Path(path).write_text(json.dumps({"model_type": "dspark_drafter", **raw}, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "DSparkConfig":
        raw = json.loads(Path(path).read_text())
        raw.pop("model_type", None)
        return cls(**raw)


DEFAULT_CONTEXT_WINDOW = 512  # = calibration.MAX_CONTEXT: the rows online calibration trains a round on
# the prompt tokens a speculating request computes past its cached prefix, for its drafter's first blocks: tau
# read 3.16 / 2.89 (greedy / temperature 1) with 512 context rows, 3.09 / 2.93 with 32, 3.14 / 2.83 with 16,
# 3.02 / 2.73 with 8 (BENCHMARKS.md session 23; recomputing the whole window cost DSpark requests the prefix cache)
PREFIX_RECOMPUTE_ROWS = 32
# positions a serving drafter reads its rope from a table for; the table grows (by doubling) only as far as the
# positions served: at most 2 x 65,536 x head_dim x 4 B, 32 MiB at head_dim 64 (memory_report's rope_table_bytes)
ROPE_TABLE_ROWS = 1 << 16


def prefix_recompute_rows(context_window: int) -> int:
    """Scheduler.speculative_recompute for a DSpark drafter reading `context_window` rows a block."""
    return min(int(context_window), PREFIX_RECOMPUTE_ROWS)


def resolve_draft_passes(setting, c: DSparkConfig, path="", device="auto") -> int:
    """speculative.draft_passes ("auto", 1 or 2) for the drafter of config `c` on parallel.device `device`: auto
    is its own draft_passes on CUDA (a second block forward is small beside a GPU target's verify step), else 1
    (on the CPU it cost more than its tau gave: BENCHMARKS.md); 2 needs a drafter trained for it."""
    if setting == "auto":
        kind = ("cuda" if torch.cuda.is_available() else "cpu") if str(device) == "auto" else torch.device(device).type
        return c.draft_passes if kind == "cuda" else 1
    if int(setting) == 2 and c.draft_passes != 2:
        raise ConfigError(f"speculative.draft_passes: got 2; the drafter {path} was trained for one pass (draft_passes "
                          f"{c.draft_passes} in its config.json): use 1 or auto, or train one with "
                          "launch/train_dspark.py --second-pass-share 0.5")
    return int(setting)


def draft_passes_of(cfg) -> int:
    """Block forwards a proposal of the run `cfg` takes (speculative.draft_passes resolved for its DSpark drafter
    and parallel.device; 1 for the other methods, whose forwards verify_budget.draft_forwards counts itself).
    A DrafterConfig (what drafter actors get) carries it resolved in the engine's process."""
    if hasattr(cfg, "draft_passes"):
        return cfg.draft_passes
    sp = cfg.speculative
    if sp.method != "dspark" or not sp.draft_model:
        return 1
    return resolve_draft_passes(sp.draft_passes, DSparkConfig.load(Path(sp.draft_model) / "config.json"),
                                sp.draft_model, cfg.parallel.device)


def context_window_of(setting, c: DSparkConfig) -> int:
    """speculative.context_window ("auto" or rows) for this drafter: the rows before its anchor a
    block reads."""
    if setting != "auto" and setting is not None:
        return int(setting)
    return int(c.context_window or DEFAULT_CONTEXT_WINDOW)


class DSparkLayer(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.c = c
        self.input_norm = RMSNorm(d, c.rms_norm_eps)
        self.q_proj = Linear(d, d, bias=False)
        self.k_proj = Linear(d, d, bias=False)
        self.v_proj = Linear(d, d, bias=False)
        self.o_proj = Linear(d, d, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        self.post_norm = RMSNorm(d, c.rms_norm_eps)
        self.gate_proj = Linear(d, c.intermediate_size, bias=False)
        self.up_proj = Linear(d, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, d, bias=False)
        self.packed = None  # serving: (qkv [3d, d], gate_up [2I, d], qk_norm [2, 1, hd]) weights (`pack`)
        self.index = 0  # which of the drafter's layers (the drafter sets it): a compiled round's attention reads it

    def pack(self) -> None:
        """Serving: the q, k, v projections one weight and gate, up another (a GEMM each, not three and two),
        q's and k's norm weights side by side (q and k normed and rotated in one call each); the modules'
        weights become views of them, so a load_state_dict (a drafter version switch) copies into them and
        nothing is held twice. Used without gradients only (training reads the modules)."""
        with torch.no_grad():
            qkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            gate_up = torch.cat([self.gate_proj.weight, self.up_proj.weight])
            qk_norm = torch.stack([self.q_norm.weight, self.k_norm.weight])
        d, inter = self.c.hidden_size, self.c.intermediate_size
        self.q_proj.weight.data, self.k_proj.weight.data, self.v_proj.weight.data = qkv[:d], qkv[d:2 * d], qkv[2 * d:]
        self.gate_proj.weight.data, self.up_proj.weight.data = gate_up[:inter], gate_up[inter:]
        self.q_norm.weight.data, self.k_norm.weight.data = qk_norm[0], qk_norm[1]
        self.packed = (qkv, gate_up, qk_norm[:, None, :])

    def _apply(self, fn, recurse=True):  # .to() / .cuda() make new weights: pack them again
        super()._apply(fn, recurse)
        if self.packed is not None:
            self.pack()
        return self

    def context_kv(self, ctx, rope):
        """Keys/values of fused context rows: ctx [..., T, d], rope the (cos, sin) of their positions
        (`DSparkDrafter.rope`) -> k, v [..., T, heads, head_dim] (k normed and rotated)."""
        shape = ctx.shape[:-1] + (self.c.num_heads, self.c.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(ctx).view(shape)), *rope)
        return k, self.v_proj(ctx).view(shape)

    def forward(self, x, rope, ctx_k, ctx_v, mask, in_place: bool = False):
        """x [B, Q, d] block rows, rope the (cos, sin) of their positions [B, Q] (`DSparkDrafter.rope`: made once
        for every layer); ctx_k/ctx_v [B, C, heads, hd], the context's keys and values (the block's are appended
        to a copy); or with `in_place` [B, C + Q, heads, hd], whose last Q rows the block's are written into
        (serving: no copy of the context per layer); mask [B, Q, C + Q] bool (True: may attend) or None
        (everything). ctx_k None: a compiled round's layer (`compiled_draft`), whose attention is one op that
        reads the context from the round's `draft_context` (this layer's `index` says which layer's)."""
        B, Q, _ = x.shape
        H, D = self.c.num_heads, self.c.head_dim
        h = self.input_norm(x)
        cos, sin = rope
        packed = self.packed is not None and not torch.is_grad_enabled()
        if packed:  # (the same values: one GEMM for q, k, v; q and k normed and rotated together)
            qkv = linear(h, self.packed[0]).view(B, Q, 3, H, D)
            qk = apply_rope(_rms_norm_rows(qkv[:, :, :2], self.packed[2], self.c.rms_norm_eps).view(B, Q, 2 * H, D),
                            cos, sin)
            (q, k), v = qk.split(H, dim=2), qkv[:, :, 2]
        else:
            q = apply_rope(self.q_norm(self.q_proj(h).view(B, Q, H, D)), cos, sin)
            k = apply_rope(self.k_norm(self.k_proj(h).view(B, Q, H, D)), cos, sin)
            v = self.v_proj(h).view(B, Q, H, D)
        if ctx_k is None:  # [B, Q, heads, hd]
            attn = torch.ops.dspark.block_attention(q, k, v, self.index)
        elif in_place:
            attn = block_attention(q, k, v, ctx_k, ctx_v, mask)
        else:
            k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)
            v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k, v,
                                                  attn_mask=None if mask is None else mask[:, None]).transpose(1, 2)
        x = x + self.o_proj(attn.reshape(B, Q, H * D))
        h = self.post_norm(x)
        if packed:
            gate, up = linear(h, self.packed[1]).chunk(2, dim=-1)
            return x + self.down_proj(F.silu(gate) * up)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def block_attention(q, k, v, ctx_k, ctx_v, mask):
    """A serving block's attention: q, k, v [B, Q, heads, hd] (k normed and rotated), written into the last Q rows of
    its context's keys / values ctx_k, ctx_v [B, C + Q, heads, hd] (in place), then q over them (mask as
    `DSparkLayer.forward`'s) -> [B, Q, heads, hd]."""
    Q = q.shape[1]
    ctx_k[:, -Q:].copy_(k)
    ctx_v[:, -Q:].copy_(v)
    return F.scaled_dot_product_attention(q.transpose(1, 2), ctx_k.transpose(1, 2), ctx_v.transpose(1, 2),
                                          attn_mask=None if mask is None else mask[:, None]).transpose(1, 2)


class DSparkDrafter(nn.Module):
    """Parameters: `embed` / `lm_head` are the target's (frozen buffers, not saved); the rest is trained."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.c = c
        Ht, d, V = c.target_hidden_size, c.hidden_size, c.vocab_size
        # the target's tables [V, Ht], set by set_target_tables (placeholders until then: at DeepSeek-V3's size a
        # pair of tables is 3.7 GB in bf16, never to be allocated twice)
        self.register_buffer("embed", torch.empty(0, Ht), persistent=False)
        self.register_buffer("lm_head", torch.empty(0, Ht), persistent=False)
        self.fc = Linear(len(c.target_layer_ids) * Ht, d, bias=False)
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.in_proj = Linear(Ht, d, bias=False)
        self.layers = nn.ModuleList(DSparkLayer(c) for _ in range(c.num_layers))
        for i, layer in enumerate(self.layers):
            layer.index = i
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.out_proj = Linear(d, Ht, bias=False)
        self.out_norm = RMSNorm(Ht, c.rms_norm_eps)
        r = c.markov_rank
        if r:
            self.markov_in = Linear(Ht, r, bias=False)  # P: W1 = E_in P
            self.markov_out = Linear(r, Ht, bias=False)  # Q: W2 = Q E_out^T
            nn.init.zeros_(self.markov_out.weight)  # start as no bias
            if c.markov_gate:
                self.markov_gate = Linear(d, r, bias=False)
                nn.init.zeros_(self.markov_gate.weight)  # start as the plain Markov head
        if c.confidence_head:
            self.confidence = Linear(d + r, 1)
        self._w1 = self._w2 = None  # materialised Markov factors (serving)
        self._factors_stale = False  # the weights they are made from changed: made again, in place (`markov_factors`)
        self._inv_freq: dict = {}  # device -> the rope's inverse frequencies (fp32, whatever the model's dtype)
        self._rope_table: dict = {}  # device -> (cos, sin) [rows, 1, head_dim] of positions 0 .. rows - 1 (serving)

    def set_target_tables(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """The target's input embedding and LM head [V, Ht], held as they are (not copied: pass them on the
        model's device, in its dtype)."""
        if embed.shape != (self.c.vocab_size, self.c.target_hidden_size) or lm_head.shape != embed.shape:
            raise CheckpointError(f"the target's tables {tuple(embed.shape)} / {tuple(lm_head.shape)} do not match the "
                                  f"drafter's vocab_size x target_hidden_size ({self.c.vocab_size}, "
                                  f"{self.c.target_hidden_size})")
        self.embed, self.lm_head = embed, lm_head
        self._factors_stale = True

    def rope(self, positions, upto: Optional[int] = None):
        """positions [...] -> the rotation's cos, sin [..., 1, head_dim] in fp32 (computed in fp32 whatever the
        width), for every layer (they share head_dim and theta): made once a forward. upto: a bound on the
        positions the caller knows on the host (serving): they are then read from a table of every position
        below it, made once and grown by doubling (the same values; two lookups instead of a dozen ops a call),
        not computed per call."""
        dev = positions.device
        inv_freq = self._inv_freq.get(dev)
        if inv_freq is None:
            inv_freq = self._inv_freq[dev] = rope_frequencies(self.c.head_dim, self.c.rope_theta, dev)
        if upto is None or upto > ROPE_TABLE_ROWS:
            return rope_cos_sin(positions, inv_freq)
        table = self._rope_table.get(dev)
        if table is None or table[0].shape[0] < upto:
            rows = min(ROPE_TABLE_ROWS, max(upto, 2 * table[0].shape[0] if table is not None else 256))
            table = self._rope_table[dev] = rope_cos_sin(torch.arange(rows, device=dev), inv_freq)
        return table[0][positions], table[1][positions]

    def pack(self) -> None:
        """Serving: each layer's projections packed (`DSparkLayer.pack`)."""
        for layer in self.layers:
            layer.pack()

    def serving_weights(self, tables: bool = True) -> list:
        """The weights a packed serving round multiplies rows by through `gemm.linear` (what may take oneDNN's
        reordered copy on the CPU): each layer's packed q/k/v and gate/up, the k and v views its context rows read,
        o and down; the fuse, the block's input and output projections; the LM head unless `tables` is False (a
        target's own, reordered and counted with the target). The Markov head's and the confidence's products are
        too small for it (gemm.ONEDNN_MIN_WORK)."""
        out = [w for layer in self.layers for w in (*layer.packed[:2], layer.k_proj.weight, layer.v_proj.weight,
                                                    layer.o_proj.weight, layer.down_proj.weight)]
        out += [self.fc.weight, self.in_proj.weight, self.out_proj.weight]
        return out + ([self.lm_head] if tables else [])

    def load_trained(self, state: dict) -> None:
        """Swap in other trained weights (a calibrated version): the cached Markov factors go too."""
        self.load_state_dict(state, strict=True)
        self._factors_stale = True
        if any(layer.packed is not None and layer.q_proj.weight.data_ptr() != layer.packed[0].data_ptr()
               for layer in self.layers):
            self.pack()  # (the load copies into the packed views, which a compiled round's graphs read: kept)
        for layer in self.layers:  # their oneDNN copies (gemm.reordered) are made again: a write through a module's
            for t in (layer.packed or ())[:2]:  # view bumps the view's version counter, not the packed tensor's
                t.__dict__.pop("_onednn", None)

    # ---- pieces shared by training and serving ----------------------------------------------
    def fuse(self, target_hidden):
        """target_hidden [..., n_layers * H_target] -> fused context [..., d]."""
        return self.hidden_norm(self.fc(target_hidden))

    def block_input(self, anchors, block_size: int, second=None):
        """anchors [B] -> block embeddings [B, block_size, d]: the anchor, then mask tokens. second [B]
        (optional): slot 1's token where >= 0 (a block that already knows its first draft: a second pass)."""
        ids = torch.full((anchors.shape[0], block_size), self.c.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        if second is not None:
            ids[:, 1] = torch.where(second >= 0, second, ids[:, 1])
        return self.in_proj(self.embed[ids])

    def head(self, h):
        """final block rows h [..., d] -> (normed rows [..., d], base logits [..., V] fp32)."""
        hn = self.norm(h)
        return hn, _fp32(linear(self.out_norm(self.out_proj(hn)), self.lm_head))

    def block_pass(self, anchors, rope, attend, second=None):
        """One backbone pass over blocks, the computation every user of the drafter shares (serving eager and
        compiled, training, the calibrator's replayed rounds). anchors [B] token ids, a block a row, or [B, A]: A
        blocks of a row side by side (training); rope: the (cos, sin) of the block rows' positions (`rope`);
        attend(layer_index) -> that layer's (ctx_k, ctx_v, mask[, in_place]) for `DSparkLayer.forward`; second:
        slot 1's tokens (shaped as anchors) where >= 0 (a second pass), or None -> (normed final rows [..., S, d],
        base logits [..., S, V] fp32), S = block_size."""
        S, shape = self.c.block_size, anchors.shape
        if len(shape) == 2:
            anchors, second = anchors.reshape(-1), None if second is None else second.reshape(-1)
        x = self.block_input(anchors, S, second)
        if len(shape) == 2:
            x = x.view(shape[0], shape[1] * S, -1)
        for layer in self.layers:
            x = layer(x, rope, *attend(layer.index))
        return self.head(x if len(shape) == 1 else x.view(*shape, S, -1))

    def draft_slots(self, block, anchors, w1, w2, num_tokens: int, choose):
        """A serving round's drafts, left to right through the Markov head (eager and compiled rounds alike).
        block(second) -> (hn [B, S, d], base [B, S, V]): a `block_pass` of the round's rows (second: slot 1's tokens,
        for the second pass), anchors [B], w1 / w2 the Markov factors (`markov_factors`), choose(i, z) -> (slot i's
        tokens [B], its law [B, V] or None) from slot i's corrected logits z [B, V] -> (tokens [B, K], the logits
        [K x [B, V]], the laws choose gave [K x [B, V]] or [], raw confidence logits [B, K] or None), K =
        num_tokens."""
        hn, base = block(None)
        gates = self.markov_gates(hn)  # [B, S, r] or None
        # each slot's base logits and gate: one unbind, not a select per slot
        base_i, gates_i = base.unbind(1), None if gates is None else gates.unbind(1)
        prev, tokens, zs, laws, es = anchors, [], [], [], []
        for i in range(num_tokens):  # the backbone ran once, or twice
            if i == 1 and self.c.draft_passes == 2:  # slots 1.. from a block that holds slot 0's draft
                hn, base = join_passes((hn, base), block(tokens[0]))
                gates = self.markov_gates(hn)
                base_i, gates_i = base.unbind(1), None if gates is None else gates.unbind(1)
            e, bias = self.markov_bias(prev, w1, w2, None if gates_i is None else gates_i[i])
            z = base_i[i] + bias
            prev, law = choose(i, z)
            tokens.append(prev)
            zs.append(z)
            es.append(e)
            if law is not None:
                laws.append(law)
        conf = self.confidence_logit(hn[:, :num_tokens], torch.stack(es, 1) if es[0] is not None else None)
        return torch.stack(tokens, 1), zs, laws, conf

    def markov_factors(self):
        """W1 [V, r], W2 [r, V] (materialised and cached when not training)."""
        if not self.c.markov_rank:
            return None, None
        if self.training or self._w1 is None or self._factors_stale:
            w1 = self.markov_in(self.embed)  # [V, r]
            w2 = self.markov_out.weight.T @ self.lm_head.T  # [r, Ht] @ [Ht, V] -> [r, V]
            if self.training:
                return w1, w2
            w1, w2 = w1.detach(), w2.detach().float()
            old = self._w1
            # made again in place where they can be (a version switch): a compiled round's CUDA graphs read them
            # where they are
            if old is not None and old.shape == w1.shape and old.dtype == w1.dtype and old.device == w1.device \
                    and (torch.is_inference_mode_enabled() or not old.is_inference()):
                self._w1.copy_(w1)
                self._w2.copy_(w2)
            else:
                self._w1, self._w2 = w1, w2
            self._factors_stale = False
        return self._w1, self._w2

    def markov_gates(self, hn):
        """The slots' normed final rows hn [..., d] -> the Markov factors' gates 1 + G h [..., r] (None
        without markov_gate)."""
        return 1 + self.markov_gate(hn) if self.c.markov_rank and self.c.markov_gate else None

    def markov_bias(self, prev, w1, w2, gates=None):
        """prev [...] token ids, gates [..., r] (markov_gates, or None) -> (W1[prev] [..., r], logit bias
        [..., V])."""
        if w1 is None:
            return None, 0.0
        e = w1[prev]
        x = e if gates is None else e * _as(gates, e.dtype)
        return e, _fp32(_as(x, w2.dtype) @ w2)

    def confidence_logit(self, hn, e):
        """[h ; W1[prev]] -> raw confidence logit [...] (None without a confidence head)."""
        if not self.c.confidence_head:
            return None
        x = hn if e is None else torch.cat([hn, _as(e, hn.dtype)], dim=-1)
        return self.confidence(x).squeeze(-1)

    # ---- training: many blocks of one window in one dense forward --------------------------
    def forward_train(self, tokens, target_hidden, anchors, second_pass=None):
        """tokens [B, T] long; target_hidden [B, T, n_layers * H_target] (the target's chosen layer
        outputs at each token); anchors [B, A] long positions (block b starts at anchors[:, b]);
        second_pass [B, A] bool (optional): blocks whose slot 1 holds the true token after the anchor
        instead of a mask (a second block forward after slot 0 was drafted; slot 0's own output is then
        not a prediction). Returns (z [B, A, S, V] Markov-corrected logits with teacher-forced previous
        tokens, confidence logits [B, A, S] or None), S = block_size."""
        B, T = tokens.shape
        A, S = anchors.shape[1], self.c.block_size
        dev = tokens.device
        ctx = self.fuse(target_hidden)  # [B, T, d]
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        second = None
        if second_pass is not None:
            second = torch.where(second_pass, tokens.gather(1, (anchors + 1).clamp(max=T - 1)), -1)
        slot = torch.arange(S, device=dev)
        qpos = (anchors[:, :, None] + slot).reshape(B, A * S)
        # a block's slot sees the context strictly before its anchor, and its own block
        see_ctx = ctx_pos[:, None, :] < anchors.repeat_interleave(S, dim=1)[:, :, None]  # [B, A*S, T]
        blk = torch.arange(A * S, device=dev) // S
        see_blk = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
        mask = torch.cat([see_ctx, see_blk], dim=2)
        ctx_rope, q_rope = self.rope(ctx_pos), self.rope(qpos)
        hn, base = self.block_pass(tokens.gather(1, anchors), q_rope,
                                   lambda i: (*self.layers[i].context_kv(ctx, ctx_rope), mask), second)
        prev = tokens.gather(1, qpos.clamp(max=T - 1)).view(B, A, S)  # teacher forcing: the true token before
        w1, w2 = self.markov_factors()
        e, bias = self.markov_bias(prev, w1, w2, self.markov_gates(hn))
        return base + bias, self.confidence_logit(hn, e)

    # ---- online calibration: recorded verify rounds, several per sequence over one context ----
    def forward_rounds(self, target_hidden, ctx_pos, ctx_valid, anchors, anchor_pos, prev, window=None):
        """The serving computation (`block_pass` + the Markov head) for A recorded rounds of each
        of B sequences, with gradients; each sequence's context keys/values are computed once for
        all its rounds. target_hidden [B, C, n_layers * H_target] context rows (padded), ctx_pos
        [B, C] their positions, ctx_valid [B, C] bool; anchors [B, A] token ids at anchor_pos [B, A];
        prev [B, A, S] the token before each slot (slot 0: the anchor; slot j: draft j). A block sees
        the context before its anchor (the last `window` rows of it, when given) and its own slots. Returns (z [B, A, S, V] Markov-corrected
        logits, confidence logits [B, A, S] or None)."""
        B, A = anchors.shape
        S, dev = self.c.block_size, anchors.device
        ctx = self.fuse(target_hidden)
        qpos = (anchor_pos[:, :, None] + torch.arange(S, device=dev)).reshape(B, A * S)
        q_anchor = anchor_pos.repeat_interleave(S, dim=1)[:, :, None]  # [B, A*S, 1]
        see_ctx = ctx_valid[:, None, :] & (ctx_pos[:, None, :] < q_anchor)
        if window is not None:
            see_ctx = see_ctx & (ctx_pos[:, None, :] >= q_anchor - window)
        blk = torch.arange(A * S, device=dev) // S
        mask = torch.cat([see_ctx, (blk[:, None] == blk[None, :]).expand(B, -1, -1)], dim=2)
        ctx_rope, q_rope = self.rope(ctx_pos), self.rope(qpos)
        kv = [layer.context_kv(ctx, ctx_rope) for layer in self.layers]
        hn, base = self.block_pass(anchors, q_rope, lambda i: (*kv[i], mask))
        if self.c.draft_passes == 2:  # slots 1.. from the pass that holds slot 0's draft (prev's slot 1)
            second = self.block_pass(anchors, q_rope, lambda i: (*kv[i], mask), prev[:, :, 1])
            hn, base = join_passes((hn, base), second)
        w1, w2 = self.markov_factors()
        e, bias = self.markov_bias(prev, w1, w2, self.markov_gates(hn))
        return base + bias, self.confidence_logit(hn, e)


def join_passes(first, second) -> tuple:
    """A two-pass block's rows: slot 0 from the first pass, slots 1.. from the second (whose slot 1 holds slot 0's
    draft). first / second: (normed rows, base logits) of `block_pass`, the slot axis second to last."""
    (hn, base), (hn2, base2) = first, second
    return torch.cat([hn[..., :1, :], hn2[..., 1:, :]], -2), torch.cat([base[..., :1, :], base2[..., 1:, :]], -2)


def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., G, H, D] normed over D, group g scaled by weight[g] ([G, 1, D]): RMSNorm's arithmetic (fp32: one
    F.rms_norm, whose weight multiplies last; else normed in fp32, cast back, then scaled) for G norms at once."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape[-1:], eps=eps) * weight
    return weight * F.rms_norm(x.float(), weight.shape[-1:], eps=eps).to(x.dtype)


def _as(t: torch.Tensor, dtype) -> torch.Tensor:
    """t in dtype (no op dispatched when it is already: the drafting loop runs per slot)."""
    return t if t.dtype == dtype else t.to(dtype)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.float32)


def dspark_loss(z, conf, labels, p_target, weight, ce_alpha=0.1, l1_alpha=0.9, conf_alpha=1.0):
    """DSpark's loss. z [N, V] corrected draft logits; conf [N] logits or None; labels [N] the next
    tokens; p_target [N, V] the target's law at the same positions; weight [N] (position decay x
    validity). Returns (loss, metrics): CE + L1 (= 2 TV) toward the target + BCE of the confidence
    toward 1 - TV (detached), each a weighted mean."""
    wsum = weight.sum().clamp(min=1e-6)
    logq = z.log_softmax(-1)
    ce = -(logq.gather(1, labels[:, None]).squeeze(1))
    l1 = (logq.exp() - p_target).abs().sum(-1)
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()
    loss = ce_alpha * (ce * weight).sum() / wsum + l1_alpha * (l1 * weight).sum() / wsum
    metrics = {"ce": float((ce * weight).sum().detach() / wsum), "tv": float((0.5 * l1 * weight).sum().detach() / wsum)}
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
        loss = loss + conf_alpha * (bce * weight).sum() / wsum
        metrics["bce"] = float((bce * weight).sum().detach() / wsum)
    return loss, metrics


def block_weights(anchors, T: int, S: int, gamma: float = 4.0, loss_mask=None):
    """anchors [B, A] -> (label positions [B, A, S], weights [B, A, S]): slot j's label is at
    anchor + j + 1, weight exp(-j / gamma) while every label up to j is inside the window (and the
    loss mask), 0 after (a hole ends the block's supervision)."""
    slot = torch.arange(S, device=anchors.device)
    pos = anchors[:, :, None] + slot + 1
    valid = pos < T
    if loss_mask is not None:
        valid = valid & loss_mask.gather(1, pos.clamp(max=T - 1).flatten(1)).view_as(pos)
    valid = valid.long().cumprod(-1).bool()
    return pos.clamp(max=T - 1), valid * torch.exp(-slot.float() / gamma)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def load_drafter(path, target_embed: torch.Tensor, target_lm_head: torch.Tensor, device="cpu",
                 dtype=torch.float32) -> DSparkDrafter:
    """A saved DSpark drafter (config.json + model.safetensors, any float dtype) in `dtype` (serving: the
    target's), with the target's tables in place in that dtype."""
    from safetensors.torch import load_file

    path = Path(path)
    c = DSparkConfig.load(path / "config.json")
    model = DSparkDrafter(c)
    state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: DSpark drafter tensors missing {missing[:4]} or unexpected {unexpected[:4]}")
    model = model.to(device, dtype).eval()
    model.set_target_tables(target_embed.to(device, dtype), target_lm_head.to(device, dtype))
    return model


def target_tables(target_path, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """The target checkpoint's input embedding and LM head (the drafter shares them, frozen);
    read through the checkpoint reader, so an fp8 checkpoint's tables come back dequantized."""
    from ..model.loader import CheckpointReader

    reader = CheckpointReader(target_path, spec.fp8_block)
    names = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}
    if not reader.has(names["head"]) and spec.tie_word_embeddings:
        names["head"] = names["embed"]
    missing = [n for n in names.values() if not reader.has(n)]
    if missing:
        raise ConfigError(f"speculative.draft_model: the target {target_path} lacks {missing}"
                          " (a DSpark drafter needs the target's embedding and LM head)")
    return reader.read(names["embed"]), reader.read(names["head"])


def tensor_fingerprint(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's fp32 bytes (which target the drafter was trained against)."""
    import hashlib

    return hashlib.sha256(t.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def save_drafter(model: DSparkDrafter, path, dtype=torch.float16) -> int:
    """Save the trained parameters (not the target's tables) and the config. Returns bytes written."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    model.c.save(path / "config.json")
    return sum(f.stat().st_size for f in path.iterdir())


def random_drafter(target_path, out_dir, seed: int = 0, layers=(0,), block_size: int = 4, markov_rank: int = 8,
                   hidden: int = 32, scale: float = 1.0, markov_gate: bool = False, draft_passes: int = 1):
    """A random DSpark drafter for the checkpoint at `target_path`, saved in fp32 to `out_dir` (its
    tables are the target's; every matrix drawn at `scale` / sqrt(fan-in), so the Markov head is
    non-zero and its path runs): for tests and device checks, which build their own models."""
    from ..model.spec import load_spec

    spec = load_spec(str(target_path), "float32")
    embed, head = target_tables(str(target_path), spec)
    torch.manual_seed(seed)
    c = DSparkConfig(target_hidden_size=spec.hidden_size, vocab_size=spec.vocab_size, target_layer_ids=list(layers),
                     hidden_size=hidden, num_heads=2, intermediate_size=2 * hidden, block_size=block_size,
                     markov_rank=markov_rank, markov_gate=markov_gate, draft_passes=draft_passes, mask_token_id=1,
                     target={"embed_sha256": tensor_fingerprint(embed), "lm_head_sha256": tensor_fingerprint(head)})
    model = DSparkDrafter(c)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, scale / p.shape[1] ** 0.5)
    save_drafter(model, out_dir, dtype=torch.float32)
    return out_dir
