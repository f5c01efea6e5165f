"""megatrain as a VERL training backend (megatrain.rl.verl, the ``verl`` extra): registered in VERL's
EngineRegistry, log-probs as VERL's engines give them, a step on VERL's own ppo_loss equal to eager
PyTorch + torch.optim.AdamW on the whole batch (FP32, 1e-5), weights out by name. Runs where VERL
imports (skipped otherwise: the project's environment does not install it)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

verl = pytest.importorskip("verl", reason="VERL is the optional megatrain[verl] extra")
warnings.filterwarnings("ignore")

from tensordict import TensorDict  # noqa: E402
from verl.workers.config.actor import ActorConfig  # noqa: E402
from verl.workers.config.optimizer import OptimizerConfig  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from megatrain.errors import BatchError  # noqa: E402
from megatrain.rl.verl import MegatrainEngine, MegatrainEngineConfig  # noqa: E402

from conftest import tiny_llama  # noqa: E402

B, P, R, SEQ = 4, 6, 5, 16


def _batch(seed: int = 0) -> TensorDict:
    """A rollout batch as VERL's trainer hands it to the actor: prompts left-padded, responses
    right-padded, then VERL's own left_right_2_no_padding."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 96, (B, P), generator=g)
    responses = torch.randint(1, 96, (B, R), generator=g)
    pmask = torch.ones(B, P, dtype=torch.long)
    pmask[0, :2] = 0
    pmask[3, :1] = 0
    rmask = torch.ones(B, R, dtype=torch.long)
    rmask[1, 3:] = 0
    rmask[2, 4:] = 0
    attn = torch.cat([pmask, rmask], 1)
    data = TensorDict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                       "attention_mask": attn, "response_mask": rmask, "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
                       "old_log_probs": -torch.rand(B, R, generator=g) * 5, "advantages": torch.randn(B, R, generator=g)},
                      batch_size=[B])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, global_batch_size=B)
    return data


def _engine(model, micro_batch_size=2, lr=1e-2, micro_batches=None):
    cls = EngineRegistry.get_engine_cls("language_model", "megatrain")
    assert cls is MegatrainEngine
    engine = EngineRegistry.new("language_model", "megatrain", model_config=None,
                                engine_config=MegatrainEngineConfig(seq_len=SEQ, micro_batch_size=micro_batch_size,
                                                                    micro_batches=micro_batches or B // micro_batch_size,
                                                                    device="cpu"),
                                optimizer_config=OptimizerConfig(lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                                                 clip_grad=0.0),
                                checkpoint_config=None, model=model)
    engine.initialize()
    return engine


def _eager_log_probs(model, data):
    """VERL's alignment: log_probs[t] is the log-probability of token t + 1; the last position 0."""
    rows = data["input_ids"].unbind()
    out = []
    for r in rows:
        logits = model(input_ids=r[None]).logits[0].float()
        lp = F.log_softmax(logits[:-1], -1).gather(-1, r[1:, None]).squeeze(-1)
        out.append(torch.cat([lp, lp.new_zeros(1)]))
    return torch.nested.nested_tensor_from_jagged(torch.cat(out), offsets=data["input_ids"].offsets())


def test_log_probs_are_verls_alignment_of_eager():
    torch.manual_seed(0)
    model = tiny_llama()
    eager = copy.deepcopy(model)
    engine = _engine(model)
    data = _batch()
    got = engine.infer_batch(data)["model_output"]["log_probs"]
    with torch.no_grad():
        want = _eager_log_probs(eager, data)
    assert torch.equal(got.offsets(), want.offsets())
    # the last position of each row is no prediction (VERL leaves it to the roll); compare the rest
    for g, w in zip(got.unbind(), want.unbind()):
        torch.testing.assert_close(g[:-1], w[:-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_a_step_on_verls_ppo_loss_is_eager_adamw_on_the_whole_batch(micro_batch_size):
    torch.manual_seed(0)
    model = tiny_llama()
    eager = copy.deepcopy(model)
    engine = _engine(model, micro_batch_size)
    # eps far below every gradient of this tiny model, so that the comparison is well-conditioned (as
    # tests/test_exactness.py's ADAMW; at 1e-8 a weight whose gradient is ~1e-8 moves by its rounding)
    engine.trainer.set_optimizer(engine.trainer.optimizer.model_copy(update={"eps": 1e-16}))
    config = ActorConfig(strategy="fsdp", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=micro_batch_size,
                         use_dynamic_bsz=False, rollout_n=1)
    loss_fn = lambda model_output, data, dp_group=None: ppo_loss(config, model_output, data, dp_group)  # noqa: E731
    data = _batch()
    out = engine.train_batch(data, loss_fn)
    # eager: VERL's ppo_loss on the whole batch's log-probabilities, backward, torch.optim.AdamW
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-16)
    ref = _batch()
    tu.assign_non_tensor(ref, batch_num_tokens=int(ref["loss_mask"].sum()), dp_size=1)
    loss, metrics = ppo_loss(config, {"log_probs": _eager_log_probs(eager, ref)}, ref)
    loss.backward()
    opt.step()
    assert out["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert "actor/pg_clipfrac" in out["metrics"] and out["metrics"]["grad_norm"] > 0
    weights = dict(engine.get_per_tensor_param()[0])
    for name, p in eager.named_parameters():
        got = engine.trainer.state_dict()["model"][name]
        torch.testing.assert_close(got, p.detach(), rtol=1e-5, atol=1e-6)
        assert weights[name].dtype == torch.bfloat16 and weights[name].shape == p.shape


def test_a_batch_of_another_shape_is_one_error_and_no_update():
    torch.manual_seed(0)
    engine = _engine(tiny_llama(), micro_batch_size=1, micro_batches=2)  # 2 rows a step; the batch has 4
    before = {k: v.clone() for k, v in engine.trainer.state_dict()["model"].items()}
    config = ActorConfig(strategy="fsdp", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1,
                         use_dynamic_bsz=False, rollout_n=1)
    data = _batch()
    with pytest.raises(BatchError, match="4 rows, but this engine trains batches of"):
        engine.train_batch(data, lambda model_output, data, dp_group=None: ppo_loss(config, model_output, data))
    after = engine.trainer.state_dict()["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)
