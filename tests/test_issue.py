"""The issue queue the CUDA backend and the simulator share, and the launch counts of the tracer."""

from __future__ import annotations

import pytest
import torch

from megatrain.ir.issue import DispatchCounter, IssueQueue
from megatrain.ir.schedule import Stream
from megatrain.ir.graph import retarget
from megatrain.planner.trace import trace

from conftest import tiny_llama

H, C, D, HOST, CAST = Stream.H2D, Stream.COMPUTE, Stream.D2H, Stream.HOST, Stream.CAST


def drain(q: IssueQueue, done) -> list:
    out = []
    while (i := q.next(done)) is not None:
        out.append(i)
    return out


def test_ops_without_host_deps_issue_in_list_order():
    q = IssueQueue()
    for i, (s, deps) in enumerate([(H, []), (C, [0]), (D, [1]), (HOST, [2])]):
        q.add(i, s, deps)
    assert drain(q, lambda h: False) == [0, 1, 2, 3]  # host ops are handed over at once
    assert not q.pending()


def test_an_op_gated_by_a_host_op_waits_and_its_stream_waits_behind_it():
    q = IssueQueue()
    q.add(0, CAST, [])
    q.add(1, H, [0])  # reads the staging tile the cast fills
    q.add(2, H, [])  # behind it on the same stream
    q.add(3, C, [])  # another stream: goes on
    q.add(4, C, [1])  # needs the pending copy's event
    done = set()
    assert drain(q, done.__contains__) == [0, 3]
    assert q.pending_ops() == [1, 2, 4]
    done.add(0)
    assert drain(q, done.__contains__) == [1, 2, 4]


def test_ready_pending_ops_go_first_lowest_index_first():
    q = IssueQueue()
    q.add(0, HOST, [])
    q.add(1, CAST, [])
    q.add(2, D, [0])
    q.add(3, H, [1])
    done = set()
    assert drain(q, done.__contains__) == [0, 1]
    done.update({0, 1})
    q.add(4, C, [])
    assert drain(q, done.__contains__) == [2, 3, 4]


def test_a_fenced_op_waits_until_its_fence_finished_and_other_streams_go_on():
    """A fence (Schedule.issue_after) is a GPU op that must have *finished*, not only been issued:
    the fenced op and its stream wait in the pending queue, other streams are issued meanwhile,
    and waiting_on names the fence a blocked caller can wait for."""
    q = IssueQueue()
    q.add(0, D, [])  # an OFFLOAD
    q.add(1, C, [], after=[0])  # a forward that reuses the checkpoint's memory
    q.add(2, C, [])  # behind it on the compute stream
    q.add(3, H, [])  # a weight copy: goes on
    done = set()
    assert drain(q, done.__contains__) == [0, 3]
    assert q.pending_ops() == [1, 2] and q.waiting_on(done.__contains__) == [0]
    done.add(0)
    assert drain(q, done.__contains__) == [1, 2] and q.waiting_on(done.__contains__) == []
    with pytest.raises(ValueError, match="not offered before"):
        q.add(4, C, [], after=[5])


def test_offering_out_of_order_is_an_error():
    q = IssueQueue()
    with pytest.raises(ValueError, match="not offered before"):
        q.add(0, C, [1])
    q.add(1, C, [])
    with pytest.raises(ValueError, match="offered twice"):
        q.add(1, C, [])


def test_trace_counts_each_templates_dispatched_ops():
    traced = trace(tiny_llama(layers=2), micro_batch_size=1, seq_len=8)
    g = traced.graph
    block = g.layers[1]
    assert 0 < block.fwd_launches < block.bwd_launches  # the local backward recomputes the forward
    assert g.layers[2].fwd_launches == block.fwd_launches  # identical blocks, one template
    # Cross-check on real CPU tensors: the count on meta is an upper estimate (meta has no fused
    # attention, so it counts the math decomposition), and the rest of the block is the same ops.
    fn = retarget(traced.templates[block.template], torch.device("cpu"))
    flat = torch.randn(block.numel)
    params = [flat[p.offset:p.offset + p.numel].view(p.shape) for p in block.params]
    ins = [torch.randn(g.values[v].shape, dtype=getattr(torch, g.values[v].dtype)) for v in block.inputs]
    with DispatchCounter() as c, torch.no_grad():
        fn(*params, *ins)
    assert 0 < c.count <= block.fwd_launches
    assert g.layers[0].fwd_launches < c.count, "the embedding layer dispatches far fewer ops than a block"
