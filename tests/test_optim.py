"""Optimizers as data (megatrain.optim): Lion, the second host optimizer, exact against an eager
reference, planned with its own state bytes, checkpointed and resumed, and on the NVMe tier."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import megatrain
from megatrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatrain.errors import ConfigError, PlanError
from megatrain.optim import OPTIMIZERS, optimizer_settings, optimizer_spec
from megatrain.planner import cost
from megatrain.ir.plan import OptimizerPlacement, Plan
from megatrain.ir.schedule import Schedule
from megatrain.runtime.host_kernels import CHUNK_ELEMENTS, HostLion

from conftest import eager_train, random_batch, tiny_llama

RTOL = 1e-5
LION = dict(name="lion", lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
LION_SPEC = OPTIMIZERS["lion"]


class EagerLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, arXiv:2302.06675, Algorithm 2) in eager PyTorch, one tensor at a time,
    in the form of the widely used ``lion-pytorch`` package (``Lion.step``; not installed here): the
    reference megatrain's host kernel is checked against. (``sign`` is discontinuous at 0, so
    another rounding of ``beta1 * m + (1 - beta1) * g`` flips about one element in 10^6 whose
    interpolation is within an ulp of 0, by ``2 * lr``: the relative error stays far below 1e-5.)"""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = m.clone().mul_(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def eager_lion_losses(model, batches, max_grad_norm=None):
    opt = EagerLion(model.parameters(), lr=LION["lr"], betas=LION["betas"], weight_decay=LION["weight_decay"])
    return eager_train(model, batches, opt, max_grad_norm)


def batches(steps):
    return [random_batch(2, 16, 96, seed=s % 3) for s in range(steps)]


def lion_trainer(model, **kw):
    return megatrain.compile(model, seq_len=16, micro_batch_size=2, optimizer=LION, **kw)


def assert_same_weights(model, ref):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        err = ((p - q).norm() / q.norm()).item()
        assert err <= RTOL, f"{name}: relative difference {err:.2e}"


def test_the_specs_state_bytes_follow_their_rows():
    assert optimizer_spec("adamw").states == ("exp_avg", "exp_avg_sq")
    assert optimizer_spec("lion").states == ("exp_avg",)
    for spec in OPTIMIZERS.values():
        assert spec.state_bytes_per_param == 4 * len(spec.states)
    with pytest.raises(ConfigError, match=r"'sgd' is not one .*\['adamw', 'lion'\]"):
        optimizer_spec("sgd")
    with pytest.raises(ConfigError, match="invalid Lion settings: eps"):
        optimizer_settings({"name": "lion", "eps": 1e-8})  # Lion has no epsilon
    with pytest.raises(ConfigError, match="takes the settings, not an optimizer object"):
        optimizer_settings(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))
    assert optimizer_settings(None) == megatrain.AdamW()
    assert optimizer_settings(megatrain.Lion(lr=1e-4)) == optimizer_settings({"name": "LION", "lr": 1e-4})
    with pytest.raises(PlanError, match="optimizer_name='sgd'"):
        Plan(optimizer_name="sgd")


@pytest.mark.parametrize("grad_dtype, scaled", [(torch.float32, False), (torch.bfloat16, True)])
def test_host_lion_kernel_matches_the_eager_update_across_chunks(grad_dtype, scaled):
    # More elements than one chunk of the calling team, so the chunk loop's seams are crossed.
    n = CHUNK_ELEMENTS * torch.get_num_threads() * 2 + 37
    g = torch.Generator().manual_seed(0)
    p, m = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    grad = torch.randn(n, generator=g).to(grad_dtype)
    scale = torch.tensor(4.0) if scaled else None
    ref_p = p.clone().requires_grad_()
    opt = EagerLion([ref_p], lr=LION["lr"], betas=LION["betas"], weight_decay=LION["weight_decay"])
    opt.state[ref_p]["exp_avg"] = m.clone()
    ref_p.grad = grad.float() / (4.0 if scaled else 1.0)
    opt.step()
    step = torch.zeros(())
    HostLion().update(p, grad, [m], step, megatrain.Lion(**{k: v for k, v in LION.items() if k != "name"}),
                      grad_scale=scale)
    for got, want in ((p, ref_p.detach()), (m, opt.state[ref_p]["exp_avg"])):
        assert ((got - want).norm() / want.norm()).item() <= RTOL
    assert float(step) == 1.0
    with pytest.raises(ValueError, match="HostLion.update: exp_avg is torch.float64"):
        HostLion().update(p, grad, [m.double()], step, megatrain.Lion())


def test_lion_matches_eager_and_plans_its_own_bytes():
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    ref = copy.deepcopy(model)
    data = batches(8)
    trainer = lion_trainer(model)
    got = [trainer.step(b).loss for b in data]
    want = eager_lion_losses(ref, data)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: megatrain {a} vs eager Lion {b}"
    assert got[-1] < got[0]
    assert_same_weights(model, ref)
    # The plan and the host hold Lion's one moment: half of AdamW's optimizer-state bytes.
    plan = trainer.planned.plan
    assert plan.optimizer_name == "lion" and trainer.host.optimizer is LION_SPEC
    adamw = megatrain.plan_model(copy.deepcopy(ref), seq_len=16, micro_batch_size=2)
    trainable = sum(layer.trainable_numel for layer in trainer.graph.layers)
    assert trainer.planned.memory.adam_moments == trainable * LION_SPEC.state_bytes_per_param
    assert adamw.memory.adam_moments == trainable * OPTIMIZERS["adamw"].state_bytes_per_param
    assert (adamw.memory.host_total - trainer.planned.memory.host_total
            == trainable * (OPTIMIZERS["adamw"].state_bytes_per_param - LION_SPEC.state_bytes_per_param))
    assert trainer.host.nbytes == trainer.planned.memory.master_weights + trainer.planned.memory.adam_moments
    assert set(trainer.state_dict()["optimizer"]) == {f"{layer.name}.exp_avg" for layer in trainer.graph.layers}
    # Settings of another optimizer do not fit the host state.
    with pytest.raises(ConfigError, match="adamw settings for a trainer whose host state holds lion's"):
        trainer.set_optimizer(megatrain.AdamW())


def test_the_solver_plans_lion_with_its_own_bytes():
    model = tiny_llama(layers=2, device="meta")
    kw = dict(seq_len=16, micro_batch_size=2, hardware="H100_SXM")
    lion = megatrain.plan_model(model, optimizer_name="lion", **kw)
    adamw = megatrain.plan_model(model, **kw)
    trainable = sum(layer.trainable_numel for layer in lion.graph.layers)
    assert lion.plan.optimizer_name == "lion"
    assert adamw.memory.adam_moments - lion.memory.adam_moments == trainable * 4
    # The solver's own check (memory_breakdown == its scaled prediction) held for Lion's bytes.
    assert lion.solution is not None and lion.memory == cost.memory_breakdown(
        lion.graph, lion.plan, lion.hardware, lion.schedules.steady)
    # A host with less memory than AdamW's persistent state alone: the solver plans Lion there
    # (the tiny model's rings and pinned buffers take less than the 4 B/param Lion saves).
    adamw_state = cost.persistent_state_bytes(lion.graph, adamw.plan)
    assert adamw_state - cost.persistent_state_bytes(lion.graph, lion.plan) == trainable * 4
    tight = lion.hardware.model_copy(update={"host_memory_bytes": adamw_state - 1})
    assert megatrain.plan_model(model, optimizer_name="lion", seq_len=16, micro_batch_size=2,
                                hardware=tight).memory.host_total <= tight.host_memory_bytes
    with pytest.raises(megatrain.InfeasibleRequestError, match="Adam moments"):
        megatrain.plan_model(model, seq_len=16, micro_batch_size=2, hardware=tight)


def test_schedule_json_names_lion_and_keeps_adamw_files_as_they_were():
    model = tiny_llama(layers=2, device="meta")
    lion = megatrain.plan_model(model, seq_len=16, optimizer_name="lion")
    adamw = megatrain.plan_model(model, seq_len=16)
    assert '"optimizer_name"' not in adamw.schedules.steady.to_json()
    text = lion.schedules.steady.to_json()
    assert '"optimizer_name": "lion"' in text
    assert Schedule.from_json(text).plan == lion.plan
    assert Schedule.from_json(adamw.schedules.steady.to_json()).plan.optimizer_name == "adamw"


def test_a_plan_for_another_optimizer_is_refused():
    model = tiny_llama(layers=2)
    planned = megatrain.plan_model(model, seq_len=16)
    with pytest.raises(ConfigError, match=r"sizes adamw's optimizer state .* optimizer is lion"):
        megatrain.materialize(planned, LION)


def test_lion_checkpoint_resumes_exactly_and_refuses_adamw(tmp_path):
    torch.manual_seed(2)
    model = tiny_llama(layers=2)
    ref = copy.deepcopy(model)
    fresh = copy.deepcopy(model)
    data = batches(6)
    # Clipped gradients: the updates are deferred to the next step, so a save carries one.
    whole = lion_trainer(ref, max_grad_norm=1.0)
    want = [whole.step(b).loss for b in data]
    first = lion_trainer(model, max_grad_norm=1.0)
    for b in data[:3]:
        first.step(b)
    save_checkpoint(first, tmp_path / "ck")
    resumed = lion_trainer(fresh, max_grad_norm=1.0)
    load_checkpoint(resumed, tmp_path / "ck")
    got = [resumed.step(b).loss for b in data[3:]]
    assert got == want[3:]  # bitwise: the same state, the same kernel
    whole.flush()
    resumed.flush()
    for (name, p), (_, q) in zip(fresh.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name
    other = megatrain.compile(copy.deepcopy(fresh), seq_len=16, micro_batch_size=2, max_grad_norm=1.0)
    with pytest.raises(CheckpointError, match="holds lion's optimizer state but the trainer runs adamw"):
        load_checkpoint(other, tmp_path / "ck")


def test_lion_moments_and_masters_on_nvme_match_host_memory(tmp_path):
    torch.manual_seed(3)
    model = tiny_llama(layers=2)
    ref = copy.deepcopy(model)
    data = batches(4)
    plan = dataclasses.replace(Plan(), optimizer_name="lion")
    ram = lion_trainer(ref, plan=plan)
    trainable = [i for i, layer in enumerate(ram.graph.layers) if layer.trainable_numel]
    on_nvme = dataclasses.replace(plan, nvme_moments=frozenset(trainable[1:3]))
    nvme = lion_trainer(model, plan=on_nvme, nvme_dir=str(tmp_path))
    for b in data:
        assert nvme.step(b).loss == ram.step(b).loss
    assert_same_weights(model, ref)
    li = trainable[1]
    # The layer's file holds Lion's one moment row: 4 bytes per trainable parameter.
    assert nvme.host.read_moments(li).numel() == ram.graph.layers[li].trainable_numel
    torch.testing.assert_close(nvme.host.read_moments(li), ram.host.read_moments(li), rtol=0, atol=0)
    assert nvme.planned.memory.adam_moments == ram.planned.memory.adam_moments - sum(
        ram.graph.layers[i].trainable_numel * LION_SPEC.state_bytes_per_param for i in trainable[1:3])


def test_clipped_lion_matches_eager():
    # NEXT_FORWARD placement: the carried OPT divides the gradients by the clip factor (grad_scale).
    torch.manual_seed(4)
    model = tiny_llama(layers=2)
    ref = copy.deepcopy(model)
    data = batches(5)
    trainer = lion_trainer(model, max_grad_norm=0.5)
    assert trainer.plan.optimizer is OptimizerPlacement.NEXT_FORWARD
    got = [trainer.step(b).loss for b in data]
    trainer.flush()
    want = eager_lion_losses(ref, data, max_grad_norm=0.5)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: megatrain {a} vs eager Lion {b}"
    assert_same_weights(model, ref)


def test_train_config_and_help_choose_the_optimizer(capsys):
    from megatrain.cli import main
    from megatrain.train.config import TrainConfig

    cfg = TrainConfig(model="m", output_dir="o", optimizer="lion", lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.3)
    assert cfg.optimizer_settings() == megatrain.Lion(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.3)
    assert TrainConfig(model="m", output_dir="o").optimizer_settings() == megatrain.AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                                                          weight_decay=0.1)
    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--optimizer {adamw,lion}" in out and "arXiv:2302.06675" in out


def test_readme_lion_snippet_runs(capsys):
    from conftest import readme_snippet

    exec(compile(readme_snippet("## Optimizers: AdamW and Lion"), "README.md", "exec"), {})
    assert "Lion moments (FP32 x1)" in capsys.readouterr().out
