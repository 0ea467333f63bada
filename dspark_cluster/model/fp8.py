"""FP8 block-quantized weights (DeepSeek-V3's format): e4m3 values with one float32 scale per
(rows, cols) block, stored beside each weight as `<name>_scale_inv` (value = fp8 x scale).

`dequantize_fp8` is what the loader applies to each shard's slice. `quantize_fp8` and
`write_fp8_checkpoint` make such checkpoints from a bf16/fp32 one, as DeepSeek ships theirs: the
tests and `launch/bench_fp8.py` use them, and they convert a checkpoint for a memory study.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP8_DTYPES = ("F8_E4M3",)  # safetensors' names; e5m2 or other formats are refused by name
E4M3_MAX = 448.0


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """q [R, C] fp8 values of the global rows row0.. and columns col0.. of a weight; scale [r, c] the
    block scales starting at block (row0 // bm, col0 // bn) that cover them -> float32 [R, C], on
    q's device (the loader moves the fp8 slice to the worker's device first: half the bytes of bf16
    cross the bus, and a GPU widens them at its own bandwidth)."""
    bm, bn = block
    r, c = row0 % bm, col0 % bn
    nr, nc = scale.shape
    # the values laid into whole blocks, each block scaled in place by one broadcast multiply
    out = torch.empty(nr * bm, nc * bn, dtype=torch.float32, device=q.device)
    out[r : r + q.shape[0], c : c + q.shape[1]] = q
    out.view(nr, bm, nc, bn).mul_(scale.to(q.device, torch.float32)[:, None, :, None])
    return out[r : r + q.shape[0], c : c + q.shape[1]]


def quantize_fp8(w: torch.Tensor, block: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (e4m3 values [R, C], scale_inv [ceil(R/bm), ceil(C/bn)] float32), each block
    scaled so its largest magnitude maps to e4m3's largest finite value (partial edge blocks too)."""
    bm, bn = block
    R, C = w.shape
    pr, pc = -(-R // bm) * bm, -(-C // bn) * bn
    padded = torch.zeros(pr, pc, dtype=torch.float32)
    padded[:R, :C] = w.float()
    blocks = padded.view(pr // bm, bm, pc // bn, bn)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / E4M3_MAX).float()
    q = (blocks / scale[:, None, :, None]).view(pr, pc)[:R, :C].to(torch.float8_e4m3fn)
    return q, scale


def is_quantized_weight(name: str, t: torch.Tensor) -> bool:
    """The tensors DeepSeek ships in fp8: every linear projection of attention and the MLPs /
    experts; embeddings, LM head, norms and the router stay in bf16."""
    owner, _, leaf = name.rpartition(".")
    in_block = any(f".{m}." in name for m in ("self_attn", "mlp", "block_sparse_moe"))
    router = owner.rsplit(".", 1)[-1] in ("gate", "shared_expert_gate")
    return t.dim() == 2 and leaf == "weight" and in_block and "norm" not in owner and not router


def write_fp8_checkpoint(src, dst, block=(128, 128), dequantized=None, rest_dtype=None) -> dict:
    """Copy the HF checkpoint folder `src` to `dst` with its projections in fp8 + block scales and
    `quantization_config` in config.json. rest_dtype: the other tensors' dtype in `dst` (DeepSeek
    ships them in bf16; None keeps the source's), also its config's dtype. dequantized: optional
    folder that gets the same model with the dequantized weights (the exact function the fp8
    checkpoint computes), in the source dtype. Returns {"fp8_bytes", "dequantized_bytes"}."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    quantized, plain = {}, {}
    for name, t in tensors.items():
        if is_quantized_weight(name, t):
            q, s = quantize_fp8(t, block)
            quantized[name], quantized[name + "_scale_inv"] = q, s
            plain[name] = dequantize_fp8(q, s, block).to(t.dtype).contiguous()
        else:
            quantized[name] = t if rest_dtype is None else t.to(rest_dtype)
            plain[name] = quantized[name].to(t.dtype)
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    if rest_dtype is not None:
        cfg["dtype"] = cfg["torch_dtype"] = str(rest_dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    out = {"fp8_bytes": (dst / "model.safetensors").stat().st_size}
    if dequantized is not None:
        dq = Path(dequantized)
        shutil.copytree(src, dq, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        save_file(plain, str(dq / "model.safetensors"), metadata={"format": "pt"})
        out["dequantized_bytes"] = (dq / "model.safetensors").stat().st_size
    return out
