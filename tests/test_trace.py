"""The tracer: layer structure found from the module tree, boundary values, templates, FLOPs."""

from __future__ import annotations

import resource

import pytest
import torch
from torch import nn

from megatrain.errors import TraceError, UnsupportedModelError
from megatrain.planner.graph import BATCH_PRODUCER, TILE_ALIGN_ELEMENTS
from megatrain.planner.trace import trace

from conftest import tiny_gpt, tiny_llama


def _check_graph_invariants(model: nn.Module, g) -> None:
    names = [p.name for layer in g.layers for p in layer.params]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()), "each parameter in exactly one layer"
    for layer in g.layers:
        end = 0
        for p in layer.params:
            assert p.offset % TILE_ALIGN_ELEMENTS == 0 and p.offset >= end, "aligned, non-overlapping"
            end = p.offset + p.numel
        assert end <= layer.numel
    for v in g.values:
        assert all(c > v.producer for c in v.consumers)
        for c in v.consumers:
            assert v.id in g.layers[c].inputs
        if v.producer != BATCH_PRODUCER:
            assert v.id in g.layers[v.producer].outputs


@pytest.mark.parametrize("layers", [1, 3])
def test_llama_layers_are_prologue_blocks_epilogue(layers):
    model = tiny_llama(layers=layers, device="meta")
    g = trace(model, micro_batch_size=2, seq_len=16).graph
    assert [l.name for l in g.layers] == ["prologue"] + [f"model.layers.{i}" for i in range(layers)] + ["epilogue"]
    _check_graph_invariants(model, g)
    assert {l.template for l in g.layers[1:-1]} == {1}, "identical blocks share one template"
    # The residual stream is the only differentiable value between consecutive blocks.
    for b in g.layers[1:-1]:
        diff = [v for v in b.inputs if g.values[v].requires_grad]
        assert len(diff) == 1 and g.values[diff[0]].shape == (2, 16, 32)
    loss = g.values[g.loss]
    assert loss.shape == () and loss.producer == len(g.layers) - 1


def test_gpt_traces_the_same_way():
    model = tiny_gpt(layers=3)
    g = trace(model, micro_batch_size=2, seq_len=8).graph
    assert [l.name for l in g.layers] == ["prologue", "blocks.0", "blocks.1", "blocks.2", "epilogue"]
    _check_graph_invariants(model, g)
    assert len({l.template for l in g.layers}) == 3


def test_flops_match_the_matmul_count():
    b, t, d, ff, heads = 2, 16, 32, 64, 4
    model = tiny_llama(layers=1, hidden=d, device="meta")
    g = trace(model, micro_batch_size=b, seq_len=t).graph
    block = g.layers[1]
    kv = d // 2  # 2 of 4 heads for k and v
    proj = 2 * b * t * (d * d + 2 * d * kv + d * d + 3 * d * ff)
    attn = 2 * 2 * b * heads * t * t * (d // heads)
    assert block.fwd_flops == proj + attn
    # Local backward = recompute (1x) + grads for weights and inputs (2x).
    assert block.bwd_flops == 3 * block.fwd_flops


def test_block_container_is_found_without_class_names():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.small = nn.ModuleList([nn.Linear(8, 8)])
            self.stack = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
            self.out = nn.Linear(8, 50)

        def forward(self, input_ids, labels):
            x = self.small[0](self.emb(input_ids))
            for m in self.stack:
                x = torch.tanh(m(x))
            return nn.functional.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())

    g = trace(Net(), micro_batch_size=1, seq_len=4).graph
    assert [l.name for l in g.layers] == ["prologue", "stack.0", "stack.1", "stack.2", "epilogue"]
    assert [p.name for p in g.layers[0].params] == ["emb.weight", "small.0.weight", "small.0.bias"]


def test_model_with_data_dependent_control_flow_names_the_module():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if self.lin(x).sum() > 0:  # data-dependent branch: cannot be exported
                return x
            return -x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.gate = Gate()

        def forward(self, input_ids, labels):
            return self.gate(self.emb(input_ids)).sum()

    with pytest.raises(TraceError, match="'gate'"):
        trace(Net(), micro_batch_size=1, seq_len=3)


def test_tied_weights_are_refused_with_the_fix():
    model = tiny_llama(layers=1, tie_word_embeddings=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(UnsupportedModelError, match="tie_word_embeddings=False"):
        trace(model, micro_batch_size=1, seq_len=8)


def test_no_trainable_parameters_is_an_error():
    model = tiny_gpt(layers=1)
    model.requires_grad_(False)
    with pytest.raises(UnsupportedModelError, match="no trainable parameters"):
        trace(model, micro_batch_size=1, seq_len=8)


def test_model_without_loss_is_an_error():
    model = tiny_gpt(layers=1)
    with pytest.raises(TraceError, match="pass labels"):
        trace(model, micro_batch_size=1, seq_len=8, input_names=("input_ids",))


@pytest.mark.slow
def test_llama_70b_traces_on_meta_without_parameter_memory():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    g = trace(model, micro_batch_size=1, seq_len=4096).graph
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    assert 70.0e9 < g.param_count < 71.0e9
    assert len(g.layers) == 82 and len({l.template for l in g.layers}) == 3
    assert grown_gib < 2.0, f"tracing grew the process by {grown_gib:.1f} GiB; 70B in FP32 would be 280 GB"


def test_dropout_is_refused_but_zero_dropout_is_fine():
    model = tiny_llama(layers=1, attention_dropout=0.0)
    trace(model, micro_batch_size=1, seq_len=8)  # p == 0: no random draws, fine

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))])

        def forward(self, input_ids, labels):
            return self.blocks[0](self.emb(input_ids)).square().mean()

    with pytest.raises(UnsupportedModelError, match=r"'blocks.0.1'.*dropout"):
        trace(Drop(), micro_batch_size=1, seq_len=3)
    trace(Drop().eval(), micro_batch_size=1, seq_len=3)  # eval mode: dropout is the identity
