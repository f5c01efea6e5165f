"""Frozen parameters (``requires_grad=False``): no weight gradient leaves the GPU, no AdamW state
is kept (only the FP32 master), the planner counts that, and training equals eager PyTorch."""

from __future__ import annotations

import pytest
import torch

from megatrain.planner import cost
from megatrain.ir.schedule import OpKind

from conftest import tiny_llama
from test_exactness import assert_same_training


def freeze(model) -> list[str]:
    """Freeze the input embedding, the whole first block and one MLP weight of the second block
    (a layer frozen in part: its frozen weight is laid out after the trainable prefix)."""
    frozen = [model.model.embed_tokens.weight, *model.model.layers[0].parameters(),
              model.model.layers[1].mlp.up_proj.weight]
    for p in frozen:
        p.requires_grad_(False)
    return [n for n, p in model.named_parameters() if not p.requires_grad]


@pytest.mark.parametrize("micro_batches, max_grad_norm", [(1, None), (2, None), (2, 0.5)])
def test_a_frozen_subset_trains_as_eager(micro_batches, max_grad_norm):
    # A fixed initialisation, not whatever the tests before left in the global generator.
    torch.manual_seed(1)
    model = tiny_llama(layers=3)
    names = freeze(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    trainer = assert_same_training(model, steps=8, micro_batches=micro_batches, max_grad_norm=max_grad_norm)
    after = dict(model.named_parameters())
    for n, p in before.items():
        assert torch.equal(after[n], p), f"frozen {n} changed"
    assert any(not p.requires_grad for p in model.parameters()), "binding keeps requires_grad"
    assert trainer.step_count == 8


def test_frozen_parameters_have_no_optimizer_state_and_no_gradient_copy():
    import megatrain

    model = tiny_llama(layers=3)
    freeze(model)
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2)
    layers = trainer.graph.layers
    frozen = [li for li, layer in enumerate(layers) if layer.trainable_numel == 0]
    partial = [li for li, layer in enumerate(layers) if 0 < layer.trainable_numel < layer.numel]
    assert frozen and partial, [(layer.name, layer.numel, layer.trainable_numel) for layer in layers]
    # Host: the master of every parameter, the two moments of the trainable ones only.
    numel = sum(layer.numel for layer in layers)
    trainable = sum(layer.trainable_numel for layer in layers)
    assert trainer.host.nbytes == 4 * numel + 8 * trainable < 12 * numel
    for li, layer in enumerate(layers):
        assert trainer.host.master(li).numel() == layer.numel
        assert trainer.host.exp_avg(li).numel() == trainer.host.exp_avg_sq(li).numel() == layer.trainable_numel
    mem = cost.memory_breakdown(trainer.graph, trainer.plan)
    assert mem.master_weights + mem.adam_moments == trainer.host.nbytes
    # The schedule: no gradient copy and no optimizer step for a layer with nothing to train; a
    # partly frozen layer copies out only its trainable prefix.
    ops = trainer.schedule.ops
    for li in frozen:
        assert not [op for op in ops if op.layer == li and op.kind in (OpKind.D2H, OpKind.OPT, OpKind.ACC)]
    for li in partial:
        assert cost.d2h_bytes(layers[li]) == layers[li].trainable_numel * cost.GRAD_ITEMSIZE
    # The checkpoint's optimizer rows are the trainable prefix's.
    sd = trainer.state_dict()
    for layer in layers:
        assert sd["optimizer"][f"{layer.name}.exp_avg"].shape == (layer.trainable_numel,)
