"""The tracer: layer structure found from the module tree, boundary values, templates, FLOPs."""

from __future__ import annotations

import copy
import functools
import resource

import pytest
import torch
from torch import nn

from megatrain.errors import TraceError, UnsupportedModelError
from megatrain.ir.graph import BATCH_PRODUCER, TILE_ALIGN_ELEMENTS
from megatrain.kernels import grouped_query_attention, sequence_chunked
from megatrain.planner.trace import DEFAULT_SEQ_CHUNK_BYTES, trace
from megatrain.planner.trace.fx_util import signature

from conftest import random_batch, tiny_gpt, tiny_llama


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


def test_tied_weights_have_one_owner_and_reach_the_lm_head_as_a_value():
    model = tiny_llama(layers=1, tie_word_embeddings=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = trace(model, micro_batch_size=1, seq_len=8).graph
    placed = [(layer.name, p.name) for layer in g.layers for p in layer.params if "embed" in p.name or "lm_head" in p.name]
    assert placed == [("prologue", "model.embed_tokens.weight")]
    (tied,) = [v for v in g.values if v.name.endswith("_tied")]
    assert (tied.producer, tied.consumers, tied.shape) == (0, (len(g.layers) - 1,), (96, 32))


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


def test_dropout_marks_its_layer_and_zero_dropout_does_not():
    g = trace(tiny_llama(layers=1, attention_dropout=0.0), micro_batch_size=1, seq_len=8).graph
    assert not any(layer.draws_random for layer in g.layers)  # p == 0: no random draws

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))])

        def forward(self, input_ids, labels):
            return self.blocks[0](self.emb(input_ids)).square().mean()

    g = trace(Drop(), micro_batch_size=1, seq_len=3).graph
    assert [layer.draws_random for layer in g.layers] == [False, True, False]
    g = trace(Drop().eval(), micro_batch_size=1, seq_len=3).graph  # eval mode: dropout is the identity
    assert not any(layer.draws_random for layer in g.layers)
    # Attention dropout reaches scaled_dot_product_attention as an argument, not as a dropout op.
    g = trace(tiny_llama(layers=2, attention_dropout=0.1), micro_batch_size=1, seq_len=8).graph
    assert [layer.draws_random for layer in g.layers] == [False, True, True, False]


def test_random_ops_drawing_from_their_own_generator_are_refused():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])
            self.gen = torch.Generator().manual_seed(0)

        def forward(self, input_ids, labels):
            h = self.blocks[0](self.emb(input_ids))
            return (h * torch.rand(h.shape, generator=self.gen)).square().mean()

    # Either export refuses the generator, or the trace names the op: a recompute cannot replay it.
    with pytest.raises((UnsupportedModelError, TraceError), match=r"(?i)generator"):
        trace(Noisy(), micro_batch_size=1, seq_len=3)


# -- replicated blocks -------------------------------------------------------------------------------

def _assert_same_graph(fast, full) -> None:
    assert len(fast.graph.layers) == len(full.graph.layers)
    for a, b in zip(fast.graph.layers, full.graph.layers):
        assert a == b, f"layer {b.name}: replicated {a} != traced {b}"
    assert fast.graph.values == full.graph.values
    assert fast.graph == full.graph
    assert fast.buffer_sources.keys() == full.buffer_sources.keys()
    assert [signature(t) for t in fast.templates] == [signature(t) for t in full.templates]


@pytest.mark.parametrize("make,seq_chunk_bytes", [
    (lambda: tiny_llama(layers=6, device="meta"), DEFAULT_SEQ_CHUNK_BYTES),
    (lambda: tiny_gpt(layers=6), DEFAULT_SEQ_CHUNK_BYTES),
    (lambda: tiny_llama(layers=6, device="meta"), 1000),
], ids=["llama", "gpt", "llama-sequence-chunked"])
def test_replicated_blocks_equal_the_full_trace(make, seq_chunk_bytes):
    model = make()
    fast = trace(model, micro_batch_size=2, seq_len=16, seq_chunk_bytes=seq_chunk_bytes)
    full = trace(model, micro_batch_size=2, seq_len=16, replicate_blocks=False, seq_chunk_bytes=seq_chunk_bytes)
    chunked = [n for t in fast.templates for n in t.graph.nodes if n.target is sequence_chunked]
    assert len(chunked) == (3 if seq_chunk_bytes == 1000 else 0), "two regions per block, one in the head"
    assert fast.graph.meta["trace"] == "replicated" and fast.graph.meta["traced_blocks"] == (0, 3, 5)
    assert full.graph.meta["trace"] == "full"
    _assert_same_graph(fast, full)
    _check_graph_invariants(model, fast.graph)
    # Value names count within their layer, so every block's residual output has the same local name.
    assert len({v.name.split(":")[1] for v in fast.graph.values if v.producer in range(1, 7)}) == 1


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt], ids=["llama", "gpt"])
def test_replicated_blocks_train_exactly_like_the_full_trace(monkeypatch, make):
    import megatrain
    import megatrain.planner.front

    torch.manual_seed(0)
    model = make(layers=4)
    ref = copy.deepcopy(model)
    batches = [random_batch(2, 16, 96, seed=s) for s in range(2)]
    fast = megatrain.compile(model, seq_len=16, micro_batch_size=2, optimizer=dict(lr=3e-3))
    monkeypatch.setattr(megatrain.planner.front, "trace", functools.partial(trace, replicate_blocks=False))
    full = megatrain.compile(ref, seq_len=16, micro_batch_size=2, optimizer=dict(lr=3e-3))
    assert fast.traced.graph.meta["trace"] == "replicated" and full.traced.graph.meta["trace"] == "full"
    assert [fast.step(b).loss for b in batches] == [full.step(b).loss for b in batches]
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name


def test_tracing_leaves_the_users_model_as_it_was():
    from transformers import masking_utils

    packed = masking_utils.find_packed_sequence_indices
    model = tiny_llama(layers=6, device="meta")
    layers, inner = model.model.layers, dict(model.model._modules)
    names = [n for n, _ in model.named_parameters()]
    trace(model, micro_batch_size=1, seq_len=8)
    assert model.model.layers is layers and len(layers) == 6
    assert all(model.model._modules[k] is v for k, v in inner.items()) and model.model._modules.keys() == inner.keys()
    assert [n for n, _ in model.named_parameters()] == names
    assert model.config._attn_implementation == "sdpa"
    assert masking_utils.find_packed_sequence_indices is packed
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_block_that_differs_is_traced_in_full():
    model = tiny_llama(layers=6, device="meta")
    model.model.layers[4].self_attn.scaling = 0.5  # one block attends at another temperature
    g = trace(model, micro_batch_size=1, seq_len=8).graph
    assert g.meta["trace"] == "full" and "'scaling'" in g.meta["trace_full_because"]
    blocks = [layer.template for layer in g.layers[1:-1]]
    assert blocks[4] != blocks[0] and len(set(blocks)) == 2


def _give_hidden_kernels(model, fn_of_block) -> None:
    """Each block's attention a dict of its own naming hub-kernel functions, as transformers 5.6
    and 5.7 build one per module in ``use_kernelized_func`` (``_hidden_kernels``)."""
    for i, block in enumerate(model.model.layers):
        block.self_attn.__dict__["_hidden_kernels"] = {"apply_rotary_pos_emb": fn_of_block(i)}


def test_blocks_with_equal_per_block_kernel_dicts_are_replicated():
    from transformers.models.llama import modeling_llama

    model = tiny_llama(layers=6, device="meta")
    _give_hidden_kernels(model, lambda i: modeling_llama.apply_rotary_pos_emb)
    dicts = [b.self_attn._hidden_kernels for b in model.model.layers]
    assert len({id(d) for d in dicts}) == 6 and all(d == dicts[0] for d in dicts)
    fast = trace(model, micro_batch_size=2, seq_len=16)
    assert fast.graph.meta["trace"] == "replicated", fast.graph.meta.get("trace_full_because")
    _assert_same_graph(fast, trace(model, micro_batch_size=2, seq_len=16, replicate_blocks=False))


def test_blocks_whose_kernel_dicts_name_different_functions_are_traced_in_full():
    from transformers.models.llama import modeling_llama

    def other_rotary(q, k, cos, sin, unsqueeze_dim=1):  # another kernel for block 4: not the same block
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    model = tiny_llama(layers=6, device="meta")
    _give_hidden_kernels(model, lambda i: other_rotary if i == 4 else modeling_llama.apply_rotary_pos_emb)
    g = trace(model, micro_batch_size=1, seq_len=8).graph
    assert g.meta["trace"] == "full"
    assert g.meta["trace_full_because"] == (
        "attribute '_hidden_kernels' of model.layers.<i>.self_attn differs between blocks")


@pytest.mark.parametrize("a,b,same", [
    ({"f": torch.add}, {"f": torch.add}, True),
    ({"f": torch.add}, {"f": torch.mul}, False),
    ({"f": torch.add, "g": torch.mul}, {"g": torch.mul, "f": torch.add}, False),  # walked in order
    ({}, {}, True),
    ([1, (2, "x")], [1, (2, "x")], True),
    ([1, (2, "x")], [1, (2, "y")], False),
    ([1], (1,), False),
    ({1, 2}, {2, 1}, True),
    ([torch.zeros(1)], [torch.zeros(1)], False),  # each block's own tensor
    (functools.partial(torch.add, alpha=2), functools.partial(torch.add, alpha=2), True),
], ids=["dict-same-fn", "dict-other-fn", "dict-order", "dict-empty", "nested", "nested-differs",
        "list-vs-tuple", "set", "own-tensors", "partial"])
def test_block_attributes_compare_containers_by_their_contents(a, b, same):
    from megatrain.planner.trace.replicate import _attr_key

    assert (_attr_key(a) == _attr_key(b)) is same


def test_a_self_referring_container_is_compared_by_identity_past_a_depth():
    from megatrain.planner.trace.replicate import _attr_key

    a, b = [], []
    a.append(a)
    b.append(b)
    assert _attr_key(a) == _attr_key(a) and _attr_key(a) != _attr_key(b)


def test_a_loop_that_treats_a_traced_block_differently_is_traced_in_full():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
            self.out = nn.Linear(8, 16)

        def forward(self, input_ids, labels):
            x = self.emb(input_ids)
            for i, block in enumerate(self.blocks):
                x = torch.tanh(block(x))
                if i == len(self.blocks) // 2:  # glue after the middle block only
                    x = x * 2
            return nn.functional.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())

    g = trace(Net(), micro_batch_size=1, seq_len=4).graph
    assert g.meta["trace"] == "full" and "differ" in g.meta["trace_full_because"]
    blocks = [layer.template for layer in g.layers[1:-1]]
    # Block 2 multiplies; the last block's tanh runs after it and so belongs to the epilogue.
    assert blocks[0] == blocks[1] == blocks[3] and len({blocks[0], blocks[2], blocks[4]}) == 3


def test_per_layer_attention_types_are_traced_in_full_and_keep_their_sliding_mask():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      use_sliding_window=True, sliding_window=4, max_window_layers=2, tie_word_embeddings=False)
    assert cfg.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    model = Qwen2ForCausalLM(cfg)
    ref = copy.deepcopy(model)
    t = trace(model, micro_batch_size=2, seq_len=16)
    assert t.graph.meta["trace"] == "full"
    masks = [v for v in t.graph.values if v.shape == (2, 1, 16, 16)]
    assert len(masks) == 1 and masks[0].consumers == (3, 4), "only the sliding-window layers read a mask"
    # And the sliding-window layers compute what eager transformers computes.
    import megatrain

    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, optimizer=dict(lr=1e-3))
    batch = random_batch(2, 16, 96, seed=0)
    want = ref(**batch).loss.item()
    assert trainer.step(batch).loss == pytest.approx(want, rel=1e-5)


# -- the causal mask ---------------------------------------------------------------------------------

def test_causal_lm_traces_without_a_materialised_mask():
    S = 48  # no other dimension of the tiny model is 48
    model = tiny_llama(layers=2, device="meta")
    t = trace(model, micro_batch_size=2, seq_len=S)
    assert t.graph.meta["skip_causal_mask"] is True
    assert not [v for v in t.graph.values if list(v.shape).count(S) > 1], "no S x S boundary value"
    # GQA attention (tiny_llama: 4 query, 2 KV heads) calls the kernel that takes SDPA's arguments.
    sdpa = [n for gm in t.templates for n in gm.graph.nodes
            if n.target in (torch.ops.aten.scaled_dot_product_attention.default, grouped_query_attention)]
    assert sdpa and all(len(n.args) > 5 and n.args[3] is None and n.args[5] is True for n in sdpa), \
        "attention runs with is_causal and no mask tensor"
    for gm in t.templates:
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            assert not (isinstance(v, torch.Tensor) and list(v.shape).count(S) > 1), f"{n.name} is S x S"


def test_an_attention_mask_input_keeps_the_mask():
    S = 32
    model = tiny_llama(layers=2, device="meta")
    g = trace(model, micro_batch_size=2, seq_len=S, input_names=("input_ids", "attention_mask", "labels")).graph
    assert g.meta["skip_causal_mask"] is False
    assert any(v.shape == (2, 1, S, S) for v in g.values), "padding needs the mask"
    assert model.config._attn_implementation == "sdpa"


def test_llama2_7b_at_512k_traces_on_meta_in_seconds_with_no_sequence_squared_value():
    """What keeps the trace to seconds is checked, not the seconds (bench/plan_scale.py times it):
    three blocks are exported and the rest replicated, and nothing S x S is built."""
    from megatrain.planner.presets import build_meta_model, load_model_config

    S, d, vocab = 524288, 4096, 32000
    model = build_meta_model(load_model_config("llama-2-7b"), dtype=torch.bfloat16)
    traced = trace(model, micro_batch_size=1, seq_len=S)
    g = traced.graph
    assert g.meta["trace"] == "replicated" and g.meta["skip_causal_mask"] is True
    residual = S * d * 2
    assert max(v.nbytes for v in g.values) == residual, "nothing crosses a layer bigger than the residual stream"
    head = g.layers[-1]
    assert head.fwd_flops == 2 * S * d * vocab and head.bwd_flops == 3 * head.fwd_flops
    assert head.work_bytes < S * vocab * 4 // 2, "the LM head's logits are chunked"
    # Each block runs its two token-wise regions (norm, q/k/v, rotary; o proj, norm, MLP) in chunks
    # of the sequence; what stays whole is attention's q, k, v, output and their gradients.
    block = g.layers[1]
    calls = [n for n in traced.templates[block.template].graph.nodes if n.target is sequence_chunked]
    assert len(calls) == 2 and all(16 <= n.args[1] <= 64 for n in calls)
    assert 36 * 2**30 < block.work_bytes < 48 * 2**30, f"{block.work_bytes / 2**30:.1f} GiB"


# -- the package's shape ---------------------------------------------------------------------------

def test_trace_runs_one_visible_list_of_named_passes():
    """``trace()`` is the pipeline PASSES names, in this order; a new pass is added here on purpose."""
    from megatrain.planner.trace import PASSES

    assert [p.__name__ for p in PASSES] == ["export", "clean", "sum_token_loss", "cut", "fuse_lm_head_loss",
                                            "chunk_sequences", "share_templates", "measure", "build_graph",
                                            "replicate"]


def test_public_surface_and_old_import_paths():
    import megatrain.kernels as kernels
    import megatrain.ir.graph as graph
    import megatrain.planner.trace as trace_pkg

    assert sorted(trace_pkg.__all__) == sorted([
        "DEFAULT_LOSS_CHUNK_BYTES", "DEFAULT_SEQ_CHUNK_BYTES", "MIXED", "PASSES", "TraceContext", "TraceOptions",
        "TracedModel", "chunk_lm_head_loss", "chunk_sequence_regions", "erase_metadata_asserts",
        "install_grouped_query_attention", "keep_position_math_fp32", "retarget", "run_passes", "sequence_dims",
        "trace"])
    assert sorted(kernels.__all__) == sorted([
        "REDUCTIONS", "chunk_bounds", "expand_kv_heads", "gqa_needs_expansion", "grouped_query_attention",
        "linear_cross_entropy", "linear_cross_entropy_work_bytes", "sequence_chunked", "without_autocast"])
    # The IR owns TracedModel and retarget; the trace re-exports them for old imports.
    assert trace_pkg.TracedModel is graph.TracedModel and trace_pkg.retarget is graph.retarget


def _imports(path) -> set[str]:
    import ast

    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            out.add(n.module)
    return out


def test_the_trace_and_the_kernels_import_no_runtime():
    """Layering: the planner's trace and the kernels it installs never import the runtime (or the
    kernels the planner), and the IR module imports torch only inside ``retarget``."""
    import ast
    import pathlib

    import megatrain

    root = pathlib.Path(megatrain.__file__).parent
    for path in [*(root / "planner" / "trace").glob("*.py"), *(root / "kernels").glob("*.py")]:
        bad = {m for m in _imports(path) if m.startswith("megatrain.runtime") or m == "megatrain.trainer"}
        assert not bad, f"{path.relative_to(root)} imports {sorted(bad)}"
    for path in (root / "kernels").glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith("megatrain.planner")}, path.name
    top = ast.parse((root / "ir" / "graph.py").read_text()).body
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "torch" in ast.unparse(n) for n in top)


# -- BF16 compute: the BF16-built template ----------------------------------------------------------

def test_bf16_compute_traces_the_bf16_built_model_and_halves_checkpoint_bytes():
    """Traced with BF16 parameters (what compile does for BF16 compute) every floating value a layer
    passes on is BF16, half its FP32 bytes, the loss excepted (the model's loss upcasts to FP32), so
    the plan's checkpoints take half the bytes; the model's own parameters are left as they were."""
    from megatrain.planner import cost
    from megatrain.ir.plan import Plan

    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    before = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
    fp32 = trace(model, micro_batch_size=2, seq_len=16).graph
    bf16 = trace(model, micro_batch_size=2, seq_len=16, param_dtype=torch.bfloat16).graph
    assert {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()} == before
    assert (fp32.meta["param_dtype"], bf16.meta["param_dtype"]) == ("float32", "bfloat16")
    floats = [(a, b) for a, b in zip(fp32.values, bf16.values) if a.dtype == "float32" and a.id != fp32.loss]
    assert floats and all(b.dtype == "bfloat16" and 2 * b.nbytes == a.nbytes for a, b in floats)
    assert bf16.values[bf16.loss].dtype == "float32"
    plan = Plan(micro_batches=2)
    peak = {g.meta["param_dtype"]: cost.memory_breakdown(g, plan).activations_peak for g in (fp32, bf16)}
    ints = sum(v.nbytes for v in fp32.values if v.dtype == "int64") * plan.micro_batches
    assert peak["bfloat16"] - ints <= (peak["float32"] - ints) / 2, peak


def test_megatrain_plan_and_compile_trace_the_same_graph():
    """`megatrain plan` (trace_preset: the model built on meta in FP32, traced in the compute dtype)
    and compile (the user's FP32 model, traced in the compute dtype) plan the same layer graph."""
    import megatrain
    from megatrain.planner.presets import trace_preset

    model = tiny_llama(layers=3)
    planned = trace_preset(model.config, seq_len=16, compute_dtype="bfloat16", micro_batch_size=2).graph
    compiled = megatrain.plan_model(model, seq_len=16, micro_batch_size=2, compute_dtype="bfloat16").graph
    assert [(v.name, v.shape, v.dtype, v.nbytes) for v in planned.values] == \
        [(v.name, v.shape, v.dtype, v.nbytes) for v in compiled.values]
    assert [(x.name, x.numel, x.work_bytes, x.fwd_flops, x.bwd_flops, x.fwd_launches, x.bwd_launches)
            for x in planned.layers] == \
        [(x.name, x.numel, x.work_bytes, x.fwd_flops, x.bwd_flops, x.fwd_launches, x.bwd_launches)
         for x in compiled.layers]
    assert planned.meta["param_dtype"] == compiled.meta["param_dtype"] == "bfloat16"
