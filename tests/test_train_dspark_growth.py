"""Growing a saved drafter for fine-tuning (`launch/train_dspark.py --init-from` with a wider Markov head, more
layers or a Markov gate) keeps the function it computes: the new parts start as no-ops."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))

from train_dspark import add_new_parts, widen_markov  # noqa: E402

from dspark_cluster.speculative.dspark_model import DSparkConfig, DSparkDrafter  # noqa: E402


def drafter(num_layers: int, markov_rank: int, seed: int, markov_gate: bool = False) -> DSparkDrafter:
    torch.manual_seed(seed)
    c = DSparkConfig(target_hidden_size=32, vocab_size=64, target_layer_ids=[0, 1], hidden_size=32,
                     num_layers=num_layers, num_heads=4, intermediate_size=48, block_size=4, markov_rank=markov_rank,
                     markov_gate=markov_gate, confidence_head=True, mask_token_id=1)
    d = DSparkDrafter(c)
    for p in d.parameters():  # a trained-looking drafter: no zero blocks (markov_out starts at zero)
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(7)
    d.set_target_tables(torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g))
    return d.eval()


@pytest.mark.parametrize("layers, rank, gate", [(3, 8, False), (2, 16, False), (4, 16, False), (2, 8, True),
                                               (3, 16, True)])
def test_a_grown_drafter_computes_what_the_saved_one_did(layers, rank, gate):
    old = drafter(2, 8, seed=0)
    new = drafter(layers, rank, seed=1, markov_gate=gate)
    state = add_new_parts(widen_markov(old.state_dict(), new.state_dict()), new.state_dict())
    new.load_state_dict(state, strict=True)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 20), generator=g)
    hidden = torch.randn(2, 20, 64, generator=g)
    anchors = torch.tensor([[3, 9, 14], [0, 5, 15]])
    with torch.no_grad():
        z0, c0 = old.forward_train(tokens, hidden, anchors)
        z1, c1 = new.forward_train(tokens, hidden, anchors)
    torch.testing.assert_close(z1, z0, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(c1, c0, rtol=1e-5, atol=1e-5)
    # the new parts are trainable, not frozen at zero: their gradients are not all zero
    new.train()
    z, c = new.forward_train(tokens, hidden, anchors)
    (z.logsumexp(-1).sum() + c.sum()).backward()
    if layers > 2:
        assert new.layers[-1].o_proj.weight.grad.abs().sum() > 0
    if rank > 8:
        assert new.markov_out.weight.grad[:, 8:].abs().sum() > 0
    if gate:
        assert new.markov_gate.weight.grad.abs().sum() > 0
