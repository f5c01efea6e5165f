"""The guard of ``megatrain train`` (``megatrain.train.guard``): a step it does not keep leaves
nothing behind, with deferred updates (clipping: the update is dropped) and with updates during
backward (rolled back to the last checkpoint and replayed); updates that leave non-finite weights
are caught; loss spikes are skipped; a run of skipped steps stops with the last checkpoint kept.

Each run is ``megatrain train`` in this process on a tiny Llama (as tests/test_train_cli.py). A
run with a step not kept is compared, tensor for tensor, with the run whose step ``k`` never ran
(``_never_runs``): the guard's promise is exactly that run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import megatrain.runtime.executor as executor_module
from megatrain.cli import main
from megatrain.ir.schedule import OpKind
from megatrain.runtime.host_kernels import HostAdamW
from megatrain.train.guard import SPIKE_WINDOW, Guard
from megatrain.trainer import StepResult, Trainer

from train_runs import quick_matmul_probe, quick_probe, write_run  # noqa: F401 (an autouse fixture)



@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("guard"), lr=5.0e-3, warmup_steps=2, eval_interval=4, checkpoint_interval=2,
                     nonfinite="skip")


def run(setup: Path, out: Path, *extra: str) -> int:
    return main(["train", "--config", str(setup / "run.yaml"), "--output-dir", str(out),
                 "--data-cache", str(setup / "tokens"), *extra])


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def state(out: Path) -> dict[str, torch.Tensor]:
    ckpt = out / "checkpoint"
    return {**load_file(ckpt / "model.safetensors"), **load_file(ckpt / "megatrain_state" / "optimizer.safetensors")}


def assert_same_state(a: Path, b: Path) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _never_runs(monkeypatch, at: int) -> None:
    """Trainer.step whose ``at``-th call does not run: the previous step's deferred update is
    applied (as the step would have at its start) and a NaN loss is returned, so the guard skips
    it with nothing of its batch applied."""
    real, calls = Trainer.step, [0]

    def step(self, batch):
        calls[0] += 1
        if calls[0] != at:
            return real(self, batch)
        self.flush()
        return StepResult(step=self.step_count, loss=math.nan, micro_batch_losses=(math.nan,), tokens=1,
                          seconds=1.0, applied=False)

    monkeypatch.setattr(Trainer, "step", step)


def _once_at_step(monkeypatch, at: int) -> list[bool]:
    """A flag that is up while the ``at``-th call of Trainer.step runs (only the first time)."""
    real, calls, on = Trainer.step, [0], [False]

    def step(self, batch):
        calls[0] += 1
        on[0] = calls[0] == at
        try:
            return real(self, batch)
        finally:
            on[0] = False

    monkeypatch.setattr(Trainer, "step", step)
    return on


def test_a_gradient_found_non_finite_after_layers_took_the_update_is_rolled_back(setup, tmp_path, monkeypatch):
    """Without clipping each layer is updated as its gradients arrive; layer 0's come last. At step
    3 they are flagged non-finite, after every other layer took step 3's update: the run rolls back
    to step 2's checkpoint and goes on without step 3, exactly as the run that never ran it."""
    on = _once_at_step(monkeypatch, 3)
    real_opt = executor_module.HANDLERS[OpKind.OPT]

    def opt(ctx, i, op):
        work = real_opt(ctx, i, op)

        def run():
            if on[0] and op.layer == 0:
                ctx.ex._flags[0] = False  # as the D2H's finite check of a NaN gradient leaves it
            work()
        return run

    monkeypatch.setitem(executor_module.HANDLERS, OpKind.OPT, opt)
    rolled = tmp_path / "rolled"
    assert run(setup, rolled, "--max-grad-norm", "none", "--max-steps", "6") == 0
    r = rows(rolled)
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5, 6] and [x["applied"] for x in r] == [True, True, False] + [True] * 3
    monkeypatch.undo()
    quick_probe(monkeypatch)
    _never_runs(monkeypatch, 3)
    reference = tmp_path / "reference"
    assert run(setup, reference, "--max-grad-norm", "none", "--max-steps", "6") == 0
    assert_same_state(rolled, reference)
    monkeypatch.undo()
    quick_probe(monkeypatch)
    plain = tmp_path / "plain"
    assert run(setup, plain, "--max-grad-norm", "none", "--max-steps", "6") == 0
    assert not torch.equal(state(plain)["lm_head.weight"], state(reference)["lm_head.weight"])


@pytest.mark.parametrize("at", [3, 4], ids=["carried-into-the-next-step", "flushed-for-an-evaluation"])
def test_a_deferred_update_that_leaves_nan_weights_is_rolled_back(setup, tmp_path, monkeypatch, capsys, at):
    """With clipping step k's update runs at the start of step k + 1, or before the evaluation of
    step 4. A NaN in a master it wrote (finite gradients can diverge) makes the run roll back
    and leave step k out."""
    if at == 3:
        on = _once_at_step(monkeypatch, at + 1)
    else:
        real_flush, on, fired = Trainer.flush, [False], [False]

        def flush(self):
            on[0] = self.step_count == at and not fired[0]
            fired[0] |= on[0]
            try:
                return real_flush(self)
            finally:
                on[0] = False

        monkeypatch.setattr(Trainer, "flush", flush)
    real_step = HostAdamW.step

    def step(self, param, *args, **kw):
        total = real_step(self, param, *args, **kw)
        if on[0]:
            param[0] = math.nan
            total = param.sum()  # what the kernel would have summed
        return total

    monkeypatch.setattr(HostAdamW, "step", step)
    rolled = tmp_path / "rolled"
    assert run(setup, rolled, "--max-steps", "6") == 0
    out = capsys.readouterr().out
    assert f"step {at}: its update made the weights of" in out and "rolled back to the checkpoint of step 2" in out
    assert [x["applied"] for x in rows(rolled)] == [x != at for x in range(1, 7)]
    monkeypatch.undo()
    quick_probe(monkeypatch)
    _never_runs(monkeypatch, at)
    reference = tmp_path / "reference"
    assert run(setup, reference, "--max-steps", "6") == 0
    assert_same_state(rolled, reference)


@pytest.mark.parametrize("clip", ["1.0", "none"], ids=["deferred-dropped", "during-backward-rolled-back"])
def test_a_loss_spike_is_not_kept(setup, tmp_path, monkeypatch, capsys, clip):
    k = SPIKE_WINDOW + 2
    on = _once_at_step(monkeypatch, k)
    real_run = executor_module.Executor.run

    def run_spiking(self, schedule, micro_batches, *args, **kwargs):
        out = real_run(self, schedule, micro_batches, *args, **kwargs)
        if on[0] and schedule.mode == "train":
            out.losses = [x * 10 for x in out.losses]
        return out

    monkeypatch.setattr(executor_module.Executor, "run", run_spiking)
    args = ("--max-grad-norm", clip, "--max-steps", str(k + 1), "--loss-spike", "3", "--eval-interval", "0",
            "--checkpoint-interval", str(k - 1))
    spiked = tmp_path / "spiked"
    assert run(setup, spiked, *args) == 0
    assert f"step {k}: the loss, " in capsys.readouterr().out
    assert [x["step"] for x in rows(spiked) if not x["applied"]] == [k]
    monkeypatch.undo()
    quick_probe(monkeypatch)
    _never_runs(monkeypatch, k)
    reference = tmp_path / "reference"
    assert run(setup, reference, *args) == 0
    assert_same_state(spiked, reference)


@pytest.mark.parametrize("clip", ["none", "1.0"])
def test_a_diverged_run_stops_with_its_last_finite_checkpoint(setup, tmp_path, capsys, clip):
    """The issue's run: lr 1e6 makes every step after the first non-finite. It used to end "done ...
    19 skipped steps", exit 0, with NaN weights saved; now it stops after 3 in a row, exit 2."""
    out = tmp_path / "o"
    assert run(setup, out, "--lr", "1e6", "--max-grad-norm", clip, "--max-steps", "20",
               "--max-consecutive-skips", "3") == 2
    err = capsys.readouterr().err
    assert "error: 3 steps in a row were not kept" in err and "the run diverged" in err and "Traceback" not in err
    assert "holds step 0: the same command resumes from it" in err
    assert all(torch.isfinite(t).all() for t in state(out).values())


def test_the_guard_judges_by_the_plan(setup):
    """Table: what each result gets under deferred updates and updates during backward."""
    layers = [type("L", (), {"name": f"layer{i}"})() for i in range(3)]
    ok = StepResult(step=1, loss=2.0, micro_batch_losses=(2.0,), tokens=1, seconds=1.0)
    nan = dataclasses.replace(ok, loss=math.nan, applied=False)
    partial = dataclasses.replace(ok, grad_norm=math.inf, applied=False, updated_layers=(2,), skipped_layers=(0, 1))
    for deferred in (True, False):
        g = Guard(deferred=deferred, loss_spike=2.0)
        assert g.judge(5, ok, (), layers).action == "keep"
        assert g.judge(5, nan, (), layers).action == "skip"
        bad = g.judge(5, ok, (1,), layers)
        assert (bad.action, bad.blame) == ("rollback", 4 if deferred else 5) and "layer1" in bad.why
        for _ in range(SPIKE_WINDOW - 1):
            g.keep(1.0)
        assert g.judge(5, dataclasses.replace(ok, loss=9.0), (), layers).action == "keep"  # the window is not full
        g.keep(1.0)
        spike = g.judge(5, dataclasses.replace(ok, loss=2.5), (), layers)
        assert spike.action == ("skip" if deferred else "rollback") and "2.5x the mean" in spike.why
        assert g.judge(5, dataclasses.replace(ok, loss=1.9), (), layers).action == "keep"
    assert Guard(deferred=False, loss_spike=None).judge(5, partial, (), layers).action == "rollback"
    g = Guard(deferred=True, loss_spike=None)
    g.keep(1.0)
    g.in_a_row, g.not_kept = 2, {3: "a", 7: "b"}
    g.restore(g.state(), 5)
    assert g.not_kept == {7: "b"} and g.in_a_row == 2 and list(g.window) == [1.0]


@pytest.mark.parametrize("clip", [None, 1.0], ids=["during-backward", "deferred"])
def test_a_step_names_the_layers_its_update_left_non_finite(clip):
    """lr x weight_decay = 1e40 overflows: finite gradients, infinite weights. The trainer's check
    of the updated masters reports them (Python API); during backward the later layers are then
    not updated, and the step is not applied."""
    import megatrain
    from conftest import random_batch, tiny_llama

    torch.manual_seed(0)
    trainer = megatrain.compile(tiny_llama(), seq_len=16, micro_batch_size=2, max_grad_norm=clip,
                                optimizer=megatrain.AdamW(lr=1e30, weight_decay=1e10))
    res = trainer.step(random_batch(2, 16, 96, seed=0))
    n = len(trainer.graph.layers)
    if clip is None:
        last = n - 1  # the LM head's gradients arrive first, and its update is the first to diverge
        assert res.nonfinite_weights == (last,) and not res.applied
        assert res.updated_layers == (last,) and res.skipped_layers == tuple(range(n - 2, -1, -1))
    else:
        assert res.applied and res.nonfinite_weights == ()  # the update waits for the next step
        assert set(trainer.flush()) == set(range(n))
