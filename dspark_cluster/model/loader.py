"""Load one shard of an HF safetensors checkpoint into a DecoderModel.

The shard is `(tp_rank, tp_size)` plus the list of experts it holds. Only the tensors (and, for
split tensors, only the rows or columns) that this shard needs are read from disk:
safetensors' `get_slice` reads a slice without materialising the rest.

FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2: e4m3 weights, each with a `*.weight_scale_inv` of one
float32 scale per (rows, cols) block) are dequantized slice by slice: a shard reads its rows or
columns of the fp8 tensor and the scale blocks that cover them, and only that slice is ever
widened (scale x value in float32, then the model's dtype).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .fp8 import FP8_DTYPES, dequantize_fp8
from .gemm import reorder_weights
from .layers import LocalComm
from .model import DecoderModel
from .spec import ModelSpec



def _open(f: Path):
    """safe_open, with a file it cannot read (truncated by a download or a copy that stopped, or not
    safetensors at all) as one CheckpointError naming the file and the fix."""
    try:
        return safe_open(str(f), "pt")
    except FileNotFoundError:
        raise CheckpointError(f"{f}: the checkpoint file is missing (listed in model.safetensors.index.json); "
                              "download or save the checkpoint again") from None
    except Exception as e:  # noqa: BLE001 -- safetensors' own error type (SafetensorError) is not public API
        size = f.stat().st_size if f.exists() else 0
        raise CheckpointError(f"{f}: not a readable safetensors file ({size} bytes; {e}): it is truncated or "
                              "corrupt; download or save the checkpoint again") from None


class CheckpointReader:
    """Name -> file index over a folder of *.safetensors; reads tensors or slices on demand.
    fp8_block: the checkpoint's quantization block (rows, cols), from config.json, or None;
    device: where fp8 slices are widened."""

    def __init__(self, path, fp8_block=None, device="cpu"):
        self.path = Path(path)
        self.fp8_block = tuple(fp8_block) if fp8_block else None
        self.device = torch.device(device)  # where fp8 slices are dequantized (the worker's device)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files; save the model with safe_serialization")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: self.path / v for k, v in weight_map.items()}
        else:
            self.where = {}
            for f in files:
                with _open(f) as h:
                    for k in h.keys():
                        self.where[k] = f
        self._handles = {}
        self.bytes_read = 0

    def _handle(self, f):
        if f not in self._handles:
            self._handles[f] = _open(f)
        return self._handles[f]

    def has(self, name):
        return name in self.where

    def _slice(self, name):
        if name not in self.where:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return self._handle(self.where[name]).get_slice(name)

    def _take(self, sl, dim, start, length):
        if dim is None:
            t = sl[:]
        elif dim == 0:
            t = sl[start : start + length]
        else:
            t = sl[:, start : start + length]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read(self, name, dim=None, start=0, length=None, expect=None):
        """The tensor `name`, or its rows (dim 0) / columns (dim 1) [start, start + length); an fp8
        tensor comes back dequantized to float32 (only the slice asked for)."""
        sl = self._slice(name)
        if dim is not None:  # the dimensions not split must match whole (a transposed tensor would not)
            shape = sl.get_shape()
            if expect is not None and (len(shape) != len(expect) or any(
                    a != b for d, (a, b) in enumerate(zip(shape, expect)) if d != dim) or shape[dim] < start + length):
                raise CheckpointError(f"{self.path}: tensor {name!r} has shape {tuple(shape)}, but this "
                                      f"architecture needs {tuple(expect)} outside dimension {dim} and at least "
                                      f"{start + length} along it")
        dtype = sl.get_dtype()
        if not dtype.startswith("F8"):
            return self._take(sl, dim, start, length)
        return self._read_fp8(name, sl, dtype, dim, start, length)

    def _read_fp8(self, name, sl, dtype, dim, start, length):
        scale_name = name + "_scale_inv"
        if dtype not in FP8_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {dtype}; only e4m3 fp8 (F8_E4M3) is supported")
        if self.fp8_block is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is fp8 ({dtype}) but config.json has no "
                                  "quantization_config with weight_block_size; add it (DeepSeek-V3: quant_method fp8, "
                                  "weight_block_size [128, 128]) or dequantize the checkpoint")
        if not self.has(scale_name):
            raise CheckpointError(f"{self.path}: fp8 tensor {name!r} has no block scales {scale_name!r}")
        bm, bn = self.fp8_block
        rows, cols = sl.get_shape()
        scale_sl = self._slice(scale_name)
        want = (-(-rows // bm), -(-cols // bn))
        if tuple(scale_sl.get_shape()) != want:
            raise CheckpointError(f"{self.path}: {scale_name!r} has shape {tuple(scale_sl.get_shape())}, expected "
                                  f"{want} for a {rows} x {cols} weight in {bm} x {bn} blocks (weight_block_size)")
        q = self._take(sl, dim, start, length).to(self.device)
        if dim is None:
            return dequantize_fp8(q, self._take(scale_sl, None, 0, None), self.fp8_block)
        b = bm if dim == 0 else bn
        first, last = start // b, (start + length - 1) // b  # the scale blocks this slice touches
        scale = self._take(scale_sl, dim, first, last - first + 1)
        return dequantize_fp8(q, scale, self.fp8_block, start if dim == 0 else 0, start if dim == 1 else 0)


def _hf_names(name: str, spec: ModelSpec, expert_ids):
    """Our parameter name -> list of checkpoint names (several are concatenated along dim 0)."""
    m = re.match(r"model\.layers\.(\d+)\.mlp\.(.*)", name)
    if m:
        layer, rest = m.groups()
        prefix = f"model.layers.{layer}.{spec.expert_prefix}"
        g, u, d = spec.expert_names
        if rest == "w13":
            return [f"{prefix}.experts.{e}.{w}.weight" for e in expert_ids for w in (g, u)]
        if rest == "w2":
            return [f"{prefix}.experts.{e}.{d}.weight" for e in expert_ids]
        if rest == "e_score_correction_bias":
            return [f"{prefix}.gate.e_score_correction_bias"]
        if rest.startswith("shared."):
            return [f"{prefix}.{spec.shared_prefix}.{rest[len('shared.'):]}"]
        return [f"{prefix}.{rest}"]
    if name == "lm_head.weight" and spec.tie_word_embeddings:
        return ["model.embed_tokens.weight"]
    return [name]


def _shard_dim(model, name: str):
    """The split dimension of parameter `name`, or None when it is whole on every rank."""
    owner, _, leaf = name.rpartition(".")
    dim = getattr(model.get_submodule(owner), "shard_dim", None) if owner else None
    if dim == 1 and leaf == "bias":
        return None  # a row-parallel bias is whole
    return dim


def load_weights(model: DecoderModel, reader: CheckpointReader):
    """Fill every parameter and persistent buffer of `model` from the checkpoint."""
    spec, comm = model.spec, model.comm
    tp_rank, tp_size = comm.tp_rank, comm.tp_size
    tensors = dict(model.named_parameters())
    tensors.update({k: v for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")})
    for name, param in tensors.items():
        expert_ids = None
        if name.endswith((".w13", ".w2")):
            moe = model.get_submodule(name.rsplit(".", 1)[0])
            expert_ids = moe.expert_ids
        sources = _hf_names(name, spec, expert_ids)
        if name.endswith(".w13") or name.endswith(".w2"):
            # per expert: gate and up [I, H] each (w13), down [H, I] (w2); a transposed tensor has the
            # right number of elements, so each one's shape is checked before they are joined
            part_shape = (param.shape[1] // 2, param.shape[2]) if name.endswith(".w13") else tuple(param.shape[1:])
            parts = [reader.read(s) for s in sources]
            for s, t in zip(sources, parts):
                if tuple(t.shape) != part_shape:
                    raise CheckpointError(f"{reader.path}: tensor {s!r} has shape {tuple(t.shape)}, expected "
                                          f"{part_shape} for this architecture (config.json)")
            full = torch.cat(parts, 0) if name.endswith(".w13") else torch.stack(parts)
            value = full.view(param.shape) if full.numel() == param.numel() else full
        elif getattr(model.get_submodule(name.rsplit(".", 1)[0]), "parts", None) is not None:
            value = _read_packed(model, reader, name, param)
        elif tp_size > 1 and _shard_dim(model, name) is not None:
            # the layer says how it is split: rows (column-parallel) or columns (row-parallel)
            module = model.get_submodule(name.rsplit(".", 1)[0])
            dim = module.shard_dim
            length = param.shape[dim]
            value = reader.read(sources[0], dim, (tp_rank // module.share) * length, length, expect=param.shape)
        else:
            value = reader.read(sources[0])
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{reader.path}: tensor {sources[0]!r} has shape {tuple(value.shape)}, expected "
                f"{tuple(param.shape)} for this shard (tp_rank={tp_rank}, tp_size={tp_size})"
            )
        with torch.no_grad():
            param.copy_(value.to(param.dtype))


def _read_packed(model: DecoderModel, reader: CheckpointReader, name: str, param) -> torch.Tensor:
    """A PackedLinear's weight or bias: each part read from its own checkpoint tensor (this rank's
    rows of it when the part is split), its rows reordered where the part says, and joined."""
    owner, _, leaf = name.rpartition(".")
    module, parent = model.get_submodule(owner), owner.rpartition(".")[0]
    comm, spec = model.comm, model.spec
    values = []
    for part in module.parts:
        source = _hf_names(f"{parent}.{part.name}.{leaf}", spec, None)[0]
        expect = (part.size, *param.shape[1:])
        if part.split and comm.tp_size > 1:
            value = reader.read(source, 0, (comm.tp_rank // part.share) * part.size, part.size, expect=expect)
        else:
            value = reader.read(source)
        if tuple(value.shape) != expect:
            raise CheckpointError(f"{reader.path}: tensor {source!r} has shape {tuple(value.shape)}, expected "
                                  f"{expect} for this shard (tp_rank={comm.tp_rank}, tp_size={comm.tp_size})")
        values.append(value if part.row_order is None else value.index_select(0, part.row_order.to(value.device)))
    return torch.cat(values)


def load_model(path, spec: ModelSpec, comm=None, expert_ids=None, device="cpu") -> DecoderModel:
    """Build the shard of `spec` described by `comm` (tp rank/size) and `expert_ids` (per MoE
    layer, the logical experts of this shard's slots; None = all experts), and load it.

    Parameters are created on the meta device and materialised once, so nothing is initialised
    that the checkpoint then overwrites.
    """
    comm = comm or LocalComm()
    with torch.device("meta"):
        model = DecoderModel(spec, comm, expert_ids)
    model = model.to(dtype=spec.dtype).to_empty(device=device)
    model.reset_buffers()
    reader = CheckpointReader(path, spec.fp8_block, device)
    load_weights(model, reader)
    model.bytes_read = reader.bytes_read
    model.reordered_bytes = reorder_weights(model)  # the CPU's oneDNN copies (model/gemm.py), before the KV plan
    return model.eval().requires_grad_(False)
