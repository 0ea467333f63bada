"""The linear layers' matmul: torch's `F.linear`, or on the CPU oneDNN's over a weight reordered once.

Why: on the CPUs this project is measured on (AMD EPYC, AVX-512) torch's fp32 matmul (MKL) multiplies a few
rows at ~50 GFLOP/s: a 7-row x 256 x 768 product, a verify step's, costs 5x a row's (51 against 10 us); oneDNN's
matmul over a weight kept in its blocked layout does it in 25 us, 64 rows in 0.45x MKL's time
(`launch/bench_step.py --gemm`, BENCHMARKS.md "oneDNN's matmul on the CPU"). It costs ~10 us a call whatever the size,
so a product goes to it only when it is large enough (`ONEDNN_MIN_WORK`), never for one row, which MKL does at
memory speed. The values are fp32 products either way (summed in another order: they differ in the last bits, as
MKL's own do between one row and several). On other devices, with gradients, under torch.compile (inductor
chooses its own kernels), for inference tensors and for other dtypes, it is `F.linear`.

The reordered copy is kept on the weight tensor itself with its storage and version, so it is made once, goes with
the weight, and is made again after an in-place load into the same tensor. It is a second copy of each weight it is used for (the dense one stays: other readers need it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# rows x in x out of a product from which oneDNN's call beats MKL's on the measured CPU (its ~10 us floor against
# MKL's ~50 GFLOP/s). Alone a product gains from ~400,000 (256 x 256 from 7 rows, 768 x 256 from 3); inside a forward
# the steps of 7-16 rows were 2-3% faster leaving those under ~1,000,000 to MKL (BENCHMARKS.md: 256 x 256 from 16 rows,
# 256 x 768 from 6, 256 x 2048 from 2)
ONEDNN_MIN_WORK = 1_000_000
_REORDER_ROWS = 16  # the batch size the weight's layout is chosen for (8-64 measured the same)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# bf16 only where oneDNN has its bf16 path (AVX-512 BW/VL/DQ): elsewhere its reorder refuses bf16 weights
_DTYPES = (torch.float32,) + ((torch.bfloat16,) if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ())


def runs_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN's matmul runs this dtype on this machine's CPU."""
    return _ONEDNN and dtype in _DTYPES


def reorderable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can take this weight: on the CPU, in a dtype it runs, and not an inference tensor (whose
    in-place changes have no version counter for the kept copy to follow)."""
    return weight.device.type == "cpu" and runs_dtype(weight.dtype) and not weight.is_inference()


def use_onednn(x: torch.Tensor, weight: torch.Tensor, bias=None) -> bool:
    """Whether `linear(x, weight, bias)` runs oneDNN's matmul (the rule in the module's docstring)."""
    if torch.compiler.is_compiling():  # first: a test of the weight (`is_inference`) is a graph break, which would
        return False  # cut a compiled step's graph at every linear, and a test of x's size guards a dynamic batch
    n = x.numel()  # rows x in: the cheap tests first (it runs for every linear of every step)
    return (n * weight.shape[0] >= ONEDNN_MIN_WORK and n > x.shape[-1]
            and weight.dtype == x.dtype and x.device == weight.device and reorderable(weight)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


# Rows a slot (on average) from which a MoE layer's experts run as one oneDNN product a slot, over the plain weights
# (no reordered copy: at these sizes oneDNN's own handling of a plain weight costs ~5-15% more than a kept copy, and the
# experts are most of a MoE model's weights), rather than as torch's CPU grouped matmul, a loop of MKL products that is
# slow at large row counts. The bundled model's 8 slots (`launch/bench_step.py --experts`), time over the grouped
# matmul's by rows a slot: 16 1.25x, 24 1.08x, 32 0.97x, 48 0.80x, 64 0.74x, 128 0.63x, 445 (a prompt step's) 0.31x.
ONEDNN_EXPERT_MIN_ROWS = 48


def use_onednn_experts(xs: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether the experts of rows xs [N, H] (counts [n_slots] of them in each slot; the rest padding) over stacked
    weights w13 [n_slots, 2I, H] run slot by slot on oneDNN (`layers.grouped_experts`): on the CPU, in a dtype it
    runs, without gradients, at ONEDNN_EXPERT_MIN_ROWS rows a slot or more (padding rows, as expert parallelism's
    fixed-size buffers hold, not counted; reading the count waits for nothing on the CPU)."""
    return (xs.shape[0] >= ONEDNN_EXPERT_MIN_ROWS * w13.shape[0] and xs.device.type == "cpu" and runs_dtype(xs.dtype)
            and w13.dtype == xs.dtype and w13.device.type == "cpu"
            and not (torch.is_grad_enabled() and (xs.requires_grad or w13.requires_grad))
            and int(counts.sum()) >= ONEDNN_EXPERT_MIN_ROWS * w13.shape[0])


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T by oneDNN's matmul over the weight as it is (nothing kept)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def reordered(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (`reorderable`) in oneDNN's blocked layout, made once per storage and version and kept on
    the tensor."""
    key = (weight.data_ptr(), weight._version)
    kept = weight.__dict__.get("_onednn")
    if kept is None or kept[0] != key:
        with torch.no_grad():
            kept = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _REORDER_ROWS))
        weight.__dict__["_onednn"] = kept
    return kept[1]


def detached(weight: torch.Tensor) -> torch.Tensor:
    """weight.detach() that shares the weight's reordered copy (a detached tensor is a new object with the same
    storage and version counter: without this it would make a second copy), for a reader of another module's weight
    (a DSpark drafter reading its target's LM head)."""
    out = weight.detach()
    if "_onednn" in weight.__dict__:
        out.__dict__["_onednn"] = weight.__dict__["_onednn"]
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T + bias: `F.linear`'s result, by the faster kernel for this product."""
    if use_onednn(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, reordered(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


def reorder_tensors(weights) -> int:
    """Each weight [out, in] reordered for oneDNN now where it can run there (on the CPU, fp32 or bf16): at load, so
    that the copies are in the memory the KV pool is sized from and the first step does not pay for them. Returns
    the bytes the copies take (the dense size; each tensor once)."""
    total, seen = 0, set()
    for w in weights:
        if id(w) not in seen and reorderable(w):
            seen.add(id(w))
            reordered(w)
            total += w.numel() * w.element_size()
    return total


def linear_weights(module: nn.Module) -> list:
    """Every `Linear`'s weight under `module` that the loader reorders (a module whose weight is only read as views,
    as MLA's absorbed kv_b_proj, says so: `onednn = False`)."""
    return [m.weight for m in module.modules() if isinstance(m, Linear) and getattr(m, "onednn", True)]


def reorder_weights(module: nn.Module) -> int:
    """`reorder_tensors` of `linear_weights(module)`: what `load_model` runs."""
    return reorder_tensors(linear_weights(module))


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (the same parameters, names and training behaviour)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)
