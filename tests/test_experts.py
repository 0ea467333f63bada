"""`run_experts` computes each row through its slot's expert whichever batched path it takes."""

import pytest
import torch
import torch.nn.functional as F

from dspark_cluster.model.layers import run_experts


def reference(xs, slots, w13, w2):
    inter = w2.shape[-1]
    rows = []
    for x, s in zip(xs, slots):
        h = x @ w13[s].T
        rows.append((F.silu(h[:inter]) * h[inter:]) @ w2[s].T)
    return torch.stack(rows) if rows else xs.new_zeros(0, w2.shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, inter", [(64, 32), (18, 6)])  # 18 x 6: rows too narrow for the grouped kernel
@pytest.mark.parametrize("layout", ["decode", "skewed", "empty_slots", "no_rows"])
def test_run_experts_matches_a_per_row_reference(dtype, hidden, inter, layout):
    g = torch.Generator().manual_seed(0)
    n_slots = 4
    w13 = torch.randn(n_slots, 2 * inter, hidden, generator=g).to(dtype)
    w2 = torch.randn(n_slots, hidden, inter, generator=g).to(dtype)
    n = {"decode": 16, "skewed": 100, "empty_slots": 40, "no_rows": 0}[layout]
    slots = {"decode": torch.randint(0, n_slots, (n,), generator=g),  # few rows per slot: the padded bmm
             "skewed": torch.cat([torch.zeros(90, dtype=torch.long), torch.arange(10) % n_slots]),  # grouped matmul
             "empty_slots": torch.full((n,), 2),
             "no_rows": torch.zeros(0, dtype=torch.long)}[layout]
    xs = torch.randn(n, hidden, generator=g).to(dtype)
    ys, counts = run_experts(xs, slots, w13, w2)
    assert counts.tolist() == torch.bincount(slots, minlength=n_slots).tolist()
    ref = reference(xs.float(), slots, w13.float(), w2.float())
    assert ys.shape == (n, hidden) and ys.dtype == dtype
    if n:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((ys.float() - ref).abs().max() / ref.abs().max()) <= tol
