"""Traced templates keep eager numerics across transformers versions: no dtype asserts left in
nested graphs, rotary angle math in FP32 under BF16 autocast, and grouped-query attention that
a fused SDPA kernel accepts in FP32. Model configs are checked the same on every version (recent
transformers validate some values themselves, older ones none), and none runs a directory's code."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
import torch.fx as fx

import megatrain.planner.trace.cleanup as cleanup
from megatrain.kernels import expand_kv_heads, gqa_needs_expansion, grouped_query_attention, without_autocast
from megatrain.ir.graph import retarget
from megatrain.planner.trace import trace
from megatrain.planner.trace.fx_util import bind

from conftest import requires_cuda, tiny_llama

aten = torch.ops.aten
POSITIONS = 4096


def _graphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def _layer_args(model: nn.Module, traced, li: int, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Layer ``li``'s template arguments, as the executor passes them: parameters, buffers, inputs."""
    g = traced.graph
    layer = g.layers[li]
    named = dict(model.named_parameters())
    params = [named[p.name].detach() for p in layer.params]
    buffers = []
    for b in layer.buffers:
        kind, src = traced.buffer_sources[b]
        buffers.append(model.get_buffer(src) if kind == "buffer" else src)
    inputs = [batch[g.values[v].name] for v in layer.inputs]
    return params + buffers + inputs


def _prologue_tables(model: nn.Module, seq_len: int = POSITIONS):
    """The prologue's outputs run in FP32 and under BF16 autocast, and the FP32 run's rotary tables."""
    traced = trace(model, micro_batch_size=1, seq_len=seq_len)
    tmpl = retarget(traced.templates[traced.graph.layers[0].template], "cpu")
    ids = torch.randint(0, 96, (1, seq_len), generator=torch.Generator().manual_seed(0))
    args = _layer_args(model, traced, 0, {"input_ids": ids, "labels": ids})
    with torch.no_grad():
        fp32 = tmpl(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = tmpl(*args)
    # The tables: the float outputs that depend on no parameter (the embedding output does).
    values = [traced.graph.values[v] for v in traced.graph.layers[0].outputs]
    tables = [o for o, v in zip(fp32, values) if o.dtype.is_floating_point and not v.requires_grad]
    return fp32, bf16, tables


def _angle_bound(positions: int) -> float:
    # An FP32 angle p * inv_freq (inv_freq <= 1, one rounding) is off by at most |angle| * 2**-24, and
    # cos/sin are 1-Lipschitz; their FP32 evaluation adds a few ulp of 1 (2**-23 each). Doubled for slack.
    return 2 * (positions * 2.0**-24 + 4 * 2.0**-23)


def _check_tables_fp32(fp32, bf16, tables, inv_freq: torch.Tensor) -> None:
    assert len(tables) == 2, "the prologue passes the cos and sin tables to the blocks"
    # Autocast recasts none of the prologue's ops (the angle matmul runs with autocast off), so the
    # BF16-autocast run computes every output with the same FP32 kernels on the same inputs: equal.
    for a, b in zip(fp32, bf16):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # And they are the FP32 tables, not merely self-consistent: against float64 angles from the same inv_freq.
    pos = torch.arange(POSITIONS, dtype=torch.float64)
    angles = pos[:, None] * inv_freq.double()[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    refs = {"cos": emb.cos(), "sin": emb.sin()}
    matched = {}
    for t in tables:
        name, err = min(((k, (t[0].double() - r).abs().max().item()) for k, r in refs.items()), key=lambda x: x[1])
        assert err <= _angle_bound(POSITIONS), f"{name} table off by {err:.2e} at {POSITIONS} positions"
        matched[name] = err
    assert set(matched) == {"cos", "sin"}

def test_hf_rotary_tables_under_bf16_autocast_equal_fp32_at_4096_positions():
    """Whatever the installed transformers computes its rotary angles with (transformers 5.17: a matmul
    in an autocast-disabled region export drops; newer: an elementwise product), the traced prologue
    under BF16 autocast yields the FP32 cos/sin. In BF16 the angle at position 4095 would be off by
    up to 8 rad and cos/sin by up to 2.0."""
    torch.manual_seed(0)
    model = tiny_llama(layers=1)
    fp32, bf16, tables = _prologue_tables(model)
    _check_tables_fp32(fp32, bf16, tables, model.model.rotary_emb.inv_freq)


class _MatmulRotary(nn.Module):
    """Rotary tables computed as transformers 5.17 does: ``inv_freq @ position_ids`` under no_grad,
    with autocast switched off only where it is on (so export, which runs without it, sees nothing)."""

    def __init__(self, dim: int):
        super().__init__()
        inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(torch.float)
        pos = position_ids[:, None, :].float()
        dev = x.device.type
        off = torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else contextlib.nullcontext()
        with off:
            freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class _RotaryNet(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rotary = _MatmulRotary(dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = self.rotary(x, pos)
        for blk in self.blocks:
            x = x + blk(x * cos + x * sin)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_matmul_rotary_tables_stay_fp32_under_bf16_autocast():
    """The 5.17 pattern on any installed transformers: the angle matmul becomes a without_autocast call
    inside the no_grad body, and the tables equal the FP32 ones at 4096 positions."""
    torch.manual_seed(0)
    model = _RotaryNet()
    traced = trace(model, micro_batch_size=1, seq_len=16)
    pro = traced.templates[traced.graph.layers[0].template]
    pinned = [n for m in _graphs(pro) for n in m.graph.nodes if n.target is without_autocast]
    assert [n.args[0] for n in pinned] == [aten.matmul.default]
    holders = [m for m in _graphs(pro) if any(n.target is without_autocast for n in m.graph.nodes)]
    assert holders and all(m is not pro for m in holders), "the matmul sits in the nested no_grad graph"
    blocks = [traced.templates[L.template] for L in traced.graph.layers[1:]]
    assert not any(n.target is without_autocast for b in blocks for m in _graphs(b) for n in m.graph.nodes), \
        "matmuls that read parameters keep autocast"
    fp32, bf16, tables = _prologue_tables(model)
    _check_tables_fp32(fp32, bf16, tables, model.rotary.inv_freq)


def test_without_the_pass_the_check_sees_bf16_angles(monkeypatch):
    """The assertion above can fail: with the pass off the same template's BF16 tables are off by more
    than 0.5 (BF16 keeps 8 bits: position 4095 rounds to 4096, an angle error of 1 rad at inv_freq 1)."""
    torch.manual_seed(0)
    monkeypatch.setattr(cleanup, "keep_position_math_fp32", lambda gm, learned: 0)
    fp32, bf16, tables = _prologue_tables(_RotaryNet())
    pairs = [(a, b) for a, b in zip(fp32, bf16) if any(a is t for t in tables)]
    assert len(pairs) == 2 and max((a - b.float()).abs().max().item() for a, b in pairs) > 0.5


def _metadata_asserts(traced) -> list[fx.Node]:
    return [n for t in traced.templates for m in _graphs(t) for n in m.graph.nodes
            if n.target is aten._assert_tensor_metadata.default]


@pytest.mark.parametrize("make", [_RotaryNet, lambda: tiny_llama(layers=1)], ids=["nested-rotary", "llama"])
def test_no_dtype_asserts_survive_in_any_nested_graph(make):
    """Export's ``_assert_tensor_metadata`` checks pin the FP32 trace dtypes; under autocast they
    fail (transformers 5.17: 'Tensor dtype mismatch') wherever they are, nested graphs included:
    _RotaryNet's no_grad rotary body (5.17's pattern, a nested graph on any transformers) and the
    installed transformers' Llama, whatever it nests."""
    traced = trace(make(), micro_batch_size=1, seq_len=8)
    assert not _metadata_asserts(traced)


def test_erase_metadata_asserts_reaches_nested_graphs():
    """The test above can fail: the pass removes the asserts from a graph and from the graphs nested
    in it (torch 2.13's export no longer emits them for these models, older ones did), and nothing
    else; a nested graph is a submodule its parent calls, as export's no_grad bodies are."""

    def with_assert(body):
        g = fx.Graph()
        x = g.placeholder("x")
        g.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
        g.output(body(g, x))
        return g

    inner = fx.GraphModule(nn.Module(), with_assert(lambda g, x: g.call_function(aten.cos.default, (x,))))
    root = nn.Module()
    root.body = inner
    outer = fx.GraphModule(root, with_assert(lambda g, x: g.call_module("body", (x,))))
    asserts = lambda: [n for m in _graphs(outer) for n in m.graph.nodes  # noqa: E731
                       if n.target is aten._assert_tensor_metadata.default]
    assert len(asserts()) == 2 and len(_graphs(outer)) == 2
    cleanup.erase_metadata_asserts(outer)
    assert not asserts()
    x = torch.randn(3)
    assert torch.equal(outer(x), x.cos()), "the computation is kept"


# -- grouped-query attention ---------------------------------------------------------------------

def _calls_to(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for m in _graphs(gm) for n in m.graph.nodes if n.target is target]


def test_gqa_attention_is_routed_through_the_expanding_kernel():
    """FP32 on CUDA runs SDPA on the memory-efficient kernel, which rejects ``enable_gqa``: the traced
    block of a GQA model (4 query, 2 KV heads) must not call SDPA with enable_gqa directly, or the
    math kernel would hold [B, H, S, S] scores the memory model does not count."""
    traced = trace(tiny_llama(layers=1), micro_batch_size=2, seq_len=16)
    block = traced.templates[traced.graph.layers[1].template]
    assert not [n for n in _calls_to(block, aten.scaled_dot_product_attention.default) if bind(n).get("enable_gqa")]
    (att,) = _calls_to(block, grouped_query_attention)
    q, k, v = (att.args[i].meta["val"] for i in range(3))
    assert (q.shape[1], k.shape[1], v.shape[1]) == (4, 2, 2)
    assert att.args[5] is True and att.args[3] is None, "causal, with no materialised mask"


def test_expanded_kv_is_counted_in_the_work_bytes(monkeypatch):
    """The block's modelled working memory grows by at least the expanded K and V, which the
    expanding path holds from the forward to the attention's backward."""
    b, s, heads, hd = 2, 64, 4, 8
    routed = trace(tiny_llama(layers=1), micro_batch_size=b, seq_len=s).graph.layers[1].work_bytes
    monkeypatch.setattr(cleanup, "install_grouped_query_attention", lambda gm: 0)
    plain = trace(tiny_llama(layers=1), micro_batch_size=b, seq_len=s).graph.layers[1].work_bytes
    assert routed - plain >= 2 * b * heads * s * hd * 4


def test_gqa_with_attention_dropout_counts_the_math_kernels_scores():
    """With attention dropout the kernel keeps eager's math kernel (its dropout masks are eager's):
    the block's modelled working memory grows by the softmax output, the mask and the dropped
    scores, [B, H, S, S] each (FP32, FP32, bool), that it saves for the backward."""
    b, s, heads = 2, 64, 4
    plain = trace(tiny_llama(layers=1).train(), micro_batch_size=b, seq_len=s).graph.layers[1].work_bytes
    dropped = trace(tiny_llama(layers=1, attention_dropout=0.1).train(), micro_batch_size=b,
                    seq_len=s).graph.layers[1].work_bytes
    assert dropped - plain >= b * heads * s * s * (2 * 4 + 1)


def _gqa_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, generator=gen) for h in (6, 2, 2))
    return q, k, v, torch.randn(2, 6, 12, 8, generator=gen)


def _run(fn, q, k, v, seed):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(seed)
    return out.detach(), [t.grad for t in leaves]


def test_the_kernel_is_sdpa_itself_on_cpu():
    """Off CUDA no kernel needs the expansion: the same SDPA call, bit for bit, so CPU exactness
    against eager transformers is untouched."""
    q, k, v, seed = _gqa_inputs()
    assert not gqa_needs_expansion(q, k, v, is_causal=True)
    want = _run(lambda *x: F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True), q, k, v, seed)
    got = _run(lambda *x: grouped_query_attention(*x, None, 0.0, True), q, k, v, seed)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_the_expanding_path_equals_enable_gqa_in_value_and_gradient():
    """What runs on CUDA in FP32, checked on CPU: head h reads KV head h // group, as SDPA's GQA does."""
    q, k, v, seed = _gqa_inputs()
    assert torch.equal(expand_kv_heads(k, 6), k.repeat_interleave(3, dim=1))
    want = _run(lambda *x: F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True), q, k, v, seed)
    got = _run(lambda *x: grouped_query_attention(*x, None, 0.0, True, expand=True), q, k, v, seed)
    # Same inputs to one attention kernel: the forward and dq can differ only by the kernel's
    # blocking (a few FP32 roundings of values of size max|out|); dk and dv also sum the group's 3
    # head gradients in another order (3 more roundings).
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(got[0], want[0], rtol=0, atol=8 * eps * want[0].abs().max().item())
    for a, b in zip(got[1], want[1]):
        assert torch.allclose(a, b, rtol=0, atol=8 * eps * 3 * b.abs().max().item())
    with pytest.raises(ValueError, match="not a multiple"):
        expand_kv_heads(k, 5)


def test_sdpa_is_asked_once_per_call_signature(monkeypatch):
    """gqa_needs_expansion runs in every forward and recompute of every block: SDPA's checks (and the
    stand-in tensors they need in the compute dtype) run once per signature, and a change of shape,
    dtype, causality or grad mode asks again. Checked on CPU through the cached helper CUDA calls."""
    import megatrain.kernels.attention as attention

    asked = []
    monkeypatch.setattr(attention, "_ask_sdpa", lambda q, k, v, mask, p, causal, dt: asked.append(dt) or True)
    monkeypatch.setattr(attention, "_GQA_CHECKS", {})
    q, k, v, _ = _gqa_inputs()
    for _ in range(5):
        assert attention._cached_needs_expansion(q, k, v, None, 0.0, True)
    assert len(asked) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention._cached_needs_expansion(q, k, v, None, 0.0, True)
    assert asked[-1] is torch.bfloat16, "under autocast the checks see the autocast dtype"
    attention._cached_needs_expansion(q, k, v, None, 0.0, False)
    attention._cached_needs_expansion(q[:1], k[:1], v[:1], None, 0.0, True)
    with torch.no_grad():
        attention._cached_needs_expansion(q, k, v, None, 0.0, True)
    assert len(asked) == 5
    attention._cached_needs_expansion(q.clone(), k.clone(), v.clone(), None, 0.0, True)
    assert len(asked) == 5, "new tensors of the same signature read the cached answer"


@pytest.mark.cuda
@requires_cuda
def test_fp32_gqa_on_cuda_expands_and_bf16_keeps_enable_gqa():
    """On CUDA: FP32 GQA needs the expansion (no fused kernel takes enable_gqa in FP32), and the
    expanded call is one the memory-efficient kernel accepts; under BF16 autocast flash takes GQA
    as it is. The CPU twins are the tests above."""
    q, k, v = (torch.randn(2, h, 16, 8, device="cuda") for h in (4, 2, 2))
    assert gqa_needs_expansion(q, k, v, is_causal=True)
    assert not gqa_needs_expansion(q, k, v, dropout_p=0.1, is_causal=True), "dropout keeps eager's math kernel"
    params = torch.backends.cuda.SDPAParams(q, expand_kv_heads(k, 4), expand_kv_heads(v, 4), None, 0.0, True, False)
    assert torch.backends.cuda.can_use_efficient_attention(params, True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert not gqa_needs_expansion(q, k, v, is_causal=True)


# -- config values: one error, on every transformers version -----------------------------------------

LLAMA = dict(model_type="llama", vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("change, named", [
    ({"hidden_size": "32"}, "hidden_size"), ({"hidden_size": 32.5}, "hidden_size"),
    ({"intermediate_size": None}, "intermediate_size"), ({"vocab_size": True}, "vocab_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be at least 1"),
    ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be at least 1"),
    ({"num_attention_heads": 5}, r"attention heads \(5\)|num_attention_heads=5 does not divide hidden_size=32"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"rope_theta": "fast"}, "rope_theta"), ({"rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"model_type": "gpt2", "n_layer": 0}, "n_layer=0 must be at least 1"),
], ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_an_invalid_model_config_value_is_one_error_naming_it(tmp_path, capsys, change, named):
    import json
    import re

    from megatrain.cli import main
    from megatrain.errors import ConfigError
    from megatrain.planner.presets import load_model_config

    cfg = {**LLAMA, **change} if change.get("model_type") != "gpt2" else \
        dict(model_type="gpt2", vocab_size=320, n_embd=32, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
             n_layer=change["n_layer"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*(" + named + ")"):
        load_model_config(path)
    assert main(["plan", "--model", str(path), "--hardware", "H100_SXM", "--seq-len", "32", "--global-batch", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err


def test_a_config_that_needs_the_directorys_own_code_is_refused_and_none_runs(tmp_path, monkeypatch):
    import json

    from megatrain.errors import ConfigError
    from megatrain.planner.presets import build_meta_model, load_model_config

    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked whether to run remote code"))
    (tmp_path / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    custom = {**LLAMA, "model_type": "evil", "auto_map": {"AutoConfig": "modeling_evil.EvilConfig",
                                                            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}
    (tmp_path / "config.json").write_text(json.dumps(custom))
    with pytest.raises(ConfigError, match=r"model_type 'evil' is defined only by the model directory's own Python "
                                          r"code \(modeling_evil.py\).*trust_remote_code=False"):
        load_model_config(tmp_path / "config.json")
    # A type transformers ships, with an auto_map left in (as many hub checkpoints have): its own class.
    (tmp_path / "config.json").write_text(json.dumps({**custom, "model_type": "llama"}))
    model = build_meta_model(load_model_config(tmp_path / "config.json"))
    assert type(model).__module__.startswith("transformers.models.llama")
